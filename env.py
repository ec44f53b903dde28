"""env.py: environments for tool-using LLM agents: tasks, tools, two Python sandboxes, rewards.

An environment is a small state machine in the functional style of gym / purejaxrl:

    state, messages = env.reset(task, seed)                    # messages = [system, user]
    state, obs, reward, done, info = env.step(state, action)   # obs = tool messages to append

The agent loop (agent.py) owns the tokens: it renders messages with a chat template (and env.tools() as
the tool schemas), samples an assistant message, parses it into an `Action` (text + tool calls, or a
parse error) and calls `step`. The env never sees tokens and keeps nothing between calls: everything an
episode needs is in the frozen `EnvState`, replaced (never mutated) with `dataclasses.replace`, so one
Env object serves any number of episodes at once. The agent loop, not the env, enforces max_turns.

Contents, top to bottom:
  1. Types that cross the file boundary: ToolCall, Action, Task, EnvState.
  2. The python_eval sandbox: a static AST check plus one persistent, resource-limited worker process.
  3. The python_exec sandbox (`run_python`, `execute_python`): a whole program in a fresh process per
     call, resource-limited, as an unprivileged user, behind an AST check and an audit hook.
  4. Tools: a name -> Tool registry filled by `@tool`, with OpenAI-style JSON schemas: python_eval,
     python_exec, finish, calculator (exact arithmetic, no Python), scratchpad (notes in the EnvState).
  5. Answers: `parse_number` (normalized exact comparison) and `extract_answer` (answer in free text).
  6. `Env`, the base class (tool dispatch that survives broken tools, the generic step), `ENVS`,
     `@register_env`, `make_env`.
  7. `ToyMathEnv` ("toy_math", the "Toy Math Agent" seed): integer arithmetic and word problems with a
     hash-decided train/test split; the model should learn to call python_eval, then finish.

POSIX only (the sandbox uses process groups and resource limits).
"""
import ast
import atexit
import hashlib
import inspect
import json
import math
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from fractions import Fraction


# ----------------------------------------------------------------------------------------------------
# 1. Types that cross the file boundary

@dataclass(frozen=True)
class ToolCall:
    """One tool call parsed from an assistant message."""
    name: str         # tool name, e.g. "python_eval"
    arguments: dict   # the JSON arguments object, e.g. {"code": "12 * 7"}


@dataclass(frozen=True)
class Action:
    """What the agent parsed from one assistant message."""
    text: str                               # the message content as decoded (stop token removed)
    tool_calls: tuple[ToolCall, ...] = ()   # in the order they appear in the message
    parse_error: str | None = None          # None when well formed, else why parsing failed


@dataclass(frozen=True)
class Task:
    """One problem. Everything needed to score it travels with it (no lookups into the env)."""
    env: str                                  # name of the env that made it, e.g. "toy_math"
    id: str                                   # unique and stable across runs: "<env>/<hash of prompt>"
    prompt: str                               # the user message
    answer: str                               # ground truth, as text
    meta: dict = field(default_factory=dict)  # env-specific extras (toy_math: "expression", "kind")


@dataclass(frozen=True)
class EnvState:
    """The whole state of one episode; `step` returns a new one."""
    task: Task
    turn: int = 0                # assistant messages stepped so far
    done: bool = False
    reward: float = 0.0          # the final reward once done (0 before)
    answer: str | None = None    # the submitted answer (finish argument, or extracted from text)
    tool_calls: int = 0          # tool calls made, not counting the one that ended the episode (finish)
    tool_errors: int = 0         # tool calls that failed: unknown tool, bad arguments, refused, raised, timeout
    tool_timeouts: int = 0       # tool calls that timed out (also counted in tool_errors)
    parse_failures: int = 0      # assistant messages the agent could not parse (entirely or in part)
    notes: tuple[str, ...] = ()  # what the scratchpad tool holds, oldest first


def tool_message(name: str, content: str) -> dict:
    """An observation message, as the chat templates expect it."""
    return {"role": "tool", "name": name, "content": content}


def assistant_message(content: str, tool_calls: list[ToolCall] = ()) -> dict:
    """An assistant message in OpenAI style (arguments stay a dict; the chat template serializes them)."""
    message = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": dict(c.arguments)}}
                                 for c in tool_calls]
    return message


# ----------------------------------------------------------------------------------------------------
# 2. The python_eval sandbox
#
# What it promises:
#   - A snippet cannot import, touch any attribute except math.<public name> (this is what closes the
#     classic escapes: ().__class__.__base__.__subclasses__(), "{0.__class__}".format(x), gen.gi_frame),
#     name anything starting with "__", or call anything but SAFE_BUILTINS, math functions and functions
#     it defines itself. This is checked statically twice: here, before sending, and again inside the
#     worker, so the worker stays safe even when someone talks to it directly.
#   - Inside the worker the snippet's builtins are only SAFE_BUILTINS: open, exec, eval, getattr,
#     __import__ ... do not exist at run time, whatever the AST check might have missed.
#   - Runaway code is stopped: a wall-clock timeout (the parent kills the worker's process group and
#     starts a fresh worker on the next call), RLIMIT_CPU as a backstop if the parent is gone,
#     RLIMIT_AS = 1 GiB (a memory bomb becomes a MemoryError).
#   - Every failure comes back as short "Error: ..." text, never as an exception.
# What it does NOT promise (a hardened sandbox, e.g. containers + seccomp, is a later issue):
#   - Safety against a determined attacker: the worker runs as our user, with our filesystem and
#     network; a bug in CPython or in the check is an escape.
#   - Isolation between snippets beyond a fresh namespace: they share one interpreter.
#
# Why one persistent worker: RL runs ~100 snippets per step on 2 cores; starting an interpreter per
# snippet costs ~20-50 ms each, a JSON line to a live worker ~0.1 ms.

SAFE_BUILTINS = ("abs", "min", "max", "sum", "round", "int", "float", "str", "len", "range", "pow", "divmod",
                 "sorted", "list", "tuple", "set", "dict", "bool", "enumerate", "zip", "any", "all", "print")
MAX_CODE_CHARS = 4000  # longer snippets are refused before parsing (the parser is the first thing exposed)


def check_code(code: str) -> str | None:
    """Why `code` may not run (a syntax error or a policy violation), or None when it may.

    Policy: no import; attribute access only as math.<public name>; calls only to SAFE_BUILTINS, math
    functions and functions defined in the snippet; no name starting with "__".
    This function is also sent to the worker (WORKER_SRC), so it uses only `ast`, `math` and the constants.
    """
    if len(code) > MAX_CODE_CHARS:
        return f"code longer than {MAX_CODE_CHARS} characters"
    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        return f"SyntaxError: {e.msg} (line {e.lineno})"
    except (ValueError, RecursionError, MemoryError) as e:  # null bytes, absurd nesting
        return f"cannot parse: {type(e).__name__}"
    math_names = {n for n in dir(math) if not n.startswith("_")}
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            return "import is not allowed (math is already imported)"
        if isinstance(node, ast.Name) and node.id.startswith("__"):
            return f"the name {node.id} is not allowed"
        if isinstance(node, ast.Attribute) and not (
                isinstance(node.value, ast.Name) and node.value.id == "math" and node.attr in math_names):
            return f"attribute access .{node.attr} is not allowed (only math.<function>)"
        if isinstance(node, ast.Call) and not isinstance(node.func, ast.Attribute):  # math.f: checked above
            if not (isinstance(node.func, ast.Name) and (node.func.id in SAFE_BUILTINS or node.func.id in defined)):
                what = node.func.id if isinstance(node.func, ast.Name) else "this expression"
                return f"calling {what} is not allowed"
    return None


def _run_snippet(code: str, max_chars: int) -> tuple[str, str | None]:
    """Worker side: check and run one snippet in a fresh namespace -> (text, error kind or None).

    REPL-like: the text is the printed output followed by repr() of the last statement's value when the
    last statement is an expression (and not None); "(no output)" when both are empty.
    """
    import builtins
    import contextlib
    import io
    refusal = check_code(code)
    if refusal is not None:
        return "Error: " + refusal, "refused"
    namespace = {"__builtins__": {n: getattr(builtins, n) for n in SAFE_BUILTINS}, "math": math}
    printed = io.StringIO()
    try:
        tree = ast.parse(code)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        with contextlib.redirect_stdout(printed):
            exec(compile(tree, "<python_eval>", "exec"), namespace)
            value = eval(compile(ast.Expression(last.value), "<python_eval>", "eval"), namespace) if last else None
        text = printed.getvalue() + (repr(value) if value is not None else "")
        text, kind = (text.rstrip("\n") or "(no output)"), None
    except Exception as e:  # MemoryError and RecursionError included
        text, kind = f"Error: {type(e).__name__}" + (f": {e}" if str(e) else ""), "error"
    if len(text) > max_chars:
        text = text[:max_chars] + f"... [truncated, {len(text)} chars in all]"
    return text, kind


def _worker_main(memory_bytes: int, max_chars: int) -> None:
    """Worker side: apply resource limits, then answer one JSON line per request line until stdin closes.

    Request {"code": str, "cpu_seconds": float}; reply {"text": str, "kind": str | None}.
    """
    import json
    import resource
    import sys
    _, as_hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = memory_bytes if as_hard == resource.RLIM_INFINITY else min(memory_bytes, as_hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, as_hard))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _, cpu_hard = resource.getrlimit(resource.RLIMIT_CPU)
    channel = sys.stdout  # replies go here; the snippets' print() goes to a buffer (redirect_stdout)
    for line in sys.stdin:
        request = json.loads(line)
        # RLIMIT_CPU counts the worker's whole life, so move the soft limit to "used so far + budget"
        # before each snippet: SIGXCPU kills us past it even if the parent cannot enforce its timeout.
        used = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
        soft = int(used + request["cpu_seconds"]) + 1
        if cpu_hard != resource.RLIM_INFINITY:
            soft = min(soft, cpu_hard)
        resource.setrlimit(resource.RLIMIT_CPU, (soft, cpu_hard))
        text, kind = _run_snippet(request["code"], max_chars)
        channel.write(json.dumps({"text": text, "kind": kind}) + "\n")
        channel.flush()


# The worker program: the functions above, sent as source, so it is the same code the tests read.
WORKER_SRC = "\n".join([
    "import ast, math",
    f"SAFE_BUILTINS = {SAFE_BUILTINS!r}",
    f"MAX_CODE_CHARS = {MAX_CODE_CHARS!r}",
    inspect.getsource(check_code),
    inspect.getsource(_run_snippet),
    inspect.getsource(_worker_main),
])


class PythonSandbox:
    """One persistent worker process (`python -I -S -c WORKER_SRC`) that runs snippets, one at a time.

    `run` is thread-safe (a lock around each request/reply) and never raises for a bad snippet.
    """

    def __init__(self, timeout: float = 2.0, memory_bytes: int = 1 << 30, max_chars: int = 500):
        self.timeout = timeout            # wall-clock seconds per snippet
        self.memory_bytes = memory_bytes  # RLIMIT_AS of the worker
        self.max_chars = max_chars        # result text is cut here, with a visible marker
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._owner_pid = os.getpid()     # after a fork the child must not reuse our worker's pipes
        self._pending = b""               # bytes read past the last reply line
        atexit.register(self.close)

    def run(self, code: str, timeout: float | None = None) -> tuple[str, str | None]:
        """Run `code` -> (text, error kind): kind is None, "refused", "error" or "timeout"."""
        timeout = self.timeout if timeout is None else timeout
        refusal = check_code(code)  # refuse early, without a round trip (the worker checks again)
        if refusal is not None:
            return "Error: " + refusal, "refused"
        with self._lock:
            try:
                proc = self._ensure_worker()
                proc.stdin.write((json.dumps({"code": code, "cpu_seconds": timeout + 1.0}) + "\n").encode())
                proc.stdin.flush()
                reply = json.loads(self._read_line(time.monotonic() + timeout))
                return reply["text"], reply["kind"]
            except TimeoutError:  # before OSError: TimeoutError is an OSError
                self._kill()
                return f"Error: timed out after {timeout:g} s", "timeout"
            except (OSError, EOFError, ValueError):  # the worker died (memory/CPU limit) or spoke garbage
                self._kill()
                return "Error: the Python worker crashed (memory or CPU limit?)", "error"

    def close(self) -> None:
        """Kill the worker (registered with atexit; the next `run` would start a new one)."""
        with self._lock:
            self._kill()

    def _ensure_worker(self) -> subprocess.Popen:
        if self._owner_pid != os.getpid():  # we are a forked copy: forget the parent's worker, don't kill it
            self._proc, self._pending, self._owner_pid = None, b"", os.getpid()
        if self._proc is None or self._proc.poll() is not None:
            self._kill()
            src = WORKER_SRC + f"\n_worker_main({self.memory_bytes}, {self.max_chars})\n"
            # -I: ignore PYTHON* env vars and the user's site dir; -S: skip site. start_new_session: own
            # process group, so we can kill everything it is running and Ctrl-C in a terminal does not reach it.
            self._proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", src], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
        return self._proc

    def _read_line(self, deadline: float) -> bytes:
        """One reply line from the worker; TimeoutError past `deadline`, EOFError if it died."""
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line

    def _kill(self) -> None:
        proc, self._proc, self._pending = self._proc, None, b""
        if proc is None or self._owner_pid != os.getpid():  # a forked copy never kills its parent's worker
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # pgid == pid (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()


SANDBOX = PythonSandbox()  # the shared worker behind the python_eval tool; started on first use


# ----------------------------------------------------------------------------------------------------
# 3. The python_exec sandbox: a whole program, in a fresh isolated process per call
#
# python_eval (above) is a calculator in one long-lived worker: fast, and limited to expressions over
# math. python_exec runs a whole program (imports, loops, files) and treats it as hostile. Each call
# gets a new interpreter that inherits nothing and leaves nothing behind. Layers, outermost first; the
# tests (tests/test_sandbox.py) check each threat against the whole stack and the process layer alone:
#   1. The process. `python -I -S` (no PYTHON* variables, no site-packages) with an empty environment,
#      in a fresh temporary directory deleted afterwards, in its own process group, which the parent
#      kills whole at the wall-clock deadline. Before it reads the program it sets hard limits (CPU
#      seconds, address space, file size, open files, zero new processes, no core file) and, when we
#      run as root, drops to nobody:nogroup: a limit on the number of processes does not bind root.
#      It drops after the interpreter has started (and not in Popen's preexec_fn, which may deadlock
#      in a threaded parent) but before a byte of the program is read: the same guarantee.
#   2. The interpreter. Only ALLOWED_MODULES can be imported. They are loaded before the program is
#      read, and the program gets a copy of their public names without module objects (so no
#      `fractions.sys`) and without getattr-by-string helpers (operator.attrgetter). Builtins are a
#      short list: no eval, exec, compile, getattr, type, input, breakpoint, __import__ of our own.
#      Then an audit hook (PEP 578, sys.addaudithook) refuses every runtime event but one exec (the
#      program's) and open() of a relative path inside the working directory: any import, os.*,
#      socket.*, subprocess.*, ctypes, gi_frame / tb_frame / sys._getframe raise PermissionError.
#   3. The program text. An AST check refuses imports outside ALLOWED_MODULES, names starting with
#      "__", attributes starting with "_" or naming frames and code (gi_frame, f_globals, ...), and
#      class definitions, before a process is started (and once more inside it).
# Errors, refusals and timeouts come back as short "Error: ..." text, never as exceptions.
# What it does NOT promise: it is not a security boundary against a determined attacker. There is no
# seccomp filter, no network namespace, no chroot. An escape from layers 2-3 (a CPython bug, an
# audit-hook gap in some C code) leaves only layer 1: nobody's rights, which still include reading
# world-readable files and opening sockets. Put the trainer in a container or VM when that matters.

ALLOWED_MODULES = ("math", "cmath", "fractions", "decimal", "statistics", "itertools", "functools", "operator",
                   "collections", "heapq", "bisect", "random", "re", "json")
_HIDDEN_MEMBERS = ("attrgetter", "methodcaller")  # operator's getattr-by-string: a way around the AST check
EXEC_BUILTINS = SAFE_BUILTINS + (
    "isinstance", "reversed", "map", "filter", "chr", "ord", "hex", "bin", "oct", "format", "repr", "iter", "next",
    "slice", "frozenset", "complex", "hash", "callable", "open",
    "Exception", "ArithmeticError", "AssertionError", "AttributeError", "FileNotFoundError", "ImportError",
    "IndexError", "KeyError", "LookupError", "MemoryError", "NameError", "NotImplementedError", "OSError",
    "OverflowError", "PermissionError", "RecursionError", "RuntimeError", "StopIteration", "TypeError",
    "ValueError", "ZeroDivisionError")
_FRAME_ATTR_PREFIXES = ("gi_", "cr_", "ag_", "f_", "tb_", "co_")  # generator/coroutine/frame/traceback/code
MAX_OPENS = 64  # open() calls per program
NOBODY = 65534  # uid and gid of nobody / nogroup on Debian, Ubuntu, Alpine and RHEL


@dataclass(frozen=True)
class ExecLimits:
    """Resource limits of one python_exec run (the wall-clock timeout is an argument of execute_python)."""
    memory_bytes: int = 512 << 20  # RLIMIT_AS: address space; past it, allocations raise MemoryError
    file_bytes: int = 1 << 20      # RLIMIT_FSIZE: largest file the program may write (in its directory)
    open_files: int = 16           # RLIMIT_NOFILE: file descriptors, stdin/stdout/stderr included
    max_chars: int = 2000          # printed output kept; the rest is cut, with a visible marker
    max_code_chars: int = 20000    # longer programs are refused before parsing


def check_program(code: str, max_code_chars: int = 20000) -> str | None:
    """Why python_exec refuses `code` (a syntax error or a policy violation), or None when it may run.

    Policy: imports only of ALLOWED_MODULES (no submodules, no relative imports, no private names); no
    name starting with "__"; no attribute starting with "_" or naming a frame, generator or code
    internal; no class definitions. Sent to the child too (EXEC_CHILD_SRC): only `ast` and constants.
    """
    if len(code) > max_code_chars:
        return f"program longer than {max_code_chars} characters"
    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        return f"SyntaxError: {e.msg} (line {e.lineno})"
    except (ValueError, RecursionError, MemoryError) as e:  # null bytes, absurd nesting
        return f"cannot parse: {type(e).__name__}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name not in ALLOWED_MODULES:
                    return f"import {alias.name} is not allowed; allowed: {', '.join(ALLOWED_MODULES)}"
        if isinstance(node, ast.ImportFrom):
            if node.level or node.module not in ALLOWED_MODULES:
                return f"import from {node.module} is not allowed; allowed: {', '.join(ALLOWED_MODULES)}"
            for alias in node.names:
                if alias.name.startswith("_"):
                    return f"importing the private name {alias.name} is not allowed"
        if isinstance(node, ast.Name) and node.id.startswith("__"):
            return f"the name {node.id} is not allowed"
        if isinstance(node, ast.Attribute) and node.attr.startswith(("_",) + _FRAME_ATTR_PREFIXES):
            return f"attribute access .{node.attr} is not allowed"
        if isinstance(node, ast.ClassDef):
            return "class definitions are not allowed"
    return None


def _exec_program(code: str, max_chars: int, max_code_chars: int) -> tuple[str, str | None]:
    """Child side: check `code`, build its namespace, install the audit hook, run -> (text, error kind).

    REPL-like: the text is what the program printed, then repr() of the last statement's value when it
    is an expression (and not None); an error is appended as "Error: Type: message". The audit hook
    stays installed for good: the caller must only write the reply and os._exit() afterwards.
    """
    import builtins
    import os
    import sys
    import types
    refusal = check_program(code, max_code_chars)
    if refusal is not None:
        return "Error: " + refusal, "refused"
    tree = ast.parse(code)
    if tree.body and isinstance(tree.body[-1], ast.Expr):  # keep the last value: `x = 1\nx + 1` shows 2
        last = tree.body[-1]
        tree.body[-1] = ast.copy_location(ast.Assign([ast.Name("__result__", ast.Store())], last.value), last)
        ast.fix_missing_locations(tree)
    program = compile(tree, "<program>", "exec")  # before the hook: compiling raises an audit event

    modules = {}  # name -> a new module holding only the public names of the real one (no modules in it)
    for name in ALLOWED_MODULES:
        modules[name] = types.ModuleType(name)
        modules[name].__dict__.update({k: v for k, v in vars(sys.modules[name]).items() if not k.startswith("_")
                                       and not isinstance(v, types.ModuleType) and k not in _HIDDEN_MEMBERS})

    def import_allowed(name, globals=None, locals=None, fromlist=(), level=0):
        if level or name not in modules:
            raise ImportError(f"import of {name!r} is not allowed")
        return modules[name]

    safe = {n: getattr(builtins, n) for n in EXEC_BUILTINS}
    namespace = {"__builtins__": {**safe, "__import__": import_allowed}, "__name__": "__main__"}

    class Printed:
        """sys.stdout for the program: keeps the first max_chars characters, counts the rest."""
        def __init__(self):
            self.parts, self.kept, self.total = [], 0, 0

        def write(self, s):
            if not isinstance(s, str):
                raise TypeError("write() argument must be str")
            self.total += len(s)
            if self.kept < max_chars:
                self.parts.append(s[:max_chars - self.kept])
                self.kept += len(self.parts[-1])
            return len(s)

        def flush(self):
            pass

    def inside_workdir(path) -> bool:
        if not isinstance(path, str) or "\0" in path:  # an int is an inherited fd (stdout...), refuse it
            return False
        path = os.path.normpath(path)  # pure string work: symlinks cannot be made (os is unreachable)
        return not os.path.isabs(path) and path != ".." and not path.startswith("../")

    seen = {"exec": 0, "open": 0}

    def audit(event, args):
        if event == "exec" and seen["exec"] == 0:  # our own exec(program) below, once
            seen["exec"] += 1
            return
        if event == "open":
            if inside_workdir(args[0]) and seen["open"] < MAX_OPENS:
                seen["open"] += 1  # a budget, so that 2 s of open() cannot fill the disk with 1 MiB files
                return
            raise PermissionError(f"open({str(args[0])[:60]!r}) is not allowed in the sandbox: only relative "
                                  f"paths inside the working directory, {MAX_OPENS} opens at most")
        raise PermissionError(f"{event} is not allowed in the sandbox")

    printed = Printed()
    sys.stdout = sys.stderr = printed
    sys.addaudithook(audit)
    kind, error = None, ""
    try:
        exec(program, namespace)
        value = namespace.get("__result__")
        if value is not None:
            printed.write(repr(value))
    except BaseException as e:  # MemoryError, RecursionError, SystemExit, PermissionError from the hook ...
        try:
            message = str(e)
        except Exception:
            message = ""
        kind, error = "error", f"Error: {type(e).__name__}" + (f": {message}" if message else "")
    text = "".join(printed.parts).rstrip("\n")
    if printed.total > max_chars:
        text += f"... [truncated, {printed.total} chars in all]"
    text = "\n".join(t for t in (text, error[:max_chars]) if t)
    return text or "(no output)", kind


def _exec_child_main(limits: dict, policy: bool = True) -> None:
    """Child side, the whole life of a python_exec process: limits, imports, drop root, run, reply, exit.

    `limits`: {"cpu_seconds", "memory_bytes", "file_bytes", "open_files", "max_chars", "max_code_chars"}.
    `policy` False skips layers 2-3 (the AST check, the namespace, the audit hook): only tests use it, to
    show what the process layer holds by itself. Replies one JSON line {"text", "kind"} on stdout.
    """
    import json
    import os
    import resource
    import signal
    import sys

    def cap(which, value):  # soft = hard: the program cannot raise it again
        _, hard = resource.getrlimit(which)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (value, value))

    cap(resource.RLIMIT_CPU, limits["cpu_seconds"])
    cap(resource.RLIMIT_AS, limits["memory_bytes"])
    cap(resource.RLIMIT_FSIZE, limits["file_bytes"])
    cap(resource.RLIMIT_NOFILE, limits["open_files"])
    cap(resource.RLIMIT_NPROC, 0)  # no fork, no threads (binds only a non-root user: see below)
    cap(resource.RLIMIT_CORE, 0)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a too-large write raises OSError instead of killing us
    for name in ALLOWED_MODULES:  # import now: after the drop below, our Python install may be unreadable
        __import__(name)
    with open("program.py", "rb") as f:  # written by the parent; read as data, not run yet
        code = f.read().decode("utf-8", "surrogatepass")
    os.remove("program.py")
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)  # as root this sets the real, effective and saved uid: there is no way back
        if 0 in (os.getuid(), os.geteuid(), os.getgid(), os.getegid()):
            os._exit(3)
    if policy:
        text, kind = _exec_program(code, limits["max_chars"], limits["max_code_chars"])
    else:  # tests only: the process layer, bare
        import contextlib
        import io
        out, kind, error = io.StringIO(), None, ""
        with contextlib.redirect_stdout(out):
            try:
                exec(code, {"__name__": "__main__"})
            except BaseException as e:
                kind, error = "error", f"Error: {type(e).__name__}: {e}"
        text = (out.getvalue() + error)[:limits["max_chars"]].rstrip("\n") or "(no output)"
    os.write(1, (json.dumps({"text": text, "kind": kind}) + "\n").encode())
    os._exit(0)  # no interpreter shutdown: no finalizer of the program's objects runs after the reply


# The child program: the functions above, sent as source, so it is the same code the tests read.
EXEC_CHILD_SRC = "\n".join([
    "import ast",
    f"ALLOWED_MODULES = {ALLOWED_MODULES!r}",
    f"_HIDDEN_MEMBERS = {_HIDDEN_MEMBERS!r}",
    f"EXEC_BUILTINS = {EXEC_BUILTINS!r}",
    f"_FRAME_ATTR_PREFIXES = {_FRAME_ATTR_PREFIXES!r}",
    f"MAX_OPENS = {MAX_OPENS!r}",
    f"NOBODY = {NOBODY!r}",
    inspect.getsource(check_program),
    inspect.getsource(_exec_program),
    inspect.getsource(_exec_child_main),
])


def execute_python(code: str, timeout_s: float = 2.0, limits: ExecLimits = ExecLimits(),
                   _policy: bool = True) -> tuple[str, str | None]:
    """Run a program in a fresh sandboxed process -> (text, error kind): kind is None, "refused",
    "error" or "timeout". Thread-safe (nothing is shared between calls) and never raises for a bad program.

    `_policy=False` turns off layers 2-3 (tests only: it shows what the process layer holds alone).
    """
    if _policy:
        refusal = check_program(code, limits.max_code_chars)  # refuse early, without a process
        if refusal is not None:
            return "Error: " + refusal, "refused"
    child_limits = {"cpu_seconds": math.ceil(timeout_s) + 1, "memory_bytes": limits.memory_bytes,
                    "file_bytes": limits.file_bytes, "open_files": limits.open_files,
                    "max_chars": limits.max_chars, "max_code_chars": limits.max_code_chars}
    src = EXEC_CHILD_SRC + f"\n_exec_child_main({child_limits!r}, policy={_policy!r})\n"
    workdir = tempfile.mkdtemp(prefix="nano-skyrl-py-")
    proc = None
    try:
        with open(os.path.join(workdir, "program.py"), "wb") as f:
            f.write(code.encode("utf-8", "surrogatepass"))
        if os.geteuid() == 0:
            os.chown(workdir, NOBODY, NOBODY)  # the child drops to nobody and must write its directory
        deadline = time.monotonic() + timeout_s
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", src], cwd=workdir, env={},
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        out, timed_out = _read_capped(proc, deadline, cap=4 * limits.max_chars + 4096)
        if timed_out:
            return f"Error: timed out after {timeout_s:g} s", "timeout"
        try:
            reply = json.loads(out.decode("utf-8", "replace").strip().splitlines()[-1])
            return reply["text"].encode("utf-8", "replace").decode("utf-8"), reply["kind"]
        except (ValueError, IndexError, KeyError, TypeError):  # no reply: the process died first
            status = proc.wait()
            if status == -signal.SIGXCPU:
                return "Error: CPU time limit exceeded", "timeout"
            if status < 0:
                try:
                    name = signal.Signals(-status).name
                except ValueError:
                    name = f"signal {-status}"
                return f"Error: the program was killed by {name}", "error"
            return f"Error: the program exited with status {status} without a result", "error"
    except OSError as e:  # no process could be started (out of processes, memory, disk)
        return f"Error: the sandbox could not start: {type(e).__name__}: {e}", "error"
    finally:
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the whole group; pgid == pid (start_new_session)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()  # until this wait the pid stays a zombie, so the killpg above hits no one else
            proc.stdout.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _read_capped(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, bool]:
    """Read proc's stdout until it closes -> (at most `cap` bytes, whether the deadline passed first)."""
    fd, chunks, size = proc.stdout.fileno(), [], 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return b"".join(chunks), True
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks), False
        if size < cap:
            chunks.append(chunk[:cap - size])
            size += len(chunks[-1])


def run_python(code: str, timeout_s: float = 2.0) -> str:
    """Run a program in the python_exec sandbox and return the text it produced (see execute_python)."""
    return execute_python(code, timeout_s)[0]


# ----------------------------------------------------------------------------------------------------
# 4. Tools

@dataclass(frozen=True)
class Tool:
    """A callable the model can name. `fn(env, state, **arguments) -> (state, text, error_kind | None)`.

    The env is passed so tools can use env resources (a search index, a simulated world); the state so a
    tool can change the episode (finish sets done). Error kinds: "unknown_tool", "bad_args" (from dispatch),
    "refused", "error", "timeout" (from the tool).
    """
    name: str
    description: str   # keep it to a few words: the schemas are rendered into every prompt
    parameters: dict   # JSON schema of the arguments object
    fn: Callable
    bounded: bool = False  # True: fn returns within env.tool_timeout by itself (it kills its own child
                           # process, or cannot block), so Env.run_tool calls it directly, not in a watchdog thread

    def schema(self) -> dict:
        """The OpenAI-style function schema."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


TOOLS: dict[str, Tool] = {}  # filled at import by @tool (tests add and remove their own)


def tool(name: str, description: str, parameters: dict, bounded: bool = False):
    """Decorator: register `fn` as the tool `name` in TOOLS."""
    def register(fn):
        if name in TOOLS:
            raise ValueError(f"tool {name!r} is registered twice")
        TOOLS[name] = Tool(name, description, parameters, fn, bounded)
        return fn
    return register


@tool("python_eval", "Run Python code and return the result.",
      {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}, bounded=True)
def python_eval(env, state, code):
    """Run `code` in the shared sandbox; the state is unchanged."""
    text, kind = SANDBOX.run(code, timeout=env.tool_timeout)
    return state, text, kind


@tool("python_exec", "Run a Python program in a fresh sandbox.",
      {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}, bounded=True)
def python_exec(env, state, code):
    """Run `code` as a whole program in its own sandboxed process (execute_python); the state is unchanged."""
    text, kind = execute_python(code, timeout_s=env.tool_timeout)
    return state, text, kind


@tool("finish", "Submit the final answer.",
      {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}, bounded=True)
def finish(env, state, answer):
    """Record the answer and end the episode; Env.step scores it and emits no observation for it."""
    return replace(state, done=True, answer=answer), "", None


CALC_MAX_CHARS = 500   # longer expressions are refused before parsing
CALC_MAX_BITS = 4096   # every intermediate numerator and denominator stays below 2**4096 (~1233 digits)
_CALC_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
             ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: Fraction(a // b), ast.Mod: lambda a, b: a % b}


def calculate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression: numbers, + - * / // % ** (or ^), unary minus, ().

    Its own evaluator over the AST, never Python's eval, with Fractions, so 0.1 + 0.2 is exactly 3/10.
    Bounded: CALC_MAX_CHARS of input, integer exponents, CALC_MAX_BITS per value (checked before a
    power is computed, so 9**9**9 is refused at once). Raises ValueError or ZeroDivisionError.
    """
    if len(expression) > CALC_MAX_CHARS:
        raise ValueError(f"expression longer than {CALC_MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.replace("^", "**").strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ValueError("not an arithmetic expression") from None

    def small(x: Fraction) -> Fraction:
        if max(x.numerator.bit_length(), x.denominator.bit_length()) > CALC_MAX_BITS:
            raise ValueError(f"a value is larger than 2**{CALC_MAX_BITS}")
        return x

    def value(node, depth: int) -> Fraction:
        if depth > 100:
            raise ValueError("expression nested too deeply")
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return small(Fraction(node.value))
        if isinstance(node, ast.Constant) and type(node.value) is float:
            if not math.isfinite(node.value):
                raise ValueError(f"a value is larger than 2**{CALC_MAX_BITS}")
            return small(Fraction(repr(node.value)))  # a float literal as written: 0.1 is 1/10
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            x = value(node.operand, depth + 1)
            return -x if isinstance(node.op, ast.USub) else x
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            base, exponent = value(node.left, depth + 1), value(node.right, depth + 1)
            if exponent.denominator != 1:
                raise ValueError("only integer exponents are exact")
            if abs(base) == 1:  # (+-1) ** n without computing n multiplications
                return base ** (int(exponent) % 2)
            size = max(base.numerator.bit_length(), base.denominator.bit_length())
            if (size - 1) * abs(exponent) >= CALC_MAX_BITS:  # the result has more than this many bits
                raise ValueError(f"a value is larger than 2**{CALC_MAX_BITS}")
            return small(base ** int(exponent))  # at most size * |exponent| <= 2 * CALC_MAX_BITS bits
        if isinstance(node, ast.BinOp) and type(node.op) in _CALC_OPS:
            return small(_CALC_OPS[type(node.op)](value(node.left, depth + 1), value(node.right, depth + 1)))
        raise ValueError("only numbers, + - * / // % ** and parentheses are allowed")

    return value(tree.body, 0)


def format_exact(x: Fraction) -> str:
    """'84', '7/2 = 3.5' (a terminating decimal), '1/3 ≈ 0.333333333333'."""
    if x.denominator == 1:
        return str(x.numerator)
    for k in range(21):  # 10**k divisible by the denominator: the decimal terminates after k digits
        if 10 ** k % x.denominator == 0:
            digits = str(abs(x.numerator) * 10 ** k // x.denominator).rjust(k + 1, "0")
            return f"{x.numerator}/{x.denominator} = {'-' if x < 0 else ''}{digits[:-k]}.{digits[-k:]}"
    try:
        return f"{x.numerator}/{x.denominator} ≈ {float(x):.12g}"
    except OverflowError:
        return f"{x.numerator}/{x.denominator}"


@tool("calculator", "Exact arithmetic: + - * / // % ** ( ).",
      {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}, bounded=True)
def calculator(env, state, expression):
    """Evaluate `expression` exactly (calculate); the state is unchanged."""
    try:
        return state, format_exact(calculate(expression)), None
    except ZeroDivisionError:
        return state, "Error: division by zero", "error"
    except ValueError as e:
        return state, f"Error: {e}", "error"


MAX_NOTES = 20         # notes per episode
MAX_NOTE_CHARS = 500   # characters per note


@tool("scratchpad", "Write a note, or read all notes.",
      {"type": "object", "properties": {"action": {"type": "string", "enum": ["write", "read"]},
                                        "text": {"type": "string"}}, "required": ["action"]}, bounded=True)
def scratchpad(env, state, action, text=""):
    """Notes that live in the episode's state (EnvState.notes): "write" appends `text`, "read" lists them."""
    if action == "read":
        return state, "\n".join(f"{i}. {note}" for i, note in enumerate(state.notes, 1)) or "(no notes)", None
    if action != "write":
        return state, f'Error: unknown action {action[:40]!r}; use "write" or "read".', "bad_args"
    if not text.strip():
        return state, "Error: nothing to write: give the note as \"text\".", "bad_args"
    if len(text) > MAX_NOTE_CHARS:
        return state, f"Error: a note holds at most {MAX_NOTE_CHARS} characters, not {len(text)}.", "error"
    if len(state.notes) >= MAX_NOTES:
        return state, f"Error: the scratchpad is full ({MAX_NOTES} notes).", "error"
    return replace(state, notes=state.notes + (text,)), f"Saved note {len(state.notes) + 1}.", None


_JSON_TYPES = {"string": str, "number": (int, float), "integer": int, "boolean": bool, "object": dict, "array": list}


def validate_arguments(parameters: dict, arguments) -> tuple[dict | None, str | None]:
    """Check `arguments` against a (flat) JSON schema -> (arguments, None) or (None, what is wrong)."""
    if not isinstance(arguments, dict):
        return None, "arguments must be a JSON object"
    properties = parameters.get("properties", {})
    missing = [k for k in parameters.get("required", []) if k not in arguments]
    unknown = [k for k in arguments if k not in properties]
    if missing or unknown:
        expected = ", ".join(f'"{k}": {p.get("type", "any")}' for k, p in properties.items())
        problem = f"missing {missing}" if missing else f"unexpected {unknown}"
        return None, f"bad arguments: {problem}; expected {{{expected}}}"
    checked = {}
    for key, value in arguments.items():
        kind = properties[key].get("type")
        if kind == "string" and isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)  # {"answer": 57} for {"answer": "57"} is a harmless slip; accept it
        if kind in _JSON_TYPES and not isinstance(value, _JSON_TYPES[kind]):
            return None, f"bad arguments: {key!r} must be a {kind}"
        checked[key] = value
    return checked, None


# ----------------------------------------------------------------------------------------------------
# 5. Answers

_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d{1,4})?")    # exponent capped: 1e999999999 would hang
_NUMBER_IN_TEXT = re.compile(r"(?<![\d.])-?\d[\d,]*(?:\.\d+)?")            # "1,234" is one number, "10-3" ends in 3
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def parse_number(text: str | None) -> Fraction | None:
    """The exact value of a numeric answer, or None: strips spaces, commas, "$" and one trailing period.

    '57', ' 57.0 ', '57.', '1,234', '$5', '-3', '1e3' parse; '57 apples', 'x', '' do not. Exact (Fraction),
    so "57" == "57.0" and no float rounding can make a wrong answer right.
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


def extract_answer(text: str) -> str | None:
    """The final answer written in free text: the last \\boxed{...} if any, else the last number, else None."""
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    numbers = _NUMBER_IN_TEXT.findall(text)
    return numbers[-1].rstrip(",") if numbers else None


# ----------------------------------------------------------------------------------------------------
# 6. The Env base class and the registry

class Env:
    """Base class. A subclass sets `tool_names` and implements system_prompt, sample_tasks, score and
    demonstration; it overrides `on_text` (and `format_ok`) when plain text is not a final answer (e.g. a
    reply to a simulated user). reset, step and run_tool are shared, so the agent loop never changes."""
    name: str = "base"                 # set by @register_env
    tool_names: tuple[str, ...] = ()   # the TOOLS this env offers, in prompt order
    tool_timeout: float = 2.0          # seconds per tool call (python_eval, python_exec; the watchdog of the others)

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

    def format_ok(self, answer: str) -> bool:
        """Whether an answer submitted through finish is well formed."""
        return bool(answer.strip())

    def reset(self, task: Task, seed: int) -> tuple[EnvState, list[dict]]:
        """A new episode -> (state, [system, user]). `seed` is for envs with randomness (unused by toy_math)."""
        if task.env != self.name:
            raise ValueError(f"task {task.id!r} belongs to env {task.env!r}, not {self.name!r}")
        return EnvState(task=task), [{"role": "system", "content": self.system_prompt()},
                                     {"role": "user", "content": task.prompt}]

    def step(self, state: EnvState, action: Action) -> tuple[EnvState, list[dict], float, bool, dict]:
        """One assistant message -> (state, observation messages, reward, done, info).

        info: "format_ok" (answered through finish with a well-formed answer), "answer", and this step's
        "tool_calls", "tool_errors", "tool_timeouts".
        """
        if state.done:
            raise ValueError("step() called on a finished episode")
        start = replace(state, turn=state.turn + 1)
        if action.parse_error is not None:
            # Calls the parser could still read (repaired JSON, a missing </tool_call>) run; the problem is
            # reported after their results and counted, so the model still learns the exact format.
            hint = "Call a tool with JSON arguments, or reply with the answer."
            state = replace(start, parse_failures=start.parse_failures + 1)
            state, obs, reward, done, info = self.run_tool_calls(state, action.tool_calls)
            if not done:
                obs = obs + [tool_message("error", f"Error: {action.parse_error}. {hint}")]
        elif not action.tool_calls:
            state, obs, reward, done, info = self.on_text(start, action.text)
        else:
            state, obs, reward, done, info = self.run_tool_calls(start, action.tool_calls)
        info = {"format_ok": False, "answer": state.answer if done else None, **info,
                "tool_calls": state.tool_calls - start.tool_calls,
                "tool_errors": state.tool_errors - start.tool_errors,
                "tool_timeouts": state.tool_timeouts - start.tool_timeouts}
        return state, obs, reward, done, info

    def on_text(self, state: EnvState, text: str) -> tuple[EnvState, list[dict], float, bool, dict]:
        """A message without tool calls. Default: it is the final answer (\\boxed{} or the last number)."""
        answer = extract_answer(text)
        reward = self.score(state.task, answer)
        return replace(state, done=True, answer=answer, reward=reward), [], reward, True, {"format_ok": False}

    def run_tool_calls(self, state: EnvState, calls) -> tuple[EnvState, list[dict], float, bool, dict]:
        """Run calls in order, one observation each; a call that ends the episode (finish) stops the rest."""
        obs = []
        for call in calls:
            state, text, kind = self.run_tool(state, call)
            if state.done:
                reward = self.score(state.task, state.answer)
                return replace(state, reward=reward), obs, reward, True, {"format_ok": self.format_ok(state.answer)}
            state = replace(state, tool_calls=state.tool_calls + 1, tool_errors=state.tool_errors + (kind is not None),
                            tool_timeouts=state.tool_timeouts + (kind == "timeout"))
            obs.append(tool_message(call.name, text))
        return state, obs, 0.0, False, {}

    def run_tool(self, state: EnvState, call: ToolCall) -> tuple[EnvState, str, str | None]:
        """Dispatch one call -> (state, observation text, error kind or None). Errors are text, not exceptions.

        A bug in one tool must not kill a batch of rollouts: an exception, a hang (a tool that is not
        `bounded` runs in a watchdog thread; past tool_timeout it is abandoned, and keeps its thread until
        it returns), a result of the wrong shape all become "Error: ..." text; text longer than
        MAX_OBSERVATION_CHARS is cut with a visible marker.
        """
        if call.name not in self.tool_names:
            return state, f"Error: unknown tool {call.name!r}. Tools: {', '.join(self.tool_names)}.", "unknown_tool"
        spec = TOOLS[call.name]
        arguments, problem = validate_arguments(spec.parameters, call.arguments)
        if problem is not None:
            return state, f"Error: {problem}.", "bad_args"
        result, error = _call_with_deadline(lambda: spec.fn(self, state, **arguments),
                                            None if spec.bounded else self.tool_timeout)
        if isinstance(error, TimeoutError):
            return state, f"Error: {call.name} did not answer within {self.tool_timeout:g} s", "timeout"
        if error is not None:
            return state, _cut(f"Error: {type(error).__name__}: {_safe_str(error)}"), "error"
        if not (isinstance(result, tuple) and len(result) == 3 and isinstance(result[0], EnvState)
                and isinstance(result[1], str) and (result[2] is None or isinstance(result[2], str))):
            return state, f"Error: {call.name} returned a {type(result).__name__}, not (state, text, kind)", "error"
        new_state, text, kind = result
        return new_state, _cut(text), kind


MAX_OBSERVATION_CHARS = 4000  # a tool's text is cut here, with a visible marker (python_eval cuts at 500 itself)


def _cut(text: str) -> str:
    return text if len(text) <= MAX_OBSERVATION_CHARS else (
        text[:MAX_OBSERVATION_CHARS] + f"... [truncated, {len(text)} chars in all]")


def _safe_str(error: BaseException) -> str:
    try:
        return str(error)
    except Exception:  # an exception whose __str__ raises
        return "(no message)"


def _call_with_deadline(fn: Callable, timeout: float | None) -> tuple[object, Exception | None]:
    """fn() -> (its result, None) or (None, the exception it raised, or TimeoutError past `timeout`).

    timeout None: call it here. Otherwise in a daemon thread, which we stop waiting for at the deadline:
    Python cannot kill a thread, so a tool that truly hangs keeps its thread (tools that run untrusted
    code use a child process they can kill, and are `bounded`). The thread costs ~0.1 ms per call.
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


def make_env(name: str, **kwargs) -> Env:
    """Build a registered env; unknown names raise ValueError listing the available ones."""
    if name not in ENVS:
        raise ValueError(f"unknown env {name!r}; available: {', '.join(sorted(ENVS))}")
    return ENVS[name](**kwargs)


# ----------------------------------------------------------------------------------------------------
# 7. Toy math

TEST_PERCENT = 10  # share of the problem space (by hash of the prompt) that is held out; fixed, so that
                   # a test problem is a test problem under every config and seed

_NAMES = (("Tom", "he"), ("Mia", "she"), ("Sam", "he"), ("Ana", "she"), ("Leo", "he"), ("Zoe", "she"))
_ITEMS = ("apples", "pens", "coins", "stickers", "books", "marbles", "cards", "cookies")
_CONTAINERS = ("boxes", "bags", "jars", "baskets")
_ARITH = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
          ast.Mult: lambda a, b: a * b, ast.FloorDiv: lambda a, b: a // b}


def eval_arith(expression: str) -> int:
    """The value of an integer expression with + - * // and parentheses (ground truth without eval())."""
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
            return _ARITH[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"not integer arithmetic: {expression!r}")
    return value(ast.parse(expression, mode="eval").body)


def split_of(prompt: str) -> str:
    """"test" or "train", from a stable hash of the problem text: no seed can make the splits overlap."""
    return "test" if int(hashlib.sha256(prompt.encode()).hexdigest(), 16) % 100 < TEST_PERCENT else "train"


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
    a, b, c = rng.randint(1, m), rng.randint(1, m), rng.randint(1, m)
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
    """A one- or two-step story: groups (*), gains (+), losses (-), sharing (//), gains and losses."""
    name, he = rng.choice(_NAMES)
    item, box = rng.choice(_ITEMS), rng.choice(_CONTAINERS)
    a, b = rng.randint(2, m), rng.randint(2, m)
    template = rng.randrange(6)
    if template == 0:
        return (f"{name} has {a} {box} with {b} {item} in each. How many {item} does {he} have?", f"{a} * {b}")
    if template == 1:
        return (f"{name} has {a} {item} and gets {b} more. How many {item} does {he} have now?", f"{a} + {b}")
    if template == 2:
        a, b = max(a, b), min(a, b)
        return (f"{name} had {a} {item} and lost {b}. How many {item} are left?", f"{a} - {b}")
    if template == 3:
        d = _divisor(rng, m)
        return (f"{name} shares {a * d} {item} equally among {d} friends. How many {item} does each friend get?",
                f"{a * d} // {d}")
    if template == 4:
        b, c = rng.randint(1, a), rng.randint(2, m)
        return (f"{name} has {a} {item}, gives away {b} and then finds {c}. How many {item} does {he} have now?",
                f"{a} - {b} + {c}")
    c = rng.randint(1, min(a * b, 10 * m))
    return (f"A shop has {a} {box} of {b} {item} and sells {c} {item}. How many {item} are left?", f"{a} * {b} - {c}")


_GENERATORS = {"binary": _binary, "multi": _multi, "word": _word}


@register_env("toy_math")
class ToyMathEnv(Env):
    """Integer arithmetic and word problems; reward 1.0 for the exact number, else 0.0.

    The prompt of "binary" and "multi" problems is "What is <expression>?", where the expression is
    valid Python, so a tiny model can copy it into python_eval. Answers are integers.
    """
    tool_names = ("python_eval", "finish")

    def __init__(self, max_operand: int = 50, kinds: tuple[str, ...] = ("binary", "multi", "word"),
                 weights: tuple[float, ...] | None = None, tool_timeout: float = 2.0):
        unknown = [k for k in kinds if k not in _GENERATORS]
        if unknown or not kinds:
            raise ValueError(f"unknown kinds {unknown}; choose from {list(_GENERATORS)}")
        if weights is not None and (len(weights) != len(kinds) or min(weights) < 0 or sum(weights) <= 0):
            raise ValueError(f"weights {weights} must be one non-negative number per kind {kinds}")
        if max_operand < 2:
            raise ValueError("max_operand must be at least 2")
        self.max_operand = max_operand           # operands are drawn from 1..max_operand (// dividends excepted)
        self.kinds = tuple(kinds)                # which generators to draw from
        self.weights = tuple(weights) if weights is not None else (1.0,) * len(kinds)  # their relative odds
        self.tool_timeout = tool_timeout         # seconds per tool call

    def system_prompt(self) -> str:
        return "Solve the problem. Use python_eval to compute and finish to give the answer."

    def make_task(self, prompt: str, expression: str, kind: str) -> Task:
        digest = hashlib.sha256(prompt.encode()).hexdigest()
        return Task(env=self.name, id=f"{self.name}/{digest[:16]}", prompt=prompt,
                    answer=str(eval_arith(expression)), meta={"expression": expression, "kind": kind})

    def sample_tasks(self, split: str, n: int, seed: int) -> list[Task]:
        """n distinct tasks of `split`, the same for the same (seed, constructor arguments)."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', not {split!r}")
        rng = random.Random(seed)
        tasks, seen, misses = [], set(), 0
        while len(tasks) < n:
            kind = rng.choices(self.kinds, self.weights)[0]
            prompt, expression = _GENERATORS[kind](rng, self.max_operand)
            if split_of(prompt) != split or prompt in seen:
                misses += 1
                if misses > 1000 + 100 * n:
                    raise ValueError(f"found only {len(tasks)} distinct {split} tasks of {n}: raise max_operand")
                continue
            seen.add(prompt)
            tasks.append(self.make_task(prompt, expression, kind))
        return tasks

    def score(self, task: Task, answer: str | None) -> float:
        return 1.0 if answers_match(answer, task.answer) else 0.0

    def format_ok(self, answer: str) -> bool:
        return parse_number(answer) is not None

    def demonstration(self, task: Task, rng: random.Random, use_tools: bool) -> list[dict]:
        """The expert conversation. With tools: python_eval(canonical expression), its real output, then
        finish(answer). Without: finish(answer) at once (the habit RL should replace by tool use on hard
        problems). `rng` is unused: toy math has one expert path."""
        state, messages = self.reset(task, seed=0)
        if use_tools:
            call = ToolCall("python_eval", {"code": task.meta["expression"]})
            _, output, kind = self.run_tool(state, call)
            if kind is not None or output != task.answer:  # never train on a demonstration that is wrong
                raise RuntimeError(f"python_eval gave {output!r} for {task.id}, expected {task.answer!r}")
            messages += [assistant_message("", [call]), tool_message("python_eval", output)]
        messages.append(assistant_message("", [ToolCall("finish", {"answer": task.answer})]))
        return messages
