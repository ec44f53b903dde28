"""chat.py: the text side of an agent: chat formats written by hand, and reading an assistant
message.

The agent loop (agent.py) owns the tokens; this file owns the text they encode:
  render(messages, tools)         OpenAI-style messages -> the prompt text of a chat format, by
                                  hand (no jinja at run time), byte-equal to the real templates
                                  (tested against jinja2);
  render_continuation(obs)        the text one observation adds to a conversation, cut out of
                                  render() itself;
  encode(tokenizer, text)         text -> token ids, special tokens written in the text mapped to
                                  their ids;
  make_action(text)               -> env.Action (text, tool calls, parse error), what env.step
                                  takes;
  parse_assistant_message(text)   -> the OpenAI-style message that render() writes back as exactly
                                  `text`.
The tool-call syntax (its one writer, tool_call_text, and its parser, parse_tool_calls, which never
raises and repairs the JSON mistakes small models make) lives in tool_calls.py; render() writes
calls with the writer.

Chat formats (CHAT_FORMATS; the Qwen ones are written here, the others in a wing file reached by
name through WING_FORMATS, which defines the same functions: render, render_continuation,
make_action, parse_assistant_message, and TURN_ENDS):
  "qwen2.5": ChatML with Qwen's tool section. Stable: rendering a longer conversation never
             changes the text of earlier turns, so a trajectory also equals render(messages)
             tokenized (for a tokenizer whose merges do not cross the turn boundaries). The
             embedded default model uses it.
  "qwen3":   byte-equal to the chat template that Qwen3 checkpoints ship (tests compare with
             jinja2).
  "llama3":  Llama 3.1 / 3.2 Instruct, JSON tool calls (wings/chat_llama3.py,
             docs/chat_formats.md).
WHY qwen2.5 is the default: Qwen3's template drops the (empty) think block from assistant turns
before the last one and adds one to the last, so a re-rendered multi-turn conversation is not the
text the engine saw when it sampled each turn. In "qwen2.5" every turn renders the same whatever
follows, so re-rendering a finished conversation (SFT data, evaluation dumps, debugging) gives back
exactly what the policy saw. Token-in-token-out (agent.play_episodes) makes RL trajectories exact
for either format.

Imports: env.py (Action, the message dict), tool_calls.py (the tool-call syntax), and the standard
library.
"""

import importlib

from env import Action, assistant_message
from tool_calls import parse_tool_calls, split_tool_calls, tojson, tool_call_text


# -----------------------------------------------------------------------------
# chat formatting

# formats written in a wing file, reached by name ("format" -> "module"), as rollout.wing reaches a
# wing: a run in another format never imports the file
WING_FORMATS = {"llama3": "wings.chat_llama3"}
CHAT_FORMATS = ("qwen2.5", "qwen3", *WING_FORMATS)
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# Qwen's, Llama 3.1's: pad_token_id takes the first
PAD_TOKENS = ("<|endoftext|>", "<|finetune_right_pad_id|>")
QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# The tool section, the same text in Qwen2.5 and Qwen3 (Qwen3 writes system content + "\n\n" first)
_TOOLS_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)
_EMPTY_THINK = "<think>\n\n</think>\n\n"


def _format_module(chat_format: str):
    """The wing module that implements `chat_format` (imported now), or None for a format written in
    this file."""
    if chat_format not in CHAT_FORMATS:
        raise ValueError(f"unknown chat_format {chat_format!r}, expected one of {CHAT_FORMATS}")
    return (
        importlib.import_module(WING_FORMATS[chat_format]) if chat_format in WING_FORMATS else None
    )


def turn_ends(chat_format: str) -> tuple[str, ...]:
    """The special tokens that end an assistant turn in `chat_format`: each stops a generation, and
    the first is the one the agent appends (mask 0) to close a turn that was cut."""
    wing = _format_module(chat_format)
    return wing.TURN_ENDS if wing else (IM_END,)


def pad_token_id(tokenizer) -> int:
    """The id a batch is padded with: the first of PAD_TOKENS that the tokenizer has (any id would
    do, padding is masked everywhere; this one never ends a turn)."""
    for token in PAD_TOKENS:
        if tokenizer.token_to_id(token) is not None:
            return tokenizer.token_to_id(token)
    raise ValueError(f"the tokenizer has none of the padding tokens {PAD_TOKENS}")


def _is_tool_response(content: str) -> bool:
    return content.startswith("<tool_response>") and content.endswith("</tool_response>")


def render(
    messages: list[dict],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = False,
    chat_format: str = "qwen2.5",
    enable_thinking: bool | None = None,
) -> str:
    """Render OpenAI-style messages to the prompt text of `chat_format` (see CHAT_FORMATS).

    "qwen3" is byte-equal to the chat template Qwen3 checkpoints ship; "qwen2.5" is byte-equal to
    the jinja template sft.py writes into the default model's tokenizer_config.json. Both are tested
    against jinja2. enable_thinking is Qwen3's switch: False puts an empty think block after the
    generation prompt; it is ignored by "qwen2.5". A wing format (WING_FORMATS) is rendered by its
    own file.
    """
    wing = _format_module(chat_format)
    if wing:
        return wing.render(messages, tools, add_generation_prompt)
    qwen3 = chat_format == "qwen3"
    has_system = bool(messages) and messages[0]["role"] == "system"
    out = []

    # system turn, with the tool signatures when there are tools
    if tools:
        system = (
            messages[0]["content"] if has_system else (None if qwen3 else QWEN25_DEFAULT_SYSTEM)
        )
        out.append(
            IM_START + "system\n" + ("" if system is None else system + "\n\n") + _TOOLS_HEAD
        )
        out += ["\n" + tojson(tool) for tool in tools]
        out.append(_TOOLS_TAIL)
    elif has_system:
        out.append(IM_START + "system\n" + messages[0]["content"] + IM_END + "\n")
    elif not qwen3:
        out.append(IM_START + "system\n" + QWEN25_DEFAULT_SYSTEM + IM_END + "\n")

    # Qwen3 shows reasoning only for assistant turns after the last real user query (a user message
    # that is not a wrapped tool response); earlier turns lose their <think> block.
    last_query = len(messages) - 1
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "user" and not _is_tool_response(messages[i]["content"]):
            last_query = i
            break

    for i, m in enumerate(messages):
        role = m["role"]
        last = i == len(messages) - 1
        if role == "user" or (role == "system" and i > 0):
            out.append(IM_START + role + "\n" + m["content"] + IM_END + "\n")
        elif role == "assistant":
            content = m.get("content") or ""
            if qwen3:
                reasoning = m.get("reasoning_content")
                if reasoning is None:
                    reasoning = ""
                    if "</think>" in content:
                        reasoning = (
                            content.split("</think>")[0]
                            .rstrip("\n")
                            .split("<think>")[-1]
                            .lstrip("\n")
                        )
                        content = content.split("</think>")[-1].lstrip("\n")
                if i > last_query and (last or reasoning):
                    out.append(
                        IM_START
                        + "assistant\n<think>\n"
                        + reasoning.strip("\n")
                        + "\n</think>\n\n"
                        + content.lstrip("\n")
                    )
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


def render_continuation(
    obs_messages: list[dict], chat_format: str = "qwen2.5", enable_thinking: bool | None = None
) -> str:
    """The text render() adds after an assistant turn's '<|im_end|>' for these observation messages,
    up to and including the next generation prompt: '\\n' + observation turn(s) +
    '<|im_start|>assistant\\n' (+ the empty think block for qwen3 with enable_thinking False).

    Cut out of render() itself (a dummy user/assistant exchange, then the observations) so the
    continuation and the full rendering cannot diverge. Valid for both Qwen formats because neither
    renders a tool or user turn differently depending on what came before it. A wing format cuts its
    own.
    """
    wing = _format_module(chat_format)
    if wing:
        return wing.render_continuation(obs_messages)
    prefix = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _PREFIX_SENTINEL}]
    text = render(
        prefix + list(obs_messages),
        add_generation_prompt=True,
        chat_format=chat_format,
        enable_thinking=enable_thinking,
    )
    cut = text.index(_PREFIX_SENTINEL + IM_END) + len(_PREFIX_SENTINEL + IM_END)
    return text[cut:]


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of `text`; special tokens written in it (<|im_start|>, <|im_end|>, ...) map to
    their ids."""
    return tokenizer.encode(text, add_special_tokens=False).ids


def make_action(text: str, chat_format: str = "qwen2.5") -> Action:
    """The env.Action of one decoded assistant message (stop token already removed), read with the
    tool-call syntax of `chat_format` (the Qwen formats' <tool_call> blocks here, a wing format's
    own parser)."""
    wing = _format_module(chat_format)
    if wing:
        return wing.make_action(text)
    calls, error = parse_tool_calls(text)
    return Action(text=text, tool_calls=tuple(calls), parse_error=error)


def parse_assistant_message(text: str, chat_format: str = "qwen2.5") -> dict:
    """The OpenAI-style assistant message of a decoded completion, such that render() gives `text`
    back (a wing format: its own parse_assistant_message).

    tool_calls = the calls of the blocks that end the message exactly as render() writes them
    (canonical JSON, one "\n" between blocks and before the first); content = the text before them.
    Any other block, well-formed or not, stays in the content verbatim, so the message re-renders to
    the very text the policy produced (qwen2.5): what SFT data, evaluation dumps and replays need.
    """
    wing = _format_module(chat_format)
    if wing:
        return wing.parse_assistant_message(text)
    split = split_tool_calls(text)
    return assistant_message(split.content, split.content_calls)
