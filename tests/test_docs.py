"""Every code name the docs mention resolves against the code (STYLE 15), so a rename breaks this
test, not a reader.

Read with ast from the source; none of our modules is imported. Each backticked span of README.md
and docs/*.md, and each line of their ```bash blocks, is checked for:
- files: every `x.py` names a file that exists (a path from the root, or a bare name found at the
  root, in wings/ or envs/, else in tests/, bench/ or examples/, in exactly one of them), and so
  does every path into configs/, docs/, tests/, bench/, examples/, wings/ or envs/;
- runs: `python x.py` and `python -m x` name a file or module as run from the root, and so does
`wing("x.name")`;
- code names: every `module.name`, `module.Class.attr` or `module.name(...)` whose first part is one
  of our modules (a core file, a wing's or world's file stem, or `wings.x` / `envs.x`) names what
  that file defines at top level (def, class, assignment; in a class: its body, dataclass fields,
  methods, `self.x` set by a method). A name only imported into a file does not count: the docs
  point at the defining file;
- config keys: every dotted path whose first part is a section of config.Config
  (`rollout.agent.max_turns`, `envs[i].name`), and the key of every `key=value` override, resolves
  in the dataclass tree that config.py assembles (with agent.AgentConfig, learner.LearnerConfig and
  algos' loss and off-policy dataclasses). A first part that is both a section and a module
  (`rollout`, `learner`, `model`, `eval`, `sft`, `envs`) passes either way;
- links: every relative markdown link `[x](path#anchor)` names a file that exists and, into a .md
file, a heading. Metric names (`rollout/reward`), values, other words of a command and other
libraries' names are not checked.

Imports: none of our files (ast, functools, glob, os, re and pytest).
"""

import ast
import functools
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))
)
MODULE_DIRS = ("", "wings", "envs")  # where a bare `x.py` or `x.name` is looked for first ...
OTHER_DIRS = ("tests", "bench", "examples")  # ... then here
PATH_DIRS = ("configs", "docs", "tests", "bench", "examples", "wings", "envs")
# where the config tree's dataclasses live
CONFIG_FILES = ("config.py", "agent.py", "learner.py", "algos.py")
# `ray.x` that is Ray's own, not a key
RAY_API = {"put", "get", "wait", "init", "remote", "kill", "shutdown"}

# Placeholders the docs use on purpose, each with its reason; everything else must resolve.
ALLOWED = {
    "wings.x.name": "the form a rollout.wing() name takes, in prose",
    "key.sub": "the form of an override, in prose (`key.sub=value`)",
    "path/to/file.py": "the user's own agent file, in the form rollout.external_agent takes",
    "configs/my_env.yaml": "the user's own world's config, in the guide to writing one",
    "learner.tis_cap": (
        "a removed key, shown with the error that names its replacement (config.RENAMED)"
    ),
    "rollout.stale_policy": "a key that does not exist, named to say so",
    "learner.lrr": "a typo on purpose, in the example of the closest-key error",
    "configs/nope.yaml": "a missing file on purpose, in the example of the missing-file error",
    "model.layers.0.self_attn.q_proj.weight": "a parameter's name in a checkpoint, not a code name",
}

FILE = re.compile(r"(?<![\w/.-])([\w.-]+(?:/[\w.-]+)*\.py)\b")
PATH = re.compile(r"(?<![\w/.-])((?:" + "|".join(PATH_DIRS) + r")/[\w./-]*\w)")
DOTTED = re.compile(r"(?<![\w.])([A-Za-z_]\w*(?:\[[^\]\s]*\])?(?:\.(?:\w+)(?:\[[^\]\s]*\])?)+)")
OVERRIDE = re.compile(r"^([a-z_][\w]*(?:\[\w+\])?(?:\.\w+(?:\[\w+\])?)*)=(?!=)")
# a span whose bare key=value are overrides
COMMAND = re.compile(r"\b(?:train|eval|sft)\.py\b|-m (?:wings|envs)\.")
EXTENSIONS = {
    "yaml",
    "json",
    "jsonl",
    "safetensors",
    "md",
    "png",
    "txt",
    "toml",
    "parquet",
    "pt",
    "bin",
    "gz",
    "zip",
    # `config.yaml`, `model.safetensors`: a file's name, not a code name
    "log",
    "sh",
    "csv",
    "html",
}
RUN = re.compile(
    r"(?:^|[\s/])(?:python3?|torchrun(?:\s+--\S+(?:\s+\d+)?)*)\s+(?:-m\s+([\w.]+)|([\w./-]+\.py)\b)"
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


# -----------------------------------------------------------------------------
# what the docs say


def spans(text: str) -> list[tuple[int, str]]:
    """(line number, text) of every backticked span outside fenced blocks, and of every line of a
    ```bash block."""
    out, fence, lang = [], False, ""
    for i, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fence, lang = not fence, line[3:].strip()
            continue
        if fence:
            if lang in ("bash", "sh", "shell"):
                out.append((i, line))
            continue
        out += [(i, s) for s in re.findall(r"`([^`]+)`", line)]
    return out


def names_in(span: str) -> dict[str, list[str]]:
    """The span's file paths, dotted code names and config keys (overrides' keys), each kind
    apart."""
    found = {"file": [], "name": [], "key": [], "run": []}
    found["run"] = [m for pair in RUN.findall(span) for m in pair if m]
    found["run"] += [
        m.rsplit(".", 1)[0] for m in re.findall(r"\bwing\(\"([\w.]+)\"\)", span) if "." in m
    ]
    for word in re.split(r"\s+", span):
        word = word.strip("'\"()[],;:")
        if not word or word.startswith(("-", "http", "$")) or "://" in word:
            continue
        found["file"] += [m for m in FILE.findall(word) if "*" not in word]
        found["file"] += [
            m.rstrip(".") for m in PATH.findall(word) if not m.endswith(".py") and "*" not in word
        ]
        override = OVERRIDE.match(word)
        if override:
            found["key"].append(override.group(1))
            continue
        if "/" in word:  # a metric name (rollout/reward) or a path: not a code name
            continue
        found["name"] += [
            m for m in DOTTED.findall(word) if m.rsplit(".", 1)[-1] not in EXTENSIONS | {"py"}
        ]
    return found


# -----------------------------------------------------------------------------
# what the code defines


def _page(doc: str) -> str:
    with open(os.path.join(ROOT, doc)) as f:
        return f.read()


@functools.lru_cache(maxsize=None)
def _read(path: str) -> ast.Module:
    with open(os.path.join(ROOT, path)) as f:
        return ast.parse(f.read())


def modules() -> dict[str, str]:
    """Module name -> file: "rollout" -> rollout.py, "lora" and "wings.lora" -> wings/lora.py."""
    out = {}
    for folder in MODULE_DIRS:
        for p in sorted(glob.glob(os.path.join(ROOT, folder, "*.py"))):
            stem = os.path.basename(p)[:-3]
            if stem == "__init__":
                continue
            rel = os.path.relpath(p, ROOT)
            out.setdefault(stem, rel)
            if folder:
                out[f"{folder}.{stem}"] = rel
                out.setdefault(folder, os.path.join(folder, "__init__.py"))
    return out


def definitions(body: list) -> dict[str, ast.AST | None]:
    """Names a module or class body defines: defs and classes (-> the node), assignments (-> None),
    in if/try too."""
    out = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        out.setdefault(n.id, None)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for part in ("body", "orelse", "finalbody"):
                out.update(definitions(getattr(node, part, [])))
            for handler in getattr(node, "handlers", []):
                out.update(definitions(handler.body))
    return out


def members(cls: ast.ClassDef, scope: dict) -> dict[str, ast.AST | None]:
    """What a class defines: its body, the attributes its methods set on self, and its bases' (in
    the same file)."""
    out = {}
    for base in cls.bases:
        if (
            isinstance(base, ast.Name)
            and isinstance(scope.get(base.id), ast.ClassDef)
            and base.id != cls.name
        ):
            out.update(members(scope[base.id], scope))
    out.update(definitions(cls.body))
    for node in ast.walk(cls):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            out.setdefault(node.attr, None)
    return out


def resolve_code(name: str, mods: dict) -> str | None:
    """None if `name` is what our code defines; else why not. Names whose first part is not ours
    pass."""
    parts = [re.sub(r"\[.*\]$", "", p) for p in name.split(".")]
    for n in (2, 1):  # "wings.lora.x" before "wings" alone
        if ".".join(parts[:n]) in mods:
            path, rest = mods[".".join(parts[:n])], parts[n:]
            break
    else:
        return None
    if not rest:
        return None
    scope = definitions(_read(path).body)
    node, here = None, scope
    for i, part in enumerate(rest):
        if part not in here:
            return f"{path} defines no {'.'.join(rest[: i + 1])}"
        node = here[part]
        if isinstance(node, ast.ClassDef):
            here = members(node, scope)
        elif i + 1 < len(rest):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return f"{path}: {'.'.join(rest[: i + 1])} is a function, it has no {rest[i + 1]}"
            return None  # an attribute of a value: not followed
    return None


def config_tree() -> dict[str, dict]:
    """Dataclass name -> {field: its annotation's source}, for every class in the files the config
    tree spans."""
    out = {}
    for path in CONFIG_FILES:
        for node in _read(path).body:
            if isinstance(node, ast.ClassDef) and any(
                "dataclass" in ast.unparse(d) for d in node.decorator_list
            ):
                out[node.name] = {
                    s.target.id: ast.unparse(s.annotation)
                    for s in node.body
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                }
    return out


def resolve_key(key: str, tree: dict) -> str | None:
    """None if `key` is a field path of config.Config (`envs[0].name` and `envs.0.name` index its
    list); else why."""
    fields, done = tree["Config"], []
    for part in key.split("."):
        index = re.match(r"^(\w+)\[\w+\]$", part)
        part = index.group(1) if index else part
        if fields is None:  # below a dict (envs[i].kwargs.x): any key
            return None
        if part.isdigit() and done and done[-1] == "[]":
            continue
        if part not in fields:
            return f"config has no {'.'.join(done + [part]).replace('.[]', '')}"
        ann = fields[part]
        done.append(part)
        inner = re.match(r"^list\[(\w+)\]$", ann)
        if inner:
            ann = inner.group(1)
            done.append("[]")
        ann = ann.rsplit(".", 1)[-1]
        fields = tree.get(ann) if ann in tree else (None if ann.startswith("dict") else {})
    return None


def resolve_file(path: str) -> str | None:
    """None if the path (from the root, or bare) names exactly one file of ours; else why not."""
    if "/" in path:
        return None if os.path.exists(os.path.join(ROOT, path)) else f"no file {path}"
    for dirs in (MODULE_DIRS, OTHER_DIRS):
        hits = [os.path.join(d, path) for d in dirs if os.path.isfile(os.path.join(ROOT, d, path))]
        if len(hits) > 1:
            return f"{path} is ambiguous: {hits}; write the folder"
        if hits:
            return None
    folders = ", ".join(d + "/" for d in MODULE_DIRS[1:] + OTHER_DIRS)
    return f"no file {path} at the root or in {folders}"


def resolve_run(target: str, mods: dict) -> str | None:
    """None if `python FILE` / `python -m MODULE` run from the root, or `wing("MODULE.name")`, finds
    what it names."""
    if target.endswith(".py"):
        return (
            None
            if os.path.isfile(os.path.join(ROOT, target))
            else f"`python {target}` from the root: no such file"
        )
    path = mods.get(target)
    if path and path.replace("/", ".")[:-3] != target:
        module = path.replace("/", ".")[:-3]
        return f"`{target}` is not importable from the root: the module is {module}"
    return None


def sections(tree: dict) -> set[str]:
    """config.Config's sections: its fields that hold a dataclass (or a list of them: envs)."""
    return {
        k for k, ann in tree["Config"].items() if re.sub(r"^list\[(\w+)\]$", r"\1", ann) in tree
    }


def problems(text: str, mods: dict, tree: dict) -> list[str]:
    """Every name in a markdown text that does not resolve, as 'line N: `span`: why'."""
    out, config_sections = [], sections(tree)
    for line, span in spans(text):
        found = names_in(span)
        why = [resolve_file(f) for f in found["file"] if f not in ALLOWED]
        why += [resolve_run(r, mods) for r in found["run"] if r not in ALLOWED]
        for key in found["key"]:
            if key in ALLOWED or "." not in key and not COMMAND.search(span):
                continue
            first = key.split(".")[0].split("[")[0]
            if "." in key:
                why.append(
                    resolve_key(key, tree)
                    if first in config_sections
                    else f"{first} is not a config section"
                )
            elif first not in tree["Config"]:  # a bare key on a command line: a top-level field
                why.append(f"{key} is not a config field")
        for name in found["name"]:
            if name in ALLOWED:
                continue
            first, rest = name.split(".")[0].split("[")[0], name.split(".", 1)[1]
            code = resolve_code(name, mods)
            if first not in config_sections:
                why.append(code)
                continue
            key = resolve_key(name, tree)
            if key is None or first in mods and code is None or first == "ray" and rest in RAY_API:
                continue
            why.append(key + (f"; as code, {code}" if first in mods else ""))
        out += [f"line {line}: `{span}`: {w}" for w in why if w]
    return out


# -----------------------------------------------------------------------------
# links


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text without markup, lower-cased, punctuation dropped,
    spaces -> '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: str) -> set[str]:
    with open(path) as f:
        text = re.sub(r"^```.*?^```", "", f.read(), flags=re.M | re.S)
    return {slug(h) for h in re.findall(r"^#+\s+(.*)$", text, re.M)}


def broken_links(text: str, page: str) -> list[str]:
    """Every relative link in `text` (the markdown file `page`) whose file or heading does not
    exist."""
    out = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if full and not os.path.exists(full):
            out.append(f"({target}): no file {os.path.relpath(full, ROOT)}")
        elif anchor and full.endswith(".md") and anchor not in anchors(full):
            out.append(f"({target}): {os.path.relpath(full, ROOT)} has no heading #{anchor}")
    return out


# -----------------------------------------------------------------------------
# the tests


@pytest.fixture(scope="module")
def code():
    return modules(), config_tree()


@pytest.mark.parametrize("doc", DOCS)
def test_every_code_name_in_the_docs_exists(doc, code):
    bad = problems(_page(doc), *code)
    assert not bad, f"{doc}: names the code does not define:\n" + "\n".join(bad)


def test_every_placeholder_is_still_used():
    """A placeholder no page uses any more leaves ALLOWED, so the list stays the docs' own."""
    text = "".join(_page(doc) for doc in DOCS)
    assert [name for name in ALLOWED if name not in text] == []


@pytest.mark.parametrize("doc", DOCS)
def test_every_relative_link_in_the_docs_exists(doc):
    bad = broken_links(_page(doc), os.path.join(ROOT, doc))
    assert not bad, f"{doc}: broken links:\n" + "\n".join(bad)


GOOD = [
    "rollout.py",
    "wings/serve.py",
    "rollout.TorchEngine.generate",
    'wing("wings.lora.apply_lora")',
    "lora.LoRALinear",
    "rollout.agent.max_turns",
    "learner.off_policy.kind=tis",
    "envs[0].name",
    "envs.0.weight",
    "python train.py steps=60",
    "ray.put",
    "ray.learner_workers",
    "torch.compile",
    "rollout/reward",
    "config.yaml",
    "python -m envs.worlds",
    "learner.train_step",
    "agent.AgentConfig.n_samples",
    ".venv/bin/torchrun --nproc_per_node 2 train.py",
    "python -m wings.serve",
    "key.sub=value",
]
BAD = {  # span -> what the report must say
    "no_such_file.py": "no file no_such_file.py",
    "wings/rollout.py": "no file wings/rollout.py",
    "rollout.NoSuchEngine": "rollout.py defines no NoSuchEngine",
    "rollout.TorchEngine.no_such_method": "defines no TorchEngine.no_such_method",
    "learner.train_step.x": "train_step is a function",
    "rollout.no_such_key=1": "config has no rollout.no_such_key",
    "learner.off_policy.no_such=1": "config has no learner.off_policy.no_such",
    "envs[0].no_such": "config has no envs.no_such",
    "python train.py no_such_field=3": "no_such_field is not a config field",
    "agent.max_turns=2": "agent is not a config section",
    "algo.no_such": "config has no algo.no_such",
    "ray.no_such": "config has no ray.no_such",
    "wings.lora.no_such": "wings/lora.py defines no no_such",
    "python serve.py": "`python serve.py` from the root",
    "python -m lora": "the module is wings.lora",
    'wing("judge.LLMJudge")': "the module is wings.judge",
}


def test_the_checks_catch_a_wrong_name(code):
    """The checks fail for the right reasons: each wrong span alone is reported, saying why, and no
    right one is."""
    for span in GOOD:
        assert problems(f"`{span}`", *code) == [], span
    for span, why in BAD.items():
        found = problems(f"`{span}`", *code)
        assert any(why in p for p in found), (span, why, found)
    page = os.path.join(ROOT, "docs", "layout.md")
    assert (
        broken_links(
            "[a](engines.md) [b](../rollout.py) [c](../README.md#the-files) [d](#the-budgets)", page
        )
        == []
    )
    bad = broken_links(
        "[a](nosuch.md) [b](engines.md#no-such-heading) [c](#no-such-heading) [d](../nosuch.py)",
        page,
    )
    assert len(bad) == 4, bad
