"""bench/algos.py: every RL algorithm on the embedded toy-math default, same budget, one table.

    .venv/bin/python bench/algos.py                       # all algorithms, 30 RL steps each
    .venv/bin/python bench/algos.py --algos grpo,dapo --steps 20 --seed 1

Each algorithm starts from the same cached SFT checkpoint (built once) and runs train.main with the
same steps, prompts, samples and learning rate; only `algo.name` differs. Runs are sequential, so wall
times compare on an otherwise idle machine. Prints a markdown table: held-out accuracy at step 0 and at
the end, wall time, and the mean training reward over the first and last five steps.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from config import ALGO_PRESETS, load_config  # noqa: E402
from train import main  # noqa: E402


def run(algo: str, args) -> dict:
    cfg = load_config(args.config, [f"algo.name={algo}", f"steps={args.steps}", f"eval_every={args.steps}",
                                    f"seed={args.seed}", f"run_name=bench_{algo}_s{args.seed}", "wandb=false",
                                    f"out_dir={args.out_dir}", *args.overrides])
    t0 = time.time()
    summary = main(cfg)
    wall = time.time() - t0
    rows = [json.loads(l) for l in open(os.path.join(summary["run_dir"], "metrics.jsonl"))]
    rewards = [r["rollout/reward"] for r in rows if "rollout/reward" in r]
    evals = summary["eval_curve"]
    return {"algo": algo, "acc_start": evals[0][1], "acc_end": evals[-1][1], "wall_s": wall,
            "reward_first5": sum(rewards[:5]) / max(len(rewards[:5]), 1),
            "reward_last5": sum(rewards[-5:]) / max(len(rewards[-5:]), 1)}


def main_cli():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/toy_math.yaml")
    p.add_argument("--algos", default=",".join(ALGO_PRESETS))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="runs/bench")
    p.add_argument("overrides", nargs="*", help="key.sub=value applied to every algorithm")
    args = p.parse_args()
    results = [run(a, args) for a in args.algos.split(",")]
    print(f"\n{args.steps} RL steps each, seed {args.seed}, config {args.config} {' '.join(args.overrides)}")
    print("| algo | held-out acc. start | end | gain | train reward first 5 | last 5 | wall time |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['algo']} | {r['acc_start']:.3f} | {r['acc_end']:.3f} | {r['acc_end'] - r['acc_start']:+.3f} | "
              f"{r['reward_first5']:.3f} | {r['reward_last5']:.3f} | {r['wall_s']:.0f} s |")
    with open(os.path.join(args.out_dir, f"algos_seed{args.seed}.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main_cli()
