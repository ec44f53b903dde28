"""The launch paths on CPU: a run resumed under torchrun repeats the uninterrupted one exactly, and the learner's
ranks as Ray actors (`ray.learner_workers=2`) train exactly as torchrun's 2 processes do.

The reference is one 4-step run under `torchrun --nproc_per_node 2` (checkpoints every 2 steps), made once per
module; the other launch paths must reproduce its records. One local Ray (2 CPUs, no dashboard) serves the module."""
import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_distributed import torchrun  # noqa: E402
from test_train import TINY, tiny  # noqa: E402,F401  (the session's tiny default model, built once)

EXTRA = ["eval_every=100", "threads=1", "learner.micro_batch_size=3", "learner.entropy_coef=0.01"]


def records(run_dir: str) -> dict[int, dict]:
    """metrics.jsonl by step, without the perf/* timings (they differ between any two runs)."""
    lines = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
    return {l["step"]: {k: v for k, v in l.items() if not k.startswith("perf/")} for l in lines}


def cli_args(cfg) -> list[str]:
    """The command-line arguments that make train.py build `cfg`'s tiny model in the same cache and folder."""
    return ["--config", "configs/toy_math.yaml", *TINY, f"model.cache_dir={cfg.model.cache_dir}",
            f"out_dir={cfg.out_dir}"]


@pytest.fixture(scope="module")
def reference(tiny):
    """The uninterrupted run: 4 steps under torchrun, a checkpoint every 2. -> its run folder."""
    from sft import build_default_model

    cfg = tiny(*EXTRA, "run_name=launch_full")
    build_default_model(cfg)                                       # once (shared with test_train.py)
    torchrun(["train.py", *cli_args(cfg), *EXTRA, "steps=4", "checkpoint_every=2", "run_name=launch_full"],
             timeout=300)
    return os.path.join(cfg.out_dir, "launch_full")


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")          # no token file in ~/.ray
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(tmp_path_factory.mktemp("ray")))
    yield ray
    ray.shutdown()


def same_records(run_dir: str, reference: str, steps: list[int]):
    """Each step's record of run_dir holds the reference's (equal values); only held-out evals may be added
    (a shorter run evaluates at its own last step)."""
    ours, ref = records(run_dir), records(reference)
    assert sorted(ours) == steps
    for step in steps:
        assert {k: ours[step].get(k) for k in ref[step]} == ref[step], step
        assert all(k.startswith("eval/") for k in set(ours[step]) - set(ref[step])), step


def test_learner_workers_on_ray_match_torchrun(tiny, reference, local_ray):
    """ray.learner_workers=2: two actors run main() as ranks 0 and 1 (gloo), and log what torchrun's 2 ranks
    logged, step by step: rollouts, losses, gradient norms, the weight-sync gate."""
    from train import launch_on_ray

    summary = launch_on_ray(tiny(*EXTRA, "steps=2", "run_name=launch_ray", "ray.learner_workers=2"))
    assert summary["run_dir"].endswith("launch_ray") and summary["final_accuracy"] is not None  # rank 0's summary
    same_records(summary["run_dir"], reference, [0, 1, 2])
    assert records(summary["run_dir"])[1]["train/grad_norm"] > 0


def test_a_failing_learner_actor_is_named(tiny, local_ray):
    """Every rank raises at once (a config main() refuses): the driver stops with the rank and the cause."""
    from train import launch_on_ray

    with pytest.raises(RuntimeError, match=r"learner rank \d of 2 failed:(.|\n)*cannot train"):
        launch_on_ray(tiny("rollout.engine=openai", "ray.learner_workers=2"))


def test_learner_workers_under_torchrun_is_refused(tiny, monkeypatch):
    from train import launch_on_ray

    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="choose one launcher"):
        launch_on_ray(tiny("ray.learner_workers=2"))


def test_no_cluster_at_the_address_is_a_clear_error(tiny):
    import socket

    from train import launch_on_ray

    with socket.socket() as s:                                     # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConnectionError, match=f"no Ray cluster at '127.0.0.1:{port}'"):
        launch_on_ray(tiny(f"ray.address=127.0.0.1:{port}", "ray.learner_workers=2"))


def test_resume_under_torchrun_is_exact(tiny, reference):
    """Resumed from checkpoints/step_2 under torchrun, steps 3-4 log what the uninterrupted run logged, and the
    final weights are bit-identical: the checkpoint holds everything a rank needs (weights, optimizer, RNG)."""
    cfg = tiny(*EXTRA, "run_name=launch_resumed")
    half = os.path.join(reference, "checkpoints", "step_2")
    torchrun(["train.py", *cli_args(cfg), *EXTRA, "steps=4", "run_name=launch_resumed", f"resume={half}"],
             timeout=300)
    resumed_dir = os.path.join(cfg.out_dir, "launch_resumed")
    full, resumed = records(reference), records(resumed_dir)
    assert sorted(resumed) == [3, 4]                               # no step-0 eval, no repeated steps
    for step in (3, 4):
        assert {k for k in full[step] if k.split("/")[0] in ("train", "rollout")} > {"train/pg_loss"}
        assert resumed[step] == full[step], step
    a = load_file(os.path.join(reference, "final", "model.safetensors"))
    b = load_file(os.path.join(resumed_dir, "final", "model.safetensors"))
    start = load_file(os.path.join(half, "model.safetensors"))
    assert any(not torch.equal(a[k], start[k]) for k in a)          # steps 3-4 did change the weights
    for k in a:
        assert torch.equal(a[k], b[k]), k
