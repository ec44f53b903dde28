"""The layout contract (docs/layout.md): which top-level file may import which. Read with ast, nothing executed.

The core is the reference path the main command runs; a wing is an optional feature in a file of its own. The core
never imports a wing (it reaches one by name, through a registry, when the config turns it on: env.ENTRY_POINTS,
rollout.ENGINES and TORCH_ENGINE_PIECES, rollout.wing), imports between core files point one way (down the order
below), and config.py imports only the files whose dataclasses it assembles and the catalogues it checks names
against. Every import statement counts, at the top of a file or inside a function.
"""
import ast
import glob
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the core, bottom to top: a core file imports only core files listed before it
CORE = ["model", "algos", "plot", "distributed", "sandbox", "sandbox_exec", "tools", "env", "chat", "agent", "rollout",
        "microbatch", "learner", "config", "runs", "eval", "sft", "train"]
WINGS = ["engine_vllm", "engine_openai", "prefix_cache", "async_rollouts", "lora", "qlora", "cluster", "chat_llama3",
         "serve", "judge", "external_agent"]
WORLDS = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "env_*.py")))
WORLDS_LIB = "worlds"                          # what the worlds share (expert replay, JSON-lines files): theirs alone
WING_IMPORTS = {"external_agent": {"serve"},    # the user's agent talks to serve.Server's HTTP API: a wing on a wing
                "qlora": {"lora"}}             # QLoRA is LoRA on an NF4 base: its layers are lora.LoRALinear
CONFIG_IMPORTS = {"agent", "learner",          # the dataclasses config.Config assembles (AgentConfig, LearnerConfig)
                  "algos", "chat"}             # the catalogues it checks names against (algos' kinds, CHAT_FORMATS)


def local_imports(name: str) -> set[str]:
    """The top-level files of this repo that `name`.py imports, anywhere in the file."""
    tree = ast.parse(open(os.path.join(ROOT, name + ".py")).read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return {m for m in found if os.path.isfile(os.path.join(ROOT, m + ".py")) and m != name}


def test_every_top_level_file_is_core_a_wing_or_a_world():
    files = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "*.py")))
    assert sorted(CORE + WINGS + WORLDS + [WORLDS_LIB]) == files, "place a new file in the layout (and docs/layout.md)"


@pytest.mark.parametrize("name", CORE)
def test_the_core_imports_down_and_never_a_wing(name):
    below = set(CORE[:CORE.index(name)])
    imports = local_imports(name)
    assert not imports & set(WINGS + WORLDS + [WORLDS_LIB]), f"{name}.py imports a wing: reach it by name"
    assert imports <= below, f"{name}.py imports {sorted(imports - below)}, which are not below it in the core"


def test_config_imports_only_what_it_assembles():
    assert local_imports("config") <= CONFIG_IMPORTS
    assert not local_imports("config") & {"rollout", *WINGS}, "config.py must not import an engine"


@pytest.mark.parametrize("name", WINGS + WORLDS + [WORLDS_LIB])
def test_a_wing_imports_the_core_and_no_other_wing(name):
    imports = local_imports(name)
    allowed = set(CORE) | WING_IMPORTS.get(name, set())
    if name in WORLDS:                           # a world may use the worlds' shared library
        allowed |= {WORLDS_LIB} | ({"env_code"} if name == "env_humaneval" else set())  # HumanEval: CodeEnv grades
    assert imports <= allowed, f"{name}.py imports {sorted(imports - allowed)}"


def test_the_registries_name_files_that_exist():
    """What the core reaches by name is there: a renamed wing breaks this test, not a user's run."""
    import env
    import rollout
    entries = list(rollout.ENGINES.values()) + list(rollout.TORCH_ENGINE_PIECES.values())
    for name in CORE:                             # wing("module.name") calls, as train.py makes them
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, name + ".py")).read())):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "wing" and node.args
                    and isinstance(node.args[0], ast.Constant)):
                entries.append(node.args[0].value)
    assert len(entries) >= 7                      # 2 engines, 2 torch engine pieces, async schedule, LoRA, Ray (x2)
    for entry in entries:
        module, attr = entry.rsplit(".", 1)
        assert module in WINGS, entry
        defined = {n.name for n in ast.walk(ast.parse(open(os.path.join(ROOT, module + ".py")).read()))
                   if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
        assert attr in defined, f"{entry}: {module}.py defines no {attr}"
    assert set(env.ENTRY_POINTS.values()) <= set(WORLDS)
    import chat
    assert set(chat.WING_FORMATS.values()) <= set(WINGS)      # the chat formats written in a wing


def test_the_package_ships_every_top_level_file():
    """pyproject.toml's py-modules (what `pip install .` installs) names every top-level file, so a new wing is not
    left out of an installed copy."""
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    listed = ast.literal_eval(text[text.index("py-modules = ") + len("py-modules = "):].split("]")[0] + "]")
    files = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "*.py")))
    assert sorted(listed) == files
