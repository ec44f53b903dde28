"""The shape, as tests (docs/layout.md): where each file lives, which file may import which, the
size budgets, and each file's `Imports:` line. Read with ast from the source, except
test_a_plain_run_imports_neither_ray_nor_vllm, which imports the entry points in a fresh interpreter
to see what they pull in.

The root holds the core, the reference path the main command runs; wings/ holds the optional
features and envs/ the worlds beyond toy_math. The core never imports a wing or a world (it reaches
one by name, through a registry, when the config turns it on: env.ENTRY_POINTS, chat.WING_FORMATS,
rollout.ENGINES and TORCH_ENGINE_PIECES, rollout.wing, config.WING_CHECKS), imports between core
files point one way (down the order below), and config.py imports only the files whose dataclasses
it assembles and the catalogues it checks names against. Every import statement counts, at the top
of a file or inside a function.
"""

import ast
import glob
import io
import keyword
import os
import re
import subprocess
import sys
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the core, bottom to top: a core file imports only core files listed before it
CORE = [
    "model",
    "algos",
    "plot",
    "distributed",
    "sandbox",
    "tools",
    "env",
    "tool_calls",
    "chat",
    "agent",
    "batch",
    "rollout",
    "microbatch",
    "learner",
    "config",
    "runs",
    "eval",
    "sft",
    "train",
]
WINGS = [
    "wings/" + n
    for n in (
        "engine_vllm",
        "engine_openai",
        "prefix_cache",
        "async_rollouts",
        "lora",
        "qlora",
        "cluster",
        "chat_llama3",
        "serve",
        "judge",
        "external_agent",
        "memory",
        "fast_decode",
        "long_context",
    )
]
# serve's
WINGS += [
    "wings/" + n
    for n in (
        "serve_http",
        "serve_openai",
        "serve_anthropic",
        "serve_responses",
        "capture",
        "batcher",
    )
]
# what only the worlds share: expert replay and JSON-lines files; the python_exec sandbox of the
# code worlds
WORLD_LIBS = ["envs/worlds", "envs/sandbox_exec"]
WORLDS = [
    "envs/" + n
    for n in (
        "env_math",
        "env_search",
        "env_code",
        "env_humaneval",
        "env_webshop",
        "env_alfworld",
        "env_tau",
        "env_textworld",
        "env_bfcl",
        "env_vault",
    )
]
# the user's agent talks to serve.Server's HTTP API,
WING_IMPORTS = {
    "wings/external_agent": {
        "wings/serve",
        "wings/capture",  # its session becomes the trajectories,
        # and RunServer refuses with its RequestError
        "wings/serve_http",
    },
    # the server's parts, each a file of its own (the transport, the three dialects, the records,
    # the engine thread), imported one way: by serve.py; of them only the dialects import one
    # (RequestError)
    "wings/serve": {
        "wings/serve_http",
        "wings/serve_openai",
        "wings/serve_anthropic",
        "wings/serve_responses",
        "wings/capture",
        "wings/batcher",
    },
    "wings/serve_openai": {"wings/serve_http"},
    "wings/serve_anthropic": {"wings/serve_http"},
    "wings/serve_responses": {"wings/serve_http"},
    # QLoRA is LoRA on an NF4 base: its layers are LoRALinear
    "wings/qlora": {"wings/lora"},
    # a push into `vllm serve` follows vLLM's rules for what a push holds (folder_push,
    # with_tied_head)
    "wings/engine_openai": {"wings/engine_vllm"},
}
# HumanEval grades with the code world's run_grading
WORLD_IMPORTS = {"envs/env_humaneval": {"envs/env_code"}}
# the dataclasses config.Config assembles (AgentConfig, LearnerConfig)
CONFIG_IMPORTS = {
    "agent",
    "learner",
    # the catalogues it checks names against (algos' kinds, CHAT_FORMATS)
    "algos",
    "chat",
}

# budgets, in code tokens (docs/layout.md says why): what Python's tokenize yields, less comments,
# docstrings and layout (code_token_rows), so a denser line never pays and an explanation never
# costs. Each was set at its value when the line budgets it replaced were retired (commit 2ae1af6),
# and moves only with code that moved: code may not grow past them; lines may.
CORE_FILE_TOKENS = 4362  # learner.py's then, the largest core file under the common budget
FILE_TOKENS = {
    # the catalogue of every loss and advantage, read top to bottom; + 62: algos.at_last, the
    # reward placement that train.compute_advantages and turn_credit each wrote out
    "algos": 4385 + 62,
    # + 18: rollout.prefill_chunk_tokens and its check (long contexts); + 2: the memory wing's
    # check sees rollout.agent.summary_gradient (refused under memory=full)
    "config": 2901 + 20,
    "train": 3563 - 62,
}
CORE_TOTAL_TOKENS = 48899  # the whole core: it may not grow
# sft.build_default_model's then, the largest function under the common budget
FUNCTION_TOKENS = 882
FUNCTION_EXCEPTIONS = {
    # the python_exec child's setup is security code: every step of it (check, namespace, audit
    # hook, run) is read in order, in one place, to audit it (its own comment says so)
    ("envs/sandbox_exec", "_exec_program"),
}
# the loop, read as its numbered steps; + 48: the sampling SyncSchedule.take did, now in main
FUNCTION_BUDGETS = {("train", "main"): 983 + 48}
# the reference engine, read in one sitting; + 108: long contexts (prefill, which hands a prompt
# longer than a chunk to wings/long_context.py, its chunk size, the KV cache's reserve, the decode
# step without a mask), while the vLLM push helpers left rollout.py for wings/engine_vllm.py
CLASS_BUDGETS = {("rollout", "TorchEngine"): 1492 + 108}
README_LINES = 320


def files(group=None) -> list[str]:
    """Every Python file of ours, as a path without .py relative to the root (the core's: its module
    name)."""
    root = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "*.py")))
    folders = sorted(
        p[len(ROOT) + 1 : -3]
        for d in ("wings", "envs")
        for p in glob.glob(os.path.join(ROOT, d, "*.py"))
        if not p.endswith("__init__.py")
    )
    return {"root": root, "folders": folders}.get(group, root + folders)


def source(name: str) -> str:
    with open(os.path.join(ROOT, name + ".py")) as f:
        return f.read()


def local_imports(name: str) -> set[str]:
    """Our files that `name` imports, anywhere in the file, as paths without .py ("rollout",
    "wings/lora")."""
    found = set()
    for node in ast.walk(ast.parse(source(name))):
        if isinstance(node, ast.Import):
            found |= {a.name.replace(".", "/") for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            module = node.module.replace(".", "/")
            found |= {f"{module}/{a.name}" for a in node.names} | {module}
    return {m for m in found if os.path.isfile(os.path.join(ROOT, m + ".py")) and m != name}


def test_the_root_is_the_core_and_two_folders_hold_the_rest():
    assert files("root") == sorted(CORE), "place a new file in the layout (and docs/layout.md)"
    assert files("folders") == sorted(WINGS + WORLD_LIBS + WORLDS), "place a new file in the layout"


@pytest.mark.parametrize("name", CORE)
def test_the_core_imports_down_and_never_a_wing(name):
    below = set(CORE[: CORE.index(name)])
    imports = local_imports(name)
    assert not {m for m in imports if "/" in m}, (
        f"{name}.py imports a wing or a world: reach it by name"
    )
    assert imports <= below, (
        f"{name}.py imports {sorted(imports - below)}, which are not below it in the core"
    )


def test_config_imports_only_what_it_assembles():
    assert local_imports("config") <= CONFIG_IMPORTS


@pytest.mark.parametrize("name", WINGS + WORLD_LIBS + WORLDS)
def test_a_wing_imports_the_core_and_no_other_wing(name):
    imports = local_imports(name)
    allowed = (
        set(CORE) - {"config", "train"}
        | WING_IMPORTS.get(name, set())
        | WORLD_IMPORTS.get(name, set())
    )
    if name in WORLDS:  # a world may use what the worlds share
        allowed |= set(WORLD_LIBS)
    if name == "envs/sandbox_exec":
        allowed = {"sandbox"}
    assert imports <= allowed, f"{name}.py imports {sorted(imports - allowed)}"


def test_a_plain_run_imports_neither_ray_nor_vllm():
    """What train.py imports when it starts (every file of ours on its import path, at module level)
    never imports ray or vllm: a run that does not ask for Ray or vLLM works without them."""
    code = "import sys, train, eval, sft; print(sorted({'ray', 'vllm'} & set(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_registries_name_files_that_exist():
    """What the core reaches by name is there: a renamed wing breaks this test, not a user's run."""

    def literal(module, name):
        for node in ast.parse(source(module)).body:
            targets = [
                t.id
                for t in getattr(node, "targets", [getattr(node, "target", None)])
                if hasattr(t, "id")
            ]
            if name in targets:
                return ast.literal_eval(node.value)
        raise AssertionError(f"{module}.py defines no {name}")

    entries = [
        *literal("rollout", "ENGINES").values(),
        *literal("rollout", "TORCH_ENGINE_PIECES").values(),
        *(f"{m}.check_config" for m in literal("config", "WING_CHECKS")),
    ]
    for name in CORE:  # wing("wings.module.name") calls, as train.py makes them
        for node in ast.walk(ast.parse(source(name))):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "wing"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                entries.append(node.args[0].value)
    # 2 engines, 2 engine pieces, schedule, LoRA, QLoRA, judge, agent, Ray (x2), checks
    assert len(entries) >= 14
    for entry in entries:
        module, attr = entry.rsplit(".", 1)
        path = module.replace(".", "/")
        assert path in WINGS, entry
        defined = {
            n.name
            for n in ast.walk(ast.parse(source(path)))
            if isinstance(n, (ast.ClassDef, ast.FunctionDef))
        }
        assert attr in defined, f"{entry}: {path}.py defines no {attr}"
    worlds = {m.replace(".", "/") for m in literal("env", "ENTRY_POINTS").values()}
    assert worlds <= set(WORLDS) and len(worlds) == 10
    assert {m.replace(".", "/") for m in literal("chat", "WING_FORMATS").values()} <= set(WINGS)


def test_the_package_ships_every_file():
    """pyproject.toml's py-modules and packages (what `pip install .` installs) name every file, so
    a new core file is not left out of an installed copy."""
    text = open(os.path.join(ROOT, "pyproject.toml")).read()

    def listed(key):
        return ast.literal_eval(
            text[text.index(key + " = ") + len(key + " = ") :].split("]")[0] + "]"
        )

    assert sorted(listed("py-modules")) == files("root")
    assert listed("packages") == ["wings", "envs"]


# -----------------------------------------------------------------------------
# budgets


def docstring_starts(tree: ast.AST) -> set[tuple[int, int]]:
    """Where each docstring of a module, class or function begins: (line, column)."""
    starts = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                starts.add((first.lineno, first.col_offset))
    return starts


LAYOUT_TOKENS = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENDMARKER,
}


def code_token_rows(text: str) -> list[int]:
    """The line of every code token of `text`: tokenize's tokens less comments, docstrings and
    layout. Layout is newlines and indentation, and what a formatter adds or removes as it lays a
    statement out over lines: a trailing comma before a closing bracket, grouping parentheses
    (those that do not call or define: `x = (a + b)`, `return (a, b)`), and the joins of a string
    split over lines (`"a" "b"` is one string). Python 3.11's tokenize, which yields an f-string
    as one token (3.12 splits it: the budgets would need counting again)."""
    docs = docstring_starts(ast.parse(text))
    tokens = [
        tok
        for tok in tokenize.generate_tokens(io.StringIO(text).readline)
        if tok.type not in LAYOUT_TOKENS and not (tok.type == tokenize.STRING and tok.start in docs)
    ]
    rows = []
    calls = []  # for each open parenthesis: does it call (or define)?
    for i, tok in enumerate(tokens):
        after = tokens[i + 1].string if i + 1 < len(tokens) else ""
        if tok.string == "," and after in (")", "]", "}"):
            continue
        if tok.type == tokenize.STRING and i and tokens[i - 1].type == tokenize.STRING:
            continue  # a string split over lines ("a" "b") is one string
        if tok.type == tokenize.OP and tok.string == "(":
            before = tokens[i - 1] if i else None
            calls.append(
                before is not None
                and (
                    (before.type == tokenize.NAME and not keyword.iskeyword(before.string))
                    or before.string in (")", "]")
                    or before.type == tokenize.STRING
                )
            )
            if not calls[-1]:
                continue
        if tok.type == tokenize.OP and tok.string == ")" and not calls.pop():
            continue
        rows.append(tok.start[0])
    return rows


def code_tokens(name: str, first: int = 1, last: int = 10**9) -> int:
    """Code tokens of `name` (between lines `first` and `last`)."""
    return sum(first <= row <= last for row in code_token_rows(source(name)))


def test_code_tokens_count_code_only():
    text = '''"""A module docstring: not counted."""


def f(x):  # a comment: not counted
    """Nor this one."""
    return (x +
            1)
'''
    # def f ( x ) :   return x + 1   (the grouping parentheses are layout)
    assert len(code_token_rows(text)) == 10
    assert len(code_token_rows("a = 1\n")) == len(code_token_rows("a  =  1  # the same\n")) == 3
    # what a formatter changes is not code: a trailing comma, a statement's parentheses
    assert len(code_token_rows("f(a, b)\n")) == len(code_token_rows("f(\n    a,\n    b,\n)\n"))
    assert len(code_token_rows("x = a or b\n")) == len(code_token_rows("x = (\n    a or b\n)\n"))
    assert len(code_token_rows('s = "ab"\n')) == len(
        code_token_rows('s = (\n    "a"\n    "b"\n)\n')
    )


@pytest.mark.parametrize("name", CORE)
def test_core_files_keep_their_budget(name):
    budget = FILE_TOKENS.get(name, CORE_FILE_TOKENS)
    n = code_tokens(name)
    assert n <= budget, (
        f"{name}.py is {n} code tokens (budget {budget}): remove code, or move a wing out"
    )


def test_the_core_does_not_grow():
    n = sum(code_tokens(name) for name in CORE)
    assert n <= CORE_TOTAL_TOKENS, f"the core is {n} code tokens (budget {CORE_TOTAL_TOKENS})"


def defs(name: str):
    """(qualified name, kind, code tokens) of every function and class in `name`, nested ones
    included."""
    out = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qual = prefix + child.name
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                out.append((qual, kind, code_tokens(name, child.lineno, child.end_lineno)))
                visit(child, qual + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source(name)), "")
    return out


@pytest.mark.parametrize("name", files())
def test_no_function_over_its_budget(name):
    for qual, kind, n in defs(name):
        short = qual.rsplit(".", 1)[-1]
        if kind == "function" and (name, short) not in FUNCTION_EXCEPTIONS:
            budget = FUNCTION_BUDGETS.get((name, short), FUNCTION_TOKENS)
            assert n <= budget, f"{name}.py: {qual} is {n} code tokens (budget {budget})"
        if kind == "class" and (name, short) in CLASS_BUDGETS:
            assert n <= CLASS_BUDGETS[name, short], f"{name}.py: {qual} is {n} code tokens"


def test_the_layout_page_states_the_budgets_the_tests_hold():
    """docs/layout.md's table of budgets gives the numbers above (as the sums they are written
    as: a value at 2ae1af6, plus or minus the code that moved)."""
    with open(os.path.join(ROOT, "docs", "layout.md")) as f:
        rows = dict(re.findall(r"^\| (.+?) \| ([\d,]+(?: [-+] [\d,]+)?)", f.read(), re.M))
    stated = {}
    for label, value in rows.items():
        first, *moved = value.replace(",", "").split(" ")
        stated[label] = int(first) + (int(moved[0] + moved[1]) if moved else 0)
    assert stated["a core file"] == CORE_FILE_TOKENS
    assert stated["the core, all of it"] == CORE_TOTAL_TOKENS
    assert stated["a function"] == FUNCTION_TOKENS
    assert stated["`train.main`"] == FUNCTION_BUDGETS["train", "main"]
    assert stated["`rollout.TorchEngine`"] == CLASS_BUDGETS["rollout", "TorchEngine"]
    assert stated["`README.md`"] == README_LINES
    for name, budget in FILE_TOKENS.items():
        assert stated[f"`{name}.py`"] == budget, name


def test_the_exceptions_and_budgets_name_what_exists():
    """A renamed or shortened exception must not keep its licence silently."""
    for name, short in FUNCTION_EXCEPTIONS:
        found = [n for qual, kind, n in defs(name) if qual.rsplit(".", 1)[-1] == short]
        assert found and max(found) > FUNCTION_TOKENS, (
            f"{name}.{short} is no longer an exception: remove it"
        )
    for (name, short), _ in {**FUNCTION_BUDGETS, **CLASS_BUDGETS}.items():
        assert any(qual == short for qual, _, _ in defs(name)), f"{name}.py defines no {short}"


# -----------------------------------------------------------------------------
# the house style that no formatter checks (docs/layout.md): in the core, explanations stand above
# the code; the right margin holds a short clause now and then; one value per name in a statement

MARGIN_SHARE = 0.10  # of a core file's code lines, at most, carry a margin comment
TWO_SENTENCES = re.compile(r"[.;] +[A-Z]|;")


def comment_facts(name: str) -> tuple[set[int], dict[int, tuple[int, str]]]:
    """(the lines that hold code, docstrings left out; {line: (column, text)} of every comment)."""
    text = source(name)
    docs = docstring_starts(ast.parse(text))
    code, comments = set(), {}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = (tok.start[1], tok.string)
        elif tok.type not in LAYOUT_TOKENS and not (
            tok.type == tokenize.STRING and tok.start in docs
        ):
            code.update(range(tok.start[0], tok.end[0] + 1))
    return code, comments


@pytest.mark.parametrize("name", CORE)
def test_the_core_explains_above_the_code(name):
    """At most one code line in ten carries a margin comment; a margin comment is one clause that
    never runs on into a comment line below it (the explanation goes above the code instead)."""
    code, comments = comment_facts(name)
    lines = source(name).splitlines()
    margin = {row: c for row, c in comments.items() if row in code}
    share = len(margin) / len(code)
    assert share <= MARGIN_SHARE, (
        f"{name}.py: {len(margin)} of {len(code)} code lines carry a margin comment ({share:.0%})"
    )
    for row, (_, text) in margin.items():
        indent = len(lines[row - 1]) - len(lines[row - 1].lstrip())
        below = comments.get(row + 1)
        assert not (below and row + 1 not in code and below[0] > indent), (
            f"{name}.py:{row}: a margin comment continues on the next line: put it above the code"
        )
        assert not TWO_SENTENCES.search(text), (
            f"{name}.py:{row}: a margin comment holds two sentences: put it above the code"
        )


@pytest.mark.parametrize("name", CORE)
def test_one_value_per_name(name):
    """No statement unpacks three or more names from a literal tuple (`a, b, c = [], 0, 0`)."""
    for node in ast.walk(ast.parse(source(name))):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.targets[0], (ast.Tuple, ast.List))
            and len(node.targets[0].elts) >= 3
            and isinstance(node.value, (ast.Tuple, ast.List))
        ):
            raise AssertionError(f"{name}.py:{node.lineno}: one statement per value")


def test_the_readme_is_a_front_door():
    with open(os.path.join(ROOT, "README.md")) as f:
        n = len(f.read().splitlines())
    assert n <= README_LINES, (
        f"README.md is {n} lines (budget {README_LINES}): move the detail to docs/"
    )


# -----------------------------------------------------------------------------
# each file's Imports: line

# to the end of its paragraph
IMPORTS_LINE = re.compile(r"^Imports:(.*?)(?:\n\s*\n|\Z)", re.M | re.S)


@pytest.mark.parametrize("name", files())
def test_the_imports_line_says_what_the_file_imports(name):
    """Each file's module docstring has one `Imports: a.py, wings/b.py (and torch, ...)` paragraph
    naming exactly the files of ours it imports (`none of our files` when there are none), so a
    reader copying it out knows what to take along."""
    doc = ast.get_docstring(ast.parse(source(name))) or ""
    found = IMPORTS_LINE.findall(doc)
    assert len(found) == 1, (
        f"{name}.py: its docstring needs exactly one line starting with 'Imports:'"
    )
    named = {m[:-3] for m in re.findall(r"[\w/]+\.py\b", found[0])}
    actual = local_imports(name)
    assert named == actual, (
        f"{name}.py's Imports: line names {sorted(named)}, it imports {sorted(actual)}"
    )
    if not actual:
        assert "none of our files" in found[0], f"{name}.py: say 'Imports: none of our files (...)'"
