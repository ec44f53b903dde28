"""The fault-injection harness (bench/faults.py) as tests: every fault it injects is counted
exactly, the run goes on, no episode is lost without a count, and an episode whose env raised is
dropped with its group (the update equals the update on the batch without them, torch.equal), never
half-trained."""

import os
import sys

import pytest

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
)
import faults  # noqa: E402


def check(rows):
    for r in rows:
        assert r["counted"] == r["injected"] > 0, r
        assert r["survived"] and r["lost"] == 0, r


def test_env_and_call_faults_are_counted_and_failed_groups_dropped():
    check(
        faults.main(
            [
                "--tasks",
                "4",
                "--samples",
                "2",
                "--rate",
                "0.4",
                "--scenarios",
                "reset_raises",
                "step_raises",
                "malformed_call",
                "nan_loss",
            ]
        )
    )


@pytest.mark.slow
def test_every_fault_at_two_rates():
    for args in (
        ["--rate", "0.25", "--seed", "0"],
        ["--rate", "0.5", "--samples", "2", "--seed", "1"],
    ):
        check(faults.main(args))


def test_a_world_that_always_fails_stops_the_step_with_its_error():
    class Args:
        rate, tasks, samples, seed = 1.0, 2, 2, 0

    tok, model, cfg = faults.setup(Args)
    with pytest.raises(
        RuntimeError,
        match=r"every episode group of 4 rollout rounds had a failed episode \(16 failed\)"
        r", e.g. RuntimeError: the world would not start",
    ):
        faults.play(tok, cfg, "reset_raises", 1.0, 0)
