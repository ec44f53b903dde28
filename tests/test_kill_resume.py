"""Nothing is lost when a run is killed: bench/kill_resume.py's short version. A tiny run is killed
with SIGKILL three times (at a random moment, during a checkpoint write, in the middle of a step),
relaunched with resume=auto each time, and must end with the uninterrupted run's bytes: final
weights, optimizer state, metrics.jsonl; synchronous, with async rollouts two updates ahead
(rollout.max_staleness=2: the checkpoints carry the queued batches), with LoRA (adapter files and
merged model), with two Ray rollout workers, and with partial rollouts: where each push lands is
timing, so the killed run replays the uninterrupted run's swap record (and must end with the same
record too), or (own record) replays only its own record across its kills, and a replay of its final
record must give its bytes. The README reports the long version (20 kills). The cases share one
default model, built once for the session (test_train's tiny, the same SFT settings): each case's
runs find it in model.cache_dir instead of building it."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_train import tiny  # noqa: E402,F401  (the session's tiny default model, built once)


@pytest.fixture(scope="module")
def model_cache(tiny):
    """The cache folder holding the tiny default model, built here if no test built it yet (the
    reference run of every case would otherwise build its own: the same model, ~30 s each on a
    loaded machine)."""
    from sft import build_default_model

    cfg = tiny()
    build_default_model(cfg)
    return cfg.model.cache_dir


# async rollouts two updates ahead: a checkpoint must carry the queue of batches already sampled
# LoRA: the adapters and the merged model; Ray: two rollout workers, whose Ray cluster dies with
# each kill
CASES = {
    "sync": [],
    "async_k2": [
        "rollout.async_rollouts=true",
        "learner.off_policy.kind=tis",
        "rollout.max_staleness=2",
    ],
    "lora": ["learner.lora_rank=4"],
    "ray_workers": ["ray.rollout_workers=2"],
}
# partial rollouts: every batch updates (the tiny model earns no reward, so without this every
# update would be skipped and every version would hold the same weights: where a push lands would
# change nothing)
PARTIAL = [*CASES["async_k2"], "rollout.partial_rollouts=true", "algo.skip_uniform_batches=false"]
CASES.update({"partial_replay": PARTIAL, "partial_own_record": ["--own-record", *PARTIAL]})


@pytest.mark.parametrize("case", list(CASES))
def test_killed_and_resumed_run_ends_byte_identical(tmp_path, case, model_cache):
    out = subprocess.run(
        [
            sys.executable,
            "bench/kill_resume.py",
            "--kills",
            "3",
            "--steps",
            "8",
            "--out",
            str(tmp_path / "kr"),
            *CASES[case],
            f"model.cache_dir={model_cache}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout[out.stdout.index("{\n") :])
    # two uninterrupted runs agree: the test can fail
    assert all(result["control_identical"].values())
    assert all(result["identical"].values()), result
    assert ("partial_swaps.jsonl" in result["identical"]) == (
        "rollout.partial_rollouts=true" in CASES[case]
    )
    assert result["kills"] >= 2 and result["during_checkpoint_write"] >= 1, result
