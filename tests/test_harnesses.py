"""End to end with the agent harnesses people train in, run unchanged against wings.serve
(issue 45): Claude Code (Anthropic's Messages API), Codex (OpenAI's Responses API) and Qwen Code
(OpenAI's chat completions), each the version harnesses/package.json pins, launched headless as a
training run launches them (examples/harness_agent.py's launch).

Oracles: the harness itself (it exits 0, prints the scripted final answer, and its shell tool
really ran the command: the command's output, which its text does not contain, is in the next
request's prompt); the server's own answers (every request answered 200: none refused); the capture
(each row of the session holds exactly the ids the engine was given and sampled, token for token);
learner.train_step (one update on the rows, a finite loss).

Slow tier: each test starts a harness process (1-10 s) whose prompts are 25k-60k tokens (each
harness's own system prompt and tool schemas). Outside CI a harness that is not installed skips its
tests (bash setup.sh test installs all three); in CI it is an error (conftest's `need`).
"""

import dataclasses
import glob
import math
import os
import shutil
import sys

import pytest
import torch
from tokenizers import Tokenizer

from batch import to_batch
from chat import encode
from conftest import IN_CI
from learner import LearnerConfig, TrainBatch, make_learner, train_step
from rollout import Generation, TorchEngine
from tool_calls import tool_call_text
from wings.capture import session_trajectories
from wings.serve import Server
from wings.serve_http import RequestError
from test_agent import train_bpe
from test_openai_engine import tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import harness_agent  # noqa: E402 (examples/ is not a package)

pytestmark = pytest.mark.slow

HARNESSES = ["claude_code", "codex", "qwen_code"]
# the endpoint each one's requests are recorded under (capture.Call.endpoint)
ENDPOINTS = {"claude_code": "messages", "codex": "responses", "qwen_code": "chat"}
# each harness's shell tool, and its arguments for a command
SHELLS = {
    "claude_code": lambda command: {"name": "Bash", "arguments": {"command": command}},
    "codex": lambda command: {"name": "exec_command", "arguments": {"cmd": command}},
    "qwen_code": lambda command: {"name": "run_shell_command", "arguments": {"command": command}},
}
COMMAND = "echo harness-$((6 * 7))-ran"
# what COMMAND prints: a prompt holds it only once the command has run
OUTPUT = "harness-42-ran"
FINAL = "Done: the shell answered."
PROMPT = "Run the command the model asks for."
SESSION = "harness/0/0"
TIMEOUT_S = 240.0


def need_harness(harness: str, tmp_path):
    """Skip (outside CI) or fail (in CI) a test whose harness is not installed. (Building a command
    writes the harness's settings into the HOME it is given: a folder of its own, not the working
    folder, where Qwen Code and Codex would read them as the project's settings.)"""
    probe = tmp_path / "probe-home"
    argv, _ = harness_agent.COMMANDS[harness]("", "http://x/v1", "s", str(probe), None)
    missing = [p for p in (argv[0], shutil.which("node")) if not p or not os.path.exists(p)]
    if missing:
        why = f"{harness} is not installed ({argv[0]}, and Node.js); bash setup.sh test installs it"
        if IN_CI:
            pytest.fail(why)
        pytest.skip(why)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """Byte-level BPE (any text encodes, and decodes back) with Qwen's chat tokens, trained on this
    repository's docs: English and code like the harnesses' prompts, at ~2.7 characters a token
    (the 800-token `tok` of test_agent.py takes ~1.4: twice the tokens)."""
    texts = [open(p).read() for p in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
    return train_bpe(texts, 4000)


class HarnessEngine:
    """A scripted model for one harness: until the prompt holds OUTPUT, a call of the harness's
    shell tool running COMMAND (the <tool_call> block the server parses); then FINAL. Keeps every
    prompt it was given with what it answered."""

    def __init__(self, tok: Tokenizer, harness: str):
        self.tok = tok
        self.call = tool_call_text(SHELLS[harness](COMMAND))
        self.replies: dict[tuple, list[int]] = {}

    def generate(self, prompts, params):
        out = []
        for p in prompts:
            text = self.tok.decode(p, skip_special_tokens=False)
            reply = FINAL if OUTPUT in text else self.call
            ids = encode(self.tok, reply + "<|im_end|>")[: params.max_tokens]
            self.replies[tuple(p)] = ids
            logprobs = [-(t + 1) / 1000.0 for t in ids]
            out.append(Generation(token_ids=ids, logprobs=logprobs, finish_reason="stop"))
        return out


class AnsweredServer(Server):
    """A Server that keeps (method, path, status, error message) of every request it answers."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.answers = []

    async def handle(self, request):
        try:
            out = await super().handle(request)
        except RequestError as e:
            self.answers.append((request.method, request.path, e.status, e.message))
            raise
        except Exception as e:
            self.answers.append((request.method, request.path, 500, repr(e)))
            raise
        self.answers.append((request.method, request.path, 200, ""))
        return out


def play(harness, server, tmp_path, max_tokens=None):
    """The harness, headless, against the server in tmp_path -> its finished process."""
    server.start()
    try:
        return harness_agent.launch(
            harness, PROMPT, server.url, SESSION, str(tmp_path), max_tokens, TIMEOUT_S
        )
    finally:
        server.stop()


def assert_answered(server, out):
    refused = [a for a in server.answers if a[2] != 200]
    assert not refused, f"refused: {refused}\nstderr: {out.stderr[-3000:]}"


# -----------------------------------------------------------------------------
# a scripted two-turn tool session, captured and trained


@pytest.mark.parametrize("harness", HARNESSES)
def test_a_harness_plays_a_tool_session_that_trains_token_for_token(harness, tok, tmp_path):
    need_harness(harness, tmp_path)
    engine = HarnessEngine(tok, harness)
    server = AnsweredServer(engine, tok, "tiny", max_model_len=1 << 17)
    out = play(harness, server, tmp_path)
    assert_answered(server, out)
    assert out.returncode == 0, out.stderr[-3000:]
    assert FINAL in out.stdout

    calls = server.capture.calls(SESSION)
    assert [c.endpoint for c in calls] == [ENDPOINTS[harness]] * 2
    # the shell tool ran the command: its output came back in the second request only
    first, second = (tok.decode(c.prompt_ids, skip_special_tokens=False) for c in calls)
    assert OUTPUT not in first and OUTPUT in second

    # one row (the second request continues the first, token for token), the engine's own: each
    # run of sampled tokens (mask 1) is what the engine answered to exactly the ids before it, and
    # the two replies are all that is sampled
    rows, metrics = session_trajectories(calls, SESSION)
    assert len(rows) == 1 and metrics["serve/branched"] == 0.0, metrics
    replies = 0
    for row in rows:
        mask = row.loss_mask
        starts = [i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])]
        for s in starts:
            reply = engine.replies[tuple(row.token_ids[:s])]
            assert row.token_ids[s : s + len(reply)] == reply
            assert row.logprobs[s : s + len(reply)] == [-(t + 1) / 1000.0 for t in reply]
            assert mask[s : s + len(reply)] == [1] * len(reply)
        assert sum(mask) == sum(len(engine.replies[tuple(row.token_ids[:s])]) for s in starts)
        replies += len(starts)
    assert replies == 2

    # and they train: one update of a tiny model long enough for them
    batch = to_batch([dataclasses.replace(r, reward=1.0) for r in rows], pad_id=0)
    model = tiny_model(tok.get_vocab_size(), 0, max_position_embeddings=1 << 17)
    cfg = LearnerConfig(micro_batch_size=1, max_tokens_per_micro_batch=1 << 17)
    state = make_learner(model, cfg, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    train = TrainBatch(
        batch.input_ids,
        batch.loss_mask,
        advantages=batch.loss_mask.clone(),  # (B, T)
        engine_logprobs=batch.logprobs,
        old_from_update=True,
    )
    state, m = train_step(state, train, cfg)
    assert m["train/updates"] == 1 and math.isfinite(m["train/pg_loss"])
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


# -----------------------------------------------------------------------------
# the same on a real model with a long context


@pytest.mark.parametrize("harness", HARNESSES)
def test_every_request_of_a_harness_is_answered_by_a_long_context_model(harness, tok, tmp_path):
    """A tiny torch model made long enough for the harness's prompts (RoPE has no length of its
    own: max_position_embeddings only sizes the cache), replies capped at 8 tokens (the harness's
    own switch where it has one, else the server's default): its text is nonsense, so what is
    checked is the server's side: every request answered 200 and recorded."""
    need_harness(harness, tmp_path)
    model = tiny_model(tok.get_vocab_size(), 0, max_position_embeddings=1 << 17).eval()
    server = AnsweredServer(TorchEngine(model, 0), tok, "tiny", default_max_tokens=8)
    out = play(harness, server, tmp_path, max_tokens=8)
    assert_answered(server, out)
    sampled = [a for a in server.answers if a[0] == "POST"]
    calls = server.capture.calls(SESSION)
    assert sampled and len(calls) == len(sampled), (server.answers, out.stderr[-3000:])
    assert {c.endpoint for c in calls} == {ENDPOINTS[harness]}
    assert all(0 < len(s.token_ids) <= 8 for c in calls for s in c.samples)
