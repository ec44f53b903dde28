"""bfcl_agreement.py: how far the bfcl world (envs/env_bfcl.py) agrees with BFCL's own scoring.

    python bench/bfcl_agreement.py                      # every question, all perturbations
    python bench/bfcl_agreement.py --per-category 20    # a sample

1. The ceiling: BFCL's ground truth, played as the world's expert, scored by the world, per
   category; every question it fails is listed (BFCL_SELF_FAILURES: its own answer fails its own
   checker, left out of the sweep; simple_java 36, 64 and 65, whose answers no Java text passes
   through BFCL's type converter: kept in the sweep, docs/bfcl.md says why).
2. Agreement: the ground truth and perturbed versions of it (a wrong value, a missing argument, an
   extra call, calls out of order, a wrong function, malformed JSON, a plain-text reply; in
   multi-turn questions a call dropped, a wrong value or a duplicated call in one turn), each
   written as the model writes it (Qwen's <tool_call> blocks), scored by the world (the model's
   path: chat.make_action, env.step) and by BFCL's evaluation entry points
   (eval_runner._evaluate_single_ast_entry, _evaluate_single_relevance_entry,
   _evaluate_single_multi_turn_entry, with BFCL's QwenFCHandler) on the same text. Prints the
   agreement per category and every disagreement.
"""

import argparse
import copy
import os
import random
import sys
import uuid
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from chat import make_action, render  # noqa: E402
from env import Action, ToolCall  # noqa: E402
from envs import env_bfcl  # noqa: E402
from envs.env_bfcl import AST, CATEGORIES, MULTI_TURN, BFCLEnv  # noqa: E402

# questions whose ground truth fails BFCL's own AST checker (measured with bfcl-eval 2026.3.23): a
# required parameter missing from the answer, or one the function does not have
BFCL_SELF_FAILURES = (
    "bfcl/live_simple_106-63-0",
    "bfcl/live_simple_112-68-0",
    "bfcl/live_multiple_507-149-4",
    "bfcl/live_multiple_862-181-3",
    "bfcl/live_multiple_964-207-0",
)


def reply_text(action: Action) -> str:
    """The reply as a Qwen model writes it: the assistant turn render() writes for it."""
    message = {"role": "assistant", "content": action.text}
    if action.tool_calls:
        message["tool_calls"] = [
            {"function": {"name": c.name, "arguments": c.arguments}} for c in action.tool_calls
        ]
    text = render([message])
    return text[text.index("<|im_start|>assistant\n") + 22 : -len("<|im_end|>\n")]


def changed(calls: list[ToolCall], rng: random.Random, how: str) -> list[ToolCall] | None:
    """One perturbation of a reply's calls, or None where it does not apply."""
    if not calls:
        return None
    i = rng.randrange(len(calls))
    call = calls[i]
    if how == "wrong_value" and call.arguments:
        key = rng.choice(sorted(call.arguments))
        value = call.arguments[key]
        wrong = not value if isinstance(value, bool) else "zz_wrong"
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            wrong = value + 7
        return calls[:i] + [ToolCall(call.name, {**call.arguments, key: wrong})] + calls[i + 1 :]
    if how == "missing_argument" and call.arguments:
        key = rng.choice(sorted(call.arguments))
        args = {k: v for k, v in call.arguments.items() if k != key}
        return calls[:i] + [ToolCall(call.name, args)] + calls[i + 1 :]
    if how == "extra_call":
        return calls + [call]
    if how == "out_of_order" and len(calls) > 1:
        return calls[::-1]
    if how == "dropped_call":
        return calls[:i] + calls[i + 1 :]
    if how == "wrong_function":
        return calls[:i] + [ToolCall(call.name + "_x", call.arguments)] + calls[i + 1 :]
    return None


SINGLE = ("wrong_value", "missing_argument", "extra_call", "out_of_order", "wrong_function")
MULTI = ("wrong_value", "dropped_call", "extra_call", "out_of_order")


def variants(world: BFCLEnv, task, rng: random.Random) -> list[tuple[str, list[str]]]:
    """(name, the replies as text) of the ground truth and its perturbations."""
    actions = world.expert_actions(task)
    out = [("ground_truth", [reply_text(a) for a in actions])]
    if CATEGORIES[task.meta["category"]] != MULTI_TURN:
        calls = list(actions[0].tool_calls)
        for how in SINGLE:
            new = changed(calls, rng, how)
            if new is not None:
                out.append((how, [reply_text(Action("", tuple(new)))]))
        out.append(("malformed", ['<tool_call>\n{"name": "x", "arguments": {\n</tool_call>']))
        out.append(("text_reply", ["I cannot help with that."]))
        return out
    with_calls = [i for i, a in enumerate(actions) if a.tool_calls]
    for how in MULTI:
        if not with_calls:
            break
        i = rng.choice(with_calls)
        new = changed(list(actions[i].tool_calls), rng, how)
        if new is not None:
            edited = actions[:i] + [Action("", tuple(new))] + actions[i + 1 :]
            out.append((how, [reply_text(a) for a in edited]))
    return out


def world_verdict(world: BFCLEnv, task, replies: list[str]) -> bool:
    state, _ = world.reset(task, 0)
    for text in replies:
        state, _, _, done, _ = world.step(state, make_action(text))
        if done:
            return state.success
    return False


def bfcl_verdict(world: BFCLEnv, task, replies: list[str]) -> bool:
    """BFCL's evaluation entry point on the same replies (grouped into turns as BFCL's inference
    loop records them: a reply that decodes to no call ends its turn)."""
    runner = entry_points()
    handler = env_bfcl.decoder(world.chat_format)
    _, checked, truth = world.entries[task.id]
    category = task.meta["category"]
    kind = CATEGORIES[category]
    b = env_bfcl.bfcl()
    bfcl_id = checked["id"]
    model = env_bfcl.CHECKER_MODELS[world.tool_style][0].replace("/", "_")
    if kind == MULTI_TURN:
        turns = [[]]
        for text in replies:
            turns[-1].append(text)
            if not env_bfcl.call_strings(make_action(text), world.chat_format):
                turns.append([])
        turns = turns[:-1]
        name = f"nano_skyrl_bench_{uuid.uuid4().hex}"
        try:
            result = runner._evaluate_single_multi_turn_entry(
                handler,
                bfcl_id,
                turns,
                truth["ground_truth"],
                copy.deepcopy(checked),
                name,
                category,
            )
        finally:
            env_bfcl._drop_instances(name, checked)
        return bool(result["valid"])
    if kind != AST:
        result = runner._evaluate_single_relevance_entry(
            handler, bfcl_id, replies[0], checked, model, category
        )
        return bool(result["valid"])
    language = b.enums.Language.PYTHON
    if category == "simple_java":
        language = b.enums.Language.JAVA
    elif category == "simple_javascript":
        language = b.enums.Language.JAVASCRIPT
    result = runner._evaluate_single_ast_entry(
        handler,
        bfcl_id,
        replies[0],
        truth["ground_truth"],
        checked,
        model,
        category,
        language=language,
        return_format=b.enums.ReturnFormat(language.value),
    )
    return bool(result["valid"])


def entry_points():
    """bfcl_eval.eval_checker.eval_runner, imported with the world's stand-in for BFCL's model
    registry (env_bfcl.bfcl)."""
    env_bfcl.bfcl()
    import bfcl_eval.eval_checker.eval_runner as runner

    return runner


def sweep(world: BFCLEnv, per_category: int = 0, seed: int = 0) -> list[dict]:
    """Every variant of every question (per_category > 0: that many questions of each category,
    drawn with `seed`) -> one row each: id, category, variant, the world's and BFCL's verdict."""
    rng = random.Random(seed)
    by_category = defaultdict(list)
    for task_id in world.entries:
        if task_id not in BFCL_SELF_FAILURES:
            by_category[env_bfcl.category_of(task_id)].append(task_id)
    rows = []
    for category, ids in by_category.items():
        if per_category:
            ids = rng.sample(ids, min(per_category, len(ids)))
        for task_id in ids:
            task = world.make_task(task_id)
            for variant, replies in variants(world, task, rng):
                rows.append(
                    {
                        "id": task_id,
                        "category": category,
                        "variant": variant,
                        "world": world_verdict(world, task, replies),
                        "bfcl": bfcl_verdict(world, task, replies),
                    }
                )
    return rows


def ceiling(world: BFCLEnv) -> dict[str, list]:
    """category -> [questions, passed, the ids that failed]."""
    out = {}
    for task_id in world.entries:
        task = world.make_task(task_id)
        row = out.setdefault(task.meta["category"], [0, 0, []])
        row[0] += 1
        try:
            world.demonstration(task, random.Random(0), True)
            row[1] += 1
        except RuntimeError:
            row[2].append(task_id)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--per-category", type=int, default=0, help="questions per category (0: all)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    world = BFCLEnv()
    print("## ceiling: the ground truth replayed as the world's expert\n")
    print("| category | questions | 1.0 | ceiling | failing ids |\n|---|---|---|---|---|")
    for category, (n, passed, failed) in ceiling(world).items():
        shown = ", ".join(f.removeprefix("bfcl/") for f in failed[:8])
        more = f" (+{len(failed) - 8})" if len(failed) > 8 else ""
        print(f"| {category} | {n} | {passed} | {passed / n:.3f} | {shown}{more} |")
    rows = sweep(world, args.per_category, args.seed)
    print("\n## agreement with BFCL's evaluation entry points on the same outputs\n")
    print("| category | outputs | agree | agreement | world passes | BFCL passes |")
    print("|---|---|---|---|---|---|")
    for category in CATEGORIES:
        mine = [r for r in rows if r["category"] == category]
        if mine:
            agree = sum(r["world"] == r["bfcl"] for r in mine)
            passes = sum(r["world"] for r in mine)
            theirs = sum(r["bfcl"] for r in mine)
            print(
                f"| {category} | {len(mine)} | {agree} | {agree / len(mine):.4f} | {passes} | "
                f"{theirs} |"
            )
    agree = sum(r["world"] == r["bfcl"] for r in rows)
    print(f"| all | {len(rows)} | {agree} | {agree / len(rows):.4f} | | |")
    disagreements = [r for r in rows if r["world"] != r["bfcl"]]
    print(f"\ndisagreements: {len(disagreements)}")
    for r in disagreements:
        print(f"  {r['id']} {r['variant']}: world {r['world']}, BFCL {r['bfcl']}")


if __name__ == "__main__":
    main()
