"""Tests for serve.py: the OpenAI-compatible server and its capture.

Oracles: the engine itself (the same prompt through the server and straight into the engine gives
the same ids, log-probs and kept-set sizes, to the bit: the server makes the same engine call); our
own agent loop (a client playing a conversation through the server yields the trajectory
agent.run_episodes builds for it, token for token); engine_openai.OpenAIEngine and the real `openai`
package as clients nobody here wrote for this server; the learner (the weight-sync gate,
rollout.logprob_gap, against the served engine after a push).
"""

import copy
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from dataclasses import replace

import pytest
import torch

from agent import AgentConfig, run_episodes
from chat import encode, render
from conftest import need
from model import save_model
from rollout import (
    SamplingParams,
    TorchEngine,
    assert_synced,
    logprob_gap,
    make_engine,
    row_seeds,
    sync_probe,
)
from sft import write_tokenizer_files
from wings.engine_openai import OpenAIEngine
from wings.external_agent import load_agent
from wings.capture import session_trajectories
from wings.serve import Server
from test_agent import CalcEnv, ScriptedEngine, call_text, calc_task, three_turn_script, tok  # noqa: F401 (a fixture)
from test_openai_engine import tiny_model

MODEL = "tiny"
TOKEN = "s3cret"


def post(url: str, path: str, body, headers: dict | None = None) -> tuple[int, dict]:
    """POST JSON (or raw bytes) -> (status, parsed answer), whatever the status."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        url + path,
        data=data,
        method="POST",
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def push(url: str, state_dict: dict, token: str, version: int = 1) -> dict:
    """A remote trainer's push, as train.py makes it (engine_openai.OpenAIEngine.push) -> the
    server's answer."""
    return OpenAIEngine(url, MODEL, api_key=token).push(state_dict, version)


def get(url: str, path: str, headers: dict | None = None) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url + path, headers=headers or {}), timeout=60
        ) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def model(tok):
    return tiny_model(tok.get_vocab_size(), 0).eval()


@pytest.fixture(scope="module")
def served(tok, model):
    """One server over a TorchEngine of the tiny model for the fast tests (its own copy of the
    weights)."""
    server = Server(
        TorchEngine(copy.deepcopy(model), 0), tok, MODEL, max_model_len=600, token=TOKEN
    )
    server.start()
    yield server
    server.stop()


def scripted_server(tok, tasks, script_of=three_turn_script, **kw) -> Server:
    script = {
        t.prompt: script_of(int(t.prompt.split()[1]), int(t.prompt.split()[3][:-1])) for t in tasks
    }
    server = Server(ScriptedEngine(tok, script), tok, MODEL, max_model_len=4096, **kw)
    server.start()
    return server


def tool_results(message: dict) -> list[dict]:
    """The client's side of the `add` tool: a tool message per call."""
    out = []
    for c in message.get("tool_calls") or []:
        args = json.loads(c["function"]["arguments"])
        out.append({"role": "tool", "tool_call_id": c["id"], "content": str(args["a"] + args["b"])})
    return out


def play(url: str, task, session: str, edit=None, max_turns: int = 4) -> list[dict]:
    """A client's episode over raw HTTP: ask, run the tools, send them back, until a reply has no
    tool call. edit(messages) may rewrite the history before each request after the first (a client
    that edits it)."""
    _, msgs = CalcEnv().reset(task, 0)
    for turn in range(max_turns):
        if edit is not None and turn:
            msgs = edit(msgs)
        status, reply = post(
            url,
            "/chat/completions",
            {
                "model": MODEL,
                "messages": msgs,
                "tools": CalcEnv.TOOLS,
                "temperature": 0,
                "max_tokens": 300,
                "user": session,
            },
        )
        assert status == 200, reply
        message = reply["choices"][0]["message"]
        msgs = msgs + [message] + tool_results(message)
        if not message.get("tool_calls"):
            break
    return msgs


def agent_trajectory(tok, task, script_of=three_turn_script):
    engine = ScriptedEngine(
        tok, {task.prompt: script_of(int(task.prompt.split()[1]), int(task.prompt.split()[3][:-1]))}
    )
    return run_episodes(
        engine,
        {"calc": CalcEnv()},
        [task],
        tok,
        AgentConfig(n_samples=1, max_total_tokens=4096),
        SamplingParams(temperature=0.0, max_tokens=300),
        seed=0,
    )[0]


def assert_same_tokens(row, ref):
    assert row.token_ids == ref.token_ids
    assert row.loss_mask == ref.loss_mask
    assert row.logprobs == ref.logprobs
    assert (row.prompt_len, row.turn_starts, row.num_turns, row.num_tool_calls) == (
        ref.prompt_len,
        ref.turn_starts,
        ref.num_turns,
        ref.num_tool_calls,
    )


# -----------------------------------------------------------------------------
# token exactness


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=1.0), dict(temperature=0.8, top_k=7, top_p=0.9), dict(temperature=0.0)],
)
def test_chat_gives_the_engines_own_ids_logprobs_and_kept_sizes(served, tok, model, sampling):
    messages = [
        {"role": "system", "content": CalcEnv.SYSTEM},
        {"role": "user", "content": "Compute 2 + 3."},
    ]
    prompt = encode(tok, render(messages, CalcEnv.TOOLS, add_generation_prompt=True))
    engine, im_end = TorchEngine(model, 0), tok.token_to_id("<|im_end|>")
    params = SamplingParams(n=3, max_tokens=12, seed=11, stop_token_ids=(im_end,), **sampling)
    # a token sample 0 emits: some samples stop
    stop = engine.generate([prompt], params)[0].token_ids[4]
    direct = engine.generate([prompt], replace(params, stop_token_ids=(im_end, stop)))
    status, reply = post(
        served.url,
        "/chat/completions",
        {
            "model": MODEL,
            "messages": messages,
            "tools": CalcEnv.TOOLS,
            "n": 3,
            "max_tokens": 12,
            "seed": 11,
            "logprobs": True,
            "user": f"exact-{sampling}",
            "stop_token_ids": [stop],
            **sampling,
        },
    )
    assert status == 200, reply
    (call,) = served.capture.calls(f"exact-{sampling}")
    assert call.prompt_ids == prompt
    for d, s, choice in zip(direct, call.samples, reply["choices"]):
        assert (
            s.token_ids == d.token_ids and s.logprobs == d.logprobs and s.kept_sizes == d.kept_sizes
        )
        assert [c["logprob"] for c in choice["logprobs"]["content"]] == d.logprobs
        # the stop token is not text
        content = d.token_ids[:-1] if d.finish_reason == "stop" else d.token_ids
        assert choice["message"]["content"] == tok.decode(content, skip_special_tokens=False)
        assert choice["finish_reason"] == d.finish_reason  # no tool call parses here
    assert direct[0].finish_reason == "stop" and len(direct[0].token_ids) <= 5
    if "top_k" in sampling:
        assert all(0 < k <= 7 for s in call.samples for k in s.kept_sizes)


def test_the_prefix_encoder_gives_the_tokenizers_own_ids(tok):
    """PrefixEncoder reuses the ids of prefixes that end at <|im_end|>: on growing conversations
    (non-ASCII, spaces, tool calls and their results, several sessions sharing a system prompt) its
    ids are encode(text)'s, and the conversation's earlier turns come from its cache."""
    import random
    from wings.serve import PrefixEncoder

    encoder, rng = PrefixEncoder(tok, "<|im_end|>"), random.Random(0)
    for session in range(30):
        msgs = [
            {"role": "system", "content": CalcEnv.SYSTEM + " é 中文" * rng.randint(0, 2)},
            {"role": "user", "content": f"Compute {rng.randint(0, 99)} + {rng.randint(0, 99)}. ñ"},
        ]
        for turn in range(4):
            text = render(msgs, CalcEnv.TOOLS, add_generation_prompt=True)
            hit = encoder._cached(text)[0]
            assert encoder(text) == encode(tok, text)
            # up to the last <|im_end|> before
            assert turn == 0 or hit == len(render(msgs[:-2], CalcEnv.TOOLS)) - 1
            msgs += [
                {
                    "role": "assistant",
                    "content": rng.choice(["Let me", "ok  ", " \n", "café", ""]),
                    "tool_calls": [
                        {"type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
                    ],
                },
                {"role": "tool", "content": str(rng.random())},
            ]


def test_openai_engine_against_the_server_equals_the_engine(served, model):
    """engine_openai (our client of `vllm serve`) over this server: each prompt is one request with
    its row seed, sent one at a time, so the server's batch holds that request alone, its engine
    call is exactly engine.generate([prompt], seeded) and nothing may differ (concurrent requests:
    test_serve_batching.py)."""
    client = OpenAIEngine(served.url, MODEL, max_concurrency=1)
    prompts = [[5, 9, 3, 7, 11, 2, 8], [4], [13, 6, 6, 1]]
    engine = TorchEngine(model, 0)
    for params in [
        SamplingParams(n=2, temperature=1.0, max_tokens=9, seed=3, stop_token_ids=(17,)),
        SamplingParams(n=1, temperature=0.0, max_tokens=9),
        SamplingParams(n=2, temperature=0.8, top_k=7, top_p=0.9, max_tokens=9, seed=5),
    ]:
        remote = client.generate(prompts, params)
        direct = [
            g
            for p, s in zip(prompts, row_seeds(params.seed, len(prompts)))
            for g in engine.generate([p], replace(params, seed=s))
        ]
        assert [g.token_ids for g in remote] == [g.token_ids for g in direct]
        assert [g.logprobs for g in remote] == [g.logprobs for g in direct]
        assert [g.finish_reason for g in remote] == [g.finish_reason for g in direct]
        # the kept-set sizes travel in the reply's `kept_sizes` (ours; vLLM has none): the learner
        # gets the engine's
        assert [g.kept_sizes for g in remote] == [g.kept_sizes for g in direct]
    assert all(0 < k <= 7 for g in remote for k in g.kept_sizes) and remote[0].kept_sizes


def test_a_client_session_is_the_agent_loops_trajectory(tok):
    tasks = [calc_task(0, 2, 3), calc_task(1, 40, 17)]
    server = scripted_server(tok, tasks)
    try:
        for i, task in enumerate(tasks):
            play(server.url, task, f"s{i}")
            (row,), metrics = session_trajectories(server.capture.calls(f"s{i}"), f"s{i}")
            assert metrics["serve/branched"] == 0.0 and metrics["serve/turns"] == 3
            assert_same_tokens(row, agent_trajectory(tok, task))
            # the server's weight version
            assert {v for v, m in zip(row.versions, row.loss_mask) if m} == {0}
    finally:
        server.stop()


def test_the_openai_package_plays_a_multi_turn_tool_episode(tok):
    openai = need("openai", "a client of the server that nobody here wrote")
    task = calc_task(0, 7, 8)
    server = scripted_server(tok, [task])
    try:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
        _, messages = CalcEnv().reset(task, 0)
        calls = 0
        for _ in range(4):
            reply = client.chat.completions.create(
                model=MODEL,
                messages=messages,
                tools=CalcEnv.TOOLS,
                temperature=0,
                extra_headers={"X-Session-Id": "openai"},
            )
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            for c in message.tool_calls or []:
                args = json.loads(c.function.arguments)
                messages.append(
                    {"role": "tool", "tool_call_id": c.id, "content": str(args["a"] + args["b"])}
                )
                calls += 1
            if not message.tool_calls:
                assert reply.choices[0].finish_reason == "stop" and message.content == "ANSWER: 15"
                break
        assert calls == 3  # two calls in turn 0, one in turn 1
        (row,), metrics = session_trajectories(server.capture.calls("openai"), "openai")
        assert metrics["serve/branched"] == 0.0
        assert_same_tokens(row, agent_trajectory(tok, task))
        assert [m.id for m in client.models.list().data] == [MODEL]
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(
                model="gpt-4", messages=[{"role": "user", "content": "hi"}]
            )
    finally:
        server.stop()


# -----------------------------------------------------------------------------
# the prefix invariant


def think_script(a, b):
    return ["<think>\nadd them\n</think>\n\n" + call_text(a, b), f"ANSWER: {a + b}"]


def strip_think(msgs):
    return [
        {**m, "content": (m.get("content") or "").split("</think>")[-1].lstrip("\n")}
        if m["role"] == "assistant"
        else m
        for m in msgs
    ]


def edit_user(msgs):
    return [{**m, "content": m["content"] + " Please."} if m["role"] == "user" else m for m in msgs]


@pytest.mark.parametrize("edit", [None, strip_think, edit_user])
def test_a_rewritten_history_branches_into_rows_per_turn(tok, edit):
    task = calc_task(0, 4, 5)
    server = scripted_server(tok, [task], think_script)
    try:
        play(server.url, task, "s", edit=edit)
        calls = server.capture.calls("s")
        rows, metrics = session_trajectories(calls, "s")
        assert len(calls) == 2 and metrics["serve/branched"] == float(edit is not None)
        if edit is None:
            assert_same_tokens(rows[0], agent_trajectory(tok, task, think_script))
            return
        assert calls[1].parent is None and len(rows) == 2
        assert "<think>" in tok.decode(calls[0].samples[0].token_ids, skip_special_tokens=False)
        for row, call in zip(rows, calls):
            # each row: the ids the engine was given, then the ids it sampled
            s = call.samples[0]
            assert row.token_ids == call.prompt_ids + s.token_ids
            assert row.loss_mask == [0] * len(call.prompt_ids) + [1] * len(s.token_ids)
            assert row.logprobs == [0.0] * len(call.prompt_ids) + s.logprobs
    finally:
        server.stop()


def test_concurrent_sessions_never_mix(tok):
    tasks = [calc_task(i, 3 * i + 1, 50 - i) for i in range(6)]
    server = scripted_server(tok, tasks)
    try:
        threads = [
            threading.Thread(target=play, args=(server.url, t, f"c{i}"))
            for i, t in enumerate(tasks)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, task in enumerate(tasks):
            (row,), metrics = session_trajectories(server.capture.calls(f"c{i}"), f"c{i}")
            assert metrics["serve/branched"] == 0.0
            assert_same_tokens(row, agent_trajectory(tok, task))
    finally:
        server.stop()


def test_a_malformed_tool_call_comes_back_as_text_with_a_parse_failure(tok):
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2,}}\n</tool_call>'
    task = calc_task(0, 1, 2)
    server = scripted_server(tok, [task], lambda a, b: [bad])
    try:
        _, msgs = CalcEnv().reset(task, 0)
        status, reply = post(
            server.url, "/chat/completions", {"model": MODEL, "messages": msgs, "user": "m"}
        )
        assert status == 200
        assert reply["choices"][0]["message"] == {"role": "assistant", "content": bad}
        assert reply["choices"][0]["finish_reason"] == "stop"
        (row,), _ = session_trajectories(server.capture.calls("m"), "m")
        assert row.parse_failures == 1 and row.num_tool_calls == 0
    finally:
        server.stop()


def test_qwen3_format_and_enable_thinking(tok):
    task = calc_task(0, 1, 2)
    server = scripted_server(tok, [task], lambda a, b: ["ANSWER: 3"], chat_format="qwen3")
    try:
        _, msgs = CalcEnv().reset(task, 0)
        for thinking in [None, False]:
            body = {
                "model": MODEL,
                "messages": msgs,
                "user": f"q{thinking}",
                "chat_template_kwargs": {"enable_thinking": thinking},
            }
            assert post(server.url, "/chat/completions", body)[0] == 200
            want = render(
                msgs, add_generation_prompt=True, chat_format="qwen3", enable_thinking=thinking
            )
            assert server.capture.calls(f"q{thinking}")[0].prompt_ids == encode(tok, want)
        assert want.endswith("<think>\n\n</think>\n\n")
    finally:
        server.stop()


def test_a_well_formed_call_not_written_as_render_writes_it_is_returned_and_branches(tok):
    # no spaces
    terse = 'Adding.\n<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>'
    task = calc_task(0, 1, 2)
    server = scripted_server(tok, [task], lambda a, b: [terse, "ANSWER: 3"])
    try:
        msgs = play(server.url, task, "t")
        assert (
            msgs[2]["content"] == "Adding."
            and msgs[2]["tool_calls"][0]["function"]["arguments"] == '{"a": 1, "b": 2}'
            and msgs[3]["content"] == "3"
        )
        rows, metrics = session_trajectories(server.capture.calls("t"), "t")
        assert metrics["serve/branched"] == 1.0 and len(rows) == 2 and rows[0].num_tool_calls == 1
        assert rows[0].parse_failures == 0
    finally:
        server.stop()


def test_arguments_sent_back_re_serialised_still_continue_the_sampled_text(tok):
    """Qwen Code sends a call's arguments back as JSON.stringify writes them (no spaces): the
    server reads a JSON object's string, so the prompt renders them as they were sampled and the
    session stays one row, token for token the trajectory of our agent loop."""
    task = calc_task(0, 7, 8)
    server = scripted_server(tok, [task])

    def compact(messages):
        for m in messages:
            for c in m.get("tool_calls") or []:
                args = json.loads(c["function"]["arguments"])
                c["function"]["arguments"] = json.dumps(args, separators=(",", ":"))
        return messages

    try:
        msgs = play(server.url, task, "q", edit=compact)
        assert '{"a":7,"b":8}' in [c["function"]["arguments"] for c in msgs[2]["tool_calls"]]
        (row,), metrics = session_trajectories(server.capture.calls("q"), "q")
        assert metrics["serve/branched"] == 0.0
        assert_same_tokens(row, agent_trajectory(tok, task))
    finally:
        server.stop()


def test_stop_strings(tok):
    task = calc_task(0, 1, 2)
    server = scripted_server(tok, [task], lambda a, b: ["Sure. ANSWER: 3 and more"])
    try:
        _, msgs = CalcEnv().reset(task, 0)
        for stop, content in [("ANSWER", "Sure. "), (["zzz", "3 and"], "Sure. ANSWER: ")]:
            status, reply = post(
                server.url, "/chat/completions", {"model": MODEL, "messages": msgs, "stop": stop}
            )
            assert status == 200 and reply["choices"][0]["message"]["content"] == content
            assert reply["choices"][0]["finish_reason"] == "stop"
        # completions: the same cut, and the ids recorded run to the token that completed the string
        prompt = encode(tok, render(msgs, add_generation_prompt=True))
        status, reply = post(
            server.url,
            "/completions",
            {
                "model": MODEL,
                "prompt": prompt,
                "stop": "3 and",
                "user": "c",
                "return_token_ids": True,
            },
        )
        ids = reply["choices"][0]["token_ids"]
        assert reply["choices"][0]["text"] == "Sure. ANSWER: " and "3 and" in tok.decode(ids)
        assert (
            "3 and" not in tok.decode(ids[:-1])
            and server.capture.calls("c")[0].samples[0].token_ids == ids
        )
    finally:
        server.stop()


# -----------------------------------------------------------------------------
# weights: versions and the gate


def perturbed(model, seed: int = 5):
    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return new


def test_a_push_changes_versions_and_the_gate_checks_the_served_engine(tok, model):
    server = Server(TorchEngine(copy.deepcopy(model), 0), tok, MODEL, token=TOKEN)
    stale = Server(TorchEngine(copy.deepcopy(model), 0), tok, MODEL)  # never pushed
    server.start(), stale.start()
    try:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Compute 1 + 1."}],
            "max_tokens": 6,
            "user": "v",
            "stop": "\n",
        }
        status, first = post(server.url, "/chat/completions", body)
        assert status == 200
        learner = perturbed(model)
        weights = dict(learner.named_parameters())
        assert push(server.url, weights, TOKEN, version=7) == {
            "version": 7,
            "tensors": len(weights),
        }
        # the session goes on after the push: the reply sent back, then a user turn (greedy: a reply
        # the tiny model can re-encode to the sampled ids)
        body = {
            **body,
            "temperature": 0,
            "messages": body["messages"]
            + [first["choices"][0]["message"], {"role": "user", "content": "And 2 + 2?"}],
        }
        assert post(server.url, "/chat/completions", body)[0] == 200
        assert get(server.url, "/models")[1]["data"][0]["weight_version"] == 7
        before, after = server.capture.calls("v")
        assert set(before.samples[0].versions) == {0} and set(after.samples[0].versions) == {7}
        rows, _ = session_trajectories([before, after], "v")
        assert {v for r in rows for v, m in zip(r.versions, r.loss_mask) if m} == {0, 7}

        # the gate: an OpenAIEngine probe of the server, scored by the learner
        params = SamplingParams(temperature=1.0, max_tokens=8, seed=1)
        prompts = [[5, 9, 3, 7], [13, 6, 6, 1, 2]]
        gap = logprob_gap(learner, *sync_probe(OpenAIEngine(server.url, MODEL), prompts, params))
        assert assert_synced(gap, 1e-3, 2) < 1e-4
        stale_gap = logprob_gap(
            learner, *sync_probe(OpenAIEngine(stale.url, MODEL), prompts, params)
        )
        with pytest.raises(RuntimeError, match="weight sync check failed"):
            assert_synced(stale_gap, 1e-3, 2)

        # in process (colocated): the Server is an engine; version + 1 by default
        back = dict(copy.deepcopy(model).named_parameters())
        assert server.update_weights(back) == 8
        assert logprob_gap(model, *sync_probe(server, prompts, params)) < 1e-4

        # refused pushes change nothing
        bad = {**back, "model.norm.weight": torch.ones(3)}
        status, reply = post(
            server.url, "/weights", b"not safetensors", {"Authorization": f"Bearer {TOKEN}"}
        )
        assert status == 400 and "safetensors" in reply["error"]["message"]
        with pytest.raises(RuntimeError, match="HTTP 400.*shape mismatch"):
            push(server.url, bad, TOKEN)
        with pytest.raises(RuntimeError, match="HTTP 401"):
            push(server.url, back, "wrong")
        with pytest.raises(RuntimeError, match="HTTP 403"):
            push(stale.url, back, TOKEN)
        assert server.version == 8
        assert logprob_gap(model, *sync_probe(server, prompts, params)) < 1e-4
    finally:
        server.stop(), stale.stop()


def test_an_engine_that_stamps_versions_gets_the_pushed_version(tok, model):
    # async_rollouts
    engine = make_engine("torch", "", pad_id=0, model=copy.deepcopy(model), concurrent=True)
    server = Server(engine, tok, MODEL)  # in process: no HTTP needed
    assert server.update_weights(dict(perturbed(model).named_parameters()), version=4) == 4
    (gen,) = server.generate([[5, 9, 3]], SamplingParams(max_tokens=5, seed=0))
    assert gen.versions == [4] * 5 and engine.version == 4  # the engine's own stamps


def test_sessions_endpoint_returns_and_pops_records(served):
    body = {"model": MODEL, "prompt": [5, 9, 3], "max_tokens": 4, "user": "remote"}
    assert post(served.url, "/completions", body)[0] == 200
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert get(served.url, "/sessions/remote")[0] == 401
    status, reply = get(served.url, "/sessions/remote?pop=1", auth)
    assert status == 200 and reply["calls"][0]["prompt_ids"] == [5, 9, 3]
    assert len(reply["calls"][0]["samples"][0]["token_ids"]) == 4
    assert get(served.url, "/sessions/remote", auth)[1]["calls"] == []


# -----------------------------------------------------------------------------
# bad requests

# OpenAI's categories, not the status (serve_http.CODES)
CODES = {
    400: "invalid_request",
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    411: "length_required",
    413: "request_too_large",
}
SPECIFIC = {
    "unknown model": "model_not_found",
    "context too long": "context_length_exceeded",
    "prompt too long": "context_length_exceeded",
}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETE = {"model": MODEL, "prompt": [5, 9, 3], "max_tokens": 4}
BAD = {  # name: (path, body (dict, or raw bytes), status, a piece of the message)
    "bad json": ("/chat/completions", b"{not json", 400, "not valid JSON"),
    "not an object": ("/chat/completions", b"[1, 2]", 400, "JSON object"),
    "bad utf-8": ("/chat/completions", b"\xff\xfe{", 400, "not valid JSON"),
    "unknown model": ("/chat/completions", {**CHAT, "model": "gpt-4"}, 404, "does not exist"),
    "no messages": ("/chat/completions", {**CHAT, "messages": []}, 400, "non-empty"),
    "bad role": (
        "/chat/completions",
        {**CHAT, "messages": [{"role": "robot", "content": "x"}]},
        400,
        "role",
    ),
    "image content": (
        "/chat/completions",
        {
            **CHAT,
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ],
        },
        400,
        "text parts",
    ),
    "bad tool_calls": (
        "/chat/completions",
        {**CHAT, "messages": [{"role": "assistant", "tool_calls": [{"function": {"name": 3}}]}]},
        400,
        "tool_calls[0]",
    ),
    "bad tools": ("/chat/completions", {**CHAT, "tools": [{"name": "add"}]}, 400, "tools must be"),
    "context too long": (
        "/chat/completions",
        {**CHAT, "max_tokens": 100000},
        400,
        "maximum context length",
    ),
    "prompt too long": (
        "/completions",
        {**COMPLETE, "prompt": [5] * 700},
        400,
        "maximum context length",
    ),
    "max_tokens 0": ("/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    "max_tokens float": ("/completions", {**COMPLETE, "max_tokens": 2.5}, 400, "max_tokens"),
    "temperature < 0": ("/chat/completions", {**CHAT, "temperature": -1}, 400, "temperature"),
    "temperature string": ("/chat/completions", {**CHAT, "temperature": "hot"}, 400, "temperature"),
    "top_p 0": ("/chat/completions", {**CHAT, "top_p": 0}, 400, "top_p"),
    "top_k < -1": ("/completions", {**COMPLETE, "top_k": -2}, 400, "top_k"),
    "n 0": ("/chat/completions", {**CHAT, "n": 0}, 400, "n must"),
    "n huge": ("/chat/completions", {**CHAT, "n": 10**6}, 400, "n must"),
    "n bool": ("/chat/completions", {**CHAT, "n": True}, 400, "n must"),
    "seed string": ("/chat/completions", {**CHAT, "seed": "x"}, 400, "seed"),
    "stop not strings": ("/chat/completions", {**CHAT, "stop": [1]}, 400, "stop"),
    "stop ids out of vocab": (
        "/completions",
        {**COMPLETE, "stop_token_ids": [10**9]},
        400,
        "stop_token_ids",
    ),
    "stream not a bool": ("/chat/completions", {**CHAT, "stream": "yes"}, 400, "stream"),
    "top_logprobs": (
        "/chat/completions",
        {**CHAT, "logprobs": True, "top_logprobs": 3},
        400,
        "top_logprobs",
    ),
    "logprobs not bool": ("/chat/completions", {**CHAT, "logprobs": 2}, 400, "logprobs"),
    "completion logprobs 5": ("/completions", {**COMPLETE, "logprobs": 5}, 400, "logprobs"),
    "penalty": ("/chat/completions", {**CHAT, "presence_penalty": 1.0}, 400, "presence_penalty"),
    "tool_choice required": (
        "/chat/completions",
        {**CHAT, "tool_choice": "required"},
        400,
        "tool_choice",
    ),
    "ids out of vocab": ("/completions", {**COMPLETE, "prompt": [5, 10**6]}, 400, "token ids"),
    "negative id": ("/completions", {**COMPLETE, "prompt": [-1]}, 400, "token ids"),
    "too many rows": (
        "/completions",
        {**COMPLETE, "prompt": [[5]] * 40, "n": 2},
        400,
        "at most 64",
    ),
    "template kwargs": (
        "/chat/completions",
        {**CHAT, "chat_template_kwargs": {"x": 1}},
        400,
        "enable_thinking",
    ),
    "empty prompt": ("/completions", {**COMPLETE, "prompt": []}, 400, "prompt must"),
    "prompt dict": ("/completions", {**COMPLETE, "prompt": {"a": 1}}, 400, "prompt must"),
    "session not a string": ("/chat/completions", {**CHAT, "user": 5}, 400, "session"),
    "tool parameters a string": (
        "/chat/completions",
        {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
        400,
        "JSON Schema object",
    ),
    "tool parameters not an object": (
        "/chat/completions",
        {
            **CHAT,
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
            ],
        },
        400,
        "JSON Schema object",
    ),
    "lone surrogate in content": (
        "/chat/completions",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "a \\ud800 b"}]}',
        400,
        "lone surrogate",
    ),
    "lone surrogate in a tool": (
        "/chat/completions",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "a"}'
        b'], "tools": [{"type": "function", "function": {"name": "\\udfff"}}]}',
        400,
        "lone surrogate",
    ),
    "lone surrogate in a prompt": (
        "/completions",
        b'{"model": "tiny", "prompt": "x\\ud800"}',
        400,
        "lone surrogate",
    ),
    "lone surrogate in stop": (
        "/completions",
        b'{"model": "tiny", "prompt": [5], "stop": "\\ud800"}',
        400,
        "lone surrogate",
    ),
    "unknown path": ("/embeddings", CHAT, 404, "not served"),
    "weights without token": ("/weights", b"", 401, "Bearer"),
    "too large": ("/chat/completions", b"x" * ((5 << 20) + 7), 413, "at most"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_requests_get_a_clear_4xx_and_the_server_goes_on(served, case):
    path, body, status, message = BAD[case]
    got, reply = post(served.url, path, body)
    assert got == status, reply
    # a specific reason where OpenAI gives one, else the category
    code = SPECIFIC.get(case, CODES[status])
    assert message in reply["error"]["message"] and reply["error"]["code"] == code
    assert post(served.url, "/chat/completions", CHAT)[0] == 200


def test_malformed_http_is_answered(served):
    host, port = served.address
    for method, path, headers, status in [
        ("POST", "/v1/completions", {}, 411),  # no length
        ("GET", "/v1/chat/completions", {}, 405),
        ("POST", "/v1/completions", {"Content-Length": "-3"}, 413),
        ("POST", "/v1/completions", {"Transfer-Encoding": "chunked"}, 411),
    ]:
        conn = http.client.HTTPConnection(host, port, timeout=30)
        conn.putrequest(method, path)
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.endheaders()
        r = conn.getresponse()
        assert r.status == status and json.loads(r.read())["error"]["code"] == CODES[status]
        conn.close()
    assert post(served.url, "/chat/completions", CHAT)[0] == 200


class BrokenEngine:
    def generate(self, prompts, params):
        raise RuntimeError("the accelerator fell off")


def test_an_engine_failure_is_a_500_and_the_server_goes_on(tok):
    server = Server(BrokenEngine(), tok, MODEL)
    server.start()
    try:
        for _ in range(2):
            status, reply = post(server.url, "/chat/completions", CHAT)
            assert (
                status == 500
                and "RuntimeError: the accelerator fell off" in reply["error"]["message"]
            )
        assert get(server.url, "/models")[0] == 200
    finally:
        server.stop()


# -----------------------------------------------------------------------------
# a server that holds


def raw(address, data: bytes, timeout: float = 60) -> bytes:
    """Send bytes on a fresh connection -> everything the server sends back until it closes."""
    with socket.create_connection(address, timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(1 << 16):
            out += chunk
    return out


def test_a_burst_of_fresh_connections_is_accepted(served):
    """64 clients open a connection at the same instant (the trainer runs up to WORKERS agents
    against this very server): the listening socket's backlog holds them all, none is reset."""
    barrier, answers = threading.Barrier(64), []

    def client():
        barrier.wait()
        answers.append(
            raw(served.address, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        )

    threads = [threading.Thread(target=client) for _ in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(answers) == 64 and all(a.startswith(b"HTTP/1.1 200 ") for a in answers)


def test_open_connections_hold_no_thread(served):
    """A connection is a coroutine on the event loop, not a thread: 64 open keep-alive connections,
    each served a request, add no thread to the process."""
    before = threading.active_count()
    connections = [http.client.HTTPConnection(*served.address, timeout=60) for _ in range(64)]
    try:
        for c in connections:
            c.request("GET", "/health")
            assert c.getresponse().read() and c.sock is not None
        assert threading.active_count() <= before
    finally:
        for c in connections:
            c.close()


@pytest.mark.parametrize(
    "method, path, headers, status",
    [
        ("POST", "/v1/embeddings", {}, 404),  # an endpoint we do not serve
        # refused before its body is read
        ("POST", "/v1/weights", {"Authorization": "Bearer wrong"}, 401),
        ("PUT", "/v1/chat/completions", {}, 405),
        ("DELETE", "/v1/chat/completions", {}, 405),
        ("GET", "/v1/chat/completions", {}, 405),
        ("PATCH", "/v1/models", {}, 405),
    ],
)
def test_a_refused_request_never_poisons_its_connection(served, method, path, headers, status):
    """The refusal is a JSON error, and its body is read and dropped, so the next request on the
    same keep-alive connection is parsed from its first byte."""
    conn = http.client.HTTPConnection(*served.address, timeout=60)
    try:
        conn.request(
            method,
            path,
            body=json.dumps({"model": MODEL, "input": "x" * 5000}),
            headers={"Content-Type": "application/json", **headers},
        )
        r = conn.getresponse()
        error = json.loads(r.read())["error"]
        assert (
            r.status == status
            and error["code"] == CODES[status]
            and r.getheader("Content-Type") == "application/json"
        )
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps(CHAT),
            headers={"Content-Type": "application/json"},
        )
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["choices"]
    finally:
        conn.close()


def test_the_openai_client_after_an_unserved_endpoint_and_its_error_codes(served):
    openai = need("openai", "the official client: its errors read OpenAI's error object")
    client = openai.OpenAI(base_url=served.url, api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model=MODEL, input="hello")
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert client.chat.completions.create(**chat).choices  # the same connection pool goes on
    for bad, code in [
        (dict(max_tokens=10**6), "context_length_exceeded"),
        (dict(temperature=-1), "invalid_request"),
        (dict(model="gpt-4"), "model_not_found"),
    ]:
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(**{**chat, **bad})
        assert e.value.code == code
    # the documented alias
    assert client.chat.completions.create(**{**chat, "model": "policy"}).model == MODEL


def test_a_body_that_stops_arriving_is_dropped(tok, model):
    """A Content-Length longer than the body sent: the server answers 408 and closes the connection
    once no byte came for body_timeout_s (not a thread or a coroutine held forever)."""
    server = Server(TorchEngine(copy.deepcopy(model), 0), tok, MODEL, body_timeout_s=0.5)
    server.start()
    try:
        got = raw(
            server.address,
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
            b'application/json\r\nContent-Length: 100\r\n\r\n{"model": ',
        )
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 ") and b"Connection: close" in head
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert post(server.url, "/chat/completions", CHAT)[0] == 200
    finally:
        server.stop()


# -----------------------------------------------------------------------------
# the command line


@pytest.mark.slow
def test_cli_serves_a_checkpoint_folder(tok, model, tmp_path):
    folder = str(tmp_path / "model")
    save_model(model, folder)
    write_tokenizer_files(tok, folder, "qwen2.5")
    bad = subprocess.run(
        [sys.executable, "-m", "wings.serve", "--checkpoint", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "no such folder" in bad.stderr
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "wings.serve",
            "--checkpoint",
            folder,
            "--port",
            "0",
            "--served-model-name",
            MODEL,
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "NANO_SKYRL_SERVE_TOKEN": TOKEN},
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving 'tiny' on http://127.0.0.1:"), line
        url = line.split()[-1]
        status, reply = post(
            url, "/completions", {**COMPLETE, "temperature": 0, "return_token_ids": True}
        )
        direct = TorchEngine(model, 0).generate(
            [COMPLETE["prompt"]], SamplingParams(temperature=0, max_tokens=4)
        )
        assert status == 200 and reply["choices"][0]["token_ids"] == direct[0].token_ids
        assert push(url, dict(model.named_parameters()), TOKEN)["version"] == 1
        # the example agents, as they run in training (model "policy": an alias every server answers
        # to), each recorded in its session
        examples = os.path.join(
            os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"
        )
        for name, package in (("calc_agent", "openai"), ("calc_agent_anthropic", "anthropic")):
            need(package, "the example agent's client")
            agent = load_agent(os.path.join(examples, name + ".py") + ":run")
            assert isinstance(
                agent({"id": "0", "env": "toy_math", "prompt": "What is 2 + 3?"}, url, name), str
            )
            status, calls = get(
                url, f"/sessions/{name}?pop=1", {"Authorization": f"Bearer {TOKEN}"}
            )
            assert (
                status == 200
                and calls["calls"]
                and {c["endpoint"] for c in calls["calls"]}
                == {"calc_agent": {"chat"}, "calc_agent_anthropic": {"messages"}}[name]
            )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
