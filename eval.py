"""eval.py: held-out evaluation of a policy, per environment.

    python eval.py --checkpoint runs/toy_math/final --config configs/toy_math.yaml
    # the ceiling (--policy random: the floor)
    python eval.py --policy expert --config configs/tool_use.yaml
    # a model served by `vllm serve DIR` at URL (http://host:8000/v1; DIR: its tokenizer)
    python eval.py --checkpoint DIR --config ... rollout.engine=openai rollout.base_url=URL
    # vLLM in this process (pip install vllm)
    python eval.py --checkpoint DIR --config ... rollout.engine=vllm
    # pass@k from 10 samples
    python eval.py ... eval.n_samples=10 'eval.pass_k=[1,5,10]' eval_temperature=0.8

Runs each env's held-out tasks eval.n_samples times (once by default) through the same rollout
source as training (greedy by default, `eval_temperature`), and reports per env and overall:
accuracy (mean reward over all episodes, also reported as mean@n), pass@k for each k of eval.pass_k
(the unbiased estimator of Chen et al. 2021, pass_at_k), mean turns, tool calls per episode, tokens
per episode and the parse-failure rate. Every episode is dumped as a JSON line (full conversation,
reward, counts) so that a person can read what the policy actually did.

train.py calls `run_eval` (evaluate, then the episodes dumped) at step 0, every `eval_every` steps
and at the end.
Imports: env.py, chat.py, agent.py, rollout.py, config.py, runs.py (and tokenizers, the standard
library).
"""

import argparse
import json
import math
import os
import random
import re
import time
from dataclasses import replace

from agent import AgentConfig, LocalRollouts, Trajectory, memory_metrics
from chat import pad_token_id
from env import ENVS, Action, Env, Task, ToolCall, make_env, mix_seed
from rollout import SamplingParams


def heldout_tasks(envs: dict[str, Env], sizes: dict[str, int], seed: int) -> dict[str, list[Task]]:
    """The fixed held-out set of each env (its 'test' split, which never overlaps 'train')."""
    return {name: env.sample_tasks("test", sizes[name], seed) for name, env in envs.items()}


def evaluate(
    rollouts,
    tasks: dict[str, list[Task]],
    agent_cfg: AgentConfig,
    params,
    seed: int,
    n_samples: int = 1,
    pass_k: tuple[int, ...] = (1,),
) -> tuple[dict[str, float], list[Trajectory]]:
    """n_samples episodes per held-out task, played by `rollouts` (agent.LocalRollouts, or
    cluster.RayRollouts) with no judge -> (metrics 'eval/...', trajectories group-major). Sample s
    of task g is reset with the seed mix_seed(seed, g, s) (agent.init_episodes; Ray workers seed
    each chunk of tasks alike, cluster.dispatch), so n_samples=1 plays exactly what one episode per
    task always did.

    eval/accuracy is the mean of the per-env accuracies, so a small held-out set counts as much as a
    big one."""
    all_tasks = [t for name in tasks for t in tasks[name]]
    trajs, _ = rollouts.play(
        all_tasks, params, seed, judge_weight=0.0, agent=replace(agent_cfg, n_samples=n_samples)
    )
    return eval_metrics(tasks, trajs, n_samples, pass_k), trajs


def eval_metrics(
    tasks: dict[str, list[Task]],
    trajs: list[Trajectory],
    n_samples: int = 1,
    pass_k: tuple[int, ...] = (1,),
) -> dict[str, float]:
    """The 'eval/...' metrics of n_samples episodes per held-out task (trajectories numbered by
    task: t.group)."""
    metrics: dict[str, float] = {}
    for name in tasks:
        tr = [t for t in trajs if t.task.env == name]
        n = max(len(tr), 1)
        turns = sum(t.num_turns for t in tr)
        outcomes: dict[int, list[bool]] = {}  # task -> the success of each of its samples
        for t in tr:
            outcomes.setdefault(t.group, []).append(
                episode_success(t.reward, t.info.get("metrics", {}))
            )
        accuracy = sum(t.reward for t in tr) / n
        m = {
            "accuracy": accuracy,
            f"mean@{n_samples}": accuracy,
            "mean_turns": turns / n,
            "tool_calls": sum(t.num_tool_calls for t in tr) / n,
            "tokens": sum(len(r.token_ids) for t in tr for r in t.rows or [t]) / n,
            "response_tokens": sum(sum(r.loss_mask) for t in tr for r in t.rows or [t]) / n,
            # per assistant turn
            "parse_failure_rate": sum(t.parse_failures for t in tr) / max(turns, 1),
            "finished": sum(t.done for t in tr) / n,
        }
        m.update(pass_metrics(list(outcomes.values()), pass_k))
        m.update(memory_metrics(tr))  # a memory policy's segments and compactions, when one played
        # env extras (e.g. code's pass fraction, BFCL's categories)
        m.update(_env_metrics([t.info.get("metrics", {}) for t in tr], name))
        metrics.update({f"eval/{name}/{k}": v for k, v in m.items()})
    for k in (
        "accuracy",
        f"mean@{n_samples}",
        *(f"pass@{k}" for k in pass_k),
        "mean_turns",
        "tool_calls",
        "tokens",
        "parse_failure_rate",
    ):
        metrics[f"eval/{k}"] = sum(metrics[f"eval/{name}/{k}"] for name in tasks) / max(
            len(tasks), 1
        )
    return metrics


# -----------------------------------------------------------------------------
# pass@k (algorithm code: the estimator and what counts as a success)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from n samples of a task, c of them correct (Chen et al.
    2021, "Evaluating Large Language Models Trained on Code", https://arxiv.org/abs/2107.03374, eq.
    1): the chance that at least one of k samples drawn without replacement from the n is correct,

        pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)

    computed as the product, as the paper's numerically stable code does (Figure 3): the binomials
    overflow a float for n in the hundreds. 1 when n - c < k (every k-subset holds a correct
    sample). Averaged over tasks it estimates pass@k with less variance than drawing k samples per
    task once."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_metrics(outcomes: list[list[bool]], pass_k: tuple[int, ...]) -> dict[str, float]:
    """{"pass@k": the mean over tasks of pass_at_k} for each k, from the success of every sample of
    every task (a list per task). A task with fewer samples than k (none in eval: every task gets
    n_samples) raises."""
    return {
        f"pass@{k}": sum(pass_at_k(len(o), sum(o), k) for o in outcomes) / max(len(outcomes), 1)
        for k in pass_k
    }


def episode_success(reward: float, env_metrics: dict) -> bool:
    """Whether an episode solved its task, for pass@k: the env's own "success" metric where it
    reports one (the worlds: alfworld_lite, tau_lite, and webshop_lite, whose reward gives partial
    credit for a near-miss buy), else full reward (reward >= 1: every env whose reward is 1 iff
    correct; search_lite's format bonus only adds to it)."""
    return float(env_metrics["success"]) >= 1.0 if "success" in env_metrics else reward >= 1.0


# -----------------------------------------------------------------------------
# Scripted policies: the ceiling (the env's expert) and the floor (random actions) of every env,
# played through the same env.reset / env.step as the model, without tokens.


def expert_actions(env: Env, task: Task, seed: int) -> list[Action]:
    """The assistant turns of the env's expert demonstration (with tools), as Actions to replay."""
    demo = env.demonstration(task, random.Random(seed), True)
    return [
        Action(
            text=m.get("content") or "",
            tool_calls=tuple(
                ToolCall(c["function"]["name"], dict(c["function"]["arguments"]))
                for c in m.get("tool_calls", [])
            ),
        )
        for m in demo
        if m["role"] == "assistant"
    ]


def play_scripted(
    env: Env, tasks: list[Task], policy: str, seed: int, max_turns: int, n_samples: int = 1
) -> list[dict]:
    """n_samples episodes per task with policy "expert" (replays env.demonstration) or "random"
    (env.random_action each turn), at most max_turns turns -> one record per episode, task-major."""
    if policy not in ("expert", "random"):
        raise ValueError(f"policy must be 'expert' or 'random', not {policy!r}")
    episodes = []
    for i, task in enumerate(tasks):
        for s in range(n_samples):
            episode_seed = mix_seed(seed, i, s)  # what run_episodes seeds sample s of task i with
            rng = random.Random(episode_seed)
            state, _ = env.reset(task, seed=episode_seed)
            script = expert_actions(env, task, episode_seed) if policy == "expert" else None
            reward = 0.0
            done = False
            turns = 0
            tool_calls = 0
            info = {}
            while not done and turns < max_turns and (script is None or turns < len(script)):
                action = script[turns] if script is not None else env.random_action(state, rng)
                state, _, r, done, info = env.step(state, action)
                reward += r
                turns += 1
                tool_calls += info.get("tool_calls", 0)
            episodes.append(
                {
                    "task_id": task.id,
                    "group": i,
                    "sample": s,
                    "reward": reward,
                    "done": done,
                    "turns": turns,
                    "tool_calls": tool_calls,
                    "metrics": info.get("metrics", {}),
                }
            )
    return episodes


def scripted_metrics(
    episodes: list[dict],
    prefix: str,
    n_samples: int = 1,
    pass_k: tuple[int, ...] = (1,),
    env: str = "",
) -> dict[str, float]:
    """Means over episodes: accuracy (mean reward; also mean@n), pass@k over tasks, mean_turns,
    tool_calls, and the env's extra metrics (with its summary_metrics when `env` names one that
    has them)."""
    n = max(len(episodes), 1)
    outcomes: dict[int, list[bool]] = {}  # task -> the success of each of its samples
    for e in episodes:
        outcomes.setdefault(e["group"], []).append(episode_success(e["reward"], e["metrics"]))
    accuracy = sum(e["reward"] for e in episodes) / n
    m = {
        "accuracy": accuracy,
        f"mean@{n_samples}": accuracy,
        **pass_metrics(list(outcomes.values()), pass_k),
        "mean_turns": sum(e["turns"] for e in episodes) / n,
        "tool_calls": sum(e["tool_calls"] for e in episodes) / n,
    }
    m.update(_env_metrics([e["metrics"] for e in episodes], env))
    return {f"{prefix}/{k}": v for k, v in m.items()}


def _env_metrics(per_episode: list[dict], env: str) -> dict[str, float]:
    """Mean of each env metric over all episodes: the last value an episode's env reported, 0 if
    none (an env that reports on every step, not only the last, is also right for episodes cut by
    max_turns). An env class with a `summary_metrics(per_episode)` adds what it computes from them
    (BFCL's per-category accuracy and leaderboard columns: envs/env_bfcl.py)."""
    # no episode, no key: never a division by zero
    keys = dict.fromkeys(k for metrics in per_episode for k in metrics)
    means = {
        k: sum(float(metrics.get(k, 0.0)) for metrics in per_episode) / len(per_episode)
        for k in keys
    }
    summary = getattr(ENVS.get(env), "summary_metrics", None)
    if summary:
        means.update(summary(per_episode))
    return means


def dump_episodes(trajs: list[Trajectory], path: str) -> None:
    """One JSON object per episode: the conversation as messages, the reward and the counters
    (sample: which of the task's eval.n_samples episodes it is)."""
    with open(path, "w") as f:
        for t in trajs:
            f.write(
                json.dumps(
                    {
                        "task_id": t.task.id,
                        "sample": t.sample,
                        "env": t.task.env,
                        "prompt": t.task.prompt,
                        "answer": t.task.answer,
                        "reward": t.reward,
                        "done": t.done,
                        "finish_reason": t.finish_reason,
                        "turns": t.num_turns,
                        "tool_calls": t.num_tool_calls,
                        "parse_failures": t.parse_failures,
                        "tokens": len(t.token_ids),
                        "messages": t.messages,
                    },
                    ensure_ascii=False,
                    default=str,
                )
                + "\n"
            )


def print_metrics(metrics: dict[str, float]) -> None:
    """One line per metric, by name, numbers in numeric order (pass@5 before pass@10)."""
    for k in sorted(
        metrics, key=lambda k: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", k)]
    ):
        print(f"{k:40s} {metrics[k]:.4f}")


def run_eval(cfg, rollouts, eval_tasks: dict, out: str) -> dict:
    """A run's evaluation, as its config says (train.py's at every eval step, and this file's CLI):
    eval.n_samples episodes per held-out task (greedy unless eval_temperature) -> the eval/...
    metrics (pass@k among them) and perf/eval_seconds; every episode dumped to `out` (JSON
    lines)."""
    params = SamplingParams.of(cfg.rollout, temperature=cfg.eval_temperature, seed=cfg.eval_seed)
    t0 = time.time()
    metrics, trajs = evaluate(
        rollouts,
        eval_tasks,
        cfg.rollout.agent,
        params,
        cfg.eval_seed,
        cfg.eval.n_samples,
        tuple(cfg.eval.pass_k),
    )
    dump_episodes(trajs, out)
    return {**metrics, "perf/eval_seconds": time.time() - t0}


def main(argv=None):
    # the CLI reuses the run's config file, so a checkpoint is evaluated exactly as it was trained
    from tokenizers import Tokenizer

    from config import config_exit, load_config
    from runs import check_file, check_model_folder, check_paths
    from rollout import engine_options, make_engine

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--checkpoint", help="a Hugging Face folder with tokenizer.json")
    p.add_argument(
        "--policy",
        choices=["expert", "random"],
        help="evaluate a scripted policy (the env's expert, or random actions) instead of a model",
    )
    p.add_argument("--config", help="the run's YAML config (envs, agent, eval settings)")
    p.add_argument("--out", help="episodes JSONL (default: <checkpoint>/eval_episodes.jsonl)")
    p.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    args = p.parse_args(argv)
    if (args.checkpoint is None) == (args.policy is None):
        p.error("give exactly one of --checkpoint and --policy")
    try:  # bad input ends here: one line, exit status 2
        if args.config is not None:
            check_file(args.config, "--config")
        cfg = check_paths(load_config(args.config, args.overrides), training=False)
        if args.checkpoint is not None:  # the openai engine reads only the tokenizer from it
            check_model_folder(
                args.checkpoint, "--checkpoint", weights=cfg.rollout.engine != "openai"
            )
    except (KeyError, TypeError, ValueError) as e:
        config_exit(e)
    envs = {e.name: make_env(e.name, **e.kwargs) for e in cfg.envs}
    tasks = heldout_tasks(envs, {e.name: e.eval_size for e in cfg.envs}, cfg.eval_seed)
    if args.policy is not None:
        metrics = {}
        for name, env in envs.items():
            episodes = play_scripted(
                env,
                tasks[name],
                args.policy,
                cfg.eval_seed,
                cfg.rollout.agent.max_turns,
                cfg.eval.n_samples,
            )
            metrics.update(
                scripted_metrics(
                    episodes,
                    f"{args.policy}/{name}",
                    cfg.eval.n_samples,
                    tuple(cfg.eval.pass_k),
                    env=name,
                )
            )
        print_metrics(metrics)
        return metrics

    # the engine loads the checkpoint folder (torch, vllm) or talks to a server that serves it
    # (openai: the folder then only gives the tokenizer)
    tokenizer = Tokenizer.from_file(os.path.join(args.checkpoint, "tokenizer.json"))
    engine = make_engine(
        cfg.rollout.engine,
        args.checkpoint,
        pad_id=pad_token_id(tokenizer),
        **{**engine_options(cfg), "seed": cfg.eval_seed},
    )
    rollouts = LocalRollouts(engine, envs, tokenizer, cfg.rollout.agent)
    out = args.out or os.path.join(args.checkpoint, "eval_episodes.jsonl")
    metrics = {
        k: v for k, v in run_eval(cfg, rollouts, tasks, out).items() if not k.startswith("perf/")
    }
    print_metrics(metrics)
    print(f"episodes written to {out}")
    return metrics


if __name__ == "__main__":
    main()
