"""agent.py: prompting, chat templates, tool-call parsing, the multi-turn loop and token-exact trajectories.

An *episode* is a conversation between the policy and an environment (env.py):

    prompt = render(system + user)                          tokens, mask 0
    repeat up to max_turns:
        the engine samples an assistant message             tokens, mask 1, with the engine's log-probs
        parse its <tool_call> blocks -> env.Action -> env.step(state, action)
        done? stop.  otherwise render the observation       tokens, mask 0
        (tool responses or a user message) + the next generation prompt

Token-in, token-out. The trajectory is the exact sequence of token ids the engine saw and produced,
built by *appending* ids; the conversation is never re-rendered and re-tokenized. Re-tokenizing would
not give back what was sampled: BPE merges across the boundary between prompt and completion differ,
a decoded completion may not re-encode to the same ids, and some chat templates (Qwen3) render earlier
turns differently once the conversation goes on. The learner must score the very tokens the engine
sampled, or the importance ratio is off from the first step. Only the observation text is rendered
(render_continuation), and it is cut out of render() itself so that the two cannot diverge.

Chat formats (render, by hand; no jinja at run time):
  "qwen2.5": ChatML with Qwen's tool section. Stable: rendering a longer conversation never changes the
             text of earlier turns, so a trajectory also equals render(messages) tokenized (for a
             tokenizer whose merges do not cross the turn boundaries). The embedded default model uses it.
  "qwen3":   byte-equal to the chat template that Qwen3 checkpoints ship (tests compare with jinja2).

Sections: chat formatting | tool-call parsing | the multi-turn loop | batching and metrics.
Shapes (RolloutBatch): B trajectories, T tokens (the longest trajectory; shorter ones right-padded).
Imports: env.py only (and torch, the standard library).
"""
import json
import re
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from env import Action, Env, Task, ToolCall, mix_seed
from env import assistant_message as env_assistant_message  # builds the dict; ours parses text first


@dataclass(frozen=True)
class SamplingParams:
    """What an engine is asked to do with each prompt (the same fields for torch, vLLM and remote engines)."""
    n: int = 1                      # samples per prompt; outputs are ordered prompt-major
    temperature: float = 1.0        # 0 means greedy
    top_p: float = 1.0              # nucleus sampling mass
    max_tokens: int = 256           # new tokens at most, per sample
    stop_token_ids: tuple = ()      # generation stops after emitting one of these (it is kept in the output)
    seed: int | None = None         # seed of the engine's torch.Generator for this call (None: nondeterministic)


@dataclass
class Generation:
    """One sampled continuation: exactly the tokens the engine produced, with their log-probs."""
    token_ids: list[int]            # (N,) generated ids, including the stop token when one was hit
    logprobs: list[float]           # (N,) log p(token) under softmax(logits / temperature), before top-p
    finish_reason: str              # "stop" (a stop token was emitted) or "length" (max_tokens reached)


# -----------------------------------------------------------------------------
# chat formatting

CHAT_FORMATS = ("qwen2.5", "qwen3")
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# The tool section is the same text in Qwen2.5 and Qwen3 (Qwen3 writes the system content + "\n\n" first).
_TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
_TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
               "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
               "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n")
_EMPTY_THINK = "<think>\n\n</think>\n\n"


def _tojson(x) -> str:
    # Hugging Face renders chat templates with tojson = json.dumps(x, ensure_ascii=False)
    return json.dumps(x, ensure_ascii=False)


def _tool_call_text(tool_call: dict) -> str:
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

    "qwen3" is byte-equal to Qwen3's chat template (fixtures/chat_templates/qwen3.jinja); "qwen2.5" is
    byte-equal to CHAT_TEMPLATES["qwen2.5"]. Both are tested against jinja2. enable_thinking is Qwen3's
    switch: False puts an empty think block after the generation prompt; it is ignored by "qwen2.5".
    """
    if chat_format not in CHAT_FORMATS:
        raise ValueError(f"unknown chat_format {chat_format!r}, expected one of {CHAT_FORMATS}")
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
                out.append(_tool_call_text(tool_call))
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
    continuation and the full rendering cannot diverge. Valid for both formats because neither renders
    a tool or user turn differently depending on what came before it.
    """
    prefix = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _PREFIX_SENTINEL}]
    text = render(prefix + list(obs_messages), add_generation_prompt=True, chat_format=chat_format,
                  enable_thinking=enable_thinking)
    cut = text.index(_PREFIX_SENTINEL + IM_END) + len(_PREFIX_SENTINEL + IM_END)
    return text[cut:]


# Jinja template of "qwen2.5", written to tokenizer_config.json ("chat_template") of the default model so
# that transformers' apply_chat_template gives the same string as render(). It is Qwen2.5's ChatML tool
# template, with one change borrowed from Qwen3's: arguments given as a JSON string are written as they
# are (Qwen2.5 would JSON-encode the string a second time).
#
# WHY qwen2.5 is the default format: Qwen3's template drops the (empty) think block from assistant turns
# before the last one and adds one to the last, so a re-rendered multi-turn conversation is not the text
# the engine saw when it sampled each turn. In "qwen2.5" every turn renders the same whatever follows,
# so re-rendering a finished conversation (SFT data, evaluation, debugging) gives back exactly what the
# policy saw. Token-in-token-out (run_episodes) makes RL trajectories exact for either format.
CHAT_TEMPLATES: dict[str, str] = {"qwen2.5": r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content if message.content is string else '' %}
        {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""}


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
# Bounded time: MAX_PARSE_CHARS of a message are scanned, MAX_BLOCKS blocks read; the (pure Python)
# repairing reader gets MAX_REPAIR_CHARS and MAX_REPAIR_STEPS per block, and reads string contents in
# bulk. Every scan is linear: literal tags, and regexes that are single character classes or fixed
# sequences (nothing that can backtrack).

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
MAX_PARSE_CHARS = 100_000   # characters of a message scanned for tool calls (the rest is kept as text)
MAX_BLOCKS = 16             # <tool_call> blocks read per message; later ones are reported, not read
MAX_REPAIR_CHARS = 20_000   # a longer block that is not strict JSON is not repaired
MAX_REPAIR_STEPS = 1_000    # values, keys and escapes the repairing reader reads per block (a few ms)
MAX_NAME_CHARS = 64         # a longer tool name is refused
_TAG_RE = re.compile(r"</?tool_call>")


def parse_tool_calls(text: str) -> tuple[list[ToolCall], str | None]:
    """Parse the <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks of an assistant message.

    Never raises. Returns the calls that could be read (well-formed or repaired, in order) and a
    description of everything malformed, None when all is well formed: invalid JSON (repaired or not),
    a missing name, arguments that are not an object, an unclosed <tool_call>, a stray </tool_call>.
    Text without calls -> ([], None). {"tool": ..., "args": ...} and arguments given as a JSON-encoded
    string are accepted as well-formed. Unknown tool names parse: the env reports them.
    """
    split = _split_tool_calls(text)
    return split.calls, split.error


def make_action(text: str) -> Action:
    """The env.Action of one decoded assistant message (stop token already removed)."""
    calls, error = parse_tool_calls(text)
    return Action(text=text, tool_calls=tuple(calls), parse_error=error)


def assistant_message(text: str) -> dict:
    """The OpenAI-style assistant message of a decoded completion, such that render() gives `text` back.

    tool_calls = the calls of the blocks that end the message exactly as render() writes them
    (canonical JSON, one "\n" between blocks and before the first); content = the text before them.
    Any other block, well-formed or not, stays in the content verbatim, so the message re-renders to
    the very text the policy produced (qwen2.5): what SFT data, evaluation dumps and replays need.
    """
    split = _split_tool_calls(text)
    return env_assistant_message(split.content, split.content_calls)


class _Split(NamedTuple):
    calls: list[ToolCall]          # every call that could be read, in order (parse_tool_calls)
    error: str | None              # everything malformed, or None
    content: str                   # the text less the canonical blocks that end it (assistant_message)
    content_calls: list[ToolCall]  # the calls of those blocks


def _split_tool_calls(text: str) -> _Split:
    """One scan of the message for both parse_tool_calls and assistant_message."""
    scanned = text[:MAX_PARSE_CHARS]
    problems = [] if len(text) <= MAX_PARSE_CHARS else [
        f"message longer than {MAX_PARSE_CHARS} characters: tool calls after that were not read"]
    blocks = []                        # (start, end, body, how it ended: "closed" | "next" | "end")
    open_at = None                     # index of the pending <tool_call> tag, if any
    for n_tags, m in enumerate(_TAG_RE.finditer(scanned)):
        if len(blocks) == MAX_BLOCKS or n_tags == 4 * MAX_BLOCKS:
            problems.append(f"more than {MAX_BLOCKS} tool calls: the rest were not read")
            open_at = None
            break
        if m.group() == TOOL_CALL_OPEN:
            if open_at is not None:
                blocks.append((open_at, m.start(), scanned[open_at + len(TOOL_CALL_OPEN):m.start()], "next"))
            open_at = m.start()
        elif open_at is None:
            problems.append(f"stray </tool_call> at char {m.start()}")
        else:
            blocks.append((open_at, m.end(), scanned[open_at + len(TOOL_CALL_OPEN):m.start()], "closed"))
            open_at = None
    if open_at is not None:
        blocks.append((open_at, len(scanned), scanned[open_at + len(TOOL_CALL_OPEN):], "end"))

    calls, canonical = [], []          # canonical: (start, end, call) of blocks exactly as render() writes them
    for start, end, body, ending in blocks:
        call, problem = _parse_call_body(body, closed=ending == "closed")
        if ending == "next":
            problems.append(f"<tool_call> at char {start} is not closed before the next one")
        elif ending == "end":
            problems.append(f"<tool_call> at char {start} is not closed (truncated generation?)")
        if problem is not None:
            problems.append(problem)
        if call is not None:
            calls.append(call)
            if problem is None and ending == "closed" and text[start:end] == _tool_call_text(
                    {"name": call.name, "arguments": call.arguments}):
                canonical.append((start, end, call))
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


def _parse_call_body(body: str, closed: bool) -> tuple[ToolCall | None, str | None]:
    """The text between <tool_call> and </tool_call> -> (call, None) if well formed, (call, what was
    repaired) if readable, (None, why not). closed: the block had its </tool_call>; only then may the
    lenient reader add missing closing brackets (an unclosed block must hold complete JSON)."""
    obj, repairs = None, []
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:      # JSONDecodeError is a ValueError; deep nesting recurses
        strict_error = f"invalid JSON in tool call: {e}"
        if len(body) > MAX_REPAIR_CHARS:
            return None, strict_error + " (too long to repair)"
        try:
            obj, repairs = _loads_lenient(body, close_at_end=closed)
        except ValueError:
            return None, strict_error
    if not isinstance(obj, dict):
        return None, f"tool call is a JSON {type(obj).__name__}, not an object"
    name = obj.get("name", obj.get("tool"))       # {"name", "arguments"} (Qwen) or {"tool", "args"}
    if not isinstance(name, str) or not name:
        return None, "tool call without a name"
    if len(name) > MAX_NAME_CHARS:
        return None, f"tool name longer than {MAX_NAME_CHARS} characters"
    args = obj["arguments"] if "arguments" in obj else obj.get("args")
    if args is None:                              # a call of a function without parameters
        args = {}
    if isinstance(args, str):                     # OpenAI-style arguments: a JSON-encoded string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError) as e:
            if len(args) > MAX_REPAIR_CHARS:
                return None, f"tool {name!r}: arguments string is not valid JSON: {e}"
            try:
                args, more = _loads_lenient(args, close_at_end=False)
                repairs += [r for r in more if r not in repairs]
            except ValueError:
                return None, f"tool {name!r}: arguments string is not valid JSON: {e}"
    if not isinstance(args, dict):
        return None, f"tool {name!r}: arguments are a JSON {type(args).__name__}, not an object"
    call = ToolCall(name=name, arguments=args)
    return call, (f"invalid JSON in tool call {name!r}, repaired: {', '.join(repairs)}" if repairs else None)


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
    start = body.find("{")
    if start < 0:
        raise ValueError("no JSON object")
    reader = _LenientJSON(body, start, close_at_end)
    before = body[:start].strip()
    if before:
        reader.repair("a code fence around the JSON" if before.startswith("```") else "text before the JSON")
    value = reader.value(0)
    after = body[reader.i:].strip()
    if after:
        reader.repair("a code fence around the JSON" if after.startswith("```") else "text after the JSON")
    return value, reader.repairs


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


# -----------------------------------------------------------------------------
# the multi-turn loop

@dataclass
class AgentConfig:
    n_samples: int = 8                 # episodes per task (a GRPO group)
    max_turns: int = 4                 # assistant turns per episode at most
    max_total_tokens: int = 512        # whole trajectory (prompt + all turns) at most
    chat_format: str = "qwen2.5"       # "qwen2.5" (stable re-rendering) | "qwen3" (see render)
    enable_thinking: bool | None = None  # qwen3 only: False = empty think block in every generation prompt


@dataclass
class Trajectory:
    """One episode. token_ids, loss_mask and logprobs all have length T (the whole trajectory)."""
    task: Task                         # the task this episode solves
    group: int                         # index of the task in the batch (GRPO group id)
    sample: int                        # index of the episode within its group, 0..n_samples-1
    token_ids: list[int]               # (T,) every token the engine saw or produced, in order
    loss_mask: list[int]               # (T,) 1 on tokens the policy sampled, 0 on prompt / observation / forced tokens
    logprobs: list[float]              # (T,) engine log-prob on sampled tokens, 0.0 elsewhere
    prompt_len: int                    # tokens of the first prompt (system + user + generation prompt)
    messages: list[dict]               # the conversation (reset messages, assistant turns, observations fed back)
    reward: float = 0.0                # sum of the env's step rewards (0 when the env gave none)
    done: bool = False                 # the env ended the episode (False if cut by max_turns/budget or env error)
    num_turns: int = 0                 # assistant turns generated
    num_tool_calls: int = 0            # tool calls parsed from the assistant turns
    parse_failures: int = 0            # assistant turns with a malformed tool call
    tool_errors: int = 0               # tool calls that failed in the env (env's count, EnvState.tool_errors)
    tool_timeouts: int = 0             # tool calls that timed out (env's count, EnvState.tool_timeouts if it has one)
    env_errors: int = 0                # env.step raised (ends the episode, reward 0)
    empty_responses: int = 0           # assistant turns whose content is blank
    finish_reason: str = ""            # "done" | "max_turns" | "max_tokens" | "env_error"
    info: dict = field(default_factory=dict)  # the last env info (or {"error": ...} after an env error)


def _encode(tokenizer, text: str) -> list[int]:
    # special tokens written in the text (<|im_start|>, <|im_end|>, ...) map to their ids
    return tokenizer.encode(text, add_special_tokens=False).ids


class StepResult(NamedTuple):
    """What env.step returned for one episode, or the error it raised (then the other fields are empty)."""
    state: object                      # the env's new state (EnvState or a subclass)
    obs: list                          # observation messages
    reward: float                      # this step's reward
    done: bool                         # the env ended the episode
    info: dict                         # the env's info
    error: str | None = None           # "ExceptionName: message" when env.step raised


def step_envs(envs: dict[str, Env], calls: list[tuple[str, object, Action]]) -> list[StepResult]:
    """The default `step_many` of play_episodes: env.step of every (env name, state, action) call, in order, in
    this process. An exception becomes that call's error (a broken env ends its episode, not the batch), so a
    caller elsewhere (an EnvWorker in another process) returns the same thing."""
    results = []
    for name, state, action in calls:
        try:
            results.append(StepResult(*envs[name].step(state, action)))
        except Exception as e:
            results.append(StepResult(None, [], 0.0, False, {}, f"{type(e).__name__}: {e}"))
    return results


def run_episodes(engine, envs: dict[str, Env], tasks: list[Task], tokenizer, cfg: AgentConfig,
                 params: SamplingParams, seed: int, judge_weight: float = 0.0, step_many=None) -> list[Trajectory]:
    """Play cfg.n_samples episodes of every task, token-in token-out. Returns them group-major
    (all samples of tasks[0], then tasks[1], ...), group = task index, sample = 0..n_samples-1.

    Three pieces, which a pipeline can also run apart (rollout.py's async_pipeline, each on its own Ray actors):
    init_episodes (env.reset, the first prompt rendered and encoded), play_episodes (the generation / tool
    loop), finish_episodes (the judge). `step_many(calls) -> [StepResult]` runs a turn's env steps; the default
    is step_envs over `envs` in this process (rollout.EnvPool spreads them over Ray EnvWorkers).

    judge_weight > 0 (training only; evaluate() never passes it): a finished episode's reward gets
    judge_weight * env.judge(task, messages) added, for envs that have a judge (see Env.judge).
    """
    trajs, states = init_episodes(envs, tasks, tokenizer, cfg, seed)
    play_episodes(engine, trajs, states, tokenizer, cfg, params, seed,
                  step_many or (lambda calls: step_envs(envs, calls)))
    return finish_episodes(envs, trajs, judge_weight)


def init_episodes(envs: dict[str, Env], tasks: list[Task], tokenizer, cfg: AgentConfig,
                  seed: int) -> tuple[list[Trajectory], list]:
    """env.reset of cfg.n_samples episodes per task and their first prompt, rendered and encoded ->
    (trajectories holding only that prompt, group-major; the env states). An episode whose prompt leaves no room
    for a turn already has finish_reason "max_tokens"."""
    trajs, states, prompt_cache = [], [], {}
    for g, task in enumerate(tasks):
        env = envs[task.env]
        for s in range(cfg.n_samples):
            state, msgs = env.reset(task, seed=mix_seed(seed, g, s))
            text = render(msgs, env.tools(), add_generation_prompt=True, chat_format=cfg.chat_format,
                          enable_thinking=cfg.enable_thinking)
            if text not in prompt_cache:      # the n samples of a task usually share their prompt
                prompt_cache[text] = _encode(tokenizer, text)
            ids = list(prompt_cache[text])
            traj = Trajectory(task=task, group=g, sample=s, token_ids=ids, loss_mask=[0] * len(ids),
                              logprobs=[0.0] * len(ids), prompt_len=len(ids), messages=list(msgs))
            if len(ids) + _MIN_ROOM > cfg.max_total_tokens:
                traj.finish_reason = "max_tokens"
            trajs.append(traj)
            states.append(state)
    return trajs, states


# the smallest budget worth another turn: one sampled token plus the slot kept for a forced <|im_end|>
_MIN_ROOM = 2


def play_episodes(engine, trajs: list[Trajectory], states: list, tokenizer, cfg: AgentConfig,
                  params: SamplingParams, seed: int, step_many) -> list[Trajectory]:
    """The multi-turn loop over init_episodes' output, extending the trajectories in place (also returned).

    Each turn is one batched engine.generate call over all episodes still running, then one
    step_many call with their env steps. Every episode keeps its own token budget: the call asks for the
    largest budget of the batch, and each generation is cut to its own episode's budget afterwards (its kept
    tokens are a valid sample: sampling is causal). One token of each budget is kept free for a forced
    <|im_end|>, so no trajectory exceeds cfg.max_total_tokens (unless its prompt alone does: that episode
    then ends with no turn).
    """
    im_end = tokenizer.token_to_id(IM_END)
    if im_end is None:
        raise ValueError(f"tokenizer has no {IM_END} token")
    stop_ids = tuple(dict.fromkeys((im_end, *params.stop_token_ids)))

    active = [i for i, t in enumerate(trajs) if not t.finish_reason]
    turn = 0
    while active:
        budgets = [min(params.max_tokens, cfg.max_total_tokens - len(trajs[i].token_ids) - 1) for i in active]
        call = replace(params, n=1, max_tokens=max(budgets), stop_token_ids=stop_ids,
                       seed=mix_seed(seed, turn))   # reproducible runs: the engine's RNG comes from (seed, turn)
        gens = engine.generate([list(trajs[i].token_ids) for i in active], call)   # copies: we extend ours in place
        if len(gens) != len(active):
            raise RuntimeError(f"engine returned {len(gens)} generations for {len(active)} prompts")

        actions = []
        for i, budget, gen in zip(active, budgets, gens):
            traj = trajs[i]
            ids, lps = list(gen.token_ids[:budget]), list(gen.logprobs[:budget])
            for k, t in enumerate(ids):            # keep up to the first stop token (an engine may run past it)
                if t in stop_ids:
                    ids, lps = ids[:k + 1], lps[:k + 1]
                    break
            stopped = bool(ids) and ids[-1] in stop_ids
            content_ids = ids[:-1] if stopped else ids
            traj.token_ids += ids
            traj.loss_mask += [1] * len(ids)
            traj.logprobs += [float(x) for x in lps]
            if not ids or ids[-1] != im_end:
                # cut by max_tokens (or stopped by another stop token): close the turn so the conversation
                # stays well formed. Forced, not sampled: mask 0, so the policy is not trained on it.
                traj.token_ids.append(im_end)
                traj.loss_mask.append(0)
                traj.logprobs.append(0.0)

            text = tokenizer.decode(content_ids, skip_special_tokens=False)
            action = make_action(text)
            traj.num_turns += 1
            traj.num_tool_calls += len(action.tool_calls)
            traj.parse_failures += action.parse_error is not None
            traj.empty_responses += not text.strip()
            traj.messages.append(assistant_message(text))
            actions.append(action)

        results = step_many([(trajs[i].task.env, states[i], a) for i, a in zip(active, actions)])
        still_active = []
        for i, (state, obs, reward, done, info, error) in zip(active, results):
            traj = trajs[i]
            if error is not None:                  # a broken env ends this episode, not the whole batch
                traj.env_errors += 1
                traj.reward, traj.done, traj.finish_reason = 0.0, False, "env_error"
                traj.info = {"error": error}
                continue
            states[i] = state
            traj.reward += float(reward)
            traj.info = dict(info)
            traj.tool_errors = int(getattr(state, "tool_errors", 0))
            traj.tool_timeouts = int(getattr(state, "tool_timeouts", 0))

            if done:
                traj.done, traj.finish_reason = True, "done"
                continue
            if traj.num_turns >= cfg.max_turns:
                traj.finish_reason = "max_turns"
                continue
            # only the new observation and the next generation prompt are rendered and appended
            cont = _encode(tokenizer, render_continuation(obs, cfg.chat_format, cfg.enable_thinking))
            if len(traj.token_ids) + len(cont) + _MIN_ROOM > cfg.max_total_tokens:
                traj.finish_reason = "max_tokens"  # no room to answer this observation: leave it out
                continue
            traj.token_ids += cont
            traj.loss_mask += [0] * len(cont)
            traj.logprobs += [0.0] * len(cont)
            traj.messages += list(obs)
            still_active.append(i)
        active = still_active
        turn += 1
    return trajs


def finish_episodes(envs: dict[str, Env], trajs: list[Trajectory], judge_weight: float) -> list[Trajectory]:
    """The end of every episode the env finished: judge_weight * env.judge(task, messages) added to its reward
    (and the score kept in info["judge"]) when judge_weight > 0 and the env has a judge. In place; returned."""
    if judge_weight:
        for traj in trajs:
            if traj.finish_reason == "done":
                score = envs[traj.task.env].judge(traj.task, traj.messages)
                if score is not None:
                    traj.info["judge"] = float(score)
                    traj.reward += judge_weight * float(score)
    return trajs


# -----------------------------------------------------------------------------
# batching and metrics

@dataclass
class RolloutBatch:
    """Trajectories as right-padded tensors, rows in the order given (group-major from run_episodes)."""
    input_ids: torch.Tensor            # (B, T) long, right-padded with pad_id
    loss_mask: torch.Tensor            # (B, T) float, 1 on sampled tokens, 0 on prompt/observation/forced/padding
    logprobs: torch.Tensor             # (B, T) float, engine log-prob of token t (0 where the mask is 0)
    rewards: torch.Tensor              # (B,) float, episode reward
    group_ids: torch.Tensor            # (B,) long, index of the task in the batch (GRPO group)
    lengths: torch.Tensor              # (B,) long, real tokens per row (the rest is padding)


def to_batch(trajs: list[Trajectory], pad_id: int) -> RolloutBatch:
    """Stack trajectories into right-padded tensors (T = the longest trajectory)."""
    if not trajs:
        raise ValueError("to_batch needs at least one trajectory")
    B, T = len(trajs), max(len(t.token_ids) for t in trajs)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)  # (B, T)
    loss_mask = torch.zeros(B, T)                               # (B, T)
    logprobs = torch.zeros(B, T)                                # (B, T)
    for b, t in enumerate(trajs):
        L = len(t.token_ids)
        input_ids[b, :L] = torch.tensor(t.token_ids, dtype=torch.long)
        loss_mask[b, :L] = torch.tensor(t.loss_mask, dtype=torch.float)
        logprobs[b, :L] = torch.tensor(t.logprobs, dtype=torch.float)
    return RolloutBatch(
        input_ids=input_ids, loss_mask=loss_mask, logprobs=logprobs,
        rewards=torch.tensor([t.reward for t in trajs], dtype=torch.float),        # (B,)
        group_ids=torch.tensor([t.group for t in trajs], dtype=torch.long),        # (B,)
        lengths=torch.tensor([len(t.token_ids) for t in trajs], dtype=torch.long),  # (B,)
    )


def rollout_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """Means over episodes, namespaced "rollout/...":
    reward, num_turns, tool_calls, response_tokens (sampled tokens), total_tokens, parse_failures,
    tool_errors, tool_timeouts, env_errors, empty_responses (all per episode); truncated (fraction cut by
    max_turns or max_tokens); frac_groups_mixed (fraction of groups whose rewards are not all equal: only
    those carry a GRPO signal); and "rollout/<env>/reward" per env when the batch mixes envs."""
    if not trajs:
        return {}
    n = len(trajs)

    def mean(xs) -> float:
        return float(sum(xs)) / len(xs)

    out = {
        "rollout/reward": mean([t.reward for t in trajs]),
        "rollout/num_turns": mean([t.num_turns for t in trajs]),
        "rollout/tool_calls": mean([t.num_tool_calls for t in trajs]),
        "rollout/response_tokens": mean([sum(t.loss_mask) for t in trajs]),
        "rollout/total_tokens": mean([len(t.token_ids) for t in trajs]),
        "rollout/parse_failures": mean([t.parse_failures for t in trajs]),
        "rollout/tool_errors": mean([t.tool_errors for t in trajs]),
        "rollout/tool_timeouts": mean([t.tool_timeouts for t in trajs]),
        "rollout/env_errors": mean([t.env_errors for t in trajs]),
        "rollout/empty_responses": mean([t.empty_responses for t in trajs]),
        "rollout/truncated": sum(t.finish_reason in ("max_turns", "max_tokens") for t in trajs) / n,
    }
    groups: dict[int, set] = {}
    for t in trajs:
        groups.setdefault(t.group, set()).add(t.reward)
    out["rollout/frac_groups_mixed"] = mean([len(r) > 1 for r in groups.values()])
    by_env: dict[str, list[float]] = {}
    for t in trajs:
        by_env.setdefault(t.task.env, []).append(t.reward)
    if len(by_env) > 1:
        for name, rewards in sorted(by_env.items()):
            out[f"rollout/{name}/reward"] = mean(rewards)
    return out
