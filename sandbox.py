"""sandbox.py: the python_eval sandbox (a calculator for snippets), what it promises, and what both
sandboxes share.

Model-written code is hostile input. Two sandboxes, for two jobs:
  1. python_eval (`check_code`, `PythonSandbox`, the shared `SANDBOX`), this file: a calculator.
     A static AST check (no imports, attributes only as math.<name>, calls only to safe builtins)
     and ONE persistent, resource-limited worker process, so RL can afford ~100 snippets per step
     (~0.5 ms each).
  2. python_exec (`run_python`, `execute_python`, `ExecLimits`, `check_program`), sandbox_exec.py:
     a whole program in a fresh `python -I -S` process per call (~50 ms), with an empty
     environment, its own temporary directory, hard resource limits, as `nobody` when we run as
     root, behind an AST check and an audit hook inside the child.
Both return short text (results, or "Error: ..."); nothing raises into the agent loop. Neither is a
security boundary against a determined attacker (see each file's section comment, and
docs/sandbox.md). Shared with sandbox_exec.py: SAFE_BUILTINS, parse_python and its lock
(_PARSE_LOCK), _parse_source.

POSIX only (process groups, resource limits). The worker runs functions of this file sent as source
(inspect.getsource), so this file must be present as .py at run time; tools.py registers
python_eval.

Imports: none of our files (the standard library).
"""

import ast
import atexit
import inspect
import json
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
import warnings


# -----------------------------------------------------------------------------
# 1. The python_eval sandbox
#
# What it promises:
#   - A snippet cannot import, touch any attribute except math.<public name> (this is what closes
#     the classic escapes: ().__class__.__base__.__subclasses__(), "{0.__class__}".format(x),
#     gen.gi_frame), name anything starting with "__", or call anything but SAFE_BUILTINS, math
#     functions and functions it defines itself. This is checked statically twice: here, before
#     sending, and again inside the worker, so the worker stays safe even when someone talks to it
#     directly.
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

SAFE_BUILTINS = (
    "abs",
    "min",
    "max",
    "sum",
    "round",
    "int",
    "float",
    "str",
    "len",
    "range",
    "pow",
    "divmod",
    "sorted",
    "list",
    "tuple",
    "set",
    "dict",
    "bool",
    "enumerate",
    "zip",
    "any",
    "all",
    "print",
)
# longer snippets are refused before parsing (the parser is the first thing exposed)
MAX_CODE_CHARS = 4000


_PARSE_LOCK = threading.Lock()


def parse_python(source: str, mode: str = "exec") -> ast.AST:
    """ast.parse, one thread at a time. CPython 3.11 counts the AST constructor's recursion depth in
    state shared by the whole interpreter, so two threads parsing at once (graders in a thread pool)
    can fail with "SystemError: AST constructor recursion depth mismatch" (CPython gh-106905; seen
    in CI). Every parse in this process takes the lock; the single-threaded children call ast.parse
    (they get their source alone)."""
    # model-written code's SyntaxWarnings ("invalid decimal literal") are its own business, not the
    # run's output; the lock keeps the filter's change to this parse
    with _PARSE_LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ast.parse(source, mode=mode)


def _parse_source(code: str, max_chars: int, what: str):
    """-> (ast tree, None), or (None, why it cannot be parsed). The parser is the first thing
    model-written code reaches, so length is bounded before it. Both checks use it, and both
    children get its source."""
    import warnings

    if len(code) > max_chars:
        return None, f"{what} longer than {max_chars} characters"
    try:
        with warnings.catch_warnings():
            # a model's SyntaxWarnings stay in the sandbox, not in the run's output
            warnings.simplefilter("ignore")
            return ast.parse(code), None
    except SyntaxError as e:
        return None, f"SyntaxError: {e.msg} (line {e.lineno})"
    except ValueError as e:  # null bytes
        return None, f"cannot parse: {e}"
    except (RecursionError, MemoryError) as e:
        # the parser's own depth limits, past thousands of levels
        return None, f"cannot parse: the {what} is nested too deeply ({type(e).__name__})"


def check_code(code: str) -> str | None:
    """Why `code` may not run (a syntax error or a policy violation), or None when it may.

    Policy: no import; attribute access only as math.<public name>; calls only to SAFE_BUILTINS,
    math functions and functions defined in the snippet; no name starting with "__".
    This function is also sent to the worker (WORKER_SRC), so it uses only `ast`, `math` and the
    constants.
    """
    tree, error = _parse_source(code, MAX_CODE_CHARS, "code")
    if error:
        return error
    math_names = {n for n in dir(math) if not n.startswith("_")}
    defined = {
        n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            return "import is not allowed (math is already imported)"
        if isinstance(node, ast.Name) and node.id.startswith("__"):
            return f"the name {node.id} is not allowed"
        if isinstance(node, ast.Attribute) and not (
            isinstance(node.value, ast.Name) and node.value.id == "math" and node.attr in math_names
        ):
            return f"attribute access .{node.attr} is not allowed (only math.<function>)"
        # a call of math.f was checked above, as an attribute
        if isinstance(node, ast.Call) and not isinstance(node.func, ast.Attribute):
            if not (
                isinstance(node.func, ast.Name)
                and (node.func.id in SAFE_BUILTINS or node.func.id in defined)
            ):
                what = node.func.id if isinstance(node.func, ast.Name) else "this expression"
                return f"calling {what} is not allowed"
    return None


def _run_snippet(code: str, max_chars: int) -> tuple[str, str | None]:
    """Worker side: check and run one snippet in a fresh namespace -> (text, error kind or None).

    REPL-like: the text is the printed output followed by repr() of the last statement's value when
    the last statement is an expression (and not None); "(no output)" when both are empty.
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
            value = (
                eval(compile(ast.Expression(last.value), "<python_eval>", "eval"), namespace)
                if last
                else None
            )
        text = printed.getvalue() + (repr(value) if value is not None else "")
        text = text.rstrip("\n") or "(no output)"
        kind = None
    except Exception as e:  # MemoryError and RecursionError included
        text = f"Error: {type(e).__name__}" + (f": {e}" if str(e) else "")
        kind = "error"
    if len(text) > max_chars:
        text = text[:max_chars] + f"... [truncated, {len(text)} chars in all]"
    return text, kind


def _worker_main(memory_bytes: int, max_chars: int) -> None:
    """Worker side: apply resource limits, then answer one JSON line per request line until stdin
    closes.

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
    # replies go here; the snippets' print() goes to a buffer (redirect_stdout)
    channel = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        # RLIMIT_CPU counts the worker's whole life, so before each snippet the soft limit moves
        # to "used so far + budget": SIGXCPU kills us past it even if the parent cannot enforce its
        # timeout.
        used = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
        soft = int(used + request["cpu_seconds"]) + 1
        if cpu_hard != resource.RLIM_INFINITY:
            soft = min(soft, cpu_hard)
        resource.setrlimit(resource.RLIMIT_CPU, (soft, cpu_hard))
        text, kind = _run_snippet(request["code"], max_chars)
        channel.write(json.dumps({"text": text, "kind": kind}) + "\n")
        channel.flush()


# The worker program: the functions above, sent as source, so it is the same code the tests read.
WORKER_SRC = "\n".join(
    [
        "import ast, math",
        f"SAFE_BUILTINS = {SAFE_BUILTINS!r}",
        f"MAX_CODE_CHARS = {MAX_CODE_CHARS!r}",
        inspect.getsource(_parse_source),
        inspect.getsource(check_code),
        inspect.getsource(_run_snippet),
        inspect.getsource(_worker_main),
    ]
)


class PythonSandbox:
    """One persistent worker process (`python -I -S -c WORKER_SRC`) that runs snippets, one at a
    time.

    `run` is thread-safe (a lock around each request/reply) and never raises for a bad snippet.
    """

    def __init__(self, timeout: float = 2.0, memory_bytes: int = 1 << 30, max_chars: int = 500):
        self.timeout = timeout  # wall-clock seconds per snippet
        self.memory_bytes = memory_bytes  # RLIMIT_AS of the worker
        self.max_chars = max_chars  # result text is cut here, with a visible marker
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._owner_pid = os.getpid()  # after a fork the child must not reuse our worker's pipes
        self._pending = b""  # bytes read past the last reply line
        atexit.register(self.close)

    def run(self, code: str, timeout: float | None = None) -> tuple[str, str | None]:
        """Run `code` -> (text, error kind): kind is None, "refused", "error" or "timeout"."""
        timeout = self.timeout if timeout is None else timeout
        # refuse early, without a round trip (the worker checks again); the lock because this
        # parse is in the parent, where threads run tools side by side (parse_python)
        with _PARSE_LOCK:
            refusal = check_code(code)
        if refusal is not None:
            return "Error: " + refusal, "refused"
        with self._lock:
            try:
                proc = self._ensure_worker()
                proc.stdin.write(
                    (json.dumps({"code": code, "cpu_seconds": timeout + 1.0}) + "\n").encode()
                )
                proc.stdin.flush()
                reply = json.loads(self._read_line(time.monotonic() + timeout))
                return reply["text"], reply["kind"]
            except TimeoutError:  # before OSError: TimeoutError is an OSError
                self._kill()
                return f"Error: timed out after {timeout:g} s", "timeout"
            except (OSError, EOFError, ValueError):
                # the worker died (memory/CPU limit) or spoke garbage
                self._kill()
                return "Error: the Python worker crashed (memory or CPU limit?)", "error"

    def close(self) -> None:
        """Kill the worker (registered with atexit; the next `run` would start a new one)."""
        with self._lock:
            self._kill()

    def _ensure_worker(self) -> subprocess.Popen:
        if self._owner_pid != os.getpid():
            # we are a forked copy: forget the parent's worker, don't kill it
            self._proc = None
            self._pending = b""
            self._owner_pid = os.getpid()
        if self._proc is None or self._proc.poll() is not None:
            self._kill()
            src = WORKER_SRC + f"\n_worker_main({self.memory_bytes}, {self.max_chars})\n"
            # -I: ignore PYTHON* env vars and the user's site dir; -S: skip site. start_new_session:
            # own process group, so we can kill everything it is running and Ctrl-C in a terminal
            # does not reach it.
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", src],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
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
        proc = self._proc
        self._proc = None
        self._pending = b""
        if proc is None or self._owner_pid != os.getpid():
            # a forked copy never kills its parent's worker
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # pgid == pid (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()


SANDBOX = PythonSandbox()  # the shared worker behind the python_eval tool, started on first use
