"""Tests for serve.py's third dialect, OpenAI's Responses API (serve_responses.py), and for thinking
in the Messages and Responses dialects (a Qwen3 model's think block answered as thinking blocks and
reasoning items).

Oracles: the official `openai` client's responses.create and responses.stream, and the `anthropic`
client's messages.create and messages.stream, reading what the server answers; the same request
unstreamed (a streamed response is the same record and the same response); our agent loop (a
Responses client's episode is the trajectory agent.run_episodes builds, token for token);
chat.render (a conversation sent back with its thinking re-renders the very text sampled).
"""

import json

import pytest

from chat import encode, render
from conftest import need
from wings.capture import session_trajectories
from wings.serve import Server, split_thinking
from test_agent import CalcEnv, ScriptedEngine, calc_task, call_text, tok  # noqa: F401 (a fixture)
from test_serve import agent_trajectory, assert_same_tokens, post, scripted_server
from test_serve_dialects import anthropic_tools, model, same_record, torch_server  # noqa: F401 (fixtures)

MODEL = "tiny"


def openai_client(server: Server):
    openai = need("openai", "the official client of the Responses API")
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)


def response_tools() -> list[dict]:
    """CalcEnv's tools as the Responses API writes function tools (flat)."""
    return [{"type": "function", **t["function"]} for t in CalcEnv.TOOLS]


# -----------------------------------------------------------------------------
# the Responses API


def items(response) -> list[dict]:
    """A response's output items, without what each reply numbers anew (ids, call ids) and what the
    client's stream helper adds (parsed, parsed_arguments)."""

    def plain(x):
        if isinstance(x, dict):
            return {
                k: plain(v)
                for k, v in x.items()
                if k not in ("id", "call_id", "parsed", "parsed_arguments")
            }
        return [plain(v) for v in x] if isinstance(x, list) else x

    return [plain(i.model_dump()) for i in response.output]


def test_the_responses_client_plays_the_episode_our_agent_loop_plays(tok):
    """function_call items out, function_call_output items back (the output items sent back as they
    came), instructions as the system prompt, the session as `user`: the record is the trajectory
    agent.run_episodes builds for the same conversation, token for token."""
    task = calc_task(0, 7, 8)
    server = scripted_server(tok, [task])
    try:
        client = openai_client(server)
        _, chat = CalcEnv().reset(task, 0)
        items, uses = [{"role": "user", "content": chat[1]["content"]}], 0
        for _ in range(4):
            reply = client.responses.create(
                model=MODEL,
                instructions=chat[0]["content"],
                input=items,
                tools=response_tools(),
                max_output_tokens=300,
                temperature=0,
                user="codex",
                store=False,
            )
            items += [item.model_dump(exclude_none=True) for item in reply.output]
            calls = [item for item in reply.output if item.type == "function_call"]
            uses += len(calls)
            if not calls:
                assert reply.status == "completed" and reply.output_text == "ANSWER: 15"
                break
            for c in calls:
                args = json.loads(c.arguments)
                output = str(args["a"] + args["b"])
                items.append(
                    {"type": "function_call_output", "call_id": c.call_id, "output": output}
                )
        assert uses == 3  # two calls in turn 0, one in turn 1
        (row,), metrics = session_trajectories(server.capture.calls("codex"), "codex")
        assert metrics["serve/branched"] == 0.0
        assert_same_tokens(row, agent_trajectory(tok, task))
        assert {c.endpoint for c in server.capture.calls("codex")} == {"responses"}
    finally:
        server.stop()


def test_a_streamed_response_is_the_same_call_and_response_as_unstreamed(torch_server):
    """responses.stream's final response is responses.create's (the same seed): its items, text,
    status and usage; the two records are the same; the events come in the Responses order."""
    client = openai_client(torch_server)
    kwargs = dict(
        model=MODEL,
        instructions=CalcEnv.SYSTEM,
        tools=response_tools(),
        input=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "4 + 5?"},
        ],
        max_output_tokens=40,
        extra_body={"seed": 11},
    )
    plain = client.responses.create(**kwargs, user="plain")
    with client.responses.stream(**kwargs, user="streamed") as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    # the last event carries the whole response (the client's get_final_response() reads only
    # response.completed, and 40 tokens may end as response.incomplete)
    streamed = events[-1].response
    same_record(*torch_server.capture.calls("plain"), *torch_server.capture.calls("streamed"))
    assert items(streamed) == items(plain) and streamed.output_text == plain.output_text
    assert (streamed.status, streamed.usage) == (plain.status, plain.usage)
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert kinds.count("response.output_text.delta") > 1
    numbers = [e for e in kinds if e.startswith("response.output_item")]
    assert numbers[0] == "response.output_item.added"


def test_a_streamed_function_call_is_the_unstreamed_one(tok):
    task = calc_task(0, 2, 3)
    server = scripted_server(tok, [task], lambda a, b: [call_text(a, b, content="Adding.")])
    try:
        client = openai_client(server)
        kwargs = dict(model=MODEL, input=task.prompt, tools=response_tools(), temperature=0)
        plain = client.responses.create(**kwargs)
        with client.responses.stream(**kwargs) as stream:
            kinds = [event.type for event in stream]
            streamed = stream.get_final_response()
        assert [i.type for i in plain.output] == ["message", "function_call"]
        assert plain.output[1].name == "add" and json.loads(plain.output[1].arguments) == {
            "a": 2,
            "b": 3,
        }
        assert items(streamed) == items(plain)
        assert "response.function_call_arguments.delta" in kinds
        assert "response.function_call_arguments.done" in kinds
    finally:
        server.stop()


def test_built_in_tools_and_ignored_fields_are_dropped_and_counted(tok):
    """What Codex sends beside its function tools (a web_search tool, reasoning.summary, include,
    store, prompt_cache_key, client_metadata, parallel_tool_calls) is served, not refused; the
    prompt is the one without them; each is counted in GET /health."""
    task = calc_task(0, 2, 3)
    server = scripted_server(tok, [task], lambda a, b: ["ANSWER: 5"])
    try:
        body = {
            "model": MODEL,
            "instructions": CalcEnv.SYSTEM,
            "input": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": task.prompt}],
                }
            ],
            "tools": [*response_tools(), {"type": "web_search"}],
            "reasoning": {"summary": "auto"},
            "include": ["reasoning.encrypted_content"],
            "store": False,
            "prompt_cache_key": "k",
            "client_metadata": {"a": "b"},
            "parallel_tool_calls": True,
            "stream": False,
        }
        status, reply = post(server.url, "/responses", body, {"X-Session-Id": "s"})
        assert status == 200 and reply["output"][0]["content"][0]["text"] == "ANSWER: 5"
        (call,) = server.capture.calls("s")
        _, chat = CalcEnv().reset(task, 0)
        assert call.prompt_ids == encode(
            tok, render(chat, CalcEnv.TOOLS, add_generation_prompt=True)
        )
        health = json.loads(
            __import__("urllib.request").request.urlopen(server.url[:-3] + "/health").read()
        )
        assert health["ignored"] == {
            f"responses:{k}": 1
            for k in (
                "tools.web_search",
                "reasoning.summary",
                "include",
                "store",
                "prompt_cache_key",
                "client_metadata",
                "parallel_tool_calls",
            )
        }
    finally:
        server.stop()


@pytest.mark.parametrize(
    "case",
    ["previous_response_id", "image", "tool_choice", "text format", "item_reference", "model"],
)
def test_bad_responses_requests_are_openai_errors(torch_server, case):
    openai = need("openai", "the official client of the Responses API")
    client = openai_client(torch_server)
    kwargs = dict(model=MODEL, input="hi", max_output_tokens=8)
    bad = {
        "previous_response_id": dict(previous_response_id="resp_1"),
        "image": dict(
            input=[
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}],
                }
            ]
        ),
        "tool_choice": dict(tool_choice="required", tools=response_tools()),
        "text format": dict(text={"format": {"type": "json_object"}}),
        "item_reference": dict(input=[{"type": "item_reference", "id": "msg_1"}]),
        "model": dict(model="gpt-nonexistent"),
    }[case]
    error = openai.NotFoundError if case == "model" else openai.BadRequestError
    with pytest.raises(error) as e:
        client.responses.create(**{**kwargs, **bad})
    assert set(e.value.body) >= {"message", "type", "param", "code"}
    # and the server goes on
    assert client.responses.create(**kwargs).status in ("completed", "incomplete")


def test_a_response_cut_by_max_output_tokens_is_incomplete(torch_server):
    client = openai_client(torch_server)
    reply = client.responses.create(model=MODEL, input="hi", max_output_tokens=3, temperature=0)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.output_tokens == 3


# -----------------------------------------------------------------------------
# thinking


THOUGHT = "I add 2 and 3.\nThat is 5."


def thinking_server(tok, script, chat_format="qwen3") -> Server:
    """A scripted server whose script answers the task's every turn; Qwen3's format."""
    server = Server(
        ScriptedEngine(tok, script), tok, MODEL, chat_format=chat_format, max_model_len=4096
    )
    server.start()
    return server


def test_split_thinking():
    assert split_thinking("<think>\nabc\n</think>\n\nhi") == ("abc", "hi")
    assert split_thinking("hi <think>") == (None, "hi <think>")
    assert split_thinking("<think>\nab") == ("ab", "")
    # a partial answer keeps back what may still change
    assert split_thinking("<thi", final=False) == (None, "")
    assert split_thinking("<think>\nab\n</thi", final=False) == ("ab", "")
    assert split_thinking("<think>\nab\n", final=False) == ("ab", "")


def test_claude_thinking_on_qwen3_is_thinking_blocks_and_trains_as_one_row(tok):
    """thinking enabled: a Qwen3 model's think block comes back as a thinking block, streamed as
    thinking_delta, the same as unstreamed; sent back with the tool_use block (as Claude Code
    does), the conversation re-renders the very text sampled, so the session is one row."""
    anthropic = need("anthropic", "the official client of the Messages API")
    task = calc_task(0, 2, 3)
    first = f"<think>\n{THOUGHT}\n</think>\n\n" + call_text(2, 3, content="Adding.")
    server = thinking_server(tok, {task.prompt: [first, "<think>\nDone.\n</think>\n\nANSWER: 5"]})
    try:
        client = anthropic.Anthropic(base_url=server.url[:-3], api_key="unused", max_retries=0)
        kwargs = dict(
            model=MODEL,
            max_tokens=2000,
            system=CalcEnv.SYSTEM,
            tools=anthropic_tools(),
            thinking={"type": "enabled", "budget_tokens": 1024},
            extra_query={"beta": "true"},
            extra_body={"context_management": {"edits": [{"type": "clear_thinking_20251015"}]}},
        )
        messages = [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": task.prompt, "cache_control": {"type": "ephemeral"}}
                ],
            }
        ]
        reply = client.messages.create(**kwargs, messages=messages, metadata={"user_id": "c"})
        assert [b.type for b in reply.content] == ["thinking", "text", "tool_use"]
        assert reply.content[0].thinking == THOUGHT and reply.content[1].text == "Adding."
        with client.messages.stream(**kwargs, messages=messages) as stream:
            kinds = [e.delta.type if e.type == "content_block_delta" else e.type for e in stream]
            streamed = stream.get_final_message()
        assert [b.model_dump() for b in streamed.content] == [
            {**b.model_dump(), **({"id": streamed.content[2].id} if b.type == "tool_use" else {})}
            for b in reply.content
        ]
        assert "thinking_delta" in kinds
        messages += [
            {"role": "assistant", "content": [b.model_dump() for b in reply.content]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": reply.content[2].id, "content": "5"}
                ],
            },
        ]
        last = client.messages.create(**kwargs, messages=messages, metadata={"user_id": "c"})
        assert [(b.type, getattr(b, "text", None)) for b in last.content] == [
            ("thinking", None),
            ("text", "ANSWER: 5"),
        ]
        (row,), metrics = session_trajectories(server.capture.calls("c"), "c")
        assert metrics["serve/branched"] == 0.0 and row.num_turns == 2
    finally:
        server.stop()


def test_thinking_off_or_on_a_format_that_cannot_think(tok):
    """thinking absent: Qwen3 answers after the empty think block (enable_thinking false); asked of
    qwen2.5, which cannot think, the request is served without it and counted."""
    anthropic = need("anthropic", "the official client of the Messages API")
    task = calc_task(0, 2, 3)
    for fmt in ("qwen3", "qwen2.5"):
        server = thinking_server(tok, {task.prompt: ["ANSWER: 5"]}, chat_format=fmt)
        try:
            client = anthropic.Anthropic(base_url=server.url[:-3], api_key="unused", max_retries=0)
            messages = [{"role": "user", "content": task.prompt}]
            thinking = {"type": "enabled", "budget_tokens": 1024} if fmt == "qwen2.5" else None
            extra = {"thinking": thinking} if thinking else {}
            reply = client.messages.create(
                model=MODEL, max_tokens=2000, messages=messages, metadata={"user_id": "s"}, **extra
            )
            assert [b.type for b in reply.content] == ["text"]
            (call,) = server.capture.calls("s")
            want = render(
                messages, add_generation_prompt=True, chat_format=fmt, enable_thinking=False
            )
            assert call.prompt_ids == encode(tok, want)
            assert dict(server.ignored) == ({"messages:thinking": 1} if fmt == "qwen2.5" else {})
        finally:
            server.stop()


def test_a_qwen3_response_has_its_reasoning_item_and_it_goes_back(tok):
    """Responses on Qwen3: the think block is a reasoning item (its text also as encrypted_content
    when asked, as Codex asks), streamed as reasoning_text deltas; sent back, the conversation
    re-renders the text sampled (one row)."""
    task = calc_task(0, 2, 3)
    first = f"<think>\n{THOUGHT}\n</think>\n\n" + call_text(2, 3)
    server = thinking_server(tok, {task.prompt: [first, "<think>\nOk.\n</think>\n\nANSWER: 5"]})
    try:
        client = openai_client(server)
        kwargs = dict(
            model=MODEL,
            instructions=CalcEnv.SYSTEM,
            tools=response_tools(),
            include=["reasoning.encrypted_content"],
            store=False,
        )
        items = [{"role": "user", "content": task.prompt}]
        reply = client.responses.create(**kwargs, input=items, user="r")
        assert [i.type for i in reply.output] == ["reasoning", "function_call"]
        assert reply.output[0].content[0].text == THOUGHT == reply.output[0].encrypted_content
        with client.responses.stream(**kwargs, input=items) as stream:
            kinds = [e.type for e in stream]
            streamed = stream.get_final_response()
        assert "response.reasoning_text.delta" in kinds
        assert [i.type for i in streamed.output] == ["reasoning", "function_call"]
        assert streamed.output[0].content == reply.output[0].content
        # Codex sends back the reasoning item with its encrypted_content only
        reasoning = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": THOUGHT}
        call = reply.output[1]
        items += [
            reasoning,
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "5"},
        ]
        last = client.responses.create(**kwargs, input=items, user="r")
        assert last.output_text == "ANSWER: 5"
        (row,), metrics = session_trajectories(server.capture.calls("r"), "r")
        assert metrics["serve/branched"] == 0.0 and row.num_turns == 2
    finally:
        server.stop()


class ThinkingAtLength(ScriptedEngine):
    """A Qwen3 model that would think forever: turn 0's script is a think block longer than any
    budget; a prompt whose think block was closed for it (it ends with "</think>\\n\\n") is
    answered with "ANSWER: 5"."""

    def generate(self, prompts, params):
        out = super().generate(prompts, params)
        for k, p in enumerate(prompts):
            if self.tok.decode(p, skip_special_tokens=False).endswith("</think>\n\n"):
                ids = encode(self.tok, "ANSWER: 5<|im_end|>")
                out[k] = type(out[k])(ids, [-0.5] * len(ids), "stop")
        return out


def test_a_thinking_budget_closes_the_think_block_and_the_closing_is_not_trained(tok):
    """thinking.budget_tokens = 1024 on a model that thinks on: the first 1024 tokens are its
    thinking, "\\n</think>\\n\\n" closes the block (the server's ids, not the model's), and the
    answer goes on within max_tokens. Two calls in the capture, one row: the closing ids are
    prompt ids (mask 0), every sampled token is trained; streamed equals unstreamed."""
    anthropic = need("anthropic", "the official client of the Messages API")
    task = calc_task(0, 2, 3)
    engine = ThinkingAtLength(tok, {task.prompt: ["<think>\n" + "a " * 3000]})
    server = Server(engine, tok, MODEL, chat_format="qwen3", max_model_len=16384)
    server.start()
    try:
        client = anthropic.Anthropic(base_url=server.url[:-3], api_key="unused", max_retries=0)
        kwargs = dict(
            model=MODEL,
            max_tokens=4000,
            messages=[{"role": "user", "content": task.prompt}],
            thinking={"type": "enabled", "budget_tokens": 1024},
        )
        reply = client.messages.create(**kwargs, metadata={"user_id": "b"})
        assert [b.type for b in reply.content] == ["thinking", "text"]
        assert reply.content[1].text == "ANSWER: 5" and reply.stop_reason == "end_turn"
        answer = encode(tok, "ANSWER: 5<|im_end|>")
        assert reply.usage.output_tokens == 1024 + len(answer)
        first, second = server.capture.calls("b")
        closing = encode(tok, "\n</think>\n\n")
        assert len(first.samples[0].token_ids) == 1024
        assert second.prompt_ids == first.prompt_ids + first.samples[0].token_ids + closing
        (row,), _ = session_trajectories(server.capture.calls("b"), "b")
        assert sum(row.loss_mask) == 1024 + len(answer)
        assert row.loss_mask[-len(answer) - len(closing) : -len(answer)] == [0] * len(closing)
        with client.messages.stream(**kwargs, metadata={"user_id": "s"}) as stream:
            streamed = stream.get_final_message()
        assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in reply.content]
        assert len(server.capture.calls("s")) == 2
    finally:
        server.stop()


def test_head_is_answered_without_a_body_and_the_connection_goes_on(torch_server):
    """Claude Code's runtime sends HEAD / before its first request, on the connection it then
    uses: the answer must be a head alone, or the next answer on that connection would be read
    after a stray body (http.client reads no body after HEAD, as every client does)."""
    import http.client

    host, port = torch_server.address
    c = http.client.HTTPConnection(host, port, timeout=30)
    c.request("HEAD", "/")
    head = c.getresponse()
    assert head.status == 200 and head.read() == b""
    c.request("GET", "/health")
    after = c.getresponse()
    assert after.status == 200 and json.loads(after.read())["status"] == "ok"
    c.close()
