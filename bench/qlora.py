"""bench/qlora.py: peak memory of one training step, full fine-tuning vs LoRA vs QLoRA (NF4 base),
side by side.

    .venv/bin/python bench/qlora.py [--hidden 512] [--layers 8] [--vocab 1024] [--batch 2] [--seq
                                    128] [--rank 16] [--dtype float32] [--threads 2]

A random-init Qwen2-shaped model (intermediate = 2.75 x hidden, head size 64, 2 query heads per
key/value head) is written once as a Hugging Face folder. Each variant then runs in a fresh
subprocess, so that one variant's peak cannot hide another's: load the folder (model.load_model),
wrap it (full: nothing; LoRA: lora.apply_lora; QLoRA: qlora.apply_qlora, the base quantized at load
as train.build_learner does), build the learner (AdamW on what trains), then take one
learner.sft_step (forward, backward, the first AdamW step, which creates the optimizer state) on a
fixed batch of random tokens. Memory is the process's resident set (VmHWM of /proc/self/status, the
peak RSS); load_model maps the safetensors file (zero-copy), so a weight would count in the resident
set only once read, and a quantized weight's file pages would stay mapped while the embedding keeps
the mapping alive: the child copies every tensor into its own memory first (as a copy to a GPU
would), so the resident set counts what each variant holds. The peak is reset just before the step
(`5 > /proc/self/clear_refs`), so "step peak" is the step's alone and "load peak" the loading's.
Every child runs with MALLOC_MMAP_THRESHOLD_=65536, so that freed tensors go back to the OS and the
resident set follows what is alive. With a GPU, the model is on it (distributed.shard_model) and the
GPU's peak allocated bytes during the step are reported too.

Why the columns differ: the learner holds the stored base (4 bytes a weight in fp32, ~0.516 in NF4)
plus, for what trains, a gradient and two AdamW moments (12 bytes a trained weight). The loading
peak of QLoRA is the full-precision model's: load_model reads the checkpoint in model.dtype and
apply_qlora quantizes it layer by layer (docs/qlora.md).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
VARIANTS = ("full", "lora", "qlora")


def _status(field: str) -> float:
    """A /proc/self/status field in MiB (VmRSS: resident now; VmHWM: peak resident since the last
    reset)."""
    return int(re.search(rf"{field}:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) / 1024


def worker(args) -> None:
    """One variant, in its own process: prints one JSON line."""
    import torch
    from distributed import shard_model
    from learner import LearnerConfig, make_learner, sft_step
    from model import load_model

    torch.set_num_threads(args.threads)
    rss_import = _status("VmRSS")
    model = load_model(args.path, dtype=getattr(torch, args.dtype))
    with torch.no_grad():  # the file's mapping -> this process's memory (see above)
        for t in [*model.parameters(), *model.buffers()]:
            t.data = t.data.clone()
    if args.child == "lora":
        from wings.lora import apply_lora

        apply_lora(model, args.rank, 2.0 * args.rank)
    elif args.child == "qlora":
        from wings.qlora import apply_qlora

        apply_qlora(model, args.rank, 2.0 * args.rank)
    cfg = LearnerConfig(lr=1e-4, micro_batch_size=args.batch)
    model = shard_model(model, cfg)  # one process: on the GPU if there is one
    state = make_learner(model, cfg, seed=0)
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    # (B, T) on the CPU: the learner moves
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    mask = torch.ones(args.batch, args.seq)  # (B, T) each micro-batch to its device
    load_peak = _status("VmHWM")
    try:
        # reset the peak resident set to what is resident now
        open("/proc/self/clear_refs", "w").write("5")
        resettable = True
    except OSError:  # a kernel without it (gVisor): no step peak of the RSS
        resettable = False
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        gpu_before = torch.cuda.memory_allocated()
    rss_before = _status("VmRSS")
    state, _ = sft_step(state, ids, mask, cfg)
    out = {
        "variant": args.child,
        "rss_import_mib": rss_import,
        "load_peak_mib": load_peak,
        "rss_before_step_mib": rss_before,
        "step_peak_mib": _status("VmHWM") if resettable else float("nan"),
        "trained": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "model_mib": sum(
            t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]
        )
        / 2**20,
    }
    if device.type == "cuda":
        torch.cuda.synchronize()
        out["gpu_before_step_mib"] = gpu_before / 2**20
        out["gpu_step_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    print(json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return worker(args)

    import torch
    from model import ModelConfig, init_model, save_model

    heads = args.hidden // 64
    cfg = ModelConfig(
        model_type="qwen2",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=int(2.75 * args.hidden) // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        tie_word_embeddings=True,
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        save_model(init_model(cfg, seed=0).to(getattr(torch, args.dtype)), tmp)
        n = sum(p.numel() for p in init_model(cfg, seed=0).parameters())
        print(
            f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
            f"{n / 1e6:.1f}M parameters, {args.dtype}; "
            f"one sft_step on {args.batch} x {args.seq} tokens; LoRA/QLoRA rank {args.rank}",
            flush=True,
        )
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": ROOT}
        for v in VARIANTS:
            flags = [
                f"--{k}={getattr(args, k)}"
                for k in ("hidden", "layers", "vocab", "batch", "seq", "rank", "dtype", "threads")
            ]
            res = subprocess.run(
                [
                    sys.executable,
                    os.path.abspath(__file__),
                    f"--child={v}",
                    f"--path={tmp}",
                    *flags,
                ],
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            if res.returncode:
                raise SystemExit(f"{v} failed:\n{res.stderr[-3000:]}")
            rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    cols = [
        ("variant", "variant", "{}"),
        ("trained", "trained params", "{:,}"),
        ("model_mib", "model (weights + NF4 buffers)", "{:.1f}"),
        ("rss_import_mib", "RSS after import", "{:.0f}"),
        ("load_peak_mib", "load peak", "{:.0f}"),
        ("rss_before_step_mib", "RSS before step", "{:.0f}"),
        ("step_peak_mib", "step peak RSS", "{:.0f}"),
    ]
    if "gpu_step_peak_mib" in rows[0]:
        cols += [
            ("gpu_before_step_mib", "GPU before step", "{:.0f}"),
            ("gpu_step_peak_mib", "GPU step peak", "{:.0f}"),
        ]
    print("| " + " | ".join(c[1] for c in cols) + " |  (MiB)")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f.format(r[k]) for k, _, f in cols) + " |")


if __name__ == "__main__":
    main()
