"""bench/grpo_vs_trl.py's own side, without TRL (CI does not install it): on a tiny random model,
the parent runs train.main in a child process per run and reads back what the table needs: per-step
times split into sampling and update, start-up, peak RSS (os.wait4) and the sampled tokens, and the
prompts it hands TRL are the ones our agent loop renders."""

import json
import os
import random
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_folder(path: str) -> str:
    """A random 2-layer Qwen2 model with a small BPE tokenizer trained on toy_math demonstrations
    (as bench/gpu.py)."""
    from chat import render
    from env import make_env
    from model import ModelConfig, init_model, save_model
    from sft import train_tokenizer, write_tokenizer_files

    env, rng = make_env("toy_math"), random.Random(0)
    texts = [
        render(env.demonstration(t, rng, True), env.tools())
        for t in env.sample_tasks("train", 200, 0)
    ]
    tokenizer = train_tokenizer(texts, 512)
    write_tokenizer_files(tokenizer, path, "qwen2.5")
    cfg = ModelConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    save_model(init_model(cfg, seed=0), path)
    return path


def test_our_side_runs_and_reports(tmp_path):
    folder = tiny_folder(str(tmp_path / "model"))
    keep = tmp_path / "runs"
    cmd = [
        sys.executable,
        "bench/grpo_vs_trl.py",
        "--sides",
        "ours",
        "--sizes",
        "default",
        "--base",
        folder,
        "--pairs",
        "1",
        "--steps",
        "2",
        "--prompts",
        "2",
        "--group",
        "2",
        "--max-tokens",
        "6",
        "--micro-batch",
        "2",
        "--threads",
        "1",
        "--keep",
        str(keep),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| default (" in proc.stdout and "| ours |" in proc.stdout  # the README table's row

    prompts = [json.loads(line) for line in open(keep / "prompts_default.jsonl")]
    from chat import encode
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    assert all(
        encode(tok, p["prompt"]) == p["ids"] and p["prompt"].endswith("<|im_start|>assistant\n")
        for p in prompts
    )  # rendered as the agent loop does

    for r in (0, 1):  # the warm-up run and the timed one
        out = json.load(open(keep / f"default_ours_{r}.log.json"))
        assert len(out["step_s"]) == len(out["sample_s"]) == len(out["update_s"]) == 2
        for step, sample, update in zip(out["step_s"], out["sample_s"], out["update_s"]):
            assert 0 < sample < step and 0 < update < step  # both parts of a step, inside it
        assert out["startup_s"] > 0
        assert all(0 < n <= 6 for n in out["new_tokens"])  # at most M sampled tokens per episode
        assert out["old_logprob_pass"] == [0.0, 0.0]  # on-policy: no scoring pass, as TRL
