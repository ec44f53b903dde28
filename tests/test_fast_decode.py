"""Tests for fast_decode.py: cascade attention against plain attention over each row's whole keys,
the fast engine against the plain one (the same greedy tokens, log-probs to fp32 round-off) at
several lengths, group sizes, batch mixes, with stop tokens, the prefix cache and partial rollouts,
the weight-sync gate with it on, the prompt's keys held once per group, the inverse-CDF draw against
the law it draws from, and the refusals at start-up. The compiled step (Inductor compiles C++:
minutes on a loaded CPU) is in the slow tier."""

import copy

import pytest
import torch
import torch.nn.functional as F

import config
from model import ModelConfig, init_model
from rollout import SamplingParams, TorchEngine, logprob_gap, make_engine
from wings import fast_decode
from wings.fast_decode import CascadeCache, FastDecodeEngine, cascade_attention, inverse_cdf
from test_rollout import PAD, PROMPTS, VOCAB, learner_logprobs, tiny_model

STOPS = tuple(range(20, 32))  # 12 stop ids of 64: rows stop at different steps and leave the batch


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]


def assert_same_generations(plain, fast, atol=1e-5):
    """The same tokens and finish reasons; log-probs equal to fp32 round-off (the sums run in
    another order)."""
    assert len(plain) == len(fast)
    for a, b in zip(plain, fast):
        assert (
            a.token_ids == b.token_ids
            and a.finish_reason == b.finish_reason
            and a.kept_sizes == b.kept_sizes
        )
        torch.testing.assert_close(
            torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=atol
        )


# -----------------------------------------------------------------------------
# cascade attention: the prompt once per group, merged with each row's own keys


@pytest.mark.parametrize("rows_of_group", [[3, 3], [1, 4, 2], [5], [2, 0, 1]])
def test_cascade_attention_equals_attention_over_each_rows_whole_keys(rows_of_group):
    """Rows of D groups (uneven, one emptied by finished rows), each with its group's left-padded
    prompt and its own T tokens: cascade_attention (the prompt once per group, each row's own
    tokens, merged by their log-sum-exps) equals softmax attention of the row over [prompt; own]
    (SDPA, GQA) to 1e-6, with each prompt's keys held once (one per prompt that still has rows, not
    one per row). Then rows leave (keep_rows), and a row's keys read back as a KVCache row's."""
    g = torch.Generator().manual_seed(0)
    nkv, r, hd, P, T, N = 2, 3, 8, 11, 5, 7
    group = torch.tensor([d for d, k in enumerate(rows_of_group) for _ in range(k)])  # (b,)
    b, D = len(group), len(rows_of_group)
    pk, pv = torch.randn(D, nkv, P, hd, generator=g), torch.randn(D, nkv, P, hd, generator=g)
    real = torch.ones(D, P + N, dtype=torch.bool)
    real[:, :2] = False  # left padding ...
    real[0, :6] = False  # ... of different lengths
    prefill = type("Prefill", (), {"k": [pk], "v": [pv], "pos": P, "max_len": P + N})()
    cache = CascadeCache(prefill, real, P)
    cache.keep_rows(group)  # records the groups; the empty one leaves
    own_k, own_v = torch.randn(b, nkv, T, hd, generator=g), torch.randn(b, nkv, T, hd, generator=g)
    cache.ok[0][:, :, :T], cache.ov[0][:, :, :T] = own_k, own_v
    cache.pos = P + T
    q = torch.randn(b, nkv, r, hd, generator=g)

    def check(rows):
        out = cascade_attention(
            q[rows] * hd**-0.5,
            cache.pk[0],
            cache.pv[0],
            cache.pmask,
            cache.ok[0][:, :, :T],
            cache.ov[0][:, :, :T],
            None,
            cache.slot,
            cache.at,
        )
        # (b, nkv, P + T, hd) each row's whole keys
        k = torch.cat([pk[group[rows]], own_k[rows]], 2)
        v = torch.cat([pv[group[rows]], own_v[rows]], 2)
        mask = torch.cat([real[group[rows], :P], torch.ones(len(rows), T, dtype=torch.bool)], 1)[
            :, None, None
        ]
        ref = F.scaled_dot_product_attention(
            q[rows].reshape(len(rows), nkv * r, 1, hd), k, v, attn_mask=mask, enable_gqa=True
        )
        torch.testing.assert_close(out, ref.reshape(len(rows), nkv, r, hd), rtol=0, atol=1e-6)
        for i in range(len(rows)):  # a row reads back as a KVCache row
            assert torch.equal(cache.k[0][i], k[i]) and torch.equal(cache.v[0][i], v[i])

    check(torch.arange(b))
    assert cache.pk[0].shape[0] == sum(k > 0 for k in rows_of_group)
    rows = torch.arange(b)[torch.arange(b) % 3 != 1]  # every third row leaves
    cache.keep_rows(rows)
    check(rows)


def test_a_groups_prompt_is_held_once():
    """After the prefill the fast engine's cache holds each distinct prompt's keys once, not once
    per sample: the prompt's KV memory is n times smaller; each row holds only its own new
    tokens."""
    model = tiny_model()
    engine = FastDecodeEngine(model, pad_id=PAD)
    seen = []
    engine._token_boundary = lambda prompts, rows, real, tokens, cache, end, h: (
        seen.append(cache),
        (cache, h),
    )[1]
    n, N = 8, 6
    engine.generate(PROMPTS, SamplingParams(n=n, temperature=1.0, max_tokens=N, seed=0))
    cache, P = seen[0], max(map(len, PROMPTS))
    assert cache.pk[0].shape == (len(PROMPTS), 2, P, 8) and cache.ok[0].shape == (
        len(PROMPTS) * n,
        2,
        N,
        8,
    )
    plain = TorchEngine(model, PAD)
    kept = []
    plain._token_boundary = lambda prompts, rows, real, tokens, cache, end, h: (
        kept.append(cache),
        (cache, h),
    )[1]
    plain.generate(PROMPTS, SamplingParams(n=n, temperature=1.0, max_tokens=N, seed=0))
    assert kept[0].k[0][:, :, :P].numel() == n * cache.pk[0].numel()  # the plain engine: n copies


# -----------------------------------------------------------------------------
# the fast engine against the plain one


@pytest.mark.parametrize(
    "lengths,n,max_tokens,max_batch_size",
    [
        ((7, 1, 4), 1, 12, 256),
        ((7, 1, 4), 4, 12, 256),
        ((30, 3, 17, 52, 9), 3, 20, 256),
        ((30, 3, 17, 52, 9), 2, 9, 4),
        ((5,), 16, 25, 256),
        ((12, 12), 1, 3, 256),
    ],
)
def test_fast_greedy_equals_plain(lengths, n, max_tokens, max_batch_size):
    """Greedy, with stop ids (finished rows leave the batch, groups shrink and empty): token for
    token the plain engine's generations, log-probs to 1e-5, at several prompt lengths, group sizes
    and batch splits (the last
    case: two identical prompts, one group of 2n rows)."""
    model = tiny_model()
    prompts = prompts_of(lengths) if lengths != (12, 12) else [prompts_of((12,))[0]] * 2
    params = SamplingParams(n=n, temperature=0.0, max_tokens=max_tokens, stop_token_ids=STOPS)
    plain = TorchEngine(model, PAD, max_batch_size=max_batch_size).generate(prompts, params)
    fast = make_engine(
        "torch", "", pad_id=PAD, model=model, max_batch_size=max_batch_size, decode="fast"
    )
    assert_same_generations(plain, fast.generate(prompts, params))
    if len(lengths) > 1 and max_tokens > 3:
        assert len({len(g.token_ids) for g in plain}) > 1  # rows did leave at different steps


@pytest.mark.parametrize(
    "lengths,n,top_k,top_p", [((5,), 16, 0, 1.0), ((30, 3, 17), 8, 0, 1.0), ((9, 4), 6, 5, 0.9)]
)
def test_fast_sampled_with_the_plain_draws_equals_plain(lengths, n, top_k, top_p):
    """Sampled with the plain engine's draw (torch.multinomial, the same random numbers): the same
    samples as the plain engine, so rows of one group stop at different steps and the groups shrink
    unevenly."""
    model = tiny_model()
    prompts = prompts_of(lengths, seed=2)
    params = SamplingParams(
        n=n, temperature=1.0, top_k=top_k, top_p=top_p, max_tokens=20, seed=4, stop_token_ids=STOPS
    )
    plain = TorchEngine(model, PAD).generate(prompts, params)
    fast = FastDecodeEngine(model, pad_id=PAD)
    fast.draw = None
    assert_same_generations(plain, fast.generate(prompts, params))
    assert len({len(g.token_ids) for g in plain[:n]}) > 2


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_fast_greedy_equals_plain_on_other_families(model_type):
    """Qwen3's per-head q/k norms and no biases; Llama without biases and with tied embeddings."""
    cfg = ModelConfig(
        model_type=model_type,
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        tie_word_embeddings=model_type == "llama",
    )
    model = init_model(cfg, 0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    params = SamplingParams(n=3, temperature=0.0, max_tokens=10, stop_token_ids=STOPS)
    assert_same_generations(
        TorchEngine(model, PAD).generate(PROMPTS, params),
        FastDecodeEngine(model, pad_id=PAD).generate(PROMPTS, params),
    )


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.8)]
)
def test_sampled_logprobs_are_the_learners(temperature, top_k, top_p):
    """Sampled (the draws are the fast engine's own): each token's log-prob is the learner's score
    of it under the distribution it was drawn from, truncated ones included (the weight-sync gate's
    measure, to 1e-5), and the same seed gives the same samples."""
    model = tiny_model()
    engine = FastDecodeEngine(model, pad_id=PAD)
    params = SamplingParams(
        n=4,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        max_tokens=12,
        seed=5,
        stop_token_ids=STOPS,
    )
    gens = engine.generate(PROMPTS, params)
    for i, g in enumerate(gens):
        expected = learner_logprobs(model, PROMPTS[i // 4], g, temperature)
        torch.testing.assert_close(torch.tensor(g.logprobs), expected, rtol=0, atol=1e-5)
    assert [g.token_ids for g in engine.generate(PROMPTS, params)] == [g.token_ids for g in gens]


def test_the_fused_weights_follow_the_parameters():
    """An engine reading the learner's own parameters: after an in-place update (an optimizer step)
    its next call samples from the new weights (the gate's gap stays at round-off, 1e-4: stale
    weights give ~0.1), and a push through update_weights as well."""
    model = tiny_model()
    engine = FastDecodeEngine(model, pad_id=PAD)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=1)
    engine.generate(PROMPTS, params)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.1)
    gens = engine.generate(PROMPTS, params)
    assert logprob_gap(model, [PROMPTS[i // 2] for i in range(len(gens))], gens, 1.0) < 1e-4
    other = tiny_model(3)
    engine.update_weights(other.state_dict())
    gens = engine.generate(PROMPTS, params)
    assert logprob_gap(other, [PROMPTS[i // 2] for i in range(len(gens))], gens, 1.0) < 1e-4


def test_with_the_prefix_cache_turn_after_turn():
    """The prefix cache's multi-turn case (test_prefix_cache.next_turn): with decode=fast, the same
    greedy tokens as the plain engine with the cache, turn after turn, and the cache prefills only
    the new tokens (it stored the fast engine's rows through CascadeCache's per-row view)."""
    from test_prefix_cache import next_turn

    model = tiny_model()
    prompts = prompts_of((20, 35, 17, 50, 24), seed=7)
    plain = make_engine("torch", "", pad_id=PAD, model=model, prefix_cache_tokens=4096)
    fast = make_engine(
        "torch", "", pad_id=PAD, model=model, prefix_cache_tokens=4096, decode="fast"
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=tuple(range(1, VOCAB, 9)))
    for turn in range(4):
        a, b = plain.generate(prompts, params), fast.generate(prompts, params)
        assert_same_generations(a, b)
        assert fast.prefilled_tokens == plain.prefilled_tokens  # the same hits, turn after turn
        prompts = next_turn(prompts, a, turn, budget=5)
    assert fast.prefilled_tokens < fast.prompt_tokens / 2


@pytest.mark.parametrize(
    "push_at,prefix_cache_tokens,stops", [(4, 0, False), (5, 512, True), (1, 0, True)]
)
def test_partial_rollout_push_mid_generation(push_at, prefix_cache_tokens, stops):
    """Partial rollouts with decode=fast: a push lands at the next token boundary, every row's keys
    are recomputed with the new weights (a plain cache, which the fast step takes over), and each
    token's log-prob is the learner's under the version it records."""
    old, new = tiny_model(0), tiny_model(1)
    engine = make_engine(
        "torch",
        "",
        pad_id=PAD,
        model=copy.deepcopy(old),
        prefix_cache_tokens=prefix_cache_tokens,
        concurrent=True,
        decode="fast",
    )
    steps = []

    def push(module, args, out):  # the lm_head runs once per decode step
        steps.append(1)
        if len(steps) == push_at:
            engine.update_weights(new.state_dict(), version=7)

    handle = engine.model.lm_head.register_forward_hook(push)
    params = SamplingParams(
        n=8 if stops else 2,
        temperature=1.0,
        max_tokens=10,
        seed=3,
        stop_token_ids=STOPS if stops else (),
    )
    gens = engine.generate(PROMPTS, params)
    handle.remove()
    for i, g in enumerate(gens):
        prompt = PROMPTS[i // params.n]
        assert g.versions == ([0] * push_at + [7] * (10 - push_at))[: len(g.token_ids)]
        by_old, by_new = (learner_logprobs(m, prompt, g, 1.0) for m in (old, new))
        expected = torch.where(torch.tensor(g.versions) == 7, by_new, by_old)
        torch.testing.assert_close(torch.tensor(g.logprobs), expected, rtol=0, atol=1e-4)


# -----------------------------------------------------------------------------
# the draw


def test_inverse_cdf_draws_each_index_with_its_probability(monkeypatch):
    """200k draws from rows with zeros (a top-k set), a peaked row and a flat one: every frequency
    within 5 standard errors of its probability, no zero-probability index ever drawn, even with u
    at the top of [0, 1)."""
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor(
        [[0.0, 0.5, 0.0, 0.3, 0.2, 0.0], [0.97, 0.01, 0.01, 0.005, 0.005, 0.0], [1 / 6] * 6]
    )
    draws = 200_000
    tok = inverse_cdf(probs.repeat_interleave(draws, 0), g).view(3, draws)
    freq = F.one_hot(tok, 6).float().mean(1)  # (3, 6)
    se = (probs * (1 - probs) / draws).sqrt()
    assert ((freq - probs).abs() <= 5 * se + 1e-9).all(), (freq, probs)
    assert (freq[probs == 0] == 0).all()
    # the ends of u: the draw at the top of the range (rand = 0) is the last index with probability,
    # never the zero after it; at the bottom (rand as close to 1 as it gets), the first with
    # probability, never the zero before it
    row = torch.tensor([[0.0, 0.25, 0.75, 0.0]])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.zeros(1, 1))
    assert inverse_cdf(row).tolist() == [2]
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.full((1, 1), 1 - 2**-24))
    assert inverse_cdf(row).tolist() == [1]


# -----------------------------------------------------------------------------
# settings and refusals


def test_config_checks():
    assert config.load_config(None, ["rollout.decode=fast"]).rollout.decode == "fast"
    with pytest.raises(ValueError, match="rollout.decode='fsat' is not one of"):
        config.load_config(None, ["rollout.decode=fsat"])
    with pytest.raises(ValueError, match="rollout.engine=torch"):
        config.load_config(None, ["rollout.decode=fast", "rollout.engine=vllm"])
    with pytest.raises(ValueError, match="learner.precision=bf16"):
        config.load_config(None, ["rollout.decode=fast", "learner.precision=bf16"])


def test_a_machine_without_a_compiler_is_refused_at_start_up(monkeypatch):
    """decode=compiled where Inductor has no compiler: a clear error at config load and at engine
    build, before any step runs (not a crash in the middle of a run)."""
    monkeypatch.setattr(fast_decode, "compiler_missing", lambda device: "no C++ compiler (test)")
    with pytest.raises(ValueError, match="rollout.decode=compiled: no C\\+\\+ compiler"):
        config.load_config(None, ["rollout.decode=compiled"])
    with pytest.raises(RuntimeError, match="rollout.decode=compiled: no C\\+\\+ compiler"):
        make_engine("torch", "", pad_id=PAD, model=tiny_model(), decode="compiled")
    monkeypatch.undo()
    from torch._inductor import config as inductor

    with inductor.patch({"cpp.cxx": (None, "no-such-compiler-xyz")}):
        # not monkeypatch: its undo would hide the
        # key for the rest of the session
        assert "C++ compiler" in fast_decode.compiler_missing(torch.device("cpu"))


def test_adapters_are_refused():
    """The fast step reads nn.Linear weights directly: a wrapped layer (LoRA) would be read wrong,
    so it is refused."""
    from wings.lora import apply_lora

    model = tiny_model()
    apply_lora(model, 4, 8, 0.0, ("q_proj",), seed=0)
    with pytest.raises(ValueError, match="plain nn.Linear"):
        FastDecodeEngine(model, pad_id=PAD)


# -----------------------------------------------------------------------------
# compiled (slow: Inductor writes and compiles C++)


@pytest.mark.slow
def test_compiled_equals_plain_and_the_gate_holds():
    """No stop ids: every row runs to max_tokens, so no size reaches 1 mid-call and Inductor
    compiles twice (the first token's step and the rest's, ~40 s each on a 2-core CPU), not five
    times; rows leaving the batch are the fast step's tests above, and the compiled layer is the
    same function."""
    model = tiny_model()
    compiled = make_engine("torch", "", pad_id=PAD, model=model, decode="compiled")
    params = SamplingParams(n=3, temperature=0.0, max_tokens=10)
    assert_same_generations(
        TorchEngine(model, PAD).generate(PROMPTS, params), compiled.generate(PROMPTS, params)
    )
    sampled = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=2)
    gens = compiled.generate(PROMPTS, sampled)
    assert logprob_gap(model, [PROMPTS[i // 4] for i in range(len(gens))], gens, 1.0) < 1e-5
