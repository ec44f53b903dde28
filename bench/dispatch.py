"""bench/dispatch.py: the three Ray dispatchers and in-process run_episodes, same tasks, same
workers, one run.

    .venv/bin/python bench/dispatch.py                                   # 2 workers, 32 toy-math
    tasks x 4 samples .venv/bin/python bench/dispatch.py --workers 4 --tasks 64 --chunk-groups 4
    --max-in-flight 4 --repeats 3 .venv/bin/python bench/dispatch.py --model
    .cache/default_model_XXXX  # a model folder already built

The embedded default model plays training-style episodes (temperature 1, multi-turn with tools) of
the same tasks with the same seed in every mode. In process: one run_episodes over all tasks (one
batched engine), with torch threads = workers x threads per worker (the same CPUs) and with 1 thread
(the baseline of the ratios: under load, threads fight other jobs for the cores and can be slower
than one). Ray: `workers` RolloutWorkers of `threads` CPUs each (and 2 EnvWorkers for
async_pipeline's init and evaluate stages) play chunks of
--chunk-groups tasks through each dispatcher. The modes take turns, `repeats` times (taking turns
spreads any other load on the machine over all of them); the table gives medians: wall seconds,
trajectories/s, sampled tokens/s, the workers' mean idle fraction, and tokens/s relative to
in-process with 1 thread.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from agent import run_episodes  # noqa: E402
from config import load_config  # noqa: E402
from env import make_env  # noqa: E402
from rollout import SamplingParams, make_engine  # noqa: E402
from sft import build_default_model  # noqa: E402
from wings.cluster import (
    DISPATCHERS,
    WorkerSpec,
    dispatch,
    make_placement_group,
    start_env_workers,  # noqa: E402
    start_rollout_workers,
)


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", default="configs/toy_math.yaml")
    p.add_argument(
        "--model",
        default="",
        help="a model folder (default: the config's embedded model, built if needed)",
    )
    p.add_argument("--workers", type=int, default=2, help="RolloutWorkers (one CPU each)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--tasks", type=int, default=32)
    p.add_argument("--n", type=int, default=4, help="episodes per task (the group)")
    p.add_argument("--chunk-groups", type=int, default=4)
    p.add_argument(
        "--max-in-flight", type=int, default=0, help="bounded / pipeline (0: their defaults)"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "overrides", nargs="*", help="config overrides, e.g. model.cache_dir=/elsewhere/.cache"
    )
    args = p.parse_args()

    import ray

    cfg = load_config(args.config, args.overrides)
    model_dir = args.model or build_default_model(cfg)
    agent = replace(cfg.rollout.agent, n_samples=args.n)
    envs = {e.name: make_env(e.name, **e.kwargs) for e in cfg.envs}
    tasks = envs[cfg.envs[0].name].sample_tasks("train", args.tasks, args.seed)
    params = SamplingParams(temperature=cfg.rollout.temperature, max_tokens=cfg.rollout.max_tokens)

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        num_cpus=args.workers * args.threads + 1,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=tempfile.mkdtemp(prefix="ray_bench_"),
    )
    spec = WorkerSpec(
        model_dir=model_dir,
        envs=[(e.name, e.kwargs) for e in cfg.envs],
        agent=agent,
        engine_kwargs={"max_batch_size": cfg.rollout.max_batch_size},
        threads=args.threads,
    )
    pg = make_placement_group(args.workers, cpus=args.threads)
    workers = start_rollout_workers(spec, args.workers, pg)
    env_workers = start_env_workers(envs, model_dir, 2, cpus=0.5)
    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    engine = make_engine(
        "torch",
        model_dir,
        pad_id=tokenizer.token_to_id("<|endoftext|>"),
        max_batch_size=cfg.rollout.max_batch_size,
    )

    def in_process(threads):
        def run():
            torch.set_num_threads(threads)
            t0 = time.perf_counter()
            trajs = run_episodes(engine, envs, tasks, tokenizer, agent, params, args.seed)
            wall = time.perf_counter() - t0
            return {
                "wall": wall,
                "traj/s": len(trajs) / wall,
                "tok/s": sum(sum(t.loss_mask) for t in trajs) / wall,
                "idle": float("nan"),
            }

        return run

    def on_ray(kind):
        def run():
            _, s = dispatch(
                kind,
                workers,
                tasks,
                params,
                args.seed,
                agent=agent,
                chunk_groups=args.chunk_groups,
                max_in_flight=args.max_in_flight,
                env_workers=env_workers,
            )
            m = s.metrics()
            return {
                "wall": s.wall_seconds,
                "traj/s": m["dispatch/trajectories_per_s"],
                "tok/s": m["dispatch/tokens_per_s"],
                "idle": s.idle_fraction,
            }

        return run

    many = args.workers * args.threads
    modes = {
        "in-process run_episodes, 1 thread": in_process(1),
        f"in-process run_episodes, {many} threads": in_process(many),
        **{k: on_ray(k) for k in DISPATCHERS},
    }
    for run in modes.values():  # warm-up: actors started, caches filled
        run()
    results = {name: [] for name in modes}
    for _ in range(args.repeats):
        for name, run in modes.items():
            results[name].append(run())
    ray.shutdown()

    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        for name, rs in results.items()
    }
    base = med["in-process run_episodes, 1 thread"]["tok/s"]
    print(
        f"\n{args.tasks} tasks x {args.n} samples, "
        f"{args.workers} workers x {args.threads} threads, chunk_groups {args.chunk_groups}, "
        f"max_in_flight {args.max_in_flight or 'default'}, median of {args.repeats}\n"
    )
    print(
        "| mode | wall s | trajectories/s | sampled tokens/s | worker idle "
        "| tokens/s vs in-process, 1 thread |"
    )
    print("|---|---|---|---|---|---|")
    for name, m in med.items():
        idle = "-" if m["idle"] != m["idle"] else f"{m['idle']:.2f}"
        print(
            f"| {name} | {m['wall']:.2f} | {m['traj/s']:.1f} | {m['tok/s']:.0f} | {idle} "
            f"| {m['tok/s'] / base:.2f}x |"
        )


if __name__ == "__main__":
    main()
