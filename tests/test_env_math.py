"""Tests for env_math.py: the text_math generators, ground truth, rewards and experts, and the
dataset env's loading, splits, reference extraction and answer comparison.

Ground truth comes from outside the code under test: this file reads each generated prompt back with
its own regular expressions and solves it its own way (the running total of a story sentence by
sentence; every permutation of the people of an ordering; every knight/knave assignment of a truth
puzzle), on hand-computed examples first and then on hundreds of generated tasks. The expert and
random policies are played through env.reset / env.step by eval.play_scripted, as `python eval.py
--policy expert` does.
"""

import itertools
import json
import os
import random
import re
import sys

import pytest

from config import load_config
from env import Action, Task, ToolCall, make_env, split_of
from envs import env_math
from envs.env_math import answers_equivalent, extract_reference, to_number
from envs.worlds import read_tasks, write_tasks
from eval import play_scripted
from tools import calculate

from conftest import need


@pytest.fixture(scope="module")
def hard():
    return make_env("text_math", level=3)


def sentences(prompt: str) -> list[str]:
    return re.findall(r"[^.?]+[.?]", prompt.replace("says: ", "says| "))


def fresh(e, task):
    return e.reset(task, seed=0)[0]


def finish(answer):
    return Action(text="", tool_calls=(ToolCall("finish", {"answer": answer}),))


# -----------------------------------------------------------------------------
# Independent solvers: the prompt text in, the answer out


def solve_story(prompt: str) -> tuple[int, list[int]]:
    """-> (answer, running totals), reading the story sentence by sentence."""
    rules = [
        (r"\w+ has (\d+) \w+ of (\d+) \w+\.", lambda a, b: a * b),
        (r"(?:He|She) finds (\d+) \w+\.", lambda t, k: t + k),
        (r"\w+ gives (?:him|her) (\d+) \w+\.", lambda t, k: t + k),
        (r"(?:He|She) buys (\d+) \w+ of (\d+) \w+\.", lambda t, m, c: t + m * c),
        (r"(?:He|She) sells (\d+) \w+ of (\d+) \w+\.", lambda t, m, c: t - m * c),
        (r"(?:He|She) gives (\d+) \w+ to each of (\d+) friends\.", lambda t, k, m: t - k * m),
        (r"(?:He|She) gives (\d+) \w+ to \w+\.", lambda t, k: t - k),
        (r"(?:He|She) loses (\d+) \w+\.", lambda t, k: t - k),
    ]
    *events, question = [s.strip() for s in sentences(prompt)]
    assert re.fullmatch(r"How many \w+ does \w+ have now\?", question), question
    totals = []
    for s in events:
        for pattern, apply in rules:
            m = re.fullmatch(pattern, s)
            if m:
                numbers = [int(x) for x in m.groups()]
                totals.append(apply(*numbers) if not totals else apply(totals[-1], *numbers))
                break
        else:
            raise AssertionError(f"unknown sentence {s!r}")
    return totals[-1], totals


SCALES = {
    "taller": ("tallest", "shortest"),
    "older": ("oldest", "youngest"),
    "faster": ("fastest", "slowest"),
    "heavier": ("heaviest", "lightest"),
}
OPPOSITE = {"shorter": "taller", "younger": "older", "slower": "faster", "lighter": "heavier"}


def solve_ordering(prompt: str) -> tuple[str, int]:
    """-> (answer, number of orders of the people that fit the facts), by trying every
    permutation."""
    *facts, question = [s.strip() for s in sentences(prompt)]
    above = []  # (x, y): x ranks above y
    for fact in facts:
        x, word, y = re.fullmatch(r"(\w+) is (\w+) than (\w+)\.", fact).groups()
        above.append((x, y) if word in SCALES else (y, x))
    people = sorted({p for pair in above for p in pair})
    fits = [
        p for p in itertools.permutations(people) if all(p.index(x) < p.index(y) for x, y in above)
    ]
    k, word = re.fullmatch(r"Who is the (?:(\d)\w\w )?(\w+)\?", question).groups()
    top = any(word == most for most, _ in SCALES.values())
    order = fits[0] if top else fits[0][::-1]
    return order[int(k or 1) - 1], len(fits)


def solve_truth(prompt: str) -> tuple[str, int]:
    """-> (answer, number of knight/knave assignments that fit), by trying all 2^n of them."""
    said = re.findall(r"(\w+) says: ([^.]+)\.", prompt)
    names = [n for n, _ in said]

    def true(sentence, knight):
        if m := re.fullmatch(r"(\w+) is a (knight|knave)", sentence):
            return knight[m[1]] == (m[2] == "knight")
        if m := re.fullmatch(r"(\w+) and (\w+) are (the same kind|different kinds)", sentence):
            return (knight[m[1]] == knight[m[2]]) == (m[3] == "the same kind")
        m = re.fullmatch(r"Exactly (\d) of us (?:is a knight|are knights)", sentence)
        return sum(knight.values()) == int(m[1])

    fits = []
    for bits in itertools.product((False, True), repeat=len(names)):
        knight = dict(zip(names, bits))
        if all(knight[n] == true(s, knight) for n, s in said):
            fits.append(knight)
    if prompt.endswith("How many of them are knights?"):
        return str(sum(fits[0].values())), len(fits)
    who = re.search(r"Is (\w+) a knight or a knave\?$", prompt)[1]
    return ("knight" if fits[0][who] else "knave"), len(fits)


def test_solvers_on_hand_computed_examples():
    story = (
        "Ana has 12 boxes of 8 pens. She gives 15 pens to Ben. She buys 3 boxes of 8 pens. "
        "How many pens does Ana have now?"
    )
    assert solve_story(story) == (105, [96, 81, 105])  # 12*8 = 96, 96-15 = 81, 81+3*8 = 105
    story = (
        "Bo has 2 jars of 5 beads. Cy gives him 4 beads. He gives 3 beads to each of 2 friends. "
        "He loses 7 beads. How many beads does Bo have now?"
    )
    assert solve_story(story) == (1, [10, 14, 8, 1])
    order = "Cy is shorter than Ben. Ana is taller than Ben. Who is the 2nd shortest?"
    assert solve_ordering(order) == ("Ben", 1)  # Ana > Ben > Cy
    # not unique
    assert solve_ordering("Ana is older than Ben. Cy is older than Ben. Who is the oldest?")[1] == 2
    # Ana: "Ben is a knave". Ben: "exactly 2 of us are knights". Only Ana knight, Ben knave fits.
    truth = (
        "Knights always tell the truth and knaves always lie. Ana says: Ben is a knave. "
        "Ben says: Exactly 2 of us are knights. How many of them are knights?"
    )
    assert solve_truth(truth) == ("1", 1)
    assert solve_truth(
        truth.replace("How many of them are knights?", "Is Ben a knight or a knave?")
    ) == ("knave", 1)


# -----------------------------------------------------------------------------
# text_math: generators and ground truth


def test_ground_truth_matches_independent_solvers():
    for level in (1, 2, 3):
        e = make_env("text_math", level=level)
        tasks = e.sample_tasks("train", 300, seed=level)
        assert {t.meta["kind"] for t in tasks} == {"multistep", "ordering", "truth"}
        for t in tasks:
            if t.meta["kind"] == "multistep":
                answer, totals = solve_story(t.prompt)
                assert str(answer) == t.answer and min(totals) >= 0, t
                # the expert's expression is right too
                assert calculate(t.meta["expression"]) == answer, t
            elif t.meta["kind"] == "ordering":
                assert solve_ordering(t.prompt) == (t.answer, 1), t  # the order is unique
            else:
                assert solve_truth(t.prompt) == (t.answer, 1), t  # the solution is unique


def test_level_and_knobs_set_sizes():
    def sizes(e):
        tasks = e.sample_tasks("train", 150, seed=0)
        return {
            kind: {len(sentences(t.prompt)) for t in tasks if t.meta["kind"] == kind}
            for kind in ("multistep", "ordering", "truth")
        }

    # multistep: opening + events + question; ordering: facts + question; truth: rule + speakers +
    # question
    assert sizes(make_env("text_math", level=1)) == {
        "multistep": {4},
        "ordering": {3},
        "truth": {4},
    }
    assert sizes(make_env("text_math", level=2)) == {
        "multistep": {6},
        "ordering": {4},
        "truth": {5},
    }
    assert sizes(make_env("text_math", level=3)) == {
        "multistep": {8},
        "ordering": {6},
        "truth": {6},
    }
    mixed = make_env("text_math", level=1, steps=5, speakers=4)  # explicit knobs win over the level
    assert sizes(mixed) == {"multistep": {7}, "ordering": {3}, "truth": {6}}
    assert mixed.knobs == {"steps": 5, "people": 3, "speakers": 4}


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="unknown kinds"):
        make_env("text_math", kinds=("calculus",))
    with pytest.raises(ValueError, match="weights"):
        make_env("text_math", weights=(1.0,))
    with pytest.raises(ValueError, match="level"):
        make_env("text_math", level=4)
    with pytest.raises(ValueError, match="steps must be an integer in 2..6"):
        make_env("text_math", steps=7)
    with pytest.raises(ValueError, match="people"):
        make_env("text_math", people=2)
    with pytest.raises(ValueError, match="include"):  # the truth expert needs python_eval
        make_env("text_math", tools=("calculator", "finish"))
    with pytest.raises(ValueError, match="split"):
        make_env("text_math").sample_tasks("validation", 1, seed=0)


def test_kinds_weights_and_tools():
    e = make_env("text_math", kinds=("ordering", "truth"), weights=(0.0, 1.0))
    assert {t.meta["kind"] for t in e.sample_tasks("train", 50, seed=0)} == {"truth"}
    assert e.tool_names == ("python_eval", "finish")  # only what the experts use
    assert make_env("text_math", kinds=("ordering",)).tool_names == ("finish",)
    assert make_env("text_math").tool_names == ("calculator", "python_eval", "finish")
    extra = make_env(
        "text_math", kinds=("multistep",), tools=("calculator", "scratchpad", "finish")
    )
    assert [s["function"]["name"] for s in extra.tools()] == ["calculator", "scratchpad", "finish"]


def test_prompts_are_short_and_use_few_names(hard):
    tasks = hard.sample_tasks("train", 600, seed=0)
    assert max(len(t.prompt.split()) for t in tasks) < 80
    capitalized = {w for t in tasks for w in re.findall(r"\b[A-Z][a-z]*\b", t.prompt)}
    other = {"Knights", "Who", "How", "Is", "Exactly", "He", "She"}
    assert capitalized - other <= set(env_math.NAMES) and len(env_math.NAMES) == 30


def test_sample_tasks_deterministic_distinct_and_splits_disjoint(hard):
    a = hard.sample_tasks("train", 300, seed=3)
    assert a == make_env("text_math", level=3).sample_tasks("train", 300, seed=3)
    assert a != hard.sample_tasks("train", 300, seed=4)
    assert hard.sample_tasks("train", 100, seed=3) == a[:100]
    assert len({t.id for t in a}) == len({t.prompt for t in a}) == 300
    train = {t.prompt for s in range(3) for t in hard.sample_tasks("train", 1000, seed=s)}
    test = {t.prompt for s in range(3) for t in hard.sample_tasks("test", 300, seed=s)}
    assert len(test) > 600 and not train & test
    assert all(split_of(p) == "test" for p in test)


def test_tasks_survive_json_lines(hard, tmp_path):
    tasks = hard.sample_tasks("test", 30, seed=0)
    write_tasks(tasks, str(tmp_path / "t.jsonl"))
    assert read_tasks(str(tmp_path / "t.jsonl")) == tasks


# -----------------------------------------------------------------------------
# text_math: rewards and transitions


@pytest.mark.parametrize(
    "truth, answer, reward",
    [
        ("105", "105", 1.0),
        ("105", " 105.0 ", 1.0),
        ("105", "104", 0.0),
        ("105", "105 pens", 0.0),
        ("105", None, 0.0),
        ("Ben", "Ben", 1.0),
        ("Ben", " ben. ", 1.0),
        ("Ben", "'BEN'", 1.0),
        ("Ben", "Bent", 0.0),
        ("Ben", "Ana", 0.0),
        ("Ben", "", 0.0),
        ("knave", "Knave!", 1.0),
        ("knave", "knight", 0.0),
        ("knave", "a knave", 0.0),
    ],
)
def test_score(hard, truth, answer, reward):
    assert hard.score(Task("text_math", "text_math/x", "", truth), answer) == reward


@pytest.mark.parametrize(
    "truth, text, reward",
    [
        ("105", "So she has 105 pens.", 1.0),
        ("105", "It is \\boxed{105} pens, not 7.", 1.0),
        ("105", "7", 0.0),
        ("Ben", "The 2nd tallest is Ben.", 1.0),
        ("Ben", "\\boxed{Ben} then Ana", 1.0),
        ("Ben", "Ana", 0.0),
        ("knave", "I think 3", 0.0),
        ("Ben", "", 0.0),
    ],
)
def test_plain_text_is_the_final_answer(hard, truth, text, reward):
    state = fresh(hard, Task("text_math", "text_math/x", "", truth, {"kind": "ordering"}))
    state, obs, r, done, info = hard.step(state, Action(text=text))
    assert done and obs == [] and r == reward and state.reward == reward and not info["format_ok"]


def test_bad_tool_calls_are_observations_and_the_episode_goes_on(hard):
    task = hard.sample_tasks("test", 1, seed=0)[0]
    state = fresh(hard, task)
    for call, expected in [
        (ToolCall("calculator", {"expression": "import os"}), "Error:"),
        (ToolCall("python_eval", {"code": "open('x')"}), "Error:"),
        (ToolCall("search", {"query": "x"}), "Error: unknown tool"),
        (ToolCall("calculator", {"expr": "1"}), "Error: bad arguments"),
    ]:
        state, obs, reward, done, _ = hard.step(state, Action(text="", tool_calls=(call,)))
        assert not done and reward == 0.0 and obs[0]["content"].startswith(expected)
    assert state.turn == 4 and state.tool_errors == 4
    state, obs, reward, done, info = hard.step(state, finish(task.answer))
    assert done and reward == 1.0 and info["format_ok"] and state.turn == 5


# -----------------------------------------------------------------------------
# text_math: experts and the random floor


def test_hand_made_multistep_demonstration_and_wrong_ground_truth():
    e = make_env("text_math", kinds=("multistep",))
    task = Task(
        "text_math",
        "text_math/x",
        "Ana has 12 boxes of 8 pens. ...",
        "105",
        {"kind": "multistep", "expression": "12 * 8 - 15 + 3 * 8"},
    )
    demo = e.demonstration(task, random.Random(0), True)
    assert [m["role"] for m in demo] == ["system", "user", "assistant", "tool", "assistant"]
    assert demo[3]["content"] == "105"
    assert demo[4]["tool_calls"][0]["function"]["arguments"] == {"answer": "105"}
    with pytest.raises(RuntimeError, match="expected '106'"):  # a demonstration is never wrong
        e.demonstration(
            Task(task.env, task.id, task.prompt, "106", task.meta), random.Random(0), True
        )


def test_demonstrations_with_and_without_tools(hard):
    tasks = hard.sample_tasks("train", 60, seed=5)
    for t in tasks:
        kind = t.meta["kind"]
        with_tools = hard.demonstration(t, random.Random(0), True)
        without = hard.demonstration(t, random.Random(0), False)
        assert [m["role"] for m in without] == ["system", "user", "assistant"] and not without[2][
            "content"
        ]
        assert without[-1]["tool_calls"][0]["function"] == {
            "name": "finish",
            "arguments": {"answer": t.answer},
        }
        assert with_tools[-1]["tool_calls"][0]["function"]["arguments"] == {"answer": t.answer}
        if kind == "ordering":  # one reasoning line that names everyone, and the answer
            line = with_tools[2]["content"]
            assert len(with_tools) == 3 and line.count(",") == 5 and t.answer in line
        else:  # one tool call that prints the answer
            assert [m["role"] for m in with_tools] == [
                "system",
                "user",
                "assistant",
                "tool",
                "assistant",
            ]
            assert with_tools[3]["content"] in (t.answer, f"[{t.answer}]", f"['{t.answer}']")


def test_expert_ceiling_and_random_floor_on_held_out_tasks():
    cfg = load_config("configs/text_math.yaml")
    spec = cfg.envs[0]
    e = make_env(spec.name, **spec.kwargs)
    assert e.knobs == env_math.LEVELS[3]  # the config is the hard level
    tasks = e.sample_tasks("test", 150, seed=cfg.eval_seed)
    expert = play_scripted(e, tasks, "expert", seed=0, max_turns=cfg.rollout.agent.max_turns)
    assert sum(ep["reward"] for ep in expert) / len(expert) >= 0.95
    assert all(ep["done"] and ep["turns"] <= 2 for ep in expert)
    floor = play_scripted(e, tasks, "random", seed=0, max_turns=cfg.rollout.agent.max_turns)
    assert sum(ep["reward"] for ep in floor) / len(floor) < 0.15
    # The expert needs its tool turn: cut to one turn, a multistep or truth episode earns nothing.
    cut = play_scripted(
        e, [t for t in tasks if t.meta["kind"] != "ordering"][:10], "expert", seed=0, max_turns=1
    )
    assert all(ep["reward"] == 0.0 and not ep["done"] for ep in cut)


# -----------------------------------------------------------------------------
# dataset: reference extraction and answer comparison


@pytest.mark.parametrize(
    "field, reference",
    [
        ("She sold 48/2 = <<48/2=24>>24 clips.\n#### 1,234", "1234"),  # GSM8K
        ("So the answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),  # MATH, nested braces
        # the last
        (
            "First \\boxed{3}, then finally \\boxed{\\sqrt{2}+\\frac{3}{4}}.",
            "\\sqrt{2}+\\frac{3}{4}",
        ),
        (" Tuesday ", "Tuesday"),  # short: the text itself
        # the last number
        ("We add the two numbers to get 40 and then we double it, which is 80 in all.", "80"),
        (
            "A long explanation that never states any number at all, only words.",
            "A long explanation that never states any number at all, only words.",
        ),
        (72, "72"),  # a JSON number
    ],
)
def test_extract_reference(field, reference):
    assert extract_reference(field) == reference


@pytest.mark.parametrize(
    "answer, reference, same",
    [
        ("0.5", "\\frac{1}{2}", True),
        ("1/2", "\\dfrac{1}{2}", True),
        ("-\\frac{3}{4}", "-0.75", True),
        ("\\$18.90", "18.9", True),
        ("$1,000", "1000", True),
        ("50\\%", "50", True),
        ("5\\text{ cm}", "5", True),
        ("30^\\circ", "30", True),
        ("30^{\\circ}", "30.0", True),
        ("1\\,000", "1000", True),
        ("42.", "42", True),
        ("The answer is \\boxed{\\frac{6}{8}}", "0.75", True),  # a boxed finish argument
        ("\\left(1, 2\\right)", "(1,2)", True),
        ("\\text{(A)}", "(a)", True),
        ("\\!x + 1", "X+1", True),
        ("0.5", "\\frac{1}{3}", False),
        ("0.333", "\\frac{1}{3}", False),
        ("50\\%", "0.5", False),
        ("12", "1, 2", False),  # a list is not a thousands number
        ("1+x", "x+1", False),
        ("\\sqrt{8}", "2\\sqrt{2}", False),  # no algebra (documented)
        ("1/0", "1/0", True),
        ("", "5", False),
        (None, "5", False),
    ],
)
def test_answers_equivalent(answer, reference, same):
    assert answers_equivalent(answer, reference) is same


def test_to_number():
    assert (
        to_number("\\frac{-2}{4}") == -0.5 and to_number("1/0") is None and to_number("x") is None
    )


# -----------------------------------------------------------------------------
# dataset: loading and its errors


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_loading_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        make_env("dataset", path=str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match="holds no records"):
        make_env("dataset", path=write(tmp_path / "empty.jsonl", ["", "  "]))
    bad = write(tmp_path / "bad.jsonl", ['{"question": "a", "answer": "1"}', "", "{not json"])
    with pytest.raises(ValueError, match="line 3 is not JSON"):
        make_env("dataset", path=bad)
    with pytest.raises(ValueError, match="line 1 is a JSON list"):
        make_env("dataset", path=write(tmp_path / "list.jsonl", ["[1, 2]"]))
    with pytest.raises(ValueError, match=r"no prompt field .*its keys: \['a', 'answer'\]"):
        make_env("dataset", path=write(tmp_path / "keys.jsonl", ['{"a": "x", "answer": "1"}']))
    two = write(
        tmp_path / "two.jsonl",
        ['{"question": "a", "answer": "1"}', '{"question": "b", "sol": "2"}'],
    )
    with pytest.raises(
        ValueError, match=r"line 2 has no \['answer'\] \(its keys: \['question', 'sol'\]\)"
    ):
        make_env("dataset", path=two)
    with pytest.raises(ValueError, match="line 1 has no"):
        make_env("dataset", path=two, answer_key="sol")
    half = write(
        tmp_path / "half.jsonl",
        ['{"q": "a", "answer": "1", "split": "test"}', '{"q": "b", "answer": "2"}'],
    )
    with pytest.raises(ValueError, match="1 of 2 records have a 'split' field"):
        make_env("dataset", path=half, prompt_key="q")
    with pytest.raises(ValueError, match="split 'dev' is not"):
        make_env(
            "dataset",
            path=write(tmp_path / "dev.jsonl", ['{"q": "a", "answer": "1", "split": "dev"}']),
            prompt_key="q",
        )
    with pytest.raises(ValueError, match="empty reference"):
        make_env(
            "dataset",
            path=write(tmp_path / "blank.jsonl", ['{"q": "a", "answer": " "}']),
            prompt_key="q",
        )
    with pytest.raises(ValueError, match="include finish"):
        make_env("dataset", path=bad, tools=("calculator",))


def test_parquet_without_pyarrow_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    with pytest.raises(ImportError, match="pip install pyarrow"):
        make_env("dataset", path=str(tmp_path / "d.parquet"))


def test_parquet_file(tmp_path):
    pa = need("pyarrow", "the .parquet reader")
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table(
            {
                "problem": ["1+1?", "2+2?"],
                "solution": ["\\boxed{2}", "\\boxed{4}"],
                "split": ["train", "test"],
            }
        ),
        str(tmp_path / "d.parquet"),
    )
    e = make_env("dataset", path=str(tmp_path / "d.parquet"))
    assert [t.answer for t in e.tasks["train"]] == ["2"] and [
        t.answer for t in e.tasks["test"]
    ] == ["4"]


def test_keys_splits_and_duplicates(tmp_path):
    math_style = write(
        tmp_path / "math.jsonl",
        [
            json.dumps(
                {
                    "problem": "Half of one?",
                    "solution": "It is $\\boxed{\\frac{1}{2}}$.",
                    "split": "test",
                }
            ),
            json.dumps({"problem": "Two and two?", "solution": "\\boxed{4}", "split": "train"}),
            # first one wins
            json.dumps({"problem": "Two and two?", "solution": "\\boxed{5}", "split": "train"}),
        ],
    )
    e = make_env("dataset", path=math_style)
    assert (e.prompt_key, e.answer_key) == ("problem", "solution")
    assert [t.answer for t in e.tasks["train"]] == ["4"]
    (test,) = e.tasks["test"]
    assert test.id.startswith("dataset/") and test.meta == {"source": "math.jsonl", "line": 1}
    assert e.score(test, "0.5") == 1.0 and e.score(test, "1/3") == 0.0
    # test_path: the second file is the held-out set, and a prompt in both files leaves the training
    # set
    train = write(
        tmp_path / "train.jsonl",
        ['{"prompt": "a?", "answer": "1"}', '{"prompt": "b?", "answer": "2"}'],
    )
    held = write(tmp_path / "test.jsonl", ['{"prompt": "b?", "answer": "2", "split": "train"}'])
    e = make_env(
        "dataset", path=train, test_path=held, system_prompt="Be brief.", tools=("finish",)
    )
    assert [t.prompt for t in e.tasks["train"]] == ["a?"] and [
        t.prompt for t in e.tasks["test"]
    ] == ["b?"]
    assert e.system_prompt() == "Be brief." and e.tool_names == ("finish",)
    # neither: the hash of the prompt decides, as for the generated envs
    e = make_env("dataset", path="data/sample_gsm8k.jsonl")
    assert all(split_of(t.prompt) == s for s in ("train", "test") for t in e.tasks[s])
    assert len(e.tasks["train"]) + len(e.tasks["test"]) == 200 and len(e.tasks["test"]) > 10


def test_dataset_sample_tasks(tmp_path):
    e = make_env("dataset", path="data/sample_gsm8k.jsonl")
    a = e.sample_tasks("train", 50, seed=1)
    assert a == e.sample_tasks("train", 50, seed=1) and a != e.sample_tasks("train", 50, seed=2)
    assert len({t.id for t in a}) == 50 and e.sample_tasks("train", 20, seed=1) == a[:20]
    everything = e.sample_tasks("test", 10_000, seed=0)  # more than there are: all of them
    assert sorted(t.id for t in everything) == sorted(t.id for t in e.tasks["test"])
    with pytest.raises(ValueError, match="split"):
        e.sample_tasks("validation", 1, seed=0)
    only_train = write(tmp_path / "t.jsonl", ['{"q": "a", "answer": "1", "split": "train"}'])
    with pytest.raises(ValueError, match="no test records"):
        make_env("dataset", path=only_train, prompt_key="q").sample_tasks("test", 5, seed=0)


# -----------------------------------------------------------------------------
# dataset: the sample file, the episode, the expert


def test_sample_file_is_generated_and_its_answers_are_right(tmp_path):
    env_math.write_sample_dataset(str(tmp_path / "s.jsonl"), 200, seed=0)
    with open("data/sample_gsm8k.jsonl") as f:
        committed = f.read()
    assert (tmp_path / "s.jsonl").read_text() == committed  # the committed file is this generator's
    records = [json.loads(line) for line in committed.splitlines()]
    assert len(records) == len({r["question"] for r in records}) == 200
    for r in records:
        assert set(r) == {"question", "answer"} and re.search(r"\n#### \d+$", r["answer"])
        assert extract_reference(r["answer"]) == str(solve_story(r["question"])[0])
        for a, b, c in re.findall(r"<<([\d+*-]+)=(\d+)>>(\d+)", r["answer"]):
            # every annotation is right
            assert calculate(a) == int(b) == int(c)


def test_dataset_free_text_and_finish():
    e = make_env("dataset", path="data/sample_gsm8k.jsonl")
    task = Task("dataset", "dataset/x", "Half of one?", "\\frac{1}{2}")
    for text, reward in [
        ("so \\boxed{\\frac{2}{4}}.", 1.0),
        ("It is 0.5", 1.0),
        ("It is 2", 0.0),
        ("no idea", 0.0),
    ]:
        state, obs, r, done, _ = e.step(fresh(e, task), Action(text=text))
        assert done and r == reward and obs == []
    state, obs, r, done, info = e.step(fresh(e, task), finish("\\boxed{0.5}"))
    assert done and r == 1.0 and info["format_ok"]


def test_dataset_expert_and_random_floor():
    cfg = load_config("configs/dataset.yaml")
    spec = cfg.envs[0]
    e = make_env(spec.name, **spec.kwargs)
    tasks = e.sample_tasks("test", spec.eval_size, seed=cfg.eval_seed)
    assert len(tasks) == len(e.tasks["test"])
    for use_tools in (True, False):  # finish-only either way
        demo = e.demonstration(tasks[0], random.Random(0), use_tools)
        assert [m["role"] for m in demo] == ["system", "user", "assistant"]
    expert = play_scripted(e, tasks, "expert", seed=0, max_turns=cfg.rollout.agent.max_turns)
    assert all(ep["reward"] == 1.0 and ep["turns"] == 1 for ep in expert)
    floor = play_scripted(e, tasks, "random", seed=0, max_turns=cfg.rollout.agent.max_turns)
    assert sum(ep["reward"] for ep in floor) / len(floor) < 0.15
    assert os.path.basename(spec.kwargs["path"]) == "sample_gsm8k.jsonl"
