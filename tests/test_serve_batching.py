"""Tests for batcher.py: the requests in flight share the engine's forward passes, each sampled with
its own seed.

Oracles: rollout.sample_tokens (sample_rows is it with the draw passed in: the same tokens,
log-probs and kept sizes to the bit); TorchEngine.generate (a request alone in the batch is that
call, to the bit; a request in a shared batch gives the same tokens, its log-probs within float
rounding). No timed assertion: the speed is bench/serve.py's.
"""

import copy
import json
import threading
import time
import urllib.request

import pytest
import torch

from rollout import SamplingParams, TorchEngine, sample_tokens
from wings.batcher import Scheduler, batchable, sample_rows
from wings.serve import Server
from test_agent import ScriptedEngine, tok  # noqa: F401 (a fixture)
from test_openai_engine import tiny_model

# ids the tiny model emits now and then: some samples stop early
STOPS = (7, 11, 13, 200, 201, 202, 203)


@pytest.fixture(scope="module")
def engine(tok):
    return TorchEngine(tiny_model(tok.get_vocab_size(), 0).eval(), 0)


@pytest.fixture
def scheduler(engine):
    s = Scheduler(engine)
    s.start()
    yield s
    s.stop()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(1, 500, (int(torch.randint(3, 40, (), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


class Counting:
    """Wraps a ContinuousBatch's step to record how many rows each step sampled (whether requests
    shared steps)."""

    def __init__(self, batch):
        self.rows, self.step = [], batch.step
        batch.step = self

    def __call__(self):
        self.rows.append(len(self.step.__self__.rows))
        self.step()


@pytest.mark.parametrize("kind", ["plain", "truncated", "greedy"])
def test_sample_rows_is_sample_tokens_with_the_draw_passed_in(kind):
    temperature, top_p, top_k = {
        "plain": (1.0, 1.0, 0),
        "truncated": (0.7, 0.9, 20),
        "greedy": (0.0, 1.0, 0),
    }[kind]
    logits = 3 * torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    for seed in range(5):
        want = sample_tokens(logits, temperature, top_p, torch.Generator().manual_seed(seed), top_k)
        draws = torch.empty(6, 300).exponential_(1, generator=torch.Generator().manual_seed(seed))
        got = sample_rows(logits, temperature, top_p, top_k, draws if temperature > 0 else None)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert (got[2] is None) == (want[2] is None) and (
            got[2] is None or torch.equal(got[2], want[2])
        )


def test_which_engines_are_batched(engine, tok):
    from wings.async_rollouts import ConcurrentEngine

    assert batchable(engine) and not batchable(ScriptedEngine(tok, {}))
    # its hooks take pushes mid-generation
    assert not batchable(ConcurrentEngine(engine.model, pad_id=0))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=3, temperature=1.0, max_tokens=20, seed=5, stop_token_ids=STOPS),
        SamplingParams(
            n=4, temperature=0.8, top_k=20, top_p=0.9, max_tokens=20, seed=6, stop_token_ids=STOPS
        ),
        SamplingParams(n=2, temperature=0.0, max_tokens=20, stop_token_ids=STOPS),
        SamplingParams(n=1, temperature=1.0, max_tokens=1, seed=7),
    ],
)
def test_a_lone_request_is_the_engines_own_call_to_the_bit(engine, scheduler, params):
    """n samples with finished rows riding along until a quarter of them is done, each request's
    generator drawn as TorchEngine draws its call's: ids, log-probs, kept sizes and finish reasons
    equal, bit for bit."""
    for p in prompts(4):
        alone = engine.generate([p], params)
        got = scheduler.submit(p, params).future.result(timeout=120)
        assert [g.token_ids for g in got] == [g.token_ids for g in alone]
        assert [g.logprobs for g in got] == [g.logprobs for g in alone]
        assert [g.kept_sizes for g in got] == [g.kept_sizes for g in alone]
        assert [g.finish_reason for g in got] == [g.finish_reason for g in alone]
        assert all(g.versions == [0] * len(g.token_ids) for g in got)


def test_a_seeded_request_gives_the_same_tokens_whatever_shares_its_batch(engine, scheduler):
    """Twelve requests with their own prompts, n, temperature, top-k, lengths and seeds, most of
    them joining while the first generates: each gets the tokens it gets alone; the log-probs agree
    to float rounding (a batched matrix product rounds unlike a lone one)."""
    counting = Counting(scheduler.batch)
    ps = prompts(12, seed=1)
    params = [
        SamplingParams(
            n=1 + i % 3,
            temperature=[1.0, 0.7, 0.0][i % 3],
            top_k=[0, 10, 0][i % 3],
            max_tokens=30 if i == 0 else 4 + 2 * i,
            seed=100 + i,
            stop_token_ids=STOPS,
        )
        for i in range(12)
    ]
    first_tokens = threading.Event()
    jobs = [scheduler.submit(ps[0], params[0], on_tokens=lambda new: first_tokens.set())]
    assert first_tokens.wait(120)  # the first request is generating: the others join it
    jobs += [scheduler.submit(p, q) for p, q in zip(ps[1:], params[1:])]
    for job, p, q in zip(jobs, ps, params):
        got, alone = job.future.result(timeout=120), engine.generate([p], q)
        assert [g.token_ids for g in got] == [g.token_ids for g in alone]
        for g, a in zip(got, alone):
            assert g.logprobs == pytest.approx(a.logprobs, abs=1e-5)
    assert max(counting.rows) > 10  # they shared steps


def test_a_push_runs_between_batches_and_every_token_keeps_its_version(tok, engine):
    """update_weights waits for the requests being generated (their tokens: the old version), and
    the requests that arrive meanwhile wait for it (the new version)."""
    server = Server(TorchEngine(copy.deepcopy(engine.model), 0), tok, "m")
    server.start()
    try:
        p = prompts(1, seed=3)[0]
        params = SamplingParams(temperature=1.0, max_tokens=40, seed=1)
        started = threading.Event()
        before = server.scheduler.submit(p, params, on_tokens=lambda new: started.set())
        assert started.wait(120)
        pushed = threading.Thread(
            target=server.update_weights,
            args=({k: v + 0.01 for k, v in engine.model.state_dict().items()},),
        )
        pushed.start()
        while not server.scheduler.commands and pushed.is_alive():
            time.sleep(0.001)  # the push is queued behind the running request
        after = server.scheduler.submit(p, params)
        pushed.join(120)
        assert (
            before.future.result()[0].versions == [0] * 40
            and after.future.result()[0].versions == [1] * 40
        )
        # the old weights
        assert before.future.result()[0].token_ids == engine.generate([p], params)[0].token_ids
    finally:
        server.stop()


def test_a_cancelled_request_leaves_the_batch_and_the_others_go_on(engine, scheduler):
    p, q = prompts(2, seed=4)
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=2)
    started = threading.Event()
    leaving = scheduler.submit(p, params, on_tokens=lambda new: started.set())
    staying = scheduler.submit(q, params)
    assert started.wait(120)
    scheduler.cancel(leaving)
    assert (
        staying.future.result(timeout=120)[0].token_ids == engine.generate([q], params)[0].token_ids
    )
    assert leaving.future.cancelled() and not scheduler.batch.rows


def test_a_failed_step_fails_its_batch_and_the_engine_goes_on(tok):
    # a learner's module, in training mode
    engine = TorchEngine(tiny_model(tok.get_vocab_size(), 0).train(), 0)
    scheduler = Scheduler(engine)
    scheduler.start()

    def broken(module, args, out):
        raise RuntimeError("the accelerator fell off")

    hook = engine.model.lm_head.register_forward_hook(broken)
    try:
        with pytest.raises(RuntimeError, match="fell off"):
            scheduler.submit([5, 9, 3], SamplingParams(max_tokens=4, seed=0)).future.result(
                timeout=120
            )
        hook.remove()
        good = scheduler.submit([5, 9, 3], SamplingParams(max_tokens=4, seed=0)).future.result(
            timeout=120
        )
        assert (
            good[0].token_ids
            == engine.generate([[5, 9, 3]], SamplingParams(max_tokens=4, seed=0))[0].token_ids
        )
        assert engine.model.training  # each batch gave the model back its mode
    finally:
        hook.remove()
        scheduler.stop()


def test_concurrent_http_sessions_share_the_engine_and_keep_their_tokens(tok, engine):
    """32 clients at once over HTTP, each with its own seed: the engine runs them together, each
    session's record is its own request, and its tokens are the ones its request gets alone."""
    server = Server(TorchEngine(copy.deepcopy(engine.model), 0), tok, "m", max_model_len=600)
    server.start()
    counting = Counting(server.scheduler.batch)
    replies, barrier = {}, threading.Barrier(32)

    def client(i):
        body = {
            "model": "m",
            "prompt": prompts(32, seed=5)[i],
            "max_tokens": 12,
            "seed": i,
            "user": f"s{i}",
            "return_token_ids": True,
        }
        request = urllib.request.Request(
            server.url + "/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        barrier.wait()
        with urllib.request.urlopen(request, timeout=120) as r:
            replies[i] = json.loads(r.read())

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, p in enumerate(prompts(32, seed=5)):
            alone = engine.generate([p], SamplingParams(max_tokens=12, seed=i))[0]
            (call,) = server.capture.calls(f"s{i}")
            assert call.prompt_ids == p and call.samples[0].token_ids == alone.token_ids
            assert replies[i]["choices"][0]["token_ids"] == alone.token_ids
        assert max(counting.rows) > 1  # requests shared steps
    finally:
        server.stop()
