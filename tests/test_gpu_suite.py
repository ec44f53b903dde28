"""bench/gpu.py's tiny CPU run, as CI runs it: every section of the GPU suite goes through on tiny
shapes, its correctness checks pass, and nothing on its path imports wandb, ray, vllm or
transformers (a lent GPU machine has none of them but transformers, which is optional)."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# run bench/gpu.py with these modules made unimportable, in a fresh interpreter (this one may have
# them loaded)
BLOCKED = ("wandb", "ray", "vllm", "transformers")
RUNNER = """
import runpy, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(f"{{name}} is blocked: bench/gpu.py must run without it")
sys.meta_path.insert(0, Block())
sys.argv = ["bench/gpu.py", "--tiny", "--shapes", "tiny-a", "--json", {out!r}]
runpy.run_path("bench/gpu.py", run_name="__main__")
"""


def test_gpu_suite_tiny_cpu_run(tmp_path):
    out = str(tmp_path / "gpu.json")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "2"}
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER.format(blocked=set(BLOCKED), out=out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.load(open(out))
    r = results["shapes"]["tiny-a"]
    assert r["bf16_ok"] and r["engine_learner_ok"] and r["push_ok"]
    assert r["engine_learner_logprob_gap"] <= 1e-3  # fp32 with --tiny: the gate's fp32 threshold
    assert "decode_transformers_tokens_per_s" not in r  # blocked, so the engine ran alone
    for key in (
        "decode_engine_tokens_per_s",
        "learner_no_gc_tokens_per_s",
        "learner_gc_tokens_per_s",
        "learner_no_gc_mfu",
        "learner_gc_peak_gib",
        "push_gb_per_s",
        "grpo_step_seconds",
    ):
        assert r[key] > 0, key
    assert r["grpo_sync_gap"] <= 1e-3  # train.main's own gate, twice
    assert "| learner_gc_mfu |" in proc.stdout
