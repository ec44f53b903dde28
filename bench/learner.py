"""bench/learner.py: learner throughput, 1 process vs torchrun with 2 processes, side by side in one
run.

    .venv/bin/python bench/learner.py [--batch 64] [--seq 256] [--steps 4] [--lora-rank 0]

Each configuration runs in its own subprocess, one after the other: the update of train.py (the
log-probs before the update, `compute_logprobs`, when the update needs them, then one PPO
`train_step`) on a fixed synthetic batch for the default model's size (sft.py's tiny
Qwen2: hidden 128, 4 layers, vocab 1024), timed after one warm-up step. Learner tokens/s counts
every token of the global batch (B x T) per second of train_step. Rows: one process with 1 and with
2 threads, and torchrun --nproc_per_node 2 with 1 thread per process (gloo, FSDP2); the ratio
compares equal thread counts (2 processes x 1 thread vs 1 process x 2 threads). On a 2-core CPU
expect little or no speed-up: the processes share the same two cores that one process already uses,
and FSDP adds an all-gather per layer and a reduce-scatter per step. Data parallelism pays off with
one GPU (or one machine) per rank.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def worker(args) -> None:
    """One measurement (in a subprocess; under torchrun on every rank). Rank 0 prints one JSON
    line."""
    import torch
    from config import SFTConfig
    from distributed import (
        cleanup_distributed,
        get_world_size,
        init_distributed,
        is_main,
        shard_model,
    )
    from learner import (
        LearnerConfig,
        TrainBatch,
        compute_logprobs,
        make_learner,
        old_logprobs_needed,
        train_step,
    )
    from model import ModelConfig, init_model
    from wings.lora import apply_lora

    torch.set_num_threads(args.threads)
    init_distributed()
    s = SFTConfig()  # the default model's size
    cfg = ModelConfig(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads,
        intermediate_size=s.intermediate_size,
        tie_word_embeddings=True,
    )
    model = init_model(cfg, seed=0)
    if args.lora_rank:
        apply_lora(model, args.lora_rank, 2.0 * args.lora_rank)
    lcfg = LearnerConfig(lr=1e-5, micro_batch_size=args.micro_batch_size)
    state = make_learner(shard_model(model, lcfg), lcfg, seed=0)
    g = torch.Generator().manual_seed(0)
    B, T = args.batch, args.seq
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)  # (B, T)
    mask = torch.zeros(B, T)
    mask[:, T // 2 :] = 1  # the response: second half
    adv = torch.randn(B, 1, generator=g) * mask  # (B, T)

    def update(state):  # as train.py: score the batch (pi_old) if the update needs it, then PPO
        if not old_logprobs_needed(lcfg):
            # one optimizer step: pi_old is the update's own log-probs, detached
            return train_step(state, TrainBatch(ids, mask, adv, old_from_update=True), lcfg)[0]
        old = compute_logprobs(state.model, ids, lcfg.micro_batch_size, mask=mask)
        return train_step(state, TrainBatch(ids, mask, adv, old), lcfg)[0]

    state = update(state)  # warm-up
    t0 = time.perf_counter()
    for _ in range(args.steps):
        state = update(state)
    dt = (time.perf_counter() - t0) / args.steps
    if is_main():
        print(
            json.dumps(
                {
                    "processes": get_world_size(),
                    "threads": args.threads,
                    "seconds_per_step": dt,
                    "tokens_per_s": B * T / dt,
                }
            ),
            flush=True,
        )
    cleanup_distributed()


def run(args, processes: int, threads: int) -> dict:
    flags = [
        "--worker",
        "--threads",
        str(threads),
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--steps",
        str(args.steps),
        "--micro-batch-size",
        str(args.micro_batch_size),
        "--lora-rank",
        str(args.lora_rank),
    ]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": str(threads)}
    if processes == 1:
        cmd = [sys.executable, os.path.abspath(__file__), *flags]
    else:
        with socket.socket() as s:  # a free port
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(processes),
            "--master_port",
            str(port),
            os.path.abspath(__file__),
            *flags,
        ]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{cmd} failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return json.loads([l for l in p.stdout.splitlines() if l.startswith("{")][-1])


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batch", type=int, default=64, help="sequences in the global batch")
    ap.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--steps", type=int, default=4, help="timed train_steps (after one warm-up)")
    ap.add_argument("--micro-batch-size", type=int, default=16)
    ap.add_argument("--lora-rank", type=int, default=0, help="0: full fine-tuning")
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    rows = [run(args, 1, 1), run(args, 1, 2), run(args, 2, 1)]
    print(
        f"learner: batch {args.batch} x {args.seq} tokens, micro-batch {args.micro_batch_size}, "
        f"lora_rank {args.lora_rank}, {os.cpu_count()} CPUs\n"
    )
    print("| processes | threads each | s / train_step | learner tokens/s |")
    print("|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['processes']} | {r['threads']} | {r['seconds_per_step']:.2f} "
            f"| {r['tokens_per_s']:,.0f} |"
        )
    print(
        "\n2 processes x 1 thread vs 1 process x 2 threads: "
        f"{rows[2]['tokens_per_s'] / rows[1]['tokens_per_s']:.2f}x; "
        f"vs 1 process x 1 thread: {rows[2]['tokens_per_s'] / rows[0]['tokens_per_s']:.2f}x"
    )


if __name__ == "__main__":
    main()
