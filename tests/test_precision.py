"""learner.precision=bf16: the decoder's matmuls in bf16 under autocast, everything a step keeps in
fp32 (weights, optimizer state, residual stream, head, log-softmax), the engine sampling the same
way, and a refusal on a CPU that has no bf16 arithmetic. These hold on any CPU:
Transformer.compute_dtype is set directly where a test needs bf16 arithmetic whatever the hardware
(autocast emulates it where the CPU lacks it: slower, the same numbers), and the refusal is tested
by making the CPU look like one without."""

import copy

import pytest
import torch

import learner
from learner import LearnerConfig, TrainBatch, make_learner, set_precision, train_step
from model import ModelConfig, init_model
from rollout import SamplingParams, TorchEngine, default_sync_threshold, logprob_gap

CFG = ModelConfig(
    model_type="qwen2",
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)


def batch(B=8, T=16, seed=0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CFG.vocab_size, (B, T), generator=g)
    mask = torch.zeros(B, T)
    mask[:, 6:] = 1
    return TrainBatch(ids, mask, torch.randn(B, 1, generator=g) * mask, old_from_update=True)


def first_grad(model, cfg: LearnerConfig) -> tuple[torch.Tensor, learner.LearnerState]:
    state = make_learner(model, cfg, seed=0)
    grads = []
    state.optimizer.register_step_pre_hook(
        lambda *_: grads.append(torch.cat([p.grad.flatten() for p in state.model.parameters()]))
    )
    state, _ = train_step(state, batch(), cfg)
    return grads[0], state


def bf16_anyway(monkeypatch):
    """Let set_precision accept bf16 on this CPU whatever it has (the arithmetic is the same,
    emulated or not)."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)


def test_bf16_computes_the_decoder_in_bf16_and_keeps_fp32_everywhere_else(monkeypatch):
    bf16_anyway(monkeypatch)
    model = init_model(CFG, seed=0)
    seen = {}
    model.model.layers[0].self_attn.q_proj.register_forward_hook(
        lambda m, i, o: seen.update(q=o.dtype)
    )
    model.lm_head.register_forward_hook(lambda m, i, o: seen.update(head=o.dtype))
    g32, _ = first_grad(copy.deepcopy(model), LearnerConfig(grad_clip=0.0))
    assert seen == {"q": torch.float32, "head": torch.float32}
    g16, state = first_grad(model, LearnerConfig(grad_clip=0.0, precision="bf16"))
    # the head (and its log-softmax) stay fp32
    assert seen == {"q": torch.bfloat16, "head": torch.float32}
    assert all(p.dtype == torch.float32 and p.grad is None for p in state.model.parameters())
    assert all(
        v.dtype == torch.float32
        for s in state.optimizer.state.values()
        for v in s.values()
        # AdamW's moments: fp32 master state
        if torch.is_tensor(v) and v.is_floating_point()
    )
    # the same gradient to bf16's rounding: 8 bits of mantissa, ~0.4% per matmul input, a few %
    # overall
    cos = torch.nn.functional.cosine_similarity(g16, g32, dim=0)
    assert cos > 0.999 and abs(g16.norm() / g32.norm() - 1) < 0.02
    assert not torch.equal(g16, g32)  # and it is bf16: not the fp32 numbers


def test_the_engine_samples_in_the_learners_precision_and_the_gate_holds(monkeypatch):
    """An engine over a model in bf16 precision samples with bf16 matmuls; its log-probs and the
    learner's (the same precision, whole rows) differ by rounding, well inside the gate's bf16
    threshold, and other weights fail it."""
    bf16_anyway(monkeypatch)
    model = init_model(CFG, seed=0)
    set_precision(model, "bf16")
    engine = TorchEngine(model, pad_id=0)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=0)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    gens = engine.generate(prompts, params)
    gap = float(logprob_gap(model, [p for p in prompts for _ in range(4)], gens, 1.0))
    threshold = default_sync_threshold("float32", "bf16")
    assert 0 < gap < threshold / 5
    other = init_model(CFG, seed=1)
    set_precision(other, "bf16")
    assert float(logprob_gap(other, [p for p in prompts for _ in range(4)], gens, 1.0)) > threshold


def test_bf16_is_refused_on_a_cpu_without_it(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    with pytest.raises(ValueError, match="avx512_bf16 or AMX"):
        make_learner(init_model(CFG, seed=0), LearnerConfig(precision="bf16"), seed=0)
    # fp32 always runs
    make_learner(init_model(CFG, seed=0), LearnerConfig(precision="fp32"), seed=0)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        set_precision(init_model(CFG, seed=0), "fp16")


def test_fp32_is_bit_for_bit_the_plain_model(monkeypatch):
    """precision=fp32 (the default) sets nothing: the same gradient, bit for bit, as a model never
    touched."""
    model = init_model(CFG, seed=0)
    a, _ = first_grad(copy.deepcopy(model), LearnerConfig(grad_clip=0.0))
    b, _ = first_grad(copy.deepcopy(model), LearnerConfig(grad_clip=0.0, precision="fp32"))
    assert torch.equal(a, b) and model.compute_dtype is None
