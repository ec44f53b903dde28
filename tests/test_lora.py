"""LoRA written by hand: starts equal to the base, trains only adapters, merges exactly, writes
PEFT-named adapters that round-trip, and trains the same under torchrun (2 processes, FSDP2) as in
one process."""

import copy
import json
import os
import sys

import pytest
import torch

from conftest import need

from learner import (
    LearnerConfig,
    make_learner,
    merged_state_dict,
    sft_step,
)
from model import Transformer
from runs import load_checkpoint, save_checkpoint
from wings.lora import LoRALinear, apply_lora, load_adapter, save_adapter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dist_cases  # noqa: E402
from dist_cases import CFG, init_model, make_batch  # noqa: E402
from test_distributed import STEP_GRAD_TOL, SUM_TOL, rel_err, run_case, weight_tol  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_model(seed=0, rank=4, alpha=8.0):
    return apply_lora(init_model(CFG, seed=0), rank=rank, alpha=alpha, targets=TARGETS, seed=seed)


def randomize_b(model, seed=1):
    """Trained-looking adapters: B != 0 (at init B = 0 and the adapter is a no-op)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.1)


def test_zero_init_equals_base_and_only_adapters_train():
    base = init_model(CFG, seed=0)
    model = lora_model()
    ids = make_batch().input_ids
    assert torch.equal(model(ids), base(ids))  # B = 0: exactly the base model
    wrapped = [n for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    assert len(wrapped) == 7 * CFG.num_hidden_layers
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{w}.lora_{x}" for w in wrapped for x in "AB"}
    state = make_learner(model, LearnerConfig(lr=1e-2), seed=0)
    assert sum(p.numel() for g in state.optimizer.param_groups for p in g["params"]) == sum(
        p.numel() for n, p in model.named_parameters() if n in trainable
    )
    b = make_batch()
    before = copy.deepcopy(model.state_dict())
    for _ in range(2):  # step 1 moves B; then A gets gradients too
        state, _ = sft_step(state, b.input_ids, b.loss_mask, LearnerConfig(lr=1e-2))
    after = model.state_dict()
    for k, v in before.items():
        assert torch.equal(v, after[k]) != ("lora_" in k), k  # adapters moved, nothing else did


def test_merged_weights_and_logits():
    model = lora_model()
    randomize_b(model)
    sd = merged_state_dict(model)
    assert not any("lora" in k for k in sd)
    assert set(sd) == set(init_model(CFG, seed=0).state_dict())  # the engine's names, exactly
    m = model.model.layers[1].self_attn.q_proj
    torch.testing.assert_close(
        sd["model.layers.1.self_attn.q_proj.weight"],
        m.weight + m.scaling * m.lora_B @ m.lora_A,
        rtol=0,
        atol=1e-7,
    )
    assert m.scaling == 8.0 / 4
    assert torch.equal(
        model.model.layers[1].self_attn.q_proj.weight,
        init_model(CFG, seed=0).state_dict()["model.layers.1.self_attn.q_proj.weight"],
    )  # merging did not touch the live weights
    with torch.device("meta"):
        plain = Transformer(CFG)
    plain.load_state_dict(sd, assign=True)
    plain.tie_weights()
    ids = make_batch().input_ids
    lora_logits = model(ids)
    # the adapters do change the model
    assert (lora_logits - init_model(CFG, seed=0)(ids)).abs().max() > 1e-3
    torch.testing.assert_close(plain(ids), lora_logits, rtol=1e-5, atol=1e-5)


def test_merged_weights_load_into_the_engine():
    from rollout import TorchEngine

    model = lora_model()
    randomize_b(model)
    engine = TorchEngine(init_model(CFG, seed=0).eval(), pad_id=0)
    engine.update_weights(merged_state_dict(model))
    ids = make_batch().input_ids
    torch.testing.assert_close(engine.model(ids), model(ids), rtol=1e-5, atol=1e-5)


def test_adapter_files_round_trip_with_peft_names(tmp_path):
    model = lora_model()
    randomize_b(model)
    save_adapter(model, str(tmp_path), base_model="some/base")
    from safetensors.torch import load_file

    tensors = load_file(tmp_path / "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in tensors
    assert len(tensors) == 2 * 7 * CFG.num_hidden_layers
    assert tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (
        4,
        CFG.hidden_size,
    )
    config = json.load(open(tmp_path / "adapter_config.json"))
    assert (
        config["peft_type"] == "LORA"
        and config["task_type"] == "CAUSAL_LM"
        and config["bias"] == "none"
    )
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 8.0, 0.0)
    assert (
        sorted(config["target_modules"]) == sorted(TARGETS)
        and config["base_model_name_or_path"] == "some/base"
    )

    other = lora_model(seed=5)  # different A, zero B
    load_adapter(other, str(tmp_path))
    for (k, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), k
    with pytest.raises(ValueError, match="r=8"):
        load_adapter(lora_model(rank=8), str(tmp_path))


def test_peft_names_match_peft_itself():
    """Test-only oracle: peft's own state dict of the same model has our names (needs peft and
    transformers)."""
    peft = need("peft", "the LoRA name oracle")
    transformers = need("transformers", "the LoRA name oracle")
    hf = transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(
            vocab_size=CFG.vocab_size,
            hidden_size=CFG.hidden_size,
            intermediate_size=CFG.intermediate_size,
            num_hidden_layers=CFG.num_hidden_layers,
            num_attention_heads=CFG.num_attention_heads,
            num_key_value_heads=CFG.num_key_value_heads,
            tie_word_embeddings=True,
        )
    )
    wrapped = peft.get_peft_model(
        hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(TARGETS))
    )
    theirs = set(peft.get_peft_model_state_dict(wrapped))
    model = lora_model()
    ours = {
        f"base_model.model.{n}.lora_{x}.weight"
        for n, m in model.named_modules()
        if isinstance(m, LoRALinear)
        for x in "AB"
    }
    assert ours == theirs


def test_lora_checkpoint_resume(tmp_path):
    cfg = LearnerConfig(lr=1e-2, micro_batch_size=3)
    state = make_learner(lora_model(), cfg, seed=0)
    b = make_batch()
    for _ in range(2):
        state, _ = sft_step(state, b.input_ids, b.loss_mask, cfg)
    save_checkpoint(state, str(tmp_path / "ck"))
    assert not os.path.exists(tmp_path / "ck" / "model.safetensors")  # adapter-only
    assert os.path.exists(tmp_path / "ck" / "adapter_model.safetensors")
    state, _ = sft_step(state, b.input_ids, b.loss_mask, cfg)
    resumed = load_checkpoint(make_learner(lora_model(seed=3), cfg, seed=9), str(tmp_path / "ck"))
    resumed, _ = sft_step(resumed, b.input_ids, b.loss_mask, cfg)
    for (k, x), (_, y) in zip(state.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(x, y), k


@pytest.mark.slow
def test_lora_trains_the_same_under_torchrun(tmp_path):
    one, two = run_case("lora", tmp_path)
    assert two["world_size"] == 2
    # it learns (random tokens through frozen 32-wide embeddings: ~4.1 -> ~3.7 nats in 15 steps)
    assert two["losses"][-1] < two["losses"][0] - 0.25
    # the same within what fp32 summation order allows on any CPU (tests/test_distributed.py says
    # why) ~4 nats: rounding moves them ~1e-7
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-4)
    assert len(two["step_grads"]) == len(one["step_grads"]) == dist_cases.LORA_STEPS
    for i, (a, b) in enumerate(zip(two["step_grads"], one["step_grads"])):
        # what each AdamW step was given
        assert rel_err(a, b) < (SUM_TOL if i == 0 else STEP_GRAD_TOL), i
    tol = weight_tol(dist_cases.LORA_LR, dist_cases.LORA_STEPS)
    assert set(two["adapters"]) == set(one["adapters"]) and len(one["adapters"]) == 28
    for k, v in one["adapters"].items():  # the gathered adapters are one process's
        torch.testing.assert_close(two["adapters"][k], v, rtol=0, atol=tol)
    for k, v in one["merged"].items():
        assert "lora" not in k
        torch.testing.assert_close(two["merged"][k], v, rtol=0, atol=tol)
