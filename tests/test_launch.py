"""The launch paths on CPU: a run resumed under torchrun repeats the uninterrupted one exactly.

The reference is one 4-step run under `torchrun --nproc_per_node 2` (checkpoints every 2 steps), made once per
module; the other launch paths must reproduce its records."""
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
