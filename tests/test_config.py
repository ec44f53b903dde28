"""Config tree: YAML + overrides fill it, typos and wrong types fail loudly with a hint; the paths a
config names are checked by the entry points (train.cli, eval.main), which end on bad input with one
line and exit status 2."""

import glob
import subprocess
import sys

import pytest

from config import Config, config_exit, load_config
from runs import check_paths
from test_runs import MODEL_FILES, hf_folder


def test_defaults_and_yaml(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("steps: 7\nlearner:\n  lr: 0.001\nrollout:\n  agent:\n    n_samples: 4\n")
    cfg = load_config(str(p))
    assert cfg.steps == 7 and cfg.learner.lr == 1e-3 and cfg.rollout.agent.n_samples == 4
    assert cfg.rollout.temperature == Config().rollout.temperature  # untouched defaults stay


def test_overrides_are_typed():
    cfg = load_config(
        None,
        ["learner.lr=3e-5", "rollout.temperature=1", "wandb=false", "learner.loss.clip_high=0.3"],
    )
    assert (
        cfg.learner.lr == 3e-5 and isinstance(cfg.rollout.temperature, float) and cfg.wandb is False
    )
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
    # top-k / top-p: ranges checked with the allowed values named; vLLM samples them (the learner
    # infers its sets from its log-probs on the weights that sampled, so not with async rollouts)
    cfg = load_config(None, ["rollout.engine=vllm", "rollout.top_p=0.9", "rollout.top_k=20"])
    assert (cfg.rollout.top_p, cfg.rollout.top_k) == (0.9, 20)
    assert (Config().rollout.top_p, Config().rollout.top_k) == (1.0, 0)
    for bad, message in (
        (["rollout.top_p=0"], r"rollout.top_p=0.0 must be in \(0, 1\]"),
        (["rollout.top_p=1.5"], r"rollout.top_p=1.5 must be in \(0, 1\]"),
        (["rollout.top_k=-1"], r"rollout.top_k=-1 must be >= 0 \(0: off\)"),
        (
            [
                "rollout.engine=vllm",
                "rollout.top_p=0.9",
                "rollout.async_rollouts=true",
                "learner.off_policy.kind=tis",
            ],
            "needs synchronous rollouts",
        ),
    ):
        with pytest.raises(ValueError, match=message):
            load_config(None, bad)
    with pytest.raises(TypeError, match="rollout.top_k"):
        load_config(None, ["rollout.top_k=0.5"])
    cfg = load_config(None, ["rollout.engine=vllm", "rollout.sync_max_logprob_diff=0.2"])
    assert (
        cfg.rollout.sync_max_logprob_diff == 0.2 and Config().rollout.sync_max_logprob_diff is None
    )
    with pytest.raises(
        ValueError, match=r"eval.pass_k=\[1, 5\] needs every k between 1 and eval.n_samples=4"
    ):
        load_config(None, ["eval.n_samples=4", "eval.pass_k=[1,5]"])
    with pytest.raises(ValueError, match="eval.n_samples=0 must be >= 1"):
        load_config(None, ["eval.n_samples=0", "eval.pass_k=[]"])
    with pytest.raises(TypeError, match=r"eval.pass_k\[0\]"):
        load_config(None, ["eval.pass_k=[one]"])
    cfg = load_config(None, ["eval.n_samples=10", "eval.pass_k=[1,5,10]"])
    assert (cfg.eval.n_samples, cfg.eval.pass_k) == (10, [1, 5, 10])
    # one episode per task, as always
    assert (Config().eval.n_samples, Config().eval.pass_k) == (1, [1])


def test_algo_presets_set_defaults_that_explicit_keys_override():
    cfg = load_config(None, ["algo.name=drgrpo"])
    assert cfg.algo.advantage == "drgrpo" and cfg.learner.loss.agg_mode == "seq-mean-token-sum-norm"
    cfg = load_config(None, ["algo.name=gspo", "learner.loss.agg_mode=token-mean"])
    assert cfg.learner.policy_loss == "gspo" and cfg.learner.loss.agg_mode == "token-mean"


@pytest.mark.parametrize(
    "name, policy_loss, advantage, agg_mode",
    [
        ("cispo", "cispo", "grpo", "token-mean"),
        (
            "gmpo",
            "gmpo",
            "grpo",
            "seq-mean-token-mean",
        ),  # GMPO's objective is one term per sequence
        ("reinforce_pp", "ppo", "reinforce_pp", "token-mean"),
        ("reinforce_pp_baseline", "ppo", "reinforce_pp_baseline", "token-mean"),
    ],
)
def test_frontier_presets(name, policy_loss, advantage, agg_mode):
    cfg = load_config(None, [f"algo.name={name}"])
    assert (cfg.learner.policy_loss, cfg.algo.advantage, cfg.learner.loss.agg_mode) == (
        policy_loss,
        advantage,
        agg_mode,
    )


def test_off_policy_block_is_checked_and_tis_cap_says_where_it_went():
    cfg = load_config(None, ["learner.off_policy.kind=mis", "learner.off_policy.level=sequence"])
    assert (cfg.learner.off_policy.kind, cfg.learner.off_policy.mis_low) == ("mis", 0.5)
    assert Config().learner.off_policy.kind == "none"  # default: no correction, as before
    with pytest.raises(
        KeyError,
        match=r"learner.tis_cap' was renamed: use learner.off_policy.kind=tis and "
        r"learner.off_policy.tis_cap",
    ):
        load_config(None, ["learner.tis_cap=2.0"])
    with pytest.raises(ValueError, match="did you mean 'sequence'"):
        load_config(None, ["learner.off_policy.level=sequense"])
    with pytest.raises(ValueError, match="mis_low <= 1"):
        load_config(None, ["learner.off_policy.kind=mis", "learner.off_policy.mis_low=1.5"])
    with pytest.raises(ValueError, match="tis_cap > 0"):
        load_config(None, ["learner.off_policy.kind=tis", "learner.off_policy.tis_cap=0"])


def test_turn_credit_and_distillation_are_checked(tmp_path):
    with pytest.raises(ValueError, match="did you mean 'turn'"):
        load_config(None, ["algo.credit=trun"])
    with pytest.raises(ValueError, match="algo.credit=turn"):
        # REINFORCE++ has its own token credit
        load_config(None, ["algo.credit=turn", "algo.name=reinforce_pp"])
    with pytest.raises(ValueError, match="did you mean 'state'"):
        load_config(None, ["algo.credit=turn", "algo.turn_baseline=stat"])
    with pytest.raises(ValueError, match="set algo.credit=turn"):
        load_config(None, ["algo.turn_baseline=state"])
    with pytest.raises(ValueError, match="set algo.teacher_path"):
        load_config(None, ["algo.name=distill"])
    cfg = load_config(
        None,
        ["algo.name=distill", f"algo.teacher_path={tmp_path}/nope", "rollout.agent.n_samples=1"],
    )
    assert cfg.algo.advantage == "none"  # the teacher's term alone
    with pytest.raises(ValueError, match="algo.teacher_path=.*no such folder"):
        check_paths(cfg)


def test_reinforce_pp_alone_needs_no_group():
    """REINFORCE++ whitens over the batch, so one sample per prompt is enough; its -baseline variant
    is a group mean."""
    assert (
        load_config(
            None, ["algo.name=reinforce_pp", "rollout.agent.n_samples=1"]
        ).rollout.agent.n_samples
        == 1
    )
    with pytest.raises(ValueError, match="n_samples"):
        load_config(None, ["algo.name=reinforce_pp_baseline", "rollout.agent.n_samples=1"])


def test_bad_yaml_is_one_line(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("steps: [1,\nlearner: {lr: 1\n")
    with pytest.raises(
        ValueError, match=r"is not valid YAML: expected ',' or '}', but got '<stream end>' \(line 3"
    ):
        load_config(str(p))
    p.write_text("- steps\n- 3\n")
    with pytest.raises(TypeError, match="must hold a mapping of config keys, not a list"):
        load_config(str(p))
    with pytest.raises(ValueError, match=r"override 'learner.lr=\[' is not valid YAML"):
        load_config(None, ["learner.lr=["])


def test_config_exit_is_one_line_and_status_2(capsys):
    with pytest.raises(SystemExit) as e:
        config_exit(KeyError("unknown config key 'x'\nsecond line"))
    assert e.value.code == 2 and str(e.value) == "config error: unknown config key 'x' second line"
    assert capsys.readouterr().err == "config error: unknown config key 'x' second line\n"


# -----------------------------------------------------------------------------
# the entry points: `config error: ...`, one line on stderr, exit status 2


def bad_starts(tmp_path):
    """(the entry point, its arguments, the exact line it must print) for every kind of bad path."""
    model = hf_folder(tmp_path / "model", *MODEL_FILES)
    no_tok = hf_folder(tmp_path / "no_tok", "config.json", "model.safetensors")
    return [
        ("train", ["--config", "configs/nope.yaml"], "--config 'configs/nope.yaml': no such file"),
        ("train", ["model.path=/nonexistent"], "model.path='/nonexistent': no such folder"),
        (
            "train",
            [f"model.path={no_tok}"],
            f"model.path={no_tok!r} is not a Hugging Face model folder: it has no tokenizer.json",
        ),
        (
            "train",
            [f"resume={model}"],
            f"resume={model!r} is not a checkpoint folder: it has no trainer_state.pt or "
            "checkpoint.json",
        ),
        ("train", ["resume=runs/nope"], "resume='runs/nope': no such folder"),
        (
            "train",
            ["--config", "configs/dataset.yaml", "envs.0.kwargs.path=data/nope.jsonl"],
            "envs.0.kwargs.path='data/nope.jsonl': no such file",
        ),
        (
            "train",
            ["--config", "configs/dataset.yaml", "envs.0.kwargs.test_path=data/test.jsonl"],
            "envs.0.kwargs.test_path='data/test.jsonl': no such file",
        ),
        (
            "eval",
            ["--checkpoint", "/nonexistent", "--config", "configs/toy_math.yaml"],
            "--checkpoint '/nonexistent': no such folder",
        ),
        (
            "eval",
            ["--checkpoint", no_tok, "--config", "configs/toy_math.yaml"],
            f"--checkpoint {no_tok!r} is not a Hugging Face model folder: it has no tokenizer.json",
        ),
        (
            "eval",
            ["--policy", "expert", "--config", "configs/nope.yaml"],
            "--config 'configs/nope.yaml': no such file",
        ),
        (
            "eval",
            ["--policy", "random", "eval.n_samples=4", "eval.pass_k=[1,2,8]"],
            "eval.pass_k=[1, 2, 8] needs every k between 1 and eval.n_samples=4: "
            "pass@k draws k of a task's n samples "
            "(e.g. eval.n_samples=10 eval.pass_k=[1,5,10])",
        ),
        (
            "eval",
            [
                "--policy",
                "expert",
                "--config",
                "configs/dataset.yaml",
                "envs.0.kwargs.path=nope.jsonl",
            ],
            "envs.0.kwargs.path='nope.jsonl': no such file",
        ),
    ]


def test_entry_points_end_bad_starts_with_one_line(tmp_path, capsys):
    import eval as eval_py
    import train

    entry = {"train": train.cli, "eval": eval_py.main}
    for name, argv, line in bad_starts(tmp_path):
        with pytest.raises(SystemExit) as e:
            entry[name](argv)
        assert e.value.code == 2 and str(e.value) == "config error: " + line, (name, argv)
        assert capsys.readouterr().err == "config error: " + line + "\n"


@pytest.mark.parametrize(
    "script, argv",
    [
        ("train.py", ["--config", "configs/nope.yaml"]),
        ("train.py", ["model.path=/nonexistent"]),
        ("eval.py", ["--checkpoint", "/nonexistent"]),
    ],
)
@pytest.mark.slow
def test_entry_points_as_programs(script, argv):
    """What a person sees: exactly one line on stderr, nothing on stdout, exit status 2."""
    run = subprocess.run(
        [sys.executable, script, *argv], capture_output=True, text=True, timeout=120
    )
    expected = {
        "--config": "--config 'configs/nope.yaml': no such file",
        "model.path=/nonexistent": "model.path='/nonexistent': no such folder",
        "--checkpoint": "--checkpoint '/nonexistent': no such folder",
    }[argv[0]]
    assert (run.returncode, run.stdout, run.stderr) == (2, "", "config error: " + expected + "\n")


def test_bounded_staleness_and_partial_rollouts_are_checked():
    # today's async
    assert (Config().rollout.max_staleness, Config().rollout.partial_rollouts) == (1, False)
    on = ["rollout.async_rollouts=true", "learner.off_policy.kind=tis"]
    cfg = load_config(None, [*on, "rollout.max_staleness=3", "rollout.partial_rollouts=true"])
    assert (cfg.rollout.max_staleness, cfg.rollout.partial_rollouts) == (3, True)
    with pytest.raises(ValueError, match="max_staleness=0 must be >= 1"):
        load_config(None, [*on, "rollout.max_staleness=0"])
    with pytest.raises(ValueError, match="set rollout.async_rollouts=true"):
        load_config(None, ["rollout.max_staleness=2"])
    with pytest.raises(TypeError):
        load_config(None, [*on, "rollout.max_staleness=two"])
    for extra in (
        ["rollout.partial_rollouts=true"],  # no async
        # weights swapped by us only
        [*on, "rollout.partial_rollouts=true", "rollout.engine=vllm"],
        # ... in this process
        [*on, "rollout.partial_rollouts=true", "ray.rollout_workers=1"],
    ):
        with pytest.raises(
            ValueError, match="partial_rollouts swaps weights into a generation in flight"
        ):
            load_config(None, extra)
    with pytest.raises(KeyError, match="did you mean 'rollout.max_staleness'"):
        load_config(None, [*on, "rollout.max_stalenes=2"])


def test_knobs_that_would_do_nothing_here_are_refused():
    """Found by tests/test_knobs.py: a knob set where it cannot act is refused at load, naming it,
    not ignored (or, for overlong_cache past the budget, a crash at step 1)."""
    with pytest.raises(
        ValueError, match="algo.overlong_cache=600 must be >= 0 and at most rollout.agent"
    ):
        load_config(None, ["algo.overlong_cache=600", "rollout.agent.max_total_tokens=512"])
    # the whole budget: allowed
    assert load_config(None, ["algo.overlong_cache=512"]).algo.overlong_cache == 512
    with pytest.raises(
        ValueError, match="rollout.agent.enable_thinking applies to rollout.agent.chat_format=qwen3"
    ):
        load_config(None, ["rollout.agent.enable_thinking=false"])
    assert load_config(
        None, ["rollout.agent.enable_thinking=false", "rollout.agent.chat_format=qwen3"]
    )
    with pytest.raises(
        ValueError, match="algo.truncation_penalty applies to algo.truncation=penalize"
    ):
        load_config(None, ["algo.truncation_penalty=0.5"])
    assert (
        load_config(
            None, ["algo.truncation=penalize", "algo.truncation_penalty=0.5"]
        ).algo.truncation_penalty
        == 0.5
    )
    with pytest.raises(
        ValueError, match=r"algo.truncation='drop' is not one of \['keep', 'mask', 'penalize'\]"
    ):
        load_config(None, ["algo.truncation=drop"])
    with pytest.raises(ValueError, match="rollout.agent.max_episode_tokens=-1 must be >= 0"):
        load_config(None, ["rollout.agent.max_episode_tokens=-1"])
    with pytest.raises(ValueError, match="ray.max_in_flight bounds"):
        load_config(None, ["ray.rollout_workers=1", "ray.max_in_flight=2"])
    assert load_config(
        None, ["ray.rollout_workers=1", "ray.max_in_flight=2", "ray.dispatcher=async_batch_bounded"]
    )
