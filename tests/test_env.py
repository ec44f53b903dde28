"""Tests for env.py: task generation and splits, rewards, every branch of step(), the python_eval
sandbox, the calculator and scratchpad tools, broken tools, and demonstrations replayed through
step(). (The python_exec sandbox has its own file, test_sandbox.py.)

Ground truth comes from outside the code under test: Python's own eval() of the canonical expression
(safe here: the expressions are digits and operators we check with a regex first), and hand-written
expected strings. The sandbox tests talk to a real worker process; the slowest one waits for the 2 s
timeout once.
"""

import json
import random
import re
import subprocess
import sys
import threading
import time
import warnings

import pytest

import env
import sandbox
import tools
from fractions import Fraction

from env import (
    ENVS,
    Action,
    EnvState,
    Task,
    ToolCall,
    ToyMathEnv,
    extract_answer,
    last_boxed,
    make_env,
    parse_number,
)
from sandbox import SANDBOX, PythonSandbox, check_code
from tools import TOOLS, calculate, format_exact

ARITHMETIC = re.compile(r"[\d\s()+\-*/]+")  # what a canonical toy-math expression may contain


@pytest.fixture(scope="module")
def toy():
    return make_env("toy_math")


def action(*calls, text="", parse_error=None):
    return Action(
        text=text,
        tool_calls=tuple(ToolCall(name, args) for name, args in calls),
        parse_error=parse_error,
    )


def fresh(toy, answer="84", prompt="What is 12 * 7?"):
    task = Task(
        env="toy_math",
        id="toy_math/test",
        prompt=prompt,
        answer=answer,
        meta={"expression": "12 * 7"},
    )
    return toy.reset(task, seed=0)[0]


# -----------------------------------------------------------------------------
# Tasks


def test_sample_tasks_deterministic_and_distinct(toy):
    a = toy.sample_tasks("train", 200, seed=3)
    assert a == toy.sample_tasks("train", 200, seed=3)
    # nothing hidden in the object
    assert a == make_env("toy_math").sample_tasks("train", 200, seed=3)
    assert a != toy.sample_tasks("train", 200, seed=4)
    assert len({t.id for t in a}) == len({t.prompt for t in a}) == 200
    # a prefix: n does not change which tasks come first
    assert toy.sample_tasks("train", 50, seed=3) == a[:50]
    assert {t.meta["kind"] for t in a} == {"binary", "multi", "word"}
    for t in a:
        assert t.env == "toy_math" and t.id.startswith("toy_math/")


def test_train_and_test_never_overlap(toy):
    train = [t for seed in range(3) for t in toy.sample_tasks("train", 3000, seed=seed)]
    test = [t for seed in range(3) for t in toy.sample_tasks("test", 1000, seed=seed)]
    train_prompts, test_prompts = {t.prompt for t in train}, {t.prompt for t in test}
    assert len(test_prompts) > 2000  # different seeds do give different test problems...
    assert not train_prompts & test_prompts  # ...and none of them is ever a training problem
    assert not {t.id for t in train} & {t.id for t in test}
    # Another difficulty setting draws other problems, but the split of a given text is the same.
    easy = make_env("toy_math", max_operand=12, kinds=("binary",)).sample_tasks(
        "train", 500, seed=0
    )
    assert not {t.prompt for t in easy} & test_prompts
    assert all(env.split_of(t.prompt) == "train" for t in easy)


def test_answers_are_correct(toy):
    for split in ("train", "test"):
        for t in toy.sample_tasks(split, 500, seed=1):
            expression = t.meta["expression"]
            assert ARITHMETIC.fullmatch(expression), expression
            assert eval(expression) == int(t.answer), t  # Python itself is the oracle
            assert t.answer == str(int(t.answer))  # answers are plain integers
            if t.meta["kind"] != "word":
                assert t.prompt == f"What is {expression}?"
            if "//" in expression:  # only exact divisions
                assert eval(expression.replace("//", "/")) == int(t.answer)


def test_difficulty_kwargs():
    small = make_env("toy_math", max_operand=9, kinds=("binary", "multi"), weights=(0.0, 1.0))
    tasks = small.sample_tasks("train", 100, seed=0)
    assert {t.meta["kind"] for t in tasks} == {"multi"}
    for t in tasks:
        # a // divisor may be larger, it must divide exactly
        left = t.meta["expression"].split("//")[0]
        assert all(1 <= int(x) <= 9 for x in re.findall(r"\d+", left)), t.meta["expression"]
    with pytest.raises(ValueError, match="unknown kinds"):
        make_env("toy_math", kinds=("calculus",))
    with pytest.raises(ValueError, match="weights"):
        make_env("toy_math", weights=(1.0,))
    with pytest.raises(ValueError, match="only"):
        # a space too small for n distinct tasks fails loudly
        make_env("toy_math", max_operand=2, kinds=("binary",)).sample_tasks("train", 500, seed=0)
    with pytest.raises(ValueError, match="split"):
        small.sample_tasks("validation", 1, seed=0)


# -----------------------------------------------------------------------------
# Rewards


@pytest.mark.parametrize(
    "answer, reward",
    [
        ("57", 1.0),
        ("57.0", 1.0),
        (" 57 ", 1.0),
        ("57.", 1.0),
        ("$57", 1.0),
        ("5 7", 1.0),
        ("57.000", 1.0),
        ("56", 0.0),
        ("57.5", 0.0),
        ("-57", 0.0),
        ("fifty-seven", 0.0),
        ("57 pens", 0.0),
        ("", 0.0),
        (None, 0.0),
        ("1e9999999999", 0.0),
    ],
)
def test_reward_normalization(toy, answer, reward):
    task = Task(env="toy_math", id="toy_math/x", prompt="", answer="57")
    assert toy.score(task, answer) == reward


def test_parse_number():
    assert parse_number("1,234") == 1234
    assert parse_number("$5") == 5
    assert parse_number("-3") == -3
    assert parse_number("0.5") * 2 == 1  # exact, not a float
    assert parse_number("1e3") == 1000
    assert parse_number("garbage") is None
    assert parse_number("1.2.3") is None


def test_extract_answer():
    assert extract_answer("The answer is \\boxed{84}.") == "84"
    assert extract_answer("\\boxed{1} no wait \\boxed{ 2 }") == "2"
    assert extract_answer("12 * 7 = 84.") == "84"
    assert extract_answer("It is 1,234, I think") == "1,234"
    assert extract_answer("10-3 gives -7? no: 7") == "7"
    assert extract_answer("below zero: -13") == "-13"
    assert extract_answer("no idea") is None


# -----------------------------------------------------------------------------
# step(): one test per branch


def test_reset(toy):
    task = toy.sample_tasks("train", 1, seed=0)[0]
    state, messages = toy.reset(task, seed=0)
    assert state == EnvState(task=task)
    assert messages == [
        {"role": "system", "content": toy.system_prompt()},
        {"role": "user", "content": task.prompt},
    ]
    with pytest.raises(ValueError, match="belongs to env"):
        toy.reset(Task(env="other", id="other/1", prompt="", answer=""), seed=0)


def test_step_parse_error(toy):
    state, obs, reward, done, info = toy.step(
        fresh(toy), action(text="<tool_call>{", parse_error="invalid JSON")
    )
    assert obs == [{"role": "tool", "name": "error", "content": obs[0]["content"]}]
    assert obs[0]["content"].startswith("Error: invalid JSON.")
    assert (reward, done, state.parse_failures, state.turn) == (0.0, False, 1, 1)
    assert info == {
        "format_ok": False,
        "answer": None,
        "tool_calls": 0,
        "tool_errors": 0,
        "tool_timeouts": 0,
        "parse_failures": 1,
    }


def test_step_unknown_tool(toy):
    state, obs, reward, done, info = toy.step(fresh(toy), action(("search", {"query": "84"})))
    assert obs[0]["role"] == "tool" and obs[0]["name"] == "search"
    assert obs[0]["content"] == "Error: unknown tool 'search'. Tools: python_eval, finish."
    assert (reward, done, state.tool_errors, info["tool_errors"]) == (0.0, False, 1, 1)


@pytest.mark.parametrize(
    "arguments, problem",
    [
        ({}, "missing"),
        ({"code": "1", "timeout": 9}, "unexpected"),
        ({"code": ["1"]}, "must be a string"),
        ("1 + 1", "JSON object"),
    ],
)
def test_step_bad_arguments(toy, arguments, problem):
    state, obs, reward, done, info = toy.step(fresh(toy), action(("python_eval", arguments)))
    assert problem in obs[0]["content"] and obs[0]["content"].startswith("Error:")
    assert (done, state.tool_errors, info["tool_errors"], info["tool_calls"]) == (False, 1, 1, 1)


def test_step_python_eval_then_finish(toy):
    state, obs, reward, done, info = toy.step(
        fresh(toy), action(("python_eval", {"code": "12 * 7"}))
    )
    assert obs == [{"role": "tool", "name": "python_eval", "content": "84"}]
    assert (reward, done, state.tool_calls, state.tool_errors, info["tool_calls"]) == (
        0.0,
        False,
        1,
        0,
        1,
    )
    state, obs, reward, done, info = toy.step(state, action(("finish", {"answer": "84"})))
    assert (obs, reward, done, state.reward, state.answer, state.turn) == (
        [],
        1.0,
        True,
        1.0,
        "84",
        2,
    )
    assert info == {
        "format_ok": True,
        "answer": "84",
        "tool_calls": 0,
        "tool_errors": 0,
        "tool_timeouts": 0,
        "parse_failures": 0,
    }
    with pytest.raises(ValueError, match="finished"):
        toy.step(state, action(("finish", {"answer": "84"})))


@pytest.mark.parametrize(
    "answer, reward, format_ok",
    [
        ("84", 1.0, True),
        ("84.0", 1.0, True),
        (84, 1.0, True),
        ("85", 0.0, True),
        ("eighty-four", 0.0, False),
    ],
)
def test_step_finish(toy, answer, reward, format_ok):
    state, obs, r, done, info = toy.step(fresh(toy), action(("finish", {"answer": answer})))
    assert (obs, r, done, state.reward, info["format_ok"], info["answer"]) == (
        [],
        reward,
        True,
        reward,
        format_ok,
        str(answer),
    )


def test_step_several_calls_stop_at_finish(toy):
    calls = [
        ("python_eval", {"code": "1/0"}),
        ("python_eval", {"code": "12*7"}),
        ("finish", {"answer": "84"}),
        ("python_eval", {"code": "never run"}),
    ]
    state, obs, reward, done, info = toy.step(fresh(toy), action(*calls))
    assert [o["content"] for o in obs] == ["Error: ZeroDivisionError: division by zero", "84"]
    assert (reward, done, state.tool_calls, state.tool_errors) == (1.0, True, 2, 1)
    assert (info["tool_calls"], info["tool_errors"], info["format_ok"]) == (2, 1, True)


def test_step_runs_the_calls_that_parsed_despite_a_parse_error(toy):
    # e.g. a repaired call, or a complete call whose </tool_call> was cut off: it runs, and the
    # problem is reported after its result and counted as a parse failure
    act = action(
        ("python_eval", {"code": "12 * 7"}), parse_error="<tool_call> at char 0 is not closed"
    )
    state, obs, reward, done, info = toy.step(fresh(toy), act)
    assert [o["content"] for o in obs] == ["84", obs[1]["content"]] and obs[1]["name"] == "error"
    assert obs[1]["content"].startswith("Error: <tool_call> at char 0 is not closed.")
    assert (done, state.parse_failures, state.tool_calls, info["tool_calls"]) == (False, 1, 1, 1)
    state, obs, reward, done, info = toy.step(
        state, action(("finish", {"answer": "84"}), parse_error="repaired")
    )
    assert (obs, reward, done, state.parse_failures) == ([], 1.0, True, 2)


def test_step_finish_with_bad_arguments_does_not_end(toy):
    state, obs, reward, done, info = toy.step(fresh(toy), action(("finish", {"result": "84"})))
    assert not done and "missing ['answer']" in obs[0]["content"] and state.tool_errors == 1


@pytest.mark.parametrize(
    "text, answer, reward",
    [
        ("12 * 7 is 84.", "84", 1.0),
        ("So the answer is \\boxed{84}", "84", 1.0),
        ("\\boxed{83} (12*7=84)", "83", 0.0),
        ("I think 85", "85", 0.0),
        ("I don't know", None, 0.0),
    ],
)
def test_step_plain_text_is_final_answer(toy, text, answer, reward):
    state, obs, r, done, info = toy.step(fresh(toy), action(text=text))
    assert (obs, r, done, state.answer, info["answer"], info["format_ok"]) == (
        [],
        reward,
        True,
        answer,
        answer,
        False,
    )


# -----------------------------------------------------------------------------
# The python_eval sandbox


@pytest.mark.parametrize(
    "code, expected",
    [
        ("2 + 3 * 4", "14"),
        ("12 * 7", "84"),
        ("math.sqrt(16)", "4.0"),
        ("math.factorial(5) // 3", "40"),
        ("sum(range(101))", "5050"),
        ("x = 6\nx * 7", "42"),
        ("print(1)\nprint(2)", "1\n2"),
        ("print('a'); 3", "a\n3"),
        ("x = 1", "(no output)"),
        ("def f(n):\n    return n * n\nf(9)", "81"),
        ("sorted([3, 1, 2])", "[1, 2, 3]"),
        ("round(2 / 3, 3)", "0.667"),
        ("divmod(17, 5)", "(3, 2)"),
        ("None", "(no output)"),
    ],
)
def test_python_eval_allowed(code, expected):
    assert SANDBOX.run(code) == (expected, None)


@pytest.mark.parametrize(
    "code, reason",
    [
        ("import os", "import"),
        ("from os import path", "import"),
        ("__import__('os')", "__import__"),
        ("().__class__", "__class__"),
        ("().__class__.__base__.__subclasses__()", "attribute"),
        ("open('x')", "calling open"),
        ("exec('1')", "calling exec"),
        ("eval('1')", "calling eval"),
        ("getattr(1, 'real')", "calling getattr"),
        ("'{0.__class__}'.format(1)", "attribute"),
        ("f'{(1).__class__}'", "attribute"),
        ("[].append(1)", "attribute"),
        ("__builtins__", "__builtins"),
        ("math.__loader__", "attribute"),
        ("(lambda: 1)()", "calling this expression"),
        ("1 +", "SyntaxError"),
    ],
)
def test_python_eval_refused(code, reason):
    assert check_code(code) is not None and reason in check_code(code)
    text, kind = SANDBOX.run(code)
    assert kind == "refused" and text.startswith("Error:") and reason in text


def test_model_written_code_never_prints_a_syntax_warning():
    """'3x' or '1if 1 else 2' make Python's parser warn ('invalid decimal literal'); that is the
    model's business, kept in the sandbox, not a line in the run's output (it leaked into the main
    command's progress bar)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert SANDBOX.run("x = 1if 1 else 2\nx") == ("1", None)
        assert SANDBOX.run("3x + 1")[1] == "refused" and check_code("0x1for x in [1]") is None
        sandbox.parse_python("y = 2if 1 else 3")
    assert not [w for w in seen if issubclass(w.category, SyntaxWarning)], [
        str(w.message) for w in seen
    ]


def test_python_eval_errors_are_text():
    assert SANDBOX.run("1 // 0") == (
        "Error: ZeroDivisionError: integer division or modulo by zero",
        "error",
    )
    assert SANDBOX.run("undefined_name") == (
        "Error: NameError: name 'undefined_name' is not defined",
        "error",
    )
    # RLIMIT_AS, not the machine's RAM
    assert SANDBOX.run("[0] * 10**10") == ("Error: MemoryError", "error")
    text, kind = SANDBOX.run("def f(n):\n    return f(n + 1)\nf(0)")
    assert kind == "error" and text.startswith("Error: RecursionError")


def test_python_eval_truncates_huge_output():
    text, kind = SANDBOX.run("print('x' * 100000)")
    assert (
        kind is None
        and text.startswith("x" * 500)
        and text.endswith("... [truncated, 100000 chars in all]")
    )
    assert len(text) < 600


def test_python_eval_timeout_then_recovers():
    start = time.monotonic()
    assert SANDBOX.run("while True: pass") == ("Error: timed out after 2 s", "timeout")
    assert time.monotonic() - start < 3.0
    assert SANDBOX.run("2 ** 10") == ("1024", None)  # a fresh worker answers the next call


def test_python_eval_timeout_counts_in_step(toy):
    slow = ToyMathEnv(tool_timeout=0.3)
    state, obs, reward, done, info = slow.step(
        fresh(slow), action(("python_eval", {"code": "while 1: pass"}))
    )
    assert obs[0]["content"] == "Error: timed out after 0.3 s"
    assert (info["tool_timeouts"], info["tool_errors"], state.tool_timeouts, done) == (
        1,
        1,
        1,
        False,
    )


def test_worker_checks_again_and_has_no_dangerous_builtins():
    # Talk to the worker directly, bypassing the parent's check: it must refuse by itself.
    src = sandbox.WORKER_SRC + "\n_worker_main(1 << 30, 500)\n"
    requests = [
        {"code": "import os", "cpu_seconds": 1},
        {"code": "().__class__", "cpu_seconds": 1},
        {"code": "sum([1, 2])", "cpu_seconds": 1},
    ]
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", src],
        capture_output=True,
        text=True,
        timeout=20,
        input="".join(json.dumps(r) + "\n" for r in requests),
    )
    replies = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["kind"] for r in replies] == ["refused", "refused", None] and replies[2][
        "text"
    ] == "3"


def test_worker_cpu_limit_is_a_backstop():
    # With nobody enforcing a wall-clock timeout, RLIMIT_CPU kills a spinning worker (SIGXCPU) by
    # itself.
    src = sandbox.WORKER_SRC + "\n_worker_main(1 << 30, 500)\n"
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", src],
        capture_output=True,
        text=True,
        timeout=20,
        input=json.dumps({"code": "while True: pass", "cpu_seconds": 0}) + "\n",
    )
    # 1 s of CPU; slack for a busy machine
    assert out.returncode != 0 and out.stdout == "" and time.monotonic() - start < 15


def test_sandbox_is_thread_safe():
    results = {}

    def work(k):
        results[k] = [SANDBOX.run(f"{k} * {i}")[0] for i in range(20)]

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {k: [str(k * i) for i in range(20)] for k in range(4)}


def test_sandbox_close_and_restart():
    box = PythonSandbox(timeout=1.0, max_chars=10)
    assert box.run("'abcdefghijklmnop'") == ("'abcdefghi... [truncated, 18 chars in all]", None)
    box.close()
    assert box.run("1 + 1") == ("2", None)
    box.close()


# -----------------------------------------------------------------------------
# calculator and scratchpad


@pytest.mark.parametrize(
    "expression, value",
    [
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("0.1 + 0.2", Fraction(3, 10)),
        ("7 / 2", Fraction(7, 2)),
        ("-7 // 2", -4),
        ("-7 % 3", 2),
        ("2 ** 10", 1024),
        ("2 ^ 10", 1024),
        ("2 ** -2", Fraction(1, 4)),
        ("-(3 - 5)", 2),
        ("+4", 4),
        ("(1/3) * 3", 1),
        ("1e3 / 8", 125),
        ("(-1) ** (10 ** 100 + 1)", -1),
        ("0 ** 0", 1),
        ("2 ** 4095", 2**4095),
        (" 6*7 ", 42),
    ],
)
def test_calculate_is_exact(expression, value):
    # values written by hand (0.1 + 0.2 is exactly 3/10, unlike floats)
    assert calculate(expression) == value


@pytest.mark.parametrize(
    "expression, problem",
    [
        ("2 ** 4096", "larger than"),
        ("9 ** 9 ** 9", "larger than"),
        ("10 ** 1000 * 10 ** 1000", "larger than"),
        ("2 ** 0.5", "integer exponents"),
        ("abs(-1)", "only numbers"),
        ("x + 1", "only numbers"),
        ("__import__('os')", "only numbers"),
        ("1 +", "not an arithmetic"),
        ("'a' * 3", "only numbers"),
        ("1e999", "larger than"),
        ("(" * 240 + "1" + ")" * 240, "not an arithmetic"),
        ("-" * 300 + "1", "nested too deeply"),
        ("1" * 600, "longer than"),
        ("[1, 2]", "only numbers"),
        ("1 < 2", "only numbers"),
        ("True + 1", "only numbers"),
    ],
)
def test_calculate_refuses(expression, problem):
    # CPU time of this thread: another process on the cores cannot fail it
    start = time.thread_time()
    with pytest.raises(ValueError, match=problem):
        calculate(expression)
    assert time.thread_time() - start < 0.5  # bounds are checked before the work, never after


def test_format_exact():
    assert [format_exact(Fraction(x)) for x in ("84", "-3", "7/2", "-1/8", "1/3", "-2/3")] == [
        "84",
        "-3",
        "7/2 = 3.5",
        "-1/8 = -0.125",
        "1/3 ≈ 0.333333333333",
        "-2/3 ≈ -0.666666666667",
    ]


class ToolsEnv(ToyMathEnv):
    tool_names = ("calculator", "scratchpad", "finish", "broken")


def call(env_, state, name, **arguments):
    return env_.step(state, action((name, arguments)))


def test_calculator_tool(toy):
    tools_env = ToolsEnv()
    state, obs, reward, done, info = call(
        tools_env, fresh(tools_env), "calculator", expression="12 * 7"
    )
    assert (
        obs == [{"role": "tool", "name": "calculator", "content": "84"}]
        and info["tool_errors"] == 0
    )
    for expression, text in [
        ("1 / 0", "Error: division by zero"),
        ("9 ** 9 ** 9", "Error: a value is larger than"),
    ]:
        state, obs, reward, done, info = call(tools_env, state, "calculator", expression=expression)
        assert obs[0]["content"].startswith(text) and info["tool_errors"] == 1 and not done
    assert state.tool_calls == 3 and state.tool_errors == 2


def test_scratchpad_notes_live_in_the_state():
    tools_env = ToolsEnv()
    start = fresh(tools_env)
    state, obs, *_ = call(tools_env, start, "scratchpad", action="read")
    assert obs[0]["content"] == "(no notes)"
    state, obs, *_ = call(tools_env, state, "scratchpad", action="write", text="12 * 7 = 84")
    assert obs[0]["content"] == "Saved note 1." and state.notes == ("12 * 7 = 84",)
    after_one = state
    state, obs, *_ = call(tools_env, state, "scratchpad", action="write", text="check: 84 / 7 = 12")
    state, obs, *_ = call(tools_env, state, "scratchpad", action="read")
    assert obs[0]["content"] == "1. 12 * 7 = 84\n2. check: 84 / 7 = 12"
    # frozen state: the earlier states are untouched, so episodes (and replays of one) never share
    # notes
    assert start.notes == () and after_one.notes == ("12 * 7 = 84",)
    state2, obs, *_ = call(tools_env, after_one, "scratchpad", action="read")
    assert obs[0]["content"] == "1. 12 * 7 = 84"
    for arguments, problem in [
        ({"action": "erase"}, "unknown action"),
        ({"action": "write"}, "nothing to write"),
        ({"action": "write", "text": "x" * 501}, "at most 500"),
        ({}, "missing"),
    ]:
        s, obs, reward, done, info = tools_env.step(state, action(("scratchpad", arguments)))
        assert problem in obs[0]["content"] and info["tool_errors"] == 1 and s.notes == state.notes
    for i in range(tools.MAX_NOTES - 2):
        state, *_ = call(tools_env, state, "scratchpad", action="write", text=f"note {i}")
    state, obs, reward, done, info = call(
        tools_env, state, "scratchpad", action="write", text="one too many"
    )
    assert (
        "full" in obs[0]["content"]
        and len(state.notes) == tools.MAX_NOTES
        and info["tool_errors"] == 1
    )


# -----------------------------------------------------------------------------
# A broken tool never breaks the loop


@pytest.fixture
def broken_tool():
    """Register the test tool "broken": {"how": "raise" | "hang" | "huge" | "shape" | "ok"}."""
    release = threading.Event()

    def broken(env_, state, how):
        if how == "raise":
            raise KeyError("the tool has a bug")
        if how == "hang":
            release.wait(30)  # a hang we can end, so the abandoned thread does not outlive the test
        if how == "huge":
            return state, "x" * 5_000_000, None
        if how == "shape":
            return "just text"
        return state, "fine", None

    tools.tool(
        "broken",
        "A tool with bugs (tests only).",
        {"type": "object", "properties": {"how": {"type": "string"}}, "required": ["how"]},
    )(broken)
    try:
        yield
    finally:
        release.set()
        del TOOLS["broken"]


@pytest.mark.parametrize(
    "how, text, errors, timeouts",
    [
        ("raise", "Error: KeyError: 'the tool has a bug'", 1, 0),
        ("hang", "Error: broken did not answer within 0.3 s", 1, 1),
        ("shape", "Error: broken returned a str, not (state, text, kind)", 1, 0),
        ("ok", "fine", 0, 0),
    ],
)
def test_broken_tool_becomes_an_observation(broken_tool, how, text, errors, timeouts):
    tools_env = ToolsEnv(tool_timeout=0.3)
    start = time.monotonic()
    state, obs, reward, done, info = call(tools_env, fresh(tools_env), "broken", how=how)
    assert obs == [{"role": "tool", "name": "broken", "content": text}] and not done
    assert (info["tool_errors"], info["tool_timeouts"], state.tool_errors, state.tool_timeouts) == (
        errors,
        timeouts,
        errors,
        timeouts,
    )
    assert time.monotonic() - start < 2.0


def test_broken_tool_huge_output_is_cut(broken_tool):
    state, obs, reward, done, info = call(ToolsEnv(), fresh(ToolsEnv()), "broken", how="huge")
    content = obs[0]["content"]
    assert content == "x" * env.MAX_OBSERVATION_CHARS + "... [truncated, 5000000 chars in all]"
    # too much output is not an error: python_eval cuts its own the same way
    assert info["tool_errors"] == 0


def test_broken_tool_then_the_episode_goes_on(broken_tool):
    tools_env = ToolsEnv(tool_timeout=0.3)
    calls = [
        ("broken", {"how": "raise"}),
        ("broken", {"how": "hang"}),
        ("calculator", {"expression": "12*7"}),
        ("finish", {"answer": "84"}),
    ]
    state, obs, reward, done, info = tools_env.step(fresh(tools_env), action(*calls))
    assert [o["content"] for o in obs][2] == "84" and (reward, done) == (1.0, True)
    assert (state.tool_calls, state.tool_errors, state.tool_timeouts) == (3, 2, 1)


# -----------------------------------------------------------------------------
# Tools, demonstrations, registry


def test_tool_schemas(toy):
    schemas = toy.tools()
    assert [s["function"]["name"] for s in schemas] == ["python_eval", "finish"]
    assert set(TOOLS) >= {"python_eval", "finish"}
    for s in schemas:
        # rendered into every prompt
        assert s["type"] == "function" and len(s["function"]["description"]) <= 60
        assert s["function"]["parameters"]["type"] == "object"
        json.dumps(s)
    assert schemas[0]["function"]["parameters"]["required"] == ["code"]
    assert schemas[1]["function"]["parameters"]["required"] == ["answer"]
    for name, required in [("calculator", ["expression"]), ("scratchpad", ["action"])]:
        s = TOOLS[name].schema()
        assert (
            s["function"]["parameters"]["required"] == required
            and len(s["function"]["description"]) <= 60
        )
        json.dumps(s)


@pytest.mark.parametrize("use_tools", [True, False])
def test_demonstrations_replay_to_reward_one(toy, use_tools):
    rng = random.Random(0)
    for task in toy.sample_tasks("train", 30, seed=5):
        demo = toy.demonstration(task, rng, use_tools)
        state, messages = toy.reset(task, seed=0)
        assert demo[:2] == messages
        roles = [m["role"] for m in demo[2:]]
        assert roles == (["assistant", "tool", "assistant"] if use_tools else ["assistant"])
        if use_tools:
            assert demo[2]["tool_calls"][0]["function"] == {
                "name": "python_eval",
                "arguments": {"code": task.meta["expression"]},
            }
        assert demo[-1]["tool_calls"][0]["function"] == {
            "name": "finish",
            "arguments": {"answer": task.answer},
        }
        # Feed the assistant messages back as Actions; the env's observations must be the demo's
        # tool messages.
        expected_obs = [m for m in demo[2:] if m["role"] == "tool"]
        seen_obs = []
        for m in demo[2:]:
            if m["role"] == "assistant":
                calls = [
                    (c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]
                ]
                state, obs, reward, done, info = toy.step(state, action(*calls, text=m["content"]))
                seen_obs += obs
        assert seen_obs == expected_obs
        assert (reward, done, info["format_ok"], state.reward) == (1.0, True, True, 1.0)


def test_make_env_and_registry():
    assert ENVS["toy_math"] is ToyMathEnv and ToyMathEnv.name == "toy_math"
    assert isinstance(make_env("toy_math", max_operand=10), ToyMathEnv)
    with pytest.raises(ValueError, match="toy_math"):
        make_env("webshop")
    with pytest.raises(TypeError):
        make_env("toy_math", no_such_option=1)


def test_last_boxed_and_extract_answer_read_nested_braces():
    assert last_boxed("\\boxed{a{b{c}}d} and \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\fbox{7}") == "7"
    # the last one is never closed
    assert last_boxed("\\boxed{3} then \\boxed{\\frac{1}{2}") is None
    assert last_boxed("no box here") is None
    # one reader for every env
    assert extract_answer("so \\boxed{\\frac{1}{2}} it is") == "\\frac{1}{2}"
    assert extract_answer("\\boxed{12} or 13") == "12" and extract_answer("12 or 13") == "13"
