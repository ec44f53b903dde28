"""env_code.py: the `code` env, a light function-writing benchmark graded by unit tests in
the sandbox.

The task: "Write a function f(x) that returns 3 * x + 7. Example: f(2) == 13." The model submits
Python source that defines f; the env runs it against the instance's unit tests in the
python_exec sandbox.

Generation. FAMILIES holds 59 problem families in three levels (20, 21 and 18 of them): 1 = a
one-line expression, 2 = a comprehension or a builtin (sum, max, sorted, all...), 3 = a loop or a
small algorithm. The `level` knob keeps the families up to that level; `families` names the ones to
use. A family is a prompt template, a reference-solution template (1-4 lines of body) and a
test-case generator over a few parameters drawn at random (constants, operators, thresholds,
letters, separators), so each family yields 50 to 1800 distinct instances. The expected outputs come
from a plain Python function per family (`truth`), written apart from the reference template and
differently where the problem allows (tests/test_env_code.py checks that every reference passes its
own tests: the two agree). An instance is a function of (family, parameters) alone: the prompt's
example call and the unit tests are drawn from an RNG seeded by a hash of both, and the example is
the first unit test.

Split. By env.split_of, a stable hash of the prompt text. The prompt is a function of the
parameters, so held-out tasks are NEW PARAMETERIZATIONS of the same families (unseen constants,
letters, operators), not unseen families. `holdout_families` gives the harder family-level split:
those families never appear in "train", and "test" draws only from them (whatever their hash).

Submitting. `finish(answer=<code>)`, or a plain-text reply: its last ``` fenced block (or the whole
text when it has none) is the submission (on_text). python_exec is there to try code
before finishing.

Reward. 1.0 if every unit test passes, else 0.0. The final step's info carries "metrics"
(pass_fraction k/n, syntax_error, timeout, score_seconds) and "test_error" (the first failure; ""
when all pass). Grading builds ONE program: a harness function defined first (it captures print and
repr before the submission can rebind them), the submission, then a call that runs every test case
under its own try/except and prints one line "RESULT <nonce> <passed> <first failure>". Each result
is copied into plain data (the sandbox's plain_copier) before it is compared, so an object of the
submission's own class whose __eq__ always says True passes nothing. The nonce is fresh for each
grading (from `secrets`, not a seeded RNG: it must be unguessable), and only that line is read, so a
submission that prints "passed 8/8" cannot forge the result; its own print() is silenced anyway. A
syntax error is caught before any process starts. A submission that defines no f, raises, loops
forever (the sandbox's wall-clock limit, env.tool_timeout), prints megabytes or tries something the
sandbox refuses scores 0 with a short error, never an exception. A grading costs one fresh sandbox
process: ~50 ms on an idle core, ~150 ms on a busy 2-core machine. The humaneval env
(env_humaneval.py) grades through the same run_grading, with a harness of its own.

Expert. use_tools=True: python_exec(reference + the prompt's example call), whose output must be the
prompt's example result (checked), then finish(answer=reference). use_tools=False: finish(answer=
reference) at once, the shorter path that never tests its code.
Imports: sandbox.py, tools.py, env.py, envs/sandbox_exec.py (and the standard library).
"""

import ast
import hashlib
import math
import random
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import accumulate, combinations

from env import (
    Action,
    Env,
    EnvState,
    Task,
    ToolCall,
    assistant_message,
    register_env,
    sample_distinct,
    split_of,
    tool_message,
)
from envs.sandbox_exec import PLAIN_COPIER_SRC, ExecLimits, execute_python
from sandbox import parse_python
from tools import tool


# -----------------------------------------------------------------------------
# Problem families


@dataclass(frozen=True)
class Family:
    """One parameterized problem family. Templates are str.format strings over the parameters."""

    name: str  # unique, e.g. "linear"
    level: int  # 1 expression, 2 comprehension / builtin, 3 loop / algorithm
    signature: str  # f's parameters, e.g. "x" or "xs"
    text: str  # what f returns, e.g. "{a} * x + {b}"
    body: str  # the reference solution's body (unindented lines)
    truth: Callable[..., object]  # (params, *args) -> the expected output, plain Python
    params: Callable[[random.Random], dict]  # rng -> parameters (JSON values)
    inputs: tuple[Callable, ...]  # one generator (rng, params) -> value per argument of f


def _int(lo: int, hi: int) -> Callable:
    return lambda r, p: r.randint(lo, hi)


def _ints(lo: int = -9, hi: int = 20, short: int = 1, long: int = 6) -> Callable:
    return lambda r, p: [r.randint(lo, hi) for _ in range(r.randint(short, long))]


def _text(short: int = 0, long: int = 8, pool: str = "abxyz") -> Callable:
    """A random string over `pool` plus the letters the parameters name (twice as likely), so
    they occur."""

    def gen(r, p):
        named = "".join(v for v in p.values() if isinstance(v, str) and v.isalpha() and len(v) <= 3)
        return "".join(r.choice(pool + 2 * named) for _ in range(r.randint(short, long)))

    return gen


def _sentence(r: random.Random, p: dict) -> str:
    return " ".join(_text(1, 5)(r, p) for _ in range(r.randint(1, 4)))


def _brackets(r: random.Random, p: dict) -> str:
    """Half random strings over a, b and 'x'; half balanced ones (a random walk of a's and b's,
    closed)."""
    a, b = p["a"], p["b"]
    if r.random() < 0.5:
        return "".join(r.choice(a + b + "x") for _ in range(r.randint(0, 8)))
    out, depth = "", 0
    for _ in range(r.randint(0, 6)):
        up = depth == 0 or r.random() < 0.5
        out, depth = out + (a if up else b), depth + (1 if up else -1)
    return out + b * depth


def _letters(r: random.Random, k: int) -> list[str]:
    return r.sample("abcdefghijklmnopqrstuvwxyz", k)


def _digits(x: int, base: int) -> list[int]:
    """The digits of x >= 0 in `base`, most significant first ([] for 0)."""
    return _digits(x // base, base) + [x % base] if x else []


def _fib(a: int, b: int, n: int) -> int:
    seq = [a, b]
    while len(seq) <= n:
        seq.append(seq[-1] + seq[-2])
    return seq[n]


def _balanced(s: str, a: str, b: str) -> bool:
    depths = [s[:i].count(a) - s[:i].count(b) for i in range(len(s) + 1)]
    return min(depths) >= 0 and depths[-1] == 0


def _shift(s: str, k: int) -> str:
    abc = "abcdefghijklmnopqrstuvwxyz"
    return s.translate(str.maketrans(abc, abc[k % 26 :] + abc[: k % 26]))


def _halvings(x: int, d: int, t: int) -> int:
    return 0 if x < t else 1 + _halvings(x // d, d, t)


SEPARATORS = [",", ";", "-", "+", "/", "|", "_", ":", " "]
F = Family
# One family per entry, always in four lines: name, level, signature, prompt text / reference body /
# truth(params, *args) / parameter sampler, argument generators.
FAMILIES: tuple[Family, ...] = (
    # --- level 1: one-line expressions
    F(
        "linear",
        1,
        "x",
        "{a} * x + {b}",
        "return {a} * x + {b}",
        lambda p, x: p["a"] * x + p["b"],
        lambda r: {"a": r.randint(2, 9), "b": r.randint(1, 30)},
        (_int(-20, 20),),
    ),
    F(
        "linear_neg",
        1,
        "x",
        "{b} - {a} * x",
        "return {b} - {a} * x",
        lambda p, x: p["b"] - p["a"] * x,
        lambda r: {"a": r.randint(2, 9), "b": r.randint(1, 30)},
        (_int(-20, 20),),
    ),
    F(
        "quadratic",
        1,
        "x",
        "x * x + {a} * x + {b}",
        "return x * x + {a} * x + {b}",
        lambda p, x: x**2 + p["a"] * x + p["b"],
        lambda r: {"a": r.randint(1, 9), "b": r.randint(0, 20)},
        (_int(-10, 10),),
    ),
    F(
        "two_args",
        1,
        "x, y",
        "{a} * x - {b} * y",
        "return {a} * x - {b} * y",
        lambda p, x, y: p["a"] * x - p["b"] * y,
        lambda r: {"a": r.randint(1, 12), "b": r.randint(2, 12)},
        (_int(-9, 9), _int(-9, 9)),
    ),
    F(
        "shifted_mod",
        1,
        "x",
        "(x + {a}) % {m}",
        "return (x + {a}) % {m}",
        lambda p, x: divmod(x + p["a"], p["m"])[1],
        lambda r: {"a": r.randint(1, 9), "m": r.randint(2, 20)},
        (_int(0, 99),),
    ),
    F(
        "floor_div",
        1,
        "x",
        "x // {a} + {b}",
        "return x // {a} + {b}",
        lambda p, x: math.floor(x / p["a"]) + p["b"],
        lambda r: {"a": r.randint(2, 9), "b": r.randint(0, 20)},
        (_int(-30, 99),),
    ),
    F(
        "larger",
        1,
        "x",
        "the larger of x and {a}",
        "return max(x, {a})",
        lambda p, x: x if x > p["a"] else p["a"],
        lambda r: {"a": r.randint(-60, 60)},
        (_int(-70, 70),),
    ),
    F(
        "distance",
        1,
        "x",
        "the distance between x and {a}",
        "return abs(x - {a})",
        lambda p, x: x - p["a"] if x >= p["a"] else p["a"] - x,
        lambda r: {"a": r.randint(-60, 60)},
        (_int(-70, 70),),
    ),
    F(
        "remainder_is",
        1,
        "x",
        "True if x % {m} == {k}, else False",
        "return x % {m} == {k}",
        lambda p, x: divmod(x, p["m"])[1] == p["k"],
        lambda r: {"m": (m := r.randint(2, 15)), "k": r.randrange(m)},
        (_int(0, 60),),
    ),
    F(
        "in_range",
        1,
        "x",
        "True if {lo} <= x <= {hi}, else False",
        "return {lo} <= x <= {hi}",
        lambda p, x: x in range(p["lo"], p["hi"] + 1),
        lambda r: {"lo": (lo := r.randint(-10, 10)), "hi": lo + r.randint(1, 20)},
        (_int(-15, 35),),
    ),
    F(
        "clip",
        1,
        "x",
        "x clipped to the range {lo} to {hi}",
        "return min(max(x, {lo}), {hi})",
        lambda p, x: p["lo"] if x < p["lo"] else p["hi"] if x > p["hi"] else x,
        lambda r: {"lo": (lo := r.randint(-10, 10)), "hi": lo + r.randint(1, 20)},
        (_int(-20, 35),),
    ),
    F(
        "parity_branch",
        1,
        "x",
        "x + {a} if x is even, else x - {b}",
        "return x + {a} if x % 2 == 0 else x - {b}",
        lambda p, x: x - p["b"] if x & 1 else x + p["a"],
        lambda r: {"a": r.randint(1, 20), "b": r.randint(1, 20)},
        (_int(-20, 20),),
    ),
    F(
        "pad",
        1,
        "s",
        "s followed by {k} copies of {c!r}",
        "return s + {c!r} * {k}",
        lambda p, s: s + "".join(p["c"] for _ in range(p["k"])),
        lambda r: {"c": _letters(r, 1)[0], "k": r.randint(1, 9)},
        (_text(),),
    ),
    F(
        "slice",
        1,
        "s",
        "the characters of s from index {i} up to, not including, index {j}",
        "return s[{i}:{j}]",
        lambda p, s: "".join(s[k] for k in range(p["i"], min(p["j"], len(s)))),
        lambda r: {"i": (i := r.randint(0, 9)), "j": i + r.randint(1, 9)},
        (_text(0, 15),),
    ),
    F(
        "wrap",
        1,
        "s",
        "s with {a!r} added at the front and {b!r} at the end",
        "return {a!r} + s + {b!r}",
        lambda p, s: "".join([p["a"], s, p["b"]]),
        lambda r: {"a": _letters(r, 1)[0], "b": _letters(r, 1)[0]},
        (_text(),),
    ),
    F(
        "replace",
        1,
        "s",
        "s with every {a!r} replaced by {b!r}",
        "return s.replace({a!r}, {b!r})",
        lambda p, s: "".join(p["b"] if c == p["a"] else c for c in s),
        lambda r: dict(zip("ab", _letters(r, 2))),
        (_text(),),
    ),
    F(
        "count_two",
        1,
        "s",
        "the number of characters of s that are {a!r} or {b!r}",
        "return s.count({a!r}) + s.count({b!r})",
        lambda p, s: sum(c in (p["a"], p["b"]) for c in s),
        lambda r: dict(zip("ab", sorted(_letters(r, 2)))),
        (_text(),),
    ),
    F(
        "index_times",
        1,
        "xs",
        "the element of xs at index {i}, times {a}",
        "return xs[{i}] * {a}",
        lambda p, xs: sum(xs[p["i"]] for _ in range(p["a"])),
        lambda r: {"i": r.randint(0, 3), "a": r.randint(2, 40)},
        (_ints(short=4, long=6),),
    ),
    F(
        "upper_if_long",
        1,
        "s",
        "s in upper case if it has more than {k} characters, else s + {c!r}",
        "return s.upper() if len(s) > {k} else s + {c!r}",
        lambda p, s: "".join(chr(ord(c) - 32) for c in s) if len(s) > p["k"] else s + p["c"],
        lambda r: {"k": r.randint(1, 8), "c": _letters(r, 1)[0]},
        (_text(),),
    ),
    F(
        "power",
        1,
        "x",
        "x ** {k} - {b}",
        "return x ** {k} - {b}",
        lambda p, x: math.prod([x] * p["k"]) - p["b"],
        lambda r: {"k": r.randint(2, 3), "b": r.randint(0, 60)},
        (_int(-9, 9),),
    ),
    # --- level 2: a comprehension or a builtin
    F(
        "sum_greater",
        2,
        "xs",
        "the sum of the elements of xs greater than {t}",
        "return sum(x for x in xs if x > {t})",
        lambda p, xs: sum(sorted(xs)[len([x for x in xs if x <= p["t"]]) :]),
        lambda r: {"t": r.randint(-30, 50)},
        (_ints(-30, 60),),
    ),
    F(
        "count_less",
        2,
        "xs",
        "the number of elements of xs less than {t}",
        "return len([x for x in xs if x < {t}])",
        lambda p, xs: sum(x < p["t"] for x in xs),
        lambda r: {"t": r.randint(-20, 60)},
        (_ints(-30, 60),),
    ),
    F(
        "map_linear",
        2,
        "xs",
        "the list of {a} * x + {b} for each x in xs",
        "return [{a} * x + {b} for x in xs]",
        lambda p, xs: list(map(lambda x: p["a"] * x + p["b"], xs)),
        lambda r: {"a": r.randint(2, 9), "b": r.randint(1, 20)},
        (_ints(),),
    ),
    F(
        "keep_remainder",
        2,
        "xs",
        "the elements x of xs with x % {m} == {k}, in order",
        "return [x for x in xs if x % {m} == {k}]",
        lambda p, xs: list(filter(lambda x: divmod(x, p["m"])[1] == p["k"], xs)),
        lambda r: {"m": (m := r.randint(2, 13)), "k": r.randrange(m)},
        (_ints(0, 40, 1, 8),),
    ),
    F(
        "top_below",
        2,
        "xs",
        "the {k} largest elements of xs that are below {t}, largest first",
        "return sorted([x for x in xs if x < {t}], reverse=True)[:{k}]",
        lambda p, xs: sorted((x for x in xs if x < p["t"]), key=lambda x: -x)[: p["k"]],
        lambda r: {"k": r.randint(1, 4), "t": r.randint(0, 20)},
        (_ints(-9, 30, 1, 8),),
    ),
    F(
        "max_plus",
        2,
        "xs",
        "the largest element of xs plus {a}",
        "return max(xs) + {a}",
        lambda p, xs: sorted(xs)[-1] + p["a"],
        lambda r: {"a": r.randint(1, 99)},
        (_ints(),),
    ),
    F(
        "min_times",
        2,
        "xs",
        "the smallest element of xs times {a}",
        "return min(xs) * {a}",
        lambda p, xs: sorted(xs)[0] * p["a"],
        lambda r: {"a": r.randint(2, 99)},
        (_ints(),),
    ),
    F(
        "all_between",
        2,
        "xs",
        "True if every element of xs is between {lo} and {hi} inclusive, else False",
        "return all({lo} <= x <= {hi} for x in xs)",
        lambda p, xs: not [x for x in xs if x < p["lo"] or x > p["hi"]],
        lambda r: {"lo": (lo := r.randint(0, 20)), "hi": lo + r.randint(5, 25)},
        (lambda r, p: [r.randint(p["lo"] - 3, p["hi"] + 3) for _ in range(r.randint(1, 4))],),
    ),
    F(
        "any_multiple",
        2,
        "xs",
        "True if some element of xs is a multiple of {m} greater than {t}, else False",
        "return any(x % {m} == 0 and x > {t} for x in xs)",
        lambda p, xs: bool([x for x in xs if x > p["t"] and not divmod(x, p["m"])[1]]),
        lambda r: {"m": r.randint(2, 9), "t": r.randint(0, 20)},
        (_ints(0, 40, 1, 5),),
    ),
    F(
        "words_with",
        2,
        "s",
        "the words of s that start with {c!r}, joined by {sep!r}",
        "return {sep!r}.join(w for w in s.split() if w.startswith({c!r}))",
        lambda p, s: p["sep"].join(w for w in s.split() if w[0] == p["c"]),
        lambda r: {"c": _letters(r, 1)[0], "sep": r.choice(SEPARATORS)},
        (_sentence,),
    ),
    F(
        "word_heads",
        2,
        "s",
        "the first {k} letters of each word of s, joined by {sep!r}",
        "return {sep!r}.join(w[:{k}] for w in s.split())",
        lambda p, s: p["sep"].join(
            "".join(w[i] for i in range(min(p["k"], len(w)))) for w in s.split()
        ),
        lambda r: {"k": r.randint(1, 8), "sep": r.choice(SEPARATORS)},
        (_sentence,),
    ),
    F(
        "drop_two",
        2,
        "s",
        "s without the characters {a!r} and {b!r}",
        "return ''.join(c for c in s if c not in ({a!r}, {b!r}))",
        lambda p, s: s.replace(p["a"], "").replace(p["b"], ""),
        lambda r: dict(zip("ab", sorted(_letters(r, 2)))),
        (_text(),),
    ),
    F(
        "distinct_above",
        2,
        "xs",
        "the distinct elements of xs greater than {t}, in {order} order",
        "return sorted(set(x for x in xs if x > {t}){rev})",
        lambda p, xs: sorted(
            dict.fromkeys(x for x in xs if x > p["t"]), reverse=p["order"] == "decreasing"
        ),
        lambda r: {
            "t": r.randint(-20, 40),
            "order": (o := r.choice(["increasing", "decreasing"])),
            "rev": ", reverse=True" if o == "decreasing" else "",
        },
        (_ints(-20, 45, 1, 8),),
    ),
    F(
        "word_lengths",
        2,
        "s",
        "the list of the lengths of the words of s, each plus {a}",
        "return [len(w) + {a} for w in s.split()]",
        lambda p, s: [sum(1 for _ in w) + p["a"] for w in s.split()],
        lambda r: {"a": r.randint(1, 99)},
        (_sentence,),
    ),
    F(
        "zip_combine",
        2,
        "xs, ys",
        "the list of x {op} {a} * y for x, y in zip(xs, ys)",
        "return [x {op} {a} * y for x, y in zip(xs, ys)]",
        lambda p, xs, ys: [
            xs[i] + (1 if p["op"] == "+" else -1) * p["a"] * ys[i]
            for i in range(min(len(xs), len(ys)))
        ],
        lambda r: {"op": r.choice("+-"), "a": r.randint(2, 40)},
        (_ints(-9, 9, 1, 4), _ints(-9, 9, 1, 4)),
    ),
    F(
        "range_list",
        2,
        "n",
        "the list of {a} * i + {b} for i from 0 to n - 1",
        "return [{a} * i + {b} for i in range(n)]",
        lambda p, n: list(range(p["b"], p["b"] + p["a"] * n, p["a"])),
        lambda r: {"a": r.randint(1, 9), "b": r.randint(0, 9)},
        (_int(0, 9),),
    ),
    F(
        "sum_floordiv",
        2,
        "xs",
        "the sum of the elements of xs divided by {d}, rounded down",
        "return sum(xs) // {d}",
        lambda p, xs: math.floor(math.fsum(xs) / p["d"]),
        lambda r: {"d": r.randint(2, 99)},
        (_ints(-20, 60),),
    ),
    F(
        "count_in",
        2,
        "s",
        "the number of characters of s that are in {chars!r}",
        "return sum(1 for c in s if c in {chars!r})",
        lambda p, s: len(s) - len(s.translate({ord(c): None for c in p["chars"]})),
        lambda r: {"chars": "".join(sorted(_letters(r, 3)))},
        (_text(),),
    ),
    F(
        "count_multiples",
        2,
        "n",
        "the number of integers from 1 to n divisible by {a} or {b}",
        "return len([i for i in range(1, n + 1) if i % {a} == 0 or i % {b} == 0])",
        lambda p, n: n // p["a"] + n // p["b"] - n // math.lcm(p["a"], p["b"]),
        lambda r: dict(zip("ab", sorted(r.sample(range(2, 16), 2)))),
        (_int(0, 60),),
    ),
    F(
        "sort_by_distance",
        2,
        "xs",
        "xs sorted by distance to {a}, closest first, ties in their original order",
        "return sorted(xs, key=lambda x: abs(x - {a}))",
        lambda p, xs: [
            x for _, _, x in sorted((max(x - p["a"], p["a"] - x), i, x) for i, x in enumerate(xs))
        ],
        lambda r: {"a": r.randint(-30, 40)},
        (_ints(-30, 40, 1, 6),),
    ),
    F(
        "power_sum",
        2,
        "n",
        "the sum of i ** {k} for i from {a} to n",
        "return sum(i ** {k} for i in range({a}, n + 1))",
        lambda p, n: sum(math.prod([i] * p["k"]) for i in range(p["a"], n + 1)),
        lambda r: {"k": r.randint(1, 4), "a": r.randint(0, 20)},
        (_int(0, 25),),
    ),
    # --- level 3: a loop or a small algorithm
    F(
        "product_mod",
        3,
        "n",
        "the product of the integers from {a} to n, modulo {m}",
        "p = 1\nfor i in range({a}, n + 1):\n    p = p * i % {m}\nreturn p",
        lambda p, n: math.factorial(n) // math.factorial(p["a"] - 1) % p["m"] if n >= p["a"] else 1,
        lambda r: {"a": r.randint(1, 6), "m": r.randint(5, 99)},
        (_int(0, 15),),
    ),
    F(
        "fib_like",
        3,
        "n",
        "term n (from 0) of the sequence {a}, {b}, ... where each term is the sum "
        "of the two before",
        "a, b = {a}, {b}\nfor _ in range(n):\n    a, b = b, a + b\nreturn a",
        lambda p, n: _fib(p["a"], p["b"], n),
        lambda r: {"a": r.randint(0, 19), "b": r.randint(1, 19)},
        (_int(0, 12),),
    ),
    F(
        "digit_count",
        3,
        "x",
        "the number of digits of x in base {b} that equal {d}",
        "return (x % {b} == {d}) + f(x // {b}) if x > 0 else 0",
        lambda p, x: _digits(x, p["b"]).count(p["d"]),
        lambda r: {"b": (b := r.randint(2, 16)), "d": r.randrange(b)},
        (_int(1, 999),),
    ),
    F(
        "gcd_with",
        3,
        "x",
        "the greatest common divisor of x and {a}",
        "a = {a}\nwhile a:\n    x, a = a, x % a\nreturn x",
        lambda p, x: math.gcd(x, p["a"]),
        lambda r: {"a": r.randint(2, 199)},
        (lambda r, p: r.randint(1, 30) * r.choice([1, 2, 3, p["a"]]),),
    ),
    F(
        "running_sums",
        3,
        "xs",
        "the running totals of xs, with the total starting at {a}",
        "out = [{a}]\nfor x in xs:\n    out.append(out[-1] + x)\nreturn out[1:]",
        lambda p, xs: list(accumulate(xs, initial=p["a"]))[1:],
        lambda r: {"a": r.randint(-60, 99)},
        (_ints(-9, 20, 0, 6),),
    ),
    F(
        "divisors_above",
        3,
        "x",
        "the number of divisors of x greater than {a}",
        "return sum(1 for d in range({a} + 1, x + 1) if x % d == 0)",
        lambda p, x: len([d for d in range(1, x + 1) if x % d == 0 and d > p["a"]]),
        lambda r: {"a": r.randint(0, 60)},
        (_int(1, 150),),
    ),
    F(
        "longest_run",
        3,
        "s",
        "the length of the longest run of consecutive characters of s that are {a!r} or {b!r}",
        "runs = [0]\nfor c in s:\n    runs.append(runs[-1] + 1 if c in ({a!r}, {b!r}) else 0)\n"
        "return max(runs)",
        lambda p, s: max(map(len, re.findall(f"[{p['a']}{p['b']}]*", s))),
        lambda r: dict(zip("ab", sorted(_letters(r, 2)))),
        (_text(0, 10),),
    ),
    F(
        "pair_count",
        3,
        "xs",
        "the number of pairs i < j with xs[i] {op} xs[j] == {t}",
        "return sum(1 for i in range(len(xs)) for j in range(i + 1, len(xs)) "
        "if xs[i] {op} xs[j] == {t})",
        lambda p, xs: sum(
            (x + y if p["op"] == "+" else x - y) == p["t"] for x, y in combinations(xs, 2)
        ),
        lambda r: {"op": r.choice("+-"), "t": r.randint(-10, 30)},
        (_ints(-10, 20, 2, 7),),
    ),
    F(
        "caesar",
        3,
        "s",
        "s with every letter moved {k} places {way} in the alphabet, wrapping around",
        "return ''.join(chr((ord(c) - 97 {op} {k}) % 26 + 97) for c in s)",
        lambda p, s: _shift(s, p["k"] if p["way"] == "forward" else -p["k"]),
        lambda r: {
            "k": r.randint(1, 25),
            "way": (w := r.choice(["forward", "back"])),
            "op": "+" if w == "forward" else "-",
        },
        (_text(1, 8, "abcmnoxyz"),),
    ),
    F(
        "first_above",
        3,
        "xs",
        "the index of the first element of xs greater than {t}, or -1 if there is none",
        "for i, x in enumerate(xs):\n    if x > {t}:\n        return i\nreturn -1",
        lambda p, xs: next((i for i, x in enumerate(xs) if x > p["t"]), -1),
        lambda r: {"t": r.randint(-20, 45)},
        (_ints(-20, 50, 0, 7),),
    ),
    F(
        "geometric",
        3,
        "n",
        "the sum of {a} * {q} ** i for i from 0 to n - 1",
        "total = 0\nfor i in range(n):\n    total += {a} * {q} ** i\nreturn total",
        lambda p, n: p["a"] * (p["q"] ** n - 1) // (p["q"] - 1),
        lambda r: {"a": r.randint(1, 20), "q": r.randint(2, 7)},
        (_int(0, 8),),
    ),
    F(
        "rises",
        3,
        "xs",
        "the number of positions i where xs[i + 1] - xs[i] > {t}",
        "return sum(1 for a, b in zip(xs, xs[1:]) if b - a > {t})",
        lambda p, xs: len([i for i in range(len(xs) - 1) if xs[i + 1] - xs[i] > p["t"]]),
        lambda r: {"t": r.randint(-20, 40)},
        (_ints(-20, 50, 0, 7),),
    ),
    F(
        "balanced",
        3,
        "s",
        "True if s has as many {a!r} as {b!r} "
        "and no prefix of s has more {b!r} than {a!r}, else False",
        "depth = [0]\nfor c in s:\n    depth.append(depth[-1] + (c == {a!r}) - (c == {b!r}))\n"
        "return min(depth) >= 0 and depth[-1] == 0",
        lambda p, s: _balanced(s, p["a"], p["b"]),
        lambda r: dict(zip("ab", _letters(r, 2))),
        (_brackets,),
    ),
    F(
        "max_streak",
        3,
        "xs",
        "the length of the longest run of consecutive elements of xs greater than {t}",
        "runs = [0]\nfor x in xs:\n    runs.append(runs[-1] + 1 if x > {t} else 0)\n"
        "return max(runs)",
        lambda p, xs: max(
            j - i
            for i in range(len(xs) + 1)
            for j in range(i, len(xs) + 1)
            if all(x > p["t"] for x in xs[i:j])
        ),
        lambda r: {"t": r.randint(-10, 50)},
        (_ints(-10, 55, 0, 8),),
    ),
    F(
        "nth_index",
        3,
        "s",
        "the index of occurrence number {k} of {c!r} in s, or -1 if there are fewer",
        "found = [i for i, ch in enumerate(s) if ch == {c!r}]\n"
        "return found[{i}] if len(found) > {i} else -1",
        lambda p, s: ([i for i, ch in enumerate(s) if ch == p["c"]] + [-1] * p["k"])[p["k"] - 1],
        lambda r: {"k": (k := r.randint(1, 4)), "i": k - 1, "c": _letters(r, 1)[0]},
        (_text(0, 12),),
    ),
    F(
        "stable_partition",
        3,
        "xs",
        "xs with the elements greater than {t} moved to the end, "
        "keeping the order within each part",
        "return [x for x in xs if x <= {t}] + [x for x in xs if x > {t}]",
        lambda p, xs: sorted(xs, key=lambda x: x > p["t"]),
        lambda r: {"t": r.randint(-30, 60)},
        (_ints(-30, 60, 0, 7),),
    ),
    F(
        "smallest_divisor",
        3,
        "x",
        "the smallest divisor of x greater than {a}",
        "d = {a} + 1\nwhile x % d:\n    d += 1\nreturn d",
        lambda p, x: min(d for d in range(p["a"] + 1, x + 1) if x % d == 0),
        lambda r: {"a": r.randint(1, 99)},
        (lambda r, p: r.randint(p["a"] + 1, p["a"] + 100),),
    ),
    F(
        "halvings",
        3,
        "x",
        "the number of times x must be replaced by x // {d} until it is less than {t}",
        "n = 0\nwhile x >= {t}:\n    x, n = x // {d}, n + 1\nreturn n",
        lambda p, x: _halvings(x, p["d"], p["t"]),
        lambda r: {"d": r.randint(2, 5), "t": r.randint(1, 30)},
        (_int(0, 1000),),
    ),
)
FAMILY = {f.name: f for f in FAMILIES}


def reference_code(family: Family, params: dict) -> str:
    """The reference solution: 'def f(<signature>):' and the filled-in body, indented."""
    body = family.body.format(**params)
    return f"def f({family.signature}):\n" + "\n".join("    " + line for line in body.split("\n"))


def call_text(args: list) -> str:
    """'f(3, [1, 2])': a call of f as Python source."""
    return "f(" + ", ".join(repr(a) for a in args) + ")"


# -----------------------------------------------------------------------------
# Grading: one sandboxed program per submission

# Defined BEFORE the submission, so its default arguments hold the real print, repr and plain (the
# sandbox's plain_copier) whatever the submission rebinds; its body reads only locals. The
# submission's own print() is then silenced, so nothing it prints can push the result line out of
# the output cap. Its one line longer than 100 columns is split across two string literals
# (the text is the same).
HARNESS = (
    PLAIN_COPIER_SRC + """def check_NONCE(fn, cases, out=print, repr=repr, Exception=Exception,
                 plain=plain_copier()):
    passed, first = 0, ""
    for args, expected in cases:
        call = "f(%s)" % repr(args)[1:-1]
        try:
            got = fn(*args)
        except Exception as e:
            first = first or "%s raised %s" % (call, repr(e)[:80])
            continue
        except:  # an exception class of the submission's own, derived from BaseException
            first = first or "%s did not return" % call
            continue
        try:
            if plain(got) == expected:  # both plain data: no __eq__ of the submission's choosing
                passed += 1
            elif not first:
                first = "%s returned %s, expected %s" % (call, repr(got)[:60], repr(expected))
        except Exception as e:
            first = first or "%s returned a value that cannot be compared: %s" """
    """% (call, repr(e)[:80])
        except:
            first = first or "%s returned a value that cannot be compared" % call
    out("RESULT NONCE", passed, first)
print = lambda *args, **kwargs: None
"""
)
MAX_SUBMISSION_CHARS = 4000  # longer submissions score 0 without being compiled or run


def grading_program(code: str, cases: list, nonce: str) -> str:
    """The program that grades `code`: harness, submission, then one call over all cases [[args,
    expected]]."""
    return HARNESS.replace("NONCE", nonce) + code + f"\ncheck_{nonce}(f, {cases!r})\n"


@dataclass(frozen=True)
class Grade:
    """The outcome of running one submission against its task's tests (the code env's unit tests, or
    HumanEval's check(), which counts as one test: it stops at its first failed assert)."""

    passed: int  # tests passed
    total: int  # tests run
    error: str  # the first failure, or why nothing ran ("" when all passed)
    syntax_error: bool  # the submission does not compile (nothing was run)
    timeout: bool  # the program ran past the wall-clock limit (or the CPU limit)
    seconds: float  # wall-clock time of the grading, process start included
    # the name metrics() gives passed / total (humaneval: "passed", 0 or 1)
    metric: str = "pass_fraction"

    @property
    def reward(self) -> float:
        return 1.0 if self.total and self.passed == self.total else 0.0

    def metrics(self) -> dict[str, float]:
        return {
            self.metric: self.passed / max(self.total, 1),
            "syntax_error": float(self.syntax_error),
            "timeout": float(self.timeout),
            "score_seconds": self.seconds,
        }


def grade(code: str | None, cases: list, timeout_s: float) -> Grade:
    """Run `code` against `cases` ([[args, expected], ...]) in a fresh python_exec sandbox
    -> Grade."""
    return run_grading(
        code, lambda nonce: grading_program(code, cases, nonce), len(cases), timeout_s
    )


def run_grading(
    code: str | None,
    program: Callable[[str], str],
    total: int,
    timeout_s: float,
    *,
    max_chars: int = MAX_SUBMISSION_CHARS,
    stub: str = "",
    metric: str = "pass_fraction",
    limit_program: bool = True,
) -> Grade:
    """The grading of every world that runs submitted code (code, humaneval) -> Grade of
    `total` tests.

    An empty submission, or one longer than `max_chars`, scores 0 unrun; so does one that does not
    compile after `stub` (the problem's own code that the program puts before it). Then
    program(nonce), whose harness prints "RESULT <nonce> <passed> <first failure>", runs in a fresh
    python_exec sandbox, and only that line is read. limit_program=False: no limit on the program's
    length (all of it but the submission, whose length is checked here, is the dataset's)."""
    start = time.perf_counter()

    def failed(error: str, syntax: bool = False, timeout: bool = False) -> Grade:
        return Grade(0, total, error[:200], syntax, timeout, time.perf_counter() - start, metric)

    if code is None or not code.strip():
        return failed("no code was submitted")
    if len(code) > max_chars:
        return failed(f"the submission is longer than {max_chars} characters")
    try:
        # compiled, never run, here: a syntax error is reported with the submission's own
        # line numbers
        compile(stub + "\n" + code if stub else code, "<submission>", "exec")
    except SyntaxError as e:
        line = (e.lineno or 0) - (stub.count("\n") + 1 if stub else 0)
        return failed(
            f"SyntaxError: {e.msg}" + (f" (line {line})" if line > 0 else ""), syntax=True
        )
    except (ValueError, RecursionError, MemoryError, OverflowError) as e:
        # null bytes, absurd nesting
        return failed(f"cannot compile: {type(e).__name__}", syntax=True)
    nonce = secrets.token_hex(8)
    source = program(nonce)
    limits = ExecLimits() if limit_program else ExecLimits(max_code_chars=len(source))
    text, kind = execute_python(source, timeout_s=timeout_s, limits=limits)
    result = re.search(rf"^RESULT {nonce} (\d+) ?(.*)$", text, re.MULTILINE)
    if result is None:
        # the harness never reported: the submission raised, timed out, was refused...
        if kind is None:
            # ... or printed so much (despite the silenced print) that the line was cut off
            return failed("the tests did not report: the program's output was too long")
        return failed(text.removeprefix("Error: ").split("\n")[0], timeout=kind == "timeout")
    passed = int(result.group(1))
    return Grade(passed, total, result.group(2), False, False, time.perf_counter() - start, metric)


# ```python, ```py, bare ```; closed or not
_FENCE = re.compile(r"```[^`\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(text: str) -> str:
    """The code in a plain-text reply: its last ``` fenced block (closed, or cut off by the token
    limit), else the whole text (a tiny model may write bare code)."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


# -----------------------------------------------------------------------------
# The env and its tool


@tool(
    "python_exec",
    "Run a Python program in a fresh sandbox.",
    {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    bounded=True,
)
def python_exec(env, state, code):
    """Run `code` as a whole program in its own sandboxed process (execute_python); the state is
    unchanged. The code worlds offer it (this env and env_humaneval.py): the reference path never
    starts a second sandbox."""
    text, kind = execute_python(code, timeout_s=env.tool_timeout)
    return state, text, kind


# Plausible but wrong code: the random policy submits or runs one of these.
JUNK = (
    "def f(x):\n    return x",
    "def f(x):\n    return x + 1",
    "def f(xs):\n    return sum(xs)",
    "def f(xs):\n    return sorted(xs)",
    "def f(s):\n    return s[::-1]",
    "def f(n):\n    return n * 2",
    "def f(x):\n    return 0",
    "def f(x, y):\n    return x + y",
    "print('hello')",
    "def f(s):\n    return s.upper()",
    "f = len",
    "def f(x):\n    return True",
    "def f(xs):\n    return xs[0]",
    "def f(x)\n    return x",
)


@register_env("code")
class CodeEnv(Env):
    """Write f as the prompt asks; reward 1.0 when every unit test passes (see the
    module docstring)."""

    tool_names = ("python_exec", "finish")

    def __init__(
        self,
        level: int = 3,
        families: list[str] | None = None,
        holdout_families: tuple[str, ...] = (),
        n_tests: int = 8,
        tool_timeout: float = 2.0,
    ):
        names = list(families) if families is not None else [f.name for f in FAMILIES]
        unknown = [n for n in [*names, *holdout_families] if n not in FAMILY]
        if unknown:
            raise ValueError(f"unknown families {unknown}; choose from {sorted(FAMILY)}")
        if level not in (1, 2, 3):
            raise ValueError(f"level must be 1, 2 or 3, not {level!r}")
        if n_tests < 1:
            raise ValueError("n_tests must be at least 1")
        # what tasks are drawn from
        self.families = tuple(n for n in names if FAMILY[n].level <= level)
        # never in "train"; "test" draws only these when set
        self.holdout_families = tuple(holdout_families)
        self.n_tests = n_tests  # unit tests per task (the prompt's example is the first)
        self.tool_timeout = tool_timeout  # seconds per python_exec call and per grading
        if not self.train_families():
            raise ValueError(
                "no family left for training: check level, families and holdout_families"
            )

    def train_families(self) -> list[str]:
        return [n for n in self.families if n not in self.holdout_families]

    def system_prompt(self) -> str:
        return (
            "Write the Python function the user asks for. You may test code with python_exec. "
            "Submit it with finish."
        )

    def make_task(self, family: Family, params: dict) -> Task:
        """The task of (family, params): its example and unit tests come from an RNG seeded by a
        hash of both, so the prompt (hence the split) is a function of the
        parameterization alone."""
        # one order, for the hash and for the input generators
        params = dict(sorted(params.items()))
        key = family.name + repr(params)
        rng = random.Random(int(hashlib.sha256(key.encode()).hexdigest(), 16))
        cases, seen = [], set()
        for _ in range(50 * self.n_tests):
            # distinct inputs; a small input domain may give fewer cases
            args = [gen(rng, params) for gen in family.inputs]
            if repr(args) in seen:
                continue
            seen.add(repr(args))
            case = [args, family.truth(params, *args)]
            if len(cases) < self.n_tests:
                cases.append(case)
            elif case[1] != cases[0][1]:
                # the n outputs so far are all equal (else we stopped): `return
                cases[-1] = case  # <that value>` would pass them, so swap in a case that differs
            if len(cases) == self.n_tests and any(c[1] != cases[0][1] for c in cases):
                break
        example, result = cases[0]
        prompt = (
            f"Write a function f({family.signature}) that returns {family.text.format(**params)}. "
            f"Example: {call_text(example)} == {result!r}."
        )
        digest = hashlib.sha256(prompt.encode()).hexdigest()
        return Task(
            env=self.name,
            id=f"{self.name}/{digest[:16]}",
            prompt=prompt,
            answer=reference_code(family, params),
            meta={"family": family.name, "level": family.level, "params": params, "tests": cases},
        )

    def sample_tasks(self, split: str, n: int, seed: int) -> list[Task]:
        """n distinct tasks of `split`, the same for the same (seed, constructor arguments)."""
        by_family = split == "test" and self.holdout_families
        pool = self.holdout_families if by_family else self.train_families()

        def draw(rng: random.Random) -> Task | None:
            family = FAMILY[rng.choice(pool)]
            task = self.make_task(family, family.params(rng))
            return task if by_family or split_of(task.prompt) == split else None

        return sample_distinct(draw, split, n, seed, ": allow more families")

    def score(self, task: Task, answer: str | None) -> float:
        return self.grade_answer(task, answer)[0]

    def grade_answer(self, task: Task, answer: str | None) -> tuple[float, dict]:
        """Run the unit tests once -> the reward, and for step()'s info: "metrics" (Grade.metrics:
        pass fraction, ...) and "test_error" (the first failure)."""
        result = grade(answer, task.meta["tests"], self.tool_timeout)
        return result.reward, {"metrics": result.metrics(), "test_error": result.error}

    def format_ok(self, answer: str) -> bool:
        """Python that compiles and binds f at the top level (`def f` or `f = ...`); the tests judge
        the rest."""
        try:
            compile(answer, "<submission>", "exec")
        except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
            return False

        def binds_f(node) -> bool:
            if isinstance(node, ast.FunctionDef):
                return node.name == "f"
            return isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "f" for t in node.targets
            )

        return any(binds_f(node) for node in parse_python(answer).body)

    def on_text(self, state: EnvState, text: str) -> tuple[EnvState, list[dict], float, bool, dict]:
        """A reply without a tool call is a submission: its last fenced code block, or the
        whole text."""
        code = extract_code(text)
        reward, extra = self.grade_answer(state.task, code)
        return (
            replace(state, done=True, answer=code, reward=reward),
            [],
            reward,
            True,
            {"format_ok": False, **extra},
        )

    def random_action(self, state: EnvState, rng: random.Random) -> Action:
        """A random tool with a random line of plausible but wrong code."""
        name, code = rng.choice(self.tool_names), rng.choice(JUNK)
        return Action(
            text="",
            tool_calls=(ToolCall(name, {"code" if name == "python_exec" else "answer": code}),),
        )

    def demonstration(self, task: Task, rng: random.Random, use_tools: bool) -> list[dict]:
        """The expert conversation: [python_exec(reference + example call), its output,]
        finish(reference). The output must be repr() of the prompt's example result, or this raises.
        `rng` is unused."""
        state, messages = self.reset(task, seed=0)
        if use_tools:
            args, result = task.meta["tests"][0]
            call = ToolCall("python_exec", {"code": f"{task.answer}\n{call_text(args)}"})
            _, output, kind = self.run_tool(state, call)
            if kind is not None or output != repr(result):
                # never train on a demonstration that is wrong
                raise RuntimeError(
                    f"python_exec gave {output!r} for {task.id}, expected {result!r}"
                )
            messages += [assistant_message("", [call]), tool_message("python_exec", output)]
        messages.append(assistant_message("", [ToolCall("finish", {"answer": task.answer})]))
        return messages
