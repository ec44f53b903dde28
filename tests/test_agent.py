"""Tests for agent.py: chat formatting, tool-call parsing, and the token-in token-out multi-turn
loop.

Oracles: the chat templates are checked against jinja2 renderings of the real Qwen3 template
(fixtures/chat_templates/qwen3.jinja) and of QWEN25_CHAT_TEMPLATE (plus transformers'
apply_chat_template when it is installed). The loop is driven by a scripted engine that returns
hand-written assistant texts, with a log-prob that is a known function of each token id, so every
position of a trajectory can be checked against what the engine actually returned.
"""

import functools
import json
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path

import jinja2
import jinja2.ext
import pytest
from hypothesis import given, settings, strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from conftest import IN_CI, need

import agent
import env as env_module
from agent import AgentConfig, Trajectory, rollout_metrics, run_episodes, state_key
from batch import to_batch
from chat import make_action, parse_assistant_message, render, render_continuation
from rollout import Generation, SamplingParams
from sft import QWEN25_CHAT_TEMPLATE
from tool_calls import parse_tool_calls

Task, ToolCall = env_module.Task, env_module.ToolCall
ROOT = Path(__file__).resolve().parents[1]
# the Qwen3 chat template shipped with Qwen3 checkpoints (a fixture kept next to the repository)
QWEN3_TEMPLATE = next(
    (
        p
        for p in (
            ROOT / "tests/fixtures/chat_templates/qwen3.jinja",
            ROOT / "shared/fixtures/chat_templates/qwen3.jinja",
            ROOT.parent / "shared/fixtures/chat_templates/qwen3.jinja",
        )
        if p.exists()
    ),
    None,
)
SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]


# -----------------------------------------------------------------------------
# jinja oracle (rendered the way Hugging Face does)


def _raise(msg):
    raise jinja2.exceptions.TemplateError(msg)


@functools.lru_cache(maxsize=None)
def compile_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False)
    env.globals["raise_exception"] = _raise
    return env.from_string(template)


def jinja_render(
    template: str, messages, tools=None, add_generation_prompt=False, enable_thinking=None
) -> str:
    kw = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return compile_template(template).render(
        messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **kw
    )


def fn_call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


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
CALL_STR = fn_call("lookup", '{"word": "café"}')  # arguments as a JSON string
TOOL5 = {"role": "tool", "name": "add", "content": "5"}
TOOL_W = {"role": "tool", "name": "lookup", "content": "a coffee house"}

RENDER_CASES = {
    "single_turn": ([U1], None),
    "single_turn_system": ([SYS, U1], None),
    "tools_system": ([SYS, U1], TOOLS),
    "tools_no_system": ([U1], TOOLS),
    "multi_turn": (
        [SYS, U1, {"role": "assistant", "content": "5"}, U2, {"role": "assistant", "content": "9"}],
        None,
    ),
    "several_tool_calls": (
        [SYS, U1, {"role": "assistant", "content": "", "tool_calls": [CALL_ADD, CALL_STR]}],
        TOOLS,
    ),
    "tool_calls_with_content": (
        [U1, {"role": "assistant", "content": "Let me check.", "tool_calls": [CALL_ADD]}],
        TOOLS,
    ),
    "consecutive_tool_responses": (
        [
            SYS,
            U1,
            {"role": "assistant", "content": "", "tool_calls": [CALL_ADD, CALL_STR]},
            TOOL5,
            TOOL_W,
            {"role": "assistant", "content": "It is 5."},
        ],
        TOOLS,
    ),
    "multi_step_after_last_query": (
        [
            SYS,
            U1,
            {"role": "assistant", "content": "<think>\nold reasoning\n</think>\n\n5"},
            U2,
            {
                "role": "assistant",
                "content": "<think>\nadd them\n</think>\n\nCalling.",
                "tool_calls": [CALL_ADD],
            },
            TOOL5,
            {"role": "assistant", "content": "", "tool_calls": [CALL_STR]},
            TOOL_W,
            {"role": "assistant", "content": "Done: 9."},
        ],
        TOOLS,
    ),
    "think_in_content": (
        [
            U1,
            {"role": "assistant", "content": "<think>\nr1\n</think>\n\nfive"},
            U2,
            {"role": "assistant", "content": "<think>r2</think>nine"},
        ],
        None,
    ),
    "reasoning_content_field": (
        [U1, {"role": "assistant", "content": "five", "reasoning_content": "\nsum\n"}],
        None,
    ),
    "wrapped_tool_response_user": (
        [
            U1,
            {"role": "assistant", "content": "", "tool_calls": [CALL_ADD]},
            {"role": "user", "content": "<tool_response>\n5\n</tool_response>"},
        ],
        TOOLS,
    ),
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
    "tool_response_opens": ([{"role": "tool", "name": "add", "content": "5"}, U1], TOOLS),
}


@pytest.fixture(scope="module")
def qwen3_template():
    if QWEN3_TEMPLATE is None:
        # the real Qwen3 template is an oracle we do not ship; CI has it beside the clone
        if IN_CI:
            raise FileNotFoundError(
                "the qwen3 chat template fixture (fixtures/chat_templates/qwen3.jinja) is missing"
            )
        pytest.skip(
            "the qwen3 chat template fixture "
            "(fixtures/chat_templates/qwen3.jinja) is not beside this clone"
        )
    return QWEN3_TEMPLATE.read_text()


@pytest.mark.parametrize("gen", [False, True])
@pytest.mark.parametrize("thinking", [None, True, False])
@pytest.mark.parametrize("case", list(RENDER_CASES))
def test_render_qwen3_matches_template(qwen3_template, case, thinking, gen):
    messages, tools = RENDER_CASES[case]
    expected = jinja_render(
        qwen3_template, messages, tools, add_generation_prompt=gen, enable_thinking=thinking
    )
    assert (
        render(
            messages,
            tools,
            add_generation_prompt=gen,
            chat_format="qwen3",
            enable_thinking=thinking,
        )
        == expected
    )


@pytest.mark.parametrize("gen", [False, True])
@pytest.mark.parametrize("case", list(RENDER_CASES))
def test_render_qwen25_matches_template(case, gen):
    messages, tools = RENDER_CASES[case]
    expected = jinja_render(QWEN25_CHAT_TEMPLATE, messages, tools, add_generation_prompt=gen)
    for thinking in (None, False):  # no <think> logic in qwen2.5: enable_thinking is ignored
        assert (
            render(
                messages,
                tools,
                add_generation_prompt=gen,
                chat_format="qwen2.5",
                enable_thinking=thinking,
            )
            == expected
        )


def test_qwen25_hand_written():
    # independent of any template: the defaults and the tool-call layout, written out
    assert render([U1], add_generation_prompt=True) == (
        "<|im_start|>system\n"
        "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    )
    text = render([U1], TOOLS)
    assert text.startswith(
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.\n\n# Tools\n\n"
    )
    assert '"description": "Look up a word (née, 数学)."' in text  # ensure_ascii=False
    msg = {"role": "assistant", "content": "", "tool_calls": [CALL_ADD, CALL_STR]}
    assert render([U1, msg]).endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
        '</tool_call>\n<tool_call>\n{"name": "lookup", "arguments": {"word": "café"}}\n'
        "</tool_call><|im_end|>\n"
    )


def test_qwen25_is_stable_and_qwen3_is_not():
    # Re-rendering a longer conversation keeps the text of earlier turns in qwen2.5; in qwen3 the
    # last assistant turn gains an empty think block that disappears once the conversation goes on.
    convo = RENDER_CASES["consecutive_tool_responses"][0]
    for k in range(1, len(convo)):
        if convo[k - 1]["role"] == convo[k]["role"] == "tool":
            continue  # consecutive tool responses share one turn: no cut inside it
        short, full = render(convo[:k], TOOLS), render(convo, TOOLS)
        assert full.startswith(short)
    short, full = (
        render(convo[:3], TOOLS, chat_format="qwen3"),
        render(convo, TOOLS, chat_format="qwen3"),
    )
    assert "<think>\n\n</think>" in short and not full.startswith(short)


def test_transformers_apply_chat_template_agrees():
    transformers = need("transformers", "the chat-template oracle")
    tok = Tokenizer(models.BPE())
    tok.add_special_tokens(SPECIALS)
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, chat_template=QWEN25_CHAT_TEMPLATE
    )
    for case in (
        "single_turn",
        "tools_system",
        "tools_no_system",
        "consecutive_tool_responses",
        "multi_step_after_last_query",
    ):
        messages, tools = RENDER_CASES[case]
        for gen in (False, True):
            got = hf.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=gen
            )
            assert got == render(messages, tools, add_generation_prompt=gen)


def test_unknown_format_and_role():
    with pytest.raises(ValueError):
        render([U1], chat_format="llama2")
    with pytest.raises(ValueError):
        render([U1, {"role": "critic", "content": "x"}])


@pytest.mark.parametrize(
    "fmt,thinking", [("qwen2.5", None), ("qwen3", None), ("qwen3", False), ("qwen3", True)]
)
def test_render_continuation(fmt, thinking):
    obs = [TOOL5, TOOL_W]
    expected = (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n"
        "a coffee house\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    if fmt == "qwen3" and thinking is False:
        expected += "<think>\n\n</think>\n\n"
    assert render_continuation(obs, fmt, thinking) == expected
    user = [{"role": "user", "content": "Try again."}]
    assert render_continuation(user, fmt, thinking).startswith(
        "\n<|im_start|>user\nTry again.<|im_end|>\n"
    )
    # the continuation is what render() adds after an assistant turn's <|im_end|>
    convo = [SYS, U1, {"role": "assistant", "content": "", "tool_calls": [CALL_ADD, CALL_STR]}]
    full = render(
        convo + obs, TOOLS, add_generation_prompt=True, chat_format=fmt, enable_thinking=thinking
    )
    assert full.endswith("</tool_call><|im_end|>" + expected)
    if fmt == "qwen2.5":
        assert render(convo, TOOLS)[:-1] + expected == full


# -----------------------------------------------------------------------------
# tool-call parsing


def test_parse_well_formed():
    assert parse_tool_calls("no tools here") == ([], None)
    assert parse_tool_calls("") == ([], None)
    calls, err = parse_tool_calls(
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    )
    assert err is None and calls == [ToolCall("add", {"a": 1, "b": 2})]
    text = (
        'I will call two.\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
        '<tool_call>  \n\n {"tool": "lookup", "args": {"word": "x"}} \n</tool_call>'
    )
    calls, err = parse_tool_calls(text)
    assert err is None and calls == [
        ToolCall("add", {"a": 1, "b": 2}),
        ToolCall("lookup", {"word": "x"}),
    ]
    # arguments as a JSON-encoded string (OpenAI style) are decoded; missing arguments are {}
    calls, err = parse_tool_calls(
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 4}"}</tool_call>'
        '<tool_call>{"name": "now"}</tool_call>'
    )
    assert err is None and calls == [ToolCall("add", {"a": 4}), ToolCall("now", {})]


@pytest.mark.parametrize(
    "text,n_ok,needle",
    [
        # repaired, reported
        ('<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>', 1, "invalid JSON"),
        ('<tool_call>{"arguments": {"a": 1}}</tool_call>', 0, "without a name"),
        ('<tool_call>{"name": "", "arguments": {}}</tool_call>', 0, "without a name"),
        ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', 0, "not an object"),
        ('<tool_call>{"name": "add", "arguments": "[1, 2]"}</tool_call>', 0, "not an object"),
        ('<tool_call>{"name": "add", "arguments": "{oops"}</tool_call>', 0, "not valid JSON"),
        ('<tool_call>["add"]</tool_call>', 0, "not an object"),
        ('<tool_call>\n{"name": "add", "arguments": {"a"', 0, "not closed"),
        ('<tool_call>{"name": "a", "arguments": {}}</tool_call> then </tool_call>', 1, "stray"),
        # complete JSON
        ('<tool_call>{"name": "a"} <tool_call>{"name": "b"}</tool_call>', 2, "not closed before"),
        (
            '<tool_call>{"name": "ok", "arguments": {}}</tool_call><tool_call>{bad}</tool_call>',
            1,
            "invalid JSON",
        ),
    ],
)
def test_parse_errors(text, n_ok, needle):
    calls, err = parse_tool_calls(text)
    assert len(calls) == n_ok and err is not None and needle in err
    action = make_action(text)
    assert action.text == text and action.parse_error == err and len(action.tool_calls) == n_ok


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.text(),
        st.lists(
            st.sampled_from(
                [
                    "<tool_call>",
                    "</tool_call>",
                    "{",
                    "}",
                    "[",
                    '"name"',
                    '"tool"',
                    '"arguments"',
                    '"args"',
                    ":",
                    ",",
                    '"x"',
                    "1",
                    "null",
                    "\n",
                    " ",
                    '"{\\"a\\": 1}"',
                    "<|im_end|>",
                    "é",
                ]
            ),
            max_size=40,
        ).map("".join),
    )
)
def test_parse_never_raises(text):
    calls, err = parse_tool_calls(text)
    assert all(isinstance(c, ToolCall) and isinstance(c.arguments, dict) for c in calls)
    assert err is None or isinstance(err, str)
    assert isinstance(parse_assistant_message(text)["content"], str)


def test_parse_bounded_time_on_long_inputs():
    for text in [
        "<tool_call>" * 50_000,
        "</tool_call>" * 50_000,
        "<tool_call>{" * 30_000 + "</tool_call>",
        "<tool_call>" + "[" * 100_000 + "</tool_call>",
        "x" * 1_000_000,
    ]:
        # CPU time of this thread: another process on the cores cannot fail it
        t0 = time.thread_time()
        calls, err = parse_tool_calls(text)
        assert time.thread_time() - t0 < 2.0
        assert calls == [] and (err is not None or text[0] == "x")


CANONICAL_ASSISTANT_TEXTS = [
    "The answer is 5.",
    "",
    '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
    'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
    '<tool_call>\n{"name": "lookup", "arguments": {"word": "café"}}\n</tool_call>',
    'Trailing newline kept\n\n<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>',
]


@pytest.mark.parametrize("text", CANONICAL_ASSISTANT_TEXTS)
def test_assistant_message_round_trips(text):
    # render() of the parsed message gives the generated text back (after the generation prompt)
    prompt = render([U1], TOOLS, add_generation_prompt=True)
    assert render([U1, parse_assistant_message(text)], TOOLS) == prompt + text + "<|im_end|>\n"


def test_assistant_message_keeps_malformed_blocks_in_content():
    text = 'Hmm.\n<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>'
    assert parse_assistant_message(text) == {"role": "assistant", "content": text}


# -----------------------------------------------------------------------------
# the multi-turn loop: a tokenizer, a scripted engine, fake envs


@pytest.fixture(scope="module")
def tok():
    """Byte-level BPE like Qwen's, trained on rendered conversations; the chat tokens are
    special."""
    rng = random.Random(0)
    lines = []
    for _ in range(300):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        convo = [
            {"role": "system", "content": CalcEnv.SYSTEM},
            {"role": "user", "content": f"Compute {a} + {b}."},
            {
                "role": "assistant",
                "content": "Let me add.",
                "tool_calls": [fn_call("add", {"a": a, "b": b})],
            },
            {"role": "tool", "name": "add", "content": str(a + b)},
            {"role": "assistant", "content": f"ANSWER: {a + b}"},
        ]
        lines.append(render(convo, CalcEnv.TOOLS, chat_format=rng.choice(["qwen2.5", "qwen3"])))
    return train_bpe(lines, 800)


def train_bpe(texts: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE like Qwen's (any text encodes, and decodes back), trained on `texts`, with
    Qwen's chat tokens as special tokens."""
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(texts, trainer)
    return t


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False).ids


def fake_logprob(token_id: int) -> float:
    return -(token_id + 1) / 1000.0  # never 0.0, and a known function of the token


class ScriptedEngine:
    """Answers each prompt with a hand-written assistant text chosen by (task prompt, turn).

    script: {task prompt: [text of turn 0, text of turn 1, ...]} (the last one repeats). The reply
    is encode(text + '<|im_end|>'), cut to params.max_tokens (finish "length") or at a stop
    token."""

    def __init__(self, tok, script):
        self.tok, self.script = tok, script
        self.calls = []  # (prompts, params) of every generate call
        self.replies = {}  # tuple(prompt ids) -> generated ids

    def generate(self, prompts, params):
        self.calls.append(([list(p) for p in prompts], params))
        out = []
        for p in prompts:
            text = self.tok.decode(p, skip_special_tokens=False)
            key = next(k for k in self.script if k in text)
            turn = text.count("<|im_start|>assistant") - 1
            texts = self.script[key]
            ids = encode(self.tok, texts[min(turn, len(texts) - 1)] + "<|im_end|>")
            finish = "length"
            for k, t in enumerate(ids):
                if t in params.stop_token_ids:
                    ids, finish = ids[: k + 1], "stop"
                    break
            if len(ids) > params.max_tokens:
                ids, finish = ids[: params.max_tokens], "length"
            self.replies[tuple(p)] = ids
            out.append(
                Generation(
                    token_ids=ids, logprobs=[fake_logprob(t) for t in ids], finish_reason=finish
                )
            )
        return out


@dataclass(frozen=True)
class CalcState:
    task: object
    turn: int = 0
    tool_errors: int = 0


class CalcEnv:
    """A tiny tool env following the env.Env interface: an `add` tool, then 'ANSWER: n' ends the
    episode."""

    name = "calc"
    SYSTEM = "Use the add tool, then reply with ANSWER: <number>."
    TOOLS = [TOOLS[0]]

    def tools(self):
        return self.TOOLS

    def reset(self, task, seed):
        return CalcState(task), [
            {"role": "system", "content": self.SYSTEM},
            {"role": "user", "content": task.prompt},
        ]

    def step(self, state, action):
        """As env.Env.step: the info says what this step added to the episode's counters (the agent
        sums them)."""
        state = replace(state, turn=state.turn + 1)
        if action.parse_error is not None:
            return (
                state,
                [{"role": "user", "content": f"Error: {action.parse_error}"}],
                0.0,
                False,
                {"turn": state.turn, "parse_failures": 1},
            )
        if action.tool_calls:
            obs, errors = [], 0
            for c in action.tool_calls:
                if c.name == "add" and set(c.arguments) == {"a", "b"}:
                    obs.append(
                        {
                            "role": "tool",
                            "name": c.name,
                            "content": str(c.arguments["a"] + c.arguments["b"]),
                        }
                    )
                else:
                    errors += 1
                    obs.append({"role": "tool", "name": c.name, "content": "error: bad call"})
            state = replace(state, tool_errors=state.tool_errors + errors)
            return state, obs, 0.0, False, {"turn": state.turn, "tool_errors": errors}
        reward = float(f"ANSWER: {state.task.answer}" in action.text)
        return state, [], reward, True, {"turn": state.turn, "correct": reward == 1.0}


class BoomEnv(CalcEnv):
    name = "boom"

    def step(self, state, action):
        raise RuntimeError("the sandbox died")


def calc_task(i, a, b, env="calc"):
    return Task(env=env, id=f"{env}-{i}", prompt=f"Compute {a} + {b}.", answer=str(a + b))


def call_text(a, b, content=""):
    block = '<tool_call>\n{"name": "add", "arguments": {"a": %d, "b": %d}}\n</tool_call>' % (a, b)
    return (content + "\n" + block) if content else block


def episode_prompts(engine, traj):
    """The distinct prompts the engine saw for this trajectory, shortest first."""
    seen = {
        tuple(p) for prompts, _ in engine.calls for p in prompts if traj.token_ids[: len(p)] == p
    }
    return [list(p) for p in sorted(seen, key=len)]


def three_turn_script(a, b):
    # two tool calls in one message, then another call with content, then the answer
    return [
        call_text(a, b) + "\n" + call_text(b, a),
        call_text(a + b, 0, content="Double-check."),
        f"ANSWER: {a + b}",
    ]


def test_no_drift_qwen25_and_exact_mask(tok):
    tasks = [calc_task(0, 2, 3), calc_task(1, 40, 17)]
    engine = ScriptedEngine(
        tok,
        {
            t.prompt: three_turn_script(int(t.prompt.split()[1]), int(t.prompt.split()[3][:-1]))
            for t in tasks
        },
    )
    cfg = AgentConfig(n_samples=2, max_turns=4, max_total_tokens=2048)
    trajs = run_episodes(
        engine, {"calc": CalcEnv()}, tasks, tok, cfg, SamplingParams(max_tokens=200), seed=0
    )
    im_end = tok.token_to_id("<|im_end|>")
    for tr in trajs:
        assert (tr.done, tr.finish_reason, tr.reward, tr.num_turns, tr.num_tool_calls) == (
            True,
            "done",
            1.0,
            3,
            3,
        )
        assert tr.parse_failures == tr.env_errors == tr.empty_responses == tr.tool_errors == 0
        assert len(tr.token_ids) == len(tr.loss_mask) == len(tr.logprobs)
        # (1) no drift: the token-in-token-out trajectory
        # is the tokenization of the final conversation
        full = render(tr.messages, CalcEnv.TOOLS, chat_format="qwen2.5")
        assert full.endswith("<|im_end|>\n") and tr.token_ids == encode(tok, full[:-1])
        a, b = (2, 3) if tr.group == 0 else (40, 17)
        assert tr.messages[2] == {
            "role": "assistant",
            "content": "",
            "tool_calls": [fn_call("add", {"a": a, "b": b}), fn_call("add", {"a": b, "b": a})],
        }
        # (2) mask 1 exactly on what the engine returned, log-probs on those positions, 0 elsewhere
        prompts = episode_prompts(engine, tr)
        assert len(prompts) == 3 and prompts[0] == tr.token_ids[: tr.prompt_len]
        expected_mask = [0] * len(tr.token_ids)
        for p in prompts:
            gen = engine.replies[tuple(p)]
            assert tr.token_ids[len(p) : len(p) + len(gen)] == gen and gen[-1] == im_end
            expected_mask[len(p) : len(p) + len(gen)] = [1] * len(gen)
        assert tr.loss_mask == expected_mask
        assert tr.logprobs == [
            fake_logprob(t) if m else 0.0 for t, m in zip(tr.token_ids, tr.loss_mask)
        ]
        assert tr.token_ids[-1] == im_end and tr.loss_mask[-1] == 1


class TruncatingEngine(ScriptedEngine):
    """A ScriptedEngine that says each token came from a top-k / top-p set of a known size (a
    function of the id)."""

    def generate(self, prompts, params):
        return [
            replace(g, kept_sizes=[t % 7 + 1 for t in g.token_ids])
            for g in super().generate(prompts, params)
        ]


def test_kept_sizes_follow_the_sampled_tokens_into_the_batch(tok):
    # three turns, cut by max_tokens=12 in the second run (a forced <|im_end|>, mask 0): each
    # sampled token keeps the size its engine reported, everything else (prompt, observations, the
    # forced token, padding) has 0; an engine that reports none (no truncation) gives all 0
    tasks = [calc_task(0, 2, 3), calc_task(1, 40, 17)]
    script = {
        t.prompt: three_turn_script(int(t.prompt.split()[1]), int(t.prompt.split()[3][:-1]))
        for t in tasks
    }
    cfg = AgentConfig(n_samples=2, max_turns=4, max_total_tokens=2048)
    for params in (
        SamplingParams(max_tokens=200, top_p=0.9),
        SamplingParams(max_tokens=12, top_k=5),
    ):
        trajs = run_episodes(
            TruncatingEngine(tok, script), {"calc": CalcEnv()}, tasks, tok, cfg, params, seed=0
        )
        for tr in trajs:
            assert tr.kept_sizes == [
                t % 7 + 1 if m else 0 for t, m in zip(tr.token_ids, tr.loss_mask)
            ]
        batch = to_batch(trajs, pad_id=0)
        for b, tr in enumerate(trajs):
            assert batch.kept_sizes[b].tolist() == tr.kept_sizes + [0] * (
                batch.input_ids.shape[1] - len(tr.kept_sizes)
            )
    plain = run_episodes(
        ScriptedEngine(tok, script), {"calc": CalcEnv()}, tasks, tok, cfg, SamplingParams(), seed=0
    )
    assert not to_batch(plain, pad_id=0).kept_sizes.any()


def test_truncated_generation_gets_forced_im_end(tok):
    task = calc_task(0, 2, 3)
    engine = ScriptedEngine(
        tok, {task.prompt: [call_text(2, 3, content="I will now call the add tool"), "ANSWER: 5"]}
    )
    cfg = AgentConfig(n_samples=1, max_turns=3, max_total_tokens=2048)
    (tr,) = run_episodes(
        engine, {"calc": CalcEnv()}, [task], tok, cfg, SamplingParams(max_tokens=6), seed=0
    )
    im_end = tok.token_to_id("<|im_end|>")
    P = tr.prompt_len
    # (3) six sampled tokens (mask 1), then a forced <|im_end|> (mask 0, log-prob 0)
    assert engine.calls[0][1].max_tokens == 6 and len(engine.replies[tuple(tr.token_ids[:P])]) == 6
    assert (
        tr.loss_mask[P : P + 7] == [1] * 6 + [0]
        and tr.token_ids[P + 6] == im_end
        and tr.logprobs[P + 6] == 0.0
    )
    assert im_end not in tr.token_ids[P : P + 6]
    assert tr.messages[2] == {"role": "assistant", "content": tok.decode(tr.token_ids[P : P + 6])}
    # the cut text has no tool call, so the env takes it as a (wrong) final answer; the conversation
    # is well formed: closed by the forced <|im_end|>, it re-renders to the same tokens
    assert (tr.done, tr.reward, tr.num_turns, tr.parse_failures) == (True, 0.0, 1, 0)
    assert tr.token_ids == encode(tok, render(tr.messages, CalcEnv.TOOLS)[:-1])


def test_truncated_tool_call_is_a_parse_failure(tok):
    task = calc_task(0, 2, 3)
    engine = ScriptedEngine(tok, {task.prompt: [call_text(2, 3), "ANSWER: 5"]})
    cfg = AgentConfig(n_samples=1, max_turns=3, max_total_tokens=2048)
    (tr,) = run_episodes(
        engine, {"calc": CalcEnv()}, [task], tok, cfg, SamplingParams(max_tokens=4), seed=0
    )
    assert tr.parse_failures == 1 and tr.num_tool_calls == 0
    assert tr.messages[3]["role"] == "user" and "not closed" in tr.messages[3]["content"]
    assert tr.done and tr.reward == 1.0


def test_other_stop_token_is_closed_with_im_end(tok):
    task = calc_task(0, 2, 3)
    engine = ScriptedEngine(tok, {task.prompt: ["ANSWER: 5<|endoftext|>"]})
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    params = SamplingParams(max_tokens=50, stop_token_ids=(eot,))
    (tr,) = run_episodes(
        engine, {"calc": CalcEnv()}, [task], tok, AgentConfig(n_samples=1), params, seed=0
    )
    assert engine.calls[0][1].stop_token_ids == (im_end, eot)
    assert tr.token_ids[-2:] == [eot, im_end] and tr.loss_mask[-2:] == [1, 0]
    assert tr.messages[-1]["content"] == "ANSWER: 5" and tr.reward == 1.0


def test_max_turns_ends_episode(tok):
    task = calc_task(0, 2, 3)
    engine = ScriptedEngine(tok, {task.prompt: [call_text(2, 3)]})  # calls the tool forever
    cfg = AgentConfig(n_samples=2, max_turns=2, max_total_tokens=4096)
    trajs = run_episodes(
        engine, {"calc": CalcEnv()}, [task], tok, cfg, SamplingParams(max_tokens=100), seed=0
    )
    for tr in trajs:
        assert (tr.finish_reason, tr.done, tr.reward, tr.num_turns, tr.num_tool_calls) == (
            "max_turns",
            False,
            0.0,
            2,
            2,
        )
        assert tr.token_ids[-1] == tok.token_to_id("<|im_end|>") and tr.loss_mask[-1] == 1
        # the last observation is not appended (no turn would answer it)
        assert tr.messages[-1]["role"] == "assistant"
    assert len(engine.calls) == 2
    assert rollout_metrics(trajs, 2)["rollout/truncated"] == 1.0


def test_token_budget_ends_episodes(tok):
    short, long_ = calc_task(0, 2, 3), calc_task(1, 4, 5)
    long_ = replace(long_, prompt="Compute 4 + 5. " + "Please be careful with the numbers. " * 2)
    engine = ScriptedEngine(
        tok, {short.prompt: [call_text(2, 3)], "Compute 4 + 5.": [call_text(4, 5)]}
    )
    env = CalcEnv()
    P_short = len(
        encode(tok, render(env.reset(short, 0)[1], env.TOOLS, add_generation_prompt=True))
    )
    P_long = len(encode(tok, render(env.reset(long_, 0)[1], env.TOOLS, add_generation_prompt=True)))
    budget = P_long + 40
    assert P_short < P_long
    cfg = AgentConfig(n_samples=1, max_turns=10, max_total_tokens=budget)
    trajs = run_episodes(
        engine, {"calc": env}, [short, long_], tok, cfg, SamplingParams(max_tokens=500), seed=0
    )
    for tr in trajs:
        assert (
            tr.finish_reason == "context_full"
            and tr.context_full
            and not tr.done
            and tr.reward == 0.0
        )
        assert len(tr.token_ids) <= budget and tr.num_turns >= 1
    # one call per turn; it asks for the largest remaining budget
    # (one token kept for a forced <|im_end|>)
    assert engine.calls[0][1].max_tokens == budget - P_short - 1
    # each episode got at most its own budget
    assert sum(trajs[1].loss_mask[P_long:]) <= budget - P_long - 1
    # a prompt longer than the budget: no turn at all
    cfg = replace(cfg, max_total_tokens=P_short)
    (tr,) = run_episodes(
        ScriptedEngine(tok, {}), {"calc": env}, [short], tok, cfg, SamplingParams(), seed=0
    )
    assert (tr.num_turns, tr.finish_reason, tr.context_full, sum(tr.loss_mask)) == (
        0,
        "context_full",
        True,
        0,
    )


LONG_THOUGHT = "Let me think about this carefully before I call the tool. " * 3


def test_three_length_limits_are_counted_by_kind(tok):
    """rollout.max_tokens cuts a turn, agent.max_episode_tokens the episode's sampled tokens,
    agent.max_total_tokens the context: each cut is counted against the limit that made it, and ends
    what it should."""
    task = calc_task(0, 2, 3)
    script = {task.prompt: [call_text(2, 3, content=LONG_THOUGHT), "ANSWER: 5"]}
    env = {"calc": CalcEnv()}
    P = len(
        encode(tok, render(CalcEnv().reset(task, 0)[1], CalcEnv.TOOLS, add_generation_prompt=True))
    )
    # the first reply, stopped
    L1 = len(encode(tok, call_text(2, 3, content=LONG_THOUGHT) + "<|im_end|>"))
    roomy = AgentConfig(n_samples=1, max_turns=3, max_total_tokens=4096)

    def play(cfg, max_tokens=500):
        (tr,) = run_episodes(
            ScriptedEngine(tok, script),
            env,
            [task],
            tok,
            cfg,
            SamplingParams(max_tokens=max_tokens),
            seed=0,
        )
        return tr, rollout_metrics([tr], 1)

    tr, m = play(roomy)  # no limit binds: two turns, the tool, the answer
    assert (
        tr.finish_reason,
        tr.reward,
        tr.truncated_turns,
        tr.truncated_episode,
        tr.context_full,
    ) == ("done", 1.0, 0, False, False) and not tr.length_cut
    assert (
        m["rollout/truncated_turn"],
        m["rollout/truncated_episode"],
        m["rollout/context_full"],
    ) == (0, 0, 0)
    # the turn limit: the first reply is cut (no tool call left in it),
    # the env scores it and ends the episode
    tr, m = play(roomy, max_tokens=10)
    assert (
        tr.finish_reason,
        tr.num_turns,
        tr.truncated_turns,
        tr.truncated_episode,
        tr.context_full,
    ) == ("done", 1, 1, False, False) and tr.length_cut
    # ten sampled tokens, then a forced <|im_end|>
    assert sum(tr.loss_mask) == 10 and tr.loss_mask[-1] == 0
    assert (m["rollout/truncated_turn"], m["rollout/truncated"]) == (1.0, 0.0)
    # the episode limit, reached exactly by the first turn:
    # the episode ends before the tool's answer is rendered
    tr, m = play(replace(roomy, max_episode_tokens=L1))
    assert (
        tr.finish_reason,
        tr.num_turns,
        tr.truncated_turns,
        tr.truncated_episode,
        tr.context_full,
    ) == ("episode_tokens", 1, 0, True, False)
    assert tr.token_ids[-1] == tok.token_to_id("<|im_end|>") and len(tr.token_ids) == P + L1
    assert (
        m["rollout/truncated_episode"],
        m["rollout/truncated"],
        m["rollout/truncated_turn"],
    ) == (1.0, 1.0, 0.0)
    # the episode limit in the middle of the second turn:
    # that turn is cut at it (the per-turn limit is roomier)
    tr, _ = play(replace(roomy, max_episode_tokens=L1 + 2))
    assert sum(tr.loss_mask) == L1 + 2 and (
        tr.truncated_episode,
        tr.truncated_turns,
        tr.num_turns,
    ) == (True, 0, 2)
    # the context: a window that leaves the first turn 5 tokens is a context cut, not a turn cut
    tr, m = play(replace(roomy, max_total_tokens=P + 6))
    assert (tr.num_turns, tr.truncated_turns, tr.truncated_episode, tr.context_full) == (
        1,
        0,
        False,
        True,
    )
    assert len(tr.token_ids) == P + 6 and m["rollout/context_full"] == 1.0
    # a tie between the turn limit and the context's room
    # counts against the turn limit (the first in turn_room)
    tr, _ = play(replace(roomy, max_total_tokens=P + 6), max_tokens=5)
    assert (tr.truncated_turns, tr.context_full) == (1, False)


class CharwiseEngine(ScriptedEngine):
    """A ScriptedEngine whose replies are tokenized one character at a time: the same text, but not
    the ids that encoding it gives (BPE would merge them), so a trajectory that re-tokenized any
    text would show it."""

    def generate(self, prompts, params):
        out = []
        for p, g in zip(prompts, super().generate(prompts, params)):
            text = self.tok.decode(g.token_ids, skip_special_tokens=False)
            chars = (
                ([c for c in text[: -len("<|im_end|>")]] + ["<|im_end|>"])
                if text.endswith("<|im_end|>")
                else list(text)
            )
            ids = [i for c in chars for i in encode(self.tok, c)][: params.max_tokens]
            self.replies[tuple(p)] = ids
            out.append(
                Generation(
                    token_ids=ids,
                    logprobs=[fake_logprob(t) for t in ids],
                    finish_reason="stop" if ids and ids[-1] in params.stop_token_ids else "length",
                )
            )
        return out


class LongObsEnv(CalcEnv):
    """CalcEnv whose tool answers are long, with unicode, runs of spaces and newlines (many BPE
    merge boundaries)."""

    OBS = "Result:  5\n" + "数学 ✓ — the sum  of the numbers,\tchecked twice.\n" * 12

    def step(self, state, action):
        state, obs, reward, done, info = super().step(state, action)
        return state, [dict(o, content=self.OBS + o["content"]) for o in obs], reward, done, info


@pytest.mark.parametrize("tight", [False, True])
def test_long_observations_train_on_exactly_the_sampled_tokens(tok, tight):
    """Long observations, replies tokenized in a way BPE would not: every sampled token reaches the
    learner's batch as the engine returned it (ids and log-probs, mask 1, nothing dropped, nothing
    re-tokenized), every other token is the prompt, a forced <|im_end|> or an observation rendered
    once, and an observation that does not fit is left out whole (the context counter says so),
    never cut."""
    tasks = [calc_task(0, 2, 3), calc_task(1, 40, 17)]
    engine = CharwiseEngine(
        tok,
        {
            t.prompt: three_turn_script(int(t.prompt.split()[1]), int(t.prompt.split()[3][:-1]))
            for t in tasks
        },
    )
    cfg = AgentConfig(n_samples=2, max_turns=4, max_total_tokens=4096)
    trajs = run_episodes(
        engine, {"calc": LongObsEnv()}, tasks, tok, cfg, SamplingParams(max_tokens=300), seed=0
    )
    window = 4096
    if tight:
        # a window one token short of the first episode's second observation (and a turn after it)
        window = len(episode_prompts(engine, trajs[0])[2]) + 1
        cfg, engine.calls = replace(cfg, max_total_tokens=window), []
        trajs = run_episodes(
            engine, {"calc": LongObsEnv()}, tasks, tok, cfg, SamplingParams(max_tokens=300), seed=0
        )
    im_end = tok.token_to_id("<|im_end|>")
    batch = to_batch(trajs, pad_id=0)
    for b, tr in enumerate(trajs):
        # rebuild the trajectory from what the engine returned
        # and the observations rendered, span by span
        prompts = episode_prompts(engine, tr)
        assert prompts[0] == tr.token_ids[: tr.prompt_len]
        want, mask = list(prompts[0]), [0] * tr.prompt_len
        turn_obs = iter(_group_tool_turns(tr.messages[2:]))
        for k, p in enumerate(prompts):
            assert want == p  # the next prompt is exactly the trajectory so far
            gen = engine.replies[tuple(p)]
            # ids BPE would not give
            assert gen != encode(tok, tok.decode(gen, skip_special_tokens=False))
            want += gen
            mask += [1] * len(gen)
            if gen[-1] != im_end:
                want, mask = want + [im_end], mask + [0]
            obs = next(turn_obs, None)
            if obs and k + 1 < len(prompts):
                cont = encode(tok, render_continuation(obs))
                want, mask = want + cont, mask + [0] * len(cont)
        assert tr.token_ids == want and tr.loss_mask == mask
        assert len(tr.token_ids) <= window
        assert tr.logprobs == [
            fake_logprob(t) if m else 0.0 for t, m in zip(tr.token_ids, tr.loss_mask)
        ]
        n = len(tr.token_ids)  # the learner's row is the trajectory, untouched
        assert (
            batch.input_ids[b, :n].tolist() == tr.token_ids
            and batch.loss_mask[b, :n].tolist() == tr.loss_mask
        )
        assert batch.logprobs[b, :n].tolist() == pytest.approx(tr.logprobs, abs=1e-7)
        assert int(batch.length_cut[b]) == int(tr.length_cut)
        if not tight:
            assert (tr.finish_reason, tr.reward, tr.context_full) == ("done", 1.0, False)
        elif tr.finish_reason == "context_full":  # an observation did not fit: left out, whole
            assert (
                tr.context_full
                and tr.messages[-1]["role"] == "assistant"
                and tr.token_ids[-1] == im_end
            )
    if tight:
        assert (trajs[0].finish_reason, trajs[0].num_turns, trajs[0].truncated_turns) == (
            "context_full",
            2,
            0,
        )
        assert rollout_metrics(trajs, 2)["rollout/context_full"] >= 0.25


def _group_tool_turns(messages):
    """The observation of each assistant turn: the tool messages that follow it, as one list per
    turn."""
    turns = []
    for m in messages:
        if m["role"] == "assistant":
            turns.append([])
        elif turns:
            turns[-1].append(m)
    return turns


def test_env_error_ends_episode_cleanly_in_mixed_batch(tok):
    tasks = [calc_task(0, 2, 3), calc_task(1, 4, 5, env="boom")]
    engine = ScriptedEngine(
        tok,
        {
            t.prompt: three_turn_script(int(t.prompt.split()[1]), int(t.prompt.split()[3][:-1]))
            for t in tasks
        },
    )
    cfg = AgentConfig(n_samples=2, max_turns=4, max_total_tokens=2048)
    trajs = run_episodes(
        engine, {"calc": CalcEnv(), "boom": BoomEnv()}, tasks, tok, cfg, SamplingParams(), seed=0
    )
    ok, boom = trajs[:2], trajs[2:]
    for tr in boom:
        assert (tr.env_errors, tr.reward, tr.done, tr.finish_reason, tr.num_turns) == (
            1,
            0.0,
            False,
            "env_error",
            1,
        )
        assert "the sandbox died" in tr.info["error"]
    assert all(tr.reward == 1.0 and tr.done for tr in ok)
    m = rollout_metrics(trajs, 2)
    assert (
        m["rollout/calc/reward"] == 1.0
        and m["rollout/boom/reward"] == 0.0
        and m["rollout/env_errors"] == 0.5
    )


def test_group_major_order_and_seeds(tok):
    tasks = [calc_task(i, i, i + 1) for i in range(3)]
    engine = ScriptedEngine(tok, {t.prompt: ["ANSWER: 0"] for t in tasks})
    cfg = AgentConfig(n_samples=3, max_turns=1)
    trajs = run_episodes(
        engine, {"calc": CalcEnv()}, tasks, tok, cfg, SamplingParams(n=5, seed=None), seed=7
    )
    assert [(t.group, t.sample) for t in trajs] == [(g, s) for g in range(3) for s in range(3)]
    assert [t.task for t in trajs] == [tasks[g] for g in range(3) for _ in range(3)]
    ((prompts, params),) = engine.calls
    assert len(prompts) == 9 and params.n == 1 and params.seed is not None
    # reproducible: the engine seed of each turn depends only on (seed, turn)
    again = ScriptedEngine(tok, engine.script)
    run_episodes(again, {"calc": CalcEnv()}, tasks, tok, cfg, SamplingParams(), seed=7)
    other = ScriptedEngine(tok, engine.script)
    run_episodes(other, {"calc": CalcEnv()}, tasks, tok, cfg, SamplingParams(), seed=8)
    assert again.calls[0][1].seed == params.seed != other.calls[0][1].seed


def test_to_batch_shapes_and_padding(tok):
    tasks = [calc_task(0, 2, 3), calc_task(1, 40, 17)]
    engine = ScriptedEngine(
        tok, {tasks[0].prompt: ["ANSWER: 5"], tasks[1].prompt: three_turn_script(40, 17)}
    )
    trajs = run_episodes(
        engine,
        {"calc": CalcEnv()},
        tasks,
        tok,
        AgentConfig(n_samples=2, max_total_tokens=2048),
        SamplingParams(),
        seed=0,
    )
    batch = to_batch(trajs, pad_id=-1)
    lengths = [len(t.token_ids) for t in trajs]
    B, T = 4, max(lengths)
    assert lengths[0] < lengths[2]
    assert batch.input_ids.shape == batch.loss_mask.shape == batch.logprobs.shape == (B, T)
    assert (
        batch.input_ids.dtype == agent.torch.long and batch.loss_mask.dtype == agent.torch.float32
    )
    assert batch.lengths.tolist() == lengths and [t.group for t in trajs] == [0, 0, 1, 1]
    assert batch.rewards.tolist() == [1.0, 1.0, 1.0, 1.0]
    for b, t in enumerate(trajs):
        L = lengths[b]
        assert (
            batch.input_ids[b, :L].tolist() == t.token_ids and (batch.input_ids[b, L:] == -1).all()
        )
        assert (
            batch.loss_mask[b, :L].tolist() == t.loss_mask and (batch.loss_mask[b, L:] == 0).all()
        )
        assert (
            batch.logprobs[b, :L].tolist() == pytest.approx(t.logprobs)
            and (batch.logprobs[b, L:] == 0).all()
        )


def test_qwen3_token_in_token_out_despite_rerender_drift(tok):
    task = calc_task(0, 2, 3)
    engine = ScriptedEngine(tok, {task.prompt: three_turn_script(2, 3)})
    cfg = AgentConfig(
        n_samples=1, max_turns=4, max_total_tokens=2048, chat_format="qwen3", enable_thinking=False
    )
    (tr,) = run_episodes(engine, {"calc": CalcEnv()}, [task], tok, cfg, SamplingParams(), seed=0)
    assert tr.done and tr.reward == 1.0 and tr.num_turns == 3
    # (8) each turn's prompt extends the previous prompt + its generation:
    # nothing earlier is re-tokenized
    prompts = episode_prompts(engine, tr)
    assert len(prompts) == 3
    for prev, nxt in zip(prompts, prompts[1:]):
        gen = engine.replies[tuple(prev)]
        assert nxt[: len(prev) + len(gen)] == prev + gen
    assert tr.token_ids[: len(prompts[-1])] == prompts[-1]
    # every generation prompt carried the empty think block...
    text = tok.decode(tr.token_ids, skip_special_tokens=False)
    assert text.count("<|im_start|>assistant\n<think>\n\n</think>\n\n") == 3
    # ...but Qwen3's template, re-rendering the finished conversation, keeps it only on the
    # last assistant turn: the re-rendered text is not what the engine saw,
    # so trajectories must be built token-in-token-out.
    rerender = render(tr.messages, CalcEnv.TOOLS, chat_format="qwen3", enable_thinking=False)
    assert rerender.count("<think>") == 1 and rerender[:-1] != text


def test_rollout_metrics_hand_computed():
    def tr(group, reward, env="calc", finish="done", mask=(0, 1, 1), turns=1):
        t = Task(env=env, id=f"{env}-{group}", prompt="p", answer="a")
        return Trajectory(
            task=t,
            group=group,
            sample=0,
            token_ids=[1] * len(mask),
            loss_mask=list(mask),
            logprobs=[0.0] * len(mask),
            prompt_len=1,
            messages=[],
            reward=reward,
            done=finish == "done",
            num_turns=turns,
            finish_reason=finish,
        )

    trajs = [
        tr(0, 1.0),
        tr(0, 0.0, finish="max_turns", turns=3),
        tr(1, 1.0, mask=(0, 1, 1, 1, 1)),
        tr(1, 1.0),
    ]
    m = rollout_metrics(trajs, 2)
    assert m["rollout/reward"] == 0.75
    assert m["rollout/num_turns"] == 1.5  # (1 + 3 + 1 + 1) / 4
    assert m["rollout/response_tokens"] == 2.5  # (2 + 2 + 4 + 2) / 4
    assert m["rollout/total_tokens"] == 3.5  # (3 + 3 + 5 + 3) / 4
    assert m["rollout/truncated"] == 0.25
    assert m["rollout/frac_groups_mixed"] == 0.5  # group 0 mixed, group 1 all 1.0
    assert not any(k.startswith("rollout/calc/") for k in m)  # one env: no per-env keys
    m = rollout_metrics(trajs + [tr(2, 0.0, env="search"), tr(2, 0.0, env="search")], 2)
    assert m["rollout/calc/reward"] == 0.75 and m["rollout/search/reward"] == 0.0


# -----------------------------------------------------------------------------
# the real env: expert demonstrations replayed through the loop


def test_real_toy_math_env_replays_demonstrations(tok):
    env = env_module.make_env("toy_math")
    tasks = env.sample_tasks("test", 3, seed=0)
    scripts = {}
    for task in tasks:
        demo = env.demonstration(task, random.Random(0), use_tools=True)
        # the canonical text of each assistant turn =
        # what render() writes after the generation prompt
        texts = []
        for i, msg in enumerate(demo):
            if msg["role"] == "assistant":
                before = render(demo[:i], env.tools(), add_generation_prompt=True)
                texts.append(render(demo[: i + 1], env.tools())[len(before) : -len("<|im_end|>\n")])
        scripts[task.prompt] = texts
    engine = ScriptedEngine(tok, scripts)
    cfg = AgentConfig(n_samples=2, max_turns=8, max_total_tokens=8192)
    trajs = run_episodes(
        engine, {env.name: env}, tasks, tok, cfg, SamplingParams(max_tokens=1024), seed=0
    )
    for tr in trajs:
        assert tr.done and tr.reward == 1.0 and tr.parse_failures == 0 and tr.env_errors == 0
        assert tr.token_ids == encode(tok, render(tr.messages, env.tools())[:-1])


def test_qwen25_assistant_content_none():
    # OpenAI-style tool-call messages may carry content None; qwen2.5 renders it as empty content
    messages = [U1, {"role": "assistant", "content": None, "tool_calls": [CALL_ADD]}, TOOL5]
    expected = jinja_render(QWEN25_CHAT_TEMPLATE, messages, TOOLS, add_generation_prompt=True)
    assert render(messages, TOOLS, add_generation_prompt=True) == expected


class RetryEnv(CalcEnv):
    """Never done: every turn gets the same short user message back, so episodes run to max_turns or
    the budget."""

    name = "retry"

    def step(self, state, action):
        return (
            replace(state, turn=state.turn + 1),
            [{"role": "user", "content": "Try again."}],
            0.0,
            False,
            {},
        )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_prefix_cache_keeps_trajectories_and_prefills_only_new_tokens(tok, temperature):
    """Whole episodes through the agent loop with a random model, with and without TorchEngine's
    prefix cache: the same trajectories token for token (log-probs to float rounding, 1e-5 in fp32),
    and far fewer tokens prefilled, as LocalRollouts reports them."""
    from model import ModelConfig, init_model
    from wings.prefix_cache import PrefixCachedEngine

    cfg = ModelConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = init_model(cfg, 0)
    envs = {"retry": RetryEnv()}
    tasks = [calc_task(i, i, 2 * i, env="retry") for i in range(3)]
    agent_cfg = AgentConfig(n_samples=2, max_turns=4, max_total_tokens=300)
    params = SamplingParams(temperature=temperature, max_tokens=12)
    played = {}
    for budget in (0, 50_000):
        engine = PrefixCachedEngine(
            model, pad_id=tok.token_to_id("<|endoftext|>"), prefix_cache_tokens=budget
        )
        rollouts = agent.LocalRollouts(engine, envs, tok, agent_cfg)
        played[budget] = rollouts.play(tasks, params, seed=5)
    (plain, plain_m), (cached, cached_m) = played[0], played[50_000]
    assert [t.token_ids for t in cached] == [t.token_ids for t in plain]
    assert [t.loss_mask for t in cached] == [t.loss_mask for t in plain]
    assert max(t.num_turns for t in plain) == 4
    for a, b in zip(cached, plain):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert plain_m["rollout/prefix_cached"] == 0.0
    # turns re-prefill
    assert plain_m["rollout/prefilled_tokens"] > sum(len(t.token_ids) for t in plain) / len(plain)
    assert cached_m["rollout/prefilled_tokens"] < plain_m["rollout/prefilled_tokens"] / 2
    assert cached_m["rollout/prefix_cached"] > 0.5


class StepRewardEnv(CalcEnv):
    """CalcEnv that pays 0.25 for every tool step (an intermediate reward), as envs that reward
    sub-goals do."""

    def step(self, state, action):
        state, obs, reward, done, info = super().step(state, action)
        return state, obs, reward + (0.25 if action.tool_calls else 0.0), done, info


class KeyedEnv(CalcEnv):
    """CalcEnv that names its state in info["state_key"] (as alfworld_lite does): here only the turn
    count."""

    def step(self, state, action):
        state, obs, reward, done, info = super().step(state, action)
        return state, obs, reward, done, {**info, "state_key": f"after turn {state.turn}"}


def test_turn_states_key_the_observation_each_turn_follows(tok):
    """Trajectory.turn_states: turn 0 acts from the first prompt (the same for the whole group),
    turn k from the observation tokens appended after turn k - 1, or from the env's
    info["state_key"] when it gives one; to_batch pads them with -1 (algo.turn_baseline=state
    matches them)."""
    tasks = [calc_task(0, 2, 3)]
    engine = ScriptedEngine(tok, {tasks[0].prompt: three_turn_script(2, 3)})
    cfg = AgentConfig(n_samples=2, max_turns=4, max_total_tokens=2048)
    trajs = run_episodes(engine, {"calc": CalcEnv()}, tasks, tok, cfg, SamplingParams(), seed=0)
    tr = trajs[0]
    prompts = episode_prompts(engine, tr)
    observations = [tr.token_ids[: len(prompts[0])]] + [
        tr.token_ids[len(p) + len(engine.replies[tuple(p)]) : len(q)]
        for p, q in zip(prompts, prompts[1:])
    ]
    assert tr.turn_states == [state_key(o) for o in observations] and len(set(tr.turn_states)) == 3
    assert trajs[1].turn_states == tr.turn_states  # the same observations, the same keys
    assert state_key([1, 2]) == state_key([1, 2]) != state_key([2, 1]) != state_key("12")
    keyed = run_episodes(
        ScriptedEngine(tok, {tasks[0].prompt: three_turn_script(2, 3)}),
        {"calc": KeyedEnv()},
        tasks,
        tok,
        cfg,
        SamplingParams(),
        seed=0,
    )[0]
    assert keyed.turn_states == [
        tr.turn_states[0],
        state_key("after turn 1"),
        state_key("after turn 2"),
    ]
    short = replace(tr, turn_states=tr.turn_states[:1], turn_rewards=tr.turn_rewards[:1])
    assert to_batch([tr, short], pad_id=-1).turn_states.tolist() == [
        tr.turn_states,
        [tr.turn_states[0], -1, -1],
    ]


def test_turn_rewards_and_turn_index(tok):
    """Each assistant turn keeps the env's reward of its step (they sum to the episode's) and where
    it starts; to_batch gives every sampled token its turn, -1 to everything else (algo.credit=turn
    reads both)."""
    tasks = [calc_task(0, 2, 3), calc_task(1, 4, 5, env="boom")]
    engine = ScriptedEngine(
        tok, {tasks[0].prompt: three_turn_script(2, 3), tasks[1].prompt: ["ANSWER: 9"]}
    )
    cfg = AgentConfig(n_samples=2, max_turns=4, max_total_tokens=2048)
    trajs = run_episodes(
        engine,
        {"calc": StepRewardEnv(), "boom": BoomEnv()},
        tasks,
        tok,
        cfg,
        SamplingParams(),
        seed=0,
    )
    for tr in trajs[:2]:
        assert tr.turn_rewards == [0.25, 0.25, 1.0] and tr.reward == sum(tr.turn_rewards) == 1.5
        assert tr.turn_starts == [len(p) for p in episode_prompts(engine, tr)]
    # an env error pays nothing
    assert all(tr.turn_rewards == [0.0] and tr.reward == 0.0 for tr in trajs[2:])
    batch = to_batch(trajs, pad_id=-1)
    assert batch.turn_rewards.tolist() == [[0.25, 0.25, 1.0]] * 2 + [[0.0, 0.0, 0.0]] * 2
    assert batch.turn_mask.tolist() == [[1, 1, 1]] * 2 + [[1, 0, 0]] * 2
    for b, tr in enumerate(trajs):
        expected = [-1] * batch.turn_index.shape[1]
        for k, p in enumerate(episode_prompts(engine, tr)):
            gen = engine.replies[tuple(p)]
            expected[len(p) : len(p) + len(gen)] = [k] * len(gen)
        assert batch.turn_index[b].tolist() == expected


def test_per_token_versions_follow_the_engine(tok):
    """Every sampled token records the weight version the engine reports for it (partial rollouts:
    it may change within a generation), every other token (prompt, observations) -1; an engine that
    reports none leaves
    -1 on its tokens too (train.py then stamps the batch's version)."""

    class Versioned(ScriptedEngine):
        # call c's k-th token: version 10 c + k, to check the alignment
        def generate(self, prompts, params):
            return [
                replace(g, versions=[10 * len(self.calls) + k for k in range(len(g.token_ids))])
                for g in super().generate(prompts, params)
            ]

    tasks = [calc_task(0, 2, 3), calc_task(1, 40, 17)]
    script = {
        t.prompt: three_turn_script(int(t.prompt.split()[1]), int(t.prompt.split()[3][:-1]))
        for t in tasks
    }
    cfg = AgentConfig(n_samples=2, max_turns=4, max_total_tokens=2048)
    trajs = run_episodes(
        Versioned(tok, script),
        {"calc": CalcEnv()},
        tasks,
        tok,
        cfg,
        SamplingParams(max_tokens=200),
        seed=0,
    )
    for tr in trajs:
        assert len(tr.versions) == len(tr.token_ids)
        runs, start = [], None  # the sampled spans (mask 1), one per turn
        for i, m in enumerate(tr.loss_mask + [0]):
            if m and start is None:
                start = i
            elif not m and start is not None:
                runs.append((start, i))
                start = None
        assert len(runs) == 3
        for turn, (a, b) in enumerate(runs, start=1):
            assert tr.versions[a:b] == [10 * turn + k for k in range(b - a)]
        assert all(v == -1 for v, m in zip(tr.versions, tr.loss_mask) if not m)
    plain = run_episodes(
        ScriptedEngine(tok, script),
        {"calc": CalcEnv()},
        tasks[:1],
        tok,
        cfg,
        SamplingParams(max_tokens=200),
        seed=0,
    )
    assert set(plain[0].versions) == {-1}
