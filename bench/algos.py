"""bench/algos.py: every RL algorithm on the embedded toy-math default, same budget, one table.

    .venv/bin/python bench/algos.py                       # all algorithms, 30 RL steps each
    .venv/bin/python bench/algos.py --algos grpo,dapo --steps 20 --seed 1
    .venv/bin/python bench/algos.py --algos distill,grpo --teacher runs/teacher/final   # on-policy
    distillation

Each algorithm starts from the same cached SFT checkpoint (built once) and runs train.main with the
same steps, prompts, samples and learning rate; only `algo.name` differs. Runs are sequential, so
wall times compare on an otherwise idle machine. Prints a markdown table: held-out accuracy at step
0 and at the end with its standard error sqrt(p (1 - p) / n) over the n held-out problems, whether
the algorithm learns (the gain exceeds twice sqrt(se_start^2 + se_end^2): conservative, since both
evaluations use the same problems), wall time, and the mean training reward over the first and last
five steps. `distill` (on-policy distillation alone) needs a teacher: --teacher DIR, e.g. the final/
folder of a longer run of the default model; without it the default list leaves it out.
"""

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from config import ALGO_PRESETS, load_config  # noqa: E402
from train import main  # noqa: E402


def run(algo: str, args) -> dict:
    teacher = [f"algo.teacher_path={args.teacher}"] if algo == "distill" else []
    cfg = load_config(
        args.config,
        [
            f"algo.name={algo}",
            f"steps={args.steps}",
            f"eval_every={args.steps}",
            f"seed={args.seed}",
            f"run_name=bench_{algo}_s{args.seed}",
            "wandb=false",
            f"out_dir={args.out_dir}",
            *teacher,
            *args.overrides,
        ],
    )
    n = sum(e.eval_size for e in cfg.envs)  # held-out problems behind each accuracy
    t0 = time.time()
    summary = main(cfg)
    wall = time.time() - t0
    rows = [json.loads(l) for l in open(os.path.join(summary["run_dir"], "metrics.jsonl"))]
    rewards = [r["rollout/reward"] for r in rows if "rollout/reward" in r]
    evals = summary["eval_curve"]
    se = [math.sqrt(p * (1 - p) / n) for p in (evals[0][1], evals[-1][1])]
    return {
        "algo": algo,
        "acc_start": evals[0][1],
        "acc_end": evals[-1][1],
        "se_start": se[0],
        "se_end": se[1],
        "learns": evals[-1][1] - evals[0][1] > 2 * math.hypot(*se),
        "wall_s": wall,
        "reward_first5": sum(rewards[:5]) / max(len(rewards[:5]), 1),
        "reward_last5": sum(rewards[-5:]) / max(len(rewards[-5:]), 1),
    }


def main_cli():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", default="configs/toy_math.yaml")
    p.add_argument(
        "--algos",
        default=None,
        help="comma-separated algo.name presets (default: all; distill only with --teacher)",
    )
    p.add_argument("--teacher", default=None, help="algo.teacher_path of the distill row")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="runs/bench")
    p.add_argument("overrides", nargs="*", help="key.sub=value applied to every algorithm")
    args = p.parse_args()
    algos = (
        args.algos.split(",")
        if args.algos
        else [a for a in ALGO_PRESETS if a != "distill" or args.teacher]
    )
    if "distill" in algos and not args.teacher:
        p.error("the distill row needs --teacher DIR")
    results = [run(a, args) for a in algos]
    print(
        f"\n{args.steps} RL steps each, seed {args.seed}, "
        f"config {args.config} {' '.join(args.overrides)}"
    )
    print(
        "| algo | held-out acc. start | end | gain | learns (gain > 2 SE) | train reward first 5 "
        "| last 5 | wall time |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['algo']} | {r['acc_start']:.3f} ± {r['se_start']:.3f} | "
            f"{r['acc_end']:.3f} ± {r['se_end']:.3f} | "
            f"{r['acc_end'] - r['acc_start']:+.3f} | {'yes' if r['learns'] else 'no'} | "
            f"{r['reward_first5']:.3f} | {r['reward_last5']:.3f} | {r['wall_s']:.0f} s |"
        )
    with open(os.path.join(args.out_dir, f"algos_seed{args.seed}.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main_cli()
