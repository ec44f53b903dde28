"""long_context.py: a prompt longer than a chunk, prefilled in memory linear in its length (a wing
of rollout.py: TorchEngine, wings/batcher.py and wings/async_rollouts.py call prefill when a prompt
is longer than rollout.prefill_chunk_tokens).

Run whole, a prompt of S tokens builds an (S, S) attention mask (left padding needs one), and
torch's CPU attention turns it into an (S, S) float bias: 24k tokens took 3.3 GB on the
0.9M-parameter default model, and a 72k-token request asked a server for 23 GB. In chunks
(Agrawal et al. 2023, Sarathi, https://arxiv.org/abs/2308.16369; vLLM's chunked prefill), each
chunk of C tokens is one forward pass that writes its keys and values into the KV cache and attends
to everything cached before it: the activations are those of C tokens, and the attention's mask
and scores those of C queries. The first chunk is an ordinary forward (model.hidden_states), so a
prompt no longer than a chunk is computed exactly as it always was.

A later chunk's attention (chunk_attention) never forms a (C, keys) tensor either: it runs as two
fused attentions, one over the keys cached before the chunk and one causal over the chunk's own,
merged by their log-sum-exps, as flash attention merges its blocks (Dao et al. 2022,
https://arxiv.org/abs/2205.14135). Where no key is padding, neither needs a mask, and the fused
kernel runs at its full speed (bench/long_context.py measures both against torch's fused causal
attention over the whole prompt).

Shapes: B rows, S prompt columns, C a chunk's columns, P columns cached before it, nh query heads,
nkv key/value heads, hd head dim, H hidden.
Imports: model.py (attention_mask, Transformer) (and torch).
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

from model import Transformer, attention_mask


class ChunkMask(NamedTuple):
    """The mask of a later chunk: its C queries after P cached keys, in two parts that are never
    joined into (C, P + C). model.Attention calls attend in place of its own attention."""

    past: torch.Tensor | None  # (B, 1, 1, P) True = a real key; None: all are
    own: torch.Tensor | None  # (B, 1, C, C) the chunk's causal mask; None: plain causal

    @classmethod
    def of(cls, C: int, P: int, key_padding_mask) -> "ChunkMask":
        """The mask of C queries after P cached columns under key_padding_mask (B, >= P + C), True
        = a real token (None: no padding)."""
        real = key_padding_mask[:, : P + C] if key_padding_mask is not None else None
        if real is None or bool(real.all()):
            return cls(None, None)
        past = None if bool(real[:, :P].all()) else real[:, None, None, :P]
        # causal within the chunk, real keys only, a query always seeing itself (model's rule)
        own = None if bool(real[:, P:].all()) else attention_mask(C, 0, real[:, P:], real.device)
        return cls(past, own)

    def attend(self, q, k, v):
        return chunk_attention(q, k, v, self)


def chunk_attention(q, k, v, mask: ChunkMask):
    """Attention of a chunk's C queries q (B, nh, C, hd) over k, v (B, nkv, P + C, hd): the P keys
    cached before the chunk, then the chunk's own, under `mask` -> (B, nh, C, hd).

    On the CPU: one fused attention over the P earlier keys and one causal over the chunk's own,
    each returning its log-sum-exp (lse); each output weighs by its share of the total,
    e^lse1 / (e^lse1 + e^lse2) = sigmoid(lse1 - lse2). On other devices: one attention under the
    joined (B, 1, C, P + C) mask (exact too, and still linear in P).
    """
    B, nh, C, hd = q.shape
    P, nkv = k.shape[2] - C, k.shape[1]
    ones = torch.ones(C, P + C, dtype=torch.bool, device=q.device)
    past = ones[None, None, :1, :P] if mask.past is None else mask.past
    own = ones[:, P:].tril()[None, None] if mask.own is None else mask.own
    if q.device.type != "cpu":
        joined = torch.cat([past.expand(B, 1, C, P), own.expand(B, 1, C, C)], dim=-1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=joined, enable_gqa=nkv != nh)
    # the fused CPU kernel that also returns the log-sum-exp (what F.scaled_dot_product_attention
    # calls on the CPU, which keeps it to itself)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    k, v = k.to(q.dtype), v.to(q.dtype)

    def bias(m):  # True/False -> 0/-inf, or None
        if m is None:
            return None
        return torch.zeros(m.shape, dtype=q.dtype, device=q.device).masked_fill(~m, -torch.inf)

    # The kernel wants as many key heads as query heads. Over the earlier keys, the queries of the
    # heads that share a key head run as one longer block (B, nkv, nh / nkv x C, hd), so those keys
    # are never copied; the chunk's own keys are few, and are copied per head.
    y_past, lse_past = flash(
        q.reshape(B, nkv, -1, hd), k[:, :, :P], v[:, :, :P], attn_mask=bias(mask.past)
    )
    y_past, lse_past = y_past.reshape(q.shape), lse_past.reshape(B, nh, C)
    y_own, lse_own = flash(
        q,
        k[:, :, P:].repeat_interleave(nh // nkv, dim=1),
        v[:, :, P:].repeat_interleave(nh // nkv, dim=1),
        is_causal=mask.own is None,
        attn_mask=bias(mask.own),
    )
    # a row with no real earlier key: the kernel reports lse 0 where it means -inf
    lse_past = lse_past.masked_fill(~past.any(-1), -torch.inf)
    share_past = torch.sigmoid(lse_past - lse_own)[..., None]
    share_own = torch.sigmoid(lse_own - lse_past)[..., None]
    return (y_past * share_past + y_own * share_own).to(q.dtype)


def prefill(
    model: Transformer, input_ids, position_ids, key_padding_mask, kv_cache, chunk_tokens: int
):
    """Run prompts (B, S) into kv_cache, chunk_tokens columns at a time -> the last position's
    hidden state (B, 1, H), which an engine samples the first token from. position_ids (B, S);
    key_padding_mask (B, >= cached + S) or None, as model.hidden_states takes them."""
    for s in range(0, input_ids.shape[1], chunk_tokens):
        cols = slice(s, s + chunk_tokens)
        ids = input_ids[:, cols]
        # the first chunk is an ordinary forward: model.attention_mask's mask
        mask = ChunkMask.of(ids.shape[1], kv_cache.pos, key_padding_mask) if s else None
        h = model.hidden_states(ids, position_ids[:, cols], key_padding_mask, kv_cache, mask)
    return h[:, -1:]
