"""chat.py: the text side of an agent: chat formats written by hand, the tool-call syntax, and its parser.

The agent loop (agent.py) owns the tokens; this file owns the text they encode:
  render(messages, tools)         OpenAI-style messages -> the prompt text of a chat format, by hand (no jinja at
                                  run time), byte-equal to the real templates (tested against jinja2);
  render_continuation(obs)        the text one observation adds to a conversation, cut out of render() itself;
  encode(tokenizer, text)         text -> token ids, special tokens written in the text mapped to their ids;
  parse_tool_calls(text)          an assistant message's <tool_call> blocks -> env.ToolCall's; never raises,
                                  repairs the JSON mistakes small models make, says what was wrong, bounded time;
  make_action(text)               -> env.Action (text, tool calls, parse error), what env.step takes;
  parse_assistant_message(text)   -> the OpenAI-style message that render() writes back as exactly `text`.
The tool-call syntax has one writer (tool_call_text) that render() and the parser's canonical check share.

Chat formats (CHAT_FORMATS; the Qwen ones are written here, the others in a wing file reached by name through
WING_FORMATS, which defines the same functions: render, render_continuation, make_action, parse_assistant_message,
and TURN_ENDS):
  "qwen2.5": ChatML with Qwen's tool section. Stable: rendering a longer conversation never changes the
             text of earlier turns, so a trajectory also equals render(messages) tokenized (for a
             tokenizer whose merges do not cross the turn boundaries). The embedded default model uses it.
  "qwen3":   byte-equal to the chat template that Qwen3 checkpoints ship (tests compare with jinja2).
  "llama3":  Llama 3.1 / 3.2 Instruct, JSON tool calls (chat_llama3.py, docs/chat_formats.md).
WHY qwen2.5 is the default: Qwen3's template drops the (empty) think block from assistant turns before the last
one and adds one to the last, so a re-rendered multi-turn conversation is not the text the engine saw when it
sampled each turn. In "qwen2.5" every turn renders the same whatever follows, so re-rendering a finished
conversation (SFT data, evaluation dumps, debugging) gives back exactly what the policy saw. Token-in-token-out
(agent.play_episodes) makes RL trajectories exact for either format.

Sections: chat formatting | tool-call parsing | the lenient JSON reader.
Imports: env.py only (ToolCall, Action and the message dict), and the standard library (a wing format's file is
imported by name, with importlib, when a run asks for it).
"""
import importlib
import json
import re
from typing import NamedTuple

from env import Action, ToolCall, assistant_message


# -----------------------------------------------------------------------------
# chat formatting

# formats written in a wing file, reached by name ("format" -> "module"), as rollout.wing reaches a wing: a run in
# another format never imports the file
WING_FORMATS = {"llama3": "chat_llama3"}
CHAT_FORMATS = ("qwen2.5", "qwen3", *WING_FORMATS)
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
PAD_TOKENS = ("<|endoftext|>", "<|finetune_right_pad_id|>")  # Qwen's, Llama 3.1's: pad_token_id takes the first
QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# The tool section is the same text in Qwen2.5 and Qwen3 (Qwen3 writes the system content + "\n\n" first).
_TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
_TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
               "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
               "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n")
_EMPTY_THINK = "<think>\n\n</think>\n\n"


def _format_module(chat_format: str):
    """The wing module that implements `chat_format` (imported now), or None for a format written in this file."""
    if chat_format not in CHAT_FORMATS:
        raise ValueError(f"unknown chat_format {chat_format!r}, expected one of {CHAT_FORMATS}")
    return importlib.import_module(WING_FORMATS[chat_format]) if chat_format in WING_FORMATS else None


def turn_ends(chat_format: str) -> tuple[str, ...]:
    """The special tokens that end an assistant turn in `chat_format`: each stops a generation, and the first is the
    one the agent appends (mask 0) to close a turn that was cut."""
    wing = _format_module(chat_format)
    return wing.TURN_ENDS if wing else (IM_END,)


def pad_token_id(tokenizer) -> int:
    """The id a batch is padded with: the first of PAD_TOKENS that the tokenizer has (any id would do, padding is
    masked everywhere; this one never ends a turn)."""
    for token in PAD_TOKENS:
        if tokenizer.token_to_id(token) is not None:
            return tokenizer.token_to_id(token)
    raise ValueError(f"the tokenizer has none of the padding tokens {PAD_TOKENS}")


def _tojson(x) -> str:
    # Hugging Face renders chat templates with tojson = json.dumps(x, ensure_ascii=False)
    return json.dumps(x, ensure_ascii=False)


def tool_call_text(tool_call: dict) -> str:
    """One <tool_call> block; `tool_call` is OpenAI-style {"function": {...}} or the bare {"name", "arguments"}."""
    fn = tool_call.get("function") or tool_call
    args = fn["arguments"]
    args = args if isinstance(args, str) else _tojson(args)   # a JSON string is written as it is, like Qwen3's template
    return '<tool_call>\n{"name": "' + fn["name"] + '", "arguments": ' + args + '}\n</tool_call>'


def _is_tool_response(content: str) -> bool:
    return content.startswith("<tool_response>") and content.endswith("</tool_response>")


def render(messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = False,
           chat_format: str = "qwen2.5", enable_thinking: bool | None = None) -> str:
    """Render OpenAI-style messages to the prompt text of `chat_format` (see CHAT_FORMATS).

    "qwen3" is byte-equal to the chat template Qwen3 checkpoints ship; "qwen2.5" is byte-equal to the jinja
    template sft.py writes into the default model's tokenizer_config.json. Both are tested against jinja2.
    enable_thinking is Qwen3's switch: False puts an empty think block after the generation prompt; it is ignored
    by "qwen2.5". A wing format (WING_FORMATS) is rendered by its own file.
    """
    wing = _format_module(chat_format)
    if wing:
        return wing.render(messages, tools, add_generation_prompt)
    qwen3 = chat_format == "qwen3"
    has_system = bool(messages) and messages[0]["role"] == "system"
    out = []

    # system turn, with the tool signatures when there are tools
    if tools:
        system = messages[0]["content"] if has_system else (None if qwen3 else QWEN25_DEFAULT_SYSTEM)
        out.append(IM_START + "system\n" + ("" if system is None else system + "\n\n") + _TOOLS_HEAD)
        out += ["\n" + _tojson(tool) for tool in tools]
        out.append(_TOOLS_TAIL)
    elif has_system:
        out.append(IM_START + "system\n" + messages[0]["content"] + IM_END + "\n")
    elif not qwen3:
        out.append(IM_START + "system\n" + QWEN25_DEFAULT_SYSTEM + IM_END + "\n")

    # Qwen3 shows reasoning only for assistant turns after the last real user query (a user message that
    # is not a wrapped tool response); earlier turns lose their <think> block.
    last_query = len(messages) - 1
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "user" and not _is_tool_response(messages[i]["content"]):
            last_query = i
            break

    for i, m in enumerate(messages):
        role, last = m["role"], i == len(messages) - 1
        if role == "user" or (role == "system" and i > 0):
            out.append(IM_START + role + "\n" + m["content"] + IM_END + "\n")
        elif role == "assistant":
            content = m.get("content") or ""
            if qwen3:
                reasoning = m.get("reasoning_content")
                if reasoning is None:
                    reasoning = ""
                    if "</think>" in content:
                        reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                        content = content.split("</think>")[-1].lstrip("\n")
                if i > last_query and (last or reasoning):
                    out.append(IM_START + "assistant\n<think>\n" + reasoning.strip("\n") + "\n</think>\n\n"
                               + content.lstrip("\n"))
                else:
                    out.append(IM_START + "assistant\n" + content)
            else:
                out.append(IM_START + "assistant\n" + content)
            for j, tool_call in enumerate(m.get("tool_calls") or []):
                if j > 0 or content:
                    out.append("\n")
                out.append(tool_call_text(tool_call))
            out.append(IM_END + "\n")
        elif role == "tool":
            # consecutive tool responses share one user turn
            if i == 0 or messages[i - 1]["role"] != "tool":
                out.append(IM_START + "user")
            out.append("\n<tool_response>\n" + m["content"] + "\n</tool_response>")
            if last or messages[i + 1]["role"] != "tool":
                out.append(IM_END + "\n")
        elif not (role == "system" and i == 0):
            raise ValueError(f"message {i}: unknown role {role!r}")

    if add_generation_prompt:
        out.append(IM_START + "assistant\n")
        if qwen3 and enable_thinking is False:
            out.append(_EMPTY_THINK)
    return "".join(out)


_PREFIX_SENTINEL = "\x00nano-skyrl-prefix\x00"


def render_continuation(obs_messages: list[dict], chat_format: str = "qwen2.5",
                        enable_thinking: bool | None = None) -> str:
    """The text render() adds after an assistant turn's '<|im_end|>' for these observation messages,
    up to and including the next generation prompt: '\\n' + observation turn(s) + '<|im_start|>assistant\\n'
    (+ the empty think block for qwen3 with enable_thinking False).

    Cut out of render() itself (a dummy user/assistant exchange, then the observations) so the
    continuation and the full rendering cannot diverge. Valid for both Qwen formats because neither renders
    a tool or user turn differently depending on what came before it. A wing format cuts its own.
    """
    wing = _format_module(chat_format)
    if wing:
        return wing.render_continuation(obs_messages)
    prefix = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _PREFIX_SENTINEL}]
    text = render(prefix + list(obs_messages), add_generation_prompt=True, chat_format=chat_format,
                  enable_thinking=enable_thinking)
    cut = text.index(_PREFIX_SENTINEL + IM_END) + len(_PREFIX_SENTINEL + IM_END)
    return text[cut:]


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of `text`; special tokens written in it (<|im_start|>, <|im_end|>, ...) map to their ids."""
    return tokenizer.encode(text, add_special_tokens=False).ids


# -----------------------------------------------------------------------------
# tool-call parsing
#
# Small models write tool calls badly, and a parser that raises or hangs takes a whole batch down. So:
# parse_tool_calls never raises, reads what can be read, and says what was wrong (env.step runs the
# calls that parsed, reports the problem, counts a parse failure). Each <tool_call> block is first read
# with strict json.loads: a well-formed call parses exactly as it always did. Otherwise _LenientJSON
# repairs what models commonly get wrong: a code fence or text around the object, single quotes,
# True/False/None, trailing commas, raw newlines inside strings, bare keys, and missing closing brackets
# at the end of a block that was closed. A block whose </tool_call> never comes (a generation cut by
# max_tokens, a forgotten tag) still gives its call when its JSON is complete. Every repair is reported,
# so the error is None only for a well-formed message.
# A tag written inside a JSON string of a call (python code that prints "</tool_call>") does not end the
# block: when the block's first reading (up to the next tag) gives no call and that tag lies inside a
# double-quoted string (an odd number of unescaped quotes before it), the block runs on to the first tag
# outside its strings, and that longer reading is kept if it gives a call and no text after its JSON. A
# block with an unbalanced quote, whose strings never close or whose longer reading fails, keeps its first
# reading, as before: it cannot swallow the calls after it (_string_aware_end).
# Several JSON objects in one block ({...}{...}, or one per line) are read as several calls, in order, and
# reported: the format is one object per <tool_call>. WHY run them rather than refuse them: the model's
# intent is plain, each object is checked as strictly as a call in its own block, and the env still counts
# a parse failure, so the policy learns the format without the calls being lost.
# Bounded time: MAX_PARSE_CHARS of a message are scanned, MAX_BLOCKS blocks and calls read; the (pure
# Python) repairing reader gets MAX_REPAIR_CHARS and MAX_REPAIR_STEPS per block, and reads string contents
# in bulk. Every scan is linear: literal tags, and regexes that are single character classes or fixed
# sequences (nothing that can backtrack). The string-aware reading of a block only runs over tags whose
# segments hold an even number of quotes, so none of those tags starts a string-aware reading of its own:
# the readings overlap at their ends only, and the message is read a bounded number of times.

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
MAX_PARSE_CHARS = 100_000   # characters of a message scanned for tool calls (the rest is kept as text)
MAX_BLOCKS = 16             # <tool_call> blocks read, and calls returned, per message; later ones are reported
MAX_REPAIR_CHARS = 20_000   # a longer block that is not strict JSON is not repaired
MAX_REPAIR_STEPS = 1_000    # values, keys and escapes the repairing reader reads per block (a few ms)
MAX_NAME_CHARS = 64         # a longer tool name is refused
_TAG_RE = re.compile(r"</?tool_call>")
_ESCAPE_PAIR = re.compile(r"\\.", re.S)   # a backslash and the character it escapes
_DECODER = json.JSONDecoder()


def parse_tool_calls(text: str) -> tuple[list[ToolCall], str | None]:
    """Parse the <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks of an assistant message.

    Never raises. Returns the calls that could be read (well-formed or repaired, in order) and a
    description of everything malformed, None when all is well formed: invalid JSON (repaired or not),
    a missing or blank name, arguments that are not an object, an unclosed <tool_call>, a stray
    </tool_call>, several objects in one block (each is read as a call). Text without calls -> ([], None).
    {"tool": ..., "args": ...} and arguments given as a JSON-encoded string are accepted as well-formed.
    Unknown tool names parse: the env reports them.
    """
    split = _split_tool_calls(text)
    return split.calls, split.error


def make_action(text: str, chat_format: str = "qwen2.5") -> Action:
    """The env.Action of one decoded assistant message (stop token already removed), read with the tool-call
    syntax of `chat_format` (the Qwen formats' <tool_call> blocks here, a wing format's own parser)."""
    wing = _format_module(chat_format)
    if wing:
        return wing.make_action(text)
    calls, error = parse_tool_calls(text)
    return Action(text=text, tool_calls=tuple(calls), parse_error=error)


def parse_assistant_message(text: str, chat_format: str = "qwen2.5") -> dict:
    """The OpenAI-style assistant message of a decoded completion, such that render() gives `text` back (a wing
    format: its own parse_assistant_message).

    tool_calls = the calls of the blocks that end the message exactly as render() writes them
    (canonical JSON, one "\n" between blocks and before the first); content = the text before them.
    Any other block, well-formed or not, stays in the content verbatim, so the message re-renders to
    the very text the policy produced (qwen2.5): what SFT data, evaluation dumps and replays need.
    """
    wing = _format_module(chat_format)
    if wing:
        return wing.parse_assistant_message(text)
    split = _split_tool_calls(text)
    return assistant_message(split.content, split.content_calls)


class _Split(NamedTuple):
    calls: list[ToolCall]          # every call that could be read, in order (parse_tool_calls)
    error: str | None              # everything malformed, or None
    content: str                   # the text less the canonical blocks that end it (parse_assistant_message)
    content_calls: list[ToolCall]  # the calls of those blocks


class _Block(NamedTuple):
    start: int                     # index of its <tool_call> in the text
    end: int                       # index just past its </tool_call> (or where it stopped: the next tag, the end)
    calls: list[ToolCall]          # the calls its JSON gave (several objects: several calls)
    problems: list[str]            # what was wrong with it


def _quote_parity(segment: str) -> int:
    """1 when `segment` holds an odd number of double quotes that a backslash does not escape (it leaves a JSON
    string open, or closes one), else 0. Linear: one C-level pass to drop escape pairs, one to count."""
    return _ESCAPE_PAIR.sub("", segment).count('"') & 1


def _string_aware_end(scanned: str, tags: list[tuple[int, int, bool]], i: int, complete: bool) -> int | None:
    """For the block opened by tags[i], whose first segment (up to tags[i + 1] or the end) leaves a JSON string
    open: the index of the first later tag outside its strings (len(tags): the end of the text), or None when
    its strings never close (an unbalanced quote) or the tags beyond `tags` were not scanned (complete False)."""
    parity = 1
    for k in range(i + 1, len(tags)):
        if parity == 0:
            return k
        stop = tags[k + 1][0] if k + 1 < len(tags) else len(scanned) if complete else None
        if stop is None:
            return None
        parity ^= _quote_parity(scanned[tags[k][1]:stop])
    return len(tags) if parity == 0 and complete else None


def _read_block(scanned: str, tags: list[tuple[int, int, bool]], i: int, k: int, whole: bool = False) -> _Block:
    """The block opened by tags[i] and ended by tags[k] (k == len(tags): by the end of the text); whole: see
    _parse_call_body."""
    start, body_start = tags[i][0], tags[i][1]
    if k == len(tags):
        ending, stop, end = "end", len(scanned), len(scanned)
    else:
        ending = "next" if tags[k][2] else "closed"
        stop, end = tags[k][0], tags[k][0] if tags[k][2] else tags[k][1]
    calls, problems = _parse_call_body(scanned[body_start:stop], closed=ending == "closed", whole=whole)
    if ending == "next":
        problems.insert(0, f"<tool_call> at char {start} is not closed before the next one")
    elif ending == "end":
        problems.insert(0, f"<tool_call> at char {start} is not closed (truncated generation?)")
    return _Block(start, end, calls, problems)


def _split_tool_calls(text: str) -> _Split:
    """One scan of the message for both parse_tool_calls and parse_assistant_message."""
    scanned = text[:MAX_PARSE_CHARS]
    problems = [] if len(text) <= MAX_PARSE_CHARS else [
        f"message longer than {MAX_PARSE_CHARS} characters: tool calls after that were not read"]
    tags = []                          # (start, end, is it <tool_call>) of the first 4 * MAX_BLOCKS tags
    complete = True                    # False: more tags follow that were not scanned
    for m in _TAG_RE.finditer(scanned):
        if len(tags) == 4 * MAX_BLOCKS:
            complete = False
            break
        tags.append((m.start(), m.end(), m.group() == TOOL_CALL_OPEN))

    blocks, i = [], 0
    while i < len(tags) and len(blocks) < MAX_BLOCKS:
        start, body_start, is_open = tags[i]
        if not is_open:
            problems.append(f"stray </tool_call> at char {start}")
            i += 1
            continue
        if i + 1 == len(tags) and not complete:   # where this block ends was not scanned
            break
        k = i + 1                      # the plain reading: the block ends at the next tag
        block = _read_block(scanned, tags, i, k)
        stop = tags[k][0] if k < len(tags) else len(scanned)
        if not block.calls and _quote_parity(scanned[body_start:stop]):
            k_str = _string_aware_end(scanned, tags, i, complete)   # that tag was inside a JSON string
            if k_str is not None:
                longer = _read_block(scanned, tags, i, k_str, whole=True)
                if longer.calls:
                    block, k = longer, k_str
        blocks.append(block)
        problems += block.problems
        i = k + (k < len(tags) and not tags[k][2])   # a </tool_call> belongs to its block, a <tool_call> opens the next
    calls = [c for b in blocks for c in b.calls]
    if i < len(tags) or not complete or len(calls) > MAX_BLOCKS:
        problems.append(f"more than {MAX_BLOCKS} tool calls: the rest were not read")
        calls = calls[:MAX_BLOCKS]

    canonical = [(b.start, b.end, b.calls[0]) for b in blocks  # blocks exactly as render() writes them
                 if not b.problems and len(b.calls) == 1 and text[b.start:b.end] == tool_call_text(
                     {"name": b.calls[0].name, "arguments": b.calls[0].arguments})]
    error = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more problems" if len(problems) > 8 else "")
    content, content_calls = text, []
    for k in range(len(canonical)):    # the longest run of canonical blocks that render() writes back as text
        run = canonical[k:]
        before = text[:run[0][0]]
        candidate = before[:-1] if before.endswith("\n") else before  # render() adds that "\n" itself
        if candidate + ("\n" if candidate else "") + "\n".join(text[s:e] for s, e, _ in run) == text:
            content, content_calls = candidate, [c for _, _, c in run]
            break
    return _Split(calls, error or None, content, content_calls)


def _strict_objects(body: str) -> list[dict] | None:
    """Two to MAX_BLOCKS JSON objects, separated only by whitespace, that fill `body` exactly (strict JSON);
    None when `body` is not that (then the lenient reader has its say)."""
    objs, i = [], _WS.match(body).end()
    try:
        while i < len(body) and len(objs) < MAX_BLOCKS and body[i] == "{":
            obj, i = _DECODER.raw_decode(body, i)
            objs.append(obj)
            i = _WS.match(body, i).end()
    except (ValueError, RecursionError):
        return None
    return objs if len(objs) > 1 and i == len(body) else None


def _parse_call_body(body: str, closed: bool, whole: bool = False) -> tuple[list[ToolCall], list[str]]:
    """The text between <tool_call> and </tool_call> -> (calls, problems): ([call], []) if well formed, the calls
    and what was repaired if readable, ([], [why not]) if not. Several objects give several calls (and a problem).
    closed: the block had its </tool_call>; only then may the lenient reader add missing closing brackets (an
    unclosed block must hold complete JSON). whole: text after the JSON is refused rather than ignored (the
    string-aware reading of a block must not end past its JSON, which would hide the calls it ran over)."""
    repairs = []
    try:
        objs = [json.loads(body)]
    except (ValueError, RecursionError) as e:      # JSONDecodeError is a ValueError; deep nesting recurses
        strict_error = f"invalid JSON in tool call: {e}"
        objs = _strict_objects(body)
        if objs is None and len(body) > MAX_REPAIR_CHARS:
            return [], [strict_error + " (too long to repair)"]
        if objs is None:
            try:
                objs, repairs = _read_lenient(body, close_at_end=closed, max_values=MAX_BLOCKS, whole=whole)
            except ValueError:
                return [], [strict_error]
    calls, problems = [], []
    for obj in objs:
        call, problem, more = _call_of(obj)
        if call is None:
            problems.append(problem)
        else:
            calls.append(call)
            repairs += [r for r in more if r not in repairs]
    if len(objs) > 1:
        problems.insert(0, f"{len(objs)} JSON objects in one <tool_call>, read as {len(calls)} "
                           f"call{'' if len(calls) == 1 else 's'} (write one object per <tool_call>)")
    if repairs and calls:
        names = ", ".join(repr(c.name) for c in calls)
        problems.insert(0, f"invalid JSON in tool call {names}, repaired: {', '.join(repairs)}")
    return calls, problems


def _call_of(obj) -> tuple[ToolCall | None, str | None, list[str]]:
    """One parsed JSON value -> (call, None, what its arguments string needed repaired) or (None, why not, [])."""
    if not isinstance(obj, dict):
        return None, f"tool call is a JSON {type(obj).__name__}, not an object", []
    name = obj.get("name", obj.get("tool"))       # {"name", "arguments"} (Qwen) or {"tool", "args"}
    if not isinstance(name, str) or not name.strip():
        return None, "tool call without a name", []
    if len(name) > MAX_NAME_CHARS:
        return None, f"tool name longer than {MAX_NAME_CHARS} characters", []
    args, repairs = obj["arguments"] if "arguments" in obj else obj.get("args"), []
    if args is None:                              # a call of a function without parameters
        args = {}
    if isinstance(args, str):                     # OpenAI-style arguments: a JSON-encoded string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError) as e:
            if len(args) > MAX_REPAIR_CHARS:
                return None, f"tool {name!r}: arguments string is not valid JSON: {e}", []
            try:
                args, repairs = _loads_lenient(args, close_at_end=False)
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
_ESCAPES = {'"': '"', "'": "'", "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def _loads_lenient(body: str, close_at_end: bool) -> tuple[object, list[str]]:
    """The first JSON object in `body`, forgiving common mistakes -> (value, what was repaired).

    Raises ValueError when even that fails. Text before the object and after it is ignored (and
    reported: a code fence, usually).
    """
    values, repairs = _read_lenient(body, close_at_end, max_values=1, whole=False)
    return values[0], repairs


def _read_lenient(body: str, close_at_end: bool, max_values: int, whole: bool) -> tuple[list, list[str]]:
    """The first JSON object in `body` and up to max_values - 1 more that follow it, separated only by whitespace
    -> (values, what was repaired). Raises ValueError when the first fails; a later one that fails is left as
    text after the JSON. Only the first object may be closed by the end of the text (close_at_end): a later one
    must be complete, as a call in a block cut short must be (never run a call whose JSON was cut). whole: text
    after the JSON (other than the backticks of a code fence) raises ValueError instead of being reported."""
    start = body.find("{")
    if start < 0:
        raise ValueError("no JSON object")
    reader = _LenientJSON(body, start, close_at_end)
    before = body[:start].strip()
    if before:
        reader.repair("a code fence around the JSON" if before.startswith("```") else "text before the JSON")
    values = [reader.value(0)]
    reader.close_at_end = False
    while len(values) < max_values and reader.peek() == "{":
        at, repairs = reader.i, list(reader.repairs)
        try:
            values.append(reader.value(0))
        except ValueError:
            reader.i, reader.repairs = at, repairs
            break
    after = body[reader.i:].strip()
    if whole and after.strip("`"):
        reader.fail("text after the JSON")
    if after:
        reader.repair("a code fence around the JSON" if after.startswith("```") else "text after the JSON")
    return values, reader.repairs


class _LenientJSON:
    """A forgiving recursive-descent JSON reader. Linear time: each character is consumed once, by a
    regex without alternation or by one step; steps (values, keys, escapes) and depth are capped."""
    MAX_DEPTH = 64

    def __init__(self, s: str, i: int, close_at_end: bool):
        self.s, self.i = s, i           # the text and the read position
        self.close_at_end = close_at_end  # may the end of the text close the open brackets
        self.repairs: list[str] = []    # what was forgiven, in order, without repeats
        self.steps = 0                  # values, keys and escapes read so far (MAX_REPAIR_STEPS at most)

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
            escape = self.s[self.i + 1:self.i + 2]     # self.s[self.i] is a backslash
            if escape == "u" and _HEX4.fullmatch(self.s, self.i + 2, self.i + 6):
                code = int(self.s[self.i + 2:self.i + 6], 16)
                self.i += 6
                low = self.s[self.i + 2:self.i + 6] if self.s.startswith("\\u", self.i) else ""
                if 0xD800 <= code < 0xDC00 and _HEX4.fullmatch(low) and 0xDC00 <= int(low, 16) < 0xE000:
                    code = 0x10000 + ((code - 0xD800) << 10) + (int(low, 16) - 0xDC00)  # a surrogate pair
                    self.i += 6
                parts.append(chr(code))
            elif escape in _ESCAPES:
                parts.append(_ESCAPES[escape])
                self.i += 2
            elif not escape:
                self.fail("unterminated string")
            else:                                      # \x, \d ... : kept as written (likely code)
                self.repair("invalid escapes")
                parts.append("\\" + escape)
                self.i += 2

