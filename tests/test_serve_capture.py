"""Tests for capture.py: what a messy client's session records, and the rows it trains as (through
external_agent.ExternalRollouts, the trainer's own rollout source).

Each case asserts the record and the trained rows: a retried request (the orphan dropped and
counted, whether its answer was recorded or its client left first), a side call that is not the
conversation (its own row), two tool calls in one reply, n > 1 with the client going on from one
choice, a weight push between two requests of a session (each token keeps the version that sampled
it), a reply whose tool-call JSON is malformed; and the bookkeeping: serving order, sessions that
expire. Oracle: our agent loop (a client's conversation is the trajectory agent.run_episodes builds
for it, token for token) and the engine's own ids.
"""

import copy
import threading

import pytest

from agent import AgentConfig
from chat import encode, render
from conftest import need
from env import mix_seed
from rollout import SamplingParams, TorchEngine
from wings.capture import Call, Capture, Sample, session_trajectories
from wings.serve import Server
from test_agent import CalcEnv, ScriptedEngine, calc_task, three_turn_script, tok  # noqa: F401 (a fixture)
from test_external_agent import rollouts_for
from test_openai_engine import tiny_model
from test_serve import agent_trajectory, assert_same_tokens, post, tool_results
from test_serve_dialects import blocked, until

MODEL = "tiny"


def scripted_rollouts(tok, tasks, agent, script_of=three_turn_script):
    script = {
        t.prompt: script_of(int(t.prompt.split()[1]), int(t.prompt.split()[3][:-1])) for t in tasks
    }
    return rollouts_for(
        agent,
        ScriptedEngine(tok, script),
        tok,
        {"calc": CalcEnv()},
        "rollout.agent.max_total_tokens=4096",
    )


def play_one(rollouts, task, seed=0):
    """One episode of `task` through the rollouts -> (its trajectory, the step's metrics)."""
    try:
        (traj,), metrics = rollouts.play(
            [task],
            SamplingParams(temperature=0.0, max_tokens=300),
            seed=seed,
            agent=AgentConfig(n_samples=1),
        )
    finally:
        rollouts.shutdown()
    return traj, metrics


def ask(base_url, session, messages, **extra) -> dict:
    body = {
        "model": "policy",
        "messages": messages,
        "tools": CalcEnv.TOOLS,
        "user": session,
        **extra,
    }
    status, reply = post(base_url, "/chat/completions", body)
    assert status == 200, reply
    return reply["choices"][0]["message"]


def converse(base_url, session, messages, before_each=lambda turn, msgs: None) -> list[dict]:
    """The calc client: ask, run the tools, send the results back, until a reply has no tool
    call."""
    for turn in range(4):
        before_each(turn, messages)
        message = ask(base_url, session, messages)
        messages = messages + [message] + tool_results(message)
        if not message.get("tool_calls"):
            break
    return messages


# -----------------------------------------------------------------------------
# retries


def test_a_resent_request_trains_once_and_the_orphan_is_counted(tok):
    """The client got no answer in time (it did arrive, and was recorded) and sent the same request
    again, then went on from the second answer: one continuation is trained, the first call dropped
    as an orphan."""
    task = calc_task(0, 2, 3)

    def agent(t, base_url, session):
        _, messages = CalcEnv().reset(task, 0)
        ask(base_url, session, messages)  # its answer is lost on the way: the client resends
        converse(base_url, session, messages)
        return 1.0

    rollouts = scripted_rollouts(tok, [task], agent)
    traj, metrics = play_one(rollouts, task)
    assert (
        metrics["rollout/external_orphans"] == 1.0 and metrics["rollout/external_branched"] == 0.0
    )
    assert_same_tokens(traj, agent_trajectory(tok, task))  # the resend's chain, once
    assert traj.rows == [] and traj.num_turns == 3


def test_a_timed_out_request_is_not_recorded_and_its_resend_is_trained(tok):
    """The client timed out while the engine was busy and resent: the server saw it leave, cancelled
    its call and recorded nothing of it; the resend is the session's first call."""
    openai = need("openai", "a client that times out as the official one does")
    task = calc_task(0, 2, 3)
    state = {}

    def agent(t, base_url, session):
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        _, messages = CalcEnv().reset(task, 0)
        release = blocked(rollouts.server)  # the engine is busy ...
        with pytest.raises(openai.APITimeoutError):
            client.chat.completions.create(
                model="m", messages=messages, tools=CalcEnv.TOOLS, user=session, timeout=0.5
            )
        until(lambda: rollouts.server.capture.disconnected == 1, "the server saw the client leave")
        release.set()  # ... until the client has given up
        state["calls"] = len(rollouts.server.engine.calls)
        converse(base_url, session, messages)
        return 1.0

    rollouts = scripted_rollouts(tok, [task], agent)
    traj, metrics = play_one(rollouts, task)
    assert (
        metrics["rollout/external_disconnects"] == 1.0
        and metrics["rollout/external_orphans"] == 0.0
    )
    assert state["calls"] == 0  # the engine never sampled the abandoned call
    assert_same_tokens(traj, agent_trajectory(tok, task))


# -----------------------------------------------------------------------------
# what a session holds besides its conversation


def test_a_side_call_trains_as_a_row_of_its_own(tok):
    """Between two turns the client asks for a title (another prompt, nothing continues it): the
    conversation is one row, token for token our agent loop's, and the title its own row (its
    prompt, mask 0; its reply, mask 1), both with the episode's reward."""
    task = calc_task(0, 2, 3)
    title = [{"role": "user", "content": f"Write a short title for: {task.prompt}"}]

    def agent(t, base_url, session):
        _, messages = CalcEnv().reset(task, 0)
        converse(
            base_url,
            session,
            messages,
            before_each=lambda turn, msgs: (
                turn == 1 and ask(base_url, session, title, max_tokens=20)
            ),
        )
        return 1.0

    rollouts = scripted_rollouts(tok, [task], agent)
    traj, metrics = play_one(rollouts, task)
    assert (
        metrics["rollout/external_branched"] == 1.0 and metrics["rollout/external_orphans"] == 0.0
    )
    side, conversation = traj.rows
    assert_same_tokens(conversation, agent_trajectory(tok, task))
    prompt = encode(tok, render(title, CalcEnv.TOOLS, add_generation_prompt=True))
    assert (
        side.token_ids[: side.prompt_len] == prompt
        and side.loss_mask == [0] * len(prompt) + [1] * 20
    )
    assert traj.reward == 1.0 and traj.num_turns == 4  # three turns and the title


def test_two_tool_calls_in_one_reply(tok):
    task = calc_task(0, 7, 8)
    server = Server(
        ScriptedEngine(tok, {task.prompt: three_turn_script(7, 8)}), tok, MODEL, max_model_len=4096
    )
    server.start()
    try:
        _, messages = CalcEnv().reset(task, 0)
        messages = converse(server.url, "two", messages)
        first, second, _ = server.capture.calls("two")
        assert first.samples[0].tool_calls == 2 and len(first.samples[0].message["tool_calls"]) == 2
        assert second.parent_call == 0 and second.parent == 0
        observation = tok.decode(
            second.prompt_ids[len(first.prompt_ids) + len(first.samples[0].token_ids) :],
            skip_special_tokens=False,
        )
        # both results, one user turn
        assert observation.count("<tool_response>") == 2 and "15" in observation
        (row,), _ = session_trajectories(server.capture.calls("two"), "two")
        assert row.num_tool_calls == 3 and row.num_turns == 3
        assert_same_tokens(row, agent_trajectory(tok, task))
    finally:
        server.stop()


def test_n_samples_and_the_client_goes_on_from_one_choice(tok):
    """n = 3, and the client continues choice 2 (token ids, through /v1/completions): the trained
    row holds choice 2, the other two are unused samples, and the episode is not a multi-sample
    failure (its last call has n = 1)."""
    engine = TorchEngine(tiny_model(tok.get_vocab_size(), 0).eval(), 0)
    observation = encode(
        tok, "<|im_end|>\n<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n"
    )
    chosen = {}

    def complete(base_url, session, prompt, n):
        status, reply = post(
            base_url,
            "/completions",
            {"model": "m", "prompt": prompt, "n": n, "user": session, "return_token_ids": True},
        )
        assert status == 200, reply
        return [c["token_ids"] for c in reply["choices"]]

    def agent(t, base_url, session):
        prompt = encode(
            tok, render([{"role": "user", "content": t["prompt"]}], add_generation_prompt=True)
        )
        choices = complete(base_url, session, prompt, 3)
        chosen["ids"], chosen["prompt"] = choices[2], prompt
        chosen["last"] = complete(base_url, session, prompt + choices[2] + observation, 1)[0]
        return 1.0

    rollouts = rollouts_for(agent, engine, tok, {"calc": CalcEnv()})
    try:
        (traj,), metrics = rollouts.play(
            [calc_task(0, 1, 2)],
            SamplingParams(temperature=1.0, max_tokens=12),
            seed=0,
            agent=AgentConfig(n_samples=1),
        )
    finally:
        rollouts.shutdown()
    assert metrics["rollout/external_multi_sample"] == 0.0 and traj.rows == []
    P, k = len(chosen["prompt"]), len(chosen["ids"])
    assert traj.token_ids == chosen["prompt"] + chosen["ids"] + observation + chosen["last"]
    assert traj.loss_mask == [0] * P + [1] * k + [0] * len(observation) + [1] * len(chosen["last"])


def test_a_push_between_two_requests_keeps_each_tokens_version(tok):
    """The trainer pushes new weights between the session's two requests: the first turn's tokens
    carry version 0, the second's version 1 (context: -1), and the second turn is the new weights'
    own sample."""
    model = tiny_model(tok.get_vocab_size(), 0).eval()
    new = {k: v + 0.01 for k, v in model.state_dict().items()}
    engine = TorchEngine(copy.deepcopy(model), 0)
    observation = encode(
        tok, "<|im_end|>\n<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n"
    )
    seen = {}

    def agent(t, base_url, session):
        prompt = encode(
            tok, render([{"role": "user", "content": t["prompt"]}], add_generation_prompt=True)
        )
        first = post(
            base_url,
            "/completions",
            {"model": "m", "prompt": prompt, "user": session, "return_token_ids": True},
        )[1]["choices"][0]["token_ids"]
        rollouts.update_weights(new)  # the learner's push, mid-session
        seen["prompt"] = prompt + first + observation
        post(base_url, "/completions", {"model": "m", "prompt": seen["prompt"], "user": session})
        return 1.0

    rollouts = rollouts_for(agent, engine, tok, {"calc": CalcEnv()})
    try:
        (traj,), _ = rollouts.play(
            [calc_task(0, 1, 2)],
            SamplingParams(temperature=1.0, max_tokens=12),
            seed=0,
            agent=AgentConfig(n_samples=1),
        )
    finally:
        rollouts.shutdown()
    first, second = traj.turn_starts
    assert second == len(seen["prompt"])
    assert [v for v, m in zip(traj.versions[:second], traj.loss_mask) if m] == [0] * (
        second - first - len(observation)
    )
    assert traj.versions[second:] == [1] * (len(traj.token_ids) - second)
    assert {v for v, m in zip(traj.versions, traj.loss_mask) if not m} == {-1}
    updated = copy.deepcopy(model)
    updated.load_state_dict(new)
    direct = TorchEngine(updated, 0).generate(
        [seen["prompt"]],
        SamplingParams(
            # the session's second request
            temperature=1.0,
            max_tokens=12,
            seed=mix_seed(mix_seed(0, 0, 0), 1),
        ),
    )[0]
    assert traj.token_ids[second:] == direct.token_ids and traj.logprobs[second:] == direct.logprobs


def test_a_malformed_tool_call_is_trained_as_sampled(tok):
    """The reply's tool-call JSON is malformed: it comes back as text, the client sends it back and
    goes on, and the session stays one row whose first turn is exactly the sampled ids, its parse
    failure counted."""
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2,}}\n</tool_call>'
    task = calc_task(0, 1, 2)

    def agent(t, base_url, session):
        _, messages = CalcEnv().reset(task, 0)
        reply = ask(base_url, session, messages)
        assert reply == {"role": "assistant", "content": bad}
        ask(
            base_url,
            session,
            messages + [reply, {"role": "user", "content": "That call was malformed."}],
        )
        return 0.0

    rollouts = scripted_rollouts(tok, [task], agent, lambda a, b: [bad, "ANSWER: 3"])
    traj, metrics = play_one(rollouts, task)
    assert metrics["rollout/external_branched"] == 0.0 and traj.rows == []
    assert traj.parse_failures == 1 and traj.num_tool_calls == 0 and traj.num_turns == 2
    first = traj.turn_starts[0]
    sampled = encode(tok, bad + "<|im_end|>")
    assert traj.token_ids[first : first + len(sampled)] == sampled
    assert traj.loss_mask[first : first + len(sampled)] == [1] * len(sampled)


# -----------------------------------------------------------------------------
# bookkeeping


def test_calls_are_recorded_in_serving_order(tok):
    """Two requests of one session in flight together: the longer one, served first, is recorded
    first even though the shorter finishes first."""
    server = Server(
        TorchEngine(tiny_model(tok.get_vocab_size(), 0).eval(), 0), tok, MODEL, max_model_len=600
    )
    server.start()
    try:
        release = blocked(server)
        done = []

        def send(prompt, n_tokens):
            post(
                server.url,
                "/completions",
                {"model": MODEL, "prompt": prompt, "max_tokens": n_tokens, "seed": 1, "user": "o"},
            )
            done.append(prompt[0])

        first = threading.Thread(target=send, args=([5, 9, 3], 30))
        first.start()
        until(
            lambda: "o" in server.capture.sessions, "the first request reached the engine's queue"
        )
        second = threading.Thread(target=send, args=([6, 9, 3], 2))
        second.start()
        until(lambda: len(server.capture.sessions["o"].calls) == 2, "the second too")
        release.set()
        first.join(), second.join()
        assert done == [6, 5]  # the short one finished first ...
        # ... and is recorded second
        assert [c.prompt_ids[0] for c in server.capture.calls("o")] == [5, 6]
    finally:
        server.stop()


def test_sessions_expire_after_their_idle_time():
    now = [0.0]
    capture = Capture(ttl_s=10.0, clock=lambda: now[0])
    call = Call("chat", [1, 2], [Sample([3], [-0.1], [], [0], "stop")])
    capture.record(capture.reserve("old"), call)
    now[0] = 8.0
    capture.record(capture.reserve("recent"), call)
    now[0] = 15.0
    capture.reserve("new")
    assert capture.calls("old") == [] and len(capture.calls("recent")) == 1 and capture.expired == 1
    now[0] = 30.0
    capture.reserve("newer")
    # "recent" and "new" (reserved, never filled)
    assert capture.calls("recent") == [] and capture.expired == 3


def test_an_abandoned_call_leaves_its_place_empty_even_once_filled():
    """A stream is recorded just before its last event; when that event cannot be written, serve.py
    abandons the
    call: its place is emptied again and the disconnect counted, so the session holds only the calls
    answered."""
    capture = Capture()
    call = Call("chat", [1, 2], [Sample([3], [-0.1], [], [0], "stop")])
    capture.record(capture.reserve("s"), call)
    filled = capture.reserve("s")
    capture.record(filled, Call("chat", [1, 2, 3, 4], [Sample([5], [-0.2], [], [0], "stop")]))
    capture.abandon(filled)
    assert [c.prompt_ids for c in capture.calls("s")] == [[1, 2]] and capture.disconnected == 1
    # the engine failed: not counted as a disconnect
    capture.abandon(capture.reserve("s"), disconnected=False)
    assert len(capture.calls("s")) == 1 and capture.disconnected == 1
