"""bench/knobs.py: every knob of the config tree, set on a tiny two-step run, and what it was seen
to change; writes docs/knobs.md.

    .venv/bin/python bench/knobs.py [--out docs/knobs.md] [--root runs/knobs]

The walk is tests/test_knobs.py's (its KNOBS table, its runs and its comparisons; the slow tier of
that test asserts what this script reports): each knob is set to a legal non-default value, on top
of the context that makes it apply, and the run is compared with the run of the context alone. The
page lists, per knob, the value tried and what
happened: what changed (metrics, weights, held-out episodes, files, the default model built), the
start-up refusal, or why it is inert. The runs go under --root (emptied first). Exit status 1 when a
knob does not do what the table expects (the page marks it).
"""

import argparse
import os
import platform
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import test_knobs as walk_lib  # noqa: E402  (conftest, imported with it: offline wandb, at most two torch threads)
from test_knobs import CHANGES, INERT, KNOBS, REFUSED, Walk, problem  # noqa: E402


def context_names() -> dict[tuple, str]:
    """The contexts tests/test_knobs.py names (EPOCHS, PPO, SFT, ...), by value."""
    used = {knob.context for knob in KNOBS.values()}
    return {
        v: k
        for k, v in vars(walk_lib).items()
        if k.isupper() and isinstance(v, tuple) and v in used
    }


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def describe(key: str, outcome, root: str) -> str:
    knob, why = KNOBS[key], problem(key, outcome)
    seen = [s.replace(root, "<root>") for s in outcome.seen]
    if why is not None:
        return f"**FAILS: {cell(why.replace(root, '<root>'))}**"
    if knob.expect == REFUSED:
        return f"refused: {cell(seen[0])}" + (f" ({cell(knob.why)})" if knob.why else "")
    if knob.expect == INERT:
        moved = (
            "float rounding only: " + "; ".join(seen)
            if outcome.kind == "rounding"
            else "nothing moved"
        )
        return f"inert: {cell(knob.why)}. Seen: {cell(moved)}"
    if knob.stops:
        return f"stops the run: {cell(seen[0])}"
    return "changes: " + cell("; ".join(seen)) + (f" ({cell(knob.why)})" if knob.why else "")


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "knobs.md"))
    p.add_argument("--root", default=os.path.join(ROOT, "runs", "knobs"))
    args = p.parse_args()
    os.chdir(ROOT)
    import torch

    from config import load_config
    from sft import build_default_model

    root = os.path.abspath(args.root)
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    model_dir = build_default_model(
        load_config("configs/toy_math.yaml", [*walk_lib.TINY, f"model.cache_dir={root}/cache"])
    )
    walk = Walk(model_dir, os.path.join(root, "runs"))
    rows, failed, counts = [], [], {CHANGES: 0, REFUSED: 0, INERT: 0}
    for key, knob in KNOBS.items():
        outcome = walk.check(key)
        print(f"{key}: {outcome.kind} {outcome.seen}", flush=True)
        counts[knob.expect] += 1
        if problem(key, outcome) is not None:
            failed.append(key)
        rows.append((key, knob, describe(key, outcome, root)))

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in open("/proc/cpuinfo")
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    names = context_names()
    lines = [
        "# Every knob, and what it does",
        "",
        "Every leaf of the config tree (config.py's `Config`), set to a legal non-default value on a tiny two-step run "
        "and compared with the same run without it: what changed, or the start-up refusal, or why nothing can change "
        "in that setting. The table and the walk are [tests/test_knobs.py](../tests/test_knobs.py), whose slow tier "
        "asserts every row; regenerate this page with `.venv/bin/python bench/knobs.py`. Generated at commit "
        f"{commit} on a {os.cpu_count()}-core CPU ({cpu}), {torch.get_num_threads()} torch threads.",
        "",
        f"{len(KNOBS)} knobs: {counts[CHANGES]} change something, {counts[REFUSED]} are refused, {counts[INERT]} are "
        "inert in this setting"
        + (f"; **{len(failed)} fail: {', '.join(failed)}**." if failed else "."),
        "",
        "The base run is tests/test_train.py's `TINY` (the embedded default model at test size, toy math), smaller "
        f"still (`{' '.join(walk_lib.FAST)}`), two steps, an eval at steps 0 and 2, and DAPO's overlong penalty over "
        f"the whole length range (`{' '.join(walk_lib.SIGNAL)}`): the tiny model solves almost nothing, and without "
        "it every reward and every advantage would be 0. The policy is the test-size default model, passed as "
        "`model.path`; sft.* knobs build their own (`model.path=default`). A knob's context is the overrides it needs "
        "to apply; its baseline is the run with the context alone. Observed: the metrics of metrics.jsonl (timings "
        "by presence only), the weights of final/, the held-out episode dumps, the files written, and the default "
        "model built (weights, sft_log.json). A number or weight that moved by float rounding only (relative "
        f"{walk_lib.RTOL:g}, absolute {walk_lib.ATOL:g}) counts as unchanged. `<model>` is the test-size default "
        "model's folder, `<root>` the folder of the runs.",
        "",
        "Contexts used by several knobs:",
        "",
        *[
            f"- {name}: `{' '.join(ctx)}`"
            for ctx, name in sorted(names.items(), key=lambda kv: kv[1])
        ],
        "",
        "| knob | value tried | context | what it did |",
        "|---|---|---|---|",
    ]
    for key, knob, what in rows:
        context = names.get(knob.context) or " ".join(knob.context)
        lines.append(
            f"| `{key}` | `{cell(knob.value)}` | {cell(context) if context else ''} | {what} |"
        )
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}: {counts}; failing: {failed or 'none'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
