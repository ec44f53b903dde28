"""Config tree: YAML + overrides fill it, typos and wrong types fail loudly with a hint."""
import glob

import pytest

from config import Config, load_config


def test_defaults_and_yaml(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("steps: 7\nlearner:\n  lr: 0.001\nrollout:\n  agent:\n    n_samples: 4\n")
    cfg = load_config(str(p))
    assert cfg.steps == 7 and cfg.learner.lr == 1e-3 and cfg.rollout.agent.n_samples == 4
    assert cfg.rollout.temperature == Config().rollout.temperature       # untouched defaults stay


def test_overrides_are_typed():
    cfg = load_config(None, ["learner.lr=3e-5", "rollout.temperature=1", "wandb=false", "learner.loss.clip_high=0.3"])
    assert cfg.learner.lr == 3e-5 and isinstance(cfg.rollout.temperature, float) and cfg.wandb is False
    assert cfg.learner.loss.clip_high == 0.3
    with pytest.raises(TypeError, match="steps"):
        load_config(None, ["steps=abc"])
    with pytest.raises(TypeError, match="wandb"):
        load_config(None, ["wandb=3"])


def test_unknown_key_names_the_closest():
    with pytest.raises(KeyError, match="did you mean 'learner.lr'"):
        load_config(None, ["learner.lrr=1"])
    with pytest.raises(KeyError, match="did you mean 'rollout.temperature'"):
        load_config(None, ["rollout.temprature=1"])


def test_env_list(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("envs:\n  - name: toy_math\n    weight: 2\n  - name: toy_math\n    eval_size: 8\n")
    cfg = load_config(str(p), ["envs.1.weight=0.5"])
    assert [e.weight for e in cfg.envs] == [2.0, 0.5] and cfg.envs[1].eval_size == 8
    p.write_text("envs:\n  - name: toy_math\n    wieght: 2\n")
    with pytest.raises(KeyError, match="did you mean 'envs.0.weight'"):
        load_config(str(p))


def test_env_kwargs_overrides_add_to_each_other_and_to_the_file(tmp_path):
    """`envs.0.kwargs.k=v` sets one knob: the file's other knobs and earlier overrides stay."""
    path = tmp_path / "c.yaml"
    path.write_text("envs:\n  - name: alfworld_lite\n    kwargs: {kinds: [heat], max_storage: 4}\n")
    cfg = load_config(str(path), ["envs.0.kwargs.min_storage=2", "envs.0.kwargs.max_storage=3"])
    assert cfg.envs[0].kwargs == {"kinds": ["heat"], "min_storage": 2, "max_storage": 3}


@pytest.mark.parametrize("path", sorted(glob.glob("configs/*.yaml")))
def test_shipped_configs_load(path):
    load_config(path)


def test_choices_are_checked_at_load():
    with pytest.raises(ValueError, match="did you mean 'dapo'"):
        load_config(None, ["learner.policy_loss=dapoo"])
    with pytest.raises(ValueError, match="algo.name"):
        load_config(None, ["algo.name=grpoo"])
    with pytest.raises(ValueError, match="n_samples"):
        load_config(None, ["rollout.agent.n_samples=1"])
    with pytest.raises(ValueError, match="did you mean 'vllm'"):
        load_config(None, ["rollout.engine=vlm"])
    with pytest.raises(ValueError, match="top_p=1"):                 # vLLM's log-probs would be truncated ones
        load_config(None, ["rollout.engine=vllm", "rollout.top_p=0.9"])
    cfg = load_config(None, ["rollout.engine=vllm", "rollout.sync_max_logprob_diff=0.2"])
    assert cfg.rollout.sync_max_logprob_diff == 0.2 and Config().rollout.sync_max_logprob_diff is None


def test_algo_presets_set_defaults_that_explicit_keys_override():
    cfg = load_config(None, ["algo.name=drgrpo"])
    assert cfg.algo.advantage == "drgrpo" and cfg.learner.loss.agg_mode == "seq-mean-token-sum-norm"
    cfg = load_config(None, ["algo.name=gspo", "learner.loss.agg_mode=token-mean"])
    assert cfg.learner.policy_loss == "gspo" and cfg.learner.loss.agg_mode == "token-mean"
