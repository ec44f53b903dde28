"""Tests for serve.py's streaming (stream=true) and its second dialect, Anthropic's Messages API
(serve_anthropic.py).

Oracles: the official `openai` and `anthropic` clients (test-only dependencies) reading what the
server streams and answers; the same request unstreamed (a streamed call is the same record, and its
assembled message the same message); our agent loop (an Anthropic client's episode is the trajectory
agent.run_episodes builds, token for token).
"""

import copy
import dataclasses
import json
import socket
import threading
import time

import pytest

from chat import encode, render
from conftest import need
from rollout import TorchEngine
from wings.capture import session_trajectories
from wings.serve import Server
from test_agent import CalcEnv, ScriptedEngine, calc_task, three_turn_script, tok  # noqa: F401 (a fixture)
from test_openai_engine import tiny_model
from test_serve import agent_trajectory, assert_same_tokens, post, scripted_server

MODEL = "tiny"


@pytest.fixture(scope="module")
def model(tok):
    return tiny_model(tok.get_vocab_size(), 0).eval()


@pytest.fixture
def torch_server(tok, model):
    server = Server(TorchEngine(copy.deepcopy(model), 0), tok, MODEL, max_model_len=600)
    server.start()
    yield server
    server.stop()


def same_record(a, b):
    """Two Calls are the same record: prompt ids, every sample's ids, log-probs, kept sizes,
    versions, finish reason, tool calls, parse error and message (the tool call ids aside: each
    reply numbers its own)."""

    def strip(message):
        if not message or "tool_calls" not in message:
            return message
        return {
            **message,
            "tool_calls": [
                {k: v for k, v in c.items() if k != "id"} for c in message["tool_calls"]
            ],
        }

    assert a.prompt_ids == b.prompt_ids and a.endpoint == b.endpoint and a.messages == b.messages
    assert [dataclasses.replace(s, message=strip(s.message)) for s in a.samples] == [
        dataclasses.replace(s, message=strip(s.message)) for s in b.samples
    ]


def sse(host: str, port: int, path: str, body: dict) -> list:
    """POST with stream=true over a raw socket -> the data of each server-sent event, in order."""
    data = json.dumps(body).encode()
    with socket.create_connection((host, port), timeout=60) as s:
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
            + data
        )
        raw = b""
        while chunk := s.recv(1 << 16):
            raw += chunk
    head, _, body_bytes = raw.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0] and b"chunked" in head.lower()
    text, out = b"", []
    while body_bytes:  # undo the chunked encoding
        size, _, rest = body_bytes.partition(b"\r\n")
        if int(size, 16) == 0:
            break
        text, body_bytes = text + rest[: int(size, 16)], rest[int(size, 16) + 2 :]
    for event in text.decode().split("\n\n"):
        for line in event.split("\n"):
            if line.startswith("data: "):
                out.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return out


# -----------------------------------------------------------------------------
# OpenAI streaming


@pytest.mark.parametrize("n", [1, 2])
def test_a_streamed_chat_is_the_same_call_and_record_as_unstreamed(torch_server, n):
    openai = need("openai", "the official client reads the stream")
    client = openai.OpenAI(base_url=torch_server.url, api_key="unused", max_retries=0)
    messages = [
        {"role": "system", "content": CalcEnv.SYSTEM},
        {"role": "user", "content": "Compute 4 + 5."},
    ]
    kwargs = dict(
        model=MODEL,
        messages=messages,
        tools=CalcEnv.TOOLS,
        n=n,
        max_tokens=40,
        seed=7,
        logprobs=True,
    )
    plain = client.chat.completions.create(**kwargs, user="plain")
    chunks = list(
        client.chat.completions.create(
            **kwargs, user="streamed", stream=True, stream_options={"include_usage": True}
        )
    )
    same_record(*torch_server.capture.calls("plain"), *torch_server.capture.calls("streamed"))
    for i, want in enumerate(plain.choices):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(c.delta.content or "" for c in mine) == (want.message.content or "")
        assert mine[-1].finish_reason == want.finish_reason
        assert [t.logprob for c in mine if c.logprobs for t in c.logprobs.content] == [
            t.logprob for t in want.logprobs.content
        ]
        # the text went out as it was sampled, not at the end
        assert sum(bool(c.delta.content) for c in mine) > 1
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == plain.usage.model_dump()


def test_streamed_tool_calls_are_the_unstreamed_ones(tok):
    """A scripted three-turn tool episode streamed turn by turn: the tool_call deltas assemble into
    the unstreamed message, and the session is the same trajectory as the unstreamed client's."""
    openai = need("openai", "the official client reads the stream")
    task = calc_task(0, 7, 8)
    server = scripted_server(tok, [task])
    try:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
        for session in ("plain", "streamed"):
            _, messages = CalcEnv().reset(task, 0)
            for _ in range(4):
                kwargs = dict(
                    model=MODEL, messages=messages, tools=CalcEnv.TOOLS, temperature=0, user=session
                )
                if session == "plain":
                    message = client.chat.completions.create(**kwargs).choices[0].message
                else:
                    with client.chat.completions.stream(**kwargs) as stream:
                        message = stream.get_final_completion().choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                for c in message.tool_calls or []:
                    args = json.loads(c.function.arguments)
                    messages.append(
                        {
                            "role": "tool",
                            "tool_call_id": c.id,
                            "content": str(args["a"] + args["b"]),
                        }
                    )
                if not message.tool_calls:
                    break
        for a, b in zip(server.capture.calls("plain"), server.capture.calls("streamed")):
            same_record(a, b)
        (row,), _ = session_trajectories(server.capture.calls("streamed"), "streamed")
        assert_same_tokens(row, agent_trajectory(tok, task))
    finally:
        server.stop()


def test_a_streamed_completion_is_the_unstreamed_one(torch_server):
    host, port = torch_server.address
    body = {
        "model": MODEL,
        "prompt": [5, 9, 3, 7],
        "n": 2,
        "max_tokens": 16,
        "seed": 3,
        "return_token_ids": True,
        "logprobs": 0,
    }
    _, plain = post(torch_server.url, "/completions", body)
    events = sse(host, port, "/v1/completions", {**body, "stream": True})
    assert events[-1] == "[DONE]"
    for i, want in enumerate(plain["choices"]):
        mine = [
            e["choices"][0] for e in events[:-1] if e["choices"] and e["choices"][0]["index"] == i
        ]
        assert "".join(c["text"] for c in mine) == want["text"]
        assert (
            mine[-1]["finish_reason"] == want["finish_reason"]
            and mine[-1]["token_ids"] == want["token_ids"]
        )
        assert mine[-1]["logprobs"]["token_logprobs"] == want["logprobs"]["token_logprobs"]


def blocked(server: Server) -> threading.Event:
    """Hold the engine thread (a command that waits) until the returned event is set: requests queue
    behind it."""
    release, holding = threading.Event(), threading.Event()

    def hold():
        holding.set()
        release.wait(120)

    threading.Thread(target=server.scheduler.call, args=(hold,), daemon=True).start()
    assert holding.wait(60)
    return release


def until(condition, what: str):
    for _ in range(600):
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"never: {what}")


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_is_not_recorded_and_is_counted(tok, stream):
    """The client sends its request and leaves before the answer (mid-stream: after the first
    event): its call is cancelled, nothing of it is recorded, it is counted, and the server goes
    on."""
    task = calc_task(0, 2, 3)
    server = scripted_server(tok, [task])
    try:
        release = blocked(server)
        _, messages = CalcEnv().reset(task, 0)
        data = json.dumps(
            {"model": MODEL, "messages": messages, "user": "gone", "stream": stream}
        ).encode()
        with socket.create_connection(server.address, timeout=60) as s:
            s.sendall(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
                + data
            )
            received = b""
            while stream and b"data: " not in received:  # the role delta, sent before any token
                received += s.recv(1 << 16)
        until(lambda: server.capture.disconnected == 1, "the server saw the client leave")
        release.set()
        assert (
            post(
                server.url,
                "/chat/completions",
                {"model": MODEL, "messages": messages, "user": "next"},
            )[0]
            == 200
        )
        assert server.capture.calls("gone") == [] and len(server.capture.calls("next")) == 1
        assert len(server.engine.calls) == 1  # the cancelled call never reached the engine
    finally:
        server.stop()


# -----------------------------------------------------------------------------
# Anthropic's Messages API


def anthropic_tools() -> list[dict]:
    return [
        {
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in CalcEnv.TOOLS
    ]


def test_the_anthropic_client_plays_the_episode_our_agent_loop_plays(tok):
    """tool_use blocks out, tool_result blocks back, the session in metadata.user_id: the record is
    the trajectory agent.run_episodes builds for the same conversation, token for token, as for an
    OpenAI client."""
    anthropic = need("anthropic", "the official client of the Messages API")
    task = calc_task(0, 7, 8)
    server = scripted_server(tok, [task])
    try:
        client = anthropic.Anthropic(
            base_url=server.url[: -len("/v1")], api_key="unused", max_retries=0
        )
        _, chat = CalcEnv().reset(task, 0)
        messages, uses = [{"role": "user", "content": chat[1]["content"]}], 0
        for _ in range(4):
            reply = client.messages.create(
                model=MODEL,
                max_tokens=300,
                system=chat[0]["content"],
                messages=messages,
                tools=anthropic_tools(),
                metadata={"user_id": "claude"},
                extra_body={"temperature": 0},
            )
            messages.append(
                {
                    "role": "assistant",
                    "content": [b.model_dump(exclude_none=True) for b in reply.content],
                }
            )
            calls = [b for b in reply.content if b.type == "tool_use"]
            uses += len(calls)
            if not calls:
                assert reply.stop_reason == "end_turn" and reply.content[0].text == "ANSWER: 15"
                break
            assert reply.stop_reason == "tool_use"
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": c.id,
                            "content": str(c.input["a"] + c.input["b"]),
                        }
                        for c in calls
                    ],
                }
            )
        assert uses == 3  # two calls in turn 0, one in turn 1
        (row,), metrics = session_trajectories(server.capture.calls("claude"), "claude")
        assert metrics["serve/branched"] == 0.0
        assert_same_tokens(row, agent_trajectory(tok, task))
        assert {c.endpoint for c in server.capture.calls("claude")} == {"messages"}
    finally:
        server.stop()


def test_a_streamed_message_is_the_same_call_and_record_as_unstreamed(torch_server):
    anthropic = need("anthropic", "the official client of the Messages API")
    client = anthropic.Anthropic(
        base_url=torch_server.url[: -len("/v1")], api_key="unused", max_retries=0
    )
    kwargs = dict(
        model=MODEL,
        max_tokens=40,
        system=CalcEnv.SYSTEM,
        tools=anthropic_tools(),
        messages=[{"role": "user", "content": "Compute 4 + 5."}],
        extra_body={"seed": 11},
    )
    plain = client.messages.create(**kwargs, metadata={"user_id": "plain"})
    with client.messages.stream(**kwargs, metadata={"user_id": "streamed"}) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    same_record(*torch_server.capture.calls("plain"), *torch_server.capture.calls("streamed"))
    assert [(b.type, b.text) for b in streamed.content] == [(b.type, b.text) for b in plain.content]
    assert streamed.stop_reason == plain.stop_reason
    assert streamed.usage.output_tokens == plain.usage.output_tokens
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and kinds.count("text") > 1


def test_a_messages_request_renders_as_the_chat_request_it_stands_for(tok, model):
    """system, text, tool_use and tool_result blocks give the prompt ids that the OpenAI form of the
    conversation gives (chat.render over the translated messages), and stop_sequences stop it."""
    anthropic = need("anthropic", "the official client of the Messages API")
    task = calc_task(0, 1, 2)
    server = scripted_server(tok, [task], lambda a, b: ["Sure. ANSWER: 3 and more"])
    try:
        client = anthropic.Anthropic(
            base_url=server.url[: -len("/v1")], api_key="unused", max_retries=0
        )
        _, chat = CalcEnv().reset(task, 0)
        history = [
            {"role": "user", "content": chat[1]["content"]},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Adding."},
                    {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 1, "b": 2}},
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "3"}],
            },
        ]
        reply = client.messages.create(
            model=MODEL,
            max_tokens=50,
            system=chat[0]["content"],
            messages=history,
            tools=anthropic_tools(),
            stop_sequences=["ANSWER"],
            metadata={"user_id": "r"},
        )
        assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == "ANSWER"
        assert [b.text for b in reply.content] == ["Sure. "]
        openai_form = chat + [
            {
                "role": "assistant",
                "content": "Adding.",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
                    }
                ],
            },
            {"role": "tool", "content": "3"},
        ]
        (call,) = server.capture.calls("r")
        assert call.prompt_ids == encode(
            tok, render(openai_form, CalcEnv.TOOLS, add_generation_prompt=True)
        )
    finally:
        server.stop()


@pytest.mark.parametrize(
    "case", ["image", "thinking budget", "tool_choice", "no max_tokens", "server tool", "model"]
)
def test_bad_messages_requests_are_anthropic_errors(torch_server, case):
    anthropic = need("anthropic", "the official client of the Messages API")
    client = anthropic.Anthropic(
        base_url=torch_server.url[: -len("/v1")], api_key="unused", max_retries=0
    )
    kwargs = dict(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    bad = {
        "image": dict(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"},
                        }
                    ],
                }
            ]
        ),
        # budget_tokens must be under max_tokens (8), as Anthropic requires
        "thinking budget": dict(thinking={"type": "enabled", "budget_tokens": 1024}),
        "tool_choice": dict(tool_choice={"type": "any"}, tools=anthropic_tools()),
        "no max_tokens": dict(extra_body={"max_tokens": None}),
        "server tool": dict(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
        "model": dict(model="claude-nonexistent"),
    }[case]
    error = anthropic.NotFoundError if case == "model" else anthropic.BadRequestError
    with pytest.raises(error) as e:
        client.messages.create(**{**kwargs, **bad})
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] in (
        "invalid_request_error",
        "not_found_error",
    )
    # and the server goes on
    assert client.messages.create(**kwargs).stop_reason in ("max_tokens", "end_turn")
