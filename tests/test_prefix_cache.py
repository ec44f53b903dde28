"""Tests for prefix_cache.py: the cache's lookup and eviction, and the torch engine with it against
the one without."""

import pytest
import torch

from rollout import SamplingParams, TorchEngine
from wings.prefix_cache import PrefixCache, PrefixCachedEngine
from test_rollout import PAD, PROMPTS, VOCAB, tiny_model


# -----------------------------------------------------------------------------
# the prefix cache: a multi-turn episode's next turn prefills only its new tokens


def test_prefix_cache_finds_the_longest_shared_prefix_and_evicts_the_oldest():
    B = PrefixCache.BLOCK
    kv = lambda n: torch.arange(n, dtype=torch.float).view(1, 1, n, 1)  # noqa: E731 (layers, nkv, n, hd)
    cache = PrefixCache(max_tokens=6 * B)
    a, b = list(range(1, 2 * B + 5)), list(range(1, B + 3)) + [99] * B  # share B + 2 tokens
    cache.insert(a, kv(len(a)), kv(len(a)))
    cache.insert(b, kv(len(b)), kv(len(b)))
    n, eid = cache.lookup(a[: 2 * B + 3] + [7, 7])  # past a block boundary, then off a
    assert n == 2 * B + 3 and cache.get(eid)[0] == tuple(a)
    assert cache.lookup(b + [5])[0] == len(b)  # all of b, which ends mid-block
    assert cache.lookup(a)[0] == len(a) - 1  # the last prompt token is always prefilled
    # under one block shared: not found
    assert cache.lookup(list(range(1, B)) + [0] * 20) == (0, None)
    assert cache.lookup([0] + a) == (0, None)
    cache.lookup(a)  # a is now the most recently used ...
    c = list(range(500, 500 + 3 * B))
    cache.insert(c, kv(len(c)), kv(len(c)))  # ... so b goes to make room
    assert cache.tokens == len(a) + len(c) <= cache.max_tokens
    assert cache.lookup(b + [5])[0] == B + 2  # only what b shares with a is left
    cache.insert(list(range(7 * B)), kv(7 * B), kv(7 * B))  # over the whole budget: not kept
    assert cache.tokens == len(a) + len(c)
    cache.remove(eid)
    assert cache.lookup(a)[0] == 0 and set(cache.index) == set(PrefixCache.block_hashes(c))


def next_turn(prompts, gens, turn, budget):
    """What the agent loop sends next: the prompt, the generation cut to the episode's budget, a
    forced end token when it did not stop, and an observation of a few random tokens (a tool's
    answer)."""
    g = torch.Generator().manual_seed(100 + turn)
    out = []
    for i, (p, gen) in enumerate(zip(prompts, gens)):
        ids = gen.token_ids[: budget if i % 2 else None]
        obs = torch.randint(1, VOCAB, (3 + 2 * (i % 5),), generator=g).tolist()
        out.append(
            p
            + ids
            + ([] if gen.finish_reason == "stop" and len(ids) == len(gen.token_ids) else [PAD])
            + obs
        )
    return out


@pytest.mark.parametrize(
    "temperature,top_p,n,max_batch_size", [(0.0, 1.0, 1, 256), (1.0, 0.9, 2, 256), (1.0, 1.0, 1, 3)]
)
def test_prefix_cache_gives_the_same_tokens_as_a_full_prefill(
    temperature, top_p, n, max_batch_size
):
    """Four turns of five episodes, with and without the cache: token for token the same
    generations, log-probs equal to float rounding (1e-5: fp32 sums of a few hundred terms in
    another order differ by ~1e-7 relative), and from the second turn on only the new tokens are
    prefilled."""
    model = tiny_model()
    g = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(1, VOCAB, (length,), generator=g).tolist() for length in (20, 35, 17, 50, 24)
    ]
    stop = tuple(range(1, VOCAB, 9))  # rows stop at different steps; finished rows leave the batch
    plain = TorchEngine(model, PAD, max_batch_size=max_batch_size)
    cached = PrefixCachedEngine(
        model, pad_id=PAD, max_batch_size=max_batch_size, prefix_cache_tokens=100_000
    )
    for turn in range(4):
        params = SamplingParams(
            n=n, temperature=temperature, top_p=top_p, max_tokens=10, stop_token_ids=stop, seed=turn
        )
        before = cached.prefilled_tokens
        want, got = plain.generate(prompts, params), cached.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
        for a, b in zip(got, want):
            torch.testing.assert_close(
                torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5
            )
        if turn:
            # the new tokens: the observation, the forced end token, the last sampled one (never fed
            # back)
            assert cached.prefilled_tokens - before <= sum(
                3 + 2 * i + 2 for i in range(len(prompts))
            )
        # every sample goes on
        prompts = next_turn([p for p in prompts for _ in range(n)], want, turn, budget=4)
    assert plain.prefilled_tokens == plain.prompt_tokens == cached.prompt_tokens
    assert cached.prefilled_tokens < plain.prefilled_tokens / 3
    assert cached.prefix_cache.tokens <= sum(len(p) + 10 for p in prompts)  # one entry per episode


def test_prefix_cache_is_dropped_when_the_weights_change():
    """After a push, and after an in-place change of a shared model (no push), the next call equals
    a fresh engine's: no keys or values of the old weights are reused."""
    model = tiny_model(0)
    prompts = [list(range(1, 40)), list(range(3, 30))]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    engine = PrefixCachedEngine(model, pad_id=PAD, prefix_cache_tokens=10_000)
    gens = engine.generate(prompts, params)
    follow = [p + g.token_ids + [5, 6, 7] for p, g in zip(prompts, gens)]
    engine.update_weights(tiny_model(1).state_dict())
    assert engine.prefix_cache.tokens == 0
    fresh = TorchEngine(tiny_model(1), PAD).generate(follow, params)
    assert [o.token_ids for o in engine.generate(follow, params)] == [o.token_ids for o in fresh]
    with torch.no_grad():  # the learner owns this model and steps it in place
        for p in model.parameters():
            p.mul_(-1.0)
    again = [p + g.token_ids + [8] for p, g in zip(follow, fresh)]
    before = engine.prefilled_tokens
    out = engine.generate(again, params)
    assert engine.prefilled_tokens - before == sum(map(len, again))  # nothing was reused
    assert [o.token_ids for o in out] == [
        o.token_ids for o in TorchEngine(model, PAD).generate(again, params)
    ]
    engine.sleep()
    assert engine.prefix_cache.tokens == 0
