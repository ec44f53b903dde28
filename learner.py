"""learner.py: the training side of RL: scoring (log-probs, values), the policy update, SFT.

Everything the learner owns lives in one dataclass, `LearnerState` (model, optimizer, optimizer
step, RNG), that is passed in and a new one returned: `train_step(state, batch, cfg) -> (state,
metrics)`. The model and the optimizer are torch objects, updated in place; the counters are
replaced, never mutated. The dataclass makes it explicit *what* the learner's state is, so that a
checkpoint saves exactly that and a resume restores it (runs.save_checkpoint, runs.load_checkpoint).

How one RL update works (train.py says where the batch and its old log-probs come from):
  1. old log-probs: the batch carries the learner's log-probs before the update (compute_logprobs,
     no grad). With one optimizer step per batch the PPO ratio is then exactly 1 on the first
     (only) pass: the loss reduces to the on-policy policy gradient, and clipping acts only from
     the second mini-batch on. In that case (old_logprobs_needed is False) the extra scoring pass
     is skipped: the batch says old_from_update and the update takes pi_old = its own log-probs,
     detached (the same numbers).
  2. train_step's loops: `ppo_epochs` passes over the batch, each split into `mini_batches`
     optimizer steps (rows shuffled with the learner's own RNG), each mini-batch split again into
     micro-batches whose gradients accumulate before the step.
  3. micro-batch split invariance: each micro-batch's loss is weighted by its share of the global
     normaliser (its valid tokens for token-mean, its sequences for the sequence-mean modes), so
     the summed gradient equals the one of the whole mini-batch at once, whatever
     `micro_batch_size` is.
  4. data parallel (torchrun): every rank holds the same global batch; each mini-batch's rows are
     split across ranks (sorted by length, rank r takes every world-th row: balanced and
     deterministic) and FSDP2 sums the ranks' gradients. The weights of point 3 are shares of the
     *global* mini-batch's normaliser, so 1 process and N processes, with any micro-batch size,
     give the same gradient.
  5. shared prompts (shared_prefix): the rows of a group share every token before their first
     sampled one; a micro-batch keeps a group together and runs that prefix once, each row's
     continuation attending to its keys and values (model.PrefixKV). The losses and gradients are
     those of whole rows (to rounding), so points 3 and 4 hold unchanged; micro-batches are capped
     by rows and by token positions (microbatch.py).

Sections: config and state; scoring; the RL update; the critic; SFT; the weights an engine loads.
LoRA is a wing (wings/lora.py), reached through two hooks: a module's fold_into (merged_state_dict)
and a model's adapter (runs.save_checkpoint, runs.load_checkpoint). Shapes: B sequences, T tokens,
m the rows of a micro-batch, L its longest length.

Imports: model.py (the network), algos.py (the losses), microbatch.py (which rows run
together), distributed.py (torchrun, FSDP2).
"""

import copy
from dataclasses import dataclass, field, replace

import torch

import algos
from distributed import (
    all_reduce_,
    full_state_dict,
    get_world_size,
    is_sharded,
)
from microbatch import positions_run, rank_micro_batches, row_lens
from model import Transformer


# -----------------------------------------------------------------------------
# config and state


@dataclass
class LearnerConfig:
    lr: float = 1e-4  # AdamW learning rate (after warmup)
    warmup_steps: int = 0  # linear warmup of the learning rate over this many optimizer steps
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    betas: tuple = (0.9, 0.999)  # AdamW betas
    grad_clip: float = 1.0  # clip the global grad norm to this (<= 0: no clipping)
    # sequences per forward/backward at most (the result does not depend on it)
    micro_batch_size: int = 32
    # Token positions run per forward/backward at most: rows x longest, or with shared prefixes
    # prefixes + continuations, one row at least. Rows are sorted by length, short ones many to a
    # micro-batch, long ones few. It bounds activation memory, and is faster than big micro-batches
    # on a CPU (pages mapped and freed each step). The result does not depend on it. 0: rows only.
    max_tokens_per_micro_batch: int = 4096
    # Rows that share their first tokens (a group's prompt; in multi-turn every token before the
    # first sampled one, and more where samples agree) run them once per micro-batch, each row
    # attending to them (microbatch.py): the same losses and gradients up to float rounding.
    # False: every row whole.
    shared_prefix: bool = True
    mini_batches: int = 1  # optimizer steps per RL batch (PPO mini-batches)
    ppo_epochs: int = 1  # passes over the RL batch
    temperature: float = 1.0  # log-probs are of softmax(logits / temperature), as sampled
    # Tokens (over all rows of a micro-batch) per chunk of the lm_head and the log-softmax: bounds
    # the (tokens, V) fp32 logits block to (this, V).
    logprob_chunk_size: int = 256
    gradient_checkpointing: bool = False  # recompute decoder layers in backward to save activations
    # algos.policy_loss kind: ppo|dual_clip|dapo|gspo|gspo_token|sapo|cispo|gmpo
    policy_loss: str = "ppo"
    # the policy loss's clip ranges and aggregation
    loss: algos.PolicyLossConfig = field(default_factory=algos.PolicyLossConfig)
    kl_coef: float = 0.0  # weight of the KL(policy || reference) term in the loss (0: off)
    kl_kind: str = "k3"  # estimator for that term: k1|k2|k3
    entropy_coef: float = 0.0  # weight of an entropy bonus (0: entropy is only logged)
    # The correction for samples from the engine's policy mu, not pi_old
    # (algos.off_policy_weights): kind none|tis|mis, level token|sequence, tis_cap,
    # mis_low/mis_high; each token's loss is weighted by it. none (the default): no weight, the
    # mismatch is only measured. rollout.async_rollouts needs tis or mis.
    off_policy: algos.OffPolicyConfig = field(default_factory=algos.OffPolicyConfig)
    # Under torchrun on GPUs: bf16 parameters and compute, fp32 gradient reduction (FSDP2's
    # MixedPrecisionPolicy). Ignored on CPU and in one process.
    mixed_precision: bool = True
    # fp32 | bf16: the decoder's matmuls and attention in bf16 (autocast), with fp32 weights,
    # optimizer, residual stream, head and log-softmax; the torch engine samples the same way. A
    # CPU needs avx512_bf16 or AMX (refused without). fp32 reproduces bit for bit; bf16 is ~1.5-2x
    # faster.
    precision: str = "fp32"
    lora_rank: int = 0  # LoRA rank r (0: off, every parameter trains)
    lora_alpha: float = 16.0  # LoRA scaling is lora_alpha / lora_rank
    lora_dropout: float = 0.0  # dropout on the input of the adapter path (training only)
    # the linear layers LoRA wraps
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
    # Optimizer steps taken so far: the learning-rate schedule's clock. An RL step takes
    # mini_batches x ppo_epochs of them; the loop counts RL steps.
    optimizer_step: int = 0
    # shuffles mini-batches, and is saved and restored with checkpoints
    rng: torch.Generator = None
    # the frozen reference policy of the KL term (None when kl_coef == 0)
    ref_model: Transformer | None = None


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # (B, T) long, whole trajectories, right-padded
    loss_mask: torch.Tensor  # (B, T) float, 1 on tokens the policy sampled
    advantages: torch.Tensor  # (B, T) float, advantage of each token (0 where mask is 0)
    # (B, T) pi_old, the ratio's denominator: the learner's log-probs of the batch before this
    # update (compute_logprobs), unless old_from_update
    old_logprobs: torch.Tensor | None = None
    # (B, T) the log-probs of the engine that sampled the tokens (the behaviour policy), for
    # cfg.off_policy's weights and metrics
    engine_logprobs: torch.Tensor | None = None
    # (B, T) the frozen reference policy's log-probs, used only when cfg.kl_coef > 0 (the KL term
    # of the loss)
    ref_logprobs: torch.Tensor | None = None
    # No old_logprobs: the update is exactly on-policy (old_logprobs_needed is False) and takes
    # pi_old = its own log-probs, detached.
    old_from_update: bool = False
    # (B, T) long, the size of the top-k / top-p set each token was sampled from (0: the whole
    # vocabulary; None: no truncation). The policy's log-probs are then of that truncated
    # distribution (truncated_score).
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
    """This micro-batch's share of the mini-batch's loss normaliser (the file docstring, point
    3)."""
    if agg_mode == "token-mean":
        # in fp64: the shares of a split sum to 1 to fp64 rounding
        return float(mask_mb.double().sum() / mask_all.double().sum().clamp(min=1))
    # the seq-mean-* modes divide by the number of sequences
    return mask_mb.shape[0] / mask_all.shape[0]


def _sync_gradients(model: torch.nn.Module, last: bool) -> None:
    """Sharded (FSDP2): reduce-scatter the gradients once, after the last micro-batch of a step."""
    if is_sharded(model):
        model.set_requires_gradient_sync(last)


def _sum_over_ranks(metrics: dict[str, float]) -> dict[str, float]:
    """Each rank's metric sums, summed over ranks (every rank has the same keys, dummies
    included)."""
    if get_world_size() == 1:
        return metrics
    keys = sorted(metrics)
    total = all_reduce_(torch.tensor([metrics[k] for k in keys], dtype=torch.float64))
    return dict(zip(keys, total.tolist()))


def _optimizer_step(state: LearnerState, cfg: LearnerConfig, opt_step: int) -> dict:
    """Clip, step, zero; `opt_step` is the optimizer step's number (the learning-rate schedule's
    clock). A non-finite gradient norm skips the step (and says so) instead of poisoning the
    weights."""
    params = [p for p in state.model.parameters() if p.requires_grad]
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(grad_norm, "full_tensor"):
        # sharded: a DTensor; the norm is of the full gradient
        grad_norm = grad_norm.full_tensor()
    lr = lr_at(opt_step, cfg)
    skipped = not torch.isfinite(grad_norm)
    if not skipped:
        for group in state.optimizer.param_groups:
            group["lr"] = lr
        state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": float(grad_norm), "lr": lr, "skipped_nonfinite": float(skipped)}


# -----------------------------------------------------------------------------
# the RL update


def micro_batch_loss(
    model: Transformer,
    batch: TrainBatch,
    tis: torch.Tensor | None,
    rows: torch.Tensor,
    L: int,
    shared,
    cfg: LearnerConfig,
) -> tuple[torch.Tensor, dict]:
    """The loss of one micro-batch: `rows` of the batch, their first L positions (past L: padding),
    `shared` their SharedPrefix or None. The clipped policy loss (algos.policy_loss) of the tokens
    the policy sampled, less the entropy bonus, plus the KL to the reference -> (loss, metrics),
    unweighted: the caller weights both by the micro-batch's share of the mini-batch."""
    dev = _device(model)
    # the micro-batch's slices of the batch, each (m, L)
    ids = batch.input_ids[rows, :L].to(dev)
    mask = batch.loss_mask[rows, :L].float().to(dev)
    # Only the trained tokens are scored, and the entropy has autograd only when it is in the loss.
    # A top-k / top-p sample is scored under the truncated distribution it was drawn from.
    trunc = {}
    if batch.kept_sizes is not None:
        trunc = dict(score=truncated_score, score_args=batch.kept_sizes[rows, :L].to(dev))
    logp, ent = model.token_logprobs(
        ids,
        temperature=cfg.temperature,
        chunk_size=cfg.logprob_chunk_size,
        return_entropy=True,
        mask=mask,
        entropy_grad=cfg.entropy_coef > 0,
        shared=shared,
        **trunc,
    )  # (m, L) x2
    # on-policy (old_from_update): pi_old is these very log-probs, before any optimizer step
    if batch.old_logprobs is None:
        old = logp.detach()
    else:
        old = batch.old_logprobs[rows, :L].to(dev)
    advantages = batch.advantages[rows, :L].to(dev)
    weights = None if tis is None else tis[rows, :L].to(dev)  # the off-policy weights
    loss, metrics = algos.policy_loss(
        cfg.policy_loss, logp, old, advantages, mask, cfg.loss, weights
    )
    entropy = algos.aggregate(ent, mask, cfg.loss.agg_mode, cfg.loss.agg_norm)
    metrics = {**metrics, "pg_loss": loss.detach(), "entropy": entropy.detach()}
    if cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * entropy
    if cfg.kl_coef > 0:
        ref = batch.ref_logprobs[rows, :L].to(dev)
        token_kl = algos.kl_penalty(logp, ref, cfg.kl_kind)
        kl = algos.aggregate(token_kl, mask, cfg.loss.agg_mode, cfg.loss.agg_norm)
        loss = loss + cfg.kl_coef * kl
        metrics["kl"] = kl.detach()
    return loss, metrics


def train_step(
    state: LearnerState,
    batch: "TrainBatch | ValueBatch",
    cfg: LearnerConfig,
    value_clip: float = 0.0,
) -> tuple[LearnerState, dict]:
    """One RL update -> (the state after it, metrics). On a TrainBatch, the policy's: the loss of
    micro_batch_loss, metrics 'train/...'. batch.old_logprobs is required (the caller scored the
    batch before any update: train.compute_advantages), unless batch.old_from_update and the update
    is exactly on-policy (old_logprobs_needed(cfg) is False); batch.ref_logprobs too when
    cfg.kl_coef > 0. On a ValueBatch, PPO's critic's (critic_step): the clipped value loss, rows
    whole, token-mean, metrics 'critic/...'.

    ppo_epochs passes over the batch; each pass is mini_batches optimizer steps (rows shuffled with
    the state's RNG when there are several); each step sums the gradients of its micro-batches,
    each weighted by its share of the mini-batch's loss normaliser (the file docstring, point 3).
    Metrics are means over the optimizer steps."""
    policy = isinstance(batch, TrainBatch)
    model = state.model
    mask = batch.loss_mask.float()  # (B, T)
    tis = None
    tis_metrics = {}
    agg_mode = "token-mean"
    if policy:
        _check_train_batch(batch, cfg)
        tis, tis_metrics = _off_policy_weights(batch, mask, cfg)  # (B, T) or None
        agg_mode = cfg.loss.agg_mode
    sums: dict[str, float] = {}
    n_updates = 0
    opt_step = state.optimizer_step
    model.train()
    for epoch in range(cfg.ppo_epochs):
        # the rows in this pass's order, cut into mini-batches: one optimizer step each
        if cfg.mini_batches > 1:
            order = torch.randperm(len(mask), generator=state.rng)
        else:
            order = torch.arange(len(mask))
        for rows in order.chunk(cfg.mini_batches):
            mb_mask = mask[rows]  # (b, T) the mini-batch's b rows
            lens = row_lens(mb_mask)
            # the policy's rows that share a prompt run it once; the critic runs every row whole
            share = (batch.input_ids[rows], mb_mask) if policy and cfg.shared_prefix else None
            # this rank's micro-batches: index tensors into `rows`, grouped by length
            plan = rank_micro_batches(
                lens, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch, share
            )
            step_metrics: dict[str, float] = {}
            used = 0
            computed = 0
            for i, (idx, dummy, shared) in enumerate(plan):
                _sync_gradients(model, last=i == len(plan) - 1)
                L = int(lens[idx].max())
                # the micro-batch's loss, weighted by its share of the mini-batch's normaliser
                if policy:
                    loss, m = micro_batch_loss(model, batch, tis, rows[idx], L, shared, cfg)
                else:
                    loss, m = value_micro_batch_loss(model, batch, rows[idx], L, value_clip)
                w = _share(mask[rows[idx], :L], mb_mask, agg_mode)
                loss = loss * w
                m = {k: float(v) * w for k, v in m.items()}
                if dummy:
                    # only here to join the collectives: contributes exactly 0
                    loss = loss * 0.0
                    m = {k: 0.0 for k in m}
                else:
                    u, c = positions_run(lens[idx], shared)
                    used += u
                    computed += c
                if loss.requires_grad:  # a micro-batch with no trained token adds nothing
                    loss.backward()
                for k, v in m.items():
                    step_metrics[k] = step_metrics.get(k, 0.0) + v
            step_metrics.update(tokens_used=used, tokens_computed=computed)
            step_metrics = _sum_over_ranks(step_metrics)
            # the optimizer step on the accumulated gradient: clip, step, zero
            step_metrics.update(_optimizer_step(state, cfg, opt_step))
            opt_step += 1
            n_updates += 1
            for k, v in step_metrics.items():
                sums[k] = sums.get(k, 0.0) + v
    state = replace(state, optimizer_step=opt_step)
    used = sums.pop("tokens_used")
    computed = sums.pop("tokens_computed")
    if not policy:
        return state, {f"critic/{k}": v / n_updates for k, v in sums.items()}
    metrics = {f"train/{k}": v / n_updates for k, v in sums.items()}
    # the update's work spent on padding
    metrics["perf/pad_fraction"] = 1.0 - used / max(computed, 1)
    # of the whole batch
    metrics.update({f"train/{k}": float(v) for k, v in tis_metrics.items()})
    metrics["train/updates"] = n_updates
    return state, metrics


def _check_train_batch(batch: TrainBatch, cfg: LearnerConfig) -> None:
    """Refuse a batch that lacks what the update needs, before any work."""
    if batch.old_logprobs is None and not batch.old_from_update:
        raise ValueError(
            "train_step needs batch.old_logprobs: score the batch first (compute_logprobs)"
        )
    if batch.old_logprobs is None and old_logprobs_needed(cfg):
        raise ValueError(
            "batch.old_from_update holds only for an exactly on-policy update (one mini-batch, one "
            "epoch, no off-policy correction, no dropout): score the batch first (compute_logprobs)"
        )
    if cfg.off_policy.kind != "none" and batch.engine_logprobs is None:
        raise ValueError(
            f"learner.off_policy.kind={cfg.off_policy.kind} needs the engine's log-probs "
            "(TrainBatch.engine_logprobs)"
        )
    if batch.kept_sizes is not None and bool((batch.kept_sizes < 0).any()):
        raise ValueError(
            "batch.kept_sizes has -1 (sets not reported by the engine): infer_kept_sizes first"
        )
    if cfg.kl_coef > 0 and batch.ref_logprobs is None:
        raise ValueError(
            "learner.kl_coef > 0 needs the reference policy's log-probs (TrainBatch.ref_logprobs)"
        )


def _off_policy_weights(
    batch: TrainBatch, mask: torch.Tensor, cfg: LearnerConfig
) -> tuple[torch.Tensor | None, dict]:
    """The off-policy weights (B, T) of the whole batch (a sequence's weight needs all its tokens,
    whatever the micro-batches) and their metrics; None when the loss takes no weight. With
    off_policy.kind=none the mismatch is measured only: the mismatch KL is logged."""
    old = batch.old_logprobs
    if batch.engine_logprobs is None or old is None:
        return None, {}
    engine = batch.engine_logprobs.to(old.device)
    tis, metrics = algos.off_policy_weights(old, engine, mask.to(old.device), cfg.off_policy)
    if cfg.off_policy.kind == "none":
        return None, {k: v for k, v in metrics.items() if k.startswith("mismatch_kl")}
    return tis, metrics


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


def value_micro_batch_loss(
    model: "Critic", batch: "ValueBatch", rows: torch.Tensor, L: int, value_clip: float
) -> tuple[torch.Tensor, dict]:
    """The critic's loss of one micro-batch: the clipped value loss (algos.value_loss) of `rows`,
    their first L positions, token-mean -> (loss, metrics), unweighted."""
    dev = _device(model)
    # each (m, L)
    values = model(batch.input_ids[rows, :L].to(dev))
    old_values = batch.old_values[rows, :L].to(dev)
    returns = batch.returns[rows, :L].to(dev)
    mask = batch.loss_mask[rows, :L].float().to(dev)
    loss, metrics = algos.value_loss(values, old_values, returns, mask, value_clip)
    return loss, {"value_loss": loss.detach(), **metrics}


def critic_step(
    state: LearnerState, batch: ValueBatch, cfg: LearnerConfig, value_clip: float
) -> tuple[LearnerState, dict]:
    """PPO's critic update, on train_step's schedule: ppo_epochs passes of mini_batches optimizer
    steps (rows shuffled with the critic's own RNG when mini_batches > 1). The first step's values
    are the old ones, so the clip binds only from the second step on: value_clip bounds how far each
    later step moves a value from old_values. Metrics 'critic/...', means over the steps."""
    return train_step(state, batch, cfg, value_clip)


# -----------------------------------------------------------------------------
# supervised fine-tuning (the warm start of the embedded default model)


def sft_step(
    state: LearnerState, input_ids: torch.Tensor, loss_mask: torch.Tensor, cfg: LearnerConfig
) -> tuple[LearnerState, dict]:
    """One optimizer step of next-token cross-entropy on the tokens where loss_mask is 1 (assistant
    tokens). Token-mean over the whole batch, accumulated over micro-batches of whole rows like
    train_step's (demonstrations rarely share a prompt)."""
    model = state.model
    dev = _device(model)
    mask = loss_mask.float()  # (B, T)
    lens = row_lens(mask)
    plan = rank_micro_batches(lens, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch)
    metrics: dict[str, float] = {}
    model.train()
    for i, (idx, dummy, _) in enumerate(plan):
        _sync_gradients(model, last=i == len(plan) - 1)
        L = int(lens[idx].max())
        ids = input_ids[idx, :L].to(dev)
        row_mask = mask[idx, :L].to(dev)
        logp = model.token_logprobs(ids, chunk_size=cfg.logprob_chunk_size, mask=row_mask)
        nll = algos.aggregate(-logp, row_mask, "token-mean")
        w = _share(mask[idx, :L], mask, "token-mean")
        loss = nll * w
        loss_metric = float(nll.detach()) * w
        if dummy:
            # only here to join the collectives: contributes exactly 0
            loss = loss * 0.0
            loss_metric = 0.0
        if loss.requires_grad:
            loss.backward()
        metrics["loss"] = metrics.get("loss", 0.0) + loss_metric
    metrics = _sum_over_ranks(metrics)
    metrics.update(_optimizer_step(state, cfg, state.optimizer_step))
    step = state.optimizer_step + 1
    return replace(state, optimizer_step=step), {f"sft/{k}": v for k, v in metrics.items()}


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
