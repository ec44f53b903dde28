"""prefix_cache.py: the torch engine's prefix cache, a wing of rollout.py
(rollout.prefix_cache_tokens > 0).

A multi-turn episode sends its whole conversation back every turn; with this cache
rollout.TorchEngine prefills only what follows the longest prefix it already holds. PrefixCache
holds the keys and values; PrefixCachedEngine is the TorchEngine that uses it, through the engine's
hooks (_prefill_layout, _rows_done, _store), and rollout.make_engine builds it when a run asks for
it. The sampled tokens are the same as without it; the log-probs agree to float rounding (the cached
keys were computed in another batch layout). Docs: docs/prefix_cache.md.

Shapes: as rollout.py (D distinct prompts, C cache columns holding prefix-cached tokens, S columns
to prefill, N max new tokens).
Imports: rollout.py (and torch, the standard library).
"""

from collections import OrderedDict

import torch

from rollout import DECODE_RESERVE, KVCache, TorchEngine


class PrefixCache:
    """Keys and values of sequences the engine has already run, found again by their token ids.

    A multi-turn episode sends its whole conversation back every turn: turn k's prompt is turn k-1's
    prompt, its generation and the new observation. With this cache the engine prefills only what
    follows the longest prefix it already holds (the keys and values of position j depend on tokens
    0..j alone: causal attention). The same idea as vLLM's automatic prefix caching
    (https://docs.vllm.ai/en/latest/design/prefix_caching.html), minus its paging: an entry is one
    sequence's keys and values, (layers, nkv, n, hd) each, and lookups go through hashes of its
    prefixes at every BLOCK tokens, then an exact comparison of the ids.

    Bounded by max_tokens cached positions in all: least recently used entries go first. The engine
    removes an entry once a prompt has taken its prefix from it (the row stores its own, longer
    sequence after the call), so one running episode holds one entry. Entries are only valid for the
    weights that computed them: the engine clears the cache when its weights change
    (PrefixCachedEngine._weights_version).
    """

    BLOCK = 16

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        # id -> (token ids tuple, k (layers, nkv, n, hd), v (same)); oldest first
        self.entries = OrderedDict()
        # hash of ids[:BLOCK * j] (j >= 1) -> ids of the entries starting with them
        self.index: dict[int, set] = {}
        self.tokens = 0  # positions held, over all entries
        self.next_id = 0

    @classmethod
    def block_hashes(cls, ids) -> list[int]:
        """hash(ids[:BLOCK]), hash(ids[:2 BLOCK]), ...: chained, so computing them all is linear
        in len(ids)."""
        out, h = [], 0
        for s in range(cls.BLOCK, len(ids) + 1, cls.BLOCK):
            h = hash((h, tuple(ids[s - cls.BLOCK : s])))
            out.append(h)
        return out

    def lookup(self, ids: list[int]) -> tuple[int, tuple | None]:
        """(n, entry) for the entry sharing the longest prefix with ids, n <= len(ids) - 1 tokens of
        it (the last prompt token is always prefilled: its logits start the generation); (0, None)
        when nothing is shared."""
        best_n, best = 0, None
        hashes = self.block_hashes(ids)
        for j in range(len(hashes), 0, -1):  # the longest block-aligned prefix held by some entry
            for eid in self.index.get(hashes[j - 1], ()):
                seq = self.entries[eid][0]
                n = j * self.BLOCK
                if seq[:n] != tuple(ids[:n]):  # a hash collision
                    continue
                while n < min(len(seq), len(ids)) and seq[n] == ids[n]:
                    n += 1
                if n > best_n:
                    best_n, best = n, eid
            if best is not None:
                break
        if best is None:
            return 0, None
        self.entries.move_to_end(best)  # recently used
        return min(best_n, len(ids) - 1), best

    def get(self, eid) -> tuple:
        return self.entries[eid]

    def insert(self, ids: list[int], k: torch.Tensor, v: torch.Tensor):
        """Hold ids' keys and values k, v (layers, nkv, len(ids), hd), evicting the oldest entries
        past max_tokens."""
        n = len(ids)
        if n < self.BLOCK or n > self.max_tokens:
            # too short to be found, or larger than the whole budget
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


class PrefixCachedEngine(TorchEngine):
    """A TorchEngine that keeps the keys and values of every sequence it generated, up to
    prefix_cache_tokens positions (PrefixCache): a prompt that starts with one of them prefills only
    the rest. Entries hold only for the weights that computed them: the cache is cleared when the
    parameters change (an optimizer step on a model the learner shares, a push), and a call whose
    weights changed mid-generation stores nothing."""

    def __init__(self, model, prefix_cache_tokens: int, **kwargs):
        super().__init__(model, **kwargs)
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
        # the weights' version the prefix cache's keys and values were computed with
        self.cache_version = None
        # original row -> (k, v, generated tokens fed), of the call in progress
        self._row_kv_done = {}
        self._call_version = None  # the weights' version at the start of the call in progress

    def _weights_version(self) -> tuple:
        """Changes whenever a parameter is written in place (an optimizer step, a push,
        load_state_dict: every in-place op bumps a tensor's _version) or replaced: cached keys and
        values are stale from then on. Covers a model the learner shares, which is updated without
        update_weights being called."""
        return tuple((id(p), p._version) for p in self.model.parameters())

    def generate(self, prompts, params):
        if self.cache_version != self._weights_version():
            self.prefix_cache.clear()
            self.cache_version = self._weights_version()
        return super().generate(prompts, params)

    def _prefill_layout(self, distinct: list[tuple], N: int, device) -> tuple:
        """Columns [0, C) hold the cached prefixes, right-aligned (C = the longest); columns [C, C +
        S) the tokens to prefill, right-aligned (S = the longest rest); then N columns for
        generation. A row's cached prefix and its rest may have padding between them: the mask hides
        it, and positions count real tokens only. Without a hit, C = 0 and S = the longest prompt:
        the plain left padding of TorchEngine."""
        D, cfg = len(distinct), self.model.cfg
        self._row_kv_done, self._call_version = {}, self._weights_version()
        hits = [self.prefix_cache.lookup(list(p)) for p in distinct]
        C = max(n for n, _ in hits)
        S = max(len(p) - n for p, (n, _) in zip(distinct, hits))
        ids = torch.full((D, S), self.pad_id, dtype=torch.long)
        # key padding mask over the cache; generated = real
        real = torch.zeros(D, C + S + N, dtype=torch.bool)
        for i, (p, (n, _)) in enumerate(zip(distinct, hits)):
            ids[i, S - (len(p) - n) :] = torch.tensor(p[n:], dtype=torch.long)
            real[i, C - n : C] = True
            real[i, C + S - (len(p) - n) :] = True  # the rest, then every generated token
        cache = KVCache(
            cfg,
            D,
            C + S + N,
            dtype=self.model.lm_head.weight.dtype,
            device=device,
            reserve=C + S + DECODE_RESERVE,
        )
        for i, (n, eid) in enumerate(hits):
            if n:
                _, k, v = self.prefix_cache.get(eid)
                for layer in range(cfg.num_hidden_layers):
                    cache.k[layer][i, :, C - n : C] = k[layer, :, :n]
                    cache.v[layer][i, :, C - n : C] = v[layer, :, :n]
        # every row of this call stores its own sequence when the call ends, which holds the n
        # tokens it took; what an entry held past them (a generation the agent cut to its budget) is
        # dropped with it
        for eid in {eid for n, eid in hits if n}:
            self.prefix_cache.remove(eid)
        cache.pos = C
        self.prompt_tokens += sum(len(p) for p in distinct)
        self.prefilled_tokens += sum(len(p) - n for p, (n, _) in zip(distinct, hits))
        return cache, ids.to(device), real.to(device), C

    def _rows_done(self, cache: KVCache, real, rows, which, prompt_end: int):
        """{original row: (k, v (layers, nkv, n, hd), generated tokens fed)} of batch rows `which`,
        kept for _store: their real positions only (cached prefix, prompt and generated tokens,
        without the padding between them)."""
        super()._rows_done(cache, real, rows, which, prompt_end)
        fed = cache.pos - prompt_end  # generated tokens run through the model
        for r in which.tolist():
            cols = real[r, : cache.pos].nonzero().squeeze(1)  # (n,)
            k = torch.stack([layer[r][:, cols] for layer in cache.k])  # (layers, nkv, n, hd)
            v = torch.stack([layer[r][:, cols] for layer in cache.v])
            self._row_kv_done[int(rows[r])] = (k, v, fed)

    def _store(self, prompts, tokens: list[list[int]], lengths: list[int]):
        super()._store(prompts, tokens, lengths)
        row_kv, self._row_kv_done = self._row_kv_done, {}
        if self._call_version != self._weights_version():
            # weights swapped mid-call: keys of two versions
            return
        for row, (k, v, fed) in row_kv.items():
            # the positions computed: the prompt and the sampled tokens fed back
            # (at most the row's own tokens)
            m = min(fed, lengths[row])
            self.prefix_cache.insert(
                list(prompts[row]) + tokens[row][:m],
                k[:, :, : len(prompts[row]) + m],
                v[:, :, : len(prompts[row]) + m],
            )

    @torch.no_grad()
    def _load(self, state_dict: dict):
        super()._load(state_dict)
        self.prefix_cache.clear()  # keys and values of the old weights (generate would also notice)
        self.cache_version = None

    def sleep(self):
        """Free the prefix cache: the learner may need the memory, and the weights are about
        to change."""
        super().sleep()
        self.prefix_cache.clear()
