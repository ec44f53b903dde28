"""fast_decode.py: the torch engine's fast decode step, a wing of rollout.py (rollout.decode=fast
or compiled).

rollout.TorchEngine decodes one token per step through model.py's forward: every sample of a group
reads its own copy of the group's prompt keys and values, each layer is a dozen small launches, and
torch.multinomial draws one random number per vocabulary entry. FastDecodeEngine replaces that step
(TorchEngine's _decode hook and its draw):

  a group's prompt read once   cascade (bifurcated) attention: the samples of a prompt share one
                               copy of its keys and values (CascadeCache: the prompt's KV memory is
                               n-fold smaller); attention over the shared prompt is one batched
                               matmul per group (its samples' queries side by side), over each
                               sample's own tokens one per row, and the two are merged by the
                               log-sum-exp rule (cascade_attention). Hydragen (Juravsky et al. 2024,
                               https://arxiv.org/abs/2402.05099); bifurcated attention (Athiwaratkun
                               et al. 2024, https://arxiv.org/abs/2403.08845).
  fewer launches per token     q/k/v in one matmul and gate/up in one (FusedWeights: concatenated
                               copies of the model's weights, made again whenever a parameter
                               changes), RoPE's angles looked up in a table made once per call with
                               rotate_half's signs folded in (x cos + roll(x) sin: three ops), the
                               norms one call each (F.rms_norm), no attention mask built per step,
                               and each token drawn by the inverse CDF from one uniform per row
                               (inverse_cdf), the law of torch.multinomial.
  compiled (opt-in)            rollout.decode=compiled: decode_layer under torch.compile, compiled
                               once for every layer (dynamic shapes). On CUDA, CUDA graphs
                               (mode="reduce-overhead") replay it over the shapes of a call, fixed:
                               each row's own keys are read whole, the columns past its token
                               masked. A machine without the compiler Inductor needs (a C++ compiler
                               on a CPU, Triton on CUDA) is refused at config load and at engine
                               build (compiler_missing), not mid-run.

The prefill stays model.py's forward. Floats: the step equals the plain one to fp32 round-off, not
bit for bit (its sums run in another order), and its draws are other random numbers from the same
law, so a run's trajectory differs from the plain path's: off by default. The weight-sync gate holds
with it on (tests/test_fast_decode.py), with the prefix cache (prefix_cache.py) and partial rollouts
(async_rollouts.py). Docs: docs/performance.md.

Shapes: b rows still generating, D distinct prompts they continue, n rows of a group at most,
        P prompt columns (cached and prefilled), N max new tokens, t generated tokens fed so far,
        H hidden, nh query heads, nkv key/value heads, r = nh / nkv query heads per key/value head,
        hd head dim, V vocab.
Imports: rollout.py (and torch, the standard library).
"""

from contextlib import nullcontext
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental import _config as fx_config

from rollout import DECODE_RESERVE, KVCache, TorchEngine, grown

DECODES = ("plain", "fast", "compiled")  # rollout.decode's values


def check_config(cfg) -> list:
    """config.WING_CHECKS' hook: rollout.decode needs the torch engine, fp32 compute, and compiled
    a compiler."""
    if cfg.rollout.decode != "plain" and cfg.rollout.engine != "torch":
        raise ValueError(
            f"rollout.decode={cfg.rollout.decode!r} is the torch engine's decode step: set "
            f"rollout.engine=torch (vLLM and servers have their own)"
        )
    if cfg.rollout.decode != "plain" and cfg.learner.precision == "bf16":
        # the gate compares the engine with the learner, whose SDPA rounds inside in bf16 as the
        # cascade's fp32 sums do not: on the default model the gap was 0.055-0.072 against the plain
        # engine's 0.025-0.041 (limit 0.05)
        raise ValueError(
            "rollout.decode=fast/compiled with learner.precision=bf16: "
            "the weight-sync gate's gap grows past its 0.05 "
            "(the learner's bf16 attention rounds as the fast step's does not); "
            "use rollout.decode=plain, or learner.precision=fp32 (model.dtype=bfloat16 works)"
        )
    if cfg.rollout.decode == "compiled":
        missing = compiler_missing(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        if missing:
            raise ValueError(f"rollout.decode=compiled: {missing}")
    return [("rollout.decode", cfg.rollout.decode, DECODES)]


def compiler_missing(device: torch.device) -> str | None:
    """Why torch.compile cannot build the decode step on `device`, or None when it can: Inductor
    writes C++ on a CPU (a compiler on PATH, or $CXX) and Triton kernels on CUDA."""
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return (
            None
            if has_triton()
            else "torch.compile on CUDA needs Triton; install it, or use rollout.decode=fast"
        )
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as e:  # Inductor's own error names what it looked for
        return (
            f"torch.compile on a CPU needs a C++ compiler ({type(e).__name__}: {e}); "
            "use rollout.decode=fast"
        )
    return None


# -----------------------------------------------------------------------------
# the step


class FusedWeights(NamedTuple):
    """The model's weights as the decode step reads them: per layer (input norm, q/k/v (nh hd + 2
    nkv hd, H) and its bias or None, o_proj's weight and bias or None, Qwen3's q and k norms or
    None, post-attention norm, gate/up (2 I, H), down (H, I)). The concatenations are copies, the
    rest the parameters themselves."""

    embed: torch.Tensor  # (V, H)
    norm: torch.Tensor  # (H,) the final norm
    eps: float
    layers: list


def fuse(model: nn.Module) -> FusedWeights:
    """The decode step's weights of `model`, which must be plain nn.Linear layers (a LoRA or NF4
    layer's .weight is not what it computes: refused)."""
    layers = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        for proj in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj):
            if type(proj) is not nn.Linear:
                raise ValueError(
                    f"rollout.decode=fast reads plain nn.Linear weights, not {type(proj).__name__}"
                )
        bias = (
            torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
            if a.q_proj.bias is not None
            else None
        )
        norms = (a.q_norm.weight, a.k_norm.weight) if hasattr(a, "q_norm") else (None, None)
        layers.append(
            (
                layer.input_layernorm.weight,
                torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                bias,
                a.o_proj.weight,
                a.o_proj.bias,
                *norms,
                layer.post_attention_layernorm.weight,
                torch.cat([m.gate_proj.weight, m.up_proj.weight]),
                m.down_proj.weight,
            )
        )
    return FusedWeights(
        model.model.embed_tokens.weight, model.model.norm.weight, model.cfg.rms_norm_eps, layers
    )


def attend(q, k, v, mask=None) -> tuple:
    """Softmax attention with its log-sum-exp: q (..., m, hd) scaled, k and v (..., T, hd), mask
    broadcast to (..., m, T) -> (out (..., m, hd) normalised over these keys alone, lse (..., m,
    1))."""
    s = q @ k.transpose(-1, -2)  # (..., m, T)
    if mask is not None:
        s = s + mask
    lse = s.logsumexp(-1, keepdim=True)  # (..., m, 1)
    return (s - lse).exp() @ v, lse


def cascade_attention(q, pk, pv, pmask, own_k, own_v, own_mask, slot, at) -> torch.Tensor:
    """Attention of each row's query over its group's prompt and its own tokens, the prompt's keys
    read once per group (Hydragen, Juravsky et al. 2024, https://arxiv.org/abs/2402.05099): the
    queries of a group's rows side by side against the prompt (one matmul per group), each row
    against its own tokens, and the two softmaxes merged by their log-sum-exps: softmax over
    [prompt; own] = w softmax(prompt) + (1 - w) softmax(own), w = sigmoid(lse_prompt
    - lse_own). q (b, nkv, r, hd) scaled; pk, pv (D, nkv, P, hd), pmask (D, 1, 1, P); own_k, own_v
    (b, nkv, T, hd), own_mask broadcast to (b, nkv, r, T) or None; slot (D, n), at (b,)
    (CascadeCache) -> (b, nkv, r, hd)."""
    b, nkv, r, hd = q.shape
    D, n = slot.shape
    qg = q[slot].transpose(1, 2).reshape(D, nkv, n * r, hd)  # (D, nkv, n r, hd) a group's queries
    o, lse = attend(qg, pk, pv, pmask)  # (D, nkv, n r, hd), (D, nkv, n r, 1)
    # (D, n, nkv, r, hd + 1)
    pre = torch.cat([o, lse], -1).view(D, nkv, n, r, hd + 1).transpose(1, 2)
    pre = pre.reshape(D * n, nkv, r, hd + 1)[at]  # (b, nkv, r, hd + 1) back to rows
    o_own, lse_own = attend(q, own_k, own_v, own_mask)  # (b, nkv, r, hd), (b, nkv, r, 1)
    return torch.lerp(o_own, pre[..., :hd], torch.sigmoid(pre[..., hd:] - lse_own))


def decode_layer(
    x,
    cos,
    sin,
    w: tuple,
    pk,
    pv,
    pmask,
    own_k,
    own_v,
    own_mask,
    slot,
    at,
    t,
    nh: int,
    nkv: int,
    eps: float,
):
    """One decoder layer on one token per row: x (b, H), cos and sin (b, 1, hd) its position's RoPE
    angles (sin with rotate_half's signs), w the layer's FusedWeights entry, pk, pv, own_k, own_v,
    slot, at a layer's CascadeCache; writes each row's key and value at column t ((1,) long) of
    own_k, own_v and attends to the columns they span (own_mask: those past t, when they span all N)
    -> x (b, H). model.DecoderLayer's math on one position, with fused projections and cascade
    attention (under autocast, in the cache's dtype)."""
    ln1, wqkv, bqkv, wo, bo, qn, kn, ln2, wgu, wd = w
    b, H, hd = x.shape[0], x.shape[1], cos.shape[-1]
    # (b, nh + 2 nkv, hd)
    qkv = F.linear(F.rms_norm(x, (H,), ln1, eps), wqkv, bqkv).view(b, nh + 2 * nkv, hd)
    qk = qkv[:, : nh + nkv]
    if qn is not None:  # Qwen3: per-head norms before RoPE
        qk = torch.cat(
            [F.rms_norm(qk[:, :nh], (hd,), qn, eps), F.rms_norm(qk[:, nh:], (hd,), kn, eps)], 1
        )
    qk = torch.addcmul(qk * cos, qk.roll(hd // 2, -1), sin)  # RoPE: x cos + rotate_half(x) sin
    own_k.index_copy_(2, t, qk[:, nh:, None].to(own_k.dtype))  # this token's key and value
    own_v.index_copy_(2, t, qkv[:, nh + nkv :, None].to(own_v.dtype))
    # (b, nkv, r, hd) scaled
    q = (qk[:, :nh].to(own_k.dtype) * hd**-0.5).reshape(b, nkv, nh // nkv, hd)
    with torch.autocast(x.device.type, enabled=False):
        y = cascade_attention(q, pk, pv, pmask, own_k, own_v, own_mask, slot, at)  # (b, nkv, r, hd)
    x = x + F.linear(y.reshape(b, nh * hd), wo, bo)
    gate, up = F.linear(F.rms_norm(x, (H,), ln2, eps), wgu).chunk(2, dim=-1)  # (b, I) each
    return x + F.linear(F.silu(gate) * up, wd)  # SwiGLU


def inverse_cdf(probs, generator=None):
    """One index per row of probs (B, V), drawn with those probabilities from one uniform per row:
    the first index whose cumulative probability reaches u x the row's total, u in (0, 1] (so never
    an index of probability 0, nor one past the last). The law of torch.multinomial(probs, 1), which
    draws an exponential per entry: at a 1k vocabulary that took as long as a small model's whole
    decode step here."""
    cdf = probs.cumsum(-1)  # (B, V)
    # (B, 1)
    u = 1 - torch.rand(probs.shape[0], 1, generator=generator, device=probs.device, dtype=cdf.dtype)
    return torch.searchsorted(cdf, u * cdf[:, -1:]).squeeze(-1)  # (B,)


# -----------------------------------------------------------------------------
# the cache and the engine


class CascadeCache:
    """The keys and values of a decode batch with each prompt held once. It starts as a plain
    rollout.KVCache over the D distinct prompts, for their prefill; keep_rows(source), which in
    rollout.TorchEngine copies each prompt's keys into its samples, records instead which prompt
    each row continues. From then on it holds per layer each prompt's keys and values once, pk, pv
    (D, nkv, P, hd), with their padding mask pmask (D, 1, 1, P), and each row's own generated
    tokens', ok, ov (b, nkv, N, hd). Row i is the rank[i]-th row of group group[i] (slot (D, n) the
    reverse, 0 where a group has fewer rows; at (b,) the row's index in (D n,)). Rows that finish
    leave (keep_rows), and so do prompts left without rows. pos counts the columns a row has filled,
    P + t, as KVCache.pos does; k and v read like KVCache's for one row (cache.k[layer][row]: (nkv,
    pos, hd)), as prefix_cache.py and async_rollouts.py read them."""

    def __init__(self, prefill: KVCache, real, P: int, reserve: int | None = DECODE_RESERVE):
        # real (D, P + N): the prompts' padding mask
        self.prefill, self.real, self.P = prefill, real, P
        self.pos, self.max_len, self.group = prefill.pos, prefill.max_len, None
        # generated tokens ok and ov hold room for at first (None: all N), growing as KVCache does
        self.reserve = reserve

    def update(self, layer_idx, k, v):
        """The prefill's (model.hidden_states writes the prompts through this)."""
        self.prefill.pos = self.pos
        return self.prefill.update(layer_idx, k, v)

    def keep_rows(self, rows):
        if self.group is not None:  # rows leave: the rest keep their tokens
            self.ok, self.ov = [k[rows] for k in self.ok], [v[rows] for v in self.ov]
            self._place(self.group[rows])
            return
        # after the prefill: rows = each row's prompt
        P, N = self.P, min(self.max_len - self.P, self.reserve or self.max_len)
        self.pk = [k[:, :, :P].contiguous() for k in self.prefill.k]  # (D, nkv, P, hd)
        self.pv = [v[:, :, :P].contiguous() for v in self.prefill.v]
        self.pmask = torch.zeros(self.real[:, :P].shape, dtype=self.pk[0].dtype, device=rows.device)
        # (D, 1, 1, P)
        self.pmask = self.pmask.masked_fill(~self.real[:, :P], -torch.inf)[:, None, None]
        # (b, nkv, N, hd)
        self.ok = [k.new_zeros(len(rows), k.shape[1], N, k.shape[3]) for k in self.pk]
        self.ov = [torch.zeros_like(k) for k in self.ok]
        self.prefill = self.real = None
        self._place(rows)

    def make_room(self, columns: int):
        """ok and ov hold at least `columns` generated tokens: grown to 1.5x that (at most N)."""
        if columns > self.ok[0].shape[2]:
            n = min(self.max_len - self.P, columns * 3 // 2)
            self.ok, self.ov = [grown(k, n) for k in self.ok], [grown(v, n) for v in self.ov]

    def _place(self, group):
        """group (b,) -> prompts without rows leave; each group's rows take places 0, 1, ...
        in order."""
        alive = torch.bincount(group, minlength=len(self.pmask)) > 0  # (D,)
        if not bool(alive.all()):
            keep = alive.nonzero().squeeze(1)
            self.pk, self.pv = [k[keep] for k in self.pk], [v[keep] for v in self.pv]
            self.pmask, group = self.pmask[keep], (alive.cumsum(0) - 1)[group]
        D, b, dev = len(self.pmask), len(group), group.device
        counts = torch.bincount(group, minlength=D)  # (D,)
        order = torch.argsort(group, stable=True)  # rows by prompt, in order
        rank = torch.empty_like(group)
        rank[order] = torch.arange(b, device=dev) - (counts.cumsum(0) - counts)[group[order]]
        self.slot = torch.zeros(D, int(counts.max()), dtype=torch.long, device=dev)
        self.slot[group, rank] = torch.arange(b, device=dev)
        self.group, self.at = group, group * self.slot.shape[1] + rank

    def from_rows(self, plain: KVCache) -> "CascadeCache":
        """After partial rollouts' swap (async_rollouts.ConcurrentEngine._recompute): every row's
        keys recomputed into a plain KVCache, (b, nkv, pos, hd) per layer; take each prompt's from
        its first row and each row's own."""
        first, fed = self.slot[:, 0], plain.pos - self.P
        self.pk = [k[first, :, : self.P].contiguous() for k in plain.k]
        self.pv = [v[first, :, : self.P].contiguous() for v in plain.v]
        for own, new in zip(self.ok + self.ov, plain.k + plain.v):
            own[:, :, :fed] = new[:, :, self.P : plain.pos]
        self.pos = plain.pos
        return self

    @property
    def k(self):
        return [_RowKV(p, o, self) for p, o in zip(self.pk, self.ok)]

    @property
    def v(self):
        return [_RowKV(p, o, self) for p, o in zip(self.pv, self.ov)]


class _RowKV:
    """One layer's keys (or values) of one row as a KVCache holds them: cache.k[layer][row] -> (nkv,
    pos, hd)."""

    def __init__(self, prompt, own, cache: CascadeCache):
        self.prompt, self.own, self.cache, self.dtype = prompt, own, cache, prompt.dtype

    def __getitem__(self, row):
        c = self.cache
        return torch.cat([self.prompt[c.group[row]], self.own[row, :, : c.pos - c.P]], dim=1)


class FastDecodeEngine(TorchEngine):
    """A TorchEngine whose decode step runs decode_layer over a CascadeCache (rollout.decode=fast),
    or decode_layer under torch.compile (decode=compiled: one compiled layer serves every layer; on
    a CPU with dynamic shapes, a compile for the first token and again the first time a size reaches
    1, as when one group or one row is left: dynamo specializes sizes 0 and 1; measured, ~40 s each
    on a 2-core CPU: five compiles for three prompts whose rows stop at different steps, two when
    every row runs to max_tokens; on CUDA each row's own keys are read whole, masked past the token,
    so a call's shapes stay fixed for the CUDA graphs). The fused weights are made again when the
    parameters change: at each batch's prefill (an optimizer step on a model the learner shares, a
    push) and after partial rollouts swap weights mid-generation."""

    draw = staticmethod(inverse_cdf)

    def __init__(self, model, decode: str = "fast", **kwargs):
        super().__init__(model, **kwargs)
        if decode not in DECODES[1:]:
            raise ValueError(f"decode={decode!r}: fast or compiled")
        device = next(model.parameters()).device
        self.weights, self.fused_at, self.layer = fuse(model), None, decode_layer
        # CUDA graphs replay fixed shapes
        self.static = decode == "compiled" and device.type == "cuda"
        if decode == "compiled":
            missing = compiler_missing(device)
            if missing:
                raise RuntimeError(f"rollout.decode=compiled: {missing}")
            mode = "reduce-overhead" if self.static else None  # CUDA graphs on CUDA
            self.layer = torch.compile(decode_layer, dynamic=True, mode=mode)

    def _fused(self) -> FusedWeights:
        # bumped by every in-place write
        version = tuple((id(p), p._version) for p in self.model.parameters())
        if version != self.fused_at:
            self.weights, self.fused_at = fuse(self.model), version
        return self.weights

    def _prefill_layout(self, distinct, N: int, device) -> tuple:
        cache, ids, real, C = super()._prefill_layout(distinct, N, device)
        P = C + ids.shape[1]
        self._fused()
        # RoPE's angles for every position this call can reach, as model.hidden_states computes
        # them; sin with rotate_half's signs (rotate_half(x) = roll(x, hd/2) * [-1 ... -1, 1 ... 1])
        # (P + N, hd/2)
        freqs = torch.arange(P + N, device=device)[:, None].float() * self.model.inv_freq.to(device)
        emb, dtype = torch.cat((freqs, freqs), dim=-1), self.weights.embed.dtype
        sign = torch.cat([-torch.ones_like(freqs[0]), torch.ones_like(freqs[0])])  # (hd,)
        self.cos, self.sin = emb.cos().to(dtype), (emb.sin() * sign).to(dtype)  # (P + N, hd)
        # CUDA graphs need ok and ov at fixed addresses: all N columns from the start
        return CascadeCache(cache, real, P, None if self.static else DECODE_RESERVE), ids, real, C

    def _token_boundary(self, prompts, rows, real, tokens, cache, prompt_end: int, h) -> tuple:
        new, h = super()._token_boundary(prompts, rows, real, tokens, cache, prompt_end, h)
        if new is not cache:  # partial rollouts swapped weights: every row's keys are recomputed
            self._fused()
            new = cache.from_rows(new)
        return new, h

    def _decode(self, tok, positions, real, cache: CascadeCache):
        # fed: this token's column in ok, ov
        c, w, fed = self.model.cfg, self.weights, cache.pos - cache.P
        t = torch.tensor([fed], device=tok.device)
        cache.make_room(fed + 1)
        own_k, own_v, mask = (
            [k[:, :, : fed + 1] for k in cache.ok],
            [v[:, :, : fed + 1] for v in cache.ov],
            None,
        )
        # CUDA graphs: fixed shapes, the columns past this token masked, and the buffers it writes
        # at fixed addresses
        if self.static:
            own_k, own_v, N = cache.ok, cache.ov, cache.ok[0].shape[2]
            mask = torch.zeros(N, dtype=cache.pmask.dtype, device=tok.device).masked_fill(
                torch.arange(N, device=tok.device) > fed, -torch.inf
            )  # (N,)
            for buf in own_k + own_v:
                torch._dynamo.mark_static_address(buf)
        cos, sin = self.cos[positions], self.sin[positions]  # (b, 1, hd)
        # bf16 autocast, as model.hidden_states runs it (check_config)
        mixed = self.model.compute_dtype
        # compiling: no "duck sizing", so two sizes that happen to be equal (64 rows, 64 new tokens)
        # stay two symbols
        compiling = (
            fx_config.patch(use_duck_shape=False)
            if self.layer is not decode_layer
            else nullcontext()
        )
        with torch.autocast(tok.device.type, dtype=mixed) if mixed else nullcontext(), compiling:
            x = F.embedding(tok, w.embed)  # (b, H)
            for i, layer in enumerate(w.layers):
                x = self.layer(
                    x,
                    cos,
                    sin,
                    layer,
                    cache.pk[i],
                    cache.pv[i],
                    cache.pmask,
                    own_k[i],
                    own_v[i],
                    mask,
                    cache.slot,
                    cache.at,
                    t,
                    c.num_attention_heads,
                    c.num_key_value_heads,
                    w.eps,
                )
        cache.pos += 1
        return F.rms_norm(x, (x.shape[-1],), w.norm, w.eps)[:, None]  # (b, 1, H)
