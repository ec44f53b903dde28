"""learner.py: the training side of RL: scoring (log-probs, values), the policy update, SFT,
checkpoints.

Everything the learner owns lives in one dataclass, `LearnerState` (model, optimizer, optimizer
step, RNG), that is passed in and a new one returned: `train_step(state, batch, cfg) -> (state,
metrics)`. The model and the optimizer are torch objects, updated in place; the counters are
replaced, never mutated. The dataclass makes it explicit *what* the learner's state is, so that a
checkpoint saves exactly that and a resume restores it.

How one RL update works (train.py says where the batch and its old log-probs come from):
  1. old log-probs: the batch carries the learner's log-probs before the update (compute_logprobs,
  no
     grad). With one optimizer step per batch the PPO ratio is then exactly 1 on the first (only)
     pass: the loss reduces to the on-policy policy gradient, and clipping acts only from the second
     mini-batch on. In that case (old_logprobs_needed is False) the extra scoring pass is skipped:
     the batch says old_from_update and the update takes pi_old = its own log-probs, detached (the
     same numbers).
  2. split the batch into `mini_batches` optimizer steps (shuffled with the learner's own RNG),
  repeated
     for `ppo_epochs`; each mini-batch is split again into micro-batches whose gradients accumulate.
  3. micro-batch split invariance: each micro-batch's loss is weighted by its share of the global
     normaliser (its valid tokens for token-mean, its sequences for the sequence-mean modes), so the
     summed gradient equals the one of the whole mini-batch at once, whatever `micro_batch_size` is.
  4. data parallel (torchrun): every rank holds the same global batch; each mini-batch's rows are
  split
     across ranks (sorted by length, rank r takes every world-th row: balanced and deterministic)
     and FSDP2 sums the ranks' gradients. The weights of point 3 are shares of the *global*
     mini-batch's normaliser, so 1 process and N processes, with any micro-batch size, give the same
     gradient.
  5. shared prompts (shared_prefix): the rows of a group share every token before their first
  sampled one; a
     micro-batch keeps a group together and runs that prefix once, each row's continuation attending
     to its keys and values (model.PrefixKV). The losses and gradients are those of whole rows (to
     rounding), so points 3 and 4 hold unchanged; micro-batches are capped by rows and by token
     positions (microbatch.py).

Sections: config and state; scoring; the RL update; the critic; SFT; the weights an engine loads;
checkpoints. LoRA is a wing (wings/lora.py), reached through two hooks: a module's fold_into
(merged_state_dict) and a model's adapter (save_checkpoint, load_checkpoint). Shapes: B sequences, T
tokens.
Imports: model.py (the network, save/load), algos.py (the losses), microbatch.py (which rows run
together), distributed.py (torchrun, FSDP2).
"""

import copy
import glob
import json
import os
from dataclasses import dataclass, field, replace

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import algos
from distributed import (
    FULL_STATE,
    all_reduce_,
    full_state_dict,
    get_world_size,
    is_main,
    is_sharded,
)
from microbatch import positions_run, rank_micro_batches, row_lens
from model import Transformer, save_model


# -----------------------------------------------------------------------------
# config and state


@dataclass
class LearnerConfig:
    lr: float = 1e-4  # AdamW learning rate (after warmup)
    warmup_steps: int = 0  # linear warmup of the learning rate over this many optimizer steps
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    betas: tuple = (0.9, 0.999)  # AdamW betas
    grad_clip: float = 1.0  # clip the global grad norm to this (<= 0: no clipping)
    micro_batch_size: int = 32  # sequences per forward/backward at most; does not change the result
    # and token positions run per forward/backward at most (rows x longest, or with shared prefixes
    # prefixes + continuations; one row at least): rows sorted by length, short ones many to a
    # micro-batch, long ones few. Bounds activation memory, and is faster than big micro-batches on
    # a CPU (pages mapped and freed each step). Does not change the result. 0: rows only
    max_tokens_per_micro_batch: int = 4096
    # rows that share their first tokens (a group's prompt; in multi-turn every token before the
    # first sampled one, and more where samples agree) run them once per micro-batch, each row
    # attending to them (microbatch.py); same losses and gradients up to float rounding. False:
    # every row whole
    shared_prefix: bool = True
    mini_batches: int = 1  # optimizer steps per RL batch (PPO mini-batches)
    ppo_epochs: int = 1  # passes over the RL batch
    temperature: float = 1.0  # log-probs are of softmax(logits / temperature), as sampled
    # tokens (over all rows of a micro-batch) per chunk of the lm_head and log-softmax: bounds the
    # (tokens, V) fp32 logits block to (this, V)
    logprob_chunk_size: int = 256
    gradient_checkpointing: bool = False  # recompute decoder layers in backward to save activations
    # algos.policy_loss kind: ppo|dual_clip|dapo|gspo|gspo_token|sapo|cispo|gmpo
    policy_loss: str = "ppo"
    # clip ranges, aggregation
    loss: algos.PolicyLossConfig = field(default_factory=algos.PolicyLossConfig)
    kl_coef: float = 0.0  # weight of the KL(policy || reference) term in the loss (0: off)
    kl_kind: str = "k3"  # estimator for that term: k1|k2|k3
    entropy_coef: float = 0.0  # weight of an entropy bonus (0: entropy is only logged)
    # correction for samples from the engine's policy mu, not pi_old (algos.off_policy_weights):
    # kind none|tis|mis, level token|sequence, tis_cap, mis_low/mis_high; each token's loss is
    # weighted by it. none (default): no weight, the mismatch is only measured;
    # rollout.async_rollouts needs tis or mis
    off_policy: algos.OffPolicyConfig = field(default_factory=algos.OffPolicyConfig)
    # under torchrun on GPUs: bf16 params/compute, fp32 gradient reduction (FSDP2
    # MixedPrecisionPolicy); ignored on CPU and in one process
    mixed_precision: bool = True
    # fp32 | bf16: the decoder's matmuls and attention in bf16 (autocast), with fp32 weights,
    # optimizer, residual stream, head and log-softmax; the torch engine samples the same way. CPU:
    # needs avx512_bf16 or AMX (refused without). fp32 reproduces bit for bit; bf16 is ~1.5-2x
    # faster
    precision: str = "fp32"
    lora_rank: int = 0  # LoRA rank r (0: off, every parameter trains)
    lora_alpha: float = 16.0  # LoRA scaling is lora_alpha / lora_rank
    lora_dropout: float = 0.0  # dropout on the input of the adapter path (training only)
    # wrapped linears
    lora_targets: tuple = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )


@dataclass
class LearnerState:
    model: torch.nn.Module  # the policy (a Transformer) or a Critic, updated in place
    optimizer: torch.optim.Optimizer  # AdamW over model's trainable parameters
    # optimizer steps taken so far: the learning-rate schedule's clock (an RL step takes
    # mini_batches x ppo_epochs of them; the loop counts RL steps)
    optimizer_step: int = 0
    rng: torch.Generator = None  # shuffles mini-batches; saved and restored with checkpoints
    # frozen reference policy for the KL term (None when kl_coef == 0)
    ref_model: Transformer | None = None


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # (B, T) long, whole trajectories, right-padded
    loss_mask: torch.Tensor  # (B, T) float, 1 on tokens the policy sampled
    advantages: torch.Tensor  # (B, T) float, advantage of each token (0 where mask is 0)
    # (B, T) pi_old, the ratio's denominator: the learner's log-probs of the batch before this
    # update (compute_logprobs), unless old_from_update
    old_logprobs: torch.Tensor | None = None
    # (B, T) the log-probs of the engine that sampled the tokens (the behaviour policy); for
    # cfg.off_policy (its weights and metrics)
    engine_logprobs: torch.Tensor | None = None
    # (B, T) the frozen reference policy's log-probs; used only when cfg.kl_coef > 0 (the KL term of
    # the loss)
    ref_logprobs: torch.Tensor | None = None
    # no old_logprobs: the update is exactly on-policy (old_logprobs_needed is False) and takes
    # pi_old = its own log-probs, detached
    old_from_update: bool = False
    # (B, T) long, the size of the top-k / top-p set each token was sampled from (0: whole
    # vocabulary; None: no truncation); the policy's log-probs are then of that truncated
    # distribution (truncated_score)
    kept_sizes: torch.Tensor | None = None


def make_learner(
    model: torch.nn.Module, cfg: LearnerConfig, seed: int, ref_model: Transformer | None = None
) -> LearnerState:
    """Wrap a model (the policy, or a Critic) with its AdamW optimizer and RNG."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay
    )
    model.gradient_checkpointing = cfg.gradient_checkpointing
    set_precision(model, cfg.precision)
    if ref_model is not None:
        ref_model.requires_grad_(False).eval()
        set_precision(ref_model, cfg.precision)
    rng = torch.Generator().manual_seed(seed)
    return LearnerState(model=model, optimizer=opt, optimizer_step=0, rng=rng, ref_model=ref_model)


def set_precision(model: torch.nn.Module, precision: str) -> None:
    """learner.precision on every Transformer in `model` (the policy, a Critic's backbone, an
    engine's copy): "bf16" runs their decoder layers under autocast (Transformer.compute_dtype),
    "fp32" as the parameters are. A CPU without native bf16 arithmetic (avx512_bf16 or AMX tiles) is
    refused: autocast would emulate bf16 there, slower than fp32, which is not what anyone asks bf16
    for."""
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"learner.precision={precision!r}: fp32 or bf16")
    device = next(model.parameters()).device
    if (
        precision == "bf16"
        and device.type == "cpu"
        and not (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    ):
        raise ValueError(
            "learner.precision=bf16 needs a CPU with native bf16 arithmetic (avx512_bf16 or AMX); "
            "this one has neither, so bf16 would run slower than fp32: use learner.precision=fp32"
        )
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(
            "learner.precision=bf16: this GPU does not support bf16; use learner.precision=fp32"
        )
    for m in model.modules():
        if isinstance(m, Transformer):
            m.compute_dtype = torch.bfloat16 if precision == "bf16" else None


def old_logprobs_needed(cfg: LearnerConfig) -> bool:
    """Whether the update needs pi_old scored before it (compute_logprobs: one extra forward pass
    over the batch). It does not when the update is exactly on-policy: one optimizer step per batch
    (one mini-batch, one epoch), so every micro-batch's forward runs on the very weights pi_old
    stands for and pi_old = pi.detach(), token for token (TRL skips the pass in the same case); no
    dropout (LoRA's), so the training forward is the scoring forward; and no correction that reads
    pi_old before the update (off_policy's importance weights, which async rollouts need; with
    kind=none the mismatch KL is logged only when the pass runs). The caller adds its own needs
    (train.py: a KL in the reward reads pi_old)."""
    dropout = cfg.lora_rank > 0 and cfg.lora_dropout > 0
    return cfg.mini_batches > 1 or cfg.ppo_epochs > 1 or cfg.off_policy.kind != "none" or dropout


def lr_at(opt_step: int, cfg: LearnerConfig) -> float:
    """Linear warmup, then constant. The value returned is the one the optimizer uses (and that is
    logged)."""
    if cfg.warmup_steps > 0 and opt_step < cfg.warmup_steps:
        return cfg.lr * (opt_step + 1) / cfg.warmup_steps
    return cfg.lr


def _device(model: torch.nn.Module) -> torch.device:
    """Where the model computes (the CPU except under torchrun on GPUs); batches stay on the CPU
    until used."""
    p = next(model.parameters())
    return p.device


# -----------------------------------------------------------------------------
# scoring

# Top-k / top-p sampling: the engine drew each token from softmax(logits / T) renormalised over a
# kept set and recorded the set's size (rollout.sample_tokens). The policy's log-probs, new and old,
# are scored under that same truncated distribution, the set rebuilt on the learner's own logits
# (algos.kept_mask_from_size), so the on-policy ratio to the engine is 1 (to float rounding) instead
# of off by the dropped mass. The reference (the KL term) and the teacher (distillation) are scored
# over the full vocabulary: they are the targets the sampler is compared with, KL(pi_trunc || ref),
# and truncating them with the policy's set would move the target with the policy's sampling
# choices. At pi = ref the KL estimate is then -log(kept mass) per token, but its gradient there has
# zero mean (a constant per position times the score function of the truncated policy).


def truncated_score(
    z: torch.Tensor, tokens: torch.Tensor, kept_sizes: torch.Tensor
) -> torch.Tensor:
    """model.token_logprobs' score of a top-k / top-p sample: log p(y) under softmax(z) renormalised
    over the kept_sizes largest logits (the engine's set, rebuilt on these logits; y always in it;
    0: the whole vocabulary). z = logits / temperature (C, V), tokens (C,), kept_sizes (C,) ->
    (C,)."""
    size = torch.where(kept_sizes > 0, kept_sizes, z.shape[-1])  # (C,)
    return algos.truncated_logprobs(z, tokens, algos.kept_mask_from_size(z, size, tokens), 1.0)


def _kept_size_score(z: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """model.token_logprobs' score that infers a truncated set's size from its log-prob (as float,
    for the (B, T) output): algos.kept_size_from_logprob."""
    return algos.kept_size_from_logprob(z, tokens, logprobs, 1.0).float()


def infer_kept_sizes(
    model: Transformer,
    input_ids: torch.Tensor,
    kept_sizes: torch.Tensor,
    logprobs: torch.Tensor,
    micro_batch_size: int,
    temperature: float = 1.0,
    chunk_size: int = 256,
    max_tokens: int = 0,
    shared_prefix: bool = False,
) -> torch.Tensor:
    """kept_sizes (B, T) with every -1 (a truncated token whose set the engine did not report: vLLM)
    replaced by the size that reproduces the engine's log-prob of it on this model's logits
    (algos.kept_size_from_logprob). One extra scoring pass over those tokens. The model must hold
    the weights that sampled (synchronous rollouts): on other weights the inferred set would absorb
    part of the policy change."""
    todo = kept_sizes < 0  # (B, T)
    if not bool(todo.any()):
        return kept_sizes
    found = compute_logprobs(
        model,
        input_ids,
        micro_batch_size,
        temperature,
        chunk_size,
        todo.float(),
        max_tokens,
        score=_kept_size_score,
        score_args=logprobs,
        shared_prefix=shared_prefix,
    )  # (B, T) sizes, 0 elsewhere
    return torch.where(todo, found.round().long(), kept_sizes)


@torch.no_grad()
def compute_logprobs(
    model: Transformer,
    input_ids: torch.Tensor,
    micro_batch_size: int,
    temperature: float = 1.0,
    chunk_size: int = 256,
    mask: torch.Tensor | None = None,
    max_tokens: int = 0,
    score=None,
    score_args: torch.Tensor | None = None,
    shared_prefix: bool = False,
) -> torch.Tensor:
    """Per-token log-probs of a whole batch, micro-batch by micro-batch, without gradients. -> (B,
    T) With `mask`, rows are grouped by length and only the masked tokens are scored (0 elsewhere).
    max_tokens > 0 packs micro-batches by a token budget (LearnerConfig.max_tokens_per_micro_batch).
    score, score_args (B, T): model.token_logprobs' (truncated_score with the batch's kept sizes: a
    top-k / top-p sample's log-probs). shared_prefix (needs mask): rows that share their first
    tokens run them once (LearnerConfig.shared_prefix). Under torchrun each rank scores its share of
    the rows and a sum over ranks fills in the rest (the other ranks' rows are exact zeros here), so
    every rank returns the same full (B, T) tensor."""
    was_training = model.training
    model.eval()
    dev = _device(model)
    out = torch.zeros(input_ids.shape, dtype=torch.float32)  # (B, T)
    lens = (
        row_lens(mask)
        if mask is not None
        else torch.full((input_ids.shape[0],), input_ids.shape[1])
    )
    share = (input_ids, mask) if shared_prefix and mask is not None else None
    for idx, dummy, shared in rank_micro_batches(lens, micro_batch_size, max_tokens, share):
        L = int(lens[idx].max())
        m = mask[idx, :L].to(dev) if mask is not None else None  # score only the masked tokens
        args = score_args[idx, :L].to(dev) if score_args is not None else None
        logp = model.token_logprobs(
            input_ids[idx, :L].to(dev),
            temperature=temperature,
            chunk_size=chunk_size,
            mask=m,
            score=score,
            score_args=args,
            shared=shared,
        )
        if not dummy:
            out[idx, :L] = logp.float().cpu()  # (m, L)
    model.train(was_training)
    return all_reduce_(out)


def _share(mask_mb: torch.Tensor, mask_all: torch.Tensor, agg_mode: str) -> float:
    """This micro-batch's share of the mini-batch's loss normaliser (see the file docstring, point
    3)."""
    if agg_mode == "token-mean":  # in fp64: the shares of a split sum to 1 to fp64 rounding
        return float(mask_mb.double().sum() / mask_all.double().sum().clamp(min=1))
    # the seq-mean-* modes divide by the number of sequences
    return mask_mb.shape[0] / mask_all.shape[0]


def _optimizer_step(state: LearnerState, cfg: LearnerConfig, opt_step: int) -> dict:
    """Clip, step, zero; `opt_step` is the optimizer step's number (the learning-rate schedule's
    clock). A non-finite gradient norm skips the step (and says so) instead of poisoning the
    weights."""
    params = [p for p in state.model.parameters() if p.requires_grad]
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(grad_norm, "full_tensor"):  # sharded: a DTensor; the norm is of the full gradient
        grad_norm = grad_norm.full_tensor()
    lr = lr_at(opt_step, cfg)
    skipped = not torch.isfinite(grad_norm)
    if not skipped:
        for group in state.optimizer.param_groups:
            group["lr"] = lr
        state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": float(grad_norm), "lr": lr, "skipped_nonfinite": float(skipped)}


def _accumulate(
    state: LearnerState,
    cfg: LearnerConfig,
    mask: torch.Tensor,
    micro_loss,
    opt_step: int,
    input_ids: torch.Tensor | None = None,
) -> dict:
    """Run `micro_loss(idx, L, shared) -> (weighted loss, metrics)` over this rank's micro-batches
    of rows (index tensors into `mask`'s rows, grouped by length; L = the micro-batch's longest used
    length; shared: its SharedPrefix or None), backprop each, then take optimizer step number
    `opt_step`. input_ids (the rows' tokens) with cfg.shared_prefix: rows that share a prompt run it
    once. Metrics come back weighted the same way as the loss, summed over ranks, plus `tokens_used`
    and `tokens_computed` (positions_run). The model and the optimizer are updated in place (they
    are torch objects); the caller returns the state with its step counter advanced."""
    state.model.train()
    metrics: dict[str, float] = {}
    lens = row_lens(mask)
    share = (input_ids, mask) if cfg.shared_prefix and input_ids is not None else None
    plan = rank_micro_batches(lens, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch, share)
    used = computed = 0
    for i, (idx, dummy, shared) in enumerate(plan):
        if is_sharded(state.model):  # reduce-scatter gradients once, after the last micro-batch
            state.model.set_requires_gradient_sync(i == len(plan) - 1)
        L = int(lens[idx].max())
        if not dummy:
            u, c = positions_run(lens[idx], shared)
            used, computed = used + u, computed + c
        loss, m = micro_loss(idx, L, shared)
        if dummy:  # only here to join the collectives: contributes exactly 0
            loss, m = loss * 0.0, {k: 0.0 for k in m}
        if loss.requires_grad:  # a micro-batch with no trained token contributes nothing
            loss.backward()
        for k, v in m.items():
            metrics[k] = metrics.get(k, 0.0) + float(v)
    metrics.update(tokens_used=used, tokens_computed=computed)
    if get_world_size() > 1:  # every rank has the same keys (dummies included)
        keys = sorted(metrics)
        total = all_reduce_(torch.tensor([metrics[k] for k in keys], dtype=torch.float64))
        metrics = dict(zip(keys, total.tolist()))
    metrics.update(_optimizer_step(state, cfg, opt_step))
    return metrics


# -----------------------------------------------------------------------------
# the RL update


def _run_schedule(
    state: LearnerState,
    cfg: LearnerConfig,
    mask: torch.Tensor,
    micro_loss_of,
    input_ids: torch.Tensor | None = None,
) -> tuple:
    """The update's schedule, train_step's and critic_step's: ppo_epochs passes over the batch, each
    split into mini_batches optimizer steps (rows shuffled with state.rng when mini_batches > 1).
    micro_loss_of(rows, mb_mask) gives the micro_loss(idx, L, shared) of a mini-batch (idx indexes
    its rows). mask (B, T) -> (the next optimizer step, the metrics summed over the optimizer steps,
    their number). input_ids (B, T): the tokens, for shared prefixes (train_step's; the critic runs
    every row whole)."""
    B = mask.shape[0]
    sums: dict[str, float] = {}
    n_updates, opt_step = 0, state.optimizer_step
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(B, generator=state.rng) if cfg.mini_batches > 1 else torch.arange(B)
        for rows in order.chunk(cfg.mini_batches):
            mb_mask = mask[rows]  # (b, T)
            step_metrics = _accumulate(
                state,
                cfg,
                mb_mask,
                micro_loss_of(rows, mb_mask),
                opt_step,
                None if input_ids is None else input_ids[rows],
            )
            opt_step += 1
            n_updates += 1
            for k, v in step_metrics.items():
                sums[k] = sums.get(k, 0.0) + v
    return opt_step, sums, n_updates


def train_step(
    state: LearnerState, batch: TrainBatch, cfg: LearnerConfig
) -> tuple[LearnerState, dict]:
    """One RL update on a batch of trajectories -> (the state after it, metrics namespaced
    'train/...'). batch.old_logprobs is required (the caller scored the batch before any update:
    train.compute_advantages), unless batch.old_from_update and the update is exactly on-policy
    (old_logprobs_needed(cfg) is False); batch.ref_logprobs too when cfg.kl_coef > 0."""
    model = state.model
    dev = _device(model)
    mask = batch.loss_mask.float()  # (B, T)
    old = batch.old_logprobs
    if old is None and not batch.old_from_update:
        raise ValueError(
            "train_step needs batch.old_logprobs: score the batch first (compute_logprobs)"
        )
    if old is None and old_logprobs_needed(cfg):
        raise ValueError(
            "batch.old_from_update holds only for an exactly on-policy update (one mini-batch, one "
            "epoch, no off-policy correction, no dropout): score the batch first (compute_logprobs)"
        )
    tis, tis_metrics = None, {}  # off-policy weights (B, T) over the whole batch: a sequence's
    if batch.engine_logprobs is not None and old is not None:
        # weight needs all its tokens, whatever the micro-batches
        tis, tis_metrics = algos.off_policy_weights(
            old, batch.engine_logprobs.to(old.device), mask.to(old.device), cfg.off_policy
        )
        if cfg.off_policy.kind == "none":
            # measured only: the loss untouched, the mismatch KL logged
            tis, tis_metrics = (
                None,
                {k: v for k, v in tis_metrics.items() if k.startswith("mismatch_kl")},
            )
    elif cfg.off_policy.kind != "none" and batch.engine_logprobs is None:
        raise ValueError(
            f"learner.off_policy.kind={cfg.off_policy.kind} needs the engine's log-probs "
            "(TrainBatch.engine_logprobs)"
        )
    set_sizes = batch.kept_sizes  # (B, T) top-k / top-p set sizes
    if set_sizes is not None and bool((set_sizes < 0).any()):
        raise ValueError(
            "batch.kept_sizes has -1 (sets not reported by the engine): infer_kept_sizes first"
        )
    ref = batch.ref_logprobs
    if cfg.kl_coef > 0 and ref is None:
        raise ValueError(
            "learner.kl_coef > 0 needs the reference policy's log-probs (TrainBatch.ref_logprobs)"
        )

    def micro_loss_of(rows: torch.Tensor, mb_mask: torch.Tensor):
        def micro_loss(idx, L, shared):
            r = rows[idx]
            # (m, L) past L: padding
            ids, row_mask = batch.input_ids[r, :L].to(dev), mask[r, :L].to(dev)
            # only the trained tokens are scored; the entropy has autograd only when it is in the
            # loss; a top-k / top-p sample is scored under the truncated distribution it was drawn
            # from (truncated_score)
            trunc = (
                {}
                if set_sizes is None
                else dict(score=truncated_score, score_args=set_sizes[r, :L].to(dev))
            )
            logp, ent = model.token_logprobs(
                ids,
                temperature=cfg.temperature,
                chunk_size=cfg.logprob_chunk_size,
                return_entropy=True,
                mask=row_mask,
                entropy_grad=cfg.entropy_coef > 0,
                shared=shared,
                **trunc,
            )
            # on-policy (old_from_update): pi_old is these very log-probs, before any optimizer step
            old_mb = logp.detach() if old is None else old[r, :L].to(dev)  # (m, L)
            loss, metrics = algos.policy_loss(
                cfg.policy_loss,
                logp,
                old_mb,
                batch.advantages[r, :L].to(dev),
                row_mask,
                cfg.loss,
                None if tis is None else tis[r, :L].to(dev),
            )
            entropy = algos.aggregate(ent, row_mask, cfg.loss.agg_mode, cfg.loss.agg_norm)
            metrics = {**metrics, "pg_loss": loss.detach(), "entropy": entropy.detach()}
            if cfg.entropy_coef:
                loss = loss - cfg.entropy_coef * entropy
            if cfg.kl_coef > 0:
                kl = algos.aggregate(
                    algos.kl_penalty(logp, ref[r, :L].to(dev), cfg.kl_kind),
                    row_mask,
                    cfg.loss.agg_mode,
                    cfg.loss.agg_norm,
                )
                loss = loss + cfg.kl_coef * kl
                metrics["kl"] = kl.detach()
            w = _share(row_mask.cpu(), mb_mask, cfg.loss.agg_mode)
            return loss * w, {k: float(v) * w for k, v in metrics.items()}

        return micro_loss

    opt_step, sums, n_updates = _run_schedule(state, cfg, mask, micro_loss_of, batch.input_ids)
    used, computed = sums.pop("tokens_used"), sums.pop("tokens_computed")
    metrics = {f"train/{k}": v / n_updates for k, v in sums.items()}  # mean over optimizer steps
    # the update's work spent on padding
    metrics["perf/pad_fraction"] = 1.0 - used / max(computed, 1)
    metrics.update({f"train/{k}": float(v) for k, v in tis_metrics.items()})  # of the whole batch
    metrics["train/updates"] = n_updates
    return replace(state, optimizer_step=opt_step), metrics


# -----------------------------------------------------------------------------
# PPO's critic: the policy backbone with a scalar value head


class Critic(torch.nn.Module):
    """V(s_t) for every token position: a copy of the policy's decoder with a linear value head.
    values[:, t] is the value of the state *before* token t (read from the hidden state at t - 1),
    aligned with token_logprobs so one mask serves both."""

    def __init__(self, policy: Transformer):
        super().__init__()
        self.backbone = copy.deepcopy(policy)
        # unused: only hidden states feed the value head
        self.backbone.lm_head.requires_grad_(False)
        self.value_head = torch.nn.Linear(policy.cfg.hidden_size, 1)
        # start at V = 0: no early bias in the advantages
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)
        self.gradient_checkpointing = False

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.backbone.gradient_checkpointing = self.gradient_checkpointing
        h = self.backbone.hidden_states(input_ids)  # (B, T, H)
        v = self.value_head(h[:, :-1].float()).squeeze(-1)  # (B, T-1) state before token t+1
        return torch.cat([v.new_zeros(v.shape[0], 1), v], dim=1)  # (B, T)


@dataclass
class ValueBatch:
    input_ids: torch.Tensor  # (B, T) long
    loss_mask: torch.Tensor  # (B, T) float, 1 on the policy's tokens (the states it acted in)
    old_values: torch.Tensor  # (B, T) values before the update (the clip's centre)
    returns: torch.Tensor  # (B, T) GAE returns, the regression target


@torch.no_grad()
def compute_values(critic: Critic, input_ids: torch.Tensor, micro_batch_size: int) -> torch.Tensor:
    """(B, T) values of every position, without gradients (rows split across ranks like
    compute_logprobs)."""
    out = torch.zeros(input_ids.shape, dtype=torch.float32)  # (B, T)
    dev = _device(critic)
    for idx, dummy, _ in rank_micro_batches(
        torch.full((input_ids.shape[0],), input_ids.shape[1]), micro_batch_size
    ):
        v = critic(input_ids[idx].to(dev)).float().cpu()  # (m, T)
        if not dummy:
            out[idx] = v
    return all_reduce_(out)


def critic_step(
    state: LearnerState, batch: ValueBatch, cfg: LearnerConfig, value_clip: float
) -> tuple[LearnerState, dict]:
    """The clipped value loss (algos.value_loss), token-mean, on train_step's schedule: ppo_epochs
    passes of mini_batches optimizer steps (rows shuffled with the critic's own RNG when
    mini_batches > 1). The first step's values are the old ones, so the clip binds only from the
    second step on: value_clip bounds how far each later step moves a value from old_values. Metrics
    are means over the optimizer steps."""
    mask = batch.loss_mask.float()  # (B, T)
    dev = _device(state.model)

    def micro_loss_of(rows: torch.Tensor, mb_mask: torch.Tensor):
        def micro_loss(idx, L, _):  # every row whole (no input_ids given: no shared prefixes)
            r = rows[idx]
            v = state.model(batch.input_ids[r, :L].to(dev))  # (m, L)
            loss, vf = algos.value_loss(
                v,
                batch.old_values[r, :L].to(dev),
                batch.returns[r, :L].to(dev),
                mask[r, :L].to(dev),
                value_clip,
            )
            w = _share(mask[r, :L], mb_mask, "token-mean")
            return loss * w, {
                "value_loss": float(loss.detach()) * w,
                **{k: float(x) * w for k, x in vf.items()},
            }

        return micro_loss

    opt_step, sums, n_updates = _run_schedule(state, cfg, mask, micro_loss_of)
    # train_step's pad fraction logs those
    sums = {k: v for k, v in sums.items() if not k.startswith("tokens_")}
    return replace(state, optimizer_step=opt_step), {
        f"critic/{k}": v / n_updates for k, v in sums.items()
    }


# -----------------------------------------------------------------------------
# supervised fine-tuning (the warm start of the embedded default model)


def sft_step(
    state: LearnerState, input_ids: torch.Tensor, loss_mask: torch.Tensor, cfg: LearnerConfig
) -> tuple[LearnerState, dict]:
    """One optimizer step of next-token cross-entropy on the tokens where loss_mask is 1 (assistant
    tokens). Token-mean over the whole batch, accumulated over micro-batches like train_step."""
    mask = loss_mask.float()  # (B, T)
    model = state.model
    dev = _device(model)

    def micro_loss(idx, L, _):  # every row whole: demonstrations rarely share a prompt
        ids, row_mask = input_ids[idx, :L].to(dev), mask[idx, :L]
        # (m, L)
        logp = model.token_logprobs(ids, chunk_size=cfg.logprob_chunk_size, mask=row_mask.to(dev))
        nll = algos.aggregate(-logp, row_mask.to(dev), "token-mean")
        w = _share(row_mask, mask, "token-mean")
        return nll * w, {"loss": float(nll.detach()) * w}

    step_metrics = _accumulate(state, cfg, mask, micro_loss, state.optimizer_step)
    step_metrics = {k: v for k, v in step_metrics.items() if not k.startswith("tokens_")}
    return replace(state, optimizer_step=state.optimizer_step + 1), {
        f"sft/{k}": v for k, v in step_metrics.items()
    }


# -----------------------------------------------------------------------------
# the weights an engine loads (adapters folded in)


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the inference engine loads: full_state_dict(model) with every adapter folded into the
    weight it adapts (a module with a `fold_into(sd, name)` hook: lora.LoRALinear, W' = W + s * B @
    A). Without adapters: full_state_dict(model). Sharded: every rank calls it, rank 0 gets the dict
    (the others an empty one)."""
    sd = full_state_dict(model)
    adapters = [(n, m) for n, m in model.named_modules() if hasattr(m, "fold_into")]
    if not sd or not adapters:
        return sd
    sd = dict(sd)  # a new dict: the live state_dict's entries stay untouched
    for name, m in adapters:
        m.fold_into(sd, name)
    return sd


# -----------------------------------------------------------------------------
# checkpoints: weights in Hugging Face layout + optimizer, optimizer step and RNG state beside them


def save_checkpoint(
    state: LearnerState, path: str, extra: dict | None = None, base_model: str = ""
) -> None:
    """Write `path/` as a loadable HF folder (config.json, model.safetensors) plus
    `trainer_state.pt` (optimizer, optimizer step, RNG states) and `trainer_state.json` (that step
    and `extra`, human-readable). A LoRA model writes only its adapter (save_adapter: PEFT names;
    `base_model` goes into adapter_config.json).
    Sharded: every rank calls it (weights and optimizer state are gathered), rank 0 writes. The
    optimizer state is keyed by parameter name, so a checkpoint resumes under any number of
    processes."""
    model = state.model
    # a wing's adapters (lora.py): only they train, only they are saved
    adapter = getattr(model, "adapter", None)
    if adapter is not None:
        adapter.save(model, path, base_model)
        sd = {}
    else:
        sd = full_state_dict(model)
    optim = get_optimizer_state_dict(model, state.optimizer, options=FULL_STATE)
    if not is_main():
        return
    os.makedirs(path, exist_ok=True)
    if sd and isinstance(model, Transformer):
        # Hugging Face layout: loadable by any engine. save_model reads a module: a sharded one is
        # not one
        save_model(_plain_model(model.cfg, sd) if is_sharded(model) else model, path)
    elif sd:
        save_file(
            {k: v.detach().clone() for k, v in sd.items()},  # clone: tied weights
            os.path.join(path, "model.safetensors"),
        )
    torch.save(
        {
            "optimizer": optim,
            "optimizer_step": state.optimizer_step,
            "rng": state.rng.get_state(),
            "torch_rng": torch.get_rng_state(),
        },
        os.path.join(path, "trainer_state.pt"),
    )
    with open(os.path.join(path, "trainer_state.json"), "w") as f:
        json.dump({"optimizer_step": state.optimizer_step, **(extra or {})}, f, indent=2)


def _plain_model(cfg, sd: dict) -> Transformer:
    """An unsharded Transformer holding the tensors of `sd` (no copy)."""
    with torch.device("meta"):
        plain = Transformer(cfg)
    plain.load_state_dict(sd, strict=False, assign=True)
    plain.tie_weights()
    return plain


def save_merged(model: Transformer, path: str) -> None:
    """A Hugging Face folder (config.json, model.safetensors) of merged_state_dict(model): a LoRA
    run's weights as a plain model that eval.py, transformers or vLLM load. Every rank calls it,
    rank 0 writes."""
    sd = merged_state_dict(model)
    if is_main():
        save_model(_plain_model(model.cfg, {k: v.detach().cpu() for k, v in sd.items()}), path)


def _tied(model) -> bool:
    m = model if isinstance(model, Transformer) else model.backbone
    return m.cfg.tie_word_embeddings


def load_checkpoint(state: LearnerState, path: str) -> LearnerState:
    """Restore weights (or a LoRA model's adapters), optimizer, optimizer step and RNG from `path`
    into `state` (built the same way as when saved, with any number of processes). Every rank reads
    the files."""
    adapter = getattr(state.model, "adapter", None)
    if adapter is not None:
        adapter.load(state.model, path)
    else:
        sd = {}
        for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            sd.update(load_file(f))
        expected = set(state.model.state_dict())
        missing = [
            k
            for k in expected - set(sd)
            if not (k.endswith("lm_head.weight") and _tied(state.model))
        ]
        unexpected = sorted(set(sd) - expected)
        if missing or unexpected:
            raise ValueError(
                f"checkpoint {path}: missing {sorted(missing)[:5]}, unexpected {unexpected[:5]}"
            )
        if is_sharded(state.model):  # each rank keeps its shard of the full tensors
            set_model_state_dict(
                state.model, sd, options=StateDictOptions(full_state_dict=True, strict=False)
            )
        else:
            state.model.load_state_dict(sd, strict=False)
    ts = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
    set_optimizer_state_dict(
        state.model,
        state.optimizer,
        ts["optimizer"],
        options=StateDictOptions(full_state_dict=True),
    )
    for group in state.optimizer.param_groups:
        # the loader hands tuples (AdamW's betas) back as lists: the same
        # as saved
        group.update(
            {k: tuple(v) for k, v in group.items() if k != "params" and isinstance(v, list)}
        )
    state.rng.set_state(ts["rng"])
    torch.set_rng_state(ts["torch_rng"])
    return replace(state, optimizer_step=ts["optimizer_step"])
