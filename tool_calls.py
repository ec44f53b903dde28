"""tool_calls.py: the tool-call syntax of the Qwen chat formats: its one writer and its parser.

  tool_call_text(call)     one <tool_call>{"name": ..., "arguments": {...}}</tool_call> block,
                           as render() writes it;
  parse_tool_calls(text)   an assistant message's blocks -> env.ToolCall's, in bounded time; never
                           raises, repairs the JSON mistakes small models make, says what was wrong;
  split_tool_calls(text)   the same reading, plus the content and the calls of the canonical blocks
                           that end the message (what chat.parse_assistant_message gives back).
The writer and the parser's canonical check share tool_call_text, so a message the parser calls well
formed renders back to the very text the policy wrote. chat.py renders and dispatches by chat
format; wings/chat_llama3.py reuses the lenient JSON reader and the bounds for Llama's JSON calls.

Sections: writing | parsing | the lenient JSON reader.
Imports: env.py (ToolCall), and the standard library.
"""

import json
import re
from typing import NamedTuple

from env import ToolCall


# -----------------------------------------------------------------------------
# writing


def tojson(x) -> str:
    # Hugging Face renders chat templates with tojson = json.dumps(x, ensure_ascii=False)
    return json.dumps(x, ensure_ascii=False)


def tool_call_text(tool_call: dict) -> str:
    """One <tool_call> block; `tool_call` is OpenAI-style {"function": {...}} or the bare {"name",
    "arguments"}."""
    fn = tool_call.get("function") or tool_call
    args = fn["arguments"]
    # a JSON string is written as it is, like Qwen3's template
    args = args if isinstance(args, str) else tojson(args)
    return '<tool_call>\n{"name": "' + fn["name"] + '", "arguments": ' + args + "}\n</tool_call>"


# -----------------------------------------------------------------------------
# tool-call parsing
#
# Small models write tool calls badly, and a parser that raises or hangs takes a whole batch down.
# So: parse_tool_calls never raises, reads what can be read, and says what was wrong (env.step runs
# the calls that parsed, reports the problem, counts a parse failure). Each <tool_call> block is
# first read with strict json.loads: a well-formed call parses exactly as it always did. Otherwise
# _LenientJSON repairs what models commonly get wrong: a code fence or text around the object,
# single quotes, True/False/None, trailing commas, raw newlines inside strings, bare keys, and
# missing closing brackets at the end of a block that was closed. A block whose </tool_call> never
# comes (a generation cut by max_tokens, a forgotten tag) still gives its call when its JSON is
# complete. Every repair is reported, so the error is None only for a well-formed message.
#
# A tag written inside a JSON string of a call (python code that prints "</tool_call>") does not end
# the block: when the block's first reading (up to the next tag) gives no call and that tag lies
# inside a double-quoted string (an odd number of unescaped quotes before it), the block runs on to
# the first tag outside its strings, and that longer reading is kept if it gives a call and no text
# after its JSON. A block with an unbalanced quote, whose strings never close or whose longer
# reading fails, keeps its first reading, as before: it cannot swallow the calls after it
# (_string_aware_end).
#
# Several JSON objects in one block ({...}{...}, or one per line) are read as several calls, in
# order, and reported: the format is one object per <tool_call>. WHY run them rather than refuse
# them: the model's intent is plain, each object is checked as strictly as a call in its own block,
# and the env still counts a parse failure, so the policy learns the format without the calls being
# lost.
#
# Bounded time: MAX_PARSE_CHARS of a message are scanned, MAX_BLOCKS blocks and calls read; the
# (pure Python) repairing reader gets MAX_REPAIR_CHARS and MAX_REPAIR_STEPS per block, and reads
# string contents in bulk. Every scan is linear: literal tags, and regexes that are single character
# classes or fixed sequences (nothing that can backtrack). The string-aware reading of a block only
# runs over tags whose segments hold an even number of quotes, so none of those tags starts a
# string-aware reading of its own: the readings overlap at their ends only, and the message is read
# a bounded number of times.

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
# characters of a message scanned for tool calls (the rest is kept as text)
MAX_PARSE_CHARS = 100_000
# <tool_call> blocks read, and calls returned, per message (later ones are reported, not read)
MAX_BLOCKS = 16
MAX_REPAIR_CHARS = 20_000  # a longer block that is not strict JSON is not repaired
MAX_REPAIR_STEPS = 1_000  # values, keys and escapes the repairing reader reads per block (a few ms)
MAX_NAME_CHARS = 64  # a longer tool name is refused
_TAG_RE = re.compile(r"</?tool_call>")
_ESCAPE_PAIR = re.compile(r"\\.", re.S)  # a backslash and the character it escapes
_DECODER = json.JSONDecoder()


def parse_tool_calls(text: str) -> tuple[list[ToolCall], str | None]:
    """Parse the <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks of an assistant
    message.

    Never raises. Returns the calls that could be read (well-formed or repaired, in order) and a
    description of everything malformed, None when all is well formed: invalid JSON (repaired or
    not), a missing or blank name, arguments that are not an object, an unclosed <tool_call>, a
    stray </tool_call>, several objects in one block (each is read as a call). Text without calls ->
    ([], None). {"tool": ..., "args": ...} and arguments given as a JSON-encoded string are accepted
    as well-formed. Unknown tool names parse: the env reports them.
    """
    split = split_tool_calls(text)
    return split.calls, split.error


class _Split(NamedTuple):
    calls: list[ToolCall]  # every call that could be read, in order (parse_tool_calls)
    error: str | None  # everything malformed, or None
    content: str  # the text less the canonical blocks that end it (parse_assistant_message)
    content_calls: list[ToolCall]  # the calls of those blocks


class _Block(NamedTuple):
    start: int  # index of its <tool_call> in the text
    end: int  # index just past its </tool_call> (or where it stopped: the next tag, the end)
    calls: list[ToolCall]  # the calls its JSON gave (several objects: several calls)
    problems: list[str]  # what was wrong with it


def _quote_parity(segment: str) -> int:
    """1 when `segment` holds an odd number of double quotes that a backslash does not escape (it
    leaves a JSON string open, or closes one), else 0. Linear: one C-level pass to drop escape
    pairs, one to count."""
    return _ESCAPE_PAIR.sub("", segment).count('"') & 1


def _string_aware_end(
    scanned: str, tags: list[tuple[int, int, bool]], i: int, complete: bool
) -> int | None:
    """For the block opened by tags[i], whose first segment (up to tags[i + 1] or the end) leaves a
    JSON string open: the index of the first later tag outside its strings (len(tags): the end of
    the text), or None when its strings never close (an unbalanced quote) or the tags beyond `tags`
    were not scanned (complete False)."""
    parity = 1
    for k in range(i + 1, len(tags)):
        if parity == 0:
            return k
        if k + 1 < len(tags):
            stop = tags[k + 1][0]
        elif complete:
            stop = len(scanned)
        else:
            return None
        parity ^= _quote_parity(scanned[tags[k][1] : stop])
    return len(tags) if parity == 0 and complete else None


def _read_block(
    scanned: str, tags: list[tuple[int, int, bool]], i: int, k: int, whole: bool = False
) -> _Block:
    """The block opened by tags[i] and ended by tags[k] (k == len(tags): by the end of the text);
    whole: see _parse_call_body."""
    start, body_start = tags[i][0], tags[i][1]
    if k == len(tags):
        ending = "end"
        stop = len(scanned)
        end = len(scanned)
    else:
        ending = "next" if tags[k][2] else "closed"
        stop = tags[k][0]
        # a </tool_call> is part of the block, a next <tool_call> is not
        end = tags[k][0] if tags[k][2] else tags[k][1]
    calls, problems = _parse_call_body(
        scanned[body_start:stop], closed=ending == "closed", whole=whole
    )
    if ending == "next":
        problems.insert(0, f"<tool_call> at char {start} is not closed before the next one")
    elif ending == "end":
        problems.insert(0, f"<tool_call> at char {start} is not closed (truncated generation?)")
    return _Block(start, end, calls, problems)


def split_tool_calls(text: str) -> _Split:
    """One scan of the message for both parse_tool_calls and parse_assistant_message."""
    scanned = text[:MAX_PARSE_CHARS]
    problems = (
        []
        if len(text) <= MAX_PARSE_CHARS
        else [
            f"message longer than {MAX_PARSE_CHARS} characters: tool calls after that were not read"
        ]
    )
    tags = []  # (start, end, is it <tool_call>) of the first 4 * MAX_BLOCKS tags
    complete = True  # False: more tags follow that were not scanned
    for m in _TAG_RE.finditer(scanned):
        if len(tags) == 4 * MAX_BLOCKS:
            complete = False
            break
        tags.append((m.start(), m.end(), m.group() == TOOL_CALL_OPEN))

    blocks = []
    i = 0  # the tag read next
    while i < len(tags) and len(blocks) < MAX_BLOCKS:
        start, body_start, is_open = tags[i]
        if not is_open:
            problems.append(f"stray </tool_call> at char {start}")
            i += 1
            continue
        if i + 1 == len(tags) and not complete:  # where this block ends was not scanned
            break
        k = i + 1  # the plain reading: the block ends at the next tag
        block = _read_block(scanned, tags, i, k)
        stop = tags[k][0] if k < len(tags) else len(scanned)
        # no call, and a JSON string left open: the tag that ended the block was inside that string
        if not block.calls and _quote_parity(scanned[body_start:stop]):
            k_str = _string_aware_end(scanned, tags, i, complete)
            if k_str is not None:
                longer = _read_block(scanned, tags, i, k_str, whole=True)
                if longer.calls:
                    block, k = longer, k_str
        blocks.append(block)
        problems += block.problems
        # a </tool_call> belongs to its block, a <tool_call> opens the next
        i = k + (k < len(tags) and not tags[k][2])
    calls = [c for b in blocks for c in b.calls]
    if i < len(tags) or not complete or len(calls) > MAX_BLOCKS:
        problems.append(f"more than {MAX_BLOCKS} tool calls: the rest were not read")
        calls = calls[:MAX_BLOCKS]

    # blocks exactly as render() writes them
    canonical = [
        (b.start, b.end, b.calls[0])
        for b in blocks
        if not b.problems
        and len(b.calls) == 1
        and text[b.start : b.end]
        == tool_call_text({"name": b.calls[0].name, "arguments": b.calls[0].arguments})
    ]
    error = "; ".join(problems[:8]) + (
        f"; and {len(problems) - 8} more problems" if len(problems) > 8 else ""
    )
    content, content_calls = text, []
    # the longest run of canonical blocks that ends the message as render() would write it
    for k in range(len(canonical)):
        run = canonical[k:]
        before = text[: run[0][0]]
        # render() adds that "\n" itself
        candidate = before[:-1] if before.endswith("\n") else before
        if (
            candidate + ("\n" if candidate else "") + "\n".join(text[s:e] for s, e, _ in run)
            == text
        ):
            content, content_calls = candidate, [c for _, _, c in run]
            break
    return _Split(calls, error or None, content, content_calls)


def _strict_objects(body: str) -> list[dict] | None:
    """Two to MAX_BLOCKS JSON objects, separated only by whitespace, that fill `body` exactly
    (strict JSON); None when `body` is not that (then the lenient reader has its say)."""
    objs = []
    i = _WS.match(body).end()
    try:
        while i < len(body) and len(objs) < MAX_BLOCKS and body[i] == "{":
            obj, i = _DECODER.raw_decode(body, i)
            objs.append(obj)
            i = _WS.match(body, i).end()
    except (ValueError, RecursionError):
        return None
    return objs if len(objs) > 1 and i == len(body) else None


def _parse_call_body(
    body: str, closed: bool, whole: bool = False
) -> tuple[list[ToolCall], list[str]]:
    """The text between <tool_call> and </tool_call> -> (calls, problems): ([call], []) if well
    formed, the calls and what was repaired if readable, ([], [why not]) if not. Several objects
    give several calls (and a problem).
    closed: the block had its </tool_call>; only then may the lenient reader add missing closing
    brackets (an unclosed block must hold complete JSON). whole: text after the JSON is refused
    rather than ignored (the string-aware reading of a block must not end past its JSON, which would
    hide the calls it ran over)."""
    repairs = []
    try:
        objs = [json.loads(body)]
    except (ValueError, RecursionError) as e:
        # a JSONDecodeError is a ValueError, and deep nesting recurses
        strict_error = f"invalid JSON in tool call: {e}"
        objs = _strict_objects(body)
        if objs is None and len(body) > MAX_REPAIR_CHARS:
            return [], [strict_error + " (too long to repair)"]
        if objs is None:
            try:
                objs, repairs = read_lenient(
                    body, close_at_end=closed, max_values=MAX_BLOCKS, whole=whole
                )
            except ValueError:
                return [], [strict_error]
    calls, problems = [], []
    for obj in objs:
        call, problem, more = call_of(obj)
        if call is None:
            problems.append(problem)
        else:
            calls.append(call)
            repairs += [r for r in more if r not in repairs]
    if len(objs) > 1:
        problems.insert(
            0,
            f"{len(objs)} JSON objects in one <tool_call>, read as {len(calls)} "
            f"call{'' if len(calls) == 1 else 's'} (write one object per <tool_call>)",
        )
    if repairs and calls:
        names = ", ".join(repr(c.name) for c in calls)
        problems.insert(0, f"invalid JSON in tool call {names}, repaired: {', '.join(repairs)}")
    return calls, problems


def call_of(obj) -> tuple[ToolCall | None, str | None, list[str]]:
    """One parsed JSON value -> (call, None, what its arguments string needed repaired) or (None,
    why not, [])."""
    if not isinstance(obj, dict):
        return None, f"tool call is a JSON {type(obj).__name__}, not an object", []
    name = obj.get("name", obj.get("tool"))  # {"name", "arguments"} (Qwen) or {"tool", "args"}
    if not isinstance(name, str) or not name.strip():
        return None, "tool call without a name", []
    if len(name) > MAX_NAME_CHARS:
        return None, f"tool name longer than {MAX_NAME_CHARS} characters", []
    args = obj["arguments"] if "arguments" in obj else obj.get("args")
    repairs = []
    if args is None:  # a call of a function without parameters
        args = {}
    if isinstance(args, str):  # OpenAI-style arguments: a JSON-encoded string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError) as e:
            if len(args) > MAX_REPAIR_CHARS:
                return None, f"tool {name!r}: arguments string is not valid JSON: {e}", []
            try:
                args, repairs = loads_lenient(args, close_at_end=False)
            except ValueError:
                return None, f"tool {name!r}: arguments string is not valid JSON: {e}", []
    if not isinstance(args, dict):
        return None, f"tool {name!r}: arguments are a JSON {type(args).__name__}, not an object", []
    return ToolCall(name=name, arguments=args), None, repairs


# -----------------------------------------------------------------------------
# the lenient JSON reader (for tool calls that strict json.loads refuses)

_WS = re.compile(r"[ \t\r\n]*")
_STRING_RUN = {'"': re.compile(r'[^"\\]*'), "'": re.compile(r"[^'\\]*")}
_CONTROL = re.compile(r"[\x00-\x1f]")
_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")
_WORD_RE = re.compile(r"[A-Za-z_]\w*")
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")
_LITERALS = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}
_ESCAPES = {
    '"': '"',
    "'": "'",
    "\\": "\\",
    "/": "/",
    "b": "\b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
}


def loads_lenient(body: str, close_at_end: bool) -> tuple[object, list[str]]:
    """The first JSON object in `body`, forgiving common mistakes -> (value, what was repaired).

    Raises ValueError when even that fails. Text before the object and after it is ignored (and
    reported: a code fence, usually).
    """
    values, repairs = read_lenient(body, close_at_end, max_values=1, whole=False)
    return values[0], repairs


def read_lenient(
    body: str, close_at_end: bool, max_values: int, whole: bool
) -> tuple[list, list[str]]:
    """The first JSON object in `body` and up to max_values - 1 more that follow it, separated only
    by whitespace
    -> (values, what was repaired). Raises ValueError when the first fails; a later one that fails
    is left as text after the JSON. Only the first object may be closed by the end of the text
    (close_at_end): a later one must be complete, as a call in a block cut short must be (never run
    a call whose JSON was cut). whole: text after the JSON (other than the backticks of a code
    fence) raises ValueError instead of being reported."""
    start = body.find("{")
    if start < 0:
        raise ValueError("no JSON object")
    reader = _LenientJSON(body, start, close_at_end)
    before = body[:start].strip()
    if before:
        reader.repair(
            "a code fence around the JSON" if before.startswith("```") else "text before the JSON"
        )
    values = [reader.value(0)]
    reader.close_at_end = False
    while len(values) < max_values and reader.peek() == "{":
        at, repairs = reader.i, list(reader.repairs)
        try:
            values.append(reader.value(0))
        except ValueError:
            reader.i, reader.repairs = at, repairs
            break
    after = body[reader.i :].strip()
    if whole and after.strip("`"):
        reader.fail("text after the JSON")
    if after:
        reader.repair(
            "a code fence around the JSON" if after.startswith("```") else "text after the JSON"
        )
    return values, reader.repairs


class _LenientJSON:
    """A forgiving recursive-descent JSON reader. Linear time: each character is consumed once, by a
    regex without alternation or by one step; steps (values, keys, escapes) and depth are capped."""

    MAX_DEPTH = 64

    def __init__(self, s: str, i: int, close_at_end: bool):
        self.s, self.i = s, i  # the text and the read position
        self.close_at_end = close_at_end  # may the end of the text close the open brackets
        self.repairs: list[str] = []  # what was forgiven, in order, without repeats
        self.steps = 0  # values, keys and escapes read so far (MAX_REPAIR_STEPS at most)

    def step(self) -> None:
        self.steps += 1
        if self.steps > MAX_REPAIR_STEPS:
            self.fail("too long to repair")

    def repair(self, what: str) -> None:
        if what not in self.repairs:
            self.repairs.append(what)

    def peek(self) -> str:
        self.i = _WS.match(self.s, self.i).end()
        return self.s[self.i] if self.i < len(self.s) else ""

    def fail(self, what: str):
        raise ValueError(f"{what} at char {self.i}")

    def value(self, depth: int):
        self.step()
        if depth > self.MAX_DEPTH:
            self.fail("nested too deeply")
        c = self.peek()
        if c == "{" or c == "[":
            return self.container(depth, c == "{")
        if c == '"' or c == "'":
            return self.string()
        m = _NUMBER_RE.match(self.s, self.i)
        if m:
            self.i = m.end()
            return float(m.group()) if any(x in m.group() for x in ".eE") else int(m.group())
        m = _WORD_RE.match(self.s, self.i)
        if m and m.group() in _LITERALS:
            if m.group()[0].isupper():
                self.repair("Python literals")
            self.i = m.end()
            return _LITERALS[m.group()]
        self.fail(f"unexpected {c!r}" if c else "unexpected end")

    def container(self, depth: int, is_object: bool):
        close, out = ("}", {}) if is_object else ("]", [])
        self.i += 1
        while True:
            c = self.peek()
            if c == close:
                self.i += 1
                return out
            if not c:
                if not self.close_at_end:
                    self.fail("unexpected end")
                self.repair("missing closing brackets")
                return out
            if is_object:
                key = self.key()
                if self.peek() != ":":
                    self.fail("expected ':'")
                self.i += 1
                out[key] = self.value(depth + 1)
            else:
                out.append(self.value(depth + 1))
            c = self.peek()
            if c == ",":
                self.i += 1
                if self.peek() == close:
                    self.repair("trailing commas")
            elif c and c != close:
                self.fail(f"expected ',' or '{close}'")

    def key(self) -> str:
        self.step()
        if self.peek() in ('"', "'"):
            return self.string()
        m = _WORD_RE.match(self.s, self.i)
        if not m:
            self.fail("expected a key")
        self.repair("unquoted keys")
        self.i = m.end()
        return m.group()

    def string(self) -> str:
        quote = self.s[self.i]
        if quote == "'":
            self.repair("single quotes")
        self.i += 1
        parts = []
        while True:
            run = _STRING_RUN[quote].match(self.s, self.i).group()
            if _CONTROL.search(run):
                self.repair("raw control characters (newlines, tabs) in strings")
            parts.append(run)
            self.i += len(run)
            if self.i >= len(self.s):
                self.fail("unterminated string")
            if self.s[self.i] == quote:
                self.i += 1
                return "".join(parts)
            self.step()
            escape = self.s[self.i + 1 : self.i + 2]  # self.s[self.i] is a backslash
            if escape == "u" and _HEX4.fullmatch(self.s, self.i + 2, self.i + 6):
                code = int(self.s[self.i + 2 : self.i + 6], 16)
                self.i += 6
                low = self.s[self.i + 2 : self.i + 6] if self.s.startswith("\\u", self.i) else ""
                # a surrogate pair: a high \uXXXX escape followed by a low one
                if (
                    0xD800 <= code < 0xDC00
                    and _HEX4.fullmatch(low)
                    and 0xDC00 <= int(low, 16) < 0xE000
                ):
                    code = 0x10000 + ((code - 0xD800) << 10) + (int(low, 16) - 0xDC00)
                    self.i += 6
                parts.append(chr(code))
            elif escape in _ESCAPES:
                parts.append(_ESCAPES[escape])
                self.i += 2
            elif not escape:
                self.fail("unterminated string")
            else:  # \x, \d ... : kept as written (likely code)
                self.repair("invalid escapes")
                parts.append("\\" + escape)
                self.i += 2
