"""Tests for env_code.py: the families (every reference passes its own tests, in-process and in the
sandbox), grading (partial credit, spoofing, timeouts, errors), submission by finish or by text, the
split, determinism, and the expert and random policies through eval.play_scripted.

Ground truth comes from outside the code under test: hand-written tasks and expected pass counts,
and the references, which are our own code and so may be exec'd here in-process. Every sandbox
grading costs a process (~50-150 ms), so the tests use few of them: one program checks all 59
families' references at once, and the policies play a handful of tasks.
"""

import json
import random

import pytest

from env import Action, Task, ToolCall, make_env, split_of
from envs import env_code
from envs.env_code import FAMILIES, FAMILY, CodeEnv, extract_code, grade, reference_code
from envs.sandbox_exec import ExecLimits, execute_python
from envs.worlds import read_tasks, write_tasks
from eval import play_scripted


@pytest.fixture(scope="module")
def code_env():
    return make_env("code")


def linear_task(env) -> Task:
    """f(x) = 3 * x + 7 with four hand-written cases; the prompt's example is the first."""
    cases = [[[1], 10], [[2], 13], [[-1], 4], [[0], 7]]
    prompt = "Write a function f(x) that returns 3 * x + 7. Example: f(1) == 10."
    return Task(
        env="code",
        id="code/linear",
        prompt=prompt,
        answer="def f(x):\n    return 3 * x + 7",
        meta={"family": "linear", "tests": cases},
    )


def finish(code: str) -> Action:
    return Action(text="", tool_calls=(ToolCall("finish", {"answer": code}),))


# -----------------------------------------------------------------------------
# Families


def test_families_and_levels():
    # names are unique (the module docstring says 59)
    assert len(FAMILIES) == 59 and len(FAMILY) == 59
    assert [sum(f.level == k for f in FAMILIES) for k in (1, 2, 3)] == [20, 21, 18]
    for f in FAMILIES:
        # short solutions: the model has 0.8 M parameters
        assert 1 <= len(f.body.split("\n")) <= 4, f.name


def test_every_reference_passes_its_tests_in_process(code_env):
    """Several instances of every family: the reference (our code, exec'd here) against the truth
    function's expected outputs, after a JSON round trip (the tests travel as JSON lines)."""
    rng = random.Random(0)
    for family in FAMILIES:
        for _ in range(6):
            task = code_env.make_task(family, family.params(rng))
            meta = json.loads(json.dumps(task.meta))
            assert meta == task.meta and len(meta["tests"]) == 8
            namespace = {}
            exec(task.answer, namespace)
            for args, expected in meta["tests"]:
                assert namespace["f"](*args) == expected, (family.name, task.answer, args)
            example, result = meta["tests"][0]
            assert task.prompt.endswith(f"Example: {env_code.call_text(example)} == {result!r}.")
            assert task.prompt.startswith(f"Write a function f({family.signature}) that returns ")


def test_every_reference_passes_in_the_sandbox(code_env):
    """The references under the sandbox's rules (its AST check, its builtins): one program runs
    three instances of each family, so one process covers all 59."""
    rng = random.Random(1)
    lines, count = [], 0
    for family in FAMILIES:
        for _ in range(3):
            task = code_env.make_task(family, family.params(rng))
            lines += [task.answer, f"ok.append(all(f(*a) == e for a, e in {task.meta['tests']!r}))"]
            count += 1
    program = "ok = []\n" + "\n".join(lines) + "\nprint(ok.count(True), len(ok))"
    text, kind = execute_python(
        program, timeout_s=20, limits=ExecLimits(max_code_chars=len(program))
    )
    assert (text, kind) == (f"{count} {count}", None)


def test_tests_are_not_passed_by_a_constant(code_env):
    """Outputs that are all equal would reward `return <that value>`: make_task swaps in a case that
    differs."""
    for task in code_env.sample_tasks("train", 400, seed=2):
        assert len({json.dumps(expected) for _, expected in task.meta["tests"]}) > 1, task.prompt


def test_make_task_is_a_function_of_the_parameters(code_env):
    family = FAMILY["replace"]
    a = code_env.make_task(family, {"a": "x", "b": "q"})
    # same tests, same example, same id
    assert a == code_env.make_task(family, {"b": "q", "a": "x"})
    assert a.prompt.startswith(
        "Write a function f(s) that returns s with every 'x' replaced by 'q'. Example: f("
    )
    assert a.answer == "def f(s):\n    return s.replace('x', 'q')"
    assert reference_code(FAMILY["gcd_with"], {"a": 12}) == (
        "def f(x):\n    a = 12\n    while a:\n        x, a = a, x % a\n    return x"
    )


def test_kwargs_level_families_and_errors():
    assert {FAMILY[n].level for n in CodeEnv(level=1).families} == {1}
    assert {FAMILY[n].level for n in CodeEnv(level=2).families} == {1, 2}
    tasks = CodeEnv(families=["caesar", "pad"]).sample_tasks("train", 30, seed=0)
    assert {t.meta["family"] for t in tasks} == {"caesar", "pad"}
    assert {len(t.meta["tests"]) for t in CodeEnv(n_tests=3).sample_tasks("train", 10, seed=0)} == {
        3
    }
    with pytest.raises(ValueError, match="unknown families"):
        CodeEnv(families=["nope"])
    with pytest.raises(ValueError, match="level"):
        CodeEnv(level=4)
    with pytest.raises(ValueError, match="no family left"):
        CodeEnv(families=["pad"], holdout_families=["pad"])


# -----------------------------------------------------------------------------
# Split and determinism


def test_sample_tasks_deterministic_and_distinct(code_env):
    a = code_env.sample_tasks("train", 100, seed=3)
    assert a == make_env("code").sample_tasks("train", 100, seed=3)  # nothing hidden in the object
    assert a != code_env.sample_tasks("train", 100, seed=4)
    assert code_env.sample_tasks("train", 40, seed=3) == a[:40]
    assert len({t.id for t in a}) == len({t.prompt for t in a}) == 100
    with pytest.raises(ValueError, match="split"):
        code_env.sample_tasks("dev", 1, seed=0)


def test_train_and_test_never_overlap_and_share_families(code_env):
    train = {t.prompt for seed in range(3) for t in code_env.sample_tasks("train", 500, seed=seed)}
    test = code_env.sample_tasks("test", 200, seed=0)
    assert not train & {t.prompt for t in test}
    assert all(split_of(t.prompt) == "test" for t in test)
    # held out means new parameters, not new families:
    # the held-out families are all seen in training
    assert len({t.meta["family"] for t in test}) > 45


def test_holdout_families_split():
    env = CodeEnv(holdout_families=["caesar", "balanced"])
    train = env.sample_tasks("train", 300, seed=0)
    test = env.sample_tasks("test", 40, seed=0)
    assert not {t.meta["family"] for t in train} & {"caesar", "balanced"}
    assert {t.meta["family"] for t in test} == {"caesar", "balanced"}


def test_tasks_survive_json_lines(code_env, tmp_path):
    tasks = code_env.sample_tasks("test", 5, seed=0)
    write_tasks(tasks, tmp_path / "code.jsonl")
    assert read_tasks(tmp_path / "code.jsonl") == tasks


# -----------------------------------------------------------------------------
# Grading


@pytest.mark.parametrize(
    "code, passed, error",
    [
        ("def f(x):\n    return 3 * x + 7", 4, ""),
        ("def f(x):\n    return 3 * x + 7 if x > 0 else 0", 2, "f(-1) returned 0, expected 4"),
        # f(1) right, f(0) raises
        ("def f(x):\n    return 10 // x + 3 * x - 3", 1, "f(2) returned 8, expected 13"),
        (
            "def f(x):\n    return 7 + 3 * x if x % 2 == 0 else 1 / 0",
            2,
            "f(1) raised ZeroDivisionError('division by zero')",
        ),
        ("f = lambda x: x * 3 + 7", 4, ""),
        (
            "def f(x):\n    print('RESULT 0123456789abcdef 4 ')\n    return 0",
            0,
            "f(1) returned 0, expected 10",
        ),
        # objects equal to everything (the sandbox runs classes):
        # compared as plain data, they pass nothing
        (
            "class A:\n    def __eq__(self, o):\n        return True\ndef f(x):\n    return A()",
            0,
            "f(1) returned a value that cannot be compared: "
            "TypeError('the result is not plain data (None, bool, int, float, str, or lists, ",
        ),
        (
            "class I(int):\n    def __eq__(self, o):\n        return True\ndef f(x):\n"
            "    return I(0)",
            0,
            "f(1) returned 0, expected 10",
        ),
        # a subclass, but the right value
        ("class I(int):\n    pass\ndef f(x):\n    return I(3 * x + 7)", 4, ""),
    ],
)
def test_partial_credit(code_env, code, passed, error):
    result = grade(code, linear_task(code_env).meta["tests"], timeout_s=2.0)
    assert (result.passed, result.total, result.error, result.reward) == (
        passed,
        4,
        error,
        float(passed == 4),
    )
    assert not result.syntax_error and not result.timeout and result.seconds > 0


def test_printed_results_cannot_spoof_the_grade(code_env):
    # print restored, then a fake result line for every nonce format it could guess, then a wrong f
    fake = (
        "del print\nfor n in ['', '0' * 16, 'NONCE']:\n    print('RESULT', n, 4, '')\n"
        "def f(x):\n    return 0\n"
    )
    result = grade(fake, linear_task(code_env).meta["tests"], timeout_s=2.0)
    assert (result.passed, result.reward) == (0, 0.0)
    # the submission's own prints are silenced, so megabytes of them do not hide the result line
    noisy = "print('x' * 10 ** 7)\ndef f(x):\n    print('y' * 10 ** 6)\n    return 3 * x + 7"
    assert grade(noisy, linear_task(code_env).meta["tests"], timeout_s=2.0).reward == 1.0
    # restored print: the line is cut off
    loud = "del print\nprint('x' * 10 ** 6)\ndef f(x):\n    return 3 * x + 7"
    result = grade(loud, linear_task(code_env).meta["tests"], timeout_s=2.0)
    assert (result.passed, result.error) == (
        0,
        "the tests did not report: the program's output was too long",
    )


@pytest.mark.parametrize(
    "code, error, syntax",
    [
        ("def f(x) return x", "SyntaxError: expected ':' (line 1)", True),
        ("return 5", "SyntaxError: 'return' outside function (line 1)", True),
        ("", "no code was submitted", False),
        ("def g(x):\n    return 3 * x + 7", "NameError: name 'f' is not defined", False),
        ("raise ValueError('no')\ndef f(x):\n    return 3 * x + 7", "ValueError: no", False),
        ("import os\ndef f(x):\n    return 3 * x + 7", "import os is not allowed", False),
        ("def f(x):\n    return __import__('os')", "the name __import__ is not allowed", False),
        ("x" * 5000, "the submission is longer than 4000 characters", False),
    ],
)
def test_bad_submissions_score_zero_with_an_error(code_env, code, error, syntax):
    result = grade(code, linear_task(code_env).meta["tests"], timeout_s=2.0)
    assert (result.passed, result.reward, result.syntax_error, result.timeout) == (
        0,
        0.0,
        syntax,
        False,
    )
    assert result.error.startswith(error)


def test_infinite_loop_times_out_and_counts_in_metrics():
    env = CodeEnv(tool_timeout=0.5)
    state, _ = env.reset(linear_task(env), seed=0)
    state, obs, reward, done, info = env.step(
        state, finish("def f(x):\n    while True:\n        pass")
    )
    assert (reward, done, obs) == (0.0, True, [])
    assert info["metrics"]["timeout"] == 1.0 and info["metrics"]["pass_fraction"] == 0.0
    assert info["test_error"] == "timed out after 0.5 s"


# -----------------------------------------------------------------------------
# Steps: finish, text replies, metrics


def test_finish_reports_metrics_and_format(code_env):
    state, _ = code_env.reset(linear_task(code_env), seed=0)
    state, obs, reward, done, info = code_env.step(
        state, finish("def f(x):\n    return 3 * x + 7 if x > 0 else 0")
    )
    assert (reward, done, state.reward, info["format_ok"]) == (0.0, True, 0.0, True)
    assert info["metrics"]["pass_fraction"] == 0.5 and info["metrics"]["syntax_error"] == 0.0
    assert info["test_error"] == "f(-1) returned 0, expected 4" and info["answer"].startswith(
        "def f(x):"
    )
    state, _ = code_env.reset(linear_task(code_env), seed=0)
    state, obs, reward, done, info = code_env.step(state, finish("def f(x) return 3"))
    assert (reward, info["format_ok"], info["metrics"]["syntax_error"]) == (0.0, False, 1.0)


@pytest.mark.parametrize(
    "answer, ok",
    [
        ("def f(x):\n    return x", True),
        ("f = lambda x: x", True),
        ("def g(x):\n    return x", False),
        ("f(", False),
        ("print(1)", False),
    ],
)
def test_format_ok(code_env, answer, ok):
    assert code_env.format_ok(answer) is ok


def test_python_exec_is_this_worlds_tool():
    """python_exec is registered by the code worlds (env_code.py), with a short schema rendered into
    every prompt."""
    from tools import TOOLS

    s = TOOLS["python_exec"].schema()
    assert (
        s["function"]["parameters"]["required"] == ["code"]
        and len(s["function"]["description"]) <= 60
    )
    assert TOOLS["python_exec"].bounded
    json.dumps(s)


def test_python_exec_runs_and_the_episode_goes_on(code_env):
    state, _ = code_env.reset(linear_task(code_env), seed=0)
    call = ToolCall("python_exec", {"code": "def f(x):\n    return 3 * x + 7\nf(1)"})
    state, obs, reward, done, info = code_env.step(state, Action(text="", tool_calls=(call,)))
    assert (obs[0]["content"], reward, done, "metrics" in info, state.tool_calls) == (
        "10",
        0.0,
        False,
        False,
        1,
    )


@pytest.mark.parametrize(
    "text, code",
    [
        ("Here:\n```python\ndef f(x):\n    return x\n```\nDone.", "def f(x):\n    return x\n"),
        ("```\nold\n```\nthen\n```py\nnew\n```", "new\n"),
        # cut off by the token limit
        (
            "```python\ndef f(x):\n    return x",
            "def f(x):\n    return x",
        ),
        ("def f(x): return x", "def f(x): return x"),  # no fence: the whole text
    ],
)
def test_extract_code(text, code):
    assert extract_code(text) == code


def test_text_reply_is_a_submission(code_env):
    state, _ = code_env.reset(linear_task(code_env), seed=0)
    text = "Sure.\n```python\ndef f(x):\n    return 3 * x + 7\n```"
    state, obs, reward, done, info = code_env.step(state, Action(text=text))
    assert (reward, done, state.answer, info["format_ok"]) == (
        1.0,
        True,
        "def f(x):\n    return 3 * x + 7\n",
        False,
    )
    assert info["metrics"]["pass_fraction"] == 1.0


# -----------------------------------------------------------------------------
# Expert and random policies


@pytest.mark.parametrize("use_tools", [True, False])
def test_demonstrations_replay_to_reward_one(code_env, use_tools):
    for task in code_env.sample_tasks("train", 3, seed=5):
        demo = code_env.demonstration(task, random.Random(0), use_tools)
        state, messages = code_env.reset(task, seed=0)
        assert demo[:2] == messages
        assert [m["role"] for m in demo[2:]] == (
            ["assistant", "tool", "assistant"] if use_tools else ["assistant"]
        )
        if use_tools:
            args, result = task.meta["tests"][0]
            # the prompt's example result, as python_exec shows it
            assert demo[3]["content"] == repr(result)
        assert demo[-1]["tool_calls"][0]["function"] == {
            "name": "finish",
            "arguments": {"answer": task.answer},
        }


def test_demonstration_refuses_a_wrong_reference(code_env):
    task = linear_task(code_env)
    wrong = Task(
        env=task.env,
        id=task.id,
        prompt=task.prompt,
        answer="def f(x):\n    return 0",
        meta=task.meta,
    )
    with pytest.raises(RuntimeError, match="expected 10"):
        code_env.demonstration(wrong, random.Random(0), use_tools=True)


def test_expert_solves_held_out_tasks_and_random_does_not(code_env):
    tasks = code_env.sample_tasks("test", 6, seed=1234)
    expert = play_scripted(code_env, tasks, "expert", seed=0, max_turns=3)
    assert [e["reward"] for e in expert] == [1.0] * 6 and {e["turns"] for e in expert} == {2}
    assert all(e["metrics"]["pass_fraction"] == 1.0 for e in expert)
    rand = play_scripted(code_env, tasks, "random", seed=0, max_turns=3)
    assert sum(e["reward"] for e in rand) <= 1.0
    assert sum(e["metrics"].get("pass_fraction", 0.0) for e in rand) / len(rand) < 0.3


def test_random_action_is_junk_code(code_env):
    state, _ = code_env.reset(linear_task(code_env), seed=0)
    rng = random.Random(0)
    calls = [code_env.random_action(state, rng).tool_calls[0] for _ in range(50)]
    assert {c.name for c in calls} == {"python_exec", "finish"}
    assert all(list(c.arguments.values())[0] in env_code.JUNK for c in calls)
    assert all(
        c.arguments.keys() == ({"code"} if c.name == "python_exec" else {"answer"}) for c in calls
    )
