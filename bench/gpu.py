"""bench/gpu.py: the GPU suite, one command for the first GPU we are lent, and its tiny CPU run for
CI.

    python bench/gpu.py                          # CUDA: Qwen2.5-0.5B and 1.5B shapes, random
                                                 weights, bf16
    python bench/gpu.py --shapes 0.5b --json out.json
    python bench/gpu.py --tiny                   # tiny shapes on the CPU (automatic without CUDA):
                                                 what CI runs

Needs only torch, safetensors, tokenizers, numpy, pyyaml and tqdm (what a lent GPU machine has: no
network, no vLLM, Ray or wandb; nothing on this script's path imports them). transformers is
optional: when it imports, the engine is also timed against its generate. Per shape (a model with
Qwen2.5's architecture and sizes, N(0, 0.02) weights), in bf16 (--dtype; fp32 by default with
--tiny):

  checks (fail the run)   bf16 vs fp32: the same weights' token log-probs differ by at most 0.5 (the
                          bf16 weight-sync threshold, rollout.default_sync_threshold) and the logits
                          by at most 5% in relative L2 norm (one bf16 rounding is 0.4%; a wrong
                          weight or layout gives ~100%); engine vs learner: the engine's log-probs
                          of its own samples against the learner's scoring of them, within
                          rollout.default_sync_threshold(dtype), as the run's gate checks
  engine decode           TorchEngine.generate tokens/s (rows x new tokens, temperature 1, no stop
                          token), and transformers' generate forced to the same tokens when it
                          imports, interleaved A B A B; on CUDA each side's peak memory above what
                          was allocated before the call (KV cache etc.)
  decode modes, floor     the same prompts with each rollout.decode (--decodes: plain, fast,
                          compiled; compiled where Inductor has its compiler, its first call
                          compiling untimed), interleaved: tokens/s, ms per decode step, and each
                          against the decode's floor (bench/profile_step.py's sampling_floor: per
                          step the weights and every row's keys and values read once at this
                          device's read bandwidth, or its FLOPs at its matmul rate on the decode's
                          shapes, whichever is longer); memory_bound_pct: the bandwidth floor over
                          the time, the share of the memory bound a step reaches. A check (fails the
                          run): the fast and compiled engines' log-probs of their own samples
                          against the learner's, within rollout.default_sync_threshold(dtype)
  learner                 learner.train_step on rows x tokens (one mini-batch, one epoch, AdamW):
                          tokens/s, MFU and peak memory, with and without gradient checkpointing
  shared prefix, bf16     train_step on groups of 8 rows sharing a 3/4-row prompt, fp32 parameters:
                          every row whole, the shared prompt run once (learner.shared_prefix; a
                          check: the same gradient, fails the run), and the same in bf16
                          (learner.precision=bf16; where the device has bf16)
  weight push             TorchEngine.update_weights from the learner's state dict: seconds and GB/s
  train.py                (first shape only) two GRPO steps of train.main on toy math, the model
                          saved with a small BPE tokenizer (sampled ids past it decode to nothing:
                          rewards are 0, so skip_uniform_batches is off to force the updates): its
                          perf/* seconds

MFU = model FLOPs / seconds / peak FLOPs. Model FLOPs of a step, after PaLM (Chowdhery et al. 2022,
appendix B, https://arxiv.org/abs/2204.02311): 6 N + 12 L H T per token, N the parameters in matmuls
(the lm_head counted even when tied, the embedding lookup not), L layers, H = heads x head_dim, T
the sequence length; recomputation under gradient checkpointing is not counted (it is work, not
progress): model.train_flops, as perf/mfu. Peak FLOPs: runs.peak_flops, a table of dense bf16 peaks
by GPU name (--peak-tflops overrides); on a CPU, a measured matmul. Peak memory: CUDA's
max_memory_allocated after a reset, or the process's peak RSS on a CPU (which only grows). Prints
one markdown table per section; --json writes every figure.
"""

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from learner import LearnerConfig, TrainBatch, compute_logprobs, make_learner, train_step  # noqa: E402
from model import ModelConfig, init_model, save_model, train_flops  # noqa: E402
from rollout import SamplingParams, TorchEngine, default_sync_threshold, logprob_gap, make_engine  # noqa: E402
from runs import GPU_PEAK_FLOPS, peak_flops, peak_memory_gib  # noqa: E402
from wings.fast_decode import compiler_missing  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_step import gemm_shapes, read_bandwidth, sampling_floor, seconds_per_flop, timed  # noqa: E402

# Qwen2.5-0.5B / 1.5B's config.json sizes (tied embeddings, q/k/v biases, rope_theta 1e6); the tiny
# ones stand in for them on a CPU
SHAPES = {
    "0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_theta=1e6,
    ),
    "1.5b": dict(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_theta=1e6,
    ),
    "tiny-a": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "tiny-b": dict(
        vocab_size=768,
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
}
# the sizes of each run: GPU (full) and CPU (tiny)
SIZES = {
    "full": dict(
        gen_rows=64,
        prompt_len=256,
        new_tokens=128,
        repeats=3,
        train_rows=16,
        train_len=1024,
        micro_batch=4,
        check_rows=4,
        check_len=256,
        grpo_prompts=16,
        grpo_samples=8,
        grpo_tokens=128,
    ),
    "tiny": dict(
        gen_rows=4,
        prompt_len=16,
        new_tokens=8,
        repeats=1,
        train_rows=4,
        train_len=32,
        micro_batch=2,
        check_rows=2,
        check_len=16,
        grpo_prompts=2,
        grpo_samples=2,
        grpo_tokens=8,
    ),
}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_flops_and_source(device, override_tflops: float) -> tuple[float, str]:
    """(peak FLOP/s, where the figure comes from): runs.peak_flops, the same table and measurement
    as perf/mfu."""
    if override_tflops:
        return override_tflops * 1e12, "--peak-tflops"
    if device.type != "cuda":
        return peak_flops(device), "a matmul measured on this CPU"
    name = torch.cuda.get_device_name(device)
    known = any(key in name for key, _ in GPU_PEAK_FLOPS)
    return peak_flops(
        device
    ), f"table ({name})" if known else f"measured bf16 matmul ({name} is not in the table)"


def random_prompts(rows: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """rows prompts of length/2..length tokens (different lengths: the engine left-pads, as in real
    rollouts)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 2, length + 1, (rows,), generator=g).tolist()
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


# -----------------------------------------------------------------------------
# checks


def check_bf16_vs_fp32(cfg: ModelConfig, device, size: dict) -> dict:
    """The same weights in fp32 and bf16: token log-probs and logits on random sequences."""
    fp32 = init_model(cfg, seed=0).to(device).eval()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    ids = torch.tensor(random_prompts(size["check_rows"], size["check_len"], cfg.vocab_size, 1)[0])
    ids = ids[None].repeat(size["check_rows"], 1).to(device)  # (B, T)
    with torch.no_grad():
        lp32, lp16 = fp32.token_logprobs(ids), bf16.token_logprobs(ids)  # (B, T) each
        x = ids[:, : min(64, ids.shape[1])]
        l32, l16 = fp32(x).float(), bf16(x).float()  # (B, t, V)
    max_lp = float((lp32 - lp16).abs().max())
    rel = float((l32 - l16).norm() / l32.norm())
    ok = max_lp <= default_sync_threshold("bfloat16") and rel <= 0.05
    return {
        "bf16_max_logprob_diff": max_lp,
        "bf16_mean_logprob_diff": float((lp32 - lp16).abs().mean()),
        "bf16_logits_rel_l2": rel,
        "bf16_ok": ok,
    }


def check_engine_vs_learner(model, dtype: str, size: dict) -> dict:
    """The weight-sync gate's measure on the same weights: the engine samples, a copy of the model
    scores."""
    engine = TorchEngine(copy.deepcopy(model).eval(), pad_id=0)
    prompts = random_prompts(size["check_rows"], size["check_len"], model.cfg.vocab_size, 2)
    params = SamplingParams(temperature=1.0, max_tokens=size["new_tokens"], seed=0)
    gens = engine.generate(prompts, params)
    gap = logprob_gap(model, prompts, gens, 1.0)
    return {
        "engine_learner_logprob_gap": gap,
        "sync_threshold": default_sync_threshold(dtype),
        "engine_learner_ok": gap <= default_sync_threshold(dtype),
    }


# -----------------------------------------------------------------------------
# speed


def bench_decode(model, tmp: str, device, dtype, size: dict) -> dict:
    """TorchEngine vs transformers' generate (when it imports), same weights and prompts, A B A
    B."""
    prompts = random_prompts(size["gen_rows"], size["prompt_len"], model.cfg.vocab_size, 3)
    N = size["new_tokens"]
    engine = TorchEngine(model, pad_id=0, max_batch_size=len(prompts))
    sides = {
        "engine": lambda seed: engine.generate(
            prompts, SamplingParams(temperature=1.0, max_tokens=N, seed=seed)
        )
    }
    try:
        import transformers
    except ImportError:
        transformers = None
    if transformers is not None:
        save_model(model, tmp)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype)
        # older transformers ignore dtype= (torch_dtype=)
        hf = hf.to(device=device, dtype=dtype).eval()
        L = max(map(len, prompts))
        ids = torch.zeros(len(prompts), L, dtype=torch.long)
        mask = torch.zeros(len(prompts), L, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, L - len(p) :], mask[i, L - len(p) :] = torch.tensor(p), 1
        ids, mask = ids.to(device), mask.to(device)

        def hf_generate(seed):
            torch.manual_seed(seed)
            with torch.no_grad():
                return hf.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=N,
                    min_new_tokens=N,
                    eos_token_id=None,
                    pad_token_id=0,
                )

        sides["transformers"] = hf_generate
    seconds = {side: [] for side in sides}
    extra = {}  # CUDA: peak memory above the weights, per call
    for r in range(size["repeats"] + 1):  # round 0 warms up (allocator, kernels)
        for side, run in sides.items():
            reset_peak(device)
            sync(device)
            base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            t0 = time.perf_counter()
            run(r)
            sync(device)
            if r:
                seconds[side].append(time.perf_counter() - t0)
                if device.type == "cuda":
                    extra[side] = max(extra.get(side, 0.0), peak_memory_gib(device) - base / 2**30)
    out = {
        f"decode_{side}_tokens_per_s": len(prompts) * N / statistics.median(ts)
        for side, ts in seconds.items()
    }
    out.update({f"decode_{side}_extra_peak_gib": p for side, p in extra.items()})
    if transformers is not None:
        out["decode_engine_vs_transformers"] = (
            out["decode_engine_tokens_per_s"] / out["decode_transformers_tokens_per_s"]
        )
        del hf
    return out


def bench_decode_modes(model, device, dtype: str, size: dict, modes: list[str]) -> dict:
    """rollout.decode's steps against each other and against the decode's floor (the module
    docstring)."""
    prompts = random_prompts(size["gen_rows"], size["prompt_len"], model.cfg.vocab_size, 3)
    N, tdtype = size["new_tokens"], getattr(torch, dtype)
    modes = [m for m in modes if m != "compiled" or compiler_missing(device) is None]
    engines = {
        m: make_engine("torch", "", pad_id=0, model=model, max_batch_size=len(prompts), decode=m)
        for m in modes
    }
    seconds, out = {m: [] for m in modes}, {}
    for m, engine in list(engines.items()):  # warm up (and compile); the gate's measure
        try:
            gens = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=N, seed=0))
        except Exception as e:  # a compiler that fails here is reported, not fatal
            out[f"decode_{m}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            del engines[m], seconds[m]
            continue
        gap = logprob_gap(model, prompts, gens, 1.0)
        out[f"decode_{m}_gap"], out[f"decode_{m}_ok"] = gap, gap <= default_sync_threshold(dtype)
    for r in range(size["repeats"]):
        for m, engine in engines.items():
            params = SamplingParams(temperature=1.0, max_tokens=N, seed=r + 1)
            seconds[m].append(timed(lambda: engine.generate(prompts, params), device=device))
    spf_prefill = seconds_per_flop(
        gemm_shapes(model.cfg, sum(map(len, prompts)), head=False),
        device=device,
        dtype=tdtype,
        reps=5,
    )
    spf_decode = seconds_per_flop(
        gemm_shapes(model.cfg, len(prompts)), device=device, dtype=tdtype, reps=5
    )
    bandwidth = read_bandwidth(device=device)
    floor = sampling_floor(
        model.cfg,
        [len(p) for p in prompts],
        [N] * len(prompts),
        1,
        spf_prefill,
        spf_decode,
        bandwidth,
        bytes_per=tdtype.itemsize,
    )
    out.update(
        {
            "decode_floor_s": floor["floor"],
            "decode_memory_floor_s": floor["memory"],
            "decode_compute_floor_s": floor["compute"],
            "read_gb_per_s": bandwidth / 1e9,
        }
    )
    for m, ts in seconds.items():
        sec = statistics.median(ts)
        out.update(
            {
                f"decode_{m}_tokens_per_s": len(prompts) * N / sec,
                f"decode_{m}_ms_per_step": 1e3 * sec / N,
                f"decode_{m}_x_plain": statistics.median(seconds["plain"]) / sec,
                f"decode_{m}_x_floor": sec / floor["floor"],
                f"decode_{m}_memory_bound_pct": 100 * floor["memory"] / sec,
            }
        )
    return out


def timed_steps(state, batch: TrainBatch, cfg: LearnerConfig, device, repeats: int) -> tuple:
    """`repeats` train_steps, each timed alone (the device synchronised around it) -> (state, median
    seconds)."""
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        state, _ = train_step(state, batch, cfg)
        sync(device)
        times.append(time.perf_counter() - t0)
    return state, statistics.median(times)


def bench_learner(model, device, peak: float, size: dict) -> dict:
    """train_step on rows x tokens, with and without gradient checkpointing: tokens/s, MFU, peak
    memory."""
    B, T = size["train_rows"], size["train_len"]
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, model.cfg.vocab_size, (B, T), generator=g)  # (B, T)
    mask = torch.zeros(B, T)
    mask[:, T // 4 :] = 1.0  # (B, T) a prompt, then the response
    adv = torch.randn(B, 1, generator=g).expand(B, T) * mask  # (B, T) one advantage per row
    flops = train_flops(model, [T] * B)
    out = {}
    for gc in (False, True):
        cfg = LearnerConfig(
            lr=1e-6, micro_batch_size=size["micro_batch"], gradient_checkpointing=gc
        )
        state = make_learner(model, cfg, seed=0)
        # (B, T) ratio 1: on-policy
        old = compute_logprobs(model, ids, cfg.micro_batch_size, mask=mask)
        batch = TrainBatch(ids, mask, adv, old)
        state, _ = train_step(state, batch, cfg)  # warm-up (AdamW state, kernels)
        reset_peak(device)
        state, sec = timed_steps(state, batch, cfg, device, size["repeats"])
        tag = "gc" if gc else "no_gc"
        out.update(
            {
                f"learner_{tag}_tokens_per_s": B * T / sec,
                f"learner_{tag}_mfu": flops / sec / peak,
                f"learner_{tag}_peak_gib": peak_memory_gib(device),
                f"learner_{tag}_seconds": sec,
            }
        )
        del state
    model.gradient_checkpointing = False
    return out


def bench_shared_and_bf16(cfg: ModelConfig, device, size: dict) -> dict:
    """learner.shared_prefix and learner.precision=bf16 on an fp32 copy of the shape: train_step
    seconds on groups of 8 rows sharing a prompt of 3/4 of the row, a group per micro-batch (every
    row whole; shared prompts; shared prompts in bf16), and the
    check (fails the run) that the shared path's gradient is the whole rows' to fp32 summation order
    (relative 1e-3; a row attending to the wrong prefix is off by O(1)). bf16 rows only where
    set_precision accepts the device."""
    B, T = size["train_rows"], size["train_len"]
    G, P = 8, 3 * size["train_len"] // 4
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, cfg.vocab_size, (B, T), generator=g)  # (B, T)
    ids[:, :P] = ids[torch.arange(B) // G * G, :P]  # each group's rows: one prompt
    mask = torch.zeros(B, T)
    mask[:, P:] = 1.0  # (B, T) the responses
    adv = torch.randn(B, 1, generator=g) * mask  # (B, T)
    batch = TrainBatch(ids, mask, adv, old_from_update=True)
    base = init_model(cfg, seed=0).to(device)
    out, grads = {}, {}
    runs = [
        ("whole_rows", dict(shared_prefix=False)),
        ("shared", {}),
        ("shared_bf16", dict(precision="bf16")),
    ]
    for tag, kw in runs:
        # a group per micro-batch
        cfg_l = LearnerConfig(lr=1e-6, grad_clip=0.0, micro_batch_size=G, **kw)
        try:
            state = make_learner(copy.deepcopy(base), cfg_l, seed=0)
        except ValueError as e:  # no bf16 on this CPU
            out[f"{tag}_skipped"] = str(e)[:80]
            continue
        seen, params = [], list(state.model.parameters())
        hook = state.optimizer.register_step_pre_hook(
            lambda *_: seen.append(torch.cat([p.grad.flatten().float().cpu() for p in params]))
        )
        state, _ = train_step(state, batch, cfg_l)  # warm-up, and its gradient
        hook.remove()
        grads[tag] = seen[0]
        state, out[f"{tag}_seconds"] = timed_steps(state, batch, cfg_l, device, size["repeats"])
        del state
    ref = grads["whole_rows"]
    out["shared_grad_rel_err"] = float((grads["shared"] - ref).abs().max() / ref.abs().max())
    out["shared_ok"] = out["shared_grad_rel_err"] < 1e-3
    out["shared_speedup"] = out["whole_rows_seconds"] / out["shared_seconds"]
    if "shared_bf16" in grads:
        out["bf16_grad_cosine"] = float(
            torch.nn.functional.cosine_similarity(grads["shared_bf16"], ref, dim=0)
        )
        out["bf16_speedup_over_shared_fp32"] = out["shared_seconds"] / out["shared_bf16_seconds"]
    return out


def bench_push(model, device, dtype: str) -> dict:
    """update_weights of a second TorchEngine from the learner's state dict, then the gate on the
    new weights."""
    engine = TorchEngine(
        init_model(model.cfg, seed=1).to(device=device, dtype=model.lm_head.weight.dtype), pad_id=0
    )
    state = model.state_dict()
    nbytes = sum(t.numel() * t.element_size() for k, t in model.named_parameters())
    times = []
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        engine.update_weights(state)
        sync(device)
        times.append(time.perf_counter() - t0)
    sec = min(times)
    prompts = random_prompts(2, 16, model.cfg.vocab_size, 5)
    gens = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=8, seed=0))
    gap = logprob_gap(model, prompts, gens, 1.0)
    return {
        "push_seconds": sec,
        "push_gb_per_s": nbytes / sec / 1e9,
        "push_gib": nbytes / 2**30,
        "push_gate_gap": gap,
        "push_ok": gap <= default_sync_threshold(dtype),
    }


def grpo_steps(cfg: ModelConfig, tmp: str, dtype: str, size: dict) -> dict:
    """Two GRPO steps of train.main on toy math with this shape (random weights, a small BPE
    tokenizer)."""
    from config import load_config
    from env import make_env
    from sft import train_tokenizer, write_tokenizer_files
    from chat import render
    import train  # imports no wandb, ray or vllm at module level
    import random

    env = make_env("toy_math")
    rng = random.Random(0)
    texts = [
        render(env.demonstration(t, rng, True), env.tools())
        for t in env.sample_tasks("train", 200, 0)
    ]
    model_dir = os.path.join(tmp, "grpo_model")
    tokenizer = train_tokenizer(texts, 1024)
    write_tokenizer_files(tokenizer, model_dir, "qwen2.5")
    # the tiny shapes' vocab is less
    cfg = replace(cfg, vocab_size=max(cfg.vocab_size, tokenizer.get_vocab_size()))
    save_model(init_model(cfg, seed=0).to(getattr(torch, dtype)), model_dir)
    run_cfg = load_config(
        "configs/toy_math.yaml",
        [
            f"model.path={model_dir}",
            f"model.dtype={dtype}",
            "steps=2",
            "eval_every=100",
            "envs.0.eval_size=4",
            f"rollout.prompts_per_step={size['grpo_prompts']}",
            f"rollout.agent.n_samples={size['grpo_samples']}",
            f"rollout.max_tokens={size['grpo_tokens']}",
            f"learner.micro_batch_size={size['micro_batch']}",
            "algo.skip_uniform_batches=false",
            "wandb=false",
            f"out_dir={tmp}/runs",
            "run_name=gpu_suite",
        ],
    )
    t0 = time.perf_counter()
    summary = train.main(run_cfg)
    lines = [json.loads(line) for line in open(os.path.join(summary["run_dir"], "metrics.jsonl"))]
    steps = [m for m in lines if m["step"] > 0]
    assert len(steps) == 2 and all(m["train/updates"] >= 1 for m in steps), (
        "train.main did not take two updates"
    )
    out = {"grpo_total_seconds": time.perf_counter() - t0}
    for key in ("step", "rollout", "train", "sync"):
        out[f"grpo_{key}_seconds"] = statistics.mean(m[f"perf/{key}_seconds"] for m in steps)
    out["grpo_sync_gap"] = max(m["sync/logprob_abs_diff"] for m in steps)
    return out


# -----------------------------------------------------------------------------


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--tiny", action="store_true", help="tiny shapes and sizes (automatic without CUDA)"
    )
    p.add_argument(
        "--shapes",
        nargs="+",
        default=None,
        help=f"of {list(SHAPES)} (default: 0.5b 1.5b, or tiny-a tiny-b with --tiny)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        help="bfloat16 (default), or float32 (the default with --tiny: bf16 "
        "matmuls are emulated, and slow, on most CPUs; the bf16-vs-fp32 check runs either way)",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=0.0,
        help="the device's peak (default: table / measured)",
    )
    p.add_argument("--skip-grpo", action="store_true", help="no train.main steps")
    p.add_argument(
        "--decodes",
        default=None,
        help="rollout.decode modes timed against each other and the floor "
        "(default: plain,fast,compiled; plain,fast with --tiny: compiling takes minutes on a CPU)",
    )
    p.add_argument("--json", default=None, help="write every figure here")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tiny = args.tiny or device.type == "cpu"
    shapes = args.shapes or (["tiny-a", "tiny-b"] if tiny else ["0.5b", "1.5b"])
    size = SIZES["tiny" if tiny else "full"]
    args.dtype = args.dtype or ("float32" if tiny else "bfloat16")
    decodes = (args.decodes or ("plain,fast" if tiny else "plain,fast,compiled")).split(",")
    dtype = getattr(torch, args.dtype)
    peak, peak_source = peak_flops_and_source(device, args.peak_tflops)
    where = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU, {torch.get_num_threads()} threads"
    )
    print(
        f"# bench/gpu.py on {where}, torch {torch.__version__}, {args.dtype}, "
        f"peak {peak / 1e12:.3g} TFLOPS ({peak_source}), sizes {size}",
        flush=True,
    )
    results, failed = (
        {"device": where, "dtype": args.dtype, "peak_tflops": peak / 1e12, "shapes": {}},
        [],
    )
    with tempfile.TemporaryDirectory(prefix="gpu_suite_") as tmp:
        for i, name in enumerate(shapes):
            cfg = ModelConfig(**SHAPES[name])
            r = check_bf16_vs_fp32(cfg, device, size)
            model = init_model(cfg, seed=0).to(device=device, dtype=dtype)
            r["params_m"] = sum(t.numel() for t in model.parameters()) / 1e6
            r.update(check_engine_vs_learner(model, args.dtype, size))
            r.update(bench_decode(model.eval(), os.path.join(tmp, name), device, dtype, size))
            r.update(bench_decode_modes(model, device, args.dtype, size, decodes))
            r.update(bench_learner(model, device, peak, size))
            r.update(bench_shared_and_bf16(cfg, device, size))
            r.update(bench_push(model, device, args.dtype))
            del model
            if i == 0 and not args.skip_grpo:
                r.update(grpo_steps(cfg, tmp, args.dtype, size))
            failed += [
                f"{name}: {k}"
                for k in ("bf16_ok", "engine_learner_ok", "push_ok", "shared_ok")
                if not r[k]
            ]
            failed += [
                f"{name}: {k}"
                for k, v in r.items()
                if k.startswith("decode_") and k.endswith("_ok") and not v
            ]
            results["shapes"][name] = r
            print(
                f"\n## {name} ({r['params_m']:.3g}M parameters)\n"
                + "\n".join(
                    f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |"
                    for k, v in r.items()
                ),
                flush=True,
            )
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if failed:
        raise SystemExit(f"checks failed: {failed}")
    return results


if __name__ == "__main__":
    main()
