"""Tests for async_rollouts.py: the async schedule (which weights sample which batch, whatever the thread timing), and
the concurrent torch engine's pushes at token boundaries (partial rollouts). The end-to-end runs (bounded staleness,
exact resume, partial rollouts within the bound) are in test_train.py."""
import pytest
import torch

from async_rollouts import AsyncSchedule
from rollout import SamplingParams, make_engine
from test_rollout import PAD, PROMPTS, learner_logprobs, tiny_model


@pytest.mark.parametrize("k", [1, 2, 3])
def test_async_schedule_samples_batch_s_from_version_s_minus_1_minus_k(k):
    """The loop's calls on an AsyncSchedule whose collect records the engine's version when it runs (partial rollouts
    off): batch s is sampled from version max(0, s-1-k) whatever the thread timing, no push happens while a batch
    is being sampled, each batch's tokens are stamped with that version, and at most k batches are ahead."""
    import threading
    import time as clock
    from types import SimpleNamespace
    engine = {"version": 0, "sampling": False}
    seen, lock = {}, threading.Lock()

    def collect(step):
        with lock:
            engine["sampling"] = True
        clock.sleep(0.01 * (step % 3))                          # uneven batch times
        seen[step] = engine["version"]
        with lock:
            engine["sampling"] = False
        return [SimpleNamespace(loss_mask=[0, 1, 1], versions=[])], {}

    steps = 7
    prefetch = AsyncSchedule(collect, steps, enabled=True, max_staleness=k)
    for step in range(1, steps + 1):
        trajs, metrics, _ = prefetch.take(step)
        assert len(prefetch.ready) + len(prefetch.futures) <= k
        assert trajs[0].versions == [-1] + [max(0, step - 1 - k)] * 2         # stamped on the sampled tokens
        assert metrics["rollout/staleness"] == metrics["rollout/staleness_max"] == min(k, step - 1)
        clock.sleep(0.005)                                      # the update
        prefetch.before_push(step)
        with lock:
            assert not engine["sampling"]                       # the push never lands mid-batch
            engine["version"] = step                            # the push
    prefetch.shutdown()
    assert seen == {s: max(0, s - 1 - k) for s in range(1, steps + 1)}


@pytest.mark.parametrize("push_at,prefix_cache_tokens,stops,top_k,top_p", [
    (4, 0, False, 0, 1.0), (4, 512, False, 0, 1.0), (10, 0, False, 0, 1.0), (5, 0, True, 0, 1.0),
    (5, 512, True, 0, 1.0), (4, 0, False, 0, 0.9), (5, 512, True, 6, 0.8)])
def test_partial_rollout_push_lands_at_the_next_token_boundary(push_at, prefix_cache_tokens, stops, top_k, top_p):
    """A push during a generation (partial rollouts) does not wait for it: it lands at the next token boundary, the
    tokens from there on carry its version, and the keys and values of the tokens before are recomputed, so every
    token's log-prob is the learner's re-scoring of the whole sequence under the weights of the version it records
    (not a mix of old keys and new weights). A push after the last boundary lands when the call ends. With top-k /
    top-p, each token's kept-set size is that of the version it records too: the learner's truncated score of the
    recorded sizes under that version's weights gives back the engine's log-prob."""
    import copy
    old, new = tiny_model(0), tiny_model(1)
    engine = make_engine("torch", "", pad_id=PAD, model=copy.deepcopy(old), prefix_cache_tokens=prefix_cache_tokens,
                         concurrent=True)
    steps = []

    def push(module, args, out):                 # the lm_head runs once per decode step: push at step push_at
        steps.append(1)
        if len(steps) == push_at:                # from inside the generation: a push that waited would deadlock
            engine.update_weights(new.state_dict(), version=7)
    handle = engine.model.lm_head.register_forward_hook(push)
    # stops: 8 samples per prompt and 12 stop ids, so rows finish (and leave the batch) before and after the push
    params = SamplingParams(n=8 if stops else 1, temperature=1.0, max_tokens=10, seed=3, top_k=top_k, top_p=top_p,
                            stop_token_ids=tuple(range(20, 32)) if stops else ())
    gens = engine.generate(PROMPTS, params)
    handle.remove()
    assert engine.version == 7 and all(torch.equal(p, q) for p, q in zip(engine.model.parameters(), new.parameters()))
    lengths = [len(g.token_ids) for g in gens]
    if stops:
        assert min(lengths) < push_at < max(lengths) and lengths.count(10) < len(gens) - len(gens) // 4
    for i, g in enumerate(gens):
        prompt = PROMPTS[i // params.n]
        assert g.versions == ([0] * push_at + [7] * (10 - push_at))[:len(g.token_ids)]
        assert len(g.kept_sizes) == (len(g.token_ids) if top_k or top_p < 1 else 0)
        by_old, by_new = (learner_logprobs(m, prompt, g, 1.0) for m in (old, new))         # (10,) each
        expected = torch.where(torch.tensor(g.versions) == 7, by_new, by_old)
        # 1e-4: float32 rounding between the engine's padded batch and a one-row forward (~1e-6 measured), well
        # under the 1e-3 of the weight-sync gate; the two models differ by ~1 per token
        torch.testing.assert_close(torch.tensor(g.logprobs), expected, rtol=0, atol=1e-4)
        if len(g.token_ids) > push_at:
            assert (torch.tensor(g.logprobs)[push_at:] - by_old[push_at:]).abs().max() > 1e-2
    again = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=10, seed=3))
    assert all(g.versions == [7] * 10 for g in again)     # no push pending: the next call is all version 7
