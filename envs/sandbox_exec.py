"""sandbox_exec.py: the python_exec sandbox: a whole model-written program in a fresh isolated
process per call, and what it promises.

python_exec (`run_python`, `execute_python`, `ExecLimits`, `check_program`) runs a whole program
(imports, classes, loops, files) as hostile input: a fresh `python -I -S` process per call (~50 ms),
with an empty environment, its own temporary directory, hard resource limits, as `nobody` when we
run as root, behind an AST check and an audit hook inside the child. Graders copy a program's
results into plain data before comparing them (`plain_copier`, `PLAIN_COPIER_SRC`). It returns short
text (results, or "Error: ..."); nothing raises into the agent loop. It is not a security boundary
against a determined attacker (see the comment block below, and docs/sandbox.md).

The calculator, python_eval, is sandbox.py; this file takes from it what the two share:
SAFE_BUILTINS, the bounded parser (_parse_source, sent to the child too) and the lock every parse in
the parent takes (_PARSE_LOCK, see parse_python).

POSIX only (process groups, resource limits). The child process runs functions of this file and
sandbox.py's _parse_source sent as source (inspect.getsource), so both files must be present as .py
at run time. The code world registers execute_python as the python_exec tool (env_code.python_exec).

Imports: sandbox.py (and the standard library).
"""

import ast
import inspect
import json
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from sandbox import _PARSE_LOCK, SAFE_BUILTINS, _parse_source


# -----------------------------------------------------------------------------
# 2. The python_exec sandbox: a whole program, in a fresh isolated process per call
#
# python_eval (sandbox.py) is a calculator in one long-lived worker: fast, and limited to
# expressions over math. python_exec runs a whole program (imports, classes, loops, files) and
# treats it as hostile. Each call gets a new interpreter that inherits nothing and leaves nothing
# behind. Layers, outermost first; the tests (tests/test_sandbox.py) check each threat against the
# whole stack and the process layer alone:
#   1. The process. `python -I -S` (no PYTHON* variables, no site-packages) with an empty
# environment,
#      in a fresh temporary directory deleted afterwards, in its own process group, which the parent
#      kills whole at the wall-clock deadline. Before it reads the program it sets hard limits (CPU
#      seconds, address space, file size, open files, zero new processes, no core file) and, when we
#      run as root, drops to nobody:nogroup: a limit on the number of processes does not bind root.
#      It drops after the interpreter has started (and not in Popen's preexec_fn, which may deadlock
#      in a threaded parent) but before a byte of the program is read: the same guarantee.
#   2. The interpreter. Only ALLOWED_MODULES can be imported. They are loaded before the drop, with
#      PRELOADED, what the interpreter loads lazily by itself (unicodedata: the parser needs it for
# a
#      name like `π`): once we are nobody, a Python installed in a private home (pyenv under /root)
# cannot
#      be read, and once the audit hook is on, nothing can be imported. The program gets a copy of
# each
#      module's public names without module objects (so no `fractions.sys`) and without getattr-by-
#      string helpers (operator.attrgetter, string.Formatter). Builtins are a short list: no exec,
#      compile, getattr, type, input, breakpoint; __import__ and eval are our own, and eval runs a
#      string under the program's own rules (the AST check, these builtins). Then an audit hook
#      (PEP 578, sys.addaudithook) refuses every runtime event but one exec (the program's), eval's
# own
#      compile and exec, id(), and open() of a relative path inside the working directory: any
# import,
#      os.*, socket.*, subprocess.*, ctypes, gi_frame / tb_frame / sys._getframe raise
# PermissionError.
#   3. The program text. An AST check refuses imports outside ALLOWED_MODULES, names starting with
#      "__" and attributes starting with "_" or naming frames and code (gi_frame, f_globals, ...),
# except
#      SAFE_DUNDERS (for super().__init__() and `if __name__ == "__main__":`), and nesting deeper
# than
#      MAX_NESTING, before a process is started (and once more inside it).
# Classes are allowed. A class statement needs __build_class__, which the program cannot name; a
# class may define __eq__ or __repr__, but it can no more reach __class__, __subclasses__ or
# __globals__ than any other code. One thing classes do make possible: an object equal to
# everything. A grader that compares a program's results must first copy them into plain data
# (`plain_copier`). Errors, refusals and timeouts come back as short "Error: ..." text, never as
# exceptions, and the child always replies: a failure of the sandbox's own code on a strange program
# (too deeply nested to compile, an exception whose __str__ raises) is reported as such, not as a
# dead child. What it does NOT promise: it is not a security boundary against a determined attacker.
# There is no seccomp filter, no network namespace, no chroot. An escape from layers 2-3 (a CPython
# bug, an audit-hook gap in some C code) leaves only layer 1: nobody's rights, which still include
# reading world-readable files and opening sockets. Put the trainer in a container or VM when
# that matters.

ALLOWED_MODULES = (
    "math",
    "cmath",
    "fractions",
    "decimal",
    "statistics",
    "itertools",
    "functools",
    "operator",
    "collections",
    "heapq",
    "bisect",
    "random",
    "re",
    "json",
    "typing",
    "string",
    "copy",
    "hashlib",
    "unicodedata",
)
# loaded lazily by the interpreter itself: the parser, for non-ASCII names
PRELOADED = ("unicodedata",)
_HIDDEN_MEMBERS = (
    # operator's getattr-by-string: a way around the AST check
    "attrgetter",
    "methodcaller",
    # string.Formatter().get_field("0.__class__", ...): the same
    "Formatter",
)
EXEC_BUILTINS = SAFE_BUILTINS + (
    "isinstance",
    "issubclass",
    "reversed",
    "map",
    "filter",
    "chr",
    "ord",
    "hex",
    "bin",
    "oct",
    "format",
    "repr",
    "iter",
    "next",
    "slice",
    "frozenset",
    "complex",
    "hash",
    "id",
    "callable",
    "open",
    "bytes",
    "bytearray",
    "ascii",
    "object",
    "super",
    "property",
    "staticmethod",
    "classmethod",
    "NotImplemented",
    "Ellipsis",
    "BaseException",
    "Exception",
    "ArithmeticError",
    "AssertionError",
    "AttributeError",
    "FileNotFoundError",
    "ImportError",
    "IndexError",
    "KeyError",
    "LookupError",
    "MemoryError",
    "NameError",
    "NotImplementedError",
    "OSError",
    "OverflowError",
    "PermissionError",
    "RecursionError",
    "RuntimeError",
    "StopIteration",
    "TypeError",
    "UnicodeError",
    "ValueError",
    "ZeroDivisionError",
)
# the dunder names a program may use: super().__init__(), __name__
SAFE_DUNDERS = ("__init__", "__name__")
# generator/coroutine/frame/traceback/code
_FRAME_ATTR_PREFIXES = ("gi_", "cr_", "ag_", "f_", "tb_", "co_")
# levels of the syntax tree; CPython's own bound on brackets is 200 too, and between 700 and 1000
# the child's compile() runs out of recursion (real code: HumanEval's deepest is 20)
MAX_NESTING = 200
MAX_OPENS = 64  # open() calls per program
NOBODY = 65534  # uid and gid of nobody / nogroup on Debian, Ubuntu, Alpine and RHEL


@dataclass(frozen=True)
class ExecLimits:
    """Resource limits of one python_exec run (the wall-clock timeout is an argument of
    execute_python)."""

    # RLIMIT_AS: address space; past it, allocations raise MemoryError
    memory_bytes: int = 512 << 20
    file_bytes: int = 1 << 20  # RLIMIT_FSIZE: largest file the program may write (in its directory)
    open_files: int = 16  # RLIMIT_NOFILE: file descriptors, stdin/stdout/stderr included
    max_chars: int = 2000  # printed output kept; the rest is cut, with a visible marker
    max_code_chars: int = 20000  # longer programs are refused before parsing


def check_program(code: str, max_code_chars: int = 20000) -> str | None:
    """Why python_exec refuses `code` (a syntax error or a policy violation), or None when it
    may run.

    Policy: imports only of ALLOWED_MODULES (no submodules, no relative imports, no private names);
    no name starting with "__" and no attribute starting with "_" or naming a frame, generator or
    code internal (SAFE_DUNDERS excepted); at most MAX_NESTING levels of syntax tree. Sent to the
    child too (EXEC_CHILD_SRC), which also runs it on every string given to eval(): only `ast` and
    constants.
    """
    tree, error = _parse_source(code, max_code_chars, "program")
    if error:
        return error
    # an explicit stack, not recursion: the tree may be as deep as the parser allows
    stack = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_NESTING:
            return f"the program is nested too deeply (more than {MAX_NESTING} levels)"
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name not in ALLOWED_MODULES:
                    return (
                        f"import {alias.name} is not allowed; allowed: {', '.join(ALLOWED_MODULES)}"
                    )
        if isinstance(node, ast.ImportFrom):
            if node.level or node.module not in ALLOWED_MODULES:
                return (
                    f"import from {node.module} is not allowed; "
                    f"allowed: {', '.join(ALLOWED_MODULES)}"
                )
            for alias in node.names:
                if alias.name.startswith("_"):
                    return f"importing the private name {alias.name} is not allowed"
        if isinstance(node, ast.Name) and node.id.startswith("__") and node.id not in SAFE_DUNDERS:
            return f"the name {node.id} is not allowed"
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith(("_",) + _FRAME_ATTR_PREFIXES)
            and node.attr not in SAFE_DUNDERS
        ):
            return f"attribute access .{node.attr} is not allowed"
    return None


def plain_copier(
    isinstance=isinstance,
    int=int,
    float=float,
    str=str,
    list=list,
    tuple=tuple,
    dict=dict,
    set=set,
    frozenset=frozenset,
    TypeError=TypeError,
):
    """-> plain(x): `x` copied into exact builtin values (None, bool, int, float, str, and lists,
    tuples, dicts, sets of them), or TypeError. For graders: with classes, a program can return an
    object whose __eq__ is always True, or an int subclass that equals anything; plain(result) ==
    expected cannot be fooled. Meant to run INSIDE the graded program, defined before the code under
    test (PLAIN_COPIER_SRC): the defaults hold the real builtins, and the closure holds plain,
    whatever that code rebinds later. The copy may call the object's own methods (__iter__, __int__
    ...), but what comes out is plain."""

    def plain(x, depth=0):
        if depth > 100:
            raise TypeError("the result is nested too deeply to compare")
        if x is None or x is True or x is False:
            return x
        if isinstance(x, str):
            return "".join([x])  # join copies a str subclass's characters into a new exact str
        if isinstance(x, int):
            return int(x)  # an exact int: the value itself, or what an override of __int__ returned
        if isinstance(x, float):
            return float(x)
        if isinstance(x, (list, tuple, set, frozenset)):
            items = [plain(v, depth + 1) for v in x]
            kind = (
                list
                if isinstance(x, list)
                else tuple
                if isinstance(x, tuple)
                else set
                if isinstance(x, set)
                else frozenset
            )
            return kind(items)
        if isinstance(x, dict):
            return {plain(k, depth + 1): plain(v, depth + 1) for k, v in x.items()}
        raise TypeError(
            "the result is not plain data (None, bool, int, float, str, or lists, tuples, dicts, "
            "sets of them)"
        )

    return plain


# a grader puts this first in the program it runs
PLAIN_COPIER_SRC = inspect.getsource(plain_copier)


def _exec_program(code: str, max_chars: int, max_code_chars: int) -> tuple[str, str | None]:
    """Child side: check `code`, build its namespace, install the audit hook, run -> (text,
    error kind).

    REPL-like: the text is what the program printed, then repr() of the last statement's value when
    it is an expression (and not None); an error is appended as "Error: Type: message". The audit
    hook stays installed for good: the caller must only write the reply and os._exit() afterwards.
    """
    # One function on purpose, the only one here over 80 lines: this is security code, and every
    # step of the child's setup (check, namespace, audit hook, run) must be read in order, in one
    # place, to audit it.
    import builtins
    import os
    import sys
    import types

    refusal = check_program(code, max_code_chars)
    if refusal is not None:
        return "Error: " + refusal, "refused"
    tree = ast.parse(code)
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        # keep the last value: `x = 1\nx + 1` shows 2
        # (copy_location, not fix_missing_locations, which recurses over the whole tree)
        last = tree.body[-1]
        target = ast.copy_location(ast.Name("__result__", ast.Store()), last)
        tree.body[-1] = ast.copy_location(ast.Assign([target], last.value), last)
    try:
        # before the hook: compiling raises an audit event. `return 5` at top level parses but
        # does not compile
        program = compile(tree, "<program>", "exec")
    except SyntaxError as e:
        return f"Error: SyntaxError: {e.msg} (line {e.lineno})", "error"
    except (RecursionError, MemoryError) as e:  # MAX_NESTING is meant to stop this first
        return f"Error: the program is nested too deeply to compile ({type(e).__name__})", "error"

    # name -> a new module holding only the public names of the real one (no modules in it)
    modules = {}
    for name in ALLOWED_MODULES:
        modules[name] = types.ModuleType(name)
        modules[name].__dict__.update(
            {
                k: v
                for k, v in vars(sys.modules[name]).items()
                if not k.startswith("_")
                and not isinstance(v, types.ModuleType)
                and k not in _HIDDEN_MEMBERS
            }
        )
    # the runtime events the hook lets through, and how often
    permits = {"program": 1, "eval": 0, "compile": 0}

    def import_allowed(name, globals=None, locals=None, fromlist=(), level=0):
        if level or name not in modules:
            raise ImportError(f"import of {name!r} is not allowed")
        return modules[name]

    def checked_eval(source, globals=None, locals=None):
        """The program's eval(): a string, held to the program's own rules (check_program, these
        builtins). globals default to the program's; the caller's local variables are not seen (pass
        them in a dict)."""
        if type(source) is not str:
            raise TypeError("eval() in the sandbox takes a string")
        globals = namespace if globals is None else globals
        if type(globals) is not dict:
            raise TypeError("eval() globals must be a dict")
        source = source.lstrip(" \t")  # as eval() does
        # no code of the program runs until it is 0 again: only ours, on a str
        permits["compile"] = 1
        try:
            refusal = check_program(source, max_code_chars)
            expression = None if refusal else compile(source, "<eval>", "eval")
        finally:
            permits["compile"] = 0
        if refusal is not None:
            raise PermissionError(f"eval() refused: {refusal}")
        # never the real builtins, which eval() would add to a bare dict
        globals["__builtins__"] = safe
        permits["eval"] = 1  # spent by eval()'s own audit event, before the expression runs
        try:
            return eval(expression, globals, locals)
        finally:
            permits["eval"] = 0

    safe = {n: getattr(builtins, n) for n in EXEC_BUILTINS}
    safe.update(
        {
            "__import__": import_allowed,
            "__build_class__": builtins.__build_class__,
            "eval": checked_eval,
        }
    )
    namespace = {"__builtins__": safe, "__name__": "__main__"}

    class Printed:
        """sys.stdout for the program: keeps the first max_chars characters, counts the rest."""

        def __init__(self):
            self.parts, self.kept, self.total = [], 0, 0

        def write(self, s):
            if not isinstance(s, str):
                raise TypeError("write() argument must be str")
            self.total += len(s)
            if self.kept < max_chars:
                self.parts.append(s[: max_chars - self.kept])
                self.kept += len(self.parts[-1])
            return len(s)

        def flush(self):
            pass

    def inside_workdir(path) -> bool:
        if not isinstance(path, str) or "\0" in path:
            # an int is an inherited fd (stdout...), refuse it
            return False
        # pure string work: symlinks cannot be made (os is unreachable)
        path = os.path.normpath(path)
        return not os.path.isabs(path) and path != ".." and not path.startswith("../")

    seen = {"open": 0}

    def audit(event, args):
        if event == "exec":
            for key in ("program", "eval"):
                # our own exec(program) below, once; then one per checked_eval
                if permits[key]:
                    permits[key] -= 1
                    return
        if event == "compile" and permits["compile"]:
            return
        if event == "builtins.id":
            # id() (copy.deepcopy's memo uses it) tells an address, nothing more
            return
        if event == "open":
            if inside_workdir(args[0]) and seen["open"] < MAX_OPENS:
                # a budget, so that 2 s of open() cannot fill the disk with 1 MiB files
                seen["open"] += 1
                return
            raise PermissionError(
                f"open({str(args[0])[:60]!r}) is not allowed in the sandbox: only relative "
                f"paths inside the working directory, {MAX_OPENS} opens at most"
            )
        if event == "import" and args and isinstance(args[0], str):
            # a module loaded lazily, e.g. a codec
            raise PermissionError(
                f"import {args[0][:60]} is not allowed in the sandbox (only "
                f"{', '.join(ALLOWED_MODULES)}, loaded in advance)"
            )
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
    except BaseException as e:
        # MemoryError, RecursionError, SystemExit, PermissionError from the hook ...
        kind, error = "error", "Error: " + _describe(e)
    text = "".join(printed.parts).rstrip("\n")
    if printed.total > max_chars:
        text += f"... [truncated, {printed.total} chars in all]"
    text = "\n".join(t for t in (text, error[:max_chars]) if t)
    return text or "(no output)", kind


def _describe(e: BaseException) -> str:
    """'Type: message' of an exception the program raised; its class may be the program's own, whose
    name or __str__ may raise or return anything, so every step is guarded."""
    try:
        name = type(e).__name__
        name = name if type(name) is str else "an exception"
    except BaseException:
        name = "an exception"
    try:
        message = str(e)
        message = message if type(message) is str else ""
    except BaseException:
        message = ""
    return name + (f": {message}" if message else "")


def _exec_child_main(limits: dict, policy: bool = True) -> None:
    """Child side, the whole life of a python_exec process: limits, imports, drop root, run, reply,
    exit.

    `limits`: {"cpu_seconds", "memory_bytes", "file_bytes", "open_files", "max_chars",
    "max_code_chars"}. `policy` False skips layers 2-3 (the AST check, the namespace, the audit
    hook): only tests use it, to show what the process layer holds by itself. Replies one JSON line
    {"text", "kind"} on stdout, always: a failure of this code itself is a reply too ("Error: the
    sandbox failed: ...").
    """
    import json
    import os
    import resource
    import signal

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
    # a too-large write raises OSError instead of killing us
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    for name in ALLOWED_MODULES + PRELOADED:
        # import now: after the drop below, our Python may be unreadable
        __import__(name)
    with open("program.py", "rb") as f:  # written by the parent; read as data, not run yet
        code = f.read().decode("utf-8", "surrogatepass")
    os.remove("program.py")
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(NOBODY)
        # as root this sets the real, effective and saved uid: there is no way back
        os.setuid(NOBODY)
        if 0 in (os.getuid(), os.geteuid(), os.getgid(), os.getegid()):
            os._exit(3)
    try:
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
            text = (out.getvalue() + error)[: limits["max_chars"]].rstrip("\n") or "(no output)"
    except BaseException as e:  # a bug of ours, or a limit hit inside our own code: still an answer
        text, kind = f"Error: the sandbox failed: {_describe(e)}"[: limits["max_chars"]], "error"
    os.write(1, (json.dumps({"text": text, "kind": kind}) + "\n").encode())
    # no interpreter shutdown: no finalizer of the program's objects runs after the reply
    os._exit(0)


# The child program: the functions above, sent as source, so it is the same code the tests read.
EXEC_CHILD_SRC = "\n".join(
    [
        "import ast",
        f"ALLOWED_MODULES = {ALLOWED_MODULES!r}",
        f"PRELOADED = {PRELOADED!r}",
        f"_HIDDEN_MEMBERS = {_HIDDEN_MEMBERS!r}",
        f"EXEC_BUILTINS = {EXEC_BUILTINS!r}",
        f"SAFE_DUNDERS = {SAFE_DUNDERS!r}",
        f"_FRAME_ATTR_PREFIXES = {_FRAME_ATTR_PREFIXES!r}",
        f"MAX_NESTING = {MAX_NESTING!r}",
        f"MAX_OPENS = {MAX_OPENS!r}",
        f"NOBODY = {NOBODY!r}",
        inspect.getsource(_parse_source),
        inspect.getsource(check_program),
        inspect.getsource(_exec_program),
        inspect.getsource(_describe),
        inspect.getsource(_exec_child_main),
    ]
)


def execute_python(
    code: str, timeout_s: float = 2.0, limits: ExecLimits = ExecLimits(), _policy: bool = True
) -> tuple[str, str | None]:
    """Run a program in a fresh sandboxed process -> (text, error kind): kind is None, "refused",
    "error" or "timeout". Thread-safe (nothing is shared between calls) and never raises for a
    bad program.

    `_policy=False` turns off layers 2-3 (tests only: it shows what the process layer holds alone).
    """
    if _policy:
        with _PARSE_LOCK:
            # this parse is in the parent, where threads run graders side by side (parse_python)
            refusal = check_program(code, limits.max_code_chars)  # refuse early, without a process
        if refusal is not None:
            return "Error: " + refusal, "refused"
    child_limits = {
        "cpu_seconds": math.ceil(timeout_s) + 1,
        "memory_bytes": limits.memory_bytes,
        "file_bytes": limits.file_bytes,
        "open_files": limits.open_files,
        "max_chars": limits.max_chars,
        "max_code_chars": limits.max_code_chars,
    }
    src = EXEC_CHILD_SRC + f"\n_exec_child_main({child_limits!r}, policy={_policy!r})\n"
    workdir = tempfile.mkdtemp(prefix="nano-skyrl-py-")
    proc = None
    try:
        with open(os.path.join(workdir, "program.py"), "wb") as f:
            f.write(code.encode("utf-8", "surrogatepass"))
        if os.geteuid() == 0:
            # the child drops to nobody and must write its directory
            os.chown(workdir, NOBODY, NOBODY)
        deadline = time.monotonic() + timeout_s
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", src],
            cwd=workdir,
            env={},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
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
                # the whole group; pgid == pid (start_new_session)
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            # until this wait the pid stays a zombie, so the killpg above hits no one else
            proc.wait()
            proc.stdout.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _read_capped(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, bool]:
    """Read proc's stdout until it closes -> (at most `cap` bytes, whether the deadline
    passed first)."""
    fd, chunks, size = proc.stdout.fileno(), [], 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return b"".join(chunks), True
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks), False
        if size < cap:
            chunks.append(chunk[: cap - size])
            size += len(chunks[-1])


def run_python(code: str, timeout_s: float = 2.0) -> str:
    """Run a program in the python_exec sandbox and return the text it produced (see
    execute_python)."""
    return execute_python(code, timeout_s)[0]
