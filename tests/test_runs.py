"""runs.py: the paths a config names, checked by the entry points before anything is built
(check_model_folder, check_checkpoint_folder, check_file, check_paths). The run folder's logs,
checkpoints and resume are tested end to end in test_train.py and test_kill_resume.py."""

import json
import os

import pytest

from config import load_config
from runs import check_checkpoint_folder, check_file, check_model_folder, check_paths


# -----------------------------------------------------------------------------
# the paths a config names


def hf_folder(path, *names: str) -> str:
    """A folder holding (empty) files of these names: the checks look at names, not contents."""
    os.makedirs(path, exist_ok=True)
    for name in names:
        os.makedirs(os.path.dirname(os.path.join(path, name)), exist_ok=True)
        open(os.path.join(path, name), "w").close()
    return str(path)


MODEL_FILES = ("config.json", "tokenizer.json", "model.safetensors")


def test_check_model_folder_says_what_is_missing(tmp_path):
    good = hf_folder(tmp_path / "good", *MODEL_FILES)
    assert check_model_folder(good, "model.path") == good
    with pytest.raises(ValueError) as e:
        check_model_folder(str(tmp_path / "none"), "model.path")
    assert str(e.value) == f"model.path={str(tmp_path / 'none')!r}: no such folder"
    with pytest.raises(ValueError, match="a file, not a Hugging Face model folder"):
        check_model_folder(os.path.join(good, "config.json"), "model.path")
    for missing in MODEL_FILES:
        folder = hf_folder(tmp_path / f"no_{missing}", *(f for f in MODEL_FILES if f != missing))
        with pytest.raises(ValueError) as e:
            # any key: the same check for any model folder
            check_model_folder(folder, "teacher.path")
        word = "weights (model.safetensors" if missing == "model.safetensors" else missing
        assert str(e.value).startswith(
            f"teacher.path={folder!r} is not a Hugging Face model folder: it has no {word}"
        )
    empty = hf_folder(tmp_path / "empty")
    with pytest.raises(
        ValueError, match=r"it has no config.json, tokenizer.json or weights \(model.safetensors"
    ):
        check_model_folder(empty, "--checkpoint")
    # only the tokenizer is read for the openai engine
    assert check_model_folder(
        hf_folder(tmp_path / "tok", "tokenizer.json"), "--checkpoint", weights=False
    )
    # an adapter's *.safetensors is not the model's weights
    with pytest.raises(ValueError, match="no weights"):
        check_model_folder(
            hf_folder(
                tmp_path / "lora", "config.json", "tokenizer.json", "adapter_model.safetensors"
            ),
            "model.path",
        )


def test_check_model_folder_reads_a_sharded_index(tmp_path):
    folder = hf_folder(tmp_path / "sharded", "config.json", "tokenizer.json", "model-1.safetensors")
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}, f)
    with pytest.raises(
        ValueError,
        match=r"it has no model-2.safetensors \(listed in model.safetensors.index.json\)$",
    ):
        check_model_folder(folder, "model.path")
    hf_folder(folder, "model-2.safetensors")
    assert check_model_folder(folder, "model.path") == folder
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="model.safetensors.index.json is not a readable index"):
        check_model_folder(folder, "model.path")


def test_check_checkpoint_folder_and_file(tmp_path):
    ckpt = hf_folder(tmp_path / "ckpt", *MODEL_FILES, "trainer_state.pt", "checkpoint.json")
    assert check_checkpoint_folder(ckpt, "resume") == ckpt
    with pytest.raises(
        ValueError,
        match=r"resume='.*' is not a checkpoint folder: it has no critic/trainer_state.pt",
    ):
        check_checkpoint_folder(ckpt, "resume", critic=True)  # PPO resumes its critic too
    hf_folder(ckpt, "critic/trainer_state.pt")
    assert check_checkpoint_folder(ckpt, "resume", critic=True) == ckpt
    with pytest.raises(ValueError, match="it has no trainer_state.pt or checkpoint.json$"):
        check_checkpoint_folder(hf_folder(tmp_path / "model", *MODEL_FILES), "resume")
    with pytest.raises(ValueError, match="it has no checkpoint.json$"):  # a write a kill cut short
        check_checkpoint_folder(
            hf_folder(tmp_path / "cut", *MODEL_FILES, "trainer_state.pt"), "resume"
        )
    with pytest.raises(ValueError, match=r"^--config '.*': no such file$"):
        check_file(str(tmp_path / "nope.yaml"), "--config")
    with pytest.raises(ValueError, match=r"^--config '.*': a folder, not a file$"):
        check_file(str(tmp_path), "--config")


def test_check_paths(tmp_path):
    model = hf_folder(tmp_path / "model", *MODEL_FILES)
    ckpt = hf_folder(tmp_path / "ckpt", "trainer_state.pt", "checkpoint.json")
    with open(os.path.join(ckpt, "checkpoint.json"), "w") as f:
        json.dump({"rl_step": 2}, f)
    ok = [
        "envs.0.name=dataset",
        "envs.0.kwargs.path=data/sample_gsm8k.jsonl",
        f"model.path={model}",
        f"resume={ckpt}",
        f"out_dir={tmp_path}/runs",
    ]
    cfg = load_config(None, ok)
    assert check_paths(cfg) is cfg
    # another part of the code resolves it
    assert check_paths(load_config(None, ok[:3] + ["resume=auto"]))
    assert check_paths(load_config(None, []))  # model.path=default: built on use
    for override, says in [
        (
            "envs.0.kwargs.path=data/nope.jsonl",
            "envs.0.kwargs.path='data/nope.jsonl': no such file",
        ),
        ("envs.0.kwargs.test_path=data", "envs.0.kwargs.test_path='data': a folder, not a file"),
        (f"model.path={tmp_path}/nope", f"model.path='{tmp_path}/nope': no such folder"),
        (
            f"resume={model}",
            f"resume={model!r} is not a checkpoint folder: "
            "it has no trainer_state.pt or checkpoint.json",
        ),
        ("envs.0.name=datset", "unknown env 'datset'"),
    ]:
        with pytest.raises(ValueError) as e:
            check_paths(load_config(None, ok + [override]))
        assert str(e.value).startswith(says), e.value
    # eval.py checks only what it reads: not model.path or resume (training keys of a run's config)
    assert check_paths(load_config(None, ok + ["model.path=/nope", "resume=/nope"]), training=False)
