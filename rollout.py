"""rollout.py: the reference inference engine that samples RL rollouts, and the gate that checks it
runs the learner's weights.

Every engine speaks token ids in, token ids + log-probs out: `generate(prompts, SamplingParams)`
takes a list of token-id prompts and returns `len(prompts) * n` `Generation`s (prompt-major), each
with the sampled ids and the log-prob of every sampled id under the distribution it was drawn from:
softmax(logits / T) (T = 1 when greedy), or with top-k / top-p that softmax renormalised over the
kept set, whose size is recorded per token (kept_sizes) so the learner can score the same truncated
distribution (sample_tokens says how). Engines that train also take `update_weights(state_dict)`
with Hugging Face names, and `sleep()` / `wake_up()` around the update (they free the engine's GPU
memory while the learner runs; no-ops elsewhere). Text, chat templates and tools live in chat.py and
agent.py, so an engine never sees a string.

TorchEngine, here, is the reference: a pure-PyTorch batched sampler with a KV cache (model.py's
Transformer), CPU-fast for tiny models, the one the others are tested against. Other engines and
optional pieces of this one are wings, files of their own that make_engine imports by name only when
a run asks for them (as env.py imports the worlds):
  engine_vllm.py     VLLMEngine, a colocated vLLM (rollout.engine=vllm)
  engine_openai.py   OpenAIEngine, a client of an OpenAI-compatible server (rollout.engine=openai):
                     trains through serve.py or a `vllm serve` that reloads pushed weights,
                     evaluates through any such server
  prefix_cache.py    keys and values kept across calls, so a turn prefills only its new tokens
                     (prefix_cache_tokens)
  async_rollouts.py  a TorchEngine that generates in a background thread and takes pushes
                     mid-generation (rollout.async_rollouts, rollout.partial_rollouts)
  fast_decode.py     a decode step that reads a group's prompt once, with fused projections,
                     optionally compiled (rollout.decode)
Each optional piece is a subclass of TorchEngine that overrides its hooks (_prefill_layout,
_token_boundary, _decode, _rows_done, _store, draw); make_engine combines the ones a run turns on.

The weight-sync gate (last section) is what train.py runs after every push: the engine samples a few
short continuations and the learner scores them; their log-probs must agree, or the engine is not
running the learner's weights. Running engines on Ray workers is cluster.py's job.

Shapes: B rows in a batch (prompts x n), b rows still generating, D distinct prompts, C cache
        columns holding prefix-cached tokens (0 without prefix_cache.py), S columns of tokens to
        prefill, N max new tokens, V vocab, H hidden.
Imports: model.py, algos.py (the one definition of the top-k / top-p set, truncation_mask, which the
learner rebuilds), distributed.py (the gate's ranks) (and torch, the standard library).
"""

import importlib
from dataclasses import dataclass, field

import torch

import algos
from distributed import broadcast_object, is_main
from model import ModelConfig, Transformer, load_model


@dataclass(frozen=True)
class SamplingParams:
    """What an engine is asked to do with each prompt (the same fields for torch, vLLM and remote
    engines)."""

    n: int = 1  # samples per prompt, outputs ordered prompt-major
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus sampling mass (1: off)
    # sample among the k most likely tokens only (0: off), applied before top-p
    top_k: int = 0
    max_tokens: int = 256  # new tokens at most, per sample
    # generation stops after emitting one of these (it is kept in the output)
    stop_token_ids: tuple = ()
    # seed of the engine's torch.Generator for this call (None: nondeterministic)
    seed: int | None = None

    @classmethod
    def of(cls, rollout, **fields) -> "SamplingParams":
        """A run's sampling from its config's rollout section (temperature, top_p, top_k,
        max_tokens), `fields` replacing any of them: the one place a config becomes SamplingParams
        (train.py, eval.py, sft.py)."""
        return cls(
            **{
                "temperature": rollout.temperature,
                "top_p": rollout.top_p,
                "top_k": rollout.top_k,
                "max_tokens": rollout.max_tokens,
                **fields,
            }
        )

    @property
    def truncates(self) -> bool:
        """Whether tokens are drawn from a top-k / top-p set (greedy ignores both), so each records
        its set's size."""
        return self.temperature > 0 and (self.top_p < 1 or self.top_k > 0)


@dataclass
class Generation:
    """One sampled continuation: exactly the tokens the engine produced, with their log-probs."""

    token_ids: list[int]  # (N,) generated ids, including the stop token when one was hit
    # (N,) log p(token) under the distribution sampled: softmax(logits / temperature), renormalised
    # over the kept set when top-k / top-p truncated it
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop token was emitted) or "length" (max_tokens reached)
    # (N,) version of the weights that sampled each token (it may change mid-generation:
    # async_rollouts.ConcurrentEngine); None: not reported
    versions: list[int] | None = None
    # (N,) per token, the size of the top-k / top-p set it was drawn from; -1: truncated, size not
    # reported (vLLM: the learner infers it from the log-prob); empty: no truncation, every token
    # drawn from the whole vocabulary
    kept_sizes: list[int] = field(default_factory=list)


# -----------------------------------------------------------------------------
# sampling and weight pushes, shared by the engines


def sample_tokens(
    logits, temperature: float, top_p: float = 1.0, generator=None, top_k: int = 0, draw=None
):
    """Pick one token per row: logits (B, V) -> (tokens (B,), logprobs (B,), kept sizes (B,) long
    or None).

    The log-prob reported is that of the distribution the token was drawn from, at the chosen token:
    log softmax(logits / T) (T = 1 when greedy). With top-k / top-p (temperature > 0), the token is
    drawn from that softmax restricted to algos.truncation_mask's set and renormalised, and the
    log-prob is the truncated one (algos.truncated_logprobs); the set's size comes back too (None
    when nothing is truncated), so the learner can rebuild the set on its own logits
    (algos.kept_mask_from_size) and score the very distribution sampled: the importance ratio is
    then 1 when the policy has not changed. Without truncation nothing extra is computed and the
    random draws are those of plain sampling. draw(probs (B, V), generator) -> (B,) picks one index
    per row with those probabilities; None: torch.multinomial (fast_decode.py's inverse CDF draws
    the same law with fewer random numbers).
    """
    draw = draw or (lambda probs, g: torch.multinomial(probs, 1, generator=g).squeeze(-1))
    logits = logits.float()
    if temperature == 0:  # greedy: top-k / top-p change nothing
        tokens = logits.argmax(-1)  # (B,)
        logp_all = torch.log_softmax(logits, dim=-1)  # (B, V)
    elif top_p < 1.0 or top_k > 0:
        # top-k, then nucleus (Holtzman et al. 2019, https://arxiv.org/abs/1904.09751): the set is
        # defined once, in algos.truncation_mask, which the learner's kept_mask_from_size rebuilds
        # from its size
        in_set = algos.truncation_mask(logits, temperature, top_k, top_p)  # (B, V)
        # (B, V) renormalised
        probs = torch.softmax((logits / temperature).masked_fill(~in_set, -torch.inf), dim=-1)
        tokens = draw(probs, generator)  # (B,)
        return tokens, algos.truncated_logprobs(logits, tokens, in_set, temperature), in_set.sum(-1)
    else:
        logp_all = torch.log_softmax(logits / temperature, dim=-1)  # (B, V)
        probs = logp_all.exp()  # (B, V)
        tokens = draw(probs, generator)  # (B,)
    return tokens, logp_all.gather(-1, tokens[:, None]).squeeze(-1), None


def row_seeds(seed: int | None, n: int) -> list[int | None]:
    """The seeds of the n rows (or prompts) of a call seeded with `seed`, for engines that seed each
    request alone (vLLM, a remote server): drawn from a torch.Generator seeded with `seed`, as
    TorchEngine draws its samples."""
    if seed is None:
        return [None] * n
    return torch.randint(2**31 - 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def check_state_dict(state_dict: dict, required: dict[str, tuple], optional: dict[str, tuple]):
    """Raise before anything is copied when a pushed state dict does not fit the engine's model:
    every name of `required` present, no name outside required and optional (a tied lm_head.weight
    may come or not), and every shape equal. A push that fails here leaves the engine exactly as it
    was."""
    known = {**required, **optional}
    unknown = sorted(set(state_dict) - set(known))
    missing = sorted(set(required) - set(state_dict))
    if unknown or missing:
        raise KeyError(f"update_weights: unknown names {unknown}, missing names {missing}")
    bad = [
        f"{k}: {tuple(v.shape)} != {tuple(known[k])}"
        for k, v in state_dict.items()
        if tuple(v.shape) != tuple(known[k])
    ]
    if bad:
        raise ValueError(f"update_weights: shape mismatch {bad}")


# -----------------------------------------------------------------------------
# the reference engine


class KVCache:
    """Keys/values for incremental decoding: one (B, nkv, columns, hd) pair per layer.

    `pos` counts the positions filled. A forward pass with T new tokens writes them at [pos, pos +
    T) in every layer and then advances pos by T (the Transformer does the advance, after the last
    layer). The cache holds max_len positions at most but allocates only `reserve` columns at first
    (at most max_len; None: all of them); a write past them grows every layer to 1.5x the columns
    needed (at most max_len), so a request that may sample 32,000 tokens does not hold them before
    it samples them.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        batch_size: int,
        max_len: int,
        dtype=torch.float32,
        device="cpu",
        reserve: int | None = None,
    ):
        columns = max_len if reserve is None else min(reserve, max_len)
        shape = (batch_size, cfg.num_key_value_heads, columns, cfg.head_dim)
        self.k = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)
        ]
        self.v = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)
        ]
        self.max_len = max_len
        self.pos = 0

    def update(self, layer_idx, k, v):
        """Store k, v (B, nkv, T, hd) at [pos, pos + T); return all keys/values so far,
        (B, nkv, pos + T, hd)."""
        end = self.pos + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KVCache overflow: {end} positions > max_len {self.max_len}")
        if end > self.k[layer_idx].shape[2]:
            columns = min(self.max_len, end * 3 // 2)
            self.k[layer_idx] = grown(self.k[layer_idx], columns)
            self.v[layer_idx] = grown(self.v[layer_idx], columns)
        self.k[layer_idx][:, :, self.pos : end] = k
        self.v[layer_idx][:, :, self.pos : end] = v
        return self.k[layer_idx][:, :, :end], self.v[layer_idx][:, :, :end]

    def keep_rows(self, rows):
        """Keep batch rows `rows` (B',) long, in that order, repeats allowed: a sampler drops
        finished rows, or copies one prompt's prefill into its n samples."""
        self.k = [k[rows] for k in self.k]
        self.v = [v[rows] for v in self.v]


def grown(x, columns: int):
    """x (B, nkv, c, hd) copied into the first c of `columns` zeroed columns."""
    out = x.new_zeros(*x.shape[:2], columns, x.shape[3])
    out[:, :, : x.shape[2]] = x
    return out


# new tokens a KV cache holds room for before it grows (KVCache): a request may ask for many
# more than it samples
DECODE_RESERVE = 1024


class TorchEngine:
    """Batched generation with the pure-torch model: left-pad, one prefill, then one token per step
    from a KV cache.

    Deterministic for a fixed (prompts, params, max_batch_size) when params.seed is set: one
    torch.Generator drives the whole call. Finished rows ride along (their extra tokens are dropped)
    until a quarter of the batch has finished; then they leave the batch and the KV cache.
    prefilled_tokens / prompt_tokens: prompt tokens run through the model / asked for
    (rollout/prefix_cached). The hooks (_prefill_layout, _token_boundary, _decode, _rows_done,
    _store, draw) are the plain step here; the wings override them."""

    # sample_tokens' draw (None: torch.multinomial; fast_decode.py's is an inverse CDF)
    draw = None

    def __init__(
        self,
        model: Transformer,
        pad_id: int,
        max_batch_size: int = 256,
        prefill_chunk_tokens: int = 2048,
    ):
        self.model = model  # the learner's own module (train.shares_engine_model) or a copy
        self.pad_id = pad_id
        self.max_batch_size = max_batch_size
        # prompts run through the model this many columns at a time (prefill)
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.prefilled_tokens = self.prompt_tokens = 0

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        # prompt-major: n samples of prompt 0, then 1, ...
        rows = [p for p in prompts for _ in range(params.n)]
        device = next(self.model.parameters()).device
        generator = (
            torch.Generator(device=device).manual_seed(params.seed)
            if params.seed is not None
            else None
        )
        was_training = self.model.training
        self.model.eval()
        try:
            out = []
            for s in range(0, len(rows), self.max_batch_size):
                out += self._generate_batch(
                    rows[s : s + self.max_batch_size], params, generator, device
                )
        finally:
            self.model.train(was_training)  # the learner may share this model
        return out

    def _generate_batch(self, prompts, params, generator, device) -> list[Generation]:
        B, N = len(prompts), params.max_tokens
        if N == 0:
            return [Generation([], [], "length") for _ in prompts]
        # prefilled once each, then copied to the n samples
        distinct = list({tuple(p): None for p in prompts})
        index = {p: i for i, p in enumerate(distinct)}
        # (B,) row -> distinct prompt
        source = torch.tensor([index[tuple(p)] for p in prompts], device=device)
        cache, ids, real, C = self._prefill_layout(distinct, N, device)  # (D, S), (D, C + S + N)
        S = ids.shape[1]
        # (D, S) counting real tokens only
        positions = (real[:, : C + S].long().cumsum(-1) - 1).clamp(min=0)[:, C:]
        # only the last position's logits are needed, so the lm_head skips the rest
        h = self.prefill(ids, positions, real, cache)[source]  # (B, 1, H)
        cache.keep_rows(source)
        real, next_pos = real[source], positions[source, -1:] + 1  # (B, C + S + N), (B, 1)

        stop_ids = torch.tensor(list(params.stop_token_ids), dtype=torch.long, device=device)
        tokens = torch.full((B, N), self.pad_id, dtype=torch.long, device=device)  # (B, N)
        logprobs = torch.zeros(B, N, device=device)  # (B, N)
        # (B, N)
        kept_sizes = (
            torch.zeros(B, N, dtype=torch.long, device=device) if params.truncates else None
        )
        lengths = torch.full((B,), N, dtype=torch.long, device=device)  # (B,)
        stopped = torch.zeros(B, dtype=torch.bool, device=device)  # (B,)
        # (b,) the original row of each row still in the batch
        rows = torch.arange(B, device=device)
        for t in range(N):
            cache, h = self._token_boundary(prompts, rows, real, tokens, cache, C + S, h)
            logits = self.model.lm_head(h[:, -1])  # (b, V)
            # (b,), (b,), (b,) or None
            tok, lp, size = sample_tokens(
                logits, params.temperature, params.top_p, generator, params.top_k, self.draw
            )
            # a finished row still in the batch writes past its length (cut off below)
            tokens[rows, t], logprobs[rows, t] = tok, lp
            if size is not None:
                kept_sizes[rows, t] = size
            hit = torch.isin(tok, stop_ids) & ~stopped[rows]  # (b,) rows that stop at this step
            lengths[rows[hit]], stopped[rows[hit]] = t + 1, True
            live = ~stopped[rows]  # (b,)
            if t == N - 1 or not bool(live.any()):
                break
            # a quarter has finished: drop those rows (and their KV cache), so a few long samples
            # do not drag the whole batch through every remaining step
            if 4 * int(live.sum()) <= 3 * len(rows):
                keep = live.nonzero().squeeze(1)  # (b',)
                self._rows_done(cache, real, rows, (~live).nonzero().squeeze(1), C + S)
                rows = rows[keep]
                tok = tok[keep]
                real = real[keep]
                next_pos = next_pos[keep]
                cache.keep_rows(keep)
            h = self._decode(tok, next_pos + t, real, cache)  # (b, 1, H)

        self._rows_done(cache, real, rows, torch.arange(len(rows), device=device), C + S)
        tokens = tokens.tolist()
        logprobs = logprobs.tolist()
        lengths = lengths.tolist()
        stopped = stopped.tolist()
        kept_sizes = kept_sizes.tolist() if params.truncates else [[] for _ in range(B)]
        self._store(prompts, tokens, lengths)
        return [
            Generation(
                tokens[i][: lengths[i]],
                logprobs[i][: lengths[i]],
                "stop" if stopped[i] else "length",
                kept_sizes=kept_sizes[i][: lengths[i]],
            )
            for i in range(B)
        ]

    def _prefill_layout(self, distinct: list[tuple], N: int, device) -> tuple:
        """-> (the batch's KV cache, ids (D, S) to prefill, real (D, C + S + N) the key padding
        mask, C columns already filled): here C = 0, plain left padding (prefix_cache.py fills
        columns [0, C) from its cache)."""
        D, S = len(distinct), max(len(p) for p in distinct)
        ids = torch.full((D, S), self.pad_id, dtype=torch.long)
        # key padding mask; every generated token is real
        real = torch.zeros(D, S + N, dtype=torch.bool)
        for i, p in enumerate(distinct):
            ids[i, S - len(p) :] = torch.tensor(p, dtype=torch.long)
            real[i, S - len(p) :] = True
        cache = KVCache(
            self.model.cfg,
            D,
            S + N,
            dtype=self.model.lm_head.weight.dtype,
            device=device,
            reserve=S + DECODE_RESERVE,
        )
        self.prompt_tokens += sum(len(p) for p in distinct)
        self.prefilled_tokens += sum(len(p) for p in distinct)
        return cache, ids.to(device), real.to(device), 0

    def prefill(self, ids, positions, real, cache: KVCache):
        """Run prompts (D, S) into the cache -> the last position's hidden state (D, 1, H): in one
        forward when S fits a chunk, else in chunks (wings/long_context.py)."""
        if ids.shape[1] <= self.prefill_chunk_tokens:
            return self.model.hidden_states(ids, positions, real, cache)[:, -1:]
        chunked = wing("wings.long_context.prefill")
        return chunked(self.model, ids, positions, real, cache, self.prefill_chunk_tokens)

    def _token_boundary(
        self, prompts, rows, real, tokens, cache: KVCache, prompt_end: int, h
    ) -> tuple:
        # before each token: async_rollouts.py swaps in weights pushed mid-generation
        return cache, h

    def _decode(self, tok, positions, real, cache: KVCache):
        # the next step (fast_decode.py's own); keys that are all real need no (b, 1, 1, keys) mask
        mask = None if bool(real[:, : cache.pos + 1].all()) else real
        return self.model.hidden_states(tok[:, None], positions, mask, cache)

    def _rows_done(self, cache: KVCache, real, rows, which, prompt_end: int):
        pass  # rows `which` leave the batch: prefix_cache.py keeps their keys and values

    def _store(self, prompts, tokens: list[list[int]], lengths: list[int]):
        pass  # the batch is done: prefix_cache.py stores its sequences

    def update_weights(self, state_dict: dict[str, torch.Tensor]):
        """Copy a full state dict (Hugging Face names) into the model's parameters in place. All
        names and shapes are checked first, so a bad dict leaves the model untouched; a tied
        lm_head.weight may be present or absent."""
        self._check(state_dict)
        self._load(state_dict)

    def _check(self, state_dict: dict):
        # a tied parameter appears once in `required`, under both of its names in `known`
        required = dict(self.model.named_parameters())
        known = dict(self.model.named_parameters(remove_duplicate=False))
        check_state_dict(
            state_dict,
            {k: p.shape for k, p in required.items()},
            {k: p.shape for k, p in known.items() if k not in required},
        )

    @torch.no_grad()
    def _load(self, state_dict: dict):
        known = dict(self.model.named_parameters(remove_duplicate=False))
        for k, v in state_dict.items():
            known[k].copy_(v)

    def sleep(self):
        pass  # nothing to free for the learner: the KV cache lives only inside generate

    def wake_up(self):
        pass


# the engines and the torch engine's optional pieces that live in files of their own (wings),
# "module.Class", imported on first use: a run that never asks for one never imports it (nor vllm)
ENGINES = {"vllm": "wings.engine_vllm.VLLMEngine", "openai": "wings.engine_openai.OpenAIEngine"}
TORCH_ENGINE_PIECES = {
    "decode": "wings.fast_decode.FastDecodeEngine",
    "concurrent": "wings.async_rollouts.ConcurrentEngine",
    "prefix_cache_tokens": "wings.prefix_cache.PrefixCachedEngine",
}


def wing(entry: str):
    """ "module.name" -> that object, its file imported now: how the core reaches a wing (here and
    in train.py), only when a run asks for it, so the core's files never import a wing."""
    module, name = entry.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def make_engine(
    kind: str,
    model_dir: str,
    *,
    pad_id: int,
    model: Transformer | None = None,
    dtype: str = "float32",
    max_batch_size: int = 256,
    prefill_chunk_tokens: int = 2048,
    prefix_cache_tokens: int = 0,
    concurrent: bool = False,
    decode: str = "plain",
    **options,
):
    """The engine of `kind` for the Hugging Face folder `model_dir` (engine_options(cfg) gives every
    keyword from a run's config):
      torch   TorchEngine over `model` (the caller's own copy, or the learner's module) or,
              when None, the folder loaded in `dtype`; with the pieces a run turns on (decode:
              fast or compiled, the decode step of fast_decode.py; prefix_cache_tokens > 0;
              concurrent: generate in a background thread, pushes mid-generation) combined into
              one subclass;
      vllm, openai   ENGINES' class, built from the folder and `options` by its `build`
                     classmethod."""
    if kind in ENGINES:
        return wing(ENGINES[kind]).build(
            model_dir, dtype=dtype, max_batch_size=max_batch_size, **options
        )
    if kind != "torch":
        raise ValueError(f"unknown engine {kind!r}: torch, vllm or openai")
    model = (
        model if model is not None else load_model(model_dir, dtype=getattr(torch, dtype)).eval()
    )
    pieces = {
        "decode": "" if decode == "plain" else decode,
        "concurrent": concurrent,
        "prefix_cache_tokens": prefix_cache_tokens,
    }
    on = {k: v for k, v in pieces.items() if v}
    cls = TorchEngine
    if on:
        # e.g. FastDecodeEngine(ConcurrentEngine(PrefixCachedEngine(TorchEngine))): each piece calls
        # super(), and the fast step, first, sees the cache the others hand back
        cls = type("TorchEngine", tuple(wing(TORCH_ENGINE_PIECES[k]) for k in on), {})
    # what the pieces take as arguments
    piece_args = {k: v for k, v in on.items() if k != "concurrent"}
    return cls(
        model,
        pad_id=pad_id,
        max_batch_size=max_batch_size,
        prefill_chunk_tokens=prefill_chunk_tokens,
        **piece_args,
    )


def engine_options(cfg) -> dict:
    """make_engine's keywords for a run's config.Config (everything but the kind, the folder and the
    pad id): the one place the engine's context length is derived, whoever builds the engine
    (train.py, eval.py, Ray workers)."""
    rollout = cfg.rollout
    return {
        "dtype": cfg.model.dtype,
        "seed": cfg.seed,
        "cache_dir": cfg.model.cache_dir,
        # a whole trajectory, plus a turn's new tokens or the weight-sync probe's (the longer)
        "max_model_len": rollout.agent.max_total_tokens
        + max(rollout.max_tokens, rollout.sync_check_tokens),
        "max_batch_size": rollout.max_batch_size,
        "prefill_chunk_tokens": rollout.prefill_chunk_tokens,
        "gpu_memory_utilization": rollout.gpu_memory_utilization,
        "base_url": rollout.base_url,
        "served_model": rollout.served_model,
        "api_key_env": rollout.api_key_env,
        "weights_dir": rollout.weights_dir,
        "prefix_cache_tokens": rollout.prefix_cache_tokens,
        "concurrent": rollout.async_rollouts,
        "decode": rollout.decode,
    }


# -----------------------------------------------------------------------------
# the weight-sync gate
#
# After a push the engine must run exactly the learner's weights, and comparing weights cannot show
# it: vLLM fuses and repacks them, and a stale prefix cache or a tensor left out leaves every weight
# right and the outputs wrong. So compare what RL uses: the engine samples short continuations
# (sync_probe; top_p must be 1) and the learner scores the same tokens (logprob_gap); assert_synced
# stops the run past a threshold. The sampled token's log-prob is also the PPO ratio's denominator,
# so this is the error the ratio would carry. NaN fails too. Three pieces, because under torchrun
# rank 0 alone has the engine while every rank's shard joins the learner's forward.


def default_sync_threshold(dtype: str, precision: str = "fp32") -> float:
    """The gate's threshold when rollout.sync_max_logprob_diff is not set: 1e-3 in float32 (both
    sides agree to ~1e-5); 0.5 with bfloat16/float16 parameters, where rounding alone reaches ~0.15
    on CPU, so only gross mismatches count; 0.05 with fp32 parameters computed in bf16
    (learner.precision=bf16: the engine decodes one token at a time, the learner runs whole rows,
    and their bf16 matmuls round differently; measured up to 0.011 on the main command, so 0.05
    leaves room for other CPUs' kernels and still sees a missed push of one update)."""
    if dtype != "float32":
        return 0.5
    return 0.05 if precision == "bf16" else 1e-3


def sync_probe(engine, prompts: list[list[int]], params: SamplingParams):
    """The engine's half of the gate: `engine` (an engine, or a rollout source, whose generate is
    its engine's) continues `prompts` -> (the prompt of each generation, the generations, the
    temperature)."""
    gens = engine.generate(prompts, params)
    return [prompts[i // params.n] for i in range(len(gens))], gens, params.temperature


def assert_synced(worst: float, max_diff: float, n: int) -> float:
    """`worst` (logprob_gap over n continuations) if it is within max_diff, else a RuntimeError
    saying why."""
    if not worst <= max_diff:
        raise RuntimeError(
            f"weight sync check failed: the engine's log-probs differ from the learner's by up to "
            f"{worst:.3g} (> {max_diff:g}) on {n} sampled continuations: the engine is not "
            f"running the learner's weights (a failed push, a stale prefix cache, a dtype or "
            f"layout mismatch). rollout.sync_max_logprob_diff sets the threshold"
        )
    return worst


def weight_sync_gate(cfg, rollouts, model: Transformer, trajectories: list, seed: int) -> dict:
    """The whole gate, as train.py runs it after a push under a run's config.Config. Rank 0 takes
    the first trajectory of each group (every rollout.agent.n_samples-th of the group-major
    `trajectories`), and `rollouts` (the rollout source: agent.LocalRollouts, or a wing's)
    continues the rollout.sync_check_samples longest of them (in tokens) by
    rollout.sync_check_tokens each, at the rollout temperature without top-k / top-p, seeded by
    `seed`. Every rank's learner `model` scores those tokens (a sharded forward needs them all), and
    a gap past the threshold stops the run -> {"sync/logprob_abs_diff": the gap}. Other ranks pass
    rollouts=None and no trajectories."""
    probe = None
    if is_main():
        longest = sorted(
            trajectories[:: cfg.rollout.agent.n_samples],
            key=lambda t: len(t.token_ids),
            reverse=True,
        )
        params = SamplingParams.of(
            cfg.rollout, top_p=1.0, top_k=0, max_tokens=cfg.rollout.sync_check_tokens, seed=seed
        )
        probe = sync_probe(
            rollouts, [t.token_ids for t in longest[: cfg.rollout.sync_check_samples]], params
        )
    prompts, gens, temperature = broadcast_object(probe)
    threshold = cfg.rollout.sync_max_logprob_diff
    threshold = (
        default_sync_threshold(cfg.model.dtype, cfg.learner.precision)
        if threshold is None
        else threshold
    )
    return {
        "sync/logprob_abs_diff": assert_synced(
            logprob_gap(model, prompts, gens, temperature), threshold, len(gens)
        )
    }


@torch.no_grad()
def logprob_gap(
    model: Transformer, prompts: list[list[int]], gens: list[Generation], temperature: float
) -> float:
    """Max |gen.logprobs - the model's log-probs of the same tokens| over all generations
    (prompts[i] is gen i's prompt), scored with model.token_logprobs at `temperature` (T = 1 when
    greedy, as engines report): one forward over all of them, right-padded, the head run on the
    generated tokens only (the mask). Only the model's forward: under torchrun every rank can run it
    on a sharded learner."""
    T = temperature if temperature > 0 else 1.0
    device = next(model.parameters()).device
    rows = [
        (list(p) + list(g.token_ids), len(p), g.logprobs)
        for p, g in zip(prompts, gens)
        if g.token_ids
    ]
    if not rows:
        return 0.0
    # (R, T) right-padded
    ids = torch.zeros(len(rows), max(len(r) for r, _, _ in rows), dtype=torch.long)
    mask = torch.zeros(ids.shape)  # (R, T) the generated tokens
    for i, (row, P, _) in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, P : len(row)] = 1.0
    training = model.training
    model.eval()  # no (LoRA) dropout while scoring
    # (R, T)
    learner = (
        model.token_logprobs(ids.to(device), temperature=T, mask=mask.to(device)).float().cpu()
    )
    model.train(training)
    diffs = [
        (learner[i, P : len(row)] - torch.tensor(engine)).abs().max()
        for i, (row, P, engine) in enumerate(rows)
    ]
    return float(torch.stack(diffs).max())  # torch's max keeps a NaN, Python's may not
