"""bench/learning.py: the learning-proof table of an env: expert, random, SFT start, after RL.

    .venv/bin/python bench/learning.py configs/tool_use.yaml configs/text_math.yaml
    configs/code.yaml .venv/bin/python bench/learning.py configs/code.yaml --seed 1 steps=60

For each config: the env's scripted expert and random policies play the held-out set
(eval.play_scripted: the ceiling and the floor), then train.main builds the embedded default model
for that config (tokenizer and SFT warm start on the env's expert demonstrations, cached) and
RL-trains it; its held-out evals at step 0 (the SFT start) and at the end are read back from
metrics.jsonl. Runs are sequential. Prints one markdown table: accuracy (mean held-out reward) and
tool calls per episode for each policy, and wall time.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from config import load_config  # noqa: E402
from env import make_env  # noqa: E402
from eval import heldout_tasks, play_scripted, scripted_metrics  # noqa: E402
from train import main  # noqa: E402


def run(path: str, args) -> list[dict]:
    name = os.path.splitext(os.path.basename(path))[0]
    cfg = load_config(
        path,
        [
            f"seed={args.seed}",
            f"run_name=learning_{name}_s{args.seed}",
            "wandb=false",
            f"out_dir={args.out_dir}",
            *args.overrides,
        ],
    )
    envs = {e.name: make_env(e.name, **e.kwargs) for e in cfg.envs}
    tasks = heldout_tasks(envs, {e.name: e.eval_size for e in cfg.envs}, cfg.eval_seed)
    scripted = {}
    for policy in ("expert", "random"):
        for env_name, env in envs.items():
            episodes = play_scripted(
                env, tasks[env_name], policy, cfg.eval_seed, cfg.rollout.agent.max_turns
            )
            scripted.update(scripted_metrics(episodes, f"{policy}/{env_name}", env=env_name))
    t0 = time.time()
    summary = main(cfg)
    rows = [json.loads(line) for line in open(os.path.join(summary["run_dir"], "metrics.jsonl"))]
    evals = [r for r in rows if "eval/accuracy" in r]
    start, end = evals[0], evals[-1]
    out = []
    for env_name in envs:
        out.append(
            {
                "config": path,
                "env": env_name,
                "seed": args.seed,
                "steps": cfg.steps,
                "expert": scripted[f"expert/{env_name}/accuracy"],
                "expert_tools": scripted[f"expert/{env_name}/tool_calls"],
                "random": scripted[f"random/{env_name}/accuracy"],
                "random_tools": scripted[f"random/{env_name}/tool_calls"],
                "sft": start[f"eval/{env_name}/accuracy"],
                "sft_tools": start[f"eval/{env_name}/tool_calls"],
                "rl": end[f"eval/{env_name}/accuracy"],
                "rl_tools": end[f"eval/{env_name}/tool_calls"],
                "sft_turns": start[f"eval/{env_name}/mean_turns"],
                "rl_turns": end[f"eval/{env_name}/mean_turns"],
                "minutes": (time.time() - t0) / 60,
            }
        )
    return out


def main_cli():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("configs", nargs="+", help="YAML configs, one learning run each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="runs/learning")
    p.add_argument("overrides", nargs="*", default=[], help="key.sub=value applied to every config")
    args = p.parse_args()
    configs = [c for c in args.configs if "=" not in c]  # argparse puts overrides after configs
    args.overrides = [c for c in args.configs if "=" in c] + args.overrides
    results = [r for c in configs for r in run(c, args)]
    print(f"\nseed {args.seed}; accuracy = mean held-out reward; (tool calls per episode)")
    print("| env | expert | random | SFT start | after RL | RL steps | wall time |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['env']} | {r['expert']:.3f} ({r['expert_tools']:.1f}) "
            f"| {r['random']:.3f} ({r['random_tools']:.1f}) "
            f"| {r['sft']:.3f} ({r['sft_tools']:.1f}) | {r['rl']:.3f} ({r['rl_tools']:.1f}) "
            f"| {r['steps']} | {r['minutes']:.1f} min |"
        )
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, f"learning_seed{args.seed}.json"), "a") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main_cli()
