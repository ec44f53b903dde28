"""chat_llama3.py: the Llama 3.1 / 3.2 Instruct chat format and its JSON tool calls, a wing
of chat.py.

Turned on by `rollout.agent.chat_format=llama3`; chat.py reaches this file by name through its
format table (chat.WING_FORMATS), so a run in a Qwen format never imports it. It gives chat.py what
a format needs:
  render(messages, tools)          -> the prompt text, byte-equal to the chat_template that Llama
                                      3.1 and 3.2 Instruct checkpoints ship in tokenizer_config.json
                                      (tested against jinja2);
  render_continuation(obs)         -> the text one observation adds after an assistant turn's
                                      end token;
  parse_tool_calls(text)           -> Llama's JSON calls, with chat.py's guarantees (never raises,
                                      repairs, bounded);
  parse_assistant_message(text)    -> the OpenAI-style message that render() writes back as `text`;
  TURN_ENDS, SPECIAL_TOKENS        -> the tokens that end a turn, and those a tokenizer of this
                                      format needs.

The format (Meta's "Llama 3.1 prompt format", JSON tool calling with the tools in the first
user message):
  <|begin_of_text|><|start_header_id|>system<|end_header_id|>\\n\\n
  Environment: ipython\\nCutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n
  {system}<|eot_id|>
  <|start_header_id|>user<|end_header_id|>\\n\\n
  Given the following functions, ... {each tool as indented JSON}
  {first user message}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\\n\\n
  {"name": "python_eval", "parameters": {"code": "2 + 3"}}<|eot_id|>
  <|start_header_id|>ipython<|end_header_id|>\\n\\n"5"<|eot_id|>
  <|start_header_id|>assistant<|end_header_id|>\\n\\n
A tool call is the whole assistant message: one JSON object {"name", "parameters"}, no tags around
it. Tool results come back in the `ipython` role. Every turn ends with <|eot_id|>; a model may
instead end a tool-call turn with <|eom_id|> ("end of message": Meta's models do so in ipython mode,
to hand control to the executor), so both stop a generation (TURN_ENDS), and a turn cut short is
closed with <|eot_id|>, the first of them.

Where we follow the shipped template rather than the prose of Meta's page (so that what is trained
is what vLLM's chat endpoint renders for the checkpoint):
  - the date: the template's own fixed "26 Jul 2024" (Llama 3.1's default; Llama 3.2's template
    writes today's date when the renderer offers strftime_now). A date that moved every day would
    change the prompt's tokens from one day to the next, so a resumed run or an evaluation would not
    see what the run saw. render()'s `date_string` sets another;
  - each message's content is trimmed (leading and trailing whitespace dropped), as the
    template does;
  - a tool result is written with tojson, so a string result "5" is written "5" with its quotes
    (jinja counts a string as iterable); Meta's prose shows it bare.
Where we depart from the template (it raises or writes nonsense there): arguments given as a JSON
string (OpenAI style) are decoded and written as the object, as vLLM decodes them before rendering;
an empty tool list is no tools; a role other than system / user / assistant / tool / ipython,
several calls in one message, or tools with no first user message to carry them raise ValueError
with what was wrong.

Docs: docs/chat_formats.md.
Imports: env.py, tool_calls.py (its lenient JSON reader and the parser's bounds) (and the
standard library).
"""

import json
import re

from tool_calls import MAX_BLOCKS, MAX_PARSE_CHARS, MAX_REPAIR_CHARS, call_of, read_lenient, tojson
from env import Action, ToolCall, assistant_message

# -----------------------------------------------------------------------------
# the format

BEGIN_OF_TEXT, END_OF_TEXT = "<|begin_of_text|>", "<|end_of_text|>"
HEADER_START, HEADER_END = "<|start_header_id|>", "<|end_header_id|>"
# end of turn; end of message (a tool call waiting for its result)
EOT, EOM = "<|eot_id|>", "<|eom_id|>"
PYTHON_TAG = "<|python_tag|>"  # Meta's marker of a built-in tool call; read and skipped before JSON
PAD = "<|finetune_right_pad_id|>"  # the padding token of Llama 3.1 / 3.2 tokenizers
TURN_ENDS = (EOT, EOM)  # stop a generation; the first closes a turn that was cut
# a tokenizer for this format needs these as single, never-split tokens (sft.train_tokenizer);
# Meta's own ids are 128000-128010, ours depend on the tokenizer
SPECIAL_TOKENS = [BEGIN_OF_TEXT, END_OF_TEXT, PAD, HEADER_START, HEADER_END, EOM, EOT, PYTHON_TAG]
DATE = "26 Jul 2024"  # "Today Date" of the system block (see the module docstring)
KNOWLEDGE_CUTOFF = "December 2023"
_TOOLS_PREAMBLE = (
    "Given the following functions, please respond with a JSON for a function call with its "
    "proper arguments that best answers the given prompt.\n\n"
    "Respond in the format "
    '{"name": function name, "parameters": dictionary of argument name and its value}.'
    "Do not use variables.\n\n"
)


def _header(role: str) -> str:
    return HEADER_START + role + HEADER_END + "\n\n"


def tool_call_text(tool_call: dict) -> str:
    """One call as Llama writes it (the whole assistant message, before its end token); `tool_call`
    is OpenAI-style {"function": {...}} or the bare {"name", "arguments"}. The one writer of the
    syntax: render() and parse_assistant_message's canonical check share it."""
    fn = tool_call.get("function") or tool_call
    args = fn.get("arguments", fn.get("parameters"))
    if isinstance(args, str):  # OpenAI-style JSON string: written as the object (vLLM decodes it)
        try:
            args = json.loads(args)
        except ValueError:
            pass  # not JSON: written as a JSON string, as the template would
    return '{"name": "' + fn["name"] + '", "parameters": ' + tojson(args) + "}"


def _tool_result(content) -> str:
    # the template: `content | tojson` when content "is mapping or is iterable" (strings too), else
    # as it is
    return tojson(content) if isinstance(content, (str, list, dict, tuple)) else str(content)


def render(
    messages: list[dict],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = False,
    date_string: str = DATE,
) -> str:
    """Render OpenAI-style messages as Llama 3.1 / 3.2 Instruct do, byte-equal to their
    chat_template (with date_string defined, which 3.2's template would otherwise fill with today's
    date), except where the module docstring says. Stable: a longer conversation never changes the
    text of earlier turns.

    Raises ValueError on what the template refuses or cannot write: tools with no first user message
    to carry them, an assistant message with several tool calls, an unknown role.
    """
    msgs = list(messages)
    system = ""
    if msgs and msgs[0]["role"] == "system":
        system, msgs = (msgs[0]["content"] or "").strip(), msgs[1:]
    out = [BEGIN_OF_TEXT, _header("system")]
    if tools:
        out.append("Environment: ipython\n")
    out.append(
        f"Cutting Knowledge Date: {KNOWLEDGE_CUTOFF}\nToday Date: {date_string}\n\n{system}{EOT}"
    )

    if tools:  # the tool definitions go into the first user message
        if not msgs or msgs[0]["role"] != "user":
            raise ValueError(
                "llama3 writes the tools into the first user message: the conversation needs one "
                "right after the system message"
            )
        out.append(_header("user") + _TOOLS_PREAMBLE)
        out += [json.dumps(tool, ensure_ascii=False, indent=4) + "\n\n" for tool in tools]
        out.append((msgs[0]["content"] or "").strip() + EOT)
        msgs = msgs[1:]

    for i, m in enumerate(msgs):
        role = m["role"]
        if m.get("tool_calls"):
            if len(m["tool_calls"]) != 1:
                raise ValueError(
                    f"message {i}: llama3 writes one tool call per assistant message, "
                    f"got {len(m['tool_calls'])}"
                )
            out.append(_header("assistant") + tool_call_text(m["tool_calls"][0]) + EOT)
        elif role in ("tool", "ipython"):
            out.append(_header("ipython") + _tool_result(m["content"]) + EOT)
        elif role in ("system", "user", "assistant"):
            out.append(_header(role) + (m.get("content") or "").strip() + EOT)
        else:
            raise ValueError(f"message {i}: unknown role {role!r}")
    if add_generation_prompt:
        out.append(_header("assistant"))
    return "".join(out)


_PREFIX_SENTINEL = "\x00nano-skyrl-prefix\x00"  # survives strip(): NUL is not whitespace


def render_continuation(obs_messages: list[dict]) -> str:
    """The text render() adds after an assistant turn's end token for these observation messages, up
    to and including the next generation prompt: each observation's turn (a tool result in the
    ipython role) + '<|start_header_id|>assistant<|end_header_id|>\\n\\n'. Cut out of render()
    itself, after a dummy exchange, so the two cannot diverge; valid because no turn renders
    differently depending on what came before it. The same text follows a turn that ended with
    <|eom_id|>: the end token is the model's, the continuation is ours."""
    prefix = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _PREFIX_SENTINEL}]
    text = render(prefix + list(obs_messages), add_generation_prompt=True)
    cut = text.index(_PREFIX_SENTINEL + EOT) + len(_PREFIX_SENTINEL + EOT)
    return text[cut:]


# -----------------------------------------------------------------------------
# tool-call parsing
#
# A Llama tool call has no tags: the assistant message is one JSON object {"name": ...,
# "parameters": {...}}. So a message is read as a call when, stripped (and a leading <|python_tag|>
# skipped), it starts with "{", or when a '{"name":' object appears later in it (after prose or a
# code fence: read, and reported, since a Llama call is the whole message). Anything else is a plain
# answer: no call, no error. The JSON is read as chat.py reads a <tool_call> block: strict
# json.loads first; otherwise chat.py's lenient reader repairs what small models get wrong (single
# quotes, Python literals, trailing commas, bare keys, raw newlines), every repair reported. Missing
# closing brackets are never added: the end of the message is the only end a Llama call has, so a
# call cut short by max_tokens must not run with half its arguments. Several objects (separated by
# whitespace or ";", as vLLM's llama3_json parser reads them) are each read as a call and reported:
# Llama 3.1 calls one function per message. Same bounds as chat.py: MAX_PARSE_CHARS of the message
# scanned, MAX_BLOCKS calls, MAX_REPAIR_CHARS and MAX_REPAIR_STEPS for the repairing reader; the one
# regex below cannot backtrack (a fixed sequence, each "\s*" between fixed characters), json's
# raw_decode is linear.

_CALL_START = re.compile(r"\{\s*[\"']?name[\"']?\s*:")  # where a '{"name": ...' object starts
_SEPARATOR = re.compile(r"\s*;?\s*")
_DECODER = json.JSONDecoder()


def parse_tool_calls(text: str) -> tuple[list[ToolCall], str | None]:
    """Parse the Llama JSON tool call(s) of an assistant message (end token already removed).

    Never raises. Returns the calls that could be read, in order, and a description of everything
    malformed, None when all is well formed: invalid JSON (repaired or not, or cut short), a missing
    or blank name, arguments that are not an object, text before or after the call, several calls in
    one message. Text that holds no call -> ([], None). "parameters" (Llama) and "arguments"
    (OpenAI, Qwen) are both accepted as well formed; unknown tool names parse: the env reports them.
    """
    problems = (
        []
        if len(text) <= MAX_PARSE_CHARS
        else [
            f"message longer than {MAX_PARSE_CHARS} characters: "
            "only its start was read for a tool call"
        ]
    )
    body = text[:MAX_PARSE_CHARS].strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].lstrip()
    if body.startswith("{"):
        start = 0
    else:
        m = _CALL_START.search(body)
        if m is None:
            return [], None
        start = m.start()
        before = body[:start].strip()
        problems.append(
            "a code fence around the tool call"
            if before.startswith("```") and before.count("```") == 1
            else "text before the tool call (a Llama tool call is the whole message)"
        )
    objs, more = _read_objects(body[start:], problems)
    calls = []
    for obj in objs:
        if isinstance(obj, dict) and "parameters" in obj and "arguments" not in obj:
            obj = {**obj, "arguments": obj["parameters"]}
        call, problem, repairs = call_of(obj)
        if call is None:
            problems.append(problem)
        else:
            calls.append(call)
            if repairs:
                problems.append(
                    f"tool {call.name!r}: arguments string repaired: {', '.join(repairs)}"
                )
    if len(objs) > 1:
        problems.append(
            f"{len(objs)} JSON objects in one message, read as {len(calls)} "
            f"call{'' if len(calls) == 1 else 's'} (Llama 3.1 calls one function per message)"
        )
    if more:
        problems.append(f"more than {MAX_BLOCKS} tool calls: the rest were not read")
    error = "; ".join(problems[:8]) + (
        f"; and {len(problems) - 8} more problems" if len(problems) > 8 else ""
    )
    return calls, error or None


def _read_objects(seg: str, problems: list[str]) -> tuple[list, bool]:
    """The JSON values at the start of `seg` (it starts at a "{"), separated by whitespace or ";" ->
    (values, whether more objects followed than MAX_BLOCKS). Strict json first; the lenient reader
    when the first one is not strict JSON. What was wrong is appended to `problems`."""
    objs, i = [], 0
    try:
        while True:
            obj, i = _DECODER.raw_decode(seg, i)
            objs.append(obj)
            j = _SEPARATOR.match(seg, i).end()
            if j == len(seg) or seg[j] != "{":
                break
            if len(objs) == MAX_BLOCKS:
                return objs, True
            i = j
    except (ValueError, RecursionError) as e:
        # JSONDecodeError is a ValueError; deep nesting recurses
        if not objs:
            strict_error = f"invalid JSON in tool call: {e}"
            if len(seg) > MAX_REPAIR_CHARS:
                problems.append(strict_error + " (too long to repair)")
                return [], False
            try:
                values, repairs = read_lenient(
                    seg, close_at_end=False, max_values=MAX_BLOCKS, whole=False
                )
            except ValueError as lenient_error:
                problems.append(
                    f"{strict_error} (not repaired: {lenient_error}; a call cut short is never run)"
                )
                return [], False
            names = ", ".join(repr(v.get("name")) for v in values if isinstance(v, dict))
            problems.append(f"invalid JSON in tool call {names}, repaired: {', '.join(repairs)}")
            return values, False
    after = seg[i:].strip()
    if after.strip("`"):
        problems.append(
            f"text after the tool call at char {i} (a Llama tool call is the whole message)"
        )
    elif after and "a code fence around the tool call" not in problems:
        problems.append("a code fence around the tool call")
    return objs, False


def make_action(text: str) -> Action:
    """The env.Action of one decoded assistant message (end token already removed)."""
    calls, error = parse_tool_calls(text)
    return Action(text=text, tool_calls=tuple(calls), parse_error=error)


def parse_assistant_message(text: str) -> dict:
    """The OpenAI-style assistant message of a decoded completion, such that render() gives `text`
    back (trimmed: the template trims every message). A message that is exactly one call as render()
    writes it (tool_call_text) becomes that tool call with empty content; anything else, a call
    written any other way included, stays content verbatim, so the re-rendered conversation is the
    text the policy produced."""
    calls, error = parse_tool_calls(text)
    if (
        error is None
        and len(calls) == 1
        and text == tool_call_text({"name": calls[0].name, "arguments": calls[0].arguments})
    ):
        return assistant_message("", calls)
    return assistant_message(text)
