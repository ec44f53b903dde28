"""Data parallel training under torchrun (gloo, FSDP2 on CPU): the same global batch gives the same
gradient on 1 and 2 processes and for any micro-batch split; gathered state dicts are the model's;
`torchrun --nproc_per_node 2 train.py` runs, logs once, and matches a single-process run.

The 2-process side runs tests/dist_cases.py under torchrun once per module; the 1-process reference
runs the same functions in this process."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dist_cases  # noqa: E402
from test_train import tiny  # noqa: E402,F401  (the session's tiny default model, built once)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.slow


def torchrun(args: list[str], timeout: int = 180) -> str:
    """`torchrun --nproc_per_node 2 ARGS` from the repo root with this checkout first on the
    path."""
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    with socket.socket() as s:  # a free port: tests may run beside other torchruns
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(port),
        *args,
    ]
    # its own process group, so that a timeout ends the workers too (killing torchrun alone orphans
    # them)
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun {args} timed out after {timeout} s:\n{out[-2000:]}\n{err[-2000:]}")
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    return out


def run_case(name: str, tmp_path) -> tuple[dict, dict]:
    """(1-process result, 2-process result) of dist_cases.CASES[name]."""
    out = tmp_path / f"{name}.pt"
    torchrun(["tests/dist_cases.py", name, str(out)])
    return dist_cases.CASES[name](), torch.load(out)


@pytest.fixture(scope="module")
def grads(tmp_path_factory):
    return run_case("grads", tmp_path_factory.mktemp("grads"))


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())


# What "the same" means between 1 and 2 processes, on any CPU. The two sides sum the same fp32
# numbers in a different order (per rank, then across ranks; other SIMD widths on other CPUs), so:
#   - a gradient taken at the same weights agrees to the bound of reordered fp32 summation, n *
# 2^-24 of the
#     largest entry for n ~ 10^2 terms: SUM_TOL. Measured: ~1e-7 (AVX512, AVX2 and plain kernels).
#   - a loss that is a mean of O(1) terms gets the same absolute error, which is a large relative
# one when the
#     mean cancels to ~1e-3 (pg_loss of zero-mean advantages): LOSS_ABS.
#   - after the first optimizer step the weights differ by that rounding, amplified by AdamW: it
# divides each
#     gradient by its own running RMS, so a near-zero gradient's noise becomes a step of a fraction
# of lr. Later
#     gradients are taken at slightly different weights: STEP_GRAD_TOL (measured: up to ~1e-5 after
# 15 LoRA steps
#     at lr 1e-2), and the weights agree to lr / 100 per optimizer step taken (measured: <= 1e-6
# after 8 steps at
#     lr 1e-3, on AVX512, AVX2 and plain kernels; another machine's AVX2 build gave 1.8e-6).
# A real bug (a different shuffle, a rank's rows dropped or counted twice, a wrong share) moves
# every gradient by O(1) of itself and many weights by ~lr per step: far outside all three.
SUM_TOL, LOSS_ABS, STEP_GRAD_TOL = 1e-5, 1e-5, 1e-3


def weight_tol(lr: float, steps: int) -> float:
    """How far two runs' weights may drift apart through rounding alone (see above): lr / 100 per
    AdamW step."""
    return lr * steps / 100


@pytest.mark.parametrize("B", [8, 7])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_gradient_invariant_to_processes_and_micro_batches(grads, B, agg):
    one, two = grads
    assert one["world_size"] == 1 and two["world_size"] == 2
    ref = one[f"grad/B{B}/{agg}/mbs8"]  # 1 process, the whole batch in one micro-batch
    assert ref.abs().max() > 0
    for mbs in (8, 3, 1):  # B=7 on 2 ranks: one rank runs a dummy micro-batch
        for res in (one, two):
            # fp32 summation order is the only difference
            assert rel_err(res[f"grad/B{B}/{agg}/mbs{mbs}"], ref) < SUM_TOL, (
                mbs,
                res["world_size"],
            )
        for k, v in one[f"metrics/B{B}/{agg}/mbs8"].items():
            # metrics are summed over ranks, not per rank
            assert two[f"metrics/B{B}/{agg}/mbs{mbs}"][k] == pytest.approx(
                v, rel=SUM_TOL, abs=LOSS_ABS
            ), k


@pytest.mark.parametrize("B", [8, 7])
def test_shared_prefixes_give_the_gradient_of_whole_rows_in_any_process_count(grads, B):
    """learner.shared_prefix: rows that share a prompt run it once; the gradient is the one of whole
    rows, in 1 and 2 processes (FSDP2 on gloo: every rank runs both forwards, dummy micro-batches
    too) and for any micro-batch size."""
    one, two = grads
    ref = one[f"grad/grouped{B}/share0/mbs8"]
    assert ref.abs().max() > 0
    for mbs in (8, 3, 1):
        for share in (0, 1):
            for res in (one, two):
                assert rel_err(res[f"grad/grouped{B}/share{share}/mbs{mbs}"], ref) < SUM_TOL, (
                    mbs,
                    share,
                )


def test_full_state_dict_and_training_match_one_process(grads):
    one, two = grads
    assert set(two["fresh"]) == set(one["fresh"])  # Hugging Face names, tied lm_head included
    for k, v in one["fresh"].items():
        assert not hasattr(two["fresh"][k], "full_tensor") and torch.equal(two["fresh"][k], v), k
    # two train_steps with shuffled mini-batches and PPO epochs (8 AdamW steps): every step is given
    # the same gradient, and the weights end the same, within the bounds above
    steps = len(one["step_grads"])
    assert steps == len(two["step_grads"]) == 8
    for i, (a, b) in enumerate(zip(two["step_grads"], one["step_grads"])):
        assert rel_err(a, b) < (SUM_TOL if i == 0 else STEP_GRAD_TOL), i
    changed = 0
    for k, v in one["trained"].items():
        torch.testing.assert_close(
            two["trained"][k], v, rtol=0, atol=weight_tol(dist_cases.TRAIN_LR, steps)
        )
        changed += not torch.equal(v, one["fresh"][k])
    assert changed > 10
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=STEP_GRAD_TOL)


def test_train_py_under_torchrun_matches_one_process(tiny, tmp_path, own_threads):
    """`torchrun --nproc_per_node 2 train.py` for 2 steps, from an empty model cache: rank 0 builds
    the default model by itself while rank 1 waits (distributed.alone), the same model one process
    builds; rank 0 alone writes metrics.jsonl (one record per step) and the checkpoint; the rollouts
    are rank 0's, generated with the same seeds as one process, so the first update's metrics equal
    a single-process run's."""
    import hashlib

    from sft import build_default_model
    from test_train import TINY
    from train import main

    extra = ["steps=2", "eval_every=100", "threads=1", "learner.micro_batch_size=3"]
    one_cfg = tiny(*extra, "run_name=dp_one")
    built = build_default_model(one_cfg)  # once (shared with test_train.py)
    torchrun(
        [
            "train.py",
            "--config",
            "configs/toy_math.yaml",
            *TINY,
            f"model.cache_dir={tmp_path}",
            f"out_dir={one_cfg.out_dir}",
            *extra,
            "run_name=dp_two",
        ],
        timeout=300,
    )
    digest = lambda folder: hashlib.sha256(
        open(os.path.join(folder, "model.safetensors"), "rb").read()
    ).hexdigest()
    # no collective, no rank split in the build
    assert digest(tmp_path / os.path.basename(built)) == digest(built)
    one = main(one_cfg)
    read = lambda name: [
        json.loads(l) for l in open(os.path.join(one_cfg.out_dir, name, "metrics.jsonl"))
    ]
    two_lines, one_lines = read("dp_two"), read("dp_one")
    assert [l["step"] for l in two_lines] == [0, 1, 2]  # written once: by rank 0 only
    assert two_lines[0]["eval/accuracy"] == one_lines[0]["eval/accuracy"]
    a, b = two_lines[1], one_lines[1]
    assert a["perf/world_size"] == 2 and b["perf/world_size"] == 1
    assert (
        a["rollout/reward"] == b["rollout/reward"]
        and a["rollout/total_tokens"] == b["rollout/total_tokens"]
    )
    for k in ("train/pg_loss", "train/entropy", "train/grad_norm"):
        # the first update, at the same weights
        assert a[k] == pytest.approx(b[k], rel=SUM_TOL, abs=LOSS_ABS), k
    for f in ("config.json", "model.safetensors", "trainer_state.pt", "tokenizer.json"):
        assert os.path.exists(os.path.join(one_cfg.out_dir, "dp_two", "final", f)), f
    assert os.path.exists(os.path.join(one["run_dir"], "final", "model.safetensors"))
