"""eval.py: held-out evaluation of a policy, per environment.

    python eval.py --checkpoint runs/toy_math/final --config configs/toy_math.yaml

Runs each env's held-out tasks once through the same agent loop as training (greedy by default,
`eval_temperature`), and reports per env and overall: accuracy (mean reward), mean turns, tool calls
per episode, tokens per episode and the parse-failure rate. Every episode is dumped as a JSON line
(full conversation, reward, counts) so that a person can read what the policy actually did.

train.py calls `evaluate` at step 0, every `eval_every` steps and at the end.
"""
import argparse
import json
import os
from dataclasses import replace

from agent import AgentConfig, SamplingParams, Trajectory, run_episodes
from env import Env, Task, make_env


def heldout_tasks(envs: dict[str, Env], sizes: dict[str, int], seed: int) -> dict[str, list[Task]]:
    """The fixed held-out set of each env (its 'test' split, which never overlaps 'train')."""
    return {name: env.sample_tasks("test", sizes[name], seed) for name, env in envs.items()}


def evaluate(engine, envs: dict[str, Env], tasks: dict[str, list[Task]], tokenizer, agent_cfg: AgentConfig,
             params: SamplingParams, seed: int) -> tuple[dict[str, float], list[Trajectory]]:
    """One episode per held-out task -> (metrics 'eval/...', trajectories).

    eval/accuracy is the mean of the per-env accuracies, so a small held-out set counts as much as a big one."""
    cfg = replace(agent_cfg, n_samples=1)
    all_tasks = [t for name in tasks for t in tasks[name]]
    trajs = run_episodes(engine, envs, all_tasks, tokenizer, cfg, params, seed)
    metrics: dict[str, float] = {}
    for name in tasks:
        tr = [t for t in trajs if t.task.env == name]
        n = max(len(tr), 1)
        turns = sum(t.num_turns for t in tr)
        m = {
            "accuracy": sum(t.reward for t in tr) / n,
            "mean_turns": turns / n,
            "tool_calls": sum(t.num_tool_calls for t in tr) / n,
            "tokens": sum(len(t.token_ids) for t in tr) / n,
            "response_tokens": sum(sum(t.loss_mask) for t in tr) / n,
            "parse_failure_rate": sum(t.parse_failures for t in tr) / max(turns, 1),  # per assistant turn
            "finished": sum(t.done for t in tr) / n,
        }
        metrics.update({f"eval/{name}/{k}": v for k, v in m.items()})
    for k in ("accuracy", "mean_turns", "tool_calls", "tokens", "parse_failure_rate"):
        metrics[f"eval/{k}"] = sum(metrics[f"eval/{name}/{k}"] for name in tasks) / max(len(tasks), 1)
    return metrics, trajs


def dump_episodes(trajs: list[Trajectory], path: str) -> None:
    """One JSON object per episode: the conversation as messages, the reward and the counters."""
    with open(path, "w") as f:
        for t in trajs:
            f.write(json.dumps({
                "task_id": t.task.id, "env": t.task.env, "prompt": t.task.prompt, "answer": t.task.answer,
                "reward": t.reward, "done": t.done, "finish_reason": t.finish_reason, "turns": t.num_turns,
                "tool_calls": t.num_tool_calls, "parse_failures": t.parse_failures, "tokens": len(t.token_ids),
                "messages": t.messages,
            }, ensure_ascii=False, default=str) + "\n")


def main(argv=None):
    # the CLI reuses the run's config file, so a checkpoint is evaluated exactly as it was trained
    from config import load_config
    from model import load_model
    from rollout import TorchEngine
    from tokenizers import Tokenizer

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="a Hugging Face folder with tokenizer.json")
    p.add_argument("--config", default=None, help="the run's YAML config (envs, agent, eval settings)")
    p.add_argument("--out", default=None, help="episodes JSONL (default: <checkpoint>/eval_episodes.jsonl)")
    p.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)

    tokenizer = Tokenizer.from_file(os.path.join(args.checkpoint, "tokenizer.json"))
    model = load_model(args.checkpoint)
    engine = TorchEngine(model, pad_id=tokenizer.token_to_id("<|endoftext|>"),
                         max_batch_size=cfg.rollout.max_batch_size)
    envs = {e.name: make_env(e.name, **e.kwargs) for e in cfg.envs}
    tasks = heldout_tasks(envs, {e.name: e.eval_size for e in cfg.envs}, cfg.eval_seed)
    params = SamplingParams(temperature=cfg.eval_temperature, top_p=cfg.rollout.top_p,
                            max_tokens=cfg.rollout.max_tokens, seed=cfg.eval_seed)
    metrics, trajs = evaluate(engine, envs, tasks, tokenizer, cfg.rollout.agent, params, cfg.eval_seed)
    out = args.out or os.path.join(args.checkpoint, "eval_episodes.jsonl")
    dump_episodes(trajs, out)
    for k, v in sorted(metrics.items()):
        print(f"{k:40s} {v:.4f}")
    print(f"episodes written to {out}")
    return metrics


if __name__ == "__main__":
    main()
