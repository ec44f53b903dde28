"""bench/knobs.py: docs/knobs.md, generated: every leaf of the config tree, what
tests/test_knobs.py's walk sets it to and what the walk last saw it do.

    .venv/bin/python bench/knobs.py --page              # the page alone, from the source: seconds
    .venv/bin/python bench/knobs.py [--keys KEY ...]    # walk (every knob: many minutes), then it

The page is built from the source, never edited by hand (tests/test_knobs.py checks that it is this
script's output, so a new knob cannot be missing from it): the leaves of config.Config's dataclass
tree, each with its type, its default and its field's comment (the margin comment on its line or
the comment block directly above it, read with tokenize from whichever file defines the dataclass);
the KNOBS table of tests/test_knobs.py (the value tried, the context that makes it apply, what is
expected and why); and the walk's observations, stored in bench/knobs.json.

The walk is tests/test_knobs.py's (its runs and its comparisons; the slow tier of that test asserts
what this script records): each knob is set to its value on top of its context, and the run is
compared with the run of the context alone: what changed (metrics, weights, held-out episodes,
files, the default model built), the start-up refusal, or nothing. The runs go under --root
(emptied first). Each knob walked gets its record in bench/knobs.json (the commit and machine of
the walk with it); --keys walks only those knobs and keeps the other records. Exit status 1 when a
knob does not do what the table expects (its row says FAILS).
"""

import argparse
import ast
import dataclasses
import functools
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

# the walk (tests/conftest.py comes with it: offline wandb, at most two torch threads)
import test_knobs as walk_lib  # noqa: E402
from test_knobs import CHANGES, INERT, KNOBS, REFUSED, Walk, problem  # noqa: E402

PAGE = os.path.join(ROOT, "docs", "knobs.md")
OBSERVED = os.path.join(ROOT, "bench", "knobs.json")  # the walk's records, one per knob
COMMAND = ".venv/bin/python bench/knobs.py --page"

# -----------------------------------------------------------------------------
# the config tree, read from the source


@dataclasses.dataclass
class Leaf:
    key: str  # dotted, as on the command line: rollout.agent.max_turns, envs.0.name
    type: str  # the field's annotation, as written
    default: object
    comment: str  # the field's comment in the source ("" when it has none)
    file: str  # where its dataclass is defined, from the root: config.py, agent.py, ...


@functools.lru_cache(maxsize=None)
def field_notes(cls) -> dict[str, tuple[str, str]]:
    """{field: (annotation, comment)} of dataclass `cls`, from its source file. A field's comment is
    the block of comment lines directly above it (up to a blank line, code or a `# ---` banner, the
    heading of a group of fields) followed by the margin comment on its own lines."""
    path = sys.modules[cls.__module__].__file__
    with open(path) as f:
        src = f.read()
    margin, alone = {}, {}  # line number -> comment text
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            (margin if tok.line[: tok.start[1]].strip() else alone)[tok.start[0]] = text
    node = next(
        n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == cls.__name__
    )
    notes = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above, line = [], stmt.lineno - 1
        while line in alone and not alone[line].startswith("---"):
            above.insert(0, alone[line])
            line -= 1
        right = [margin[i] for i in range(stmt.lineno, stmt.end_lineno + 1) if i in margin]
        annotation = ast.get_source_segment(src, stmt.annotation)
        notes[stmt.target.id] = (annotation, " ".join(above + right))
    return notes


def config_leaves() -> list[Leaf]:
    """Every leaf of config.Config's tree, in the order of the fields (tests/test_knobs.leaves, the
    walk's own list), with its default and its field's annotation and comment."""
    import config

    out = []
    for key in walk_lib.leaves():
        *path, name = key.split(".")
        owner = config.Config()
        for part in path:  # envs.0.name: the first EnvSpec of the list
            owner = owner[int(part)] if part.isdigit() else getattr(owner, part)
        annotation, comment = field_notes(type(owner))[name]
        where = os.path.relpath(sys.modules[type(owner).__module__].__file__, ROOT)
        out.append(Leaf(key, annotation, getattr(owner, name), comment, where))
    return out


# -----------------------------------------------------------------------------
# the page


def yaml(value) -> str:
    """A default as the command line writes it (key=value)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, str):
        return value or '""'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(yaml, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml(v)}" for k, v in value.items()) + "}"
    return repr(value)


def code(text: str) -> str:
    """A code span in a table cell."""
    return "`" + text.replace("|", "\\|") + "`"


def prose(text: str) -> str:
    """Text in a table cell: | escaped, and outside code spans < (`<root>` would be an HTML tag)
    and * (`**kwargs` could start bold)."""
    parts = text.replace("\n", " ").replace("|", "\\|").split("`")
    plain = (p.replace("<", "\\<").replace("*", "\\*") for p in parts[::2])
    parts[::2] = list(plain)
    return "`".join(parts)


def context_names() -> dict[tuple, str]:
    """The contexts tests/test_knobs.py names (EPOCHS, PPO, SFT, ...), by value."""
    used = {knob.context for knob in KNOBS.values()}
    return {
        v: k
        for k, v in vars(walk_lib).items()
        if k.isupper() and isinstance(v, tuple) and v in used
    }


def setting(value: str, context, names: dict) -> str:
    """`value` on CONTEXT: a named context (the longest that starts it) by its name."""
    context = tuple(context)
    named = [c for c in names if c and context[: len(c)] == c]
    start = max(named, key=len, default=())
    where = " ".join(([names[start]] if start else []) + list(context[len(start) :]))
    return code(value) + (f" on {prose(where)}" if where else "")


def expectation(key: str) -> str:
    """What the table expects (as written: learner.precision's refusal on a CPU without bf16 is in
    its `why`), and why."""
    knob = KNOBS[key]
    if knob.expect == INERT:
        return prose(f"inert: {knob.why}")
    said = "changes: the run stops" if knob.stops else knob.expect
    return prose(said + (f" ({knob.why})" if knob.why else ""))


SAW = {  # a record's kind (test_knobs.Outcome.kind) -> how the page says it
    CHANGES: "changes: {}",
    REFUSED: "refused: {}",
    "error": "stops the run: {}",
    "same": "nothing moved",
    "rounding": "float rounding only: {}",
}


def saw(key: str, record: dict | None, names: dict, main_walk: str) -> str:
    """What the walk last saw knob `key` do, from its record."""
    if record is None:
        return "not walked since it was added"
    knob = KNOBS[key]
    if "fails" in record:
        text = f"**FAILS: {prose(record['fails'])}**"
    elif record["kind"] == CHANGES and not record["seen"]:
        text = "changes (what moved was not recorded)"
    else:
        text = prose(SAW[record["kind"]].format(record["seen"]))
    if (record["value"], tuple(record["context"])) != (knob.value, knob.context):
        text = f"with {setting(record['value'], record['context'], names)}: {text}"
    return text + (f" ({record['walk']})" if record["walk"] != main_walk else "")


def load_observed(path: str = OBSERVED) -> dict:
    with open(path) as f:
        return json.load(f)


def save_observed(observed: dict, path: str = OBSERVED) -> None:
    """bench/knobs.json, one knob's record a line (a walk's diff reads knob by knob)."""
    lines = [
        f"{json.dumps(k)}: {json.dumps(r, ensure_ascii=False)}"
        for k, r in observed["knobs"].items()
    ]
    head = json.dumps(
        {k: v for k, v in observed.items() if k != "knobs"}, indent=1, ensure_ascii=False
    )
    with open(path, "w") as f:
        f.write(head[:-2] + ',\n "knobs": {\n  ' + ",\n  ".join(lines) + "\n }\n}\n")


def summary(leaves: list[Leaf], observed: dict) -> tuple[list[str], str]:
    """(the page's list of the records: per walk, how many knobs and what they did; the unwalked),
    the walk that saw the most knobs (the others' rows are marked)."""
    records = observed["knobs"]
    by_walk: dict[str, list[str]] = {}
    for leaf in leaves:
        if leaf.key in records:
            by_walk.setdefault(records[leaf.key]["walk"], []).append(leaf.key)
    main_walk = max(by_walk, key=lambda w: len(by_walk[w]), default="")
    unwalked = [leaf.key for leaf in leaves if leaf.key not in records]
    walks = []
    for walk, keys in sorted(by_walk.items(), key=lambda wk: -len(wk[1])):
        kinds = [records[k]["kind"] for k in keys]
        counts = ", ".join(
            f"{n} {what}"
            for what, n in (
                ("changed something", kinds.count(CHANGES) + kinds.count("error")),
                ("refused at start-up", kinds.count(REFUSED)),
                ("moved nothing or by rounding", kinds.count("same") + kinds.count("rounding")),
            )
            if n
        )
        fails = [k for k in keys if "fails" in records[k]]
        walks.append(
            f"- {len(keys)}"
            + ("" if walk == main_walk else f" (rows marked ({walk}))")
            + f" by {observed['walks'][walk]}: {counts}"
            + (f"; **{len(fails)} failed: {', '.join(fails)}**" if fails else "")
            + "."
        )
    if unwalked:
        listed = ", ".join(code(k) for k in unwalked)
        walks.append(f"- {len(unwalked)} not walked since they were added: {listed}.")
    return walks, main_walk


def page(observed: dict | None = None) -> str:
    """docs/knobs.md, from the source and the walk's records (bench/knobs.json)."""
    observed = load_observed() if observed is None else observed
    leaves, names, records = config_leaves(), context_names(), observed["knobs"]
    walks, main_walk = summary(leaves, observed)
    fast, signal = " ".join(walk_lib.FAST), " ".join(walk_lib.SIGNAL)
    files = ", ".join(dict.fromkeys(leaf.file for leaf in leaves))
    lines = [
        "# Every knob, and what it does",
        "",
        f"Every leaf of the config tree (config.py's `Config`), one row each: {len(leaves)} knobs. "
        f"This page is generated by `{COMMAND}`, in seconds, from the source; do not edit it by "
        "hand. Per knob: its type and default and the comment its field has in the source "
        f"({files}); "
        "what the walk of [tests/test_knobs.py](../tests/test_knobs.py) sets it to (its `KNOBS` "
        "table: the value tried, on top of the context that makes it apply) and expects; and what "
        "the walk last saw it do, stored in [bench/knobs.json](../bench/knobs.json). "
        "tests/test_knobs.py checks that this page is the generator's output and that every leaf "
        "has a row, so a knob added to the tree appears here, marked as not walked until the walk "
        "runs.",
        "",
        "The walk sets each knob on a tiny two-step run and compares the run with the same run "
        "without it (the context alone): what changed, or the start-up refusal, or why nothing can "
        "change in that setting. It takes many minutes: `.venv/bin/python bench/knobs.py` walks "
        "every knob (`--keys KEY ...`: only those) and rewrites bench/knobs.json and this page; "
        "the slow tier of tests/test_knobs.py asserts every expectation. The records are:",
        "",
        *walks,
        "",
        "The base run is tests/test_train.py's `TINY` (the embedded default model at test size, "
        f"toy math), smaller still (`{fast}`), two steps, an eval at steps 0 and 2, and DAPO's "
        f"overlong penalty over the whole length range (`{signal}`): "
        "the tiny model solves almost nothing, and without it every reward and every advantage "
        "would be 0. The policy is the test-size default model, passed as `model.path`; sft.* "
        "knobs build their own (`model.path=default`). A knob's context is the overrides it needs "
        "to apply; its baseline is the run with the context alone. Observed: the metrics of "
        "metrics.jsonl (timings by presence only), the weights of final/, the held-out episode "
        "dumps, the files written, and the default model built (weights, sft_log.json). A number "
        f"or weight that moved by float rounding only (relative {walk_lib.RTOL:g}, absolute "
        f"{walk_lib.ATOL:g}) counts as unchanged. `<model>` is the test-size default model's "
        "folder, `<run>` the knob's own run folder, `<root>` the folder of the runs. The defaults "
        "are config.py's; a file in configs/ and algo.name's preset may set others.",
        "",
        "Contexts used by several knobs:",
        "",
        *[
            f"- {name}: `{' '.join(ctx)}`"
            for ctx, name in sorted(names.items(), key=lambda kv: kv[1])
        ],
        "",
        "| knob | default | what it is | the walk sets | expected | the walk saw |",
        "|---|---|---|---|---|---|",
    ]
    for leaf in leaves:
        knob = KNOBS.get(leaf.key)
        cells = [
            code(leaf.key),
            f"{code(yaml(leaf.default))} ({code(leaf.type)})",
            prose(leaf.comment),
            setting(knob.value, knob.context, names) if knob else "(not in KNOBS)",
            expectation(leaf.key) if knob else "",
            saw(leaf.key, records.get(leaf.key), names, main_walk) if knob else "",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_page(out: str = PAGE, observed: dict | None = None) -> None:
    with open(out, "w") as f:
        f.write(page(observed))


# -----------------------------------------------------------------------------
# the walk


def this_walk() -> tuple[str, str]:
    """(the walk's name: the commit, + "-dirty" with uncommitted changes; where it ran)."""
    import torch

    git = ["git", "-C", ROOT]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True).stdout
    name = commit.stdout.strip() + ("-dirty" if dirty.strip() else "")
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in open("/proc/cpuinfo")
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    where = (
        f"bench/knobs.py's walk at commit {name} on a {os.cpu_count()}-core CPU ({cpu}), "
        f"{torch.get_num_threads()} torch threads"
    )
    return name, where


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--page", action="store_true", help="only write the page (no runs)")
    p.add_argument("--keys", nargs="+", default=list(KNOBS), help="walk these knobs only")
    p.add_argument("--out", default=PAGE)
    p.add_argument("--root", default=os.path.join(ROOT, "runs", "knobs"))
    args = p.parse_args()
    if args.page:
        write_page(args.out)
        print(f"wrote {args.out}")
        return
    unknown = sorted(set(args.keys) - set(KNOBS))
    if unknown:
        sys.exit(f"not in tests/test_knobs.py's KNOBS: {unknown}")
    os.chdir(ROOT)
    from config import load_config
    from sft import build_default_model

    root = os.path.abspath(args.root)
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    model_dir = build_default_model(
        load_config("configs/toy_math.yaml", [*walk_lib.TINY, f"model.cache_dir={root}/cache"])
    )
    walk = Walk(model_dir, os.path.join(root, "runs"))
    observed = load_observed() if os.path.exists(OBSERVED) else {"walks": {}, "knobs": {}}
    name, where = this_walk()
    observed["walks"][name] = where
    failed = []
    for key in args.keys:
        knob, outcome = KNOBS[key], walk.check(key)
        print(f"{key}: {outcome.kind} {outcome.seen}", flush=True)
        record = {
            "walk": name,
            "value": knob.value,
            "context": list(knob.context),
            "kind": outcome.kind,
            "seen": "; ".join(outcome.seen).replace(root, "<root>"),
        }
        why = problem(key, outcome)
        if why is not None:
            failed.append(key)
            record["fails"] = why.replace(root, "<root>")
        observed["knobs"][key] = record
    # the records of knobs the tree no longer has, and of walks no record names, go
    observed["knobs"] = {k: v for k, v in observed["knobs"].items() if k in KNOBS}
    named = {r["walk"] for r in observed["knobs"].values()}
    observed["walks"] = {w: s for w, s in observed["walks"].items() if w in named}
    save_observed(observed)
    write_page(args.out, observed)
    print(f"wrote {OBSERVED} and {args.out}; failing: {failed or 'none'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
