"""learner.py: the training side of RL: log-prob recompute, the policy update, SFT, checkpoints.

Everything the learner owns lives in one dataclass, `LearnerState` (model, optimizer, step, RNG), that
is passed in and returned: `train_step(state, batch, cfg) -> (state, metrics)`. The model and the
optimizer are torch objects and are updated in place; the dataclass makes it explicit *what* the
learner's state is, so that a checkpoint saves exactly that and a resume restores exactly that.

How one RL step works (see train.py for where the batch comes from):
  1. old log-probs: if the batch carries none, score it once with the current weights (no grad). With
     one optimizer step per batch the PPO ratio is then exactly 1 on the first (only) pass: the loss
     reduces to the on-policy policy gradient, and clipping acts only from the second mini-batch on.
  2. split the batch into `mini_batches` optimizer steps (shuffled with the learner's own RNG), repeated
     for `ppo_epochs`; each mini-batch is split again into micro-batches whose gradients accumulate.
  3. micro-batch split invariance: each micro-batch's loss is weighted by its share of the global
     normaliser (its valid tokens for token-mean, its sequences for the sequence-mean modes), so the
     summed gradient equals the one of the whole mini-batch at once, whatever `micro_batch_size` is.

Shapes: B sequences, T tokens.
Imports: model.py (the network, save/load) and algos.py (the losses) only.
"""
import copy
import glob
import json
import os
from dataclasses import dataclass, field, replace

import torch
from safetensors.torch import load_file, save_file

import algos
from model import Transformer, save_model


# -----------------------------------------------------------------------------
# config and state

@dataclass
class LearnerConfig:
    lr: float = 1e-4                      # AdamW learning rate (after warmup)
    warmup_steps: int = 0                 # linear warmup of the learning rate over this many optimizer steps
    weight_decay: float = 0.0             # AdamW decoupled weight decay
    betas: tuple = (0.9, 0.999)           # AdamW betas
    grad_clip: float = 1.0                # clip the global grad norm to this (<= 0: no clipping)
    micro_batch_size: int = 32            # sequences per forward/backward; does not change the result
    mini_batches: int = 1                 # optimizer steps per RL batch (PPO mini-batches)
    ppo_epochs: int = 1                   # passes over the RL batch
    temperature: float = 1.0              # log-probs are of softmax(logits / temperature), as sampled
    logprob_chunk_size: int = 256         # tokens per chunk when turning hidden states into log-probs
    gradient_checkpointing: bool = False  # recompute decoder layers in backward to save activations
    policy_loss: str = "ppo"              # algos.policy_loss kind: ppo|dual_clip|dapo|gspo|gspo_token|sapo
    loss: algos.PolicyLossConfig = field(default_factory=algos.PolicyLossConfig)  # clip ranges, aggregation
    kl_coef: float = 0.0                  # weight of the KL(policy || reference) term in the loss (0: off)
    kl_kind: str = "k3"                   # estimator for that term: k1|k2|k3
    entropy_coef: float = 0.0             # weight of an entropy bonus (0: entropy is only logged)


@dataclass
class LearnerState:
    model: torch.nn.Module                # the policy (a Transformer) or a Critic, updated in place
    optimizer: torch.optim.Optimizer      # AdamW over model's trainable parameters
    step: int = 0                         # optimizer steps taken so far
    rng: torch.Generator = None           # shuffles mini-batches; saved and restored with checkpoints
    ref_model: Transformer | None = None  # frozen reference policy for the KL term (None when kl_coef == 0)


@dataclass
class TrainBatch:
    input_ids: torch.Tensor               # (B, T) long, whole trajectories, right-padded
    loss_mask: torch.Tensor               # (B, T) float, 1 on tokens the policy sampled
    advantages: torch.Tensor              # (B, T) float, advantage of each token (0 where mask is 0)
    old_logprobs: torch.Tensor | None = None  # (B, T) behaviour log-probs; None: recompute before the update


def make_learner(model: torch.nn.Module, cfg: LearnerConfig, seed: int, ref_model: Transformer | None = None) -> LearnerState:
    """Wrap a model (the policy, or a Critic) with its AdamW optimizer and RNG."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    model.gradient_checkpointing = cfg.gradient_checkpointing
    if ref_model is not None:
        ref_model.requires_grad_(False).eval()
    rng = torch.Generator().manual_seed(seed)
    return LearnerState(model=model, optimizer=opt, step=0, rng=rng, ref_model=ref_model)


def lr_at(step: int, cfg: LearnerConfig) -> float:
    """Linear warmup, then constant. The value returned is the one the optimizer uses (and that is logged)."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cfg.lr


# -----------------------------------------------------------------------------
# scoring

@torch.no_grad()
def compute_logprobs(model: Transformer, input_ids: torch.Tensor, micro_batch_size: int,
                     temperature: float = 1.0, chunk_size: int = 256, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token log-probs of a whole batch, micro-batch by micro-batch, without gradients. -> (B, T)
    With `mask`, rows are grouped by length and scored only up to their last masked token (0 beyond)."""
    was_training = model.training
    model.eval()
    out = torch.zeros(input_ids.shape, dtype=torch.float32)                      # (B, T)
    lens = _row_lens(mask) if mask is not None else torch.full((input_ids.shape[0],), input_ids.shape[1])
    for idx in _micro_batches(lens, micro_batch_size):
        L = int(lens[idx].max())
        out[idx, :L] = model.token_logprobs(input_ids[idx, :L], temperature=temperature, chunk_size=chunk_size)
    model.train(was_training)
    return out


def _row_lens(mask: torch.Tensor) -> torch.Tensor:
    """(B,) position of each row's last trained token + 1 (1 for a row with none): the causal model never
    needs to look further, so everything after it is padding as far as the update is concerned."""
    pos = torch.arange(1, mask.shape[1] + 1)                                     # (T,)
    return (mask.bool() * pos).max(dim=1).values.clamp(min=1)                    # (B,)


def _micro_batches(lens: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Row indices in micro-batches of similar length (sorted), so a long row pads few short ones. The
    update does not depend on how rows are split (file docstring, point 3), so the grouping is free."""
    order = torch.argsort(lens, stable=True)
    return [order[i:i + size] for i in range(0, len(order), size)]


def _share(mask_mb: torch.Tensor, mask_all: torch.Tensor, agg_mode: str) -> float:
    """This micro-batch's share of the mini-batch's loss normaliser (see the file docstring, point 3)."""
    if agg_mode == "token-mean":
        return float(mask_mb.sum() / mask_all.sum().clamp(min=1))
    return mask_mb.shape[0] / mask_all.shape[0]   # the seq-mean-* modes divide by the number of sequences


def _optimizer_step(state: LearnerState, cfg: LearnerConfig) -> dict:
    """Clip, step, zero. A non-finite gradient norm skips the step (and says so) instead of poisoning the weights."""
    params = [p for p in state.model.parameters() if p.requires_grad]
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    lr = lr_at(state.step, cfg)
    skipped = not torch.isfinite(grad_norm)
    if not skipped:
        for group in state.optimizer.param_groups:
            group["lr"] = lr
        state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": float(grad_norm), "lr": lr, "skipped_nonfinite": float(skipped)}


def _accumulate(state: LearnerState, cfg: LearnerConfig, mask: torch.Tensor, micro_loss) -> dict:
    """Run `micro_loss(idx, L) -> (weighted loss, metrics)` over micro-batches of rows (index tensors into
    `mask`'s rows, grouped by length; L = the micro-batch's longest used length), backprop each, then take
    one optimizer step. Metrics come back weighted the same way as the loss."""
    state.model.train()
    metrics: dict[str, float] = {}
    lens = _row_lens(mask)
    for idx in _micro_batches(lens, cfg.micro_batch_size):
        loss, m = micro_loss(idx, int(lens[idx].max()))
        if loss.requires_grad:                    # a micro-batch with no trained token contributes nothing
            loss.backward()
        for k, v in m.items():
            metrics[k] = metrics.get(k, 0.0) + float(v)
    metrics.update(_optimizer_step(state, cfg))
    return metrics


# -----------------------------------------------------------------------------
# the RL update

def train_step(state: LearnerState, batch: TrainBatch, cfg: LearnerConfig) -> tuple[LearnerState, dict]:
    """One RL update on a batch of trajectories -> (state, metrics namespaced 'train/...')."""
    model = state.model
    mask = batch.loss_mask.float()                                            # (B, T)
    old = batch.old_logprobs
    if old is None:
        old = compute_logprobs(model, batch.input_ids, cfg.micro_batch_size, cfg.temperature,
                               cfg.logprob_chunk_size, mask)
    ref = None
    if cfg.kl_coef > 0:
        if state.ref_model is None:
            raise ValueError("learner.kl_coef > 0 needs a reference model (make_learner(..., ref_model=...))")
        ref = compute_logprobs(state.ref_model, batch.input_ids, cfg.micro_batch_size, cfg.temperature,
                               cfg.logprob_chunk_size, mask)

    B = batch.input_ids.shape[0]
    sums: dict[str, float] = {}
    n_updates = 0
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(B, generator=state.rng) if cfg.mini_batches > 1 else torch.arange(B)
        for rows in order.chunk(cfg.mini_batches):
            mb_mask = mask[rows]                                              # (b, T)

            def micro_loss(idx, L, rows=rows, mb_mask=mb_mask):
                r = rows[idx]
                ids, m = batch.input_ids[r, :L], mask[r, :L]                  # (m, L) columns past L are padding
                logp, ent = model.token_logprobs(ids, temperature=cfg.temperature,
                                                 chunk_size=cfg.logprob_chunk_size, return_entropy=True)
                loss, metrics = algos.policy_loss(cfg.policy_loss, logp, old[r, :L], batch.advantages[r, :L], m, cfg.loss)
                entropy = algos.aggregate(ent, m, cfg.loss.agg_mode, cfg.loss.agg_norm)
                metrics = {**metrics, "pg_loss": loss.detach(), "entropy": entropy.detach()}
                if cfg.entropy_coef:
                    loss = loss - cfg.entropy_coef * entropy
                if ref is not None:
                    kl = algos.aggregate(algos.kl_penalty(logp, ref[r, :L], cfg.kl_kind), m,
                                         cfg.loss.agg_mode, cfg.loss.agg_norm)
                    loss = loss + cfg.kl_coef * kl
                    metrics["kl"] = kl.detach()
                w = _share(m, mb_mask, cfg.loss.agg_mode)
                return loss * w, {k: float(v) * w for k, v in metrics.items()}

            m = _accumulate(state, cfg, mb_mask, micro_loss)
            state.step += 1
            n_updates += 1
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v
    metrics = {f"train/{k}": v / n_updates for k, v in sums.items()}          # mean over optimizer steps
    metrics["train/updates"] = n_updates
    return state, metrics


# -----------------------------------------------------------------------------
# PPO's critic: the policy backbone with a scalar value head

class Critic(torch.nn.Module):
    """V(s_t) for every token position: a copy of the policy's decoder with a linear value head.
    values[:, t] is the value of the state *before* token t (read from the hidden state at t - 1), aligned
    with token_logprobs so one mask serves both."""

    def __init__(self, policy: Transformer):
        super().__init__()
        self.backbone = copy.deepcopy(policy)
        self.backbone.lm_head.requires_grad_(False)          # unused: only hidden states feed the value head
        self.value_head = torch.nn.Linear(policy.cfg.hidden_size, 1)
        torch.nn.init.zeros_(self.value_head.weight)         # start at V = 0: no early bias in the advantages
        torch.nn.init.zeros_(self.value_head.bias)
        self.gradient_checkpointing = False

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.backbone.gradient_checkpointing = self.gradient_checkpointing
        h = self.backbone.hidden_states(input_ids)            # (B, T, H)
        v = self.value_head(h[:, :-1].float()).squeeze(-1)     # (B, T-1) state before token t+1
        return torch.cat([v.new_zeros(v.shape[0], 1), v], dim=1)  # (B, T)


@dataclass
class ValueBatch:
    input_ids: torch.Tensor               # (B, T) long
    loss_mask: torch.Tensor               # (B, T) float, 1 on the policy's tokens (the states it acted in)
    old_values: torch.Tensor              # (B, T) values before the update (the clip's centre)
    returns: torch.Tensor                 # (B, T) GAE returns, the regression target


@torch.no_grad()
def compute_values(critic: Critic, input_ids: torch.Tensor, micro_batch_size: int) -> torch.Tensor:
    """(B, T) values of every position, without gradients."""
    return torch.cat([critic(input_ids[i:i + micro_batch_size]) for i in range(0, input_ids.shape[0], micro_batch_size)])


def critic_step(state: LearnerState, batch: ValueBatch, cfg: LearnerConfig, value_clip: float) -> tuple[LearnerState, dict]:
    """One optimizer step of the clipped value loss (algos.value_loss), token-mean over the batch."""
    mask = batch.loss_mask.float()

    def micro_loss(idx, L):
        v = state.model(batch.input_ids[idx, :L])                               # (m, L)
        loss, m = algos.value_loss(v, batch.old_values[idx, :L], batch.returns[idx, :L], mask[idx, :L], value_clip)
        w = _share(mask[idx, :L], mask, "token-mean")
        return loss * w, {"value_loss": float(loss.detach()) * w, **{k: float(x) * w for k, x in m.items()}}

    m = _accumulate(state, cfg, mask, micro_loss)
    state.step += 1
    return state, {f"critic/{k}": v for k, v in m.items()}


# -----------------------------------------------------------------------------
# supervised fine-tuning (the warm start of the embedded default model)

def sft_step(state: LearnerState, input_ids: torch.Tensor, loss_mask: torch.Tensor,
             cfg: LearnerConfig) -> tuple[LearnerState, dict]:
    """One optimizer step of next-token cross-entropy on the tokens where loss_mask is 1 (assistant tokens).
    Token-mean over the whole batch, accumulated over micro-batches like train_step."""
    mask = loss_mask.float()                                                  # (B, T)
    model = state.model

    def micro_loss(idx, L):
        ids, m = input_ids[idx, :L], mask[idx, :L]
        logp = model.token_logprobs(ids, chunk_size=cfg.logprob_chunk_size)    # (m, T)
        nll = algos.aggregate(-logp, m, "token-mean")
        w = _share(m, mask, "token-mean")
        return nll * w, {"loss": float(nll.detach()) * w}

    m = _accumulate(state, cfg, mask, micro_loss)
    state.step += 1
    return state, {f"sft/{k}": v for k, v in m.items()}


# -----------------------------------------------------------------------------
# checkpoints: weights in Hugging Face layout + optimizer, step and RNG state beside them

def save_checkpoint(state: LearnerState, path: str, extra: dict | None = None) -> None:
    """Write `path/` as a loadable HF folder (config.json, model.safetensors) plus `trainer_state.pt`
    (optimizer, step, RNG states) and `trainer_state.json` (step and `extra`, human-readable)."""
    os.makedirs(path, exist_ok=True)
    if isinstance(state.model, Transformer):
        save_model(state.model, path)                     # Hugging Face layout: loadable by any engine
    else:
        save_file({k: v.detach().clone() for k, v in state.model.state_dict().items()},  # clone: tied weights
                  os.path.join(path, "model.safetensors"))
    torch.save({"optimizer": state.optimizer.state_dict(), "step": state.step,
                "rng": state.rng.get_state(), "torch_rng": torch.get_rng_state()},
               os.path.join(path, "trainer_state.pt"))
    with open(os.path.join(path, "trainer_state.json"), "w") as f:
        json.dump({"step": state.step, **(extra or {})}, f, indent=2)


def _tied(model) -> bool:
    m = model if isinstance(model, Transformer) else model.backbone
    return m.cfg.tie_word_embeddings


def load_checkpoint(state: LearnerState, path: str) -> LearnerState:
    """Restore weights, optimizer, step and RNG from `path` into `state` (built the same way as when saved)."""
    sd = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        sd.update(load_file(f))
    missing, unexpected = state.model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (k.endswith("lm_head.weight") and _tied(state.model))]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    ts = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
    state.optimizer.load_state_dict(ts["optimizer"])
    state.rng.set_state(ts["rng"])
    torch.set_rng_state(ts["torch_rng"])
    return replace(state, step=ts["step"])
