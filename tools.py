"""tools.py: the tools an agent calls: the name -> Tool registry TOOLS, filled by `@tool` with
OpenAI-style JSON schemas, and the built-in tools python_eval, finish, calculator (exact arithmetic,
no Python) and scratchpad (notes in the EnvState); validate_arguments checks a call's arguments
against its tool's schema. A world registers its own tools the same way (the code worlds'
python_exec is envs/env_code.py's).

A world adds a tool by decorating `fn(env, state, **arguments) -> (state, text, error_kind | None)`
with `@tool(name, description, parameters)` and naming it in its Env's `tool_names`; env.py's Env
dispatches the calls.

Imports: sandbox.py (and the standard library).
"""

import ast
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from fractions import Fraction

# The sandbox behind python_eval, and the bounded parser calculate uses.
from sandbox import SANDBOX, parse_python


@dataclass(frozen=True)
class Tool:
    """A callable the model can name: `fn(env, state, **arguments) -> (state, text, error_kind)`,
    error_kind None when the call succeeded.

    The env is passed so tools can use env resources (a search index, a simulated world); the state
    so a tool can change the episode (finish sets done). Error kinds: "unknown_tool", "bad_args"
    (from dispatch), "refused", "error", "timeout" (from the tool).
    """

    name: str  # what the model calls, and the key in TOOLS
    description: str  # keep it to a few words: the schemas are rendered into every prompt
    parameters: dict  # JSON schema of the arguments object
    fn: Callable  # fn(env, state, **arguments) -> (state, text, error_kind | None)
    # True: fn returns within env.tool_timeout by itself (it kills its own child process, or cannot
    # block), so Env.run_tool calls it directly, not in a watchdog thread
    bounded: bool = False

    def schema(self) -> dict:
        """The OpenAI-style function schema."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


TOOLS: dict[str, Tool] = {}  # filled at import by @tool (tests add and remove their own)


def tool(name: str, description: str, parameters: dict, bounded: bool = False):
    """Decorator: register `fn` as the tool `name` in TOOLS."""

    def register(fn):
        if name in TOOLS:
            raise ValueError(f"tool {name!r} is registered twice")
        TOOLS[name] = Tool(name, description, parameters, fn, bounded)
        return fn

    return register


@tool(
    "python_eval",
    "Run Python code and return the result.",
    {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    bounded=True,
)
def python_eval(env, state, code):
    """Run `code` in the shared sandbox; the state is unchanged."""
    text, kind = SANDBOX.run(code, timeout=env.tool_timeout)
    return state, text, kind


@tool(
    "finish",
    "Submit the final answer.",
    {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
    bounded=True,
)
def finish(env, state, answer):
    """Record the answer and end the episode; Env.step scores it and emits no observation for it."""
    return replace(state, done=True, answer=answer), "", None


CALC_MAX_CHARS = 500  # longer expressions are refused before parsing
# every intermediate numerator and denominator stays below 2**4096 (~1233 digits)
CALC_MAX_BITS = 4096
_CALC_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: Fraction(a // b),
    ast.Mod: lambda a, b: a % b,
}


def calculate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression of numbers, + - * / // % ** (or ^), unary minus
    and parentheses.

    Its own evaluator over the AST, never Python's eval, with Fractions, so 0.1 + 0.2 is exactly
    3/10. Bounded: CALC_MAX_CHARS of input, integer exponents, CALC_MAX_BITS per value (checked
    before a power is computed, so 9**9**9 is refused at once). Raises ValueError or
    ZeroDivisionError.
    """
    if len(expression) > CALC_MAX_CHARS:
        raise ValueError(f"expression longer than {CALC_MAX_CHARS} characters")
    try:
        tree = parse_python(expression.replace("^", "**").strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ValueError("not an arithmetic expression") from None

    def small(x: Fraction) -> Fraction:
        if max(x.numerator.bit_length(), x.denominator.bit_length()) > CALC_MAX_BITS:
            raise ValueError(f"a value is larger than 2**{CALC_MAX_BITS}")
        return x

    def value(node, depth: int) -> Fraction:
        if depth > 100:
            raise ValueError("expression nested too deeply")
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return small(Fraction(node.value))
        if isinstance(node, ast.Constant) and type(node.value) is float:
            if not math.isfinite(node.value):
                raise ValueError(f"a value is larger than 2**{CALC_MAX_BITS}")
            return small(Fraction(repr(node.value)))  # a float literal as written: 0.1 is 1/10
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            x = value(node.operand, depth + 1)
            return -x if isinstance(node.op, ast.USub) else x
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            base, exponent = value(node.left, depth + 1), value(node.right, depth + 1)
            if exponent.denominator != 1:
                raise ValueError("only integer exponents are exact")
            if abs(base) == 1:  # (+-1) ** n without computing n multiplications
                return base ** (int(exponent) % 2)
            size = max(base.numerator.bit_length(), base.denominator.bit_length())
            # the result would have more than CALC_MAX_BITS bits
            if (size - 1) * abs(exponent) >= CALC_MAX_BITS:
                raise ValueError(f"a value is larger than 2**{CALC_MAX_BITS}")
            # at most size * |exponent| <= 2 * CALC_MAX_BITS bits
            return small(base ** int(exponent))
        if isinstance(node, ast.BinOp) and type(node.op) in _CALC_OPS:
            return small(
                _CALC_OPS[type(node.op)](value(node.left, depth + 1), value(node.right, depth + 1))
            )
        raise ValueError("only numbers, + - * / // % ** and parentheses are allowed")

    return value(tree.body, 0)


def format_exact(x: Fraction) -> str:
    """'84', '7/2 = 3.5' (a terminating decimal), '1/3 ≈ 0.333333333333'."""
    if x.denominator == 1:
        return str(x.numerator)
    for k in range(21):  # 10**k divisible by the denominator: the decimal terminates after k digits
        if 10**k % x.denominator == 0:
            digits = str(abs(x.numerator) * 10**k // x.denominator).rjust(k + 1, "0")
            return (
                f"{x.numerator}/{x.denominator} = {'-' if x < 0 else ''}{digits[:-k]}.{digits[-k:]}"
            )
    try:
        return f"{x.numerator}/{x.denominator} ≈ {float(x):.12g}"
    except OverflowError:
        return f"{x.numerator}/{x.denominator}"


@tool(
    "calculator",
    "Exact arithmetic: + - * / // % ** ( ).",
    {
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
    },
    bounded=True,
)
def calculator(env, state, expression):
    """Evaluate `expression` exactly (calculate); the state is unchanged."""
    try:
        return state, format_exact(calculate(expression)), None
    except ZeroDivisionError:
        return state, "Error: division by zero", "error"
    except ValueError as e:
        return state, f"Error: {e}", "error"


MAX_NOTES = 20  # notes per episode
MAX_NOTE_CHARS = 500  # characters per note


@tool(
    "scratchpad",
    "Write a note, or read all notes.",
    {
        "type": "object",
        "properties": {
            "action": {"type": "string", "enum": ["write", "read"]},
            "text": {"type": "string"},
        },
        "required": ["action"],
    },
    bounded=True,
)
def scratchpad(env, state, action, text=""):
    """Notes that live in the episode's state (EnvState.notes): "write" appends `text`, "read" lists
    them."""
    if action == "read":
        return (
            state,
            "\n".join(f"{i}. {note}" for i, note in enumerate(state.notes, 1)) or "(no notes)",
            None,
        )
    if action != "write":
        return state, f'Error: unknown action {action[:40]!r}; use "write" or "read".', "bad_args"
    if not text.strip():
        return state, 'Error: nothing to write: give the note as "text".', "bad_args"
    if len(text) > MAX_NOTE_CHARS:
        return (
            state,
            f"Error: a note holds at most {MAX_NOTE_CHARS} characters, not {len(text)}.",
            "error",
        )
    if len(state.notes) >= MAX_NOTES:
        return state, f"Error: the scratchpad is full ({MAX_NOTES} notes).", "error"
    return replace(state, notes=state.notes + (text,)), f"Saved note {len(state.notes) + 1}.", None


_JSON_TYPES = {
    "string": str,
    "number": (int, float),
    "integer": int,
    "boolean": bool,
    "object": dict,
    "array": list,
}


def validate_arguments(parameters: dict, arguments) -> tuple[dict | None, str | None]:
    """Check `arguments` against a (flat) JSON schema -> (arguments, None) or (None, what is
    wrong)."""
    if not isinstance(arguments, dict):
        return None, "arguments must be a JSON object"
    properties = parameters.get("properties", {})
    missing = [k for k in parameters.get("required", []) if k not in arguments]
    unknown = [k for k in arguments if k not in properties]
    if missing or unknown:
        expected = ", ".join(f'"{k}": {p.get("type", "any")}' for k, p in properties.items())
        problem = f"missing {missing}" if missing else f"unexpected {unknown}"
        return None, f"bad arguments: {problem}; expected {{{expected}}}"
    checked = {}
    for key, value in arguments.items():
        kind = properties[key].get("type")
        if kind == "string" and isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)  # {"answer": 57} for {"answer": "57"}: a harmless slip, accepted
        if kind in _JSON_TYPES and not isinstance(value, _JSON_TYPES[kind]):
            return None, f"bad arguments: {key!r} must be a {kind}"
        checked[key] = value
    return checked, None
