"""bench/staleness.py: synchronous rollouts against async ones at several staleness bounds, with and
without partial rollouts, side by side in one run.

    .venv/bin/python bench/staleness.py [--steps 8] [--threads 1] [--out runs/bench_staleness]

Each configuration trains the same tiny run (the embedded default model at test size, toy math, seed
0, CPU) for
--steps steps; the table gives, over steps 2..N (step 1 is synchronous in every mode): the mean step
time and its ratio to the synchronous run's, the mean time the learner waited for the background
thread (perf/rollout_wait_seconds), and the per-token staleness (mean of rollout/staleness, max of
rollout/staleness_max). Timings on a shared machine move from run to run: compare within one run of
this script.
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TINY = [
    "sft.num_demos=400",
    "sft.max_steps=40",
    "sft.eval_every=20",
    "sft.eval_size=8",
    "sft.batch_size=16",
    "sft.hidden_size=32",
    "sft.num_layers=2",
    "sft.num_heads=2",
    "sft.num_kv_heads=1",
    "sft.intermediate_size=64",
    "sft.vocab_size=600",
    "sft.target_accuracy=1.1",
    "envs.0.eval_size=8",
    "rollout.prompts_per_step=8",
    "rollout.agent.n_samples=4",
    "rollout.max_tokens=40",
    "rollout.agent.max_total_tokens=768",
    "learner.micro_batch_size=8",
    "learner.lr=1e-3",
    "learner.entropy_coef=0.01",
    "wandb=false",
    "eval_every=1000",
    "algo.skip_uniform_batches=false",
]
ASYNC = [
    "rollout.async_rollouts=true",
    "learner.off_policy.kind=tis",
    "learner.off_policy.tis_cap=2.0",
]
CASES = {
    "sync": [],
    "async k=1": ASYNC,
    "async k=2": [*ASYNC, "rollout.max_staleness=2"],
    "async k=1 partial": [*ASYNC, "rollout.partial_rollouts=true"],
    "async k=2 partial": [*ASYNC, "rollout.max_staleness=2", "rollout.partial_rollouts=true"],
    "async k=4 partial": [*ASYNC, "rollout.max_staleness=4", "rollout.partial_rollouts=true"],
}


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_staleness"))
    args = p.parse_args()
    os.chdir(ROOT)
    from config import load_config
    from train import main as train

    rows = {}
    for name, extra in CASES.items():
        cfg = load_config(
            "configs/toy_math.yaml",
            [
                *TINY,
                *extra,
                f"steps={args.steps}",
                f"threads={args.threads}",
                f"out_dir={args.out}",
                f"model.cache_dir={args.out}/cache",
                "run_name=" + name.replace(" ", "_").replace("=", ""),
            ],
        )
        lines = [json.loads(l) for l in open(os.path.join(train(cfg)["run_dir"], "metrics.jsonl"))][
            2:
        ]

        def mean(key):
            return sum(l.get(key, 0.0) for l in lines) / len(lines)

        rows[name] = (
            mean("perf/step_seconds"),
            mean("perf/rollout_wait_seconds"),
            mean("rollout/staleness"),
            max(l["rollout/staleness_max"] for l in lines),
        )
    base = rows["sync"][0]
    print(f"\nsteps 2..{args.steps}, threads={args.threads}")
    print("| mode | step s | vs sync | learner waited s | staleness mean | staleness max |")
    print("|---|---|---|---|---|---|")
    for name, (step, wait, mean_stale, max_stale) in rows.items():
        print(
            f"| {name} | {step:.2f} | {base / step:.2f}x | {wait:.2f} | {mean_stale:.2f} "
            f"| {max_stale:.0f} |"
        )


if __name__ == "__main__":
    main()
