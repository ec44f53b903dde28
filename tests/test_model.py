"""Tests for model.py: logit parity with Hugging Face transformers (a test-only oracle) in both
directions of checkpoint I/O, sharded round trips, chunked log-probs against a naive full
log-softmax, the KV cache (plain and left-padded) against full forwards, and activation
checkpointing against plain backward. All fp32 on CPU.
"""

import json
import math
import os

import pytest
import torch

from conftest import need

transformers = need("transformers", "the logits-parity oracle")

from rollout import KVCache
from model import ModelConfig, Transformer, init_model, load_model, save_model, train_flops

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # short, so the 3 frequency bands all occur at hd = 8
    "original_max_position_embeddings": 16,
}
COMMON = dict(
    vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4
)
# (name, HF config class, HF model class, extra config fields)
CASES = [
    (
        "qwen2-untied-gqa",
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(num_key_value_heads=2, tie_word_embeddings=False),
    ),
    (
        "qwen2-tied-mqa",
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(num_key_value_heads=1, tie_word_embeddings=True),
    ),
    (
        "qwen3-tied-hd16",
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    ),
    (
        "llama3-untied-gqa",
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling=LLAMA3_ROPE,
        ),
    ),
    (
        "llama-bias-mha",
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True),
    ),
]


def hf_model(case, seed=0):
    """A random Hugging Face model; every parameter (norms and biases too) perturbed so none is a
    no-op."""
    _, cfg_cls, model_cls, extra = case
    cfg = getattr(transformers, cfg_cls)(**COMMON, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def random_ids(B, T, vocab=97, seed=0):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def tiny_model(seed=0, **kw):
    cfg = ModelConfig(**{**COMMON, "num_key_value_heads": 2, **kw})
    model = init_model(cfg, seed)
    with torch.no_grad():  # larger weights than N(0, 0.02), so logits are far from uniform
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + 1)))
    return model


# ----------------------------------------------------------------------------- Hugging Face parity


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_logits_match_transformers_both_ways(case, tmp_path):
    hf = hf_model(case)
    ids = random_ids(3, 40)
    with torch.no_grad():
        expected = hf(ids).logits  # (B, T, V)

    # HF checkpoint -> our model
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ours = load_model(tmp_path / "hf")
    assert ours.cfg.model_type == hf.config.model_type
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == hf.config.tie_word_embeddings
    with torch.no_grad():
        logits = ours(ids)
    assert (logits - expected).abs().max() <= 1e-5
    assert expected.std() > 0.1  # the comparison is not between two near-constant tensors

    # our checkpoint -> HF model, with nothing missing or left over
    save_model(ours, tmp_path / "ours")
    cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert cfg["architectures"] == [type(hf).__name__] and cfg["torch_dtype"] == "float32"
    back, info = type(hf).from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        assert (back.eval()(ids).logits - expected).abs().max() <= 1e-5


def test_llama3_rope_scaling_changes_logits(tmp_path):
    """Guards the parity test above: dropping the scaling must be visible at its tolerance."""
    case = CASES[3]
    hf_model(case).save_pretrained(tmp_path, safe_serialization=True)
    scaled = load_model(tmp_path)
    plain = Transformer(ModelConfig(**{**vars(scaled.cfg), "rope_scaling": None}))
    plain.load_state_dict(scaled.state_dict())
    ids = random_ids(2, 40)
    with torch.no_grad():
        assert (scaled(ids) - plain(ids)).abs().max() > 1e-3


def test_config_from_hf_reads_both_rope_layouts_and_family_defaults():
    legacy = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rope_theta": 5e5,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "some_future_key": 1,
        "attention_bias": True,
    }
    v5 = {k: v for k, v in legacy.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {**legacy["rope_scaling"], "rope_theta": 5e5}
    a, b = ModelConfig.from_hf(legacy), ModelConfig.from_hf(v5)
    assert a == b and a.rope_theta == 5e5 and a.rope_scaling["factor"] == 8.0
    assert a.attention_bias and not a.qk_norm and a.head_dim == 4
    assert ModelConfig.from_hf(a.to_hf()) == a
    assert (
        ModelConfig(model_type="qwen2").attention_bias
        and not ModelConfig(model_type="qwen2").qk_norm
    )
    q3 = ModelConfig(model_type="qwen3")
    assert q3.qk_norm and not q3.attention_bias
    with pytest.raises(NotImplementedError):
        ModelConfig.from_hf({**v5, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})


# ----------------------------------------------------------------------------- our own I/O


def test_init_model_is_deterministic_and_ties():
    a, b, c = (init_model(ModelConfig(tie_word_embeddings=True), s) for s in (0, 0, 1))
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if "norm" not in name and not name.endswith(".bias"):  # norms start at 1, biases at 0
            assert not torch.equal(pa, pc), name
    assert a.lm_head.weight is a.model.embed_tokens.weight


@pytest.mark.parametrize("tied", [False, True])
def test_sharded_save_load_round_trip(tmp_path, tied):
    model = tiny_model(tie_word_embeddings=tied)
    save_model(model, tmp_path / "one")
    save_model(model, tmp_path / "shards", max_shard_bytes=20_000)
    index = json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all(os.path.exists(tmp_path / "shards" / f) for f in files)
    assert ("lm_head.weight" in index["weight_map"]) != tied
    one, sharded = load_model(tmp_path / "one"), load_model(tmp_path / "shards")
    sd, sd1, sd2 = model.state_dict(), one.state_dict(), sharded.state_dict()
    assert sd.keys() == sd1.keys() == sd2.keys()
    assert all(torch.equal(sd[k], sd1[k]) and torch.equal(sd[k], sd2[k]) for k in sd)
    ids = random_ids(2, 12)
    with torch.no_grad():
        assert torch.equal(one(ids), sharded(ids))


def test_load_rejects_a_checkpoint_that_does_not_match_its_config(tmp_path):
    model = tiny_model()
    save_model(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match="missing"):
        load_model(tmp_path)


# ----------------------------------------------------------------------------- log-probs


def naive_logprobs(model, ids, temperature):
    logp_all = torch.log_softmax(model(ids).float() / temperature, dim=-1)  # (B, T, V)
    logp = logp_all[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)[:, :-1]  # (B, T-1)
    zero = torch.zeros(ids.shape[0], 1)
    return torch.cat([zero, logp], 1), torch.cat([zero, ent], 1)


# T - 1 = 15 predictions: some divide it, some don't
@pytest.mark.parametrize("chunk_size", [1, 5, 8, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_equal_naive_log_softmax(chunk_size, temperature):
    model = tiny_model()
    ids = random_ids(3, 16)
    with torch.no_grad():
        exp_logp, exp_ent = naive_logprobs(model, ids, temperature)
        logp = model.token_logprobs(ids, temperature=temperature, chunk_size=chunk_size)
        logp2, ent = model.token_logprobs(ids, temperature, chunk_size, return_entropy=True)
    assert logp.shape == ent.shape == (3, 16)
    torch.testing.assert_close(logp, exp_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(logp2, exp_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, exp_ent, rtol=0, atol=1e-5)
    assert ent[:, 1:].min() > 0.1  # a real distribution, not a point mass


def test_token_logprobs_entropy_at_the_extremes():
    """The entropy the learner logs (and maximises with learner.entropy_coef): log V for uniform
    logits, 0 without overflow for a point mass, and the float64 textbook value in between."""
    model = tiny_model(tie_word_embeddings=False)
    ids = random_ids(2, 6)
    V = model.cfg.vocab_size
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit 0: uniform
        _, ent = model.token_logprobs(ids, return_entropy=True)
        torch.testing.assert_close(ent[:, 1:], torch.full((2, 5), math.log(V)), rtol=1e-6, atol=0)
        # huge logits
        model.lm_head.weight.normal_(generator=torch.Generator().manual_seed(3)).mul_(1e4)
        _, ent = model.token_logprobs(ids, return_entropy=True)
        assert torch.isfinite(ent).all() and ent[:, 1:].max() < 1e-3
        model.lm_head.weight.div_(1e4)
        _, ent = model.token_logprobs(ids, return_entropy=True)
        p = torch.softmax(model(ids).double(), -1)[:, :-1]  # (B, T-1, V) float64
        torch.testing.assert_close(
            ent[:, 1:].double(), -(p * p.log()).sum(-1), rtol=1e-5, atol=1e-6
        )


def test_token_logprobs_gradients_equal_naive():
    """Chunks run under activation checkpointing when grads are on; the gradients must not
    change."""
    ids = random_ids(2, 14)
    grads = []
    for chunked in (False, True):
        model = tiny_model()
        if chunked:
            logp, ent = model.token_logprobs(ids, 0.9, chunk_size=4, return_entropy=True)
        else:
            logp, ent = naive_logprobs(model, ids, 0.9)
        (logp.sum() + 0.3 * ent.sum()).backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
    for k in grads[0]:
        # the chunks sum the gradient in another order: ~100 fp32 ulps of the largest entry
        torch.testing.assert_close(
            grads[1][k], grads[0][k], rtol=1e-5, atol=1e-5 * grads[0][k].abs().max()
        )


def ragged_mask(B, T):
    """A loss mask as the learner sees it: one response span per row, one row with none at all."""
    mask = torch.zeros(B, T)
    for b in range(B):
        if b != 1:
            mask[b, 3 + b : 3 + b + 2 + 2 * b] = 1
    return mask


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_lean_head_scores_only_masked_tokens_in_bounded_chunks(temperature):
    """With a mask, the lm_head sees only the masked tokens' hidden states, at most chunk_size at a
    time, and returns what the plain head returns there (0 elsewhere). The two run the head on
    differently shaped matrices, so a GEMM may round differently: 1e-5 is ~100 fp32 ulps of these
    O(1-10) log-probs."""
    model, ids, mask = tiny_model(), random_ids(4, 16), ragged_mask(4, 16)
    seen = []
    model.lm_head.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].shape[0]))
    with torch.no_grad():
        plain, plain_ent = model.token_logprobs(ids, temperature, return_entropy=True)
        seen.clear()
        lean, lean_ent = model.token_logprobs(
            ids, temperature, chunk_size=4, return_entropy=True, mask=mask
        )
    # only the scored tokens, in bounded tiles
    assert max(seen) <= 4 and sum(seen) == int(mask[:, 1:].sum())
    for full, part in ((plain, lean), (plain_ent, lean_ent)):
        torch.testing.assert_close(part, full * mask, rtol=0, atol=1e-5)
        assert torch.equal(part * (1 - mask), torch.zeros_like(part))


def test_lean_head_gradients_equal_plain_head():
    """The gradient of a masked loss through the lean head equals the plain head's, up to summation
    order (the tiles add the head's gradient in another order: ~100 fp32 ulps of each tensor's
    largest entry); without entropy autograd the log-prob gradient is the same computation, so
    exactly equal."""
    ids, mask = random_ids(4, 14), ragged_mask(4, 14)
    grads = {}
    for name in ("plain", "lean", "lean_logp", "lean_logp_no_entropy_grad"):
        model = tiny_model()
        kw = {} if name == "plain" else {"mask": mask, "chunk_size": 3}
        logp, ent = model.token_logprobs(
            ids, 0.9, return_entropy=True, entropy_grad=name != "lean_logp_no_entropy_grad", **kw
        )
        if name == "lean_logp_no_entropy_grad":
            assert not ent.requires_grad  # a metric: no graph through the vocabulary
        loss = (logp * mask).sum() + (
            0.3 * (ent * mask).sum() if name in ("plain", "lean") else 0.0
        )
        loss.backward()
        grads[name] = {k: p.grad.clone() for k, p in model.named_parameters()}
    for k in grads["plain"]:
        torch.testing.assert_close(
            grads["lean"][k],
            grads["plain"][k],
            rtol=1e-5,
            atol=1e-5 * grads["plain"][k].abs().max(),
        )
        assert torch.equal(grads["lean_logp_no_entropy_grad"][k], grads["lean_logp"][k]), k


def test_train_flops_by_hand():
    """perf/mfu's numerator on tiny_model's shape (qwen2: q/k/v biases; H 32, I 48, 2 layers, 4
    heads of 8, 2 kv heads, V 97), counted by hand: per layer q 32*32+32, k and v 32*16+16 each, o
    32*32, MLP 3*32*48, two norms 32 each
    = 7808; two layers, the final norm 32, one (97, 32) matrix for the lm_head: N = 18752 whether
    tied (the embedding is the lm_head) or not (the lookup costs no FLOPs). Attention: 12 * 2 layers
    * 4 heads * 8 = 768 T^2."""
    for tied in (True, False):
        flops = train_flops(tiny_model(tie_word_embeddings=tied), torch.tensor([3, 5]))
        assert flops == 6 * 18752 * (3 + 5) + 768 * (3**2 + 5**2)


# ----------------------------------------------------------------------------- KV cache


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_kv_cache_prefill_and_decode_equal_full_forward(family):
    model = tiny_model(model_type=family).eval()
    ids = random_ids(2, 20)
    with torch.no_grad():
        full = model(ids)  # (B, T, V)
        cache = KVCache(model.cfg, 2, 24)
        # prefill in two parts
        steps = [model(ids[:, :8], kv_cache=cache), model(ids[:, 8:12], kv_cache=cache)]
        # then one at a time
        steps += [model(ids[:, t : t + 1], kv_cache=cache) for t in range(12, 20)]
    assert cache.pos == 20
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-5)


def test_kv_cache_with_left_padding_equals_unpadded_rows():
    model = tiny_model().eval()
    lengths, new, pad = [9, 4, 1], 5, 0
    # prompt + tokens fed later
    seqs = [random_ids(1, n + new, seed=i)[0] for i, n in enumerate(lengths)]
    L = max(lengths)
    ids = torch.full((3, L), pad)
    real = torch.zeros(3, L + new, dtype=torch.bool)
    real[:, L:] = True
    for i, n in enumerate(lengths):
        ids[i, L - n :] = seqs[i][:n]
        real[i, L - n : L] = True
    positions = (real[:, :L].long().cumsum(-1) - 1).clamp(min=0)  # (B, L)
    with torch.no_grad():
        cache = KVCache(model.cfg, 3, L + new)
        prefill = model(ids, positions, real, cache)  # (B, L, V)
        assert not prefill.isnan().any()  # pad queries see only themselves: finite, ignored
        steps = [
            model(
                torch.stack([s[n + t] for s, n in zip(seqs, lengths)])[:, None],
                torch.tensor(lengths)[:, None] + t,
                real,
                cache,
            )
            for t in range(new)
        ]
        for i, n in enumerate(lengths):
            alone = model(seqs[i][None])[0]  # (n + new, V)
            torch.testing.assert_close(prefill[i, L - n :], alone[:n], rtol=0, atol=1e-5)
            torch.testing.assert_close(
                torch.cat([s[i] for s in steps]), alone[n:], rtol=0, atol=1e-5
            )


def test_key_padding_mask_without_cache_equals_unpadded_rows():
    """The learner path: right padding in one full forward, no cache."""
    model = tiny_model().eval()
    ids = random_ids(2, 10)
    real = torch.ones(2, 10, dtype=torch.bool)
    real[1, 6:] = False
    with torch.no_grad():
        out = model(ids, key_padding_mask=real)
        torch.testing.assert_close(out[1, :6], model(ids[1:, :6])[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(out[0], model(ids[:1])[0], rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- activation
# checkpointing


def test_gradient_checkpointing_gives_the_same_gradients():
    ids = random_ids(2, 12)
    grads, calls = [], []
    for ckpt in (False, True):
        model = tiny_model(model_type="qwen3").train()
        model.gradient_checkpointing = ckpt
        n = []
        model.model.layers[0].register_forward_pre_hook(lambda *_: n.append(1))
        model.token_logprobs(ids).sum().backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        calls.append(len(n))
    assert calls == [1, 2]  # with checkpointing the layer really is recomputed in backward
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=1e-5, atol=1e-7)
