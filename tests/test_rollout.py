"""Tests for rollout.py's TorchEngine: greedy decoding against a naive full-forward loop, log-probs
against the learner's Transformer.token_logprobs, seeding, ordering, stop/length handling, top-p,
and weight updates.
"""

import math

import pytest
import torch

import algos
from learner import truncated_score
from model import ModelConfig, init_model, load_model, save_model
from rollout import (
    SamplingParams,
    TorchEngine,
    assert_synced,
    logprob_gap,
    sample_tokens,
    sync_probe,
)
from wings.engine_vllm import weight_buckets

PAD, VOCAB = 0, 64
# different lengths, so the batch is left-padded
PROMPTS = [[5, 9, 3, 7, 11, 2, 8], [4], [13, 6, 6, 1]]


def tiny_model(seed=0):
    cfg = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = init_model(cfg, seed)
    with torch.no_grad():
        # larger weights than N(0, 0.02): peaked logits, so argmax has no near-ties
        g = torch.Generator().manual_seed(seed + 1)
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


def naive_greedy(model, prompt, max_tokens, stop=()):
    """Obviously correct: a full forward over the whole sequence for every new token."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
            if seq[-1] in stop:
                break
    return seq[len(prompt) :]


def learner_logprobs(model, prompt, gen, temperature, truncated=True):
    """What the learner will compute for the generated tokens: with top-k / top-p (gen.kept_sizes),
    the truncated distribution rebuilt from the recorded sizes (learner.truncated_score), unless
    truncated=False."""
    ids = torch.tensor([prompt + gen.token_ids])  # (1, P + N)
    trunc = {}
    if gen.kept_sizes and truncated:
        trunc = dict(
            score=truncated_score, score_args=torch.tensor([[0] * len(prompt) + gen.kept_sizes])
        )
    with torch.no_grad():
        logp = model.token_logprobs(ids, temperature=temperature, **trunc)[0]
    return logp[len(prompt) :]


@pytest.mark.parametrize("max_batch_size", [256, 2])  # one batch, or chunks of 2 rows
def test_greedy_equals_naive_loop_and_logprobs_equal_learner(max_batch_size):
    model = tiny_model()
    # prompt 0 stops early; the others do not
    stop = (naive_greedy(model, PROMPTS[0], 12)[3], VOCAB - 1)
    engine = TorchEngine(model, PAD, max_batch_size=max_batch_size)
    outs = engine.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=stop)
    )
    assert len(outs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs):
        expected = naive_greedy(model, prompt, 12, stop)
        assert out.token_ids == expected
        assert out.finish_reason == ("stop" if expected[-1] in stop else "length")
        torch.testing.assert_close(
            torch.tensor(out.logprobs), learner_logprobs(model, prompt, out, 1.0), rtol=0, atol=1e-5
        )
    assert {o.finish_reason for o in outs} == {"stop", "length"}  # rows finish at different times


def test_sampled_logprobs_equal_learner_at_the_same_temperature():
    """Many stop tokens: rows end at different steps and finished rows leave the batch mid-way."""
    model = tiny_model()
    stop = tuple(range(1, VOCAB, 4))
    params = SamplingParams(
        n=8, temperature=1.0, top_p=0.9, max_tokens=12, stop_token_ids=stop, seed=3
    )
    outs = TorchEngine(model, PAD).generate(PROMPTS, params)
    assert len({len(o.token_ids) for o in outs}) >= 4
    for i, out in enumerate(outs):
        assert all(t not in stop for t in out.token_ids[:-1])
        assert out.finish_reason == ("stop" if out.token_ids[-1] in stop else "length")
        assert len(out.kept_sizes) == len(out.token_ids) and min(out.kept_sizes) >= 1
        torch.testing.assert_close(
            torch.tensor(out.logprobs),
            learner_logprobs(model, PROMPTS[i // 8], out, 1.0),
            rtol=0,
            atol=1e-5,
        )
    cold = TorchEngine(model, PAD).generate(
        PROMPTS, SamplingParams(n=2, temperature=0.7, max_tokens=8, seed=0)
    )
    for i, out in enumerate(cold):
        torch.testing.assert_close(
            torch.tensor(out.logprobs),
            learner_logprobs(model, PROMPTS[i // 2], out, 0.7),
            rtol=0,
            atol=1e-5,
        )


def test_seeds_and_prompt_major_order():
    engine = TorchEngine(tiny_model(), PAD)
    sample = lambda seed: [
        o.token_ids
        for o in engine.generate(  # noqa: E731
            PROMPTS, SamplingParams(n=3, temperature=1.0, max_tokens=16, seed=seed)
        )
    ]
    a, b, c = sample(0), sample(0), sample(1)
    assert len(a) == 9 and a == b and a != c
    assert len({tuple(t) for t in a}) > 3  # temperature 1 really samples
    greedy = engine.generate(PROMPTS, SamplingParams(n=3, temperature=0.0, max_tokens=6))
    for i, prompt in enumerate(PROMPTS):  # rows 3i, 3i+1, 3i+2 belong to prompt i
        assert all(
            g.token_ids == naive_greedy(engine.model, prompt, 6) for g in greedy[3 * i : 3 * i + 3]
        )
    repeated = engine.generate(
        [PROMPTS[0], PROMPTS[1], PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=6)
    )
    assert [g.token_ids for g in repeated] == [
        greedy[0].token_ids,
        greedy[3].token_ids,
        greedy[0].token_ids,
    ]


def test_stop_token_is_kept_and_max_tokens_gives_length():
    engine = TorchEngine(tiny_model(), PAD)
    free = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert len(free.token_ids) == 8 and free.finish_reason == "length"
    stop = free.token_ids[4]
    cut = free.token_ids.index(stop) + 1
    out = engine.generate(
        [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(stop,))
    )[0]
    assert out.token_ids == free.token_ids[:cut] and out.token_ids[-1] == stop
    assert out.finish_reason == "stop" and out.logprobs == pytest.approx(
        free.logprobs[:cut], abs=1e-6
    )
    # a stop token emitted as the very last allowed token is still a stop
    last = engine.generate(
        [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=cut, stop_token_ids=(stop,))
    )[0]
    assert last.finish_reason == "stop"
    assert engine.generate([PROMPTS[0]], SamplingParams(max_tokens=0))[0].token_ids == []


def test_tiny_top_p_is_greedy():
    engine = TorchEngine(tiny_model(), PAD)
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10))
    nucleus = engine.generate(
        PROMPTS, SamplingParams(n=2, temperature=1.3, top_p=1e-6, max_tokens=10, seed=0)
    )
    assert [g.token_ids for g in greedy for _ in range(2)] == [o.token_ids for o in nucleus]


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()[None].expand(20000, 4)  # probs by hand
    g = torch.Generator().manual_seed(0)
    # mass above each token: 0, 0.5, 0.8, 0.95 -> top_p 0.8 keeps tokens {0, 1}, top_p 0.81 keeps
    # {0, 1, 2}
    tok, logp, size = sample_tokens(logits, 1.0, 0.8, g)
    assert set(tok.tolist()) == {0, 1} and set(size.tolist()) == {2}
    # renormalised over the kept set
    assert abs((tok == 0).float().mean().item() - 0.5 / 0.8) < 0.02
    # of that set
    torch.testing.assert_close(logp[tok == 1], torch.full_like(logp[tok == 1], 0.3 / 0.8).log())
    assert set(sample_tokens(logits, 1.0, 0.81, g)[0].tolist()) == {0, 1, 2}
    # top-k alone: 0.5, 0.3, 0.15 renormalised
    tok, _, size = sample_tokens(logits, 1.0, generator=g, top_k=3)
    assert set(tok.tolist()) == {0, 1, 2} and set(size.tolist()) == {3}
    assert abs((tok == 2).float().mean().item() - 0.15 / 0.95) < 0.02
    # no truncation: no sizes, no extra work
    assert sample_tokens(logits, 1.0, generator=g)[2] is None


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, 0, 0.9), (0.7, 0, 0.5), (1.0, 5, 1.0), (1.3, 8, 0.8), (1.0, 1, 1.0)],
)
def test_sample_tokens_draws_from_the_truncation_mask_set_and_reports_its_log_prob(
    temperature, top_k, top_p
):
    # The engine's set is algos.truncation_mask's, and its log-prob is the learner's rebuilt one bit
    # for bit: on the same logits both run the same ops (kept_mask_from_size returns the very set,
    # truncated_logprobs the same masked log-softmax), so the ratio is exactly 1 here; end to end
    # only the logits' rounding differs (next test).
    g = torch.Generator().manual_seed(5)
    logits = 3 * torch.randn(4096, VOCAB, generator=g)
    logits[:512] = torch.round(logits[:512])  # ties
    tok, logp, size = sample_tokens(logits, temperature, top_p, g, top_k)
    kept = algos.truncation_mask(logits, temperature, top_k, top_p)
    assert kept.gather(-1, tok[:, None]).all() and torch.equal(size, kept.sum(-1))
    rebuilt = algos.kept_mask_from_size(logits, size, tok)
    assert torch.equal(rebuilt, kept)
    assert torch.equal(truncated_score(logits / temperature, tok, size), logp)
    assert torch.equal(algos.truncated_logprobs(logits, tok, rebuilt, temperature), logp)


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 0, 0.9), (0.7, 0, 0.6), (1.0, 4, 1.0), (1.2, 10, 0.8)]
)
def test_on_policy_ratio_is_one_at_any_top_k_and_top_p(temperature, top_k, top_p):
    """The learner's log-probs of the engine's samples, scored on the recorded sets, equal the
    engine's: ratio exp(learner - engine) = 1 to float rounding (1e-5: the engine's logits come from
    the KV-cache decode, the learner's from a full forward, fp32 sums in another order; bit-equality
    holds on equal logits, test above). Scored over the full vocabulary instead, the ratio is off by
    the dropped mass, far past that bound."""
    model = tiny_model()
    params = SamplingParams(
        n=8,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_tokens=12,
        stop_token_ids=tuple(range(1, VOCAB, 7)),
        seed=11,
    )
    outs = TorchEngine(model, PAD, max_batch_size=5).generate(PROMPTS, params)
    worst_full = 0.0
    for i, out in enumerate(outs):
        engine = torch.tensor(out.logprobs)
        log_ratio = learner_logprobs(model, PROMPTS[i // 8], out, temperature) - engine
        assert log_ratio.abs().max() <= 1e-5
        full = learner_logprobs(model, PROMPTS[i // 8], out, temperature, truncated=False)
        worst_full = max(worst_full, float((full - engine).abs().max()))
        if top_k:
            assert max(out.kept_sizes) <= top_k + 2  # ties with the k-th may join; the logits are
    assert worst_full > 1e-2  # peaked, so ties are rare


def test_default_sampling_records_no_sizes_and_keeps_its_draws():
    # top_p=1, top_k=0: the plain path (no set computed, nothing recorded); the draws are those of
    # torch.multinomial over softmax(logits / T), as before truncation existed
    model = tiny_model()
    outs = TorchEngine(model, PAD).generate(
        PROMPTS, SamplingParams(n=2, temperature=0.9, max_tokens=6, seed=4)
    )
    assert all(o.kept_sizes == [] for o in outs)
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(64, VOCAB, generator=g)
    tok, logp, size = sample_tokens(logits, 0.9, 1.0, torch.Generator().manual_seed(3))
    probs = torch.log_softmax(logits / 0.9, -1).exp()
    assert size is None and torch.equal(
        tok, torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(3)).squeeze(-1)
    )


def test_update_weights(tmp_path):
    old, new = tiny_model(0), tiny_model(1)
    engine = TorchEngine(old, PAD)
    params = SamplingParams(temperature=0.0, max_tokens=10)
    before = [o.token_ids for o in engine.generate(PROMPTS, params)]
    engine.update_weights({k: v.clone() for k, v in new.state_dict().items()})
    after = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in after] != before
    save_model(new, tmp_path)
    reference = TorchEngine(load_model(tmp_path), PAD).generate(PROMPTS, params)
    assert [o.token_ids for o in after] == [o.token_ids for o in reference]
    for a, r in zip(after, reference):
        assert a.logprobs == pytest.approx(r.logprobs, abs=1e-6)

    weights = {k: v.clone() for k, v in old.state_dict().items()}
    snapshot = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with pytest.raises(KeyError, match="unknown"):
        engine.update_weights({**weights, "model.layers.9.mlp.up_proj.weight": torch.zeros(1)})
    with pytest.raises(KeyError, match="missing"):
        engine.update_weights({k: v for k, v in weights.items() if k != "model.norm.weight"})
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights({**weights, "model.norm.weight": torch.ones(3)})
    # untouched
    assert all(torch.equal(v, snapshot[k]) for k, v in engine.model.state_dict().items())


def test_update_weights_on_a_tied_model_accepts_either_name_set():
    cfg = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    engine = TorchEngine(init_model(cfg, 0), PAD)
    src = init_model(cfg, 1).state_dict()  # state_dict() lists the tied matrix under both names
    engine.update_weights(src)
    engine.update_weights({k: v for k, v in src.items() if k != "lm_head.weight"})
    assert torch.equal(engine.model.lm_head.weight, src["model.embed_tokens.weight"])


def test_generate_restores_training_mode():
    model = tiny_model().train()
    TorchEngine(model, PAD).generate(PROMPTS, SamplingParams(max_tokens=2, seed=0))
    assert model.training


def test_weight_buckets_split_by_size_keep_order_and_cast_lazily():
    # float32: 4 bytes each
    sd = {f"w{i}": torch.full((n,), float(i)) for i, n in enumerate([10, 30, 5, 100, 1, 1])}
    buckets = weight_buckets(sd, bucket_bytes=160, dtype=torch.bfloat16)  # 80 bf16 values a bucket
    first = next(buckets)
    assert [k for k, _ in first] == ["w0", "w1", "w2"] and all(
        t.dtype == torch.bfloat16 for _, t in first
    )
    rest = list(buckets)
    # a tensor over the size goes alone
    assert [[k for k, _ in b] for b in rest] == [["w3"], ["w4", "w5"]]
    for name, t in first + [x for b in rest for x in b]:
        assert torch.equal(t, sd[name].to(torch.bfloat16))
    same = [x for b in weight_buckets(sd, bucket_bytes=1 << 20) for x in b]
    assert len(same) == len(sd) and all(
        t.dtype == torch.float32 and torch.equal(t, sd[k]) for k, t in same
    )


def check_weight_sync(engine, model, prompts, params, max_diff: float) -> float:
    """The weight-sync gate in one process, as train.check_weight_sync runs it: the engine samples,
    the learner scores, assert_synced decides."""
    prompts, gens, temperature = sync_probe(engine, prompts, params)
    return assert_synced(logprob_gap(model, prompts, gens, temperature), max_diff, len(gens))


def test_logprob_gap_scores_all_probes_in_one_padded_forward_as_one_at_a_time():
    """logprob_gap runs every probe in one right-padded forward with the head on the generated
    tokens only: the gap it finds is, probe by probe, the one a forward of that probe alone gives
    (to the fp32 it reports in; prompts of different lengths); an empty generation is skipped, a NaN
    anywhere is kept."""
    from rollout import Generation

    model = tiny_model(0).double()
    prompts = [[5, 9, 11, 3], [7], [2, 4, 6, 8, 10, 12, 14], [3, 3]]
    gens = []
    for i, p in enumerate(prompts):
        ids = [(17 * i + j) % 60 + 1 for j in range(3 + i)]
        alone = model.token_logprobs(torch.tensor([p + ids]))[0, len(p) :].tolist()
        gens.append(
            Generation(
                token_ids=ids,
                logprobs=[x + 1e-3 * (i + 1) * (j % 2) for j, x in enumerate(alone)],
                finish_reason="length",
            )
        )
    # probe 3's offset
    assert logprob_gap(model, prompts, gens, 1.0) == pytest.approx(4e-3, abs=1e-6)
    assert logprob_gap(model, prompts[:1], gens[:1], 1.0) == pytest.approx(1e-3, abs=1e-6)
    empty = Generation(token_ids=[], logprobs=[], finish_reason="length")
    assert logprob_gap(model, [prompts[0], [1]], [gens[0], empty], 1.0) == pytest.approx(
        1e-3, abs=1e-6
    )
    assert logprob_gap(model, [[1]], [empty], 1.0) == 0.0
    nan = Generation(token_ids=[1, 2], logprobs=[0.0, float("nan")], finish_reason="length")
    assert math.isnan(logprob_gap(model, prompts[:2], [gens[0], nan], 1.0))


def test_sync_gate_on_the_torch_engine():
    """The gate passes when the engine holds the learner's weights, and fails loudly otherwise."""
    learner, other = tiny_model(0), tiny_model(1)
    engine = TorchEngine(tiny_model(0), PAD)
    params = SamplingParams(temperature=0.7, max_tokens=8, seed=0)
    assert check_weight_sync(engine, learner, PROMPTS, params, max_diff=1e-3) < 1e-5
    assert (
        check_weight_sync(
            engine, learner, PROMPTS, SamplingParams(temperature=0.0, max_tokens=8), 1e-3
        )
        < 1e-5
    )
    with torch.no_grad():  # the learner takes an update that is not pushed
        for p in learner.parameters():
            p.add_(1e-3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    with pytest.raises(RuntimeError, match="weight sync check failed"):
        check_weight_sync(engine, learner, PROMPTS, params, max_diff=1e-3)
    engine.update_weights(learner.state_dict())
    assert check_weight_sync(engine, learner, PROMPTS, params, max_diff=1e-3) < 1e-5
    engine.update_weights(
        {k: torch.full_like(v, float("nan")) for k, v in other.state_dict().items()}
    )
    with pytest.raises(RuntimeError, match="by up to nan"):  # greedy: NaN logits still give tokens
        check_weight_sync(
            engine, learner, PROMPTS, SamplingParams(temperature=0.0, max_tokens=8), max_diff=1e-3
        )
