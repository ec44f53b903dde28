"""Tests for eval.py and the env extension points it relies on: scripted expert/random policies, env
metrics averaged per env, the training-only judge hook, pass@k (the estimator against the closed
form and brute force, n samples per task with their own seeds), tasks as JSON lines, lazy env entry
points.

The loop is driven by test_agent's scripted engine and tiny `calc` env, so every reward is known."""

import itertools
import math
from dataclasses import dataclass
from fractions import Fraction

import pytest

from agent import AgentConfig, LocalRollouts, run_episodes
import env as env_module
from env import make_env, mix_seed
from envs.worlds import read_tasks, write_tasks
from eval import (
    episode_success,
    evaluate,
    expert_actions,
    pass_at_k,
    pass_metrics,
    play_scripted,
    scripted_metrics,
)
from test_agent import CalcEnv, CalcState, ScriptedEngine, calc_task, call_text, tok  # noqa: F401 (tok: a fixture)
from rollout import SamplingParams


class JudgedCalcEnv(CalcEnv):
    """CalcEnv with a judge that would add a full point to every finished episode, and counts its
    calls."""

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
    return {
        t.prompt: [call_text(1, 2), f"ANSWER: {int(t.answer) + (1 if t.prompt in wrong else 0)}"]
        for t in tasks
    }


def test_judge_only_in_training_rollouts(tok):
    tasks = [calc_task(0, 2, 3), calc_task(1, 4, 5)]
    engine = ScriptedEngine(tok, script_for(tasks, wrong={tasks[1].prompt}))
    cfg, params = (
        AgentConfig(n_samples=2, max_turns=3, max_total_tokens=1024),
        SamplingParams(max_tokens=64),
    )
    judged = JudgedCalcEnv()

    # training rollouts with a judge weight: reward + 0.5 * 1.0 on every finished episode
    trajs = run_episodes(
        engine, {"calc": judged}, tasks, tok, cfg, params, seed=0, judge_weight=0.5
    )
    assert [t.reward for t in trajs] == [1.5, 1.5, 0.5, 0.5]
    assert all(t.info["judge"] == 1.0 for t in trajs) and judged.judge_calls == 4
    # weight 0 (the default): the judge is not even called
    trajs = run_episodes(engine, {"calc": judged}, tasks, tok, cfg, params, seed=0)
    assert [t.reward for t in trajs] == [1.0, 1.0, 0.0, 0.0] and judged.judge_calls == 4

    # evaluation: the same metrics with and without a judge, and the judge is never asked
    with_judge, _ = evaluate(
        LocalRollouts(engine, {"calc": judged}, tok, cfg), {"calc": tasks}, cfg, params, seed=0
    )
    without, _ = evaluate(
        LocalRollouts(engine, {"calc": CalcEnv()}, tok, cfg), {"calc": tasks}, cfg, params, seed=0
    )
    assert with_judge == without and with_judge["eval/accuracy"] == 0.5 and judged.judge_calls == 4


def test_env_metrics_are_averaged_per_env(tok):
    tasks = [calc_task(i, i, 1) for i in range(4)]
    engine = ScriptedEngine(tok, script_for(tasks, wrong={tasks[0].prompt}))
    cfg = AgentConfig(n_samples=1, max_turns=3, max_total_tokens=1024)
    m, _ = evaluate(
        LocalRollouts(engine, {"calc": MeteredCalcEnv()}, tok, cfg),
        {"calc": tasks},
        cfg,
        SamplingParams(max_tokens=64),
        0,
    )
    assert m["eval/calc/accuracy"] == 0.75
    assert m["eval/calc/pass_fraction"] == pytest.approx((0.75 + 3 * 0.25) / 4)


def test_scripted_policies_on_toy_math():
    env = make_env("toy_math")
    tasks = env.sample_tasks("test", 64, seed=3)
    expert = play_scripted(env, tasks, "expert", seed=0, max_turns=4)
    assert all(
        e["reward"] == 1.0 and e["done"] and e["turns"] == 2 and e["tool_calls"] == 1
        for e in expert
    )
    rand = scripted_metrics(
        play_scripted(env, tasks, "random", seed=0, max_turns=4), "random/toy_math"
    )
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
            env_module.TOOLS[action.tool_calls[0].name].parameters["required"]
        )


def test_tasks_round_trip_as_json_lines(tmp_path):
    tasks = make_env("toy_math").sample_tasks("train", 20, seed=5)
    path = tmp_path / "tasks.jsonl"
    write_tasks(tasks, str(path))
    assert read_tasks(str(path)) == tasks
    write_tasks(
        make_env("toy_math").sample_tasks("train", 20, seed=5), str(tmp_path / "again.jsonl")
    )
    # deterministic from the seed
    assert (tmp_path / "again.jsonl").read_bytes() == path.read_bytes()


def test_entry_point_errors_are_clear(monkeypatch):
    monkeypatch.setitem(env_module.ENTRY_POINTS, "nowhere_env", "no_such_module_xyz")
    with pytest.raises(ValueError, match="no_such_module_xyz.py"):
        make_env("nowhere_env")
    with pytest.raises(ValueError, match="available: .*toy_math"):
        make_env("toy_mth")


# -----------------------------------------------------------------------------
# pass@k


def closed_form(n, c, k):
    """Chen et al. 2021, eq. 1, with exact integers: 1 - C(n - c, k) / C(n, k) (math.comb is 0 when
    n - c < k)."""
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def brute_force(n, c, k):
    """The fraction of the k-subsets of n samples (the first c correct) that hold at least one
    correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


def test_pass_at_k_against_the_closed_form_and_brute_force():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = brute_force(n, c, k)
                assert closed_form(n, c, k) == exact, (n, c, k)
                # the product has at most n factors, each rounded once: a few ulps of 1.0 at most
                assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=0, abs=1e-12), (
                    n,
                    c,
                    k,
                )
    # far beyond what the binomials survive in floats (C(1000, 500) ~ 1e299), the product still
    # agrees
    for n, c, k in [(1000, 10, 100), (1000, 1, 500), (200, 37, 10), (5000, 2, 2500)]:
        assert pass_at_k(n, c, k) == pytest.approx(float(closed_form(n, c, k)), rel=1e-9)


def test_pass_at_k_edge_cases():
    # nothing correct: never passes
    assert pass_at_k(10, 0, 1) == 0.0 and pass_at_k(10, 0, 10) == 0.0
    assert pass_at_k(10, 10, 1) == 1.0 and pass_at_k(10, 10, 10) == 1.0  # everything correct
    # n - c < k: every k-subset has one
    assert pass_at_k(10, 3, 8) == 1.0 and pass_at_k(10, 1, 10) == 1.0
    # n - c == k: one subset misses
    assert pass_at_k(10, 3, 7) == pytest.approx(1 - 1 / math.comb(10, 7))
    assert pass_at_k(7, 3, 1) == pytest.approx(3 / 7)  # pass@1 is the success rate
    for n, c, k in [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError, match="pass@k"):
            pass_at_k(n, c, k)


def test_pass_metrics_average_over_tasks_and_success_rule():
    outcomes = [[True, False, False, False], [False] * 4, [True] * 4]
    m = pass_metrics(outcomes, (1, 2, 4))
    assert m["pass@1"] == pytest.approx((1 / 4 + 0 + 1) / 3)
    assert m["pass@2"] == pytest.approx((float(closed_form(4, 1, 2)) + 0 + 1) / 3)
    assert m["pass@4"] == pytest.approx(2 / 3)
    # success: the env's "success" metric where it reports one (a partial reward is not a success),
    # else reward >= 1
    assert not episode_success(0.75, {"success": 0.0}) and episode_success(1.0, {"success": 1.0})
    assert not episode_success(1.0, {"success": 0.0})
    assert (
        episode_success(1.0, {})
        and episode_success(1.1, {"correct": 1.0})
        and not episode_success(0.1, {})
    )


@dataclass(frozen=True)
class SeededState(CalcState):
    seed: int = 0


class SeededCalcEnv(CalcEnv):
    """CalcEnv whose right answer only scores when the episode's reset seed is not a multiple of 3:
    the n samples of one task then differ, and which of them succeed is known from mix_seed
    alone."""

    def reset(self, task, seed):
        state, msgs = super().reset(task, seed)
        return SeededState(state.task, seed=seed), msgs

    def step(self, state, action):
        state, obs, reward, done, info = super().step(state, action)
        return state, obs, reward * (state.seed % 3 != 0), done, info


def test_evaluate_plays_n_samples_per_task_with_their_own_seeds(tok):
    tasks = [calc_task(i, i, 2) for i in range(6)]
    engine = ScriptedEngine(tok, script_for(tasks, wrong={tasks[5].prompt}))
    cfg, params, n = (
        AgentConfig(n_samples=8, max_turns=3, max_total_tokens=1024),
        SamplingParams(max_tokens=64),
        5,
    )
    rollouts = LocalRollouts(engine, {"calc": SeededCalcEnv()}, tok, cfg)
    m, trajs = evaluate(
        rollouts, {"calc": tasks}, cfg, params, seed=7, n_samples=n, pass_k=(1, 2, 5)
    )
    # group-major
    assert [(t.group, t.sample) for t in trajs] == [(g, s) for g in range(6) for s in range(n)]
    # sample s of task g was reset with mix_seed(seed, g, s): its reward says which
    wins = [[g != 5 and mix_seed(7, g, s) % 3 != 0 for s in range(n)] for g in range(6)]
    assert [t.reward == 1.0 for t in trajs] == [w for row in wins for w in row]
    assert 0 < sum(map(sum, wins)) < 5 * n  # the seeds do split the samples
    for k in (1, 2, 5):
        expected = sum(float(closed_form(n, sum(row), k)) for row in wins) / 6
        assert (
            m[f"eval/calc/pass@{k}"] == pytest.approx(expected)
            and m[f"eval/pass@{k}"] == m[f"eval/calc/pass@{k}"]
        )
    assert (
        m["eval/calc/mean@5"] == pytest.approx(sum(map(sum, wins)) / 30) == m["eval/calc/accuracy"]
    )
    assert m["eval/calc/pass@1"] <= m["eval/calc/pass@2"] <= m["eval/calc/pass@5"]
    # n_samples=1 (the default) plays the episodes one per task always played: sample 0, seeded
    # mix_seed(seed, g, 0)
    one, trajs1 = evaluate(rollouts, {"calc": tasks}, cfg, params, seed=7)
    assert [t.token_ids for t in trajs1] == [t.token_ids for t in trajs if t.sample == 0]
    assert one["eval/calc/pass@1"] == one["eval/calc/accuracy"] == one["eval/calc/mean@1"]


def test_scripted_policies_play_n_samples():
    env = make_env("toy_math")
    tasks = env.sample_tasks("test", 16, seed=3)
    rand = play_scripted(env, tasks, "random", seed=0, max_turns=4, n_samples=4)
    assert [(e["group"], e["sample"]) for e in rand] == [
        (g, s) for g in range(16) for s in range(4)
    ]
    assert [e for e in rand if e["sample"] == 0] == play_scripted(
        env, tasks, "random", seed=0, max_turns=4
    )
    m = scripted_metrics(rand, "random/toy_math", 4, (1, 4))
    # toy_math's reward is 0/1
    assert m["random/toy_math/pass@1"] == pytest.approx(m["random/toy_math/mean@4"])
    assert m["random/toy_math/pass@1"] <= m["random/toy_math/pass@4"]
    expert = scripted_metrics(
        play_scripted(env, tasks, "expert", seed=0, max_turns=4, n_samples=3), "e", 3, (1, 3)
    )
    assert expert["e/pass@1"] == expert["e/pass@3"] == expert["e/mean@3"] == 1.0
