"""QLoRA written by hand (qlora.py): the NF4 levels are the paper's, quantization errors stay within
their bounds, the stored base costs ~0.516 bytes a weight, a quantized model's logits stay close to
the full one's, only the adapters get gradients, the engine gets merged full-precision weights that
reproduce the learner, checkpoints resume exactly, the config refuses nf4 without LoRA, and it
trains the same under torchrun (2 processes, FSDP2)."""

import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from config import load_config
from learner import (
    LearnerConfig,
    make_learner,
    merged_state_dict,
    sft_step,
)
from model import Transformer
from runs import load_checkpoint, save_checkpoint
from wings import qlora
from wings.lora import apply_lora
from wings.qlora import (
    ABSMAX_BLOCK,
    BLOCK,
    NF4,
    NF4_MAX_GAP,
    NF4Linear,
    QLoRALinear,
    apply_qlora,
    dequantize_absmax,
    dequantize_blockwise,
    dequantize_nf4,
    dequantized_weight,
    pack4,
    quantize_absmax,
    quantize_blockwise,
    quantize_nf4,
    unpack4,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dist_cases  # noqa: E402
from dist_cases import CFG, init_model, make_batch  # noqa: E402
from test_distributed import STEP_GRAD_TOL, SUM_TOL, rel_err, run_case, weight_tol  # noqa: E402
from test_train import TINY, same_file, tiny  # noqa: E402,F401  (tiny: the session's default model, built once)
from test_lora import randomize_b  # noqa: E402

# Appendix E of Dettmers et al. 2023 (arXiv 2305.14314), as printed (bitsandbytes' NF4 table,
# float32)
PAPER_NF4 = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
]


def qlora_model(seed=0, rank=4, alpha=8.0):
    return apply_qlora(init_model(CFG, seed=0), rank=rank, alpha=alpha, seed=seed)


# -----------------------------------------------------------------------------
# the data type and its error bounds


def test_nf4_levels_are_the_papers():
    # computed, not copied
    torch.testing.assert_close(NF4, torch.tensor(PAPER_NF4), rtol=0, atol=2e-7)
    assert NF4[7] == 0 and NF4[0] == -1 and NF4[15] == 1 and bool((NF4[1:] > NF4[:-1]).all())
    assert NF4_MAX_GAP == pytest.approx(1 - 0.6961928, abs=1e-6)


def test_pack4_round_trip_and_layout():
    codes = torch.tensor([1, 2, 15, 0, 7, 9], dtype=torch.uint8)
    packed = pack4(codes)
    assert packed.tolist() == [0x12, 0xF0, 0x79]  # first code in the high nibble
    assert torch.equal(unpack4(packed), codes)


def test_blockwise_quantization_is_nearest_level_within_half_a_gap():
    g = torch.Generator().manual_seed(0)
    # rows of different scales
    w = torch.randn(64, 96, generator=g) * torch.rand(64, 1, generator=g)
    codes, absmax = quantize_blockwise(w)
    x = w.reshape(-1, BLOCK)  # (nb, 64)
    assert absmax.shape == (w.numel() // BLOCK,) and torch.equal(absmax, x.abs().amax(1))
    # the obviously-correct reference: the nearest of the 16 levels, by brute force
    ref = (x[..., None] / absmax[:, None, None] - NF4).abs().argmin(-1).flatten()  # (N,)
    assert torch.equal(NF4[codes.long()], NF4[ref])  # ties aside, the same level
    err = (dequantize_blockwise(codes, absmax).reshape(x.shape) - x).abs()  # (nb, 64)
    assert bool((err <= absmax[:, None] * NF4_MAX_GAP / 2 * (1 + 1e-6)).all())
    # each block's largest magnitude is exact (level +-1), and an exact zero stays zero
    top = x.abs().argmax(1)
    assert torch.equal(
        dequantize_blockwise(codes, absmax).reshape(x.shape).gather(1, top[:, None]),
        x.gather(1, top[:, None]),
    )
    zero = torch.zeros(BLOCK)
    zero[5] = 2.0
    c0, a0 = quantize_blockwise(zero)
    assert torch.equal(dequantize_blockwise(c0, a0), zero)  # 0 -> level 7, 2 -> 1.0 * 2


def test_hand_computed_block():
    """One block: absmax 2; 0.9 -> 0.45 of c, nearest level 0.4407 (code 12) -> 0.8814; -0.5 ->
    -0.25, nearest
    -0.2844 (code 4) -> -0.5689."""
    w = torch.zeros(BLOCK)
    w[:3] = torch.tensor([2.0, 0.9, -0.5])
    codes, absmax = quantize_blockwise(w)
    assert codes[:3].tolist() == [15, 12, 4] and absmax.tolist() == [2.0]
    torch.testing.assert_close(
        dequantize_blockwise(codes, absmax)[:3], torch.tensor([2.0, 0.8814196, -0.5688828])
    )


def test_double_quantization_bounds():
    g = torch.Generator().manual_seed(1)
    absmax = torch.rand(600, generator=g) * 0.1 + 0.02  # 3 groups of 256 (the last short)
    absmax[300] = 1.0  # an outlier: group 1's scale only
    q, scale, mean = quantize_absmax(absmax)
    assert q.dtype == torch.int8 and q.shape == (600,) and scale.shape == (3,) and mean.shape == ()
    assert mean == absmax.mean()
    back = dequantize_absmax(q, scale, mean)  # (600,)
    for i in range(3):  # within half a step of its group
        part = slice(i * ABSMAX_BLOCK, (i + 1) * ABSMAX_BLOCK)
        step = (absmax[part] - mean).abs().max() / 127
        assert torch.allclose(scale[i], step)
        assert bool(((back[part] - absmax[part]).abs() <= step / 2 * (1 + 1e-5) + 1e-8).all()), i
    assert scale[1] > 5 * scale[0]  # the outlier widens its own group
    # the full chain: NF4 rounding with the true c, plus the constant's own error (|level| <= 1)
    w = torch.randn(128, 256, generator=g)
    nf4 = quantize_nf4(w)
    codes, c = quantize_blockwise(w)
    c2 = dequantize_absmax(nf4.absmax_q, nf4.absmax_scale, nf4.absmax_mean)
    err = (dequantize_nf4(nf4, w.shape, torch.float32) - w).reshape(-1, BLOCK).abs()  # (nb, 64)
    assert bool((err <= (c * NF4_MAX_GAP / 2 + (c2 - c).abs())[:, None] * (1 + 1e-5)).all())
    assert float((c2 - c).abs().max()) < 0.01 * float(c.min())  # 8 bits cost <1% of any constant
    assert 0.08 < float(err.pow(2).mean().sqrt()) < 0.11  # measured 0.095 for N(0, 1)


def test_a_weight_not_a_whole_number_of_blocks_is_refused():
    with pytest.raises(ValueError, match="multiple of the block size 64"):
        quantize_nf4(torch.randn(3, 7))


def test_stored_base_memory_is_about_half_a_byte_per_weight():
    """4 bits + one int8 constant per 64 + one fp32 per 64 * 256 + the mean: 4.127 bits a weight
    (the paper's)."""
    model = qlora_model()
    n_weights, n_bytes = 0, 0
    for m in model.modules():
        if isinstance(m, (NF4Linear, QLoRALinear)):
            n = m.in_features * m.out_features
            stored = sum(
                b.numel() * b.element_size()
                for k, b in m.named_buffers(recurse=False)
                if k != "nf4_levels"
            )
            assert stored == n // 2 + n // 64 + 4 * -(-(n // 64) // 256) + 4  # exactly the layout
            n_weights, n_bytes = n_weights + n, n_bytes + stored
    assert n_weights == sum(
        p.numel()
        for n, p in init_model(CFG, seed=0).named_parameters()
        if "layers" in n and n.endswith("proj.weight")
    )  # every projection
    assert 0.5 + 1 / 64 < n_bytes / n_weights < 0.53  # small layers: one scale each
    big = quantize_nf4(torch.randn(4096, 4096))  # a 7B model's q_proj
    assert sum(t.numel() * t.element_size() for t in big) / 4096**2 == pytest.approx(
        4.127 / 8, abs=1e-4
    )
    assert not any(
        isinstance(p, torch.Tensor) and p.dtype == torch.uint8 for p in model.parameters()
    )


# -----------------------------------------------------------------------------
# the layers and the model


def test_nf4_layer_is_the_linear_of_its_dequantized_weight_and_only_x_gets_a_gradient():
    g = torch.Generator().manual_seed(2)
    lin = torch.nn.Linear(64, 32)
    layer = NF4Linear(lin)
    x = torch.randn(3, 5, 64, generator=g, requires_grad=True)
    W = dequantized_weight(layer, torch.float32)  # (32, 64)
    assert (W - lin.weight).abs().max() > 0  # quantized: not the weight itself
    x_ref = x.detach().clone().requires_grad_(True)
    y, y_ref = layer(x), F.linear(x_ref, W, lin.bias)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-6)
    y.square().sum().backward()
    y_ref.square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)  # the recomputing backward
    assert [n for n, p in layer.named_parameters()] == ["bias"] and not layer.bias.requires_grad
    sd = {f"l.{k}": v for k, v in layer.state_dict().items()}
    layer.fold_into(sd, "l")  # the engine's name and dtype
    assert set(sd) == {"l.weight", "l.bias"} and torch.equal(sd["l.weight"], W)
    bf = NF4Linear(torch.nn.Linear(64, 32).to(torch.bfloat16))
    assert bf(torch.randn(2, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_starts_equal_to_the_quantized_base_and_only_adapters_get_gradients():
    model = qlora_model()
    wrapped = [n for n, m in model.named_modules() if isinstance(m, QLoRALinear)]
    assert len(wrapped) == 7 * CFG.num_hidden_layers
    # same A as a LoRA run draws
    lora = apply_lora(init_model(CFG, seed=0), rank=4, alpha=8.0, seed=0)
    for n in wrapped:
        assert torch.equal(model.get_submodule(n).lora_A, lora.get_submodule(n).lora_A)
    base = qlora.quantize_linears(init_model(CFG, seed=0))  # no adapters: NF4Linear only
    ids = make_batch().input_ids
    assert torch.equal(model(ids), base(ids))  # B = 0: the quantized base
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{w}.lora_{x}" for w in wrapped for x in "AB"}
    randomize_b(model)
    model(ids).logsumexp(-1).sum().backward()
    assert all((p.grad is not None) == p.requires_grad for p in model.parameters())
    # B != 0: A learns
    assert all(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_A" in n)
    assert all(not b.requires_grad for b in model.buffers())


def test_layers_outside_lora_targets_are_quantized_too():
    model = apply_qlora(init_model(CFG, seed=0), rank=2, alpha=4.0, targets=("q_proj", "v_proj"))
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert type(attn.q_proj) is QLoRALinear and type(attn.v_proj) is QLoRALinear
    assert type(attn.k_proj) is NF4Linear and type(mlp.down_proj) is NF4Linear
    assert type(model.lm_head) is torch.nn.Linear  # tied to the embedding: as is
    assert model.lora_config["target_modules"] == ["q_proj", "v_proj"]
    assert set(merged_state_dict(model)) == set(init_model(CFG, seed=0).state_dict())


def test_quantized_logits_stay_close_to_the_full_model():
    """The bound, stated: on this random-init model the logits move by 4.0% of their norm (relative
    Frobenius) and the next-token distributions by KL 1.5e-5 nats on average; the test allows twice
    that. (The SFT-trained default model measured 1.4% and KL 3.9e-3: docs/qlora.md.) Random tokens,
    4 x 32."""
    full = init_model(CFG, seed=0)
    quant = qlora.quantize_linears(init_model(CFG, seed=0))
    ids = torch.randint(0, CFG.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = full(ids), quant(ids)  # (4, 32, V)
    assert float((a - b).norm() / a.norm()) < 0.08
    lp, lq = a.log_softmax(-1), b.log_softmax(-1)
    assert float((lp.exp() * (lp - lq)).sum(-1).mean()) < 3e-5
    assert float((a - b).abs().max()) > 1e-4  # it did quantize


def test_merged_weights_are_dequantized_base_plus_adapter_and_drive_the_engine():
    from rollout import TorchEngine

    model = qlora_model()
    randomize_b(model)
    sd = merged_state_dict(model)
    plain_names = set(init_model(CFG, seed=0).state_dict())
    assert set(sd) == plain_names  # the engine's names, exactly
    assert all(v.dtype == torch.float32 for v in sd.values())
    m = model.model.layers[1].self_attn.q_proj
    W = dequantized_weight(m, torch.float32)
    torch.testing.assert_close(
        sd["model.layers.1.self_attn.q_proj.weight"],
        W + m.scaling * m.lora_B @ m.lora_A,
        rtol=0,
        atol=1e-7,
    )
    # merging left the model as it was
    assert any(k.endswith("weight_codes") for k in model.state_dict())
    with torch.device("meta"):
        plain = Transformer(CFG)
    plain.load_state_dict(sd, assign=True)
    plain.tie_weights()
    ids = make_batch().input_ids
    torch.testing.assert_close(plain(ids), model(ids), rtol=1e-5, atol=1e-5)
    engine = TorchEngine(init_model(CFG, seed=0).eval(), pad_id=0)
    engine.update_weights(sd)
    torch.testing.assert_close(engine.model(ids), model(ids), rtol=1e-5, atol=1e-5)


def test_checkpoint_holds_adapters_only_and_resumes_exactly(tmp_path):
    cfg = LearnerConfig(lr=1e-2, micro_batch_size=3)
    state = make_learner(qlora_model(), cfg, seed=0)
    b = make_batch()
    for _ in range(2):
        state, _ = sft_step(state, b.input_ids, b.loss_mask, cfg)
    save_checkpoint(state, str(tmp_path / "ck"))
    assert sorted(os.listdir(tmp_path / "ck")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "trainer_state.json",
        "trainer_state.pt",
    ]
    assert json.load(open(tmp_path / "ck" / "adapter_config.json"))["r"] == 4  # LoRA's PEFT files
    state, _ = sft_step(state, b.input_ids, b.loss_mask, cfg)
    resumed = load_checkpoint(make_learner(qlora_model(seed=3), cfg, seed=9), str(tmp_path / "ck"))
    resumed, _ = sft_step(resumed, b.input_ids, b.loss_mask, cfg)
    for (k, x), (_, y) in zip(state.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(x, y), k  # codes re-quantized identically


# -----------------------------------------------------------------------------
# the config and the run


def test_config_refuses_nf4_without_lora_and_unknown_kinds():
    assert load_config("configs/toy_math.yaml", []).model.quantize == "none"
    assert (
        load_config(
            "configs/toy_math.yaml", ["model.quantize=nf4", "learner.lora_rank=8"]
        ).model.quantize
        == "nf4"
    )
    with pytest.raises(ValueError, match="set learner.lora_rank > 0"):
        load_config("configs/toy_math.yaml", ["model.quantize=nf4"])
    with pytest.raises(ValueError, match="must be 'none' or 'nf4'"):
        load_config("configs/toy_math.yaml", ["model.quantize=int4", "learner.lora_rank=8"])


@pytest.mark.slow
def test_a_qlora_run_keeps_the_sync_gate_and_resumes_byte_identically(tiny):
    """train.main with model.quantize=nf4 learner.lora_rank=8: the learner runs an NF4 base, the
    engine the merged full-precision weights, and the weight-sync gate measures them equal (to float
    rounding) after every push. Then test_train's resume check, in its cheapest form: steps 1-2,
    checkpoint, resume, steps 3-4 end with the bytes of the uninterrupted run (adapters, optimizer
    state, metrics)."""
    from train import main

    extra = [
        "steps=4",
        "eval_every=2",
        "log_timings=false",
        "checkpoint_every=2",
        "model.quantize=nf4",
        "learner.lora_rank=8",
        "learner.lora_alpha=16",
        "learner.lr=3e-3",
        "learner.mini_batches=2",
    ]
    full = main(tiny(*extra, "run_name=qlora_full"))["run_dir"]
    lines = [json.loads(l) for l in open(os.path.join(full, "metrics.jsonl"))]
    assert [l["step"] for l in lines] == [0, 1, 2, 3, 4]
    for l in lines[1:]:
        assert l["sync/logprob_abs_diff"] < 1e-3  # measured ~1e-5: rounding
    assert sorted(f for f in os.listdir(os.path.join(full, "final")) if "safetensors" in f) == [
        "adapter_model.safetensors"
    ]
    # plain HF, for eval.py
    assert os.path.exists(os.path.join(full, "final", "merged", "model.safetensors"))
    half = main(tiny(*extra, "steps=2", "run_name=qlora_half"))["run_dir"]
    resumed = main(tiny(*extra, "run_name=qlora_half", f"resume={half}/checkpoints/step_2"))[
        "run_dir"
    ]
    for f in ("adapter_model.safetensors", "trainer_state.pt"):
        assert same_file(os.path.join(full, "final", f), os.path.join(resumed, "final", f)), f
    assert same_file(os.path.join(full, "metrics.jsonl"), os.path.join(resumed, "metrics.jsonl"))


@pytest.mark.slow
def test_qlora_trains_the_same_under_torchrun(tmp_path):
    """tests/test_lora.py's torchrun check on an NF4 base: FSDP2 shards the adapters and the frozen
    biases and leaves the NF4 buffers whole on every rank; the losses, gradients, adapters and
    merged weights match one process."""
    one, two = run_case("qlora", tmp_path)
    assert two["world_size"] == 2
    assert two["losses"][-1] < two["losses"][0] - 0.25  # it learns
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-4)
    for i, (a, b) in enumerate(zip(two["step_grads"], one["step_grads"])):
        assert rel_err(a, b) < (SUM_TOL if i == 0 else STEP_GRAD_TOL), i
    tol = weight_tol(dist_cases.LORA_LR, dist_cases.LORA_STEPS)
    assert set(two["adapters"]) == set(one["adapters"]) and len(one["adapters"]) == 28
    for k, v in one["adapters"].items():
        torch.testing.assert_close(two["adapters"][k], v, rtol=0, atol=tol)
    # plain names on both sides
    assert set(one["merged"]) == set(init_model(CFG, seed=0).state_dict())
    for k, v in one["merged"].items():
        torch.testing.assert_close(two["merged"][k], v, rtol=0, atol=tol)
