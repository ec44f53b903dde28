"""Tests for rollout.OpenAIEngine against a local stand-in of `vllm serve`'s completions API.

The stand-in (standard library http.server) answers with a TorchEngine over a tiny model, so whatever
the client gets can be compared with calling that TorchEngine directly: same ids, same log-probs, and the
same token-exact agent trajectories. It also speaks the older reply shape (ids only as "token_id:N"
strings), can leave the stop token out, and can fail, to test retries and error messages.
"""
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from agent import AgentConfig, run_episodes
from model import ModelConfig, init_model
from rollout import OpenAIEngine, SamplingParams, TorchEngine, row_seeds
from test_agent import CalcEnv, calc_task, tok  # noqa: F401 (tok is a fixture)

PAD = 0
PROMPTS = [[5, 9, 3, 7, 11, 2, 8], [4], [13, 6, 6, 1]]


def tiny_model(vocab: int, seed: int = 0):
    cfg = ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = init_model(cfg, seed)
    with torch.no_grad():   # peaked logits: no near-ties under greedy decoding
        g = torch.Generator().manual_seed(seed + 1)
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


class FakeServer:
    """POST /v1/completions -> TorchEngine.generate([prompt], ...). mode: "ids" (token_ids field), "legacy"
    ("token_id:N" strings only), "drop_stop" (stop token left out, named in stop_reason)."""

    def __init__(self, engine: TorchEngine, mode: str = "ids", fail_first: int = 0, status: int = 500):
        self.engine, self.mode, self.fail_left, self.status = engine, mode, fail_first, status
        self.requests, self.lock = [], threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append(body)
                    if server.fail_left > 0:
                        server.fail_left -= 1
                        self.send_response(server.status)
                        self.end_headers()
                        self.wfile.write(b'{"error": "model overloaded"}')
                        return
                    reply = server.answer(body)
                data = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def answer(self, body: dict) -> dict:
        assert self.httpd and body["return_token_ids"] and body["return_tokens_as_token_ids"]
        assert body["skip_special_tokens"] is False and all(isinstance(t, int) for t in body["prompt"])
        params = SamplingParams(n=body["n"], temperature=body["temperature"], top_p=body["top_p"],
                                max_tokens=body["max_tokens"], stop_token_ids=tuple(body["stop_token_ids"]),
                                seed=body.get("seed"))
        choices = []
        for i, g in enumerate(self.engine.generate([body["prompt"]], params)):
            ids, lps = list(g.token_ids), list(g.logprobs)
            stop_reason = ids[-1] if g.finish_reason == "stop" else None
            if self.mode == "drop_stop" and stop_reason is not None:
                ids, lps = ids[:-1], lps[:-1]
            choice = {"index": i, "text": "", "finish_reason": g.finish_reason, "stop_reason": stop_reason,
                      "logprobs": {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": lps}}
            if self.mode == "ids":
                choice["token_ids"] = ids
            choices.append(choice)
        return {"id": "cmpl-1", "object": "text_completion", "model": body["model"], "choices": choices}

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def engine():
    return TorchEngine(tiny_model(64), PAD)


@pytest.mark.parametrize("mode", ["ids", "legacy", "drop_stop"])
def test_same_tokens_and_logprobs_as_the_engine_behind_it(engine, mode):
    server = FakeServer(engine, mode)
    try:
        client = OpenAIEngine(server.url, model="tiny")
        stop = (engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=6))[0].token_ids[3],)
        greedy = SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=stop)
        direct = engine.generate(PROMPTS, greedy)
        remote = client.generate(PROMPTS, greedy)
        assert [g.token_ids for g in remote] == [g.token_ids for g in direct]
        assert remote[0].finish_reason == "stop" and remote[0].token_ids[-1] == stop[0]
        for r, d in zip(remote, direct):
            want = d.logprobs[:-1] + [0.0] if (mode == "drop_stop" and d.finish_reason == "stop") else d.logprobs
            assert r.logprobs == pytest.approx(want, abs=1e-4)   # a row batched with others vs alone: float32 sums differ

        # sampling: n per prompt, prompt-major, and prompt i's seed is row_seeds(seed, 3)[i]
        sampled = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=11)
        remote = client.generate(PROMPTS, sampled)
        assert len(remote) == 9
        for i, (p, seed) in enumerate(zip(PROMPTS, row_seeds(11, len(PROMPTS)))):
            ref = engine.generate([p], SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=seed))
            assert [g.token_ids for g in remote[3 * i:3 * i + 3]] == [g.token_ids for g in ref]
    finally:
        server.close()


def test_agent_trajectories_are_token_exact_across_engines(tok):
    model = tiny_model(tok.get_vocab_size(), seed=3)
    torch_engine = TorchEngine(model, PAD)
    server = FakeServer(torch_engine)
    try:
        tasks = [calc_task(0, 2, 3), calc_task(1, 40, 17)]
        cfg = AgentConfig(n_samples=2, max_turns=3, max_total_tokens=400)
        params = SamplingParams(temperature=0.0, max_tokens=24)
        a = run_episodes(torch_engine, {"calc": CalcEnv()}, tasks, tok, cfg, params, seed=0)
        b = run_episodes(OpenAIEngine(server.url, "tiny"), {"calc": CalcEnv()}, tasks, tok, cfg, params, seed=0)
        assert sum(t.num_turns for t in a) >= 4
        for x, y in zip(a, b):
            assert (x.token_ids, x.loss_mask, x.messages, x.finish_reason) == (y.token_ids, y.loss_mask, y.messages,
                                                                                y.finish_reason)
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)   # a row batched with others vs alone: float32 sums differ
    finally:
        server.close()


def test_retries_server_errors_and_reports_client_errors(engine):
    server = FakeServer(engine, fail_first=2, status=503)
    try:
        out = OpenAIEngine(server.url, "tiny", retries=2).generate([PROMPTS[1]], SamplingParams(max_tokens=3, seed=0))
        assert len(out) == 1 and len(server.requests) == 3          # two failures, then the answer
        server.fail_left, server.status = 1, 400
        with pytest.raises(RuntimeError, match="HTTP 400: .*model overloaded"):
            OpenAIEngine(server.url, "tiny", retries=2).generate([PROMPTS[1]], SamplingParams(max_tokens=3))
        assert len(server.requests) == 4                             # a 4xx is not retried
    finally:
        server.close()


def test_unreachable_server_and_weight_push_fail_clearly():
    with socket.socket() as s:                                       # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = OpenAIEngine(f"http://127.0.0.1:{port}/v1", "tiny", retries=0, timeout_s=2)
    with pytest.raises(RuntimeError, match="cannot reach"):
        client.generate([[1, 2]], SamplingParams(max_tokens=2))
    with pytest.raises(NotImplementedError, match="rollout.engine=torch"):
        client.update_weights({})


def test_training_refuses_the_openai_engine_before_building_anything(tmp_path):
    from config import load_config
    from train import main
    cfg = load_config(None, [f"out_dir={tmp_path}", "rollout.engine=openai", "wandb=false"])
    with pytest.raises(ValueError, match="cannot train"):
        main(cfg)
    assert not (tmp_path / "toy_math" / "metrics.jsonl").exists()
