"""Tests for chat_llama3.py, the llama3 chat format: rendering, the JSON tool-call parser, the agent
loop, end to end.

Oracles: the chat_template of Llama 3.1 and 3.2 Instruct (tokenizer_config.json of
meta-llama/Llama-3.1-8B-Instruct and Llama-3.2-1B-Instruct, copied below), rendered with jinja2 the
way Hugging Face renders it (and by transformers' apply_chat_template itself); one conversation,
Meta's JSON tool-calling example, is written out by hand. The loop is driven by a scripted engine
that answers with hand-written texts and a chosen end token (<|eot_id|> or <|eom_id|>).
"""

import json
import random
import time
from datetime import datetime

import jinja2
import jinja2.ext
import pytest
from hypothesis import given, settings, strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment
from conftest import need
from test_agent import CalcEnv  # noqa: E402

from agent import AgentConfig, run_episodes
import chat
from chat import make_action, parse_assistant_message, render, render_continuation
from env import Task, make_env
from rollout import Generation, SamplingParams
from sft import train_tokenizer, tokenize_conversation
from tool_calls import MAX_BLOCKS, MAX_PARSE_CHARS
from wings import chat_llama3
from wings.chat_llama3 import EOM, EOT, parse_tool_calls

BOS = "<|begin_of_text|>"

# -----------------------------------------------------------------------------
# the oracles: the templates Llama 3.1 and 3.2 Instruct checkpoints ship

LLAMA31_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""  # noqa: E501 (the template as the checkpoints ship it, long lines and all)

# Llama 3.2's differs in two places: today's date when the renderer offers strftime_now,
# and no built-in tools
LLAMA32_TEMPLATE = LLAMA31_TEMPLATE.replace(
    '{%- if not date_string is defined %}\n    {%- set date_string = "26 Jul 2024" %}\n',
    "{%- if not date_string is defined %}\n    {%- if strftime_now is defined %}\n"
    '        {%- set date_string = strftime_now("%d %b %Y") %}\n    {%- else %}\n'
    '        {%- set date_string = "26 Jul 2024" %}\n    {%- endif %}\n',
).replace("{%- if builtin_tools is defined or tools is not none %}", "{%- if tools is not none %}")
assert (
    LLAMA32_TEMPLATE.count("strftime_now") == 2
    and "builtin_tools is defined or" not in LLAMA32_TEMPLATE
)


def _raise(msg):
    raise jinja2.exceptions.TemplateError(msg)


def _hf_tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' tojson filter (chat_template_utils),
    # which takes indent= unlike a bare json.dumps(x)
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def jinja_render(template, messages, tools=None, add_generation_prompt=False, **kwargs) -> str:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _hf_tojson
    env.globals["raise_exception"] = _raise
    return env.from_string(template).render(
        messages=messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        bos_token=BOS,
        **kwargs,
    )


def fn_call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


# Meta's JSON tool-calling example
# (llama.com, "Llama 3.1 prompt format", custom tools in the user message)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_current_conditions",
        "description": "Get the current weather conditions for a specific location",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {
                    "type": "string",
                    "description": "The city and state, e.g., San Francisco, CA",
                },
                "unit": {
                    "type": "string",
                    "enum": ["Celsius", "Fahrenheit"],
                    "description": (
                        "The temperature unit to use. Infer this from the user's location."
                    ),
                },
            },
            "required": ["location", "unit"],
        },
    },
}
WEATHER_CALL = fn_call(
    "get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"}
)
WEATHER_CONVO = [
    {"role": "system", "content": "You are a helpful assistant with tool calling capabilities."},
    {"role": "user", "content": "Question: what is the weather like in San Fransisco?"},
    {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL]},
    {
        "role": "tool",
        "name": "get_current_conditions",
        "content": (
            "Clouds giving way to sun Hi: 76° Tonight: "
            "Mainly clear early, then areas of low clouds forming Lo: 56°"
        ),
    },
    {
        "role": "assistant",
        "content": "The weather in San Francisco is currently cloudy with a high of 76°F.",
    },
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up a word (née, 数学).",
            "parameters": {
                "type": "object",
                "properties": {"word": {"type": "string"}},
                "required": ["word"],
            },
        },
    },
]
SYS = {"role": "system", "content": "You are a careful assistant."}
U1 = {"role": "user", "content": "What is 2 + 3?"}
U2 = {"role": "user", "content": "And 4 + 5? Ünïcode ✓"}
CALL_ADD = fn_call("add", {"a": 2, "b": 3})
TOOL5 = {"role": "tool", "name": "add", "content": "5"}

RENDER_CASES = {
    "meta_basic": (
        [
            {"role": "system", "content": "You are a helpful assistant"},
            {"role": "user", "content": "What is the color of the sky?"},
        ],
        None,
    ),
    "no_system": ([U1], None),
    "multi_turn": (
        [SYS, U1, {"role": "assistant", "content": "5"}, U2, {"role": "assistant", "content": "9"}],
        None,
    ),
    "meta_json_tool_calling": (WEATHER_CONVO, [WEATHER]),
    "tools_no_system": (
        [U1, {"role": "assistant", "content": "", "tool_calls": [CALL_ADD]}, TOOL5],
        TOOLS,
    ),
    "unicode_and_multiline_tool_result": (
        [
            SYS,
            U2,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [fn_call("lookup", {"word": "café"})],
            },
            {"role": "tool", "name": "lookup", "content": 'a coffee\nhouse "é"'},
            {"role": "assistant", "content": "A coffee house."},
        ],
        TOOLS,
    ),
    "tool_result_object": (
        [
            U1,
            {"role": "assistant", "content": "", "tool_calls": [CALL_ADD]},
            {"role": "tool", "name": "add", "content": {"sum": 5, "ok": True}},
        ],
        TOOLS,
    ),
    "ipython_role": (
        [
            U1,
            {"role": "assistant", "content": "", "tool_calls": [CALL_ADD]},
            {"role": "ipython", "content": "5"},
        ],
        TOOLS,
    ),
    "whitespace_is_trimmed": (
        [
            {"role": "system", "content": "  Be brief.\n"},
            {"role": "user", "content": "\n hi \t"},
            {"role": "assistant", "content": " hello \n\n"},
        ],
        None,
    ),
    "empty_assistant": ([U1, {"role": "assistant", "content": ""}], None),
    "system_midway": (
        [
            SYS,
            U1,
            {"role": "assistant", "content": "5"},
            {"role": "system", "content": "Be brief."},
            U2,
        ],
        None,
    ),
    "no_arguments_call": (
        [U1, {"role": "assistant", "content": "", "tool_calls": [fn_call("add", {})]}],
        TOOLS,
    ),
}


# -----------------------------------------------------------------------------
# rendering


@pytest.mark.parametrize("gen", [False, True])
@pytest.mark.parametrize("case", RENDER_CASES)
def test_render_matches_the_llama31_template(case, gen):
    messages, tools = RENDER_CASES[case]
    assert render(messages, tools, add_generation_prompt=gen, chat_format="llama3") == jinja_render(
        LLAMA31_TEMPLATE, messages, tools, add_generation_prompt=gen
    )


@pytest.mark.parametrize("case", RENDER_CASES)
def test_render_matches_the_llama32_template_given_the_date(case):
    messages, tools = RENDER_CASES[case]
    ours = chat_llama3.render(
        messages, tools, add_generation_prompt=True, date_string="01 Jan 2025"
    )
    assert ours == jinja_render(
        LLAMA32_TEMPLATE, messages, tools, add_generation_prompt=True, date_string="01 Jan 2025"
    )
    assert "Today Date: 01 Jan 2025\n\n" in ours
    # without a date_string, 3.2's template writes today's date when it can (transformers offers
    # strftime_now): why ours is fixed (chat_llama3's docstring)
    today = datetime.now().strftime("%d %b %Y")
    env_today = jinja_render(
        LLAMA32_TEMPLATE.replace("strftime_now is defined", "true").replace(
            'strftime_now("%d %b %Y")', f'"{today}"'
        ),
        messages,
        tools,
    )
    assert f"Today Date: {today}\n\n" in env_today


def test_transformers_apply_chat_template_agrees(llama_tok):
    """The jinja oracle above renders as transformers does (its tojson with indent=, bos_token,
    trim)."""
    transformers = need("transformers", "the oracle of Hugging Face's own template rendering")
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=llama_tok, bos_token=BOS, eos_token=EOT
    )
    hf.chat_template = LLAMA31_TEMPLATE
    for case, (messages, tools) in RENDER_CASES.items():
        got = hf.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True
        )
        assert got == render(messages, tools, add_generation_prompt=True, chat_format="llama3"), (
            case
        )


def test_meta_json_tool_calling_example_by_hand():
    """Meta's example conversation, written out by hand from the prompt-format page's layout."""
    tool_json = (
        '{\n    "type": "function",\n    "function": {\n        "name": "get_current_conditions",\n'
        '        "description": "Get the current weather conditions for a specific location",\n'
        '        "parameters": {\n            "type": "object",\n            "properties": {\n'
        '                "location": {\n                    "type": "string",\n'
        '                    "description": "The city and state, e.g., San Francisco, CA"\n'
        '                },\n                "unit": {\n                    "type": "string",\n'
        '                    "enum": [\n                        "Celsius",\n'
        '                        "Fahrenheit"\n                    ],\n'
        '                    "description": "The temperature unit to use. Infer this from the '
        'user\'s location."\n                }\n            },\n            "required": [\n'
        '                "location",\n                "unit"\n            ]\n        }\n    }\n}'
    )
    expected = (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Environment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
        "You are a helpful assistant with tool calling capabilities.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n"
        "Given the following functions, please respond with a JSON for a function call "
        "with its proper arguments that best answers the given prompt.\n\n"
        'Respond in the format {"name": function name, "parameters": '
        "dictionary of argument name and its value}."
        "Do not use variables.\n\n" + tool_json + "\n\n"
        "Question: what is the weather like in San Fransisco?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
        '{"name": "get_current_conditions", '
        '"parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}'
        "<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n"
        '"Clouds giving way to sun Hi: 76° Tonight: '
        'Mainly clear early, then areas of low clouds forming Lo: 56°"'
        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        "The weather in San Francisco is currently cloudy with a high of 76°F.<|eot_id|>"
    )
    assert render(WEATHER_CONVO, [WEATHER], chat_format="llama3") == expected


@pytest.mark.parametrize("case", RENDER_CASES)
def test_render_is_prefix_stable_and_continuations_are_cut_from_it(case):
    """Rendering a longer conversation never changes earlier turns, so the agent can append each
    turn's tokens."""
    messages, tools = RENDER_CASES[case]
    full = render(messages, tools, chat_format="llama3")
    first = 2 if messages[0]["role"] == "system" else 1  # the tools ride in the first user message
    for k in range(first, len(messages) + 1):
        assert full.startswith(render(messages[:k], tools, chat_format="llama3"))
        if k < len(messages) and messages[k]["role"] == "assistant":
            assert full.startswith(
                render(messages[:k], tools, add_generation_prompt=True, chat_format="llama3")
            )
    for k, m in enumerate(messages):  # an observation after an assistant turn
        if (
            m["role"] in ("tool", "ipython", "user")
            and k > first
            and messages[k - 1]["role"] == "assistant"
        ):
            before = render(messages[:k], tools, chat_format="llama3")
            after = render(
                messages[: k + 1], tools, add_generation_prompt=True, chat_format="llama3"
            )
            assert render_continuation([m], "llama3") == after[len(before) :]


def test_render_continuation_by_hand():
    assert render_continuation(
        [TOOL5, {"role": "tool", "name": "lookup", "content": "x"}], "llama3"
    ) == (
        '<|start_header_id|>ipython<|end_header_id|>\n\n"5"<|eot_id|>'
        '<|start_header_id|>ipython<|end_header_id|>\n\n"x"<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert render_continuation([{"role": "user", "content": "Error: bad call"}], "llama3") == (
        "<|start_header_id|>user<|end_header_id|>\n\nError: bad call<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_departures_from_the_template():
    # arguments as an OpenAI-style JSON string are written as the object
    # (the template would quote the string)
    as_string = [
        U1,
        {"role": "assistant", "content": "", "tool_calls": [fn_call("add", '{"a": 2, "b": 3}')]},
    ]
    as_dict = [U1, {"role": "assistant", "content": "", "tool_calls": [CALL_ADD]}]
    assert render(as_string, TOOLS, chat_format="llama3") == render(
        as_dict, TOOLS, chat_format="llama3"
    )
    # an empty tool list is no tools (the template would announce an empty one)
    assert render([U1], [], chat_format="llama3") == render([U1], None, chat_format="llama3")
    # the content of an assistant turn with a tool call is dropped, as the template drops it
    with_content = [U1, {"role": "assistant", "content": "Let me add.", "tool_calls": [CALL_ADD]}]
    assert render(with_content, TOOLS, chat_format="llama3") == render(
        as_dict, TOOLS, chat_format="llama3"
    )


@pytest.mark.parametrize(
    "messages, tools, needle",
    [
        (
            [U1, {"role": "assistant", "content": "", "tool_calls": [CALL_ADD, CALL_ADD]}],
            TOOLS,
            "one tool call",
        ),
        ([SYS], TOOLS, "first user message"),
        ([SYS, {"role": "assistant", "content": "hi"}], TOOLS, "first user message"),
        ([U1, {"role": "narrator", "content": "x"}], None, "unknown role"),
    ],
)
def test_render_refuses_what_the_template_cannot_write(messages, tools, needle):
    with pytest.raises(ValueError, match=needle):
        render(messages, tools, chat_format="llama3")


def test_the_format_table():
    """chat.py reaches the wing by name: the module exists and defines what chat.py calls."""
    assert "llama3" in chat.CHAT_FORMATS and chat.WING_FORMATS["llama3"] == "wings.chat_llama3"
    for name in (
        "render",
        "render_continuation",
        "make_action",
        "parse_assistant_message",
        "TURN_ENDS",
    ):
        assert hasattr(chat_llama3, name), name
    assert chat.turn_ends("llama3") == (EOT, EOM) and chat.turn_ends("qwen2.5") == ("<|im_end|>",)
    with pytest.raises(ValueError, match="unknown chat_format"):
        chat.turn_ends("llama2")


# -----------------------------------------------------------------------------
# the tool-call parser

PARSE_CASES = [
    # (text, calls as (name, arguments), None or a piece of the error)
    ('{"name": "add", "parameters": {"a": 2, "b": 3}}', [("add", {"a": 2, "b": 3})], None),
    ('  {"name": "add", "parameters": {"a": 2}}\n', [("add", {"a": 2})], None),
    ('{"name": "add", "arguments": {"a": 2}}', [("add", {"a": 2})], None),
    ('<|python_tag|>{"name": "add", "parameters": {"a": 2}}', [("add", {"a": 2})], None),
    ('{"type": "function", "name": "add", "parameters": {"a": 2}}', [("add", {"a": 2})], None),
    ('{"name": "add", "parameters": "{\\"a\\": 2}"}', [("add", {"a": 2})], None),
    ('{"name": "now"}', [("now", {})], None),
    ('{"name": "now", "parameters": null}', [("now", {})], None),
    ("The answer is 5.", [], None),
    ("", [], None),
    ('Use {braces} and {"a": 1} freely.', [], None),
    # repaired
    ("{'name': 'add', 'parameters': {'a': 2}}", [("add", {"a": 2})], "single quotes"),
    ('{"name": "add", "parameters": {"a": 2,}}', [("add", {"a": 2})], "trailing commas"),
    ('{name: "add", parameters: {a: 2}}', [("add", {"a": 2})], "unquoted keys"),
    (
        '{"name": "f", "parameters": {"x": True, "y": None}}',
        [("f", {"x": True, "y": None})],
        "Python literals",
    ),
    (
        '{"name": "f", "parameters": {"code": "a\nb"}}',
        [("f", {"code": "a\nb"})],
        "raw control characters",
    ),
    ('```json\n{"name": "add", "parameters": {"a": 2}}\n```', [("add", {"a": 2})], "code fence"),
    (
        'I will add: {"name": "add", "parameters": {"a": 2}}',
        [("add", {"a": 2})],
        "text before the tool call",
    ),
    (
        '{"name": "add", "parameters": {"a": 2}} and then I wait',
        [("add", {"a": 2})],
        "text after the tool call",
    ),
    (
        '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}',
        [("a", {}), ("b", {"x": 1})],
        "2 JSON objects in one message",
    ),
    (
        '{"name": "a", "parameters": {}}\n{"name": "b", "parameters": {}}',
        [("a", {}), ("b", {})],
        "2 JSON objects",
    ),
    # malformed: nothing runs
    ('{"name": "add", "parameters": {"a": 2', [], "a call cut short is never run"),
    ('{"name": "python_eval", "parameters": {"code": "print(', [], "a call cut short is never run"),
    ('{"name": "add", "parameters": {"a": 2}', [], "a call cut short is never run"),
    ('{"name": "add", "param', [], "a call cut short is never run"),
    ('{"parameters": {"a": 2}}', [], "without a name"),
    ('{"name": "  ", "parameters": {}}', [], "without a name"),
    ('{"name": "add", "parameters": [2, 3]}', [], "not an object"),
    ('{"name": "add", "parameters": "not json"}', [], "not valid JSON"),
    ('{"name": "' + "x" * 100 + '", "parameters": {}}', [], "longer than"),
    ("{this is not json}", [], "invalid JSON"),
    ('{"answer": 5}', [], "without a name"),
]


@pytest.mark.parametrize("text, calls, needle", PARSE_CASES)
def test_parse(text, calls, needle):
    got, error = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in got] == calls
    if needle is None:
        assert error is None
    else:
        assert error is not None and needle in error, error
    action = make_action(text, "llama3")
    assert (list(action.tool_calls), action.parse_error, action.text) == (got, error, text)


def test_more_calls_than_the_bound_are_reported():
    text = "; ".join(f'{{"name": "f{i}", "parameters": {{}}}}' for i in range(MAX_BLOCKS + 4))
    calls, error = parse_tool_calls(text)
    assert [c.name for c in calls] == [f"f{i}" for i in range(MAX_BLOCKS)]
    assert f"more than {MAX_BLOCKS} tool calls" in error


def test_a_message_past_the_scan_bound_is_reported():
    calls, error = parse_tool_calls(
        '{"name": "f", "parameters": {"s": "' + "x" * MAX_PARSE_CHARS + '"}}'
    )
    assert calls == [] and f"longer than {MAX_PARSE_CHARS}" in error


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=list("{}[]:,\"' \n\\abnmeptrsuTFN0123456789;`<|>_"), max_size=200))
def test_parse_never_raises(text):
    calls, error = parse_tool_calls(text)
    assert all(isinstance(c.arguments, dict) and c.name.strip() for c in calls)
    assert error is None or isinstance(error, str)
    parse_assistant_message(text, "llama3")


@pytest.mark.parametrize(
    "text",
    [
        "{" * 200_000,
        "[" * 200_000,
        '{"name": "f", "parameters": ' + "[" * 100_000,
        '{"name": "f", "parameters": {"a": ' + '"' * 50_000,
        "{'name': 'f', 'parameters': {" + "'k': 1, " * 20_000,
        '{"name":' * 50_000,
        "{ " * 100_000,
        " " * 300_000 + "{",
        'x {"name": ' * 30_000,
        '{"name": "f", "parameters": {}}; ' * 10_000,
        # just under MAX_REPAIR_CHARS: the repairing reader
        "{'name': 'f', 'parameters': {" + "'k': 1, " * 2_400,
        '{"name": "f", "parameters": ' + "[" * 19_000,  # runs to its step or depth bound
        '{"name": "f", "parameters": {"a": "' + "x\\n" * 6_000,
    ],
)
def test_parse_bounded_time_on_long_inputs(text):
    t0 = time.perf_counter()
    parse_tool_calls(text)
    parse_assistant_message(text, "llama3")
    # at most ~20 ms each on a 2-core CPU; a quadratic scan takes minutes
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "add", "parameters": {"a": 2, "b": 3}}',
        '{"name": "lookup", "parameters": {"word": "café"}}',
        '{"name": "now", "parameters": {}}',
        "ANSWER: 5",
        '{"name":"add","parameters":{"a":2}}',  # a call written another way stays content
        '<|python_tag|>{"name": "add", "parameters": {"a": 2}}',
        '{"name": "add", "parameters": {"a": 2}} done',
        '{"name": "add", "parameters": {"a": 2',
    ],
)
def test_assistant_message_round_trips(text):
    message = parse_assistant_message(text, "llama3")
    rendered = render([U1, message], chat_format="llama3")
    assert rendered.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n" + text + EOT)
    calls, error = parse_tool_calls(text)
    canonical = (
        error is None
        and len(calls) == 1
        and text
        == chat_llama3.tool_call_text({"name": calls[0].name, "arguments": calls[0].arguments})
    )
    assert ("tool_calls" in message) == canonical


# -----------------------------------------------------------------------------
# the agent loop: a llama3 tokenizer, a scripted engine, a calculator env

# CalcEnv: tests/test_agent.py's (add, then 'ANSWER: n' ends the episode);
# the format does not change the env


def calc_task(i, a, b):
    return Task(env="calc", id=f"calc-{i}", prompt=f"Compute {a} + {b}.", answer=str(a + b))


def call(a, b):
    return '{"name": "add", "parameters": {"a": %d, "b": %d}}' % (a, b)


@pytest.fixture(scope="module")
def llama_tok():
    """sft.train_tokenizer with the Llama special tokens, on llama3 renderings of calculator
    episodes."""
    rng = random.Random(0)
    texts = []
    for _ in range(200):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        convo = [
            {"role": "system", "content": CalcEnv.SYSTEM},
            {"role": "user", "content": f"Compute {a} + {b}."},
            {"role": "assistant", "content": "", "tool_calls": [fn_call("add", {"a": a, "b": b})]},
            {"role": "tool", "name": "add", "content": str(a + b)},
            {"role": "assistant", "content": f"ANSWER: {a + b}"},
        ]
        texts.append(render(convo, CalcEnv.TOOLS, chat_format="llama3"))
    return train_tokenizer(texts, 500, chat_llama3.SPECIAL_TOKENS)


class ScriptedEngine:
    """Answers turn k of a task with script[task prompt][k] + its end token (EOT unless the script
    says (text, end))."""

    def __init__(self, tok, script):
        self.tok, self.script, self.calls = tok, script, []

    def generate(self, prompts, params):
        self.calls.append(params)
        out = []
        for p in prompts:
            text = self.tok.decode(p, skip_special_tokens=False)
            turns = self.script[next(k for k in self.script if k in text)]
            reply = turns[min(text.count("<|start_header_id|>assistant") - 1, len(turns) - 1)]
            reply, end = reply if isinstance(reply, tuple) else (reply, EOT)
            ids = self.tok.encode(reply + end, add_special_tokens=False).ids[: params.max_tokens]
            out.append(
                Generation(
                    token_ids=ids,
                    logprobs=[-0.5] * len(ids),
                    finish_reason="stop" if ids[-1] in params.stop_token_ids else "length",
                )
            )
        return out


def test_the_loop_appends_llama3_turns_token_exactly(llama_tok):
    tasks = [calc_task(0, 2, 3), calc_task(1, 40, 17)]
    script = {
        tasks[0].prompt: [call(2, 3), "ANSWER: 5"],  # ends its call with <|eot_id|>
        # ... with <|eom_id|> (ipython mode)
        tasks[1].prompt: [(call(40, 17), EOM), "ANSWER: 57"],
    }
    engine = ScriptedEngine(llama_tok, script)
    cfg = AgentConfig(n_samples=1, max_turns=4, max_total_tokens=1024, chat_format="llama3")
    trajs = run_episodes(
        engine, {"calc": CalcEnv()}, tasks, llama_tok, cfg, SamplingParams(max_tokens=100), seed=0
    )
    eot, eom = llama_tok.token_to_id(EOT), llama_tok.token_to_id(EOM)
    assert {eot, eom} <= set(engine.calls[0].stop_token_ids)
    for tr, end, args in zip(trajs, (EOT, EOM), ({"a": 2, "b": 3}, {"a": 40, "b": 17})):
        assert (tr.done, tr.reward, tr.num_turns, tr.num_tool_calls, tr.parse_failures) == (
            True,
            1.0,
            2,
            1,
            0,
        )
        assert tr.messages[2] == {
            "role": "assistant",
            "content": "",
            "tool_calls": [fn_call("add", args)],
        }
        ids = tr.token_ids
        # each sampled turn ends with the model's own end token,
        # sampled (mask 1), and nothing is forced after it
        sampled = [i for i, m in enumerate(tr.loss_mask) if m]
        ends = [ids[i] for i in sampled if ids[i] in (eot, eom)]
        assert ends == [eot if end == EOT else eom, eot]
        assert ids[-1] == eot and tr.loss_mask[-1] == 1
    # an episode whose turns end with <|eot_id|> is exactly its re-rendered conversation, tokenized
    assert (
        trajs[0].token_ids
        == llama_tok.encode(
            render(trajs[0].messages, CalcEnv.TOOLS, chat_format="llama3"), add_special_tokens=False
        ).ids
    )
    # the <|eom_id|> episode differs from the re-rendering only in that token
    rerendered = llama_tok.encode(
        render(trajs[1].messages, CalcEnv.TOOLS, chat_format="llama3"), add_special_tokens=False
    ).ids
    assert [eot if t == eom else t for t in trajs[1].token_ids] == rerendered


def test_a_cut_turn_is_closed_with_a_forced_eot(llama_tok):
    task = calc_task(0, 2, 3)
    engine = ScriptedEngine(llama_tok, {task.prompt: [call(2, 3)]})
    cfg = AgentConfig(n_samples=1, max_turns=1, max_total_tokens=1024, chat_format="llama3")
    (tr,) = run_episodes(
        engine, {"calc": CalcEnv()}, [task], llama_tok, cfg, SamplingParams(max_tokens=4), seed=0
    )
    eot = llama_tok.token_to_id(EOT)
    assert tr.token_ids[-1] == eot and tr.loss_mask[-1] == 0 and tr.loss_mask[-5:-1] == [1] * 4
    assert tr.parse_failures == 1 and tr.num_tool_calls == 0  # the call was cut short: not run


def test_a_tokenizer_without_the_llama_tokens_is_refused(llama_tok):
    from tokenizers import Tokenizer, models

    qwen_like = Tokenizer(models.BPE())
    qwen_like.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    cfg = AgentConfig(n_samples=1, chat_format="llama3")
    with pytest.raises(ValueError, match="eot_id"):
        run_episodes(
            ScriptedEngine(qwen_like, {}),
            {"calc": CalcEnv()},
            [calc_task(0, 1, 1)],
            qwen_like,
            cfg,
            SamplingParams(max_tokens=4),
            seed=0,
        )


def test_sft_cuts_llama3_demonstrations_at_the_turns(llama_tok):
    messages, tools = (
        RENDER_CASES["tools_no_system"][0] + [{"role": "assistant", "content": "5"}],
        TOOLS,
    )
    ids, mask = tokenize_conversation(messages, tools, llama_tok, "llama3")
    assert (
        ids
        == llama_tok.encode(
            render(messages, tools, chat_format="llama3"), add_special_tokens=False
        ).ids
    )
    trained = llama_tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert trained == call(2, 3) + EOT + "5" + EOT  # the assistant turns and their end tokens


def test_pad_token_id_finds_llamas_pad(llama_tok):
    assert chat.pad_token_id(llama_tok) == llama_tok.token_to_id("<|finetune_right_pad_id|>")


def test_the_embedded_qwen_model_is_refused_before_it_is_built(tmp_path):
    from config import load_config
    from sft import build_default_model

    cfg = load_config(
        "configs/toy_math.yaml", ["rollout.agent.chat_format=llama3", f"model.cache_dir={tmp_path}"]
    )
    with pytest.raises(ValueError, match="set model.path"):
        build_default_model(cfg)
    assert list(tmp_path.iterdir()) == []  # nothing built


# -----------------------------------------------------------------------------
# end to end: a tiny Llama-architecture model with our own Llama tokenizer,
# SFT, then RL through train.main


@pytest.mark.slow
def test_tiny_llama_trains_end_to_end(tmp_path):
    import torch

    from batch import pad_right
    from config import load_config
    from learner import LearnerConfig, make_learner, sft_step
    from model import ModelConfig, init_model, save_model
    from train import main

    env = make_env("toy_math")
    rng = random.Random(0)
    demos = [env.demonstration(t, rng, True) for t in env.sample_tasks("train", 300, 0)]
    tok = train_tokenizer(
        [render(m, env.tools(), chat_format="llama3") for m in demos],
        600,
        chat_llama3.SPECIAL_TOKENS,
    )
    seqs = [tokenize_conversation(m, env.tools(), tok, "llama3") for m in demos]
    pad = chat.pad_token_id(tok)
    mcfg = ModelConfig(
        model_type="llama",
        vocab_size=tok.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOT),
        pad_token_id=pad,
    )
    model = init_model(mcfg, seed=0)
    lcfg = LearnerConfig(lr=3e-3, warmup_steps=5, micro_batch_size=16)
    state = make_learner(model, lcfg, seed=0)
    losses = []
    for step in range(60):
        rows = [seqs[(step * 16 + i) % len(seqs)] for i in range(16)]
        state, metrics = sft_step(
            state,
            pad_right([r[0] for r in rows], pad, torch.long),
            pad_right([r[1] for r in rows], 0.0, torch.float),
            lcfg,
        )
        losses.append(metrics["sft/loss"])
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5  # it learned the format
    folder = str(tmp_path / "tiny_llama")
    save_model(model, folder)
    tok.save(f"{folder}/tokenizer.json")
    ids = {t: tok.token_to_id(t) for t in chat_llama3.SPECIAL_TOKENS}
    with open(f"{folder}/tokenizer_config.json", "w") as f:
        # as Llama 3.1 Instruct's, with its template
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS,
                "eos_token": EOT,
                "pad_token": chat_llama3.PAD,
                "clean_up_tokenization_spaces": False,
                "model_max_length": 2048,
                "added_tokens_decoder": {
                    str(i): {
                        "content": t,
                        "lstrip": False,
                        "normalized": False,
                        "rstrip": False,
                        "single_word": False,
                        "special": True,
                    }
                    for t, i in ids.items()
                },
                "chat_template": LLAMA31_TEMPLATE,
            },
            f,
            indent=2,
        )
    with open(f"{folder}/generation_config.json", "w") as f:
        json.dump(
            {
                "bos_token_id": ids[BOS],
                "eos_token_id": [ids["<|end_of_text|>"], ids[EOM], ids[EOT]],
            },
            f,
        )
    assert json.load(open(f"{folder}/config.json"))["architectures"] == ["LlamaForCausalLM"]

    cfg = load_config(
        "configs/toy_math.yaml",
        [
            f"model.path={folder}",
            "rollout.agent.chat_format=llama3",
            "steps=2",
            "eval_every=2",
            "envs.0.eval_size=4",
            "rollout.prompts_per_step=4",
            "rollout.agent.n_samples=4",
            "rollout.max_tokens=40",
            "rollout.agent.max_total_tokens=768",
            "learner.micro_batch_size=8",
            "wandb=false",
            "algo.skip_uniform_batches=false",
            f"out_dir={tmp_path}/runs",
            "run_name=llama3",
        ],
    )
    summary = main(cfg)
    lines = [json.loads(l) for l in open(f"{summary['run_dir']}/metrics.jsonl")]
    assert [l["step"] for l in lines] == [0, 1, 2]
    for l in lines[1:]:
        assert l["rollout/response_tokens"] > 0 and l["sync/logprob_abs_diff"] < 1e-3
        assert "train/pg_loss" in l
    # the SFT'd model calls tools in Llama's syntax
    assert sum(l["rollout/tool_calls"] for l in lines[1:]) > 0
    episodes = [json.loads(l) for l in open(f"{summary['run_dir']}/episodes_step2.jsonl")]
    assert any(
        "tool_calls" in m for e in episodes for m in e["messages"] if m["role"] == "assistant"
    )
    # the trained folder loads in transformers,
    # and its template renders the dumped conversations as we do
    transformers = need("transformers", "the oracle of Hugging Face's own template rendering")
    hf = transformers.AutoTokenizer.from_pretrained(f"{summary['run_dir']}/final")
    for e in episodes:
        assert hf.apply_chat_template(e["messages"], tools=env.tools(), tokenize=False) == render(
            e["messages"], env.tools(), chat_format="llama3"
        )
