"""The computations that tests/test_distributed.py and tests/test_lora.py run twice: in the pytest
process (one process, the reference) and under `torchrun --nproc_per_node 2` (gloo, FSDP2), then
compare.

    PYTHONPATH=. torchrun --nproc_per_node 2 tests/dist_cases.py grads OUT.pt
    PYTHONPATH=. torchrun --nproc_per_node 2 tests/dist_cases.py lora OUT.pt    (qlora: the same on
    an NF4 base)

Each case returns a dict of plain tensors/floats, the same on every rank; rank 0 saves it.
"""

import copy
import dataclasses
import sys

import torch

from distributed import (
    cleanup_distributed,
    full_state_dict,
    get_world_size,
    init_distributed,
    is_main,
    shard_model,
)
from learner import (
    LearnerConfig,
    TrainBatch,
    compute_logprobs,
    make_learner,
    merged_state_dict,
    sft_step,
    train_step,
)
from model import ModelConfig, init_model
from wings.lora import apply_lora
from wings.qlora import apply_qlora

CFG = ModelConfig(
    model_type="qwen2",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)


TRAIN_LR = 1e-3  # case_grads' two train_steps: 2 mini-batches x 2 PPO epochs = 4 AdamW steps each
LORA_LR, LORA_STEPS = 1e-2, 15  # case_lora's SFT


def make_batch(B=8, T=12, seed=0, groups=0) -> TrainBatch:
    """Ragged responses, one row fully masked (same as tests/test_learner.py). groups > 0: row b
    shares its first 4 tokens (its prompt) with every row b' = b mod groups, and rows 0 and `groups`
    their first response token too (learner.shared_prefix's case)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CFG.vocab_size, (B, T), generator=g)
    if groups:
        ids[:, :4] = ids[torch.arange(B) % groups, :4]
        ids[groups, 4] = ids[0, 4]
    mask = torch.zeros(B, T)
    for b in range(B):
        if b != 3:
            mask[b, 4 : 4 + 1 + b % 7] = 1
    adv = torch.randn(B, 1, generator=g) * mask  # (B, T)
    return TrainBatch(ids, mask, adv)


def scored(state, batch: TrainBatch, cfg: LearnerConfig) -> TrainBatch:
    """The batch with the learner's log-probs before the update, as train.compute_advantages gives
    it."""
    old = compute_logprobs(
        state.model,
        batch.input_ids,
        cfg.micro_batch_size,
        cfg.temperature,
        cfg.logprob_chunk_size,
        batch.loss_mask,
        cfg.max_tokens_per_micro_batch,
        shared_prefix=cfg.shared_prefix,
    )
    return dataclasses.replace(batch, old_logprobs=old)


def first_step_grad(state) -> torch.Tensor:
    """AdamW's first step stores exp_avg = (1 - beta1) * grad: the accumulated (global) gradient,
    gathered."""
    b1 = state.optimizer.param_groups[0]["betas"][0]
    out = []
    for p in state.model.parameters():
        if p.requires_grad:
            m = state.optimizer.state[p]["exp_avg"]
            m = m.full_tensor() if hasattr(m, "full_tensor") else m  # sharded: a DTensor
            out.append(m.flatten() / (1 - b1))
    return torch.cat(out)


def _learner(model, cfg):
    return make_learner(shard_model(model, cfg), cfg, seed=0)


def record_gradients(state) -> list:
    """Before every optimizer step, append the whole (gathered) gradient to the returned list: what
    the step is given, the quantity that is the same in 1 and N processes up to fp32 summation order
    (AdamW then amplifies that rounding noise on near-zero gradients, so trained weights agree less
    tightly than gradients do)."""
    steps = []

    def hook(optimizer, args, kwargs):
        grads = []
        for p in state.model.parameters():
            if p.requires_grad:
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                # sharded: a DTensor
                grads.append((g.full_tensor() if hasattr(g, "full_tensor") else g).flatten())
        steps.append(torch.cat(grads).clone())

    state.optimizer.register_step_pre_hook(hook)
    return steps


def case_grads() -> dict:
    """The first update's gradient for three aggregation modes x three micro-batch sizes, on an
    8-row batch and a 7-row one (uneven across 2 ranks: one rank runs a dummy micro-batch); the
    weights after two train_steps with shuffled mini-batches and PPO epochs; the gathered full state
    dict."""
    base = init_model(CFG, seed=0)
    out = {
        "fresh": {
            k: v.detach().clone()
            for k, v in full_state_dict(shard_model(copy.deepcopy(base), LearnerConfig())).items()
        }
    }
    for B in (8, 7):
        for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
            for mbs in (8, 3, 1):
                cfg = LearnerConfig(micro_batch_size=mbs, grad_clip=0.0)
                cfg.loss.agg_mode = agg
                state = _learner(copy.deepcopy(base), cfg)
                state, m = train_step(state, scored(state, make_batch(B=B), cfg), cfg)
                out[f"grad/B{B}/{agg}/mbs{mbs}"] = first_step_grad(state)
                out[f"metrics/B{B}/{agg}/mbs{mbs}"] = {
                    k: m[k] for k in ("train/pg_loss", "train/entropy")
                }
    for B in (8, 7):  # rows sharing prompts, each run once (learner.shared_prefix) or whole
        for share in (False, True):
            for mbs in (8, 3, 1):
                cfg = LearnerConfig(micro_batch_size=mbs, grad_clip=0.0, shared_prefix=share)
                state = _learner(copy.deepcopy(base), cfg)
                state, m = train_step(state, scored(state, make_batch(B=B, groups=3), cfg), cfg)
                out[f"grad/grouped{B}/share{int(share)}/mbs{mbs}"] = first_step_grad(state)
    cfg = LearnerConfig(lr=TRAIN_LR, micro_batch_size=3, mini_batches=2, ppo_epochs=2)
    state = _learner(copy.deepcopy(base), cfg)
    out["step_grads"] = record_gradients(state)
    for s in range(2):
        state, m = train_step(state, scored(state, make_batch(seed=s), cfg), cfg)
    sd = full_state_dict(state.model)
    out["trained"] = {k: v.detach().clone() for k, v in sd.items()}
    out["grad_norm"] = m["train/grad_norm"]
    out["world_size"] = get_world_size()
    return out


def case_lora(wrap=apply_lora) -> dict:
    """LoRA (r=4) SFT on one fixed batch for 15 steps: the losses, the adapters and the merged
    weights. `wrap`: apply_lora, or qlora.apply_qlora (the base in NF4, tests/test_qlora.py)."""
    cfg = LearnerConfig(lr=LORA_LR, micro_batch_size=3, grad_clip=1.0)
    model = wrap(init_model(CFG, seed=0), rank=4, alpha=8.0, seed=0)
    state = _learner(model, cfg)
    step_grads = record_gradients(state)
    b = make_batch()
    losses = []
    for _ in range(LORA_STEPS):
        state, m = sft_step(state, b.input_ids, b.loss_mask, cfg)
        losses.append(m["sft/loss"])
    sd = full_state_dict(state.model)
    return {
        "losses": losses,
        "step_grads": step_grads,
        "adapters": {k: v.detach().clone() for k, v in sd.items() if "lora_" in k},
        "merged": {k: v.detach().clone() for k, v in merged_state_dict(state.model).items()},
        "world_size": get_world_size(),
    }


CASES = {"grads": case_grads, "lora": case_lora, "qlora": lambda: case_lora(apply_qlora)}

if __name__ == "__main__":
    torch.set_num_threads(1)
    init_distributed()
    result = CASES[sys.argv[1]]()
    if is_main():
        torch.save(result, sys.argv[2])
    cleanup_distributed()
