"""env.py: environments for tool-using LLM agents: tasks, rewards, the Env base class, a registry.

An environment is a small state machine in the functional style of gym / purejaxrl:

    state, messages = env.reset(task, seed)                    # messages = [system, user]
    state, obs, reward, done, info = env.step(state, action)   # obs = tool messages to append

The agent loop (agent.py) owns the tokens: it renders messages with a chat template (and env.tools()
as the tool schemas), samples an assistant message, parses it into an `Action` (text + tool calls,
or a parse error) and calls `step`. The env never sees tokens and keeps nothing between calls:
everything an episode needs is in the frozen `EnvState`, replaced (never mutated) with
`dataclasses.replace`, so one Env object serves any number of episodes at once. The agent loop, not
the env, enforces max_turns.

Contents, top to bottom:
  1. Types that cross the file boundary: ToolCall, Action, Task, EnvState; `mix_seed` (what every
     random draw is seeded with) and the message builders `tool_message`, `assistant_message`.
     The tools live in tools.py: a name -> Tool registry filled by `@tool`, with OpenAI-style JSON
     schemas: python_eval, finish, calculator (exact arithmetic, no Python), scratchpad (notes in
     the EnvState); the sandbox behind python_eval is sandbox.py. A world adds its own: the code
     worlds' python_exec, in envs/.
  2. Answers: `parse_number` (normalized exact comparison), `last_boxed` and `extract_answer` (the
     answer in free text).
  3. `Env`, the base class (tool dispatch that survives broken tools, the generic step), `ENVS`,
     `@register_env`, `make_env` (and `env_class`: the class alone), `sample_distinct` (a split's
     distinct tasks) and `sample_mixture` (a run's mix of several envs' tasks). What only the
     worlds share (`replay` and `replay_commands`: an expert's actions played into a
     demonstration; `read_jsonl`: the JSON-lines files they read; tasks as a dataset on disk) lives
     in envs/worlds.py.
  4. `ToyMathEnv` ("toy_math", the "Toy Math Agent" seed): integer arithmetic and word problems
     with a hash-decided train/test split (`split_of`, which every env uses); the model should
     learn to call python_eval, then finish.

POSIX only (the sandbox uses process groups and resource limits).

Imports: sandbox.py, tools.py.
"""

import ast
import hashlib
import importlib
import random
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from fractions import Fraction

from sandbox import parse_python
from tools import TOOLS, validate_arguments


# -----------------------------------------------------------------------------
# 1. Types that cross the file boundary


@dataclass(frozen=True)
class ToolCall:
    """One tool call parsed from an assistant message."""

    name: str  # tool name, e.g. "python_eval"
    arguments: dict  # the JSON arguments object, e.g. {"code": "12 * 7"}


@dataclass(frozen=True)
class Action:
    """What the agent parsed from one assistant message."""

    text: str  # the message content as decoded (stop token removed)
    tool_calls: tuple[ToolCall, ...] = ()  # in the order they appear in the message
    parse_error: str | None = None  # None when well formed, else why parsing failed


@dataclass(frozen=True)
class Task:
    """One problem. Everything needed to score it travels with it (no lookups into the env)."""

    env: str  # name of the env that made it, e.g. "toy_math"
    id: str  # unique and stable across runs: "<env>/<hash of prompt>"
    prompt: str  # the user message
    answer: str  # ground truth, as text
    meta: dict = field(default_factory=dict)  # env-specific extras (toy_math: "expression", "kind")


@dataclass(frozen=True)
class EnvState:
    """The whole state of one episode; `step` returns a new one."""

    task: Task
    turn: int = 0  # assistant messages stepped so far
    done: bool = False
    reward: float = 0.0  # the final reward once done (0 before)
    answer: str | None = None  # the submitted answer (finish argument, or extracted from text)
    tool_calls: int = 0  # tool calls made, not counting the one that ended the episode (finish)
    # tool calls that failed: unknown tool, bad arguments, refused, raised, timeout
    tool_errors: int = 0
    tool_timeouts: int = 0  # tool calls that timed out (also counted in tool_errors)
    parse_failures: int = 0  # assistant messages the agent could not parse (entirely or in part)
    notes: tuple[str, ...] = ()  # what the scratchpad tool holds, oldest first


def mix_seed(*parts: int) -> int:
    """A reproducible seed in [0, 2**31 - 1) from integers: every random draw of a run is named by
    such a tuple, e.g. (run seed, step, purpose) or (episodes seed, group, sample), so a resumed
    run, or a chunk played by another worker, draws exactly what an uninterrupted single process
    would. A polynomial hash (Python's hash() is salted per process for strings, and not promised
    stable across versions); 31 bits suit every consumer (random.Random, torch.Generator, vLLM,
    numpy)."""
    h = 0x2545F4914F6CDD1D
    for x in parts:
        h = (h * 1_000_003 + int(x)) % (1 << 63)
    return h % (2**31 - 1)


def tool_message(name: str, content: str) -> dict:
    """An observation message, as the chat templates expect it."""
    return {"role": "tool", "name": name, "content": content}


def assistant_message(content: str, tool_calls: list[ToolCall] = ()) -> dict:
    """An assistant message in OpenAI style. The arguments stay a dict: the chat template
    serializes them."""
    message = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = [
            {"type": "function", "function": {"name": c.name, "arguments": dict(c.arguments)}}
            for c in tool_calls
        ]
    return message


# -----------------------------------------------------------------------------
# 2. Answers

# exponent capped: 1e999999999 would hang
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d{1,4})?")
# "1,234" is one number, "10-3" ends in 3
_NUMBER_IN_TEXT = re.compile(r"(?<![\d.])-?\d[\d,]*(?:\.\d+)?")
_BOXED_START = re.compile(r"\\(?:boxed|fbox)\s*\{")


def parse_number(text: str | None) -> Fraction | None:
    """The exact value of a numeric answer, or None. Strips spaces, commas, "$" and one trailing
    period first.

    '57', ' 57.0 ', '57.', '1,234', '$5', '-3', '1e3' parse; '57 apples', 'x', '' do not. Exact
    (Fraction), so "57" == "57.0" and no float rounding can make a wrong answer right.
    """
    if text is None:
        return None
    s = re.sub(r"[\s,$]", "", str(text))
    s = s[:-1] if s.endswith(".") else s
    return Fraction(s) if _NUMBER.fullmatch(s) else None


def answers_match(answer: str | None, truth: str) -> bool:
    """Normalized numeric comparison (see parse_number); False if either side is not a number."""
    a, t = parse_number(answer), parse_number(truth)
    return a is not None and a == t


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}) in `text`, nested braces balanced, or
    None (also when that last one is never closed): "\\boxed{\\frac{1}{2}}" -> "\\frac{1}{2}"."""
    starts = [m.end() for m in _BOXED_START.finditer(text)]
    if not starts:
        return None
    depth = 1
    for i in range(starts[-1], len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[starts[-1] : i].strip()
    return None


def extract_answer(text: str) -> str | None:
    """The final answer written in free text: the last \\boxed{...} if any (last_boxed), else the
    last number, else None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER_IN_TEXT.findall(text)
    return numbers[-1].rstrip(",") if numbers else None


# -----------------------------------------------------------------------------
# 3. The Env base class and the registry


class Env:
    """Base class. A subclass sets `tool_names` and implements system_prompt, sample_tasks, score
    and demonstration; it overrides `on_text` (and `format_ok`) when plain text is not a final
    answer (e.g. a reply to a simulated user). reset, step and run_tool are shared, so the agent
    loop never changes."""

    name: str = "base"  # set by @register_env
    tool_names: tuple[str, ...] = ()  # the TOOLS this env offers, in prompt order
    # seconds per tool call (python_eval, python_exec; the watchdog of the others)
    tool_timeout: float = 2.0
    # constructor kwargs that name files it reads (checked at start-up, before anything is built:
    # runs.check_paths)
    file_kwargs: tuple[str, ...] = ()

    def tools(self) -> list[dict]:
        return [TOOLS[n].schema() for n in self.tool_names]

    def system_prompt(self) -> str:
        raise NotImplementedError

    def sample_tasks(self, split: str, n: int, seed: int) -> list[Task]:
        raise NotImplementedError

    def demonstration(self, task: Task, rng: random.Random, use_tools: bool) -> list[dict]:
        raise NotImplementedError

    def score(self, task: Task, answer: str | None) -> float:
        """Reward of a final answer."""
        raise NotImplementedError

    def grade_answer(self, task: Task, answer: str | None) -> tuple[float, dict]:
        """(reward, extra info) of a final answer: what step() uses. Default: score() and nothing
        extra. An env that learns more than a number while scoring (code: the share of unit tests
        passed, the first failure) overrides this, so the answer is graded once; the dict is merged
        into step()'s info (put numbers under "metrics")."""
        return self.score(task, answer), {}

    def format_ok(self, answer: str) -> bool:
        """Whether an answer submitted through finish is well formed."""
        return bool(answer.strip())

    def random_action(self, state: EnvState, rng: random.Random) -> Action:
        """The floor baseline (eval.py --policy random): one uniformly random tool, its required
        arguments filled with words or numbers drawn from the prompt. Envs with a richer action
        space override it."""
        name = rng.choice(self.tool_names)
        words = re.findall(r"[A-Za-z0-9_.-]+", state.task.prompt) or ["0"]
        params = TOOLS[name].parameters
        arguments = {}
        for key in params.get("required", []):
            spec = params["properties"].get(key, {})
            if "enum" in spec:
                arguments[key] = rng.choice(spec["enum"])
            elif spec.get("type") in ("number", "integer"):
                arguments[key] = rng.randint(0, 100)
            else:
                arguments[key] = rng.choice(words)
        return Action(text="", tool_calls=(ToolCall(name, arguments),))

    def judge(self, task: Task, messages: list[dict]) -> float | None:
        """An optional extra reward for a finished episode (an LLM or rule-based judge), in [0, 1],
        or None when the env has no judge. Training only: run_episodes adds `judge_weight *
        judge(...)` when the training loop asks for it, and evaluate() never does, so a judge cannot
        inflate held-out metrics."""
        return None

    def state_line(self, state: EnvState) -> str | None:
        """A line (or a few) on where an episode stands, kept in a memory policy's compacted prompt
        (wings/memory.py); step() puts it in info["state_line"]. None (the default): the env offers
        none, and its info has no such key."""
        return None

    def reset(self, task: Task, seed: int) -> tuple[EnvState, list[dict]]:
        """A new episode -> (state, [system, user]). `seed` is for envs with randomness (toy_math
        has none)."""
        if task.env != self.name:
            raise ValueError(f"task {task.id!r} belongs to env {task.env!r}, not {self.name!r}")
        return EnvState(task=task), [
            {"role": "system", "content": self.system_prompt()},
            {"role": "user", "content": task.prompt},
        ]

    def step(
        self, state: EnvState, action: Action
    ) -> tuple[EnvState, list[dict], float, bool, dict]:
        """One assistant message -> (state, observation messages, reward, done, info).

        info: "format_ok" (answered through finish with a well-formed answer), "answer", and what
        this step added to the episode's counters, "tool_calls", "tool_errors", "tool_timeouts",
        "parse_failures": the state keeps the running counts (an env's reward may read them), a
        caller sums these (agent.py, eval.py). An env may add "metrics": {name: float} (e.g. code's
        pass fraction); eval.py averages the last one each episode reported as eval/<env>/<name>, so
        an env whose metrics mean something before the end (counters) should report them on every
        step.
        """
        if state.done:
            raise ValueError("step() called on a finished episode")
        start = replace(state, turn=state.turn + 1)
        if action.parse_error is not None:
            # Calls the parser could still read (repaired JSON, a missing </tool_call>) run; the
            # problem is reported after their results and counted, so the model still learns the
            # exact format.
            hint = "Call a tool with JSON arguments, or reply with the answer."
            state = replace(start, parse_failures=start.parse_failures + 1)
            state, obs, reward, done, info = self.run_tool_calls(state, action.tool_calls)
            if not done:
                obs = obs + [tool_message("error", f"Error: {action.parse_error}. {hint}")]
        elif not action.tool_calls:
            state, obs, reward, done, info = self.on_text(start, action.text)
        else:
            state, obs, reward, done, info = self.run_tool_calls(start, action.tool_calls)
        info = {
            "format_ok": False,
            "answer": state.answer if done else None,
            **info,
            "tool_calls": state.tool_calls - start.tool_calls,
            "tool_errors": state.tool_errors - start.tool_errors,
            "tool_timeouts": state.tool_timeouts - start.tool_timeouts,
            "parse_failures": state.parse_failures - start.parse_failures,
        }
        if line := self.state_line(state):
            info["state_line"] = line
        return state, obs, reward, done, info

    def on_text(self, state: EnvState, text: str) -> tuple[EnvState, list[dict], float, bool, dict]:
        """A message without tool calls. Default: it is the final answer, read as \\boxed{} or
        else the last number."""
        answer = extract_answer(text)
        reward, extra = self.grade_answer(state.task, answer)
        info = {"format_ok": False, **extra}
        return replace(state, done=True, answer=answer, reward=reward), [], reward, True, info

    def run_tool_calls(
        self, state: EnvState, calls
    ) -> tuple[EnvState, list[dict], float, bool, dict]:
        """Run calls in order, one observation each. A call that ends the episode (finish) stops
        the rest."""
        obs = []
        for call in calls:
            state, text, kind = self.run_tool(state, call)
            if state.done:
                reward, extra = self.grade_answer(state.task, state.answer)
                info = {"format_ok": self.format_ok(state.answer), **extra}
                return replace(state, reward=reward), obs, reward, True, info
            state = replace(
                state,
                tool_calls=state.tool_calls + 1,
                tool_errors=state.tool_errors + (kind is not None),
                tool_timeouts=state.tool_timeouts + (kind == "timeout"),
            )
            obs.append(tool_message(call.name, text))
        return state, obs, 0.0, False, {}

    def run_tool(self, state: EnvState, call: ToolCall) -> tuple[EnvState, str, str | None]:
        """Dispatch one call -> (state, observation text, error kind or None). Errors come back
        as text, never as exceptions.

        A bug in one tool must not kill a batch of rollouts: an exception, a hang (a tool that is
        not `bounded` runs in a watchdog thread; past tool_timeout it is abandoned, and keeps its
        thread until it returns), a result of the wrong shape all become "Error: ..." text; text
        longer than MAX_OBSERVATION_CHARS is cut with a visible marker.
        """
        if call.name not in self.tool_names:
            return (
                state,
                f"Error: unknown tool {call.name!r}. Tools: {', '.join(self.tool_names)}.",
                "unknown_tool",
            )
        spec = TOOLS[call.name]
        arguments, problem = validate_arguments(spec.parameters, call.arguments)
        if problem is not None:
            return state, f"Error: {problem}.", "bad_args"
        result, error = _call_with_deadline(
            lambda: spec.fn(self, state, **arguments), None if spec.bounded else self.tool_timeout
        )
        if isinstance(error, TimeoutError):
            return (
                state,
                f"Error: {call.name} did not answer within {self.tool_timeout:g} s",
                "timeout",
            )
        if error is not None:
            return state, _cut(f"Error: {type(error).__name__}: {_safe_str(error)}"), "error"
        if not (
            isinstance(result, tuple)
            and len(result) == 3
            and isinstance(result[0], EnvState)
            and isinstance(result[1], str)
            and (result[2] is None or isinstance(result[2], str))
        ):
            return (
                state,
                f"Error: {call.name} returned a {type(result).__name__}, not (state, text, kind)",
                "error",
            )
        new_state, text, kind = result
        return new_state, _cut(text), kind


# a tool's text is cut here, with a visible marker (python_eval cuts at 500 itself)
MAX_OBSERVATION_CHARS = 4000


def _cut(text: str) -> str:
    return (
        text
        if len(text) <= MAX_OBSERVATION_CHARS
        else (text[:MAX_OBSERVATION_CHARS] + f"... [truncated, {len(text)} chars in all]")
    )


def _safe_str(error: BaseException) -> str:
    try:
        return str(error)
    except Exception:  # an exception whose __str__ raises
        return "(no message)"


def _call_with_deadline(fn: Callable, timeout: float | None) -> tuple[object, Exception | None]:
    """fn() -> (its result, None), or (None, the exception it raised), or (None, TimeoutError())
    past `timeout`.

    timeout None: call it here. Otherwise in a daemon thread, which we stop waiting for at the
    deadline: Python cannot kill a thread, so a tool that truly hangs keeps its thread (tools that
    run untrusted code use a child process they can kill, and are `bounded`). The thread costs ~0.1
    ms per call.
    """
    if timeout is None:
        try:
            return fn(), None
        except Exception as e:
            return None, e
    box = {}

    def target():
        try:
            box["result"] = fn()
        except Exception as e:
            box["error"] = e

    thread = threading.Thread(target=target, name="tool-call", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return None, TimeoutError()
    return box.get("result"), box.get("error")


ENVS: dict[str, type[Env]] = {}  # filled at import by @register_env


def register_env(name: str):
    """Class decorator: register an Env subclass under `name` (and set its `name`)."""

    def register(cls):
        if name in ENVS:
            raise ValueError(f"env {name!r} is registered twice")
        cls.name = name
        ENVS[name] = cls
        return cls

    return register


def sample_distinct(
    draw: Callable,
    split: str,
    n: int,
    seed: int,
    hint: str = "",
    per_task: Callable[[random.Random], object] | None = None,
) -> list[Task]:
    """n tasks with distinct ids from `draw(rng)`, which returns a task of `split` or None (a draw
    of the other split). Deterministic from `seed`; raises ValueError (ending in `hint`, the knob to
    loosen) when the split runs out of distinct tasks. The rejection loop of every env's
    sample_tasks. With `per_task`, something is drawn once per task before its draws and passed on,
    draw(rng, it) (alfworld draws the task kind first, so both splits mix the kinds evenly whatever
    each kind's rejection rate)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', not {split!r}")
    rng = random.Random(seed)
    tasks = []
    seen = set()
    misses = 0
    first = per_task(rng) if per_task is not None else None
    while len(tasks) < n:
        task = draw(rng) if per_task is None else draw(rng, first)
        if task is None or task.id in seen:
            misses += 1
            if misses > 1000 + 100 * n:
                raise ValueError(f"found only {len(tasks)} distinct {split} tasks of {n}{hint}")
            continue
        seen.add(task.id)
        tasks.append(task)
        if per_task is not None and len(tasks) < n:
            first = per_task(rng)
    return tasks


def sample_mixture(
    envs: dict[str, "Env"], weights: list[tuple[str, float]], split: str, n: int, seed: int
) -> list[Task]:
    """n tasks of `split` from several envs, each env's share of n by its weight ((name, weight)
    pairs, in order; the largest remainders get the leftover tasks): a run's mix of training
    tasks."""
    total = sum(w for _, w in weights)
    quotas = [n * w / total for _, w in weights]
    counts = [int(q) for q in quotas]
    for i in sorted(range(len(weights)), key=lambda i: counts[i] - quotas[i])[: n - sum(counts)]:
        counts[i] += 1
    tasks = []
    for i, ((name, _), c) in enumerate(zip(weights, counts)):
        if c:
            tasks += envs[name].sample_tasks(split, c, seed + i)
    return tasks


# Envs that live in their own files beside this one, imported on first use (like gym's entry
# points): env.py needs none of them, and each of them imports env.py (env_humaneval also env_code,
# whose grading it shares).
ENTRY_POINTS: dict[str, str] = {
    "text_math": "envs.env_math",
    "dataset": "envs.env_math",
    "tool_use": "envs.env_search",
    "code": "envs.env_code",
    "webshop_lite": "envs.env_webshop",
    "alfworld_lite": "envs.env_alfworld",
    "tau_lite": "envs.env_tau",
    "humaneval": "envs.env_humaneval",
    "textworld": "envs.env_textworld",
    "bfcl": "envs.env_bfcl",
    "vault": "envs.env_vault",
}


def make_env(name: str, **kwargs) -> Env:
    """Build a registered env; unknown names raise ValueError listing the available ones."""
    return env_class(name)(**kwargs)


def env_class(name: str) -> type[Env]:
    """The class of a registered env, its file imported on first use; unknown names raise ValueError
    listing the available ones."""
    if name not in ENVS and name in ENTRY_POINTS:
        try:
            importlib.import_module(ENTRY_POINTS[name])  # registers the env by its @register_env
        except ModuleNotFoundError as e:
            path = ENTRY_POINTS[name].replace(".", "/") + ".py"
            raise ValueError(
                f"env {name!r} lives in {path}, which could not be imported: {e}"
            ) from e
    if name not in ENVS:
        raise ValueError(
            f"unknown env {name!r}; available: {', '.join(sorted(set(ENVS) | set(ENTRY_POINTS)))}"
        )
    return ENVS[name]


# -----------------------------------------------------------------------------
# 4. Toy math

# share of the problem space (by hash of the prompt) that is held out; fixed, so that a test problem
# is a test problem under every config and seed
TEST_PERCENT = 10

_NAMES = (
    ("Tom", "he"),
    ("Mia", "she"),
    ("Sam", "he"),
    ("Ana", "she"),
    ("Leo", "he"),
    ("Zoe", "she"),
)
_ITEMS = ("apples", "pens", "coins", "stickers", "books", "marbles", "cards", "cookies")
_CONTAINERS = ("boxes", "bags", "jars", "baskets")
_ARITH = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.FloorDiv: lambda a, b: a // b,
}


def eval_arith(expression: str) -> int:
    """The value of an integer expression with + - * // and parentheses: the ground truth,
    computed without eval()."""

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
            return _ARITH[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"not integer arithmetic: {expression!r}")

    return value(parse_python(expression, mode="eval").body)


def split_of(key: str, test_percent: int = TEST_PERCENT) -> str:
    """ "test" or "train", from a stable hash of `key` (a problem's text, an entity's name, a
    customer, ...): test_percent of all keys are "test", whatever the seed, so no seed can make the
    splits overlap. Every env splits through this; each chooses what its key is and its own
    share."""
    return (
        "test"
        if int(hashlib.sha256(key.encode()).hexdigest(), 16) % 100 < test_percent
        else "train"
    )


def _divisor(rng: random.Random, m: int) -> int:
    return rng.randint(2, max(2, min(12, m)))  # small exact divisors keep // answers exact integers


def _binary(rng: random.Random, m: int) -> tuple[str, str]:
    """'What is 37 * 12?' -> (prompt, canonical expression)."""
    op = rng.choice("+-*/")
    if op == "/":
        d = _divisor(rng, m)
        expression = f"{d * rng.randint(1, m)} // {d}"
    else:
        expression = f"{rng.randint(1, m)} {op} {rng.randint(1, m)}"
    return f"What is {expression}?", expression


def _multi(rng: random.Random, m: int) -> tuple[str, str]:
    """Three operands, two operations, parentheses: 'What is (14 + 27) * 3?'."""
    a = rng.randint(1, m)
    b = rng.randint(1, m)
    c = rng.randint(1, m)
    o1, o2 = rng.choice("+-*"), rng.choice("+-*")
    if rng.random() < 0.25:  # (a o1 b) // d, with d an exact divisor when one exists
        inner = eval_arith(f"{a} {o1} {b}")
        divisors = [d for d in range(2, 13) if inner > 0 and inner % d == 0]
        if divisors:
            expression = f"({a} {o1} {b}) // {rng.choice(divisors)}"
            return f"What is {expression}?", expression
    expression = f"({a} {o1} {b}) {o2} {c}" if rng.random() < 0.5 else f"{a} {o1} ({b} {o2} {c})"
    return f"What is {expression}?", expression


def _word(rng: random.Random, m: int) -> tuple[str, str]:
    """A one- or two-step story: groups (*), gains (+), losses (-), sharing (//), losses then
    gains, groups then sales."""
    name, he = rng.choice(_NAMES)
    item, box = rng.choice(_ITEMS), rng.choice(_CONTAINERS)
    a, b = rng.randint(2, m), rng.randint(2, m)
    template = rng.randrange(6)
    if template == 0:
        return (
            f"{name} has {a} {box} with {b} {item} in each. How many {item} does {he} have?",
            f"{a} * {b}",
        )
    if template == 1:
        return (
            f"{name} has {a} {item} and gets {b} more. How many {item} does {he} have now?",
            f"{a} + {b}",
        )
    if template == 2:
        a, b = max(a, b), min(a, b)
        return (f"{name} had {a} {item} and lost {b}. How many {item} are left?", f"{a} - {b}")
    if template == 3:
        d = _divisor(rng, m)
        return (
            f"{name} shares {a * d} {item} equally among {d} friends. "
            f"How many {item} does each friend get?",
            f"{a * d} // {d}",
        )
    if template == 4:
        b, c = rng.randint(1, a), rng.randint(2, m)
        return (
            f"{name} has {a} {item}, gives away {b} and then finds {c}. "
            f"How many {item} does {he} have now?",
            f"{a} - {b} + {c}",
        )
    c = rng.randint(1, min(a * b, 10 * m))
    return (
        f"A shop has {a} {box} of {b} {item} and sells {c} {item}. How many {item} are left?",
        f"{a} * {b} - {c}",
    )


_GENERATORS = {"binary": _binary, "multi": _multi, "word": _word}


@register_env("toy_math")
class ToyMathEnv(Env):
    """Integer arithmetic and word problems; reward 1.0 for the exact number, else 0.0.

    The prompt of "binary" and "multi" problems is "What is <expression>?", where the expression is
    valid Python, so a tiny model can copy it into python_eval. Answers are integers.
    """

    tool_names = ("python_eval", "finish")

    def __init__(
        self,
        max_operand: int = 50,
        kinds: tuple[str, ...] = ("binary", "multi", "word"),
        weights: tuple[float, ...] | None = None,
        tool_timeout: float = 2.0,
    ):
        unknown = [k for k in kinds if k not in _GENERATORS]
        if unknown or not kinds:
            raise ValueError(f"unknown kinds {unknown}; choose from {list(_GENERATORS)}")
        if weights is not None and (
            len(weights) != len(kinds) or min(weights) < 0 or sum(weights) <= 0
        ):
            raise ValueError(f"weights {weights} must be one non-negative number per kind {kinds}")
        if max_operand < 2:
            raise ValueError("max_operand must be at least 2")
        # operands are drawn from 1..max_operand (// dividends excepted)
        self.max_operand = max_operand
        self.kinds = tuple(kinds)  # which generators to draw from
        # the kinds' relative odds (equal by default)
        self.weights = tuple(weights) if weights is not None else (1.0,) * len(kinds)
        self.tool_timeout = tool_timeout  # seconds per tool call

    def system_prompt(self) -> str:
        return "Solve the problem. Use python_eval to compute and finish to give the answer."

    def make_task(self, prompt: str, expression: str, kind: str) -> Task:
        digest = hashlib.sha256(prompt.encode()).hexdigest()
        return Task(
            env=self.name,
            id=f"{self.name}/{digest[:16]}",
            prompt=prompt,
            answer=str(eval_arith(expression)),
            meta={"expression": expression, "kind": kind},
        )

    def sample_tasks(self, split: str, n: int, seed: int) -> list[Task]:
        """n distinct tasks of `split`, the same for the same (seed, constructor arguments)."""

        def draw(rng: random.Random) -> Task | None:
            kind = rng.choices(self.kinds, self.weights)[0]
            prompt, expression = _GENERATORS[kind](rng, self.max_operand)
            return self.make_task(prompt, expression, kind) if split_of(prompt) == split else None

        return sample_distinct(draw, split, n, seed, ": raise max_operand")

    def score(self, task: Task, answer: str | None) -> float:
        return 1.0 if answers_match(answer, task.answer) else 0.0

    def format_ok(self, answer: str) -> bool:
        return parse_number(answer) is not None

    def demonstration(self, task: Task, rng: random.Random, use_tools: bool) -> list[dict]:
        """The expert conversation. With tools: python_eval(canonical expression), its real output,
        then finish(answer). Without: finish(answer) at once (the habit RL should replace by tool
        use on hard problems). `rng` is unused: toy math has one expert path."""
        state, messages = self.reset(task, seed=0)
        if use_tools:
            call = ToolCall("python_eval", {"code": task.meta["expression"]})
            _, output, kind = self.run_tool(state, call)
            if kind is not None or output != task.answer:
                # never train on a demonstration that is wrong
                raise RuntimeError(
                    f"python_eval gave {output!r} for {task.id}, expected {task.answer!r}"
                )
            messages += [assistant_message("", [call]), tool_message("python_eval", output)]
        messages.append(assistant_message("", [ToolCall("finish", {"answer": task.answer})]))
        return messages
