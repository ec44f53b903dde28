"""bench/learner_vs_hf.py: one learner update vs a plain `transformers` loop doing the same work,
side by side.

    .venv/bin/python bench/learner_vs_hf.py [--sizes default,10m] [--pairs 3] [--threads 1] [--batch
    64 --seq 256]

The same random weights (a Qwen2 shape, written once with model.save_model and loaded by both
sides), the same batch (B rows of T tokens, the second half of each row trained, one advantage per
row), the same micro-batch rows, fp32, the same thread count. Each measurement is its own subprocess
(so each peak RSS is its own), run interleaved A B C A B C ... after nothing else: one warm-up
update, then one timed update.

  ours        what train.py runs: learner.train_step, on-policy, so pi_old is the update's own
              log-probs (no scoring pass), only the trained tokens reach the lm_head
  ours+old    the same after a compute_logprobs pass for pi_old (what every update did before the
              skip)
  hf          a plain loop: Qwen2ForCausalLM forward (full logits), log_softmax + gather, PPO-clip
              loss (token-mean), backward per micro-batch, grad-norm clip, AdamW

Tokens/s counts B x T tokens per second of the update. Peak RSS is the process's (ru_maxrss, model
and imports included; transformers' import alone is heavier); "update rise" is peak RSS minus the
RSS just before the warm-up update, i.e. what the update itself added. Sizes: `default` (the
embedded model: hidden 128, 4 layers, vocab 1024; 0.9M parameters), `10m` (hidden 384, 6 layers,
vocab 8192; 12.6M), `10m-qwen-vocab` (the same body with Qwen's 151,936-token vocabulary: where the
(tokens, V) logits dominate memory) and `100m` (hidden 768, 12 layers, vocab 32000; 98M). The last
two are slow on a CPU (minutes per update at 1 thread): off unless asked for.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# name -> (ModelConfig fields, default batch rows, default micro-batch rows)
SIZES = {
    "default": (
        dict(
            vocab_size=1024,
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=352,
        ),
        64,
        8,
    ),
    "10m": (
        dict(
            vocab_size=8192,
            hidden_size=384,
            num_hidden_layers=6,
            num_attention_heads=6,
            num_key_value_heads=2,
            intermediate_size=1024,
        ),
        16,
        8,
    ),
    "10m-qwen-vocab": (
        dict(
            vocab_size=151936,
            hidden_size=384,
            num_hidden_layers=6,
            num_attention_heads=6,
            num_key_value_heads=2,
            intermediate_size=1024,
        ),
        8,
        8,
    ),
    "100m": (
        dict(
            vocab_size=32000,
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=12,
            num_key_value_heads=2,
            intermediate_size=2048,
        ),
        8,
        4,
    ),
}


def rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def peak_rss_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def make_batch(vocab: int, B: int, T: int):
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (B, T), generator=g)  # (B, T)
    mask = torch.zeros(B, T)
    mask[:, T // 2 :] = 1  # the response: second half
    adv = torch.randn(B, 1, generator=g) * mask  # (B, T)
    return ids, mask, adv


def worker(args) -> None:
    """One measurement in this process: build `args.side`, one warm-up update, one timed update;
    print JSON."""
    import torch

    torch.set_num_threads(args.threads)
    ids, mask, adv = make_batch(args.vocab, args.batch, args.seq)
    mb, B = args.micro_batch_size, args.batch
    if args.side.startswith("ours"):
        from learner import (
            LearnerConfig,
            TrainBatch,
            compute_logprobs,
            make_learner,
            old_logprobs_needed,
            train_step,
        )
        from model import load_model

        cfg = LearnerConfig(lr=1e-5, micro_batch_size=mb)
        assert not old_logprobs_needed(cfg)
        state = make_learner(load_model(args.folder), cfg, seed=0)

        def update():
            nonlocal state
            if args.side == "ours+old":
                old = compute_logprobs(state.model, ids, mb, mask=mask)
                batch = TrainBatch(ids, mask, adv, old)
            else:
                batch = TrainBatch(ids, mask, adv, old_from_update=True)
            state = train_step(state, batch, cfg)[0]
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            args.folder, dtype=torch.float32, attn_implementation="sdpa"
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def update():
            model.train()
            n = mask[:, 1:].sum()
            for s in range(0, B, mb):
                # (m, T), (m, T-1) x2
                x, m, a = ids[s : s + mb], mask[s : s + mb, 1:], adv[s : s + mb, 1:]
                logits = model(x, use_cache=False).logits[:, :-1].float()  # (m, T-1, V)
                # (m, T-1)
                logp = torch.log_softmax(logits, -1).gather(-1, x[:, 1:, None]).squeeze(-1)
                ratio = torch.exp(logp - logp.detach())  # on-policy: pi_old = pi
                pg = -torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a)  # (m, T-1) PPO-clip
                ((pg * m).sum() / n).backward()  # token-mean over the batch
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

    before = rss_gib()
    update()  # warm-up
    t0 = time.perf_counter()
    update()
    dt = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "seconds": dt,
                "tokens_per_s": B * args.seq / dt,
                "peak_rss_gib": peak_rss_gib(),
                "update_rise_gib": peak_rss_gib() - before,
            }
        ),
        flush=True,
    )


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", default="default,10m", help="comma-separated: default, 10m, 100m")
    ap.add_argument(
        "--pairs", type=int, default=3, help="interleaved rounds (one run of each side per round)"
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=0, help="rows B (0: the size's default)")
    ap.add_argument("--seq", type=int, default=256, help="tokens per row T")
    ap.add_argument(
        "--micro-batch-size",
        type=int,
        default=0,
        help="rows per micro-batch (0: the size's default)",
    )
    ap.add_argument("--sides", default="ours,ours+old,hf")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--side", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    from model import ModelConfig, init_model, save_model

    sides = args.sides.split(",")
    print(
        f"threads {args.threads}, fp32, {args.pairs} interleaved rounds, "
        "one warm-up update per process"
    )
    print(
        "| size | params | B x T (micro) | side | tokens/s (median) | runs | vs hf | peak RSS GiB "
        "| update rise GiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        fields, B, mb = SIZES[size]
        B, mb = args.batch or B, args.micro_batch_size or mb
        with tempfile.TemporaryDirectory() as folder:
            model = init_model(
                ModelConfig(model_type="qwen2", tie_word_embeddings=True, **fields), seed=0
            )
            n_params = sum(p.numel() for p in model.parameters())
            save_model(model, folder)
            del model
            runs = {s: [] for s in sides}
            for _ in range(args.pairs):
                for side in sides:  # interleaved: A B C A B C ...
                    cmd = [
                        sys.executable,
                        os.path.abspath(__file__),
                        "--worker",
                        "--side",
                        side,
                        "--folder",
                        folder,
                        "--vocab",
                        str(fields["vocab_size"]),
                        "--batch",
                        str(B),
                        "--seq",
                        str(args.seq),
                        "--micro-batch-size",
                        str(mb),
                        "--threads",
                        str(args.threads),
                    ]
                    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": ROOT}
                    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
                    if p.returncode != 0:
                        sys.exit(f"{size}/{side} failed:\n{p.stderr[-3000:]}")
                    runs[side].append(json.loads(p.stdout.strip().splitlines()[-1]))
        med = {s: statistics.median(r["tokens_per_s"] for r in runs[s]) for s in sides}
        for s in sides:
            ratio = f"{med[s] / med['hf']:.2f}x" if "hf" in med else "-"
            each = " / ".join(f"{r['tokens_per_s']:.0f}" for r in runs[s])
            print(
                f"| {size} | {n_params / 1e6:.1f}M | {B} x {args.seq} ({mb}) | {s} | {med[s]:.0f} "
                f"| {each} | {ratio} | {max(r['peak_rss_gib'] for r in runs[s]):.2f} "
                f"| {max(r['update_rise_gib'] for r in runs[s]):.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
