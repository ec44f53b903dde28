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
import os
import re
import subprocess
import sys

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
    )
]
# serve's
WINGS += [
    "wings/" + n for n in ("serve_http", "serve_openai", "serve_anthropic", "capture", "batcher")
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
    # the server's parts, each a file of its own (the transport, the two dialects, the records, the
    # engine thread), imported one way: by serve.py; of them only the dialects import one
    # (RequestError)
    "wings/serve": {
        "wings/serve_http",
        "wings/serve_openai",
        "wings/serve_anthropic",
        "wings/capture",
        "wings/batcher",
    },
    "wings/serve_openai": {"wings/serve_http"},
    "wings/serve_anthropic": {"wings/serve_http"},
    # QLoRA is LoRA on an NF4 base: its layers are LoRALinear
    "wings/qlora": {"wings/lora"},
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

# budgets, in lines of source (docs/layout.md says why each is what it is)
CORE_FILE_LINES = 600
FILE_LINES = {
    "algos": 850,  # the catalogue of every loss and advantage, read top to bottom
    "config": 500,
    "train": 420,
}
FUNCTION_LINES = 80
FUNCTION_EXCEPTIONS = {
    # the python_exec child's setup is security code: every step of it (check, namespace, audit
    # hook, run) is read in order, in one place, to audit it (its own comment says so)
    ("envs/sandbox_exec", "_exec_program"),
}
FUNCTION_BUDGETS = {("train", "main"): 100}  # the loop, read as its numbered steps
CLASS_BUDGETS = {("rollout", "TorchEngine"): 130}  # the reference engine, read in one sitting
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
    assert worlds <= set(WORLDS) and len(worlds) == 8
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


def lines(name: str) -> int:
    return len(source(name).splitlines())


@pytest.mark.parametrize("name", CORE)
def test_core_files_keep_their_budget(name):
    budget = FILE_LINES.get(name, CORE_FILE_LINES)
    assert lines(name) <= budget, (
        f"{name}.py is {lines(name)} lines (budget {budget}): split it or move a wing out"
    )


def defs(name: str):
    """(qualified name, kind, lines) of every function and class in `name`, nested ones included."""
    out = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qual = prefix + child.name
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                out.append((qual, kind, child.end_lineno - child.lineno + 1))
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
            budget = FUNCTION_BUDGETS.get((name, short), FUNCTION_LINES)
            assert n <= budget, f"{name}.py: {qual} is {n} lines (budget {budget})"
        if kind == "class" and (name, short) in CLASS_BUDGETS:
            assert n <= CLASS_BUDGETS[name, short], f"{name}.py: {qual} is {n} lines"


def test_the_exceptions_and_budgets_name_what_exists():
    """A renamed or shortened exception must not keep its licence silently."""
    for name, short in FUNCTION_EXCEPTIONS:
        found = [n for qual, kind, n in defs(name) if qual.rsplit(".", 1)[-1] == short]
        assert found and max(found) > FUNCTION_LINES, (
            f"{name}.{short} is no longer an exception: remove it"
        )
    for (name, short), _ in {**FUNCTION_BUDGETS, **CLASS_BUDGETS}.items():
        assert any(qual == short for qual, _, _ in defs(name)), f"{name}.py defines no {short}"


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
