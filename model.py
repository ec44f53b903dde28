"""model.py: a pure-PyTorch decoder-only transformer that loads and saves Hugging Face checkpoints.

One module covers the Qwen2 / Qwen2.5, Qwen3 and Llama-3 families; they differ only in three
switches: q/k/v biases (Qwen2), a per-head RMSNorm on q and k (Qwen3), and Llama-3's rescaled RoPE
frequencies. Parameter names are exactly Hugging Face's, so `*.safetensors` files load and save
without renaming and vLLM or transformers can read what we write. Everything else is the textbook
pre-norm decoder:
  x = x + Attention(RMSNorm(x));  x = x + SwiGLU(RMSNorm(x));  logits = lm_head(RMSNorm(x))

References
  RMSNorm: Zhang & Sennrich 2019, https://arxiv.org/abs/1910.07467
  RoPE:    Su et al. 2021, https://arxiv.org/abs/2104.09864
           (HF "rotate_half" layout: pairs are (i, i + hd/2))
  GQA:     Ainslie et al. 2023, https://arxiv.org/abs/2305.13245
           (nkv < nh heads of keys/values, shared)
  SwiGLU:  Shazeer 2020, https://arxiv.org/abs/2002.05202

Shapes: B batch, T tokens (queries), Tk keys (cached + new), H hidden, V vocab,
        nh query heads, nkv key/value heads, hd head dim, I MLP width.
Imports: none of our files (safetensors, torch, the standard library).
"""

import json
import math
import os
from contextlib import nullcontext
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.utils.checkpoint import checkpoint

ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
}


@dataclass
class ModelConfig:
    """Mirrors the fields of a Hugging Face config.json that these three families use."""

    model_type: str = "qwen2"  # "qwen2" | "qwen3" | "llama"
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 352  # SwiGLU width I
    num_hidden_layers: int = 4
    num_attention_heads: int = 4  # nh
    num_key_value_heads: int = 2  # nkv (divides nh)
    head_dim: int | None = None  # hd (None: hidden_size // num_attention_heads)
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False  # lm_head shares the embedding matrix
    # q/k/v (and for llama/qwen3 also o) biases; None -> family default
    attention_bias: bool | None = None
    qk_norm: bool | None = None  # per-head RMSNorm on q and k (None: True for qwen3)
    # llama3: {"rope_type", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}
    rope_scaling: dict | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.model_type not in ARCHITECTURES:
            raise ValueError(
                f"model_type {self.model_type!r} not supported; "
                f"expected one of {list(ARCHITECTURES)}"
            )
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.attention_bias is None:
            self.attention_bias = self.model_type == "qwen2"
        if self.qk_norm is None:
            self.qk_norm = self.model_type == "qwen3"

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        """Read a config.json dict; unknown keys are ignored, unsupported features raise."""
        if (
            d.get("hidden_act", "silu") != "silu"
            or d.get("mlp_bias")
            or d.get("use_sliding_window")
        ):
            raise NotImplementedError(
                "only SiLU MLPs without bias and full attention are supported"
            )
        # transformers >= 5 writes rope settings under "rope_parameters"; older files use
        # rope_theta/rope_scaling
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise NotImplementedError(f"rope_type {rope_type!r} not supported")
        # transformers 5 keeps theta inside rope_parameters, older files at the top level
        theta = rope.pop("rope_theta", 10000.0)
        theta = d.get("rope_theta", theta)
        known = {f.name for f in fields(cls)} - {"rope_theta", "rope_scaling"}
        kwargs = {k: v for k, v in d.items() if k in known}
        scaling = {"rope_type": "llama3", **rope} if rope_type == "llama3" else None
        return cls(**kwargs, rope_theta=float(theta), rope_scaling=scaling)

    def to_hf(self) -> dict:
        """A config.json dict that transformers (4.x and 5.x) and vLLM read as the same model."""
        # Hugging Face ties these flags to the architecture: never write a file that loads as
        # another model
        if (self.model_type == "qwen2" and not self.attention_bias) or self.qk_norm != (
            self.model_type == "qwen3"
        ):
            raise ValueError(
                f"attention_bias={self.attention_bias}, qk_norm={self.qk_norm} has no "
                f"Hugging Face {self.model_type} equivalent"
            )
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "qk_norm"}
        return {"architectures": [ARCHITECTURES[self.model_type]], **d, "hidden_act": "silu"}


# ----------------------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # normalise in fp32 (bf16 squares overflow/underflow; fp64 stays fp64), cast back,
        # then scale: HF's order
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Rotation speeds theta^(-2i/hd) for i < hd/2, with Llama-3's long-context rescaling when
    the config has one."""
    hd = cfg.head_dim
    # (hd/2,) theta^(-2i/hd)
    inv_freq = 1.0 / (
        cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float, device="cpu") / hd)
    )
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    # Llama 3.1: slow (long-wavelength) components are divided by `factor`, fast ones kept, the band
    # between interpolated smoothly (same formula as transformers' _compute_llama3_parameters).
    old_len = s["original_max_position_embeddings"]
    low = s["low_freq_factor"]
    high = s["high_freq_factor"]
    factor = s["factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_mid, smoothed, scaled)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    """x (B, n, T, hd); cos/sin (B, T, hd) -> x rotated by its position's angles."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.nh = cfg.num_attention_heads
        self.nkv = cfg.num_key_value_heads
        self.hd = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.nh * self.hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=cfg.attention_bias)
        # Qwen2 never has an output bias; Llama and Qwen3 put one on o_proj too when
        # attention_bias is set
        self.o_proj = nn.Linear(
            self.nh * self.hd,
            cfg.hidden_size,
            bias=cfg.attention_bias and cfg.model_type != "qwen2",
        )
        if cfg.qk_norm:  # Qwen3: RMSNorm over each head's hd features, before RoPE
            self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, kv_cache=None, layer_idx=0):
        B, T, _ = x.shape
        # projected: q (B, T, nh, hd), k and v (B, T, nkv, hd); after the transposes, heads come
        # first: q (B, nh, T, hd), k and v (B, nkv, T, hd)
        q = self.q_proj(x).view(B, T, self.nh, self.hd)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        if kv_cache is not None:
            k, v = kv_cache.update(layer_idx, k, v)  # (B, nkv, Tk, hd)
        # y (B, nh, T, hd). mask None means "no padding": plain causal when several queries start
        # at key 0, and a single decode query sees every cached key anyway; a mask with its own
        # attend(q, k, v) computes the attention itself (wings/long_context.py's chunks)
        if hasattr(mask, "attend"):
            y = mask.attend(q, k, v)
        else:
            y = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                is_causal=mask is None and T > 1,
                enable_gqa=self.nkv != self.nh,
            )
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        # SwiGLU, (B, T, I) inside
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, kv_cache=None, layer_idx=0):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv_cache, layer_idx)
        return x + self.mlp(self.post_attention_layernorm(x))


class SharedPrefix(NamedTuple):
    """Which rows of a batch continue a prefix computed once (token_logprobs' `shared`;
    microbatch._layout builds it). Prefix g is input_ids[lead[g], :lens[g]]; row b continues prefix
    group[b] from position lens[group[b]] on, for `cont` positions at most (what the rows' scored
    tokens need)."""

    lead: torch.Tensor  # (n,) long, the row whose first lens[g] tokens are prefix g
    lens: torch.Tensor  # (n,) long, each prefix's length (>= 1)
    group: torch.Tensor  # (B,) long, the prefix each row continues
    cont: int  # positions each row runs past its prefix (the most any row needs, or 0)


class PrefixKV:
    """The kv_cache of shared-prefix scoring (Prefix Grouper, Liu et al. 2025,
    https://arxiv.org/abs/2506.05433): the keys and values of prefixes run once, read by every row
    that continues one. Unlike rollout.KVCache it writes nothing in place, so autograd flows
    through it: the gradient into a prefix's keys and values is the sum over the rows that read it,
    the same sum that G separate copies of the prefix would produce.
      a forward with rows None (the prefixes, (n, P)) stores each layer's k, v (n, nkv, P, hd) and
      attends as usual; continued(rows) gives the cache of a forward over continuations (B, S), each
      row attending to its prefix's keys and then its own: keys (B, nkv, P + S, hd)."""

    def __init__(
        self,
        rows: torch.Tensor | None = None,
        k: dict | None = None,
        v: dict | None = None,
        pos: int = 0,
    ):
        self.rows = rows
        self.k = dict(k or {})
        self.v = dict(v or {})
        self.pos = pos

    def update(self, layer_idx, k, v):
        if self.rows is None:  # the prefixes' own forward (again, identically, under recomputation)
            self.k[layer_idx], self.v[layer_idx] = k, v
            return k, v
        return (
            # index_select, whose gradient sums a prefix's readers in order: indexing's sums them in
            # parallel, in an order that changes from run to run on 2 threads
            torch.cat(
                [self.k[layer_idx].index_select(0, self.rows), k], dim=2
            ),  # (B, nkv, P + S, hd)
            torch.cat([self.v[layer_idx].index_select(0, self.rows), v], dim=2),
        )

    def continued(self, rows: torch.Tensor) -> "PrefixKV":
        """The cache of the continuations' forward: row b reads prefix rows[b]."""
        return PrefixKV(rows, self.k, self.v, self.pos)


def attention_mask(T: int, past: int, key_padding_mask, device):
    """Boolean (B, 1, T, Tk) mask, True = may attend; None when plain causal attention is exact.

    Query t sits at absolute slot past + t and sees keys [0, past + t] that are real tokens. It
    always sees itself, so a left-pad query (no real key before it) still gets a finite softmax
    instead of NaN.
    """
    Tk = past + T
    if key_padding_mask is None and (past == 0 or T == 1):
        return None
    # the absolute slots of the queries (T, 1) and of the keys (1, Tk)
    q_slot = torch.arange(past, Tk, device=device)[:, None]
    k_slot = torch.arange(Tk, device=device)[None, :]
    mask = (k_slot <= q_slot)[None, None]  # (1, 1, T, Tk) causal
    if key_padding_mask is not None:
        mask = (mask & key_padding_mask[:, None, None, :Tk]) | (k_slot == q_slot)  # (B, 1, T, Tk)
    return mask


# ----------------------------------------------------------------------------- the model


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = nn.ModuleDict(
            dict(  # the "model." prefix of Hugging Face's parameter names
                embed_tokens=nn.Embedding(cfg.vocab_size, cfg.hidden_size),
                layers=nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)),
                norm=RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
            )
        )
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        # (hd/2,), a plain fp32 attribute, not a buffer: model.to(bfloat16) would round a buffer
        # and shift the angles
        self.inv_freq = rope_inv_freq(cfg)
        # recompute each decoder layer during backward (saves activations)
        self.gradient_checkpointing = False
        # bf16: the decoder layers' matmuls and attention run under torch.autocast in it (the
        # learner's precision); None: in the parameters' dtype
        self.compute_dtype = None

    def tie_weights(self):
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def hidden_states(
        self, input_ids, position_ids=None, key_padding_mask=None, kv_cache=None, mask=None
    ):
        """input_ids (B, T) -> final-normed hidden states (B, T, H).

        position_ids (B, T) default to past + arange(T); key_padding_mask (B, >= past + T), True =
        real token, is needed only with left padding. With kv_cache, the new keys/values are
        appended and cache.pos advances (kv_cache: anything with update(layer, k, v) and pos, as
        rollout.KVCache). mask: one to use in place of attention_mask's (a wing's, with attend:
        wings/long_context.py).
        """
        B, T = input_ids.shape
        past = kv_cache.pos if kv_cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=input_ids.device)[None].expand(B, T)
        freqs = position_ids[..., None].float() * self.inv_freq.to(input_ids.device)  # (B, T, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, hd)
        x = self.model.embed_tokens(input_ids)  # (B, T, H)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        if mask is None:
            mask = attention_mask(T, past, key_padding_mask, input_ids.device)
        # mixed precision: linear layers and attention in compute_dtype, the residual stream, norms,
        # softmax's statistics and the head (outside this) in fp32, as torch.autocast lays out
        # (Micikevicius et al. 2018, https://arxiv.org/abs/1710.03740)
        mixed = (
            torch.autocast(x.device.type, dtype=self.compute_dtype)
            if self.compute_dtype
            else nullcontext()
        )
        with mixed:
            for i, layer in enumerate(self.model.layers):
                if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                    x = checkpoint(layer, x, cos, sin, mask, kv_cache, i, use_reentrant=False)
                else:
                    x = layer(x, cos, sin, mask, kv_cache, i)
        if kv_cache is not None:
            kv_cache.pos += T
        return self.model.norm(x)

    def forward(self, input_ids, position_ids=None, key_padding_mask=None, kv_cache=None):
        """-> logits (B, T, V) in the model's dtype."""
        return self.lm_head(self.hidden_states(input_ids, position_ids, key_padding_mask, kv_cache))

    def shared_hidden_states(self, input_ids, shared: SharedPrefix):
        """hidden_states of rows that continue shared prefixes, each prefix run once and each row's
        continuation attending to it through PrefixKV, at the positions it has in its row -> (h,
        where). h (n x P + B x S, H): the prefixes' states, then the continuations'. where (B, T)
        long: the row of h that holds each position's state. Row b's position t reads prefix
        group[b]'s state t while t < lens[group[b]], then its continuation's. Positions a row is
        not run for (past cont) point at some other state: the caller scores none of them."""
        B, T = input_ids.shape
        dev = input_ids.device
        lens, group = shared.lens.to(dev), shared.group.to(dev)  # (n,), (B,)
        # n prefixes, the longest P tokens; S positions of each row's continuation
        n = len(lens)
        P = int(lens.max())
        S = shared.cont
        kv = PrefixKV()
        # the prefixes' states, (n P, H)
        h = [self.hidden_states(input_ids[shared.lead.to(dev), :P], kv_cache=kv).reshape(n * P, -1)]
        start = lens[group]  # (B,) each continuation's start
        if S > 0:
            # (B, S) the continuations' positions in their rows, and their tokens (a position past
            # T is never scored)
            pos = start[:, None] + torch.arange(S, device=dev)
            ids = input_ids.gather(1, pos.clamp(max=T - 1))
            # (B, P + S) the keys a row reads: its own prefix's, then all of its continuation's
            real = torch.cat(
                [
                    torch.arange(P, device=dev)[None] < start[:, None],
                    torch.ones(B, S, dtype=torch.bool, device=dev),
                ],
                dim=1,
            )
            # the continuations' states, (B S, H)
            h.append(self.hidden_states(ids, pos, real, kv.continued(group)).reshape(B * S, -1))
        t = torch.arange(T, device=dev)[None]  # (1, T)
        where = torch.where(
            t < start[:, None],
            group[:, None] * P + t.clamp(max=P - 1),
            n * P + torch.arange(B, device=dev)[:, None] * S + (t - start[:, None]).clamp(min=0),
        )
        return torch.cat(h), where.clamp(max=n * P + B * S - 1)  # (N, H), (B, T)

    def token_logprobs(
        self,
        input_ids,
        temperature=1.0,
        chunk_size=256,
        return_entropy=False,
        mask=None,
        entropy_grad=True,
        score=None,
        score_args=None,
        shared: SharedPrefix | None = None,
    ):
        """Log-prob of each given token under the model:
            logp[:, t] = log softmax(logits[:, t-1] / temperature)[input_ids[:, t]]
        and logp[:, 0] = 0 (nothing predicts the first token). entropy[:, t] is the entropy of that
        same distribution (0 at t = 0).

        mask (B, T), optional: score only the tokens t where mask[:, t] is 1 (the loss mask: what
        the update reads); every other entry of logp and entropy is 0 and costs nothing past the
        decoder. The chosen hidden states are gathered into one (N, H) list, and the lm_head and
        log-softmax run over it chunk_size tokens at a time in fp32, each chunk under activation
        checkpointing, so the (tokens, V) fp32 logits are at most (chunk_size, V), in forward and
        backward, whatever B x T is. entropy_grad=False computes the entropy as a metric only (no
        autograd through the full-vocabulary entropy: the learner's default, entropy_coef = 0).

        score, score_args (B, T), optional: another score of each chosen token, score(z, targets,
        args) -> (C,) with z = logits / temperature (C, V) fp32 and the chunk's targets and
        score_args entries (C,), in place of log softmax(z)[target]. The learner scores a top-k /
        top-p sample under the truncated distribution it was drawn from this way
        (learner.truncated_score). The entropy stays that of softmax(z).

        shared, optional: rows that share their first tokens run them once (shared_hidden_states);
        the scores are those of the plain forward up to float rounding, and so are the gradients
        (see PrefixKV).
        """
        B, T = input_ids.shape
        keep = (
            torch.ones(B, T - 1, dtype=torch.bool, device=input_ids.device)
            if mask is None
            else mask[:, 1:].bool()
        )
        # the N scored tokens, row-major: rows, cols, targets and args are (N,), and h_sel (N, H)
        # holds the hidden state that predicts each (position t-1 predicts token t)
        rows, cols = keep.nonzero(as_tuple=True)
        targets = input_ids[:, 1:][rows, cols]
        if shared is None:
            h = self.hidden_states(input_ids)  # (B, T, H)
            h_sel = h[rows, cols]
        else:
            h, where = self.shared_hidden_states(input_ids, shared)  # (n P + B S, H), (B, T)
            # a prefix's states are read by many rows: index_select, as PrefixKV does
            h_sel = h.index_select(0, where[rows, cols])
        args = score_args[:, 1:][rows, cols] if score is not None else targets

        def chunk_logprobs(h_c, tgt_c, args_c):
            # (C, V) in fp32 (fp64 stays fp64)
            logits = self.lm_head(h_c)
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            if temperature != 1.0:  # sampled at T: score softmax(logits / T)
                logits = logits / temperature
            # (C, V) the whole vocabulary's log-probs, when the score or the entropy needs them
            logp_all = (
                torch.log_softmax(logits, dim=-1) if score is None or return_entropy else None
            )
            # (C,) each target's log-prob, or the caller's score
            logp = (
                logp_all.gather(-1, tgt_c[:, None]).squeeze(-1)
                if score is None
                else score(logits, tgt_c, args_c)
            )
            if not return_entropy:
                return logp, torch.zeros_like(logp)
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                return logp, -(logp_all.exp() * logp_all).sum(-1)  # (C,), (C,)

        recompute = torch.is_grad_enabled() and h.requires_grad
        logps, ents = [], []
        # at least one chunk, empty when nothing is masked: the result still hangs off the decoder's
        # graph, so a backward runs (under FSDP every rank must join every backward's collectives)
        for s in range(0, max(h_sel.shape[0], 1), chunk_size):
            chunk = (
                h_sel[s : s + chunk_size],
                targets[s : s + chunk_size],
                args[s : s + chunk_size],
            )
            lp, ent = (
                checkpoint(chunk_logprobs, *chunk, use_reentrant=False)
                if recompute
                else chunk_logprobs(*chunk)
            )
            logps.append(lp)
            ents.append(ent)

        def scatter(parts):  # (N,) -> (B, T), 0 where not scored
            scores = torch.cat(parts)  # (N,) fp32, or fp64 for a fp64 model
            out = scores.new_zeros(B, T - 1).index_put((rows, cols), scores)  # (B, T-1)
            return torch.cat([out.new_zeros(B, 1), out], dim=1)

        if return_entropy:
            return scatter(logps), scatter(ents)
        return scatter(logps)


def train_flops(model: Transformer, lengths) -> float:
    """Model FLOPs of one training pass (forward + backward) over sequences of the given lengths, as
    in PaLM's MFU (Chowdhery et al. 2022, appendix B; nanoGPT's estimate_mfu): 6 N per token for the
    weight matmuls, plus 12 x layers x heads x head_dim x T per token of a length-T sequence for
    attention's two matmuls (counted in full, causal or not). N counts the lm_head but not the
    embedding lookup (once when the two are tied). Recomputation (activation checkpointing, the
    log-prob chunks) is not model FLOPs and is not counted."""
    c = model.cfg
    n = sum(p.numel() for p in model.parameters())
    if not c.tie_word_embeddings:
        n -= model.model.embed_tokens.weight.numel()  # a lookup, no FLOPs
    attn = 12 * c.num_hidden_layers * c.num_attention_heads * c.head_dim
    return float(sum(6 * n * int(t) + attn * int(t) ** 2 for t in lengths))


# ----------------------------------------------------------------------------- init, load, save


def init_model(cfg: ModelConfig, seed: int) -> Transformer:
    """A freshly initialised model, identical for the same seed: N(0, 0.02) weights, zero
    biases, unit norms."""
    with torch.device("meta"):  # skip nn.Linear's own init (slow, and it draws from the global RNG)
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    # to_empty gives the two tied names separate storage: share it again
    model.tie_weights()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model


def safetensors_files(path) -> list[str]:
    """The weight files of a Hugging Face folder: model.safetensors, or the shards listed in
    its index."""
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.exists(index):
        return ["model.safetensors"]
    with open(index) as f:
        return sorted(set(json.load(f)["weight_map"].values()))


def load_model(path, dtype=torch.float32, device="cpu") -> Transformer:
    """Load a Hugging Face folder: config.json plus model.safetensors, or the shards its
    model.safetensors.index.json lists."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = ModelConfig.from_hf(json.load(f))
    state = {}
    for file in safetensors_files(path):
        state.update(load_file(os.path.join(path, file), device=str(device)))
    state = {k: v.to(dtype) for k, v in state.items()}
    if cfg.tie_word_embeddings:
        # some tied checkpoints store a copy; the tied parameter wins
        state.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = set(model.state_dict()) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match the config: "
            f"missing {missing}, unexpected {unexpected}"
        )
    # assign: keep the loaded tensors, no copy
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    return model


def save_model(model: Transformer, path, max_shard_bytes=None):
    """Write config.json and model.safetensors; past max_shard_bytes, the shards
    model-0000i-of-0000n.safetensors and their index instead."""
    os.makedirs(path, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    if model.cfg.tie_word_embeddings:
        del state["lm_head.weight"]  # Hugging Face re-ties it from the embedding on load
    dtype = next(iter(state.values())).dtype
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(
            {**model.cfg.to_hf(), "torch_dtype": str(dtype).removeprefix("torch.")}, f, indent=2
        )
    # greedy: start a new shard when the next tensor would overflow this one
    shards = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    meta = {"format": "pt"}  # transformers checks this tag
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata=meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, file), metadata=meta)
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
