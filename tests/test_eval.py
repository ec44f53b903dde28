"""Tests for eval.py and the env extension points it relies on: scripted expert/random policies, env
metrics averaged per env, the training-only judge hook, tasks as JSON lines, lazy env entry points.

The loop is driven by test_agent's scripted engine and tiny `calc` env, so every reward is known."""

import pytest

import env as env_module
from agent import AgentConfig, LocalRollouts, run_episodes
from rollout import SamplingParams
from env import make_env, read_tasks, write_tasks
from eval import evaluate, expert_actions, play_scripted, scripted_metrics
from test_agent import CalcEnv, ScriptedEngine, calc_task, call_text, tok  # noqa: F401 (tok is a fixture)


class JudgedCalcEnv(CalcEnv):
    """CalcEnv with a judge that would add a full point to every finished episode, and counts its calls."""
    name = "calc"

    def __init__(self):
        self.judge_calls = 0

    def judge(self, task, messages):
        self.judge_calls += 1
        return 1.0


class MeteredCalcEnv(CalcEnv):
    """CalcEnv that reports an env metric on the final step, as env_code's pass_fraction does."""
    def step(self, state, action):
        state, obs, reward, done, info = super().step(state, action)
        if done:
            info = {**info, "metrics": {"pass_fraction": 0.25 if reward else 0.75}}
        return state, obs, reward, done, info


def script_for(tasks, wrong=()):
    """Right answers for every task, wrong ones for the prompts in `wrong`."""
    return {t.prompt: [call_text(1, 2), f"ANSWER: {int(t.answer) + (1 if t.prompt in wrong else 0)}"] for t in tasks}


def test_judge_only_in_training_rollouts(tok):
    tasks = [calc_task(0, 2, 3), calc_task(1, 4, 5)]
    engine = ScriptedEngine(tok, script_for(tasks, wrong={tasks[1].prompt}))
    cfg, params = AgentConfig(n_samples=2, max_turns=3, max_total_tokens=1024), SamplingParams(max_tokens=64)
    judged = JudgedCalcEnv()

    # training rollouts with a judge weight: reward + 0.5 * 1.0 on every finished episode
    trajs = run_episodes(engine, {"calc": judged}, tasks, tok, cfg, params, seed=0, judge_weight=0.5)
    assert [t.reward for t in trajs] == [1.5, 1.5, 0.5, 0.5]
    assert all(t.info["judge"] == 1.0 for t in trajs) and judged.judge_calls == 4
    # weight 0 (the default): the judge is not even called
    trajs = run_episodes(engine, {"calc": judged}, tasks, tok, cfg, params, seed=0)
    assert [t.reward for t in trajs] == [1.0, 1.0, 0.0, 0.0] and judged.judge_calls == 4

    # evaluation: the same metrics with and without a judge, and the judge is never asked
    with_judge, _ = evaluate(LocalRollouts(engine, {"calc": judged}, tok, cfg), {"calc": tasks}, cfg, params, seed=0)
    without, _ = evaluate(LocalRollouts(engine, {"calc": CalcEnv()}, tok, cfg), {"calc": tasks}, cfg, params, seed=0)
    assert with_judge == without and with_judge["eval/accuracy"] == 0.5 and judged.judge_calls == 4


def test_env_metrics_are_averaged_per_env(tok):
    tasks = [calc_task(i, i, 1) for i in range(4)]
    engine = ScriptedEngine(tok, script_for(tasks, wrong={tasks[0].prompt}))
    cfg = AgentConfig(n_samples=1, max_turns=3, max_total_tokens=1024)
    m, _ = evaluate(LocalRollouts(engine, {"calc": MeteredCalcEnv()}, tok, cfg), {"calc": tasks}, cfg,
                    SamplingParams(max_tokens=64), 0)
    assert m["eval/calc/accuracy"] == 0.75
    assert m["eval/calc/pass_fraction"] == pytest.approx((0.75 + 3 * 0.25) / 4)


def test_scripted_policies_on_toy_math():
    env = make_env("toy_math")
    tasks = env.sample_tasks("test", 64, seed=3)
    expert = play_scripted(env, tasks, "expert", seed=0, max_turns=4)
    assert all(e["reward"] == 1.0 and e["done"] and e["turns"] == 2 and e["tool_calls"] == 1 for e in expert)
    rand = scripted_metrics(play_scripted(env, tasks, "random", seed=0, max_turns=4), "random/toy_math")
    assert rand["random/toy_math/accuracy"] < 0.2 and rand["random/toy_math/mean_turns"] > 1.0
    # a turn limit shorter than the expert's path leaves the episode unfinished, with reward 0
    cut = play_scripted(env, tasks[:4], "expert", seed=0, max_turns=1)
    assert all(e["reward"] == 0.0 and not e["done"] and e["turns"] == 1 for e in cut)
    with pytest.raises(ValueError, match="policy"):
        play_scripted(env, tasks, "oracle", seed=0, max_turns=4)


def test_expert_actions_replay_the_demonstration():
    env = make_env("toy_math")
    task = env.sample_tasks("train", 1, seed=0)[0]
    actions = expert_actions(env, task, seed=0)
    assert [a.tool_calls[0].name for a in actions] == ["python_eval", "finish"]
    assert actions[1].tool_calls[0].arguments == {"answer": task.answer}


def test_random_action_is_a_valid_call_of_the_env():
    env = make_env("toy_math")
    state, _ = env.reset(env.sample_tasks("test", 1, seed=0)[0], seed=0)
    import random
    rng = random.Random(0)
    for _ in range(20):
        action = env.random_action(state, rng)
        assert len(action.tool_calls) == 1 and action.tool_calls[0].name in env.tool_names
        assert set(action.tool_calls[0].arguments) == set(
            env_module.TOOLS[action.tool_calls[0].name].parameters["required"])


def test_tasks_round_trip_as_json_lines(tmp_path):
    tasks = make_env("toy_math").sample_tasks("train", 20, seed=5)
    path = tmp_path / "tasks.jsonl"
    write_tasks(tasks, str(path))
    assert read_tasks(str(path)) == tasks
    write_tasks(make_env("toy_math").sample_tasks("train", 20, seed=5), str(tmp_path / "again.jsonl"))
    assert (tmp_path / "again.jsonl").read_bytes() == path.read_bytes()     # deterministic from the seed


def test_entry_point_errors_are_clear(monkeypatch):
    monkeypatch.setitem(env_module.ENTRY_POINTS, "nowhere_env", "no_such_module_xyz")
    with pytest.raises(ValueError, match="no_such_module_xyz.py"):
        make_env("nowhere_env")
    with pytest.raises(ValueError, match="available: .*toy_math"):
        make_env("toy_mth")
