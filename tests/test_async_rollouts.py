"""Tests for async_rollouts.py: the async schedule (which weights sample which batch, whatever the
thread timing), and the concurrent torch engine's pushes at token boundaries (partial rollouts). The
end-to-end runs (bounded staleness, exact resume, partial rollouts within the bound) are in
test_train.py."""

import pytest
import torch

from rollout import SamplingParams, make_engine
from wings.async_rollouts import AsyncSchedule
from test_rollout import PAD, PROMPTS, learner_logprobs, tiny_model


@pytest.mark.parametrize("k", [1, 2, 3])
def test_async_schedule_samples_batch_s_from_version_s_minus_1_minus_k(k):
    """The loop's calls on an AsyncSchedule whose collect records the engine's version when it runs
    (partial rollouts off): batch s is sampled from version max(0, s-1-k) whatever the thread
    timing, no push happens while a batch is being sampled, each batch's tokens are stamped with
    that version, and at most k batches are ahead."""
    import threading
    import time as clock
    from types import SimpleNamespace

    engine = {"version": 0, "sampling": False}
    seen, lock = {}, threading.Lock()

    def collect(step):
        with lock:
            engine["sampling"] = True
        clock.sleep(0.01 * (step % 3))  # uneven batch times
        seen[step] = engine["version"]
        with lock:
            engine["sampling"] = False
        return [SimpleNamespace(loss_mask=[0, 1, 1], versions=[])], {}

    steps = 7
    prefetch = AsyncSchedule(collect, steps, enabled=True, max_staleness=k)
    for step in range(1, steps + 1):
        trajs, metrics, _ = prefetch.take(step)
        assert len(prefetch.ready) + len(prefetch.futures) <= k
        # stamped on the sampled tokens
        assert trajs[0].versions == [-1] + [max(0, step - 1 - k)] * 2
        assert metrics["rollout/staleness"] == metrics["rollout/staleness_max"] == min(k, step - 1)
        clock.sleep(0.005)  # the update
        prefetch.before_push(step)
        with lock:
            assert not engine["sampling"]  # the push never lands mid-batch
            engine["version"] = step  # the push
    prefetch.shutdown()
    assert seen == {s: max(0, s - 1 - k) for s in range(1, steps + 1)}


@pytest.mark.parametrize(
    "push_at,prefix_cache_tokens,stops,top_k,top_p",
    [
        (4, 0, False, 0, 1.0),
        (4, 512, False, 0, 1.0),
        (10, 0, False, 0, 1.0),
        (5, 0, True, 0, 1.0),
        (5, 512, True, 0, 1.0),
        (4, 0, False, 0, 0.9),
        (5, 512, True, 6, 0.8),
    ],
)
def test_partial_rollout_push_lands_at_the_next_token_boundary(
    push_at, prefix_cache_tokens, stops, top_k, top_p
):
    """A push during a generation (partial rollouts) does not wait for it: it lands at the next
    token boundary, the tokens from there on carry its version, and the keys and values of the
    tokens before are recomputed, so every token's log-prob is the learner's re-scoring of the whole
    sequence under the weights of the version it records (not a mix of old keys and new weights). A
    push after the last boundary lands when the call ends. With top-k / top-p, each token's kept-set
    size is that of the version it records too: the learner's truncated score of the recorded sizes
    under that version's weights gives back the engine's log-prob."""
    import copy

    old, new = tiny_model(0), tiny_model(1)
    engine = make_engine(
        "torch",
        "",
        pad_id=PAD,
        model=copy.deepcopy(old),
        prefix_cache_tokens=prefix_cache_tokens,
        concurrent=True,
    )
    steps = []

    def push(module, args, out):  # the lm_head runs once per decode step: push at step push_at
        steps.append(1)
        if len(steps) == push_at:  # from inside the generation: a push that waited would deadlock
            engine.update_weights(new.state_dict(), version=7)

    handle = engine.model.lm_head.register_forward_hook(push)
    # stops: 8 samples per prompt and 12 stop ids, so rows finish (and leave the batch) before and
    # after the push
    params = SamplingParams(
        n=8 if stops else 1,
        temperature=1.0,
        max_tokens=10,
        seed=3,
        top_k=top_k,
        top_p=top_p,
        stop_token_ids=tuple(range(20, 32)) if stops else (),
    )
    gens = engine.generate(PROMPTS, params)
    handle.remove()
    assert engine.version == 7 and all(
        torch.equal(p, q) for p, q in zip(engine.model.parameters(), new.parameters())
    )
    lengths = [len(g.token_ids) for g in gens]
    if stops:
        assert (
            min(lengths) < push_at < max(lengths) and lengths.count(10) < len(gens) - len(gens) // 4
        )
    for i, g in enumerate(gens):
        prompt = PROMPTS[i // params.n]
        assert g.versions == ([0] * push_at + [7] * (10 - push_at))[: len(g.token_ids)]
        assert len(g.kept_sizes) == (len(g.token_ids) if top_k or top_p < 1 else 0)
        by_old, by_new = (learner_logprobs(m, prompt, g, 1.0) for m in (old, new))  # (10,) each
        expected = torch.where(torch.tensor(g.versions) == 7, by_new, by_old)
        # 1e-4: float32 rounding between the engine's padded batch and a one-row forward (~1e-6
        # measured), well under the 1e-3 of the weight-sync gate; the two models differ by ~1 per
        # token
        torch.testing.assert_close(torch.tensor(g.logprobs), expected, rtol=0, atol=1e-4)
        if len(g.token_ids) > push_at:
            assert (torch.tensor(g.logprobs)[push_at:] - by_old[push_at:]).abs().max() > 1e-2
    again = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=10, seed=3))
    # no push pending: the next call is all version 7
    assert all(g.versions == [7] * 10 for g in again)


@pytest.mark.parametrize("arrives", ["early", "late"])
def test_partial_rollout_swaps_are_recorded_and_replayed_whenever_the_push_arrives(
    tmp_path, arrives
):
    """Record: batch 5's first call takes a push at token step 4 (from inside the generation, as a
    push lands by the clock), its second starts from the new weights; both are entries of the run's
    partial_swaps.jsonl. Replay the record on a fresh engine with the push arriving early (before
    the calls: it is held, and lands at token step 4 all the same; meanwhile a call of another
    thread, the loop's eval or gate, runs the pushed weights and gives them back) or late (the calls
    wait for it before they start): the ids, log-probs and versions are those of the recorded run,
    bit for bit, and the replay's own record is the same. A replayed call that waits for a version
    nobody will push is stopped by check_not_stuck (what the loop calls while it waits for a
    batch)."""
    import copy
    import os
    import threading
    from wings.async_rollouts import RECORD, SwapRecord, read_record

    old, new = tiny_model(0), tiny_model(1)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=3)

    def engine_with(record_dir, plan=None):
        engine = make_engine("torch", "", pad_id=PAD, model=copy.deepcopy(old), concurrent=True)
        os.makedirs(record_dir)
        engine.number_from(0, SwapRecord.open(str(record_dir), []), plan)
        return engine

    recording = engine_with(tmp_path / "recorded")
    calls = []

    def push(module, args, out):  # the lm_head runs once per decode step
        calls.append(1)
        if len(calls) == 4:
            recording.update_weights(new.state_dict(), version=1)

    handle = recording.model.lm_head.register_forward_hook(push)
    with recording.batch(5):
        recorded = recording.generate(PROMPTS, params) + recording.generate(PROMPTS, params)
    handle.remove()
    entries = [
        {"step": 5, "call": 0, "start": 0, "swaps": [[4, 1]], "token_steps": 10},
        {"step": 5, "call": 1, "start": 1, "swaps": [], "token_steps": 10},
    ]
    assert recording.record.entries == entries == read_record(str(tmp_path / "recorded"))
    rows = len(PROMPTS) * params.n
    assert [g.versions for g in recorded] == [[0] * 4 + [1] * 6] * rows + [[1] * 10] * rows

    plan = {(e["step"], e["call"]): e for e in read_record(str(tmp_path / "recorded"))}
    engine = engine_with(tmp_path / arrives, plan)
    out = {}

    def sample():
        with engine.batch(5):
            out["gens"] = engine.generate(PROMPTS, params) + engine.generate(PROMPTS, params)

    producer = threading.Thread(target=sample)
    if arrives == "early":
        engine.update_weights(new.state_dict(), version=1)  # held, not applied
        assert engine.version == 0
        # the loop's call
        gate = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=3, seed=1))
        assert all(g.versions == [1] * 3 for g in gate)  # ran the pushed weights ...
        assert engine.version == 0 and all(
            torch.equal(p, q)
            for p, q in zip(
                engine.model.parameters(),
                # ... gave them back
                old.parameters(),
            )
        )
        producer.start()
    else:
        producer.start()
        producer.join(timeout=0.5)
        # waits, not started
        assert producer.is_alive() and engine.version == 0 and engine.prompt_tokens == 0
        engine.update_weights(new.state_dict(), version=1)
    producer.join(timeout=60)
    for a, b in zip(recorded, out["gens"], strict=True):
        assert (a.token_ids, a.logprobs, a.versions) == (b.token_ids, b.logprobs, b.versions)
    assert engine.record.entries == entries and not engine.plan
    with open(tmp_path / "recorded" / RECORD) as a, open(tmp_path / arrives / RECORD) as b:
        assert a.read() == b.read()

    stuck = engine_with(tmp_path / f"stuck_{arrives}", plan)
    failed = []

    def waits_forever():
        with stuck.batch(5):
            try:
                stuck.generate(PROMPTS, params)
            except RuntimeError as e:
                failed.append(str(e))

    waiter = threading.Thread(target=waits_forever)
    waiter.start()
    while stuck._waiting is None:
        waiter.join(timeout=0.01)
    with pytest.raises(RuntimeError, match="waits for the weights after update 1"):
        stuck.check_not_stuck()
    waiter.join(timeout=10)
    assert not waiter.is_alive() and "stopped by the loop" in failed[0]


def test_replaying_another_runs_record_is_an_error_naming_the_call(tmp_path):
    """A record that does not fit the run (here: the call runs 6 token steps, the record says 10
    with a swap at 8) stops it with an error naming the call, and so does a call the record lacks
    while it still has calls to replay."""
    import copy
    from wings.async_rollouts import SwapRecord

    old, new = tiny_model(0), tiny_model(1)
    engine = make_engine("torch", "", pad_id=PAD, model=copy.deepcopy(old), concurrent=True)
    entry = {"step": 3, "call": 0, "start": 0, "swaps": [[8, 1]], "token_steps": 10}
    engine.number_from(
        0, SwapRecord.open(str(tmp_path), []), {(3, 0): entry, (4, 0): {**entry, "step": 4}}
    )
    engine.update_weights(new.state_dict(), version=1)
    with (
        engine.batch(3),
        pytest.raises(RuntimeError, match="call 0 of batch 3 ran 6 token steps with swaps"),
    ):
        engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=6, seed=0))
    with (
        engine.batch(5),
        pytest.raises(RuntimeError, match=r"no call 0 of batch 5 but still has \(4, 0\)"),
    ):
        engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=6, seed=0))
