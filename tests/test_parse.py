"""Tests for tool_calls.py's tool-call parsing on bad model output: hand-written cases for each kind
of damage, parity of the repairing reader with json.loads on valid JSON, and property-based tests
(hypothesis) over random and mutated tool calls: no exception escapes, time stays bounded,
assistant_message always re-renders to the text it came from. The oracle for what a call should be
is the call the text was made from (or json.loads, for the parity test), never the parser's own
output.
"""

import json
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import env as env_module
import tool_calls
from chat import make_action, parse_assistant_message, render
from env import ToolCall
from tool_calls import MAX_BLOCKS, MAX_PARSE_CHARS, loads_lenient, parse_tool_calls

U = {"role": "user", "content": "What is 2 + 3?"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]
# The parser promises bounded time: no input makes it scan super-linearly
# (ReDoS, quadratic rescans). These tests guard that promise, not a speed target
# (bench/ holds those): BOUND_S of this thread's CPU time, the best of three parses,
# so neither another process on the cores nor one preemption or garbage collection
# can fail them, while a super-linear blowup on these inputs costs seconds.
BOUND_S = 0.05


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def canonical(name: str, arguments: dict) -> str:
    return block(json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False))


def rerenders(text: str) -> bool:
    """render() of parse_assistant_message(text) writes back exactly `text` (qwen2.5)."""
    prompt = render([U], TOOLS, add_generation_prompt=True)
    return render([U, parse_assistant_message(text)], TOOLS) == prompt + text + "<|im_end|>\n"


def timed_parse(text: str):
    """parse_tool_calls(text) -> (calls, error, the least CPU seconds of this thread over three
    parses)."""
    best = float("inf")
    for _ in range(3):
        start = time.thread_time()
        calls, error = parse_tool_calls(text)
        best = min(best, time.thread_time() - start)
    return calls, error, best


# -----------------------------------------------------------------------------
# well-formed: exactly as before


def test_well_formed_calls_are_unchanged():
    text = (
        "Let me add.\n"
        + canonical("add", {"a": 2, "b": 3})
        + "\n"
        + canonical("lookup", {"word": "café"})
    )
    calls, error = parse_tool_calls(text)
    assert error is None and calls == [
        ToolCall("add", {"a": 2, "b": 3}),
        ToolCall("lookup", {"word": "café"}),
    ]
    assert parse_assistant_message(text) == {
        "role": "assistant",
        "content": "Let me add.",
        "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
            {"type": "function", "function": {"name": "lookup", "arguments": {"word": "café"}}},
        ],
    }
    assert rerenders(text)


def test_well_formed_but_not_canonical_stays_in_content():
    # parsed as a call, but kept verbatim in the message,
    # so the conversation re-renders to what was sampled
    for text in [
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>',  # no newlines
        canonical("add", {"a": 1}) + "\nand some text after",  # not at the end
        '<tool_call>\n{"tool": "add", "args": {"a": 1}}\n</tool_call>',  # aliases
        # a JSON string
        '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>',
    ]:
        calls, error = parse_tool_calls(text)
        assert calls == [ToolCall("add", {"a": 1})] and error is None
        assert parse_assistant_message(text) == {
            "role": "assistant",
            "content": text,
        } and rerenders(text)


# -----------------------------------------------------------------------------
# damaged calls that can still be read: the call is recovered, the damage is reported

CODE = "x = 1\nprint(x)"
RECOVERABLE = [
    # (text, the call it must give, a word of the error)
    (
        block('```json\n{"name": "add", "arguments": {"a": 1}}\n```'),
        ("add", {"a": 1}),
        "code fence",
    ),
    (
        '<tool_call>```\n{"name": "add", "arguments": {"a": 1}}```</tool_call>',
        ("add", {"a": 1}),
        "code fence",
    ),
    (
        block('{"name": "add", "arguments": {"a": 1, "b": 2,},}'),
        ("add", {"a": 1, "b": 2}),
        "trailing commas",
    ),
    (
        block('{"name": "f", "arguments": {"xs": [1, 2, ], }}'),
        ("f", {"xs": [1, 2]}),
        "trailing commas",
    ),
    (block("{'name': 'add', 'arguments': {'a': 1}}"), ("add", {"a": 1}), "single quotes"),
    (
        block("{'name': 'say', 'arguments': {'text': 'it\\'s \"quoted\"'}}"),
        ("say", {"text": 'it\'s "quoted"'}),
        "single quotes",
    ),
    (
        block('{"name": "f", "arguments": {"x": True, "y": None, "z": False}}'),
        ("f", {"x": True, "y": None, "z": False}),
        "Python literals",
    ),
    (
        block('{"name": "python_eval", "arguments": {"code": "x = 1\nprint(x)"}}'),
        ("python_eval", {"code": CODE}),
        "raw control characters",
    ),
    (block('{"name": "add", "arguments": {"a": 1}'), ("add", {"a": 1}), "missing closing brackets"),
    (
        block('{"name": "add", "arguments": {"a": [1, 2'),
        ("add", {"a": [1, 2]}),
        "missing closing brackets",
    ),
    (block('{"name": "add", "arguments": {"a": 1}}}'), ("add", {"a": 1}), "text after the JSON"),
    (
        block('Calling add: {"name": "add", "arguments": {"a": 1}}'),
        ("add", {"a": 1}),
        "text before the JSON",
    ),
    (block('{name: "add", arguments: {a: 1}}'), ("add", {"a": 1}), "unquoted keys"),
    # a JSON string
    (block('{"name": "add", "arguments": "{\'a\': 1}"}'), ("add", {"a": 1}), "single quotes"),
    (
        block('{"name": "python_eval", "arguments": {"code": "re.findall(\'\\d+\', s)",}}'),
        ("python_eval", {"code": "re.findall('\\d+', s)"}),
        "invalid escapes",
    ),
    (
        block('{"name": "f", "arguments": {"s": "\\ud83d\\ude00 \\u00e9 \\n",}}'),
        ("f", {"s": "\U0001f600 é \n"}),
        "trailing commas",
    ),
    # braces and quotes inside strings do not confuse the reader
    (
        block(
            "{'name': 'python_eval', 'arguments': {'code': 'd = {\"a\": \"}}\"}; print(\"{\")'}}"
        ),
        ("python_eval", {"code": 'd = {"a": "}}"}; print("{")'}),
        "single quotes",
    ),
    # a missing </tool_call> at the end (a generation cut by max_tokens):
    # the call if its JSON is complete
    (
        '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n',
        ("add", {"a": 1}),
        "not closed (truncated",
    ),
    (
        'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}',
        ("add", {"a": 1}),
        "not closed (truncated",
    ),
]


@pytest.mark.parametrize("text, expected, needle", RECOVERABLE)
def test_damaged_calls_are_recovered_and_reported(text, expected, needle):
    calls, error, seconds = timed_parse(text)
    assert calls == [ToolCall(*expected)] and error is not None and needle in error, error
    assert seconds < BOUND_S
    action = make_action(text)
    assert action.tool_calls == (ToolCall(*expected),) and action.parse_error == error
    # verbatim: it was not canonical
    assert parse_assistant_message(text) == {"role": "assistant", "content": text}


UNREADABLE = [
    ('<tool_call>\n{"name": "add", "arguments": {"a"', "not closed"),  # cut inside the JSON
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1}', "not closed"),  # cut: no closing added
    # never run cut code
    ('<tool_call>\n{"name": "python_eval", "arguments": {"code": "print(1', "not closed"),
    (block('{"name": "add", "arguments": [1, 2]}'), "not an object"),
    (block('{"name": "add", "arguments": 5}'), "not an object"),
    (block('{"name": "add", "arguments": "1 + 1"}'), "not valid JSON"),
    (block('{"name": "add", "arguments": "[1]"}'), "not an object"),
    (block('"add"'), "not an object"),
    (block('{"arguments": {"a": 1}}'), "without a name"),
    (block('{"name": 7, "arguments": {}}'), "without a name"),
    (block('{"name": " ", "arguments": {}}'), "without a name"),  # blank, like ""
    (block('{"name": "\\t\\n \\u00a0", "arguments": {}}'), "without a name"),
    (block('{"tool": "   ", "args": {"a": 1}}'), "without a name"),
    (block('{"name": "' + "n" * 100 + '", "arguments": {}}'), "longer than"),
    (block('{"name": "add" "arguments": {}}'), "invalid JSON"),  # a missing comma
    # a second object cut short: not run
    (block('{"name": "add", "arguments": {"a": 1}} {"name": "b"'), None),
    (block(""), "invalid JSON"),
    (block("hello"), "invalid JSON"),
]


@pytest.mark.parametrize("text, needle", UNREADABLE)
def test_unreadable_calls_are_reported(text, needle):
    calls, error, seconds = timed_parse(text)
    assert error is not None and seconds < BOUND_S
    if needle is None:
        assert calls == [ToolCall("add", {"a": 1})]
    else:
        assert calls == [] and needle in error, error
    assert parse_assistant_message(text) == {"role": "assistant", "content": text}


def test_several_calls_in_one_message_mixed():
    text = (
        "First.\n"
        + canonical("add", {"a": 1})
        + "\nthen "
        + block("{'name': 'add', 'arguments': {'a': 2}}")
        + "\n"
        + block('{"name": "add", "arguments": [3]}')
        + "\n"
        + canonical("teleport", {"to": "mars"})
    )
    calls, error = parse_tool_calls(text)
    assert calls == [
        ToolCall("add", {"a": 1}),
        ToolCall("add", {"a": 2}),
        ToolCall("teleport", {"to": "mars"}),
    ]
    assert "single quotes" in error and "not an object" in error
    msg = parse_assistant_message(text)  # only the canonical run at the end leaves the content
    assert msg["tool_calls"] == [
        {"type": "function", "function": {"name": "teleport", "arguments": {"to": "mars"}}}
    ]
    assert rerenders(text)


# -----------------------------------------------------------------------------
# a tag inside a JSON string does not end the block;
# an unbalanced quote does not swallow the calls after it

PRINT_OPEN = {"code": 'print("<tool_call>")'}
TAG_IN_STRING = [
    # (the call, written canonically: its block holds a tag inside a JSON string)
    ("python_exec", PRINT_OPEN),
    ("python_exec", {"code": "print('</tool_call>')"}),
    # escaped quotes, both tags
    ("python_exec", {"code": 's = "</tool_call>\\n<tool_call>"\nprint(s)'}),
    # a string ending in a backslash
    ("lookup", {"word": "<tool_call>", "path": "C:\\", "then": "</tool_call>"}),
    ("<tool_call>", {}),  # in the name
]


@pytest.mark.parametrize("name, arguments", TAG_IN_STRING)
def test_tag_inside_a_json_string_does_not_end_the_block(name, arguments):
    call = ToolCall(name, arguments)
    for text in [
        canonical(name, arguments),
        "Run it.\n" + canonical(name, arguments) + "\n" + canonical("add", {"a": 1}),
    ]:
        calls, error, seconds = timed_parse(text)
        assert (
            calls == [call] + [ToolCall("add", {"a": 1})] * ("Run it." in text) and error is None
        ), error
        assert seconds < BOUND_S
        msg = parse_assistant_message(text)  # canonical: the calls leave the content
        assert [c["function"] for c in msg["tool_calls"]] == [
            {"name": c.name, "arguments": c.arguments} for c in calls
        ]
        assert rerenders(text)


def test_tag_inside_a_json_string_with_other_damage():
    code = "print('</tool_call>')\nx = 1"  # a raw newline: repaired, reported
    text = '<tool_call>{"name": "python_exec", "arguments": {"code": "' + code + '"}}</tool_call>'
    calls, error = parse_tool_calls(text)
    assert calls == [ToolCall("python_exec", {"code": code})] and "raw control characters" in error
    # cut by max_tokens after a complete call: read, reported as not closed
    calls, error = parse_tool_calls(
        '<tool_call>\n{"name": "python_exec", "arguments": {"code": "print(\'<tool_call>\')"}}'
    )
    assert (
        calls == [ToolCall("python_exec", {"code": "print('<tool_call>')"})]
        and "not closed (truncated" in error
    )
    # not closed before the next block
    text = (
        '<tool_call>{"name": "a", "arguments": {"s": "<tool_call>"}}'
        '<tool_call>{"name": "b"}</tool_call>'
    )
    calls, error = parse_tool_calls(text)
    assert (
        calls == [ToolCall("a", {"s": "<tool_call>"}), ToolCall("b", {})]
        and "not closed before the next" in error
    )
    assert rerenders(text)


BROKEN_A = block('{"name": "a", "arguments": {"x": "oops}}')  # an unbalanced quote
UNBALANCED = [
    # (text, the calls it must give): what the block-by-block reading gives,
    # as before the string-aware scan
    (BROKEN_A + "\n" + canonical("b", {"y": 1}), [ToolCall("b", {"y": 1})]),
    # two of them
    (
        BROKEN_A
        + "\n"
        + block('{"name": "b", "arguments": {"y": "z}}')
        + "\n"
        + canonical("c", {}),
        [ToolCall("c", {})],
    ),
    (
        BROKEN_A + '\nsay "hi"\n' + canonical("b", {}) + "\n" + canonical("c", {}),
        [ToolCall("b", {}), ToolCall("c", {})],
    ),
    (
        '<tool_call>{"name": "a", "arguments": {"x": "it"s"}}</tool_call>' + canonical("b", {}),
        [ToolCall("b", {})],
    ),
    # the longer reading gives a call but leaves text after its JSON
    # (here, the call it ran over): refused
    (
        '<tool_call>{"name": "f", "arguments": {"a": "<tool_call>"}}</tool_cal>\n'
        '{"name": "add", "arguments": {}}</tool_call>',
        [ToolCall("add", {})],
    ),
]


@pytest.mark.parametrize("text, expected", UNBALANCED)
def test_unbalanced_quote_does_not_swallow_the_calls_after_it(text, expected):
    calls, error, seconds = timed_parse(text)
    assert calls == expected and "invalid JSON" in error and seconds < BOUND_S
    assert rerenders(text)


# -----------------------------------------------------------------------------
# several JSON objects in one <tool_call>:
# each is read as a call, and the error says so (one object per tag)

A, B = '{"name": "a", "arguments": {"x": 1}}', '{"name": "b", "arguments": {}}'
SEVERAL = [
    # (text, the calls it must give, words of the error)
    ("<tool_call>" + A + B + "</tool_call>", ["a", "b"], ["2 JSON objects", "read as 2 calls"]),
    (block(A + "\n" + B), ["a", "b"], ["2 JSON objects"]),
    (block(A + "\n\n" + B + " " + A), ["a", "b", "a"], ["3 JSON objects", "read as 3 calls"]),
    # repaired too
    (block(A.replace('"', "'") + "\n" + B), ["a", "b"], ["2 JSON objects", "single quotes"]),
    (
        block(A + "\n" + '{"name": "b", "arguments": [1]}'),
        ["a"],
        ["2 JSON objects", "read as 1 call ", "not an object"],
    ),
    (block(A + "\n" + B + "\n```"), ["a", "b"], ["2 JSON objects", "code fence"]),
    ("<tool_call>\n" + A + "\n" + B, ["a", "b"], ["2 JSON objects", "not closed (truncated"]),
]


@pytest.mark.parametrize("text, names, needles", SEVERAL)
def test_several_objects_in_one_tag_are_several_calls(text, names, needles):
    calls, error, seconds = timed_parse(text)
    by_name = {"a": ToolCall("a", {"x": 1}), "b": ToolCall("b", {})}
    assert calls == [by_name[n] for n in names] and seconds < BOUND_S
    assert error is not None and all(n in error for n in needles), error
    # not canonical
    assert parse_assistant_message(text) == {"role": "assistant", "content": text} and rerenders(
        text
    )


def test_several_objects_in_one_tag_run_in_the_env_and_keep_the_message_exact():
    text = block(A + "\n" + B) + "\n" + canonical("c", {})
    calls, error = parse_tool_calls(text)
    assert (
        calls == [ToolCall("a", {"x": 1}), ToolCall("b", {}), ToolCall("c", {})]
        and "2 JSON objects" in error
    )
    msg = parse_assistant_message(text)  # the canonical block at the end leaves the content
    assert msg["content"] == block(A + "\n" + B) and [
        c["function"]["name"] for c in msg["tool_calls"]
    ] == ["c"]
    assert rerenders(text)
    toy = env_module.make_env("toy_math")  # both calls run, the parse failure is counted
    state, _ = toy.reset(toy.sample_tasks("train", 1, seed=0)[0], seed=0)
    two = block(
        '{"name": "python_eval", "arguments": {"code": "2 + 3"}}\n'
        '{"name": "python_eval", "arguments": {"code": "4 * 5"}}'
    )
    state, obs, reward, done, info = toy.step(state, make_action(two))
    assert [m["content"] for m in obs[:2]] == ["5", "20"] and obs[2]["name"] == "error"
    assert "2 JSON objects" in obs[2]["content"] and (state.parse_failures, state.tool_calls) == (
        1,
        2,
    )


def test_several_objects_count_towards_the_call_limit():
    text = (
        block("\n".join([B] * 10)) + "\n" + "\n".join(canonical("c", {"i": i}) for i in range(10))
    )
    calls, error = parse_tool_calls(text)
    assert calls == [ToolCall("b", {})] * 10 + [ToolCall("c", {"i": i}) for i in range(6)]
    assert f"more than {MAX_BLOCKS} tool calls" in error and rerenders(text)


def test_unknown_tool_parses_and_the_env_reports_it():
    text = canonical("teleport", {"to": "mars"})
    assert parse_tool_calls(text) == ([ToolCall("teleport", {"to": "mars"})], None)
    toy = env_module.make_env("toy_math")
    state, _ = toy.reset(toy.sample_tasks("train", 1, seed=0)[0], seed=0)
    state, obs, reward, done, info = toy.step(state, make_action(text))
    assert (
        obs[0]["content"].startswith("Error: unknown tool 'teleport'") and info["tool_errors"] == 1
    )


def test_recovered_call_runs_in_the_env():
    toy = env_module.make_env("toy_math")
    state, _ = toy.reset(toy.sample_tasks("train", 1, seed=0)[0], seed=0)
    action = make_action(
        "<tool_call>\n{'name': 'python_eval', 'arguments': {'code': '12 * 7'}}\n</tool_call>"
    )
    state, obs, reward, done, info = toy.step(state, action)
    assert obs[0] == {"role": "tool", "name": "python_eval", "content": "84"}
    assert obs[1]["name"] == "error" and "single quotes" in obs[1]["content"]
    assert (state.parse_failures, state.tool_calls, done) == (1, 1, False)


def test_limits_on_size_and_count():
    many = "\n".join(canonical("add", {"a": i}) for i in range(MAX_BLOCKS + 5))
    calls, error = parse_tool_calls(many)
    assert len(calls) == MAX_BLOCKS and f"more than {MAX_BLOCKS} tool calls" in error
    # very long arguments: fine when well formed, an error (not a hang) when not
    long_code = "x" * 50_000
    assert parse_tool_calls(canonical("python_eval", {"code": long_code})) == (
        [ToolCall("python_eval", {"code": long_code})],
        None,
    )
    calls, error, seconds = timed_parse(
        block('{"name": "python_eval", "arguments": {"code": "' + long_code + '",}}')
    )
    assert calls == [] and "too long to repair" in error and seconds < BOUND_S
    calls, error = parse_tool_calls("x" * MAX_PARSE_CHARS + canonical("add", {}))
    assert calls == [] and "longer than" in error


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>" * 50_000,
        "</tool_call>" * 50_000,
        "<tool_call>{" * 30_000 + "</tool_call>",
        block("[" * 19_000),
        block("{'a':" * 5_000),
        block("[" * 100_000),
        block('"' * 19_000),
        block("{'k': [" + "'a'," * 4_900 + "]}"),
        block('{"s": "' + "\\d" * 9_000 + '",}'),
        block("{" + "'a': 1, " * 2_400 + "}"),
        "x" * 1_000_000,
        "<tool_call>" + "\\" * 99_000,
        "<tool_call>\n" + '{"name": "a", "arguments": {"code": "' + "\\n" * 40_000 + '"}}',
        # tags inside strings, quotes that flip at every tag,
        # escaped quotes, many objects in one tag
        '<tool_call>{"name": "a", "arguments": {"x": "' + "</tool_call>" * 70 + '"}}</tool_call>',
        ('<tool_call>"' + "x" * 1_500) * 64,
        '"<tool_call>' * 8_000,
        '<tool_call>"</tool_call>' * 4_000,
        '<tool_call>"' + '\\"' * 49_000 + '</tool_call>"',
        "<tool_call>" + '{"name": "a"}\n' * 7_000 + "</tool_call>",
        "<tool_call>" + "{'name': 'a'}" * 1_500 + "</tool_call>",
        '<tool_call>{"x": "' + '</tool_call>\n<tool_call>{"name": "a", "arguments": {}}' * 1_000,
    ],
)
def test_adversarial_inputs_take_milliseconds(text):
    assert timed_parse(text)[2] < BOUND_S
    assert rerenders(text) or len(text) > 200_000  # (rendering megabytes is not what is timed here)


# -----------------------------------------------------------------------------
# the repairing reader agrees with json.loads wherever json.loads succeeds

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=4), st.booleans())
def test_lenient_reader_matches_json_on_valid_json(obj, indent):
    text = json.dumps(obj, indent=2 if indent else None, ensure_ascii=bool(indent))
    value, repairs = loads_lenient(text, close_at_end=False)
    assert value == json.loads(text) and repairs == []


# -----------------------------------------------------------------------------
# properties over random and mutated tool calls

NAMES = st.sampled_from(["add", "python_eval", "finish", "teleport", "x" * 70]) | st.text(
    min_size=1, max_size=12
)
ARGUMENTS = st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=4)
NASTY = [
    "{",
    "}",
    "[",
    "]",
    '"',
    "'",
    ",",
    ":",
    "\\",
    "\n",
    "```",
    "<tool_call>",
    "</tool_call>",
    "True",
    "null",
    "\\u",
    "\\ud83d",
    "é",
    "<|im_end|>",
    " ",
]


@st.composite
def messages(draw):
    """A message made of optional text and canonical calls, then damaged by a few random edits."""
    parts, calls = [], []
    if draw(st.booleans()):
        parts.append(draw(st.text(max_size=30)))
    for _ in range(draw(st.integers(0, 3))):
        name, arguments = draw(NAMES), draw(ARGUMENTS)
        calls.append(ToolCall(name, arguments))
        parts.append(tool_calls.tool_call_text({"name": name, "arguments": arguments}))
    text = "\n".join(parts)
    # names go into the JSON unescaped (as render() writes them); a blank name is refused
    readable = all(
        json.dumps(c.name, ensure_ascii=False) == f'"{c.name}"'
        and c.name.strip()
        and len(c.name) <= tool_calls.MAX_NAME_CHARS
        for c in calls
    )
    edits = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["insert", "delete", "truncate", "quote", "duplicate"]),
                st.integers(0, 10**6),
                st.sampled_from(NASTY),
            ),
            max_size=4,
        )
    )
    for op, where, piece in edits:
        i = where % (len(text) + 1)
        if op == "insert":
            text = text[:i] + piece + text[i:]
        elif op == "delete":
            text = text[:i] + text[i + len(piece) :]
        elif op == "truncate":
            text = text[:i]
        elif op == "quote":
            text = text.replace('"', "'", 1 + where % 3)
        else:
            text = text[:i] + text[i : i + 40] + text[i:]
    return text, calls, readable and not edits


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages())
def test_parse_mutated_calls_never_raises_and_stays_fast(message):
    text, calls_made, intact = message
    calls, error, seconds = timed_parse(text)
    assert seconds < BOUND_S
    assert all(
        isinstance(c, ToolCall) and isinstance(c.name, str) and isinstance(c.arguments, dict)
        for c in calls
    )
    assert error is None or isinstance(error, str)
    assert rerenders(text)  # whatever the damage, no drift on re-rendering
    if intact:  # undamaged: exactly the calls it was made from
        assert (calls, error) == (calls_made, None)


TRICKY_STRINGS = st.lists(
    st.sampled_from(["<tool_call>", "</tool_call>", '"', "\\", '\\"', "'", "{", "}", "a", "\n"]),
    max_size=8,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "python_exec"]),
            st.dictionaries(
                st.sampled_from(["code", "a", "<tool_call>"]), TRICKY_STRINGS, max_size=3
            ),
        ),
        max_size=3,
    ),
    st.text(max_size=10),
)
def test_strings_with_tags_quotes_and_backslashes_parse_exactly(specs, prefix):
    """Canonical calls whose strings hold tags, quotes and backslashes: exactly the calls they were
    made from."""
    calls_made = [ToolCall(name, arguments) for name, arguments in specs]
    text = "\n".join(
        ([prefix] if prefix else [])
        + [
            tool_calls.tool_call_text({"name": c.name, "arguments": c.arguments})
            for c in calls_made
        ]
    )
    calls, error, seconds = timed_parse(text)
    assert seconds < BOUND_S and rerenders(text)
    if "tool_call>" not in prefix:
        assert (calls, error) == (calls_made, None)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.sampled_from(NASTY + ["a", "1", '"name"', '"arguments"', ":", " "]), max_size=60
    ).map(lambda pieces: "<tool_call>" + "".join(pieces))
)
def test_parse_random_bodies_never_raises(text):
    calls, error, seconds = timed_parse(text)
    assert seconds < BOUND_S and rerenders(text)
    assert (error is None and calls) or isinstance(error, str)  # silence only for a clean call
