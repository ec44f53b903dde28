"""bench/summary_keeps.py: what a policy's summaries keep (docs/memory.md, "The vault").

    .venv/bin/python bench/summary_keeps.py --checkpoint DIR --config configs/vault_memory.yaml \
        [--examples 3] [--json out.json] [key.sub=value ...]

Plays the config's held-out episodes (eval.n_samples per task, at eval_temperature) through the
library, as eval.py does (eval.evaluate, the run's memory policy), then finds each summary the
policy sampled in its episode's rows: the tokens sampled right after wings/memory.SUMMARY_REQUEST,
up to the end of the turn. A summary keeps the fact when the task's answer (the vault's code) is in
it.
Prints, with one standard error each (sqrt(p (1 - p) / n) over episodes; over summaries for the
share of summaries, which within an episode are not independent):
  success            held-out reward per episode (eval/<env>/accuracy)
  summaries          per episode
  keep (summaries)   the share of summaries that keep the fact
  keep (episodes)    the share of episodes, of those with a summary, whose every summary keeps it
  success | keep, success | forgot   success among the episodes whose summaries all keep the fact,
                     and among the others
  marked (summaries) with --marker TEXT: the share of summaries that hold TEXT (the vault's
                     "Vault code": a summary that writes the code's line, right or wrong)
--examples N prints the first N summaries that keep the fact and N that do not, as the policy wrote
them. Needs rollout.agent.memory=summary with summary_gradient on (off, the summaries are not in
the rows: only training changes with it, so evaluate with it on).
"""

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from agent import LocalRollouts  # noqa: E402
from chat import pad_token_id  # noqa: E402
from config import load_config  # noqa: E402
from env import make_env  # noqa: E402
from eval import evaluate, heldout_tasks  # noqa: E402
from rollout import SamplingParams, engine_options, make_engine  # noqa: E402
from wings.memory import SUMMARY_REQUEST, Memory  # noqa: E402


def summaries(traj, request: list[int], ends: set[int], tokenizer) -> list[str]:
    """The summaries an episode's policy wrote, in order: in each row, the sampled tokens right
    after each occurrence of the request's tokens, up to the end of the turn."""
    out = []
    for row in traj.rows or [traj]:
        ids, mask = row.token_ids, row.loss_mask
        for k in range(len(ids) - len(request) + 1):
            if ids[k : k + len(request)] != request:
                continue
            j = k + len(request)
            while j < len(ids) and mask[j] and ids[j] not in ends:
                j += 1
            out.append(tokenizer.decode(ids[k + len(request) : j], skip_special_tokens=False))
    return out


def se(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / n) if n else float("nan")


def measure(trajs, tokenizer, agent, marker: str = "") -> tuple[dict, list[tuple[bool, str]]]:
    """The figures of the file docstring over trajectories played under `agent` (an AgentConfig with
    memory=summary) -> (figures, [(keeps, summary text)] in episode order)."""
    memory = Memory(agent, tokenizer)
    request = memory._encode([{"role": "user", "content": SUMMARY_REQUEST}])
    ends = set(memory.ends)
    written, kept_all, success_kept, success_forgot = [], [], [], []
    for t in trajs:
        texts = summaries(t, request, ends, tokenizer)
        keeps = [t.task.answer in s for s in texts]
        written += list(zip(keeps, texts))
        if texts:
            kept_all.append(all(keeps))
            (success_kept if all(keeps) else success_forgot).append(t.reward)
    n = len(trajs)
    success = sum(t.reward for t in trajs) / n
    per_summary = sum(k for k, _ in written) / max(len(written), 1)
    per_episode = sum(kept_all) / max(len(kept_all), 1)
    figures = {
        "episodes": n,
        "success": success,
        "success_se": se(success, n),
        "summaries_per_episode": len(written) / n,
        "keep_summaries": per_summary,
        "keep_summaries_se": se(per_summary, len(written)),
        "keep_episodes": per_episode,
        "keep_episodes_se": se(per_episode, len(kept_all)),
        "success_if_kept": sum(success_kept) / max(len(success_kept), 1),
        "success_if_forgot": sum(success_forgot) / max(len(success_forgot), 1),
    }
    if marker:
        figures["marked_summaries"] = sum(marker in s for _, s in written) / max(len(written), 1)
    return figures, written


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--checkpoint", required=True, help="a Hugging Face folder with tokenizer.json")
    p.add_argument("--config", required=True, help="the run's YAML config")
    p.add_argument("--examples", type=int, default=0, help="summaries to print of each kind")
    p.add_argument("--json", help="write the figures here too")
    p.add_argument("--marker", default="", help="also count the summaries that hold this text")
    p.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    agent = cfg.rollout.agent
    if agent.memory != "summary" or not agent.summary_gradient:
        p.error("needs rollout.agent.memory=summary and summary_gradient=true")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    envs = {e.name: make_env(e.name, **e.kwargs) for e in cfg.envs}
    tasks = heldout_tasks(envs, {e.name: e.eval_size for e in cfg.envs}, cfg.eval_seed)
    tokenizer = Tokenizer.from_file(os.path.join(args.checkpoint, "tokenizer.json"))
    engine = make_engine(
        cfg.rollout.engine,
        args.checkpoint,
        pad_id=pad_token_id(tokenizer),
        **{**engine_options(cfg), "seed": cfg.eval_seed},
    )
    params = SamplingParams.of(cfg.rollout, temperature=cfg.eval_temperature, seed=cfg.eval_seed)
    _, trajs = evaluate(
        LocalRollouts(engine, envs, tokenizer, agent),
        tasks,
        agent,
        params,
        cfg.eval_seed,
        cfg.eval.n_samples,
    )
    figures, written = measure(trajs, tokenizer, agent, args.marker)
    for key, value in figures.items():
        print(f"{key:24s} {value:.4f}" if isinstance(value, float) else f"{key:24s} {value}")
    for want in (True, False):
        for _, text in [w for w in written if w[0] == want][: args.examples]:
            print(f"{'keeps' if want else 'forgot'}: {text!r}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"checkpoint": args.checkpoint, **figures, "examples": written[:20]}, f, indent=2
            )
    return figures


if __name__ == "__main__":
    main()
