"""env_math.py: two envs for math in words: "text_math" (generated word problems and logic puzzles)
and "dataset" (bring your own JSON-lines or parquet file of problems with reference answers).

text_math: three kinds of problems, each generated from a seed with one difficulty knob.
  - multistep (knob `steps`, 2..6): a story whose running total changes once per event: "Ana has 4
    boxes of 12 pens. She gives 15 pens to Ben. Ben gives her 7 pens. How many pens does Ana have
    now?". Every event adds or removes a number or a product of two numbers that the sentence
    states, so the whole solution is one expression with the story's numbers in story order and no
    parentheses: "4 * 12 - 15 + 7". The ground truth is the running total kept by the generator (no
    eval); every running total is a non-negative integer.
  - ordering (knob `people`, 3..6): "Ana is taller than Ben. Cy is shorter than Ben. Who is the 2nd
    tallest?". The facts are the n-1 comparisons of neighbours in a hidden order, each phrased one
    of two ways, shuffled, so exactly one order fits them. The answer is a name.
  - truth (knob `speakers`, 2..4): knights always tell the truth, knaves always lie; each speaker
    says one thing ("Ben is a knave.", "Ana and Cy are the same kind.", "Exactly 2 of us are
    knights."). Random statements are drawn until exactly one knight/knave assignment of the 2^n
    fits them. The question is "How many of them are knights?" (an integer) or "Is Ben a knight or a
    knave?" (a word).
  `level` sets all three knobs at once (an explicit knob wins over the level):
      level 1: steps=2, people=3, speakers=2 (easy)
      level 2: steps=4, people=4, speakers=3 (the default)
      level 3: steps=6, people=6, speakers=4 (hard: prompts of up to ~60 words)
  Names come from 30 short names and the other words from a few short lists, to keep the vocabulary
  of a tiny model small. Split: by a stable hash of the prompt (env.split_of), as toy_math.
  Tools: by default only those the chosen kinds' experts call (calculator, python_eval) and finish.
  Every schema is rendered into every prompt, and a tool no demonstration uses (scratchpad: no kind
  needs notes across turns) is only a way to waste turns; `tools=` offers more.
  Reward: 1.0 or 0.0. Numeric answers compare with env.answers_match; words and names compare
  case-insensitively after stripping whitespace and punctuation at their ends. Plain text (no tool
  call) is the final answer: its last \\boxed{} if any, else its last number (numeric tasks)
  or word.
  The expert (demonstration with use_tools=True), chosen so that a 0.8 M-parameter model can
  copy it:
  - multistep: calculator("<the story's numbers and operators in story order>"), then
    finish(result). One call, not one per event: each sentence maps to a fixed fragment ("gives 15
    pens" -> "- 15", "buys 3 bags of 8 pens" -> "+ 3 * 8"), so it is copying, and the episode stays
    two turns.
  - ordering: no tool computes an order, so the expert writes one reasoning line in the assistant
    text, the order from the asked end ("Tallest first: Ana, Ben, Cy."), and finishes with its k-th
    name in the same message. The line is the work a tiny model has to learn; the answer is a copy
    from it.
  - truth: python_eval of a brute force that copies each statement into a fixed fragment, with the
    names as 0/1 variables: "[Ana + Ben for Ana in (0, 1) for Ben in (0, 1) if Ana == (Ben == 0) and
    Ben == (Ana + Ben == 1)]" prints "[1]" (for "Is Ben ...": "'knight' if Ben else 'knave'" prints
    "['knave']"); then finish with what is inside the brackets. python_eval allows exactly this
    (names, comprehensions, no calls: sandbox.check_code).
  With use_tools=False the expert calls finish(answer) at once: arithmetic and deduction "in the
  head", the weaker habit that RL should replace by the tool path. Every demonstration runs the
  env's own tools and raises if they disagree with the ground truth.

dataset: problems read from `path` (JSON lines, gzipped or not, or .parquet when pyarrow is
installed). The reference answer is extracted from the answer field (extract_reference: GSM8K's
"#### 72", MATH's last \\boxed{}). Split: `test_path` if given, else a "split" field in every
record, else env.split_of(prompt). Reward 1.0 when the answer is equivalent to the reference
(answers_equivalent: numeric after stripping LaTeX noise, else a normalized string; NOT a full MATH
equivalence checker, see its docstring). The data has no tool traces, so the expert calls
finish(reference) at once, with or without tools.
write_sample_dataset writes a GSM8K-style file from the multistep generator
(data/sample_gsm8k.jsonl).

Imports: tools.py, env.py, envs/worlds.py (and pyarrow, the standard library).
"""

import hashlib
import itertools
import json
import os
import random
import re
import string
from dataclasses import dataclass, replace
from fractions import Fraction

from env import (
    Env,
    EnvState,
    Task,
    ToolCall,
    answers_match,
    assistant_message,
    extract_answer,
    last_boxed,
    parse_number,
    register_env,
    sample_distinct,
    split_of,
    tool_message,
)
from envs.worlds import read_jsonl
from tools import TOOLS

# -----------------------------------------------------------------------------
# Words, the Problem container, and \boxed{} answers (both envs)

_PEOPLE = (
    ("Ana", "she", "her"),
    ("Ben", "he", "him"),
    ("Cy", "he", "him"),
    ("Dan", "he", "him"),
    ("Eve", "she", "her"),
    ("Fay", "she", "her"),
    ("Gus", "he", "him"),
    ("Hal", "he", "him"),
    ("Ivy", "she", "her"),
    ("Jo", "she", "her"),
    ("Kai", "he", "him"),
    ("Lea", "she", "her"),
    ("Max", "he", "him"),
    ("Nia", "she", "her"),
    ("Otto", "he", "him"),
    ("Pam", "she", "her"),
    ("Quin", "he", "him"),
    ("Rex", "he", "him"),
    ("Sue", "she", "her"),
    ("Ted", "he", "him"),
    ("Uma", "she", "her"),
    ("Vic", "he", "him"),
    ("Wes", "he", "him"),
    ("Xia", "she", "her"),
    ("Yan", "he", "him"),
    ("Zoe", "she", "her"),
    ("Amy", "she", "her"),
    ("Bo", "he", "him"),
    # (name, subject, object); names are Python identifiers
    ("Cal", "he", "him"),
    ("Dee", "she", "her"),
)
NAMES = tuple(p[0] for p in _PEOPLE)
_ITEMS = ("pens", "cards", "coins", "stamps", "beads", "shells", "stickers", "marbles")
_CONTAINERS = ("boxes", "bags", "packs", "jars")
_SCALES = (
    ("taller", "shorter", "tallest", "shortest"),
    ("older", "younger", "oldest", "youngest"),
    ("faster", "slower", "fastest", "slowest"),
    ("heavier", "lighter", "heaviest", "lightest"),
)


def ordinal(k: int) -> str:
    """1 -> '1st', 2 -> '2nd', 3 -> '3rd', 4 -> '4th' (k <= 20)."""
    suffix = {1: "st", 2: "nd", 3: "rd"}.get(k, "th")
    return f"{k}{suffix}"


@dataclass(frozen=True)
class Problem:
    """One generated text_math problem, before it becomes a Task."""

    prompt: str  # the user message
    answer: str  # the ground truth: an integer, a name, or "knight" / "knave"
    # JSON-serializable: "kind", and what its expert needs: multistep "expression"; ordering "order"
    # (from the asked end), "word", "k"; truth "code" (the brute force), "knights"
    meta: dict


# -----------------------------------------------------------------------------
# multistep: a running total, one event per sentence


@dataclass(frozen=True)
class Story:
    """A multistep word problem with its worked solution."""

    prompt: str  # the story and its question
    # the opening product, then one signed term per event: ["4 * 12", "- 15", "+ 3 * 8"]
    terms: list[str]
    totals: list[int]  # the running total after the opening and after each event (all >= 0)


def make_story(rng: random.Random, steps: int) -> Story:
    """A story of `steps` events. Each event states all its numbers (a "+ 3 * 8" event says "buys 3
    bags of 8 pens"), so the solution is the numbers in story order; a removal is drawn only when
    the running total can afford it, so no total goes below zero."""
    (name, he, him), other = rng.sample(_PEOPLE, 2)
    item, box = rng.choice(_ITEMS), rng.choice(_CONTAINERS)
    a, b = rng.randint(2, 9), rng.randint(3, 12)
    sentences, terms, totals = [f"{name} has {a} {box} of {b} {item}."], [f"{a} * {b}"], [a * b]
    He, friend = he.capitalize(), other[0]
    for _ in range(steps):
        total = totals[-1]
        k, m = rng.randint(2, 20), rng.randint(2, 5)
        c = rng.randint(2, 12)
        events = [
            (f"{He} finds {k} {item}.", "+", f"{k}", k),
            (f"{friend} gives {him} {k} {item}.", "+", f"{k}", k),
            (f"{He} buys {m} {box} of {c} {item}.", "+", f"{m} * {c}", m * c),
        ]
        if total >= k:
            events += [
                (f"{He} gives {k} {item} to {friend}.", "-", f"{k}", k),
                (f"{He} loses {k} {item}.", "-", f"{k}", k),
            ]
        if total >= m * c:
            events.append((f"{He} sells {m} {box} of {c} {item}.", "-", f"{m} * {c}", m * c))
        if total >= k * m:
            events.append(
                (f"{He} gives {k} {item} to each of {m} friends.", "-", f"{k} * {m}", k * m)
            )
        sentence, op, term, value = rng.choice(events)
        sentences.append(sentence)
        terms.append(f"{op} {term}")
        totals.append(total + value if op == "+" else total - value)
    sentences.append(f"How many {item} does {name} have now?")
    return Story(" ".join(sentences), terms, totals)


def _multistep(rng: random.Random, steps: int) -> Problem:
    story = make_story(rng, steps)
    return Problem(
        story.prompt,
        str(story.totals[-1]),
        {"kind": "multistep", "expression": " ".join(story.terms)},
    )


# -----------------------------------------------------------------------------
# ordering: n-1 neighbour comparisons of a hidden order, shuffled


def _ordering(rng: random.Random, people: int) -> Problem:
    order = rng.sample(NAMES, people)  # most ... least
    more, less, most, least = rng.choice(_SCALES)
    facts = [
        f"{hi} is {more} than {lo}." if rng.random() < 0.5 else f"{lo} is {less} than {hi}."
        for hi, lo in zip(order, order[1:])
    ]
    rng.shuffle(facts)
    k, from_top = rng.randint(1, people), rng.random() < 0.5
    word, asked = (most, order) if from_top else (least, order[::-1])
    question = f"Who is the {word}?" if k == 1 else f"Who is the {ordinal(k)} {word}?"
    return Problem(
        " ".join(facts + [question]),
        asked[k - 1],
        {"kind": "ordering", "order": asked, "word": word, "k": k},
    )


# -----------------------------------------------------------------------------
# truth: knights and knaves, kept only when exactly one assignment fits


def _statement(rng: random.Random, speaker: int, n: int) -> tuple:
    """("is", j, 1 | 0) "j is a knight/knave" (j not the speaker: "I am a knave" has no solution),
    ("same" | "diff", j, k) "j and k are the same kind / different kinds" (either may be the
    speaker), or ("count", c) "exactly c of us are knights". "is" is drawn half the time: it is the
    classic, and the easiest, form."""
    kind = rng.choice(("is", "is", "pair", "count"))
    if kind == "is":
        return "is", rng.choice([j for j in range(n) if j != speaker]), rng.randint(0, 1)
    if kind == "pair":
        j, k = sorted(rng.sample(range(n), 2))
        return rng.choice(("same", "diff")), j, k
    return "count", rng.randint(0, n)


def _holds(statement: tuple, bits: tuple[int, ...]) -> bool:
    """Whether `statement` is true when bits[i] == 1 means person i is a knight."""
    kind = statement[0]
    if kind == "is":
        return bits[statement[1]] == statement[2]
    if kind == "same":
        return bits[statement[1]] == bits[statement[2]]
    if kind == "diff":
        return bits[statement[1]] != bits[statement[2]]
    return sum(bits) == statement[1]


def _words(statement: tuple, names: list[str]) -> tuple[str, str]:
    """-> (the sentence a speaker says, the same statement as a Python expression over
    0/1 names)."""
    kind = statement[0]
    if kind == "is":
        who = names[statement[1]]
        return f"{who} is a {'knight' if statement[2] else 'knave'}.", f"({who} == {statement[2]})"
    if kind in ("same", "diff"):
        a, b = names[statement[1]], names[statement[2]]
        return (
            f"{a} and {b} are the same kind."
            if kind == "same"
            else f"{a} and {b} are different kinds.",
            f"({a} {'==' if kind == 'same' else '!='} {b})",
        )
    c = statement[1]
    return (
        f"Exactly {c} of us {'is a knight' if c == 1 else 'are knights'}.",
        f"({' + '.join(names)} == {c})",
    )


def _truth(rng: random.Random, speakers: int) -> Problem:
    names = rng.sample(NAMES, speakers)
    while True:  # 42% of random statement sets have a unique solution at 4 speakers, 58% at 2
        statements = [_statement(rng, i, speakers) for i in range(speakers)]
        fits = [
            bits
            for bits in itertools.product((0, 1), repeat=speakers)
            if all(bits[i] == _holds(s, bits) for i, s in enumerate(statements))
        ]
        if len(fits) == 1:
            break
    (bits,) = fits
    said = [_words(s, names) for s in statements]
    if rng.random() < 0.5:
        question, answer, target = (
            "How many of them are knights?",
            str(sum(bits)),
            " + ".join(names),
        )
    else:
        who = rng.randrange(speakers)
        question, answer = (
            f"Is {names[who]} a knight or a knave?",
            "knight" if bits[who] else "knave",
        )
        target = f"'knight' if {names[who]} else 'knave'"
    code = (
        f"[{target} "
        + " ".join(f"for {x} in (0, 1)" for x in names)
        + " if "
        + " and ".join(f"{x} == {expr}" for x, (_, expr) in zip(names, said))
        + "]"
    )
    prompt = " ".join(
        ["Knights always tell the truth and knaves always lie."]
        + [f"{x} says: {sentence}" for x, (sentence, _) in zip(names, said)]
        + [question]
    )
    return Problem(
        prompt,
        answer,
        {"kind": "truth", "code": code, "knights": [x for x, b in zip(names, bits) if b]},
    )


# -----------------------------------------------------------------------------
# The text_math env

_GENERATORS = {
    "multistep": (_multistep, "steps"),
    "ordering": (_ordering, "people"),
    "truth": (_truth, "speakers"),
}
KNOB_RANGES = {"steps": (2, 6), "people": (3, 6), "speakers": (2, 4)}  # inclusive
LEVELS = {
    1: {"steps": 2, "people": 3, "speakers": 2},
    2: {"steps": 4, "people": 4, "speakers": 3},
    3: {"steps": 6, "people": 6, "speakers": 4},
}
# what each expert calls
_EXPERT_TOOLS = {"multistep": "calculator", "ordering": None, "truth": "python_eval"}


def _ends_stripped(text: str) -> str:
    """'  Ben. ' -> 'ben': whitespace and punctuation off both ends, lower case (names,
    knight/knave)."""
    return text.strip(string.whitespace + string.punctuation).lower()


@register_env("text_math")
class TextMathEnv(Env):
    """Multistep word problems, ordering puzzles and knights-and-knaves puzzles (see the
    module docstring)."""

    def __init__(
        self,
        kinds: tuple[str, ...] = tuple(_GENERATORS),
        weights: tuple[float, ...] | None = None,
        level: int = 2,
        steps: int | None = None,
        people: int | None = None,
        speakers: int | None = None,
        tools: tuple[str, ...] | None = None,
        tool_timeout: float = 2.0,
    ):
        unknown = [k for k in kinds if k not in _GENERATORS]
        if unknown or not kinds:
            raise ValueError(f"unknown kinds {unknown}; choose from {list(_GENERATORS)}")
        if weights is not None and (
            len(weights) != len(kinds) or min(weights) < 0 or sum(weights) <= 0
        ):
            raise ValueError(f"weights {weights} must be one non-negative number per kind {kinds}")
        if level not in LEVELS:
            raise ValueError(f"level must be one of {list(LEVELS)}, not {level!r}")
        knobs = {
            **LEVELS[level],
            **{
                k: v
                for k, v in (("steps", steps), ("people", people), ("speakers", speakers))
                if v is not None
            },
        }
        for knob, (lo, hi) in KNOB_RANGES.items():
            if not (isinstance(knobs[knob], int) and lo <= knobs[knob] <= hi):
                raise ValueError(f"{knob} must be an integer in {lo}..{hi}, not {knobs[knob]!r}")
        needed = [
            t for t in ("calculator", "python_eval") if t in {_EXPERT_TOOLS[k] for k in kinds}
        ] + ["finish"]
        tools = tuple(needed if tools is None else tools)
        missing = [t for t in needed if t not in tools]
        if missing or any(t not in TOOLS for t in tools):
            raise ValueError(
                f"tools {list(tools)} must be registered tools and include {needed} (the expert's)"
            )
        self.kinds = tuple(kinds)  # which generators to draw from
        # their relative odds
        self.weights = tuple(weights) if weights is not None else (1.0,) * len(kinds)
        self.knobs = knobs  # {"steps", "people", "speakers"}: the size of each kind
        self.tool_names = tools  # offered in the prompt; by default only what the experts use
        self.tool_timeout = tool_timeout  # seconds per tool call

    def system_prompt(self) -> str:
        return "Solve the problem. Use a tool if it helps, then call finish with the answer."

    def make_task(self, problem: Problem) -> Task:
        digest = hashlib.sha256(problem.prompt.encode()).hexdigest()
        return Task(
            env=self.name,
            id=f"{self.name}/{digest[:16]}",
            prompt=problem.prompt,
            answer=problem.answer,
            meta=problem.meta,
        )

    def sample_tasks(self, split: str, n: int, seed: int) -> list[Task]:
        """n distinct tasks of `split`, the same for the same (seed, constructor arguments)."""

        def draw(rng: random.Random) -> Task | None:
            kind = rng.choices(self.kinds, self.weights)[0]
            generate, knob = _GENERATORS[kind]
            problem = generate(rng, self.knobs[knob])
            return self.make_task(problem) if split_of(problem.prompt) == split else None

        return sample_distinct(draw, split, n, seed)

    def score(self, task: Task, answer: str | None) -> float:
        if answer is None:
            return 0.0
        if parse_number(task.answer) is not None:
            return 1.0 if answers_match(answer, task.answer) else 0.0
        return 1.0 if _ends_stripped(answer) == _ends_stripped(task.answer) else 0.0

    def on_text(self, state: EnvState, text: str) -> tuple[EnvState, list[dict], float, bool, dict]:
        """Plain text is the final answer: its last \\boxed{}, else its last number (numeric tasks)
        or word."""
        answer = last_boxed(text)
        if answer is None and parse_number(state.task.answer) is not None:
            answer = extract_answer(text)
        elif answer is None:
            words = re.findall(r"[A-Za-z]+", text)
            answer = words[-1] if words else None
        reward = self.score(state.task, answer)
        return (
            replace(state, done=True, answer=answer, reward=reward),
            [],
            reward,
            True,
            {"format_ok": False},
        )

    def demonstration(self, task: Task, rng: random.Random, use_tools: bool) -> list[dict]:
        """The expert conversation (module docstring). `rng` is unused: each task has one
        expert path."""
        state, messages = self.reset(task, seed=0)
        kind, answer, content = task.meta["kind"], task.answer, ""
        if use_tools and kind in ("multistep", "truth"):
            call = (
                ToolCall("calculator", {"expression": task.meta["expression"]})
                if kind == "multistep"
                else ToolCall("python_eval", {"code": task.meta["code"]})
            )
            _, output, error = self.run_tool(state, call)
            answer = output if kind == "multistep" else output.strip("[]'")
            if error is not None or (
                kind == "truth" and output not in (f"[{answer}]", f"['{answer}']")
            ):
                answer = None
            messages += [assistant_message("", [call]), tool_message(call.name, output)]
        elif use_tools:  # ordering: one reasoning line, then the k-th name of it
            order, k = task.meta["order"], task.meta["k"]
            content, answer = (
                f"{task.meta['word'].capitalize()} first: {', '.join(order)}.",
                order[k - 1],
            )
        if answer is None or self.score(task, answer) != 1.0:
            # never train on a demonstration that is wrong
            raise RuntimeError(
                f"the {kind} expert answers {answer!r} for {task.id}, expected {task.answer!r}"
            )
        messages.append(assistant_message(content, [ToolCall("finish", {"answer": answer})]))
        return messages


# -----------------------------------------------------------------------------
# dataset: reference answers and the comparison of answers

# an answer field at most this long (with no "####" or \boxed) is the answer itself
SHORT_ANSWER_CHARS = 40
_TEXT_MACRO = re.compile(r"\\(?:text|textbf|textrm|mbox|mathrm)\s*\{([^{}]*)\}")
_LATEX_NOISE = re.compile(r"\\left|\\right|\\[!,;: ]|\^\s*\{?\\circ\}?|\\circ|\\?[%$]|\s")
_FRACTION = re.compile(r"(-?)(?:\\frac\{(-?\d+)\}\{(-?\d+)\}|(-?\d+)/(-?\d+))")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def extract_reference(text: str) -> str:
    """The reference answer in a dataset's answer field: what follows the last "####" (GSM8K),
    commas removed; else the last \\boxed{} (MATH); else the field itself when it is short; else its
    last number; else the whole field, stripped."""
    text = str(text)
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().replace(",", "")
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if len(text.strip()) <= SHORT_ANSWER_CHARS:
        return text.strip()
    return extract_answer(text) or text.strip()


def to_number(text: str) -> Fraction | None:
    """The exact value of an answer written as a number with LaTeX noise, or None.

    Removed first: \\text{...}, \\mbox{...}, \\mathrm{...} groups WITH their content (units:
    "5\\text{ cm}" is 5), \\left, \\right, the spacing macros \\! \\, \\; \\: "\\ ", degrees
    (^\\circ, ^{\\circ}), % and $ (with or without a backslash), whitespace, one trailing period.
    Then accepted: a number that env.parse_number reads ("1e3", "-2.50"; commas only as thousands
    separators, so "1,2" is not 12), "a/b", \\frac{a}{b} (\\dfrac and \\tfrac too), with integer a
    and b and an optional leading minus.
    """
    s = (
        _LATEX_NOISE.sub("", _TEXT_MACRO.sub("", text))
        .replace("\\dfrac", "\\frac")
        .replace("\\tfrac", "\\frac")
    )
    s = s[:-1] if s.endswith(".") else s
    m = _FRACTION.fullmatch(s)
    if m:
        numerator, denominator = int(m[2] or m[4]), int(m[3] or m[5])
        return None if denominator == 0 else Fraction(numerator, denominator) * (-1 if m[1] else 1)
    if "," in s and not _THOUSANDS.fullmatch(s):
        return None
    return parse_number(s)


def normalize_answer(text: str) -> str:
    """The string form compared when an answer is not a number: \\text{x} (and \\mbox, \\mathrm ...)
    -> x, then the same removals as to_number (\\left \\right, spacing macros, degrees, % $, ALL
    whitespace), one trailing period, \\dfrac and \\tfrac -> \\frac, lower case: "\\text{(A)}" and
    "(a)" are equal."""
    s = (
        _LATEX_NOISE.sub("", _TEXT_MACRO.sub(r"\1", text))
        .replace("\\dfrac", "\\frac")
        .replace("\\tfrac", "\\frac")
    )
    return (s[:-1] if s.endswith(".") else s).lower()


def answers_equivalent(answer: str | None, reference: str) -> bool:
    """Whether a model's answer (a finish argument; its last \\boxed{} counts if it has one) equals
    the
    reference: exactly as numbers when both are numbers (to_number), else as normalized strings.

    This is NOT a full MATH equivalence checker. Not handled: algebra ("x+1" vs "1+x", "2\\sqrt{2}"
    vs "\\sqrt{8}"), \\pi, intervals and sets in another order, matrices, mixed numbers
    ("1\\frac{1}{2}"), \\frac12 without braces, a rounded decimal against a fraction (0.333 is not
    1/3), a percentage against a decimal (50\\% is 50, not 0.5), units outside \\text{} ("5 cm" is
    not 5), "2\\times10^3".
    """
    if answer is None:
        return False
    boxed = last_boxed(answer)
    answer = boxed if boxed is not None else answer
    a, r = to_number(answer), to_number(reference)
    if a is not None and r is not None:
        return a == r
    return normalize_answer(answer) == normalize_answer(reference)


# -----------------------------------------------------------------------------
# dataset: reading records


def read_records(path: str) -> list[tuple[int, dict]]:
    """(line number, record) of each non-blank line of a JSON-lines file (worlds.read_jsonl: gzipped
    or not), or (row number, record) of a .parquet file. ValueError: a missing or empty file, a line
    that is not a JSON object (which line)."""
    if not os.path.isfile(path):
        raise ValueError(f"dataset file {path!r} does not exist")
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError(
                f"reading {path} needs pyarrow, which is not installed: pip install pyarrow"
            ) from None
        records = list(enumerate(pq.read_table(path).to_pylist(), 1))
    else:
        records = read_jsonl(path)
    if not records:
        raise ValueError(f"dataset file {path!r} holds no records")
    return records


def _pick_key(
    given: str | None, candidates: tuple[str, ...], record: dict, what: str, path: str
) -> str:
    if given is not None:
        return given
    for key in candidates:
        if key in record:
            return key
    raise ValueError(
        f"{path}: no {what} field among {list(candidates)} in the first record (its keys: "
        f"{sorted(record)}); name it with {what}_key="
    )


@register_env("dataset")
class DatasetEnv(Env):
    """Problems and reference answers from a file (see the module docstring)."""

    file_kwargs = ("path", "test_path")

    def __init__(
        self,
        path: str,
        test_path: str | None = None,
        prompt_key: str | None = None,
        answer_key: str | None = None,
        system_prompt: str | None = None,
        tools: tuple[str, ...] = ("calculator", "finish"),
        tool_timeout: float = 2.0,
    ):
        if "finish" not in tools or any(t not in TOOLS for t in tools):
            raise ValueError(f"tools {list(tools)} must be registered tools and include finish")
        files = [(path, read_records(path))] + (
            [(test_path, read_records(test_path))] if test_path else []
        )
        first = files[0][1][0][1]
        # problem field
        self.prompt_key = _pick_key(
            prompt_key, ("problem", "question", "prompt"), first, "prompt", path
        )
        # reference field
        self.answer_key = _pick_key(answer_key, ("answer", "solution"), first, "answer", path)
        self.path, self.test_path = path, test_path  # where the records come from
        self.tool_names = tuple(tools)  # offered in the prompt
        self.tool_timeout = tool_timeout  # seconds per tool call
        self._system_prompt = (
            system_prompt or "Solve the problem, then call finish with the final answer."
        )
        tasks = {"train": [], "test": []}
        for file, records in files:
            with_split = sum("split" in r for _, r in records)
            if test_path is None and 0 < with_split < len(records):
                raise ValueError(
                    f"{file}: {with_split} of {len(records)} records have a 'split' field; "
                    "all or none must"
                )
            for number, record in records:
                task = self._task(file, number, record)
                if test_path is not None:
                    split = "train" if file == path else "test"
                elif with_split:
                    split = record["split"]
                    if split not in tasks:
                        raise ValueError(
                            f"{file} line {number}: split {split!r} is not 'train' or 'test'"
                        )
                else:
                    split = split_of(task.prompt)
                tasks[split].append(task)
        test_prompts = {t.prompt for t in tasks["test"]}
        self.tasks = {
            split: self._distinct(ts, test_prompts if split == "train" else set())
            # split -> tasks in file order, each prompt once
            for split, ts in tasks.items()
        }

    def _task(self, file: str, number: int, record: dict) -> Task:
        missing = [k for k in (self.prompt_key, self.answer_key) if k not in record]
        if missing:
            raise ValueError(f"{file} line {number} has no {missing} (its keys: {sorted(record)})")
        prompt, reference = (
            str(record[self.prompt_key]).strip(),
            extract_reference(record[self.answer_key]),
        )
        if not prompt or not reference:
            raise ValueError(
                f"{file} line {number}: empty {'problem' if not prompt else 'reference answer'}"
            )
        digest = hashlib.sha256(prompt.encode()).hexdigest()
        return Task(
            env=self.name,
            id=f"{self.name}/{digest[:16]}",
            prompt=prompt,
            answer=reference,
            meta={"source": os.path.basename(file), "line": number},
        )

    @staticmethod
    def _distinct(tasks: list[Task], exclude: set[str]) -> tuple[Task, ...]:
        """The first task of each prompt, minus prompts in `exclude` (a train prompt that is also a
        test prompt is dropped from train, so the splits never overlap)."""
        seen = set(exclude)
        return tuple(t for t in tasks if not (t.prompt in seen or seen.add(t.prompt)))

    def system_prompt(self) -> str:
        return self._system_prompt

    def sample_tasks(self, split: str, n: int, seed: int) -> list[Task]:
        """min(n, available) distinct tasks of `split` in an order shuffled by `seed` (a prefix of
        the same seed's longer sample). Fewer than n is not an error: training asks for a batch
        every step, and a small file should still train; an empty split asked for tasks is one
        (ValueError)."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', not {split!r}")
        pool = list(self.tasks[split])
        if not pool and n > 0:
            raise ValueError(f"the dataset {self.path!r} has no {split} records")
        random.Random(seed).shuffle(pool)
        return pool[:n]

    def score(self, task: Task, answer: str | None) -> float:
        return 1.0 if answers_equivalent(answer, task.answer) else 0.0

    def on_text(self, state: EnvState, text: str) -> tuple[EnvState, list[dict], float, bool, dict]:
        """Plain text is the final answer: its last \\boxed{} (nested braces), else its
        last number."""
        answer = extract_answer(text)
        reward = self.score(state.task, answer)
        return (
            replace(state, done=True, answer=answer, reward=reward),
            [],
            reward,
            True,
            {"format_ok": False},
        )

    def demonstration(self, task: Task, rng: random.Random, use_tools: bool) -> list[dict]:
        """finish(reference) at once, with or without tools: the data holds answers, not tool
        traces. `rng` and `use_tools` are unused. Raises if the reference does not score
        as correct."""
        if self.score(task, task.answer) != 1.0:
            raise RuntimeError(f"the reference {task.answer!r} of {task.id} does not match itself")
        _, messages = self.reset(task, seed=0)
        return messages + [assistant_message("", [ToolCall("finish", {"answer": task.answer})])]


# -----------------------------------------------------------------------------
# A GSM8K-style sample file, generated (not real GSM8K data)


def write_sample_dataset(path: str, n: int, seed: int) -> None:
    """n distinct multistep stories (2..4 events) as GSM8K-style JSON lines: {"question", "answer"},
    the answer a worked solution with <<calculator>> annotations and a final "#### <number>"
    line."""
    rng, seen, lines = random.Random(seed), set(), []
    while len(lines) < n:
        story = make_story(rng, rng.randint(2, 4))
        if story.prompt in seen:
            continue
        seen.add(story.prompt)
        first = story.terms[0]
        steps = [f"{first} = <<{first.replace(' ', '')}={story.totals[0]}>>{story.totals[0]}"]
        for term, before, after in zip(story.terms[1:], story.totals, story.totals[1:]):
            steps.append(f"{before} {term} = <<{before}{term.replace(' ', '')}={after}>>{after}")
        lines.append(
            json.dumps(
                {
                    "question": story.prompt,
                    "answer": "\n".join(steps + [f"#### {story.totals[-1]}"]),
                }
            )
        )
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    # Regenerate the sample file: python -m envs.env_math data/sample_gsm8k.jsonl 200 --seed 0
    import argparse

    p = argparse.ArgumentParser(
        description="write a GSM8K-style sample dataset from the multistep generator"
    )
    p.add_argument("out")
    p.add_argument("n", type=int)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    write_sample_dataset(a.out, a.n, a.seed)
    print(f"wrote {a.n} records to {a.out}")
