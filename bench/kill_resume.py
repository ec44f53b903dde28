"""bench/kill_resume.py: kill a training run with SIGKILL again and again, relaunch it with
resume=auto each time, and check that it ends byte for byte where an uninterrupted run ends.

    .venv/bin/python bench/kill_resume.py [--kills 20] [--steps 12] [--seed 0] [--out
    runs/kill_resume] [key=value ...]

A tiny run (the embedded default model at test size, toy math, `checkpoint_every=1`,
`log_timings=false`, CPU, `threads=1`) is run once uninterrupted. Then the same command with
`resume=auto` is started and killed (SIGKILL to its whole process group) --kills times, each kill
chosen in turn from three kinds of moment:
  random       a uniformly random time after the launch (start-up, rollouts, updates, evals,
  checkpoints alike); checkpoint   the instant a checkpoint is being written (its `.partial` folder
  appears); mid-step     a random fraction of a step after the run logged a step (the next step's
  rollouts or update);
and relaunched at once. A last launch runs to the end. Then every final/**/*.safetensors,
final/trainer_state.pt (the optimizer state, both step counters, the RNG states) and metrics.jsonl
must equal the uninterrupted run's, byte for byte (with LoRA: its adapter files and the merged
model). Exit status 0 when they do. Overrides after the options go to every launch (e.g. async
rollouts with a staleness bound, whose queued batches a checkpoint must carry; model.cache_dir,
OUT/cache by default, to find the default model already built). tests/test_kill_resume.py runs short
versions in CI; the README reports a long one.

Partial rollouts (rollout.partial_rollouts=true): where each push lands depends on timing, so two
runs agree only when one replays the other's swap record (partial_swaps.jsonl,
async_rollouts.SwapRecord), which is compared too. The control and every killed launch replay the
reference's record (rollout.partial_replay=<its folder>): the killed run must end with the
reference's bytes, its record rebuilt across the kills from its checkpoints. With
--own-record the killed launches replay nothing but their own record (a resumed launch re-samples
what the kill lost as it was, then goes by the clock); a last uninterrupted run replaying the killed
run's final record must then end with the killed run's bytes (`identical` compares those two;
`control_identical` the reference and its replay).
"""

import argparse
import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a test-size default model and a short run: what matters is the bookkeeping, not the learning
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
    "rollout.prompts_per_step=4",
    "rollout.agent.n_samples=4",
    "rollout.max_tokens=40",
    "rollout.agent.max_total_tokens=768",
    "learner.micro_batch_size=8",
    "learner.lr=1e-3",
    "learner.mini_batches=2",
    "learner.entropy_coef=0.01",
    "wandb=false",
    "threads=1",
    "log_timings=false",
    "checkpoint_every=1",
    "eval_every=2",
]
# and every final/**/*.safetensors (weights; LoRA: adapters and the merged model), and the swap
# record if any
COMPARED = ("final/trainer_state.pt", "metrics.jsonl")
RECORD = "partial_swaps.jsonl"  # partial rollouts: where each push landed


def command(
    out: str, run_name: str, steps: int, seed: int, resume: str = "", extra: tuple = ()
) -> list[str]:
    return [
        sys.executable,
        "train.py",
        "--config",
        "configs/toy_math.yaml",
        *TINY,
        f"model.cache_dir={out}/cache",
        *extra,
        f"steps={steps}",
        f"seed={seed}",
        f"out_dir={out}",
        f"run_name={run_name}",
        *([f"resume={resume}"] * bool(resume)),
    ]


def launch(cmd: list[str], log) -> subprocess.Popen:
    """The run in a process group of its own, so a kill takes every process it started."""
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": ROOT},
    )


def logged_steps(run_dir: str) -> int:
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return sum(1 for line in f if line.endswith("\n"))
    except FileNotFoundError:
        return 0


def writing_checkpoint(run_dir: str) -> bool:
    """A checkpoint is being written: its .partial folder exists (checkpoints/step_N.partial or
    final.partial)."""
    return bool(
        glob.glob(os.path.join(run_dir, "checkpoints", "*.partial"))
        + glob.glob(os.path.join(run_dir, "*.partial"))
    )


def wait_for(proc: subprocess.Popen, condition, deadline: float) -> bool:
    """Poll every millisecond until condition() holds (True), the run exits or the deadline passes
    (False)."""
    while time.time() < deadline and proc.poll() is None:
        if condition():
            return True
        time.sleep(0.001)
    return False


def torture(
    kills: int, steps: int, seed: int, out: str, extra: tuple = (), own_record: bool = False
) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    log = open(os.path.join(out, "log.txt"), "w")
    ref_dir, run_dir = os.path.join(out, "uninterrupted"), os.path.join(out, "killed")
    swaps = "rollout.partial_rollouts=true" in extra  # partial rollouts: a swap record to replay
    # the others replay
    base, extra = extra, (*extra, f"rollout.partial_replay={ref_dir}") if swaps else extra
    # the reference, which also builds the default model (not under kills: its build is atomic too,
    # but it is not what is tested here); then the control: a second uninterrupted run must give the
    # same bytes (timed: the model is cached by then), or byte-identity after kills would prove
    # nothing
    subprocess.run(
        command(out, "uninterrupted", steps, seed, extra=base),
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        check=True,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    t0, again = time.time(), os.path.join(out, "uninterrupted_again")
    proc = launch(command(out, "uninterrupted_again", steps, seed, extra=extra), log)
    # start-up: imports, model, step 0's eval
    wait_for(proc, lambda: logged_steps(again) > 0, t0 + 3600)
    startup = time.time() - t0
    if proc.wait() != 0:
        raise RuntimeError(f"the uninterrupted run failed: see {out}/log.txt")
    run_seconds = time.time() - t0
    control = same_files(ref_dir, again)
    step_seconds = (run_seconds - startup) / steps
    rng = random.Random(seed)
    record = []
    killed_extra = base if swaps and own_record else extra
    for k in range(kills):
        kind = ("checkpoint", "mid-step", "random")[k % 3]
        before = logged_steps(run_dir)  # records kept so far: step 0 is the first
        if before >= steps + 1:  # the run is complete: nothing left to kill
            break
        proc = launch(command(out, "killed", steps, seed, resume="auto", extra=killed_extra), log)
        start = time.time()
        if kind == "random":  # before the last step of what is left (it resumes where it was)
            left = max(steps - max(before - 1, 0) - 1, 0.5)
            wait_for(proc, lambda: False, start + rng.uniform(0, startup + left * step_seconds))
        elif kind == "checkpoint":
            wait_for(proc, lambda: writing_checkpoint(run_dir), start + 4 * run_seconds)
        elif wait_for(proc, lambda: logged_steps(run_dir) > before, start + 4 * run_seconds):
            # mid-step
            wait_for(proc, lambda: False, time.time() + rng.uniform(0, step_seconds))
        if proc.poll() is not None:  # it finished before the moment came
            record.append(
                {"kill": k, "kind": kind, "killed": False, "logged_steps": logged_steps(run_dir)}
            )
            continue
        partial = writing_checkpoint(run_dir)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        record.append(
            {
                "kill": k,
                "kind": kind,
                "killed": True,
                "after_s": round(time.time() - start, 2),
                "during_checkpoint_write": partial,
                "logged_steps": logged_steps(run_dir),
            }
        )
        print(json.dumps(record[-1]), flush=True)
    subprocess.run(
        command(out, "killed", steps, seed, resume="auto", extra=killed_extra),
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        check=True,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    identical_to = ref_dir
    if swaps and own_record:  # the killed run's own record, replayed, must give its bytes
        identical_to = os.path.join(out, "replayed")
        subprocess.run(
            command(
                out, "replayed", steps, seed, extra=(*base, f"rollout.partial_replay={run_dir}")
            ),
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=True,
            env={**os.environ, "PYTHONPATH": ROOT},
        )
    killed = [r for r in record if r["killed"]]
    return {
        "kills": len(killed),
        "during_checkpoint_write": sum(r["during_checkpoint_write"] for r in killed),
        "by_kind": {
            kind: sum(r["kind"] == kind for r in killed)
            for kind in ("random", "checkpoint", "mid-step")
        },
        "identical": same_files(identical_to, run_dir),
        "control_identical": control,
        "launches": len(record) + 1,
        "uninterrupted_seconds": round(run_seconds, 1),
        "startup_seconds": round(startup, 1),
        "steps": steps,
    }


def compared(run_dir: str) -> list[str]:
    """The files compared, relative to a run folder: COMPARED and the final checkpoint's weights."""
    weights = glob.glob(os.path.join(run_dir, "final", "**", "*.safetensors"), recursive=True)
    record = [RECORD] if os.path.exists(os.path.join(run_dir, RECORD)) else []
    return sorted({*COMPARED, *record, *(os.path.relpath(w, run_dir) for w in weights)})


def same_files(a_dir: str, b_dir: str) -> dict[str, bool]:
    """Whether each compared file is byte-identical in the two run folders (a file one of them
    lacks: False)."""
    same = {}
    for f in sorted(set(compared(a_dir)) | set(compared(b_dir))):
        try:
            with open(os.path.join(a_dir, f), "rb") as a, open(os.path.join(b_dir, f), "rb") as b:
                same[f] = a.read() == b.read()
        except FileNotFoundError:
            same[f] = False
    return same


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/kill_resume")
    p.add_argument(
        "--own-record",
        action="store_true",
        help="partial rollouts: the killed launches replay only "
        "their own record, and a replay of its final record must give the killed run's bytes",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        help="config overrides for every launch, e.g. rollout.async_rollouts=true",
    )
    args = p.parse_args()
    result = torture(
        args.kills,
        args.steps,
        args.seed,
        os.path.abspath(args.out),
        tuple(args.overrides),
        args.own_record,
    )
    print(json.dumps(result, indent=2))
    sys.exit(
        0 if all(result["identical"].values()) and all(result["control_identical"].values()) else 1
    )


if __name__ == "__main__":
    main()
