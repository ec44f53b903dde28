"""bench/profile_step.py: where one GRPO step's time goes at bench/grpo_vs_trl.py's 10M shape, against this CPU's
fp32 matmul floor.

    .venv/bin/python bench/profile_step.py [--threads 1] [--rows 25]

The step of grpo_vs_trl's `10m` size, without train.py around it: 8 prompts of 58 random tokens x 8 samples, up to 64
new tokens (TorchEngine.generate), then one learner update on those 64 rows (learner.train_step, the defaults:
shared prompts, 4,096-token micro-batches, on-policy). Printed:
  - the model FLOPs of each phase (2 per weight per token for a forward, 6 for forward and backward; the lm_head on
    the trained tokens only, as token_logprobs runs it) and this CPU's fp32 matmul rate on the phase's GEMM shapes,
    so their floor: the time if every FLOP ran at that rate;
  - the phase's measured time (best of 3), and torch.profiler's table of the ops that took it (self CPU time).
The weights are random N(0, 0.02): the ops and shapes, not the tokens, set the time (the prompts' samples run to
64 tokens, as a random model's do in the bench).
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from learner import LearnerConfig, TrainBatch, make_learner, train_step  # noqa: E402
from model import ModelConfig, init_model  # noqa: E402
from rollout import SamplingParams, TorchEngine  # noqa: E402

# grpo_vs_trl's 10m shape over the default model's config (vocab 1017, q/k/v biases)
SHAPE = ModelConfig(vocab_size=1017, hidden_size=384, num_hidden_layers=6, num_attention_heads=6,
                    num_key_value_heads=3, head_dim=64, intermediate_size=1056, tie_word_embeddings=False,
                    attention_bias=True)
P, G, M, PROMPT = 8, 8, 64, 58


def matmul_rate(shapes: list[tuple[int, int, int]], reps: int = 20) -> float:
    """FLOP/s of (M, K) @ (K, N) on this CPU, the best of reps for each shape, averaged over the shapes."""
    rates = []
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        best = min(timed(lambda: a @ b) for _ in range(reps))
        rates.append(2 * m * k * n / best)
    return sum(rates) / len(rates)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, default=25, help="ops shown per profile")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    c = SHAPE
    H, V, attn = c.hidden_size, c.vocab_size, c.num_attention_heads * c.head_dim
    kv = c.num_key_value_heads * c.head_dim
    linear = c.num_hidden_layers * (2 * H * attn + 2 * H * kv + 3 * H * c.intermediate_size)   # decoder weights

    model = init_model(c, seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, V, (PROMPT,), generator=g).tolist() for _ in range(P)]
    engine = TorchEngine(model, 0)
    params = SamplingParams(temperature=1.0, max_tokens=M, n=G, seed=1, stop_token_ids=(2,))
    gens = engine.generate(prompts, params)
    rows = [prompts[i // G] + gen.token_ids for i, gen in enumerate(gens)]
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    mask = torch.zeros(ids.shape)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, PROMPT:len(row)] = 1.0
    cfg = LearnerConfig(lr=1e-5, micro_batch_size=P * G)
    state = make_learner(model, cfg, seed=0)
    batch = TrainBatch(ids, mask, torch.randn(len(rows))[:, None] * mask, None, None, None, old_from_update=True)

    new = float(mask.sum()) / len(rows)                   # sampled tokens per row
    positions = P * (PROMPT + G * new)                    # each group's prompt run once (learner.shared_prefix)
    mb = int(positions / 2)                               # rows of a micro-batch's GEMMs (two micro-batches here)
    phases = {
        "sampling": (lambda: engine.generate(prompts, params),
                     2 * linear * P * (PROMPT + G * new) + 2 * H * V * P * G * new,
                     [(P * G, H, attn), (P * G, H, 2 * kv), (P * G, attn, H), (P * G, H, 2 * c.intermediate_size),
                      (P * G, c.intermediate_size, H), (P * G, H, V)]),
        "update": (lambda: train_step(state, batch, cfg),
                   6 * linear * positions + 6 * H * V * P * G * new,
                   [(mb, H, attn), (mb, H, 2 * kv), (mb, attn, H), (mb, H, 2 * c.intermediate_size),
                    (mb, c.intermediate_size, H), (H, mb, 2 * c.intermediate_size), (c.intermediate_size, mb, H)]),
    }
    print(f"10m shape: {linear / 1e6:.2f}M decoder weights, {P} x {G} rows of {PROMPT} + {new:.1f} tokens, "
          f"{args.threads} thread(s); fp32 matmul 512^3: {matmul_rate([(512, 512, 512)]) / 1e9:.0f} GFLOP/s\n")
    for name, (fn, flops, shapes) in phases.items():
        rate = matmul_rate(shapes)
        fn()                                              # warm
        seconds = min(timed(fn) for _ in range(3))
        print(f"{name}: {flops / 1e9:.0f} GFLOP, matmul rate on its shapes {rate / 1e9:.0f} GFLOP/s -> floor "
              f"{flops / rate:.2f} s; measured {seconds:.2f} s ({flops / rate / seconds:.0%} of it at the floor)")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
