"""bench/step_path.py: the path one RL step takes through the core's files, as a reader follows it.

    .venv/bin/python bench/step_path.py [--config configs/toy_math.yaml] [key.sub=value ...]

Runs three steps of train.main (no eval before the last) and traces the second: every call from one
of our files into another (sys.setprofile), in order. The path lists each such call once, the
first time it happens (a loop is followed once: the turn loop, the engine's per-token loop, the
micro-batch loop), merges consecutive calls from one file into the same other file into one stop,
and leaves out the rank queries of distributed.py (is_main, get_rank, get_world_size, is_sharded),
which a reader does not open a file for. It prints the stops, numbered, and their count: the count
docs/layout.md and the README give ("the step's path"). Calls into torch, the standard library and
other packages are not stops. The trace covers one process: under torchrun every rank runs the
same path, rank 0 also the rollouts.

Imports: config.py, train.py (and the standard library).
"""

import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import train  # noqa: E402
from config import load_config  # noqa: E402

RANK_QUERIES = {"is_main", "get_rank", "get_world_size", "is_sharded"}
TRACED_STEP = 2


def ours(path: str) -> str | None:
    """`path` relative to the repository when it is one of our files, else None."""
    if not path.startswith(ROOT + os.sep) or os.sep + ".venv" + os.sep in path or path == __file__:
        return None
    return os.path.relpath(path, ROOT)


def trace_step(cfg) -> list[tuple[str, str, str]]:
    """(caller file, callee file, callee function) of every call between two of our files during
    step TRACED_STEP of train.main(cfg), in order."""
    calls = []

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = ours(frame.f_code.co_filename)
        if callee is None or callee.startswith("tests" + os.sep):
            return
        # the nearest caller that is one of our files (torch's wrappers in between are skipped)
        caller = frame.f_back
        while caller is not None and ours(caller.f_code.co_filename) is None:
            caller = caller.f_back
        source = ours(caller.f_code.co_filename) if caller is not None else None
        if source is not None and source != callee:
            calls.append((source, callee, frame.f_code.co_name))

    collect = train.collect_rollouts
    log = train.Logger.log

    def collect_traced(cfg, rollouts, envs, step):
        if step == TRACED_STEP:
            sys.setprofile(profile)
        return collect(cfg, rollouts, envs, step)

    def log_traced(self, step, metrics):
        out = log(self, step, metrics)
        if step == TRACED_STEP:
            sys.setprofile(None)
        return out

    train.collect_rollouts = collect_traced
    train.Logger.log = log_traced
    try:
        train.main(cfg)
    finally:
        sys.setprofile(None)
        train.collect_rollouts = collect
        train.Logger.log = log
    return calls


def path_of(calls: list[tuple[str, str, str]]) -> list[tuple[str, str, list[str]]]:
    """The stops: each call once, consecutive calls between the same two files merged, the rank
    queries left out."""
    seen = set()
    stops = []
    for source, callee, name in calls:
        if name in RANK_QUERIES or (source, callee, name) in seen:
            continue
        seen.add((source, callee, name))
        if stops and stops[-1][:2] == (source, callee):
            stops[-1][2].append(name)
        else:
            stops.append((source, callee, [name]))
    return stops


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "toy_math.yaml"))
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    args = p.parse_args()
    out = tempfile.mkdtemp(prefix="step_path_")
    fixed = ["steps=3", "eval_every=1000", "run_name=step_path", f"out_dir={out}", "wandb=false"]
    cfg = load_config(args.config, fixed + args.overrides)
    stops = path_of(trace_step(cfg))
    for i, (source, callee, names) in enumerate(stops, 1):
        print(f"{i:3d}. {source} -> {callee}: {', '.join(names)}")
    files = {"train.py"} | {callee for _, callee, _ in stops}
    print(f"{len(stops)} stops across {len(files)} files")


if __name__ == "__main__":
    main()
