"""serve_anthropic.py: Anthropic's Messages API (POST /v1/messages) as a dialect of serve.py's chat
endpoint: a request is translated into the OpenAI chat request serve.Server already serves, and the
reply (or its stream of events) back. So a Messages request is rendered by the same chat format,
sampled by the same engine call and captured in the same records as a chat completion (a wing
of serve.py's).

    https://docs.anthropic.com/en/api/messages            the request and the reply
    https://docs.anthropic.com/en/api/messages-streaming  the events of stream=true

What maps to what:
  system (a string or text blocks)          -> the system message
  a message with role system                -> a system message in its place (Claude Code's
                                               mid-conversation system messages)
  user text blocks                          -> a user message (consecutive text blocks joined)
  user tool_result blocks                   -> tool messages, in order (their text; is_error is
                                               not rendered)
  assistant text + tool_use blocks          -> an assistant message with tool_calls,
                                               arguments = json of `input`
  assistant thinking blocks                 -> its reasoning (rendered by a thinking format:
                                               Qwen3); redacted_thinking: dropped, counted
  tools [{name, description, input_schema}] -> [{"type": "function",
                                               "function": {name, description, parameters}}]
  stop_sequences, metadata.user_id          -> stop, the session (as OpenAI's `user`)
  thinking {type: enabled, budget_tokens}   -> a thinking format thinks (serve.py: at most
                                               budget_tokens of it); disabled or absent: it does
                                               not (Qwen3's empty think block); a format that
                                               cannot think serves it without, counted
  the reply: a thinking block when the model thought, its text, then one tool_use block per tool
  call (`input` the parsed arguments); stop_reason tool_use, max_tokens, stop_sequence or end_turn.
Refused (400): images and documents, tool_choice other than auto, server tools (a `type` other
than custom), budget_tokens under 1,024 or not under max_tokens (Anthropic's own rule). IGNORED
lists the fields accepted without effect (counted), cache_control on blocks is not read, and the
`beta` query and the anthropic-beta header change nothing; docs/serve.md's table says why for each.
`seed` is accepted as an extension (Anthropic has none), so a test or a trainer can ask for a
seeded sample. Errors on this endpoint are Anthropic's error object.

Imports: wings/serve_http.py (RequestError) (and the standard library).
"""

import json

from wings.serve_http import RequestError

# the same meaning in both
PASSED = ("model", "max_tokens", "temperature", "top_p", "top_k", "stream", "seed")
# accepted and ignored: none changes what is sampled (docs/serve.md's field table)
IGNORED = ("context_management", "service_tier", "container", "mcp_servers")


def _blocks(content, where: str) -> list[dict]:
    """A message's content as a list of blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not (
        isinstance(content, list)
        and all(isinstance(b, dict) and isinstance(b.get("type"), str) for b in content)
    ):
        raise RequestError(400, f"{where} must be a string or a list of content blocks", where)
    return content


def _text(block: dict, where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise RequestError(400, f"{where}.text must be a string", where)
    return block["text"]


def _joined_text(content, where: str) -> str:
    """A string, or text blocks joined into one (any other block refused): a system prompt, a
    system message, a tool result's content."""
    return "".join(
        _text(b, where) for b in _blocks(content, where) if b["type"] == "text" or _refuse(b, where)
    )


def _tool_result(block: dict, where: str) -> dict:
    content = block.get("content", "")
    if isinstance(content, list):
        content = _joined_text(content, f"{where}.content")
    if not isinstance(content, str) or not isinstance(block.get("tool_use_id"), str):
        raise RequestError(400, f"{where} must have a tool_use_id and a text content", where)
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def _refuse(block: dict, where: str):
    raise RequestError(
        400,
        f"{where}: {block['type']!r} blocks are not supported (text, tool_use and tool_result "
        "only)",
        where,
    )


def _message(m, i: int, ignored: list[str]) -> list[dict]:
    """One Messages message -> the chat messages it stands for (what is dropped noted in
    `ignored`)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
        raise RequestError(400, f"{where}.role must be user, assistant or system", where)
    if m["role"] == "system":  # a system message mid-conversation (Claude Code's beta)
        return [{"role": "system", "content": _joined_text(m.get("content"), f"{where}.content")}]
    blocks = _blocks(m.get("content"), f"{where}.content")
    if m["role"] == "assistant":
        text, calls, reasoning = [], [], []
        for j, b in enumerate(blocks):
            if b["type"] == "text":
                text.append(_text(b, f"{where}.content[{j}]"))
            elif b["type"] == "thinking" and isinstance(b.get("thinking"), str):
                reasoning.append(b["thinking"])
            elif b["type"] == "redacted_thinking":
                ignored.append("redacted_thinking")
            elif (
                b["type"] == "tool_use"
                and isinstance(b.get("name"), str)
                and isinstance(b.get("input"), dict)
            ):
                calls.append(
                    {
                        "id": b.get("id"),
                        "type": "function",
                        "function": {
                            "name": b["name"],
                            "arguments": json.dumps(b["input"], ensure_ascii=False),
                        },
                    }
                )
            else:
                _refuse(b, f"{where}.content[{j}]")
        return [
            {
                "role": "assistant",
                "content": "".join(text) or None,
                **({"tool_calls": calls} if calls else {}),
                **({"reasoning_content": "".join(reasoning)} if reasoning else {}),
            }
        ]
    out, text = [], []
    for j, b in enumerate(blocks):
        if b["type"] == "text":
            text.append(_text(b, f"{where}.content[{j}]"))
        elif b["type"] == "tool_result":
            out.append(_tool_result(b, f"{where}.content[{j}]"))
        else:
            _refuse(b, f"{where}.content[{j}]")
    return out + ([{"role": "user", "content": "".join(text)}] if text else [])


def _tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RequestError(
            400, "tools must be a list of {'name', 'description', 'input_schema'}", "tools"
        )
    out = []
    for i, t in enumerate(tools):
        if t.get("type", "custom") != "custom":
            raise RequestError(
                400, f"tools[{i}]: server tools ({t['type']!r}) are not supported", "tools"
            )
        if not isinstance(t.get("name"), str):
            raise RequestError(400, f"tools[{i}].name must be a string", "tools")
        fn = {
            "name": t["name"],
            **({"description": t["description"]} if "description" in t else {}),
            "parameters": t.get("input_schema", {"type": "object", "properties": {}}),
        }
        out.append({"type": "function", "function": fn})
    return out


def _thinking(body: dict) -> bool | int:
    """The request's `thinking` -> False (disabled), True (enabled, no budget: "adaptive") or its
    budget_tokens."""
    thinking = body.get("thinking") or {"type": "disabled"}
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "disabled":
        return False
    if kind == "adaptive":
        return True
    budget = thinking.get("budget_tokens") if kind == "enabled" else None
    if not isinstance(budget, int) or isinstance(budget, bool):
        raise RequestError(
            400,
            "thinking must be {type: enabled, budget_tokens: int}, adaptive or disabled",
            "thinking",
        )
    if not 1024 <= budget < body["max_tokens"]:
        raise RequestError(
            400,
            f"thinking.budget_tokens must be at least 1024 and less than max_tokens "
            f"({body['max_tokens']}), got {budget}",
            "thinking",
        )
    return budget


def to_chat(body: dict) -> tuple[dict, str | None, list[str], bool | int]:
    """A Messages request -> (the chat request that serve.Server serves, the session named by
    metadata.user_id, the fields ignored or dropped, whether to think: False, True or the thinking
    budget in tokens)."""
    if not isinstance(body.get("max_tokens"), int) or isinstance(body.get("max_tokens"), bool):
        raise RequestError(400, "max_tokens: an integer is required", "max_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list of messages", "messages")
    system = body.get("system")
    if system is not None:
        system = _joined_text(system, "system")
    think = _thinking(body)
    output_config = body.get("output_config") or {}
    if not isinstance(output_config, dict) or output_config.get("format") is not None:
        raise RequestError(
            400, "output_config.format (structured outputs) is not supported", "output_config"
        )
    if (body.get("tool_choice") or {"type": "auto"}).get("type") != "auto":
        raise RequestError(
            400, "tool_choice other than auto is not supported by this server", "tool_choice"
        )
    chat = [{"role": "system", "content": system}] if system is not None else []
    ignored = [k for k in IGNORED if body.get(k) is not None]
    ignored += [f"output_config.{k}" for k in output_config]
    for i, m in enumerate(messages):
        chat += _message(m, i, ignored)
    metadata = body.get("metadata") or {}
    session = metadata.get("user_id") if isinstance(metadata, dict) else None
    stop = body.get("stop_sequences")
    out = {k: body[k] for k in PASSED if k in body}
    chat_body = {
        **out,
        "messages": chat,
        "tools": _tools(body.get("tools")),
        **({"stop": stop} if stop is not None else {}),
    }
    return chat_body, session, ignored, think


def stop_reason(choice: dict, stop_text: str | None) -> str:
    if choice["message"].get("tool_calls"):
        return "tool_use"
    if choice["finish_reason"] == "length":
        return "max_tokens"
    return "stop_sequence" if stop_text is not None else "end_turn"


def content_blocks(message: dict) -> list[dict]:
    """An OpenAI assistant message -> its Messages content: the thinking (a signature this server
    does not check), the text, then a tool_use block per call."""
    reasoning = message.get("reasoning_content")
    thinking = (
        [{"type": "thinking", "thinking": reasoning, "signature": ""}]
        if reasoning is not None
        else []
    )
    text = [{"type": "text", "text": message["content"]}] if message.get("content") else []
    return (
        thinking
        + text
        + [
            {
                "type": "tool_use",
                "id": c["id"],
                "name": c["function"]["name"],
                "input": json.loads(c["function"]["arguments"]),
            }
            for c in message.get("tool_calls") or []
        ]
    )


def message(reply: dict, stop_text: str | None) -> dict:
    """A chat completion (one choice) -> the Messages reply."""
    choice = reply["choices"][0]
    return {
        "id": "msg_" + reply["id"].split("-")[-1],
        "type": "message",
        "role": "assistant",
        "model": reply["model"],
        "content": content_blocks(choice["message"]),
        "stop_reason": stop_reason(choice, stop_text),
        "stop_sequence": stop_text,
        "usage": {
            "input_tokens": reply["usage"]["prompt_tokens"],
            "output_tokens": reply["usage"]["completion_tokens"],
        },
    }


def _event(kind: str, data: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()


class Events:
    """The server-sent events of a streamed Messages reply (one choice): message_start, then a
    thinking block and a text block fed delta by delta, then the tool_use blocks and message_delta /
    message_stop once the reply is known. The same calls as serve.py's ChatChunks: start, thinking,
    text, end, done."""

    def __init__(self, reply_id: str, model: str, prompt_tokens: int):
        self.id, self.model, self.prompt_tokens = (
            "msg_" + reply_id.split("-")[-1],
            model,
            prompt_tokens,
        )
        self.blocks = 0  # content blocks opened
        self.open: str | None = None  # the kind of the block being streamed: thinking or text

    def start(self, n: int) -> list[bytes]:
        return [
            _event(
                "message_start",
                {
                    "message": {
                        "id": self.id,
                        "type": "message",
                        "role": "assistant",
                        "model": self.model,
                        "content": [],
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0},
                    }
                },
            ),
            _event("ping", {}),
        ]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        index = self.blocks - 1
        signature = {"type": "signature_delta", "signature": ""}
        out = [_event("content_block_delta", {"index": index, "delta": signature})]
        out = out if self.open == "thinking" else []
        self.open = None
        return out + [_event("content_block_stop", {"index": index})]

    def _delta(self, kind: str, delta: dict) -> list[bytes]:
        out = []
        if self.open != kind:
            out += self._close()
            empty = {"type": "thinking", "thinking": "", "signature": ""}
            empty = empty if kind == "thinking" else {"type": "text", "text": ""}
            start = {"index": self.blocks, "content_block": empty}
            out.append(_event("content_block_start", start))
            self.open, self.blocks = kind, self.blocks + 1
        index = self.blocks - 1
        return out + [_event("content_block_delta", {"index": index, "delta": delta})]

    def thinking(self, i: int, delta: str) -> list[bytes]:
        return self._delta("thinking", {"type": "thinking_delta", "thinking": delta})

    def text(self, i: int, delta: str) -> list[bytes]:
        return self._delta("text", {"type": "text_delta", "text": delta})

    def end(self, i: int, choice: dict, stop_text: str | None) -> list[bytes]:
        out = self._close()
        for block in content_blocks(choice["message"]):
            if block["type"] != "tool_use":
                continue
            index, self.blocks = self.blocks, self.blocks + 1
            out += [
                _event(
                    "content_block_start", {"index": index, "content_block": {**block, "input": {}}}
                ),
                _event(
                    "content_block_delta",
                    {
                        "index": index,
                        "delta": {
                            "type": "input_json_delta",
                            "partial_json": json.dumps(block["input"], ensure_ascii=False),
                        },
                    },
                ),
                _event("content_block_stop", {"index": index}),
            ]
        self.reason = stop_reason(choice, stop_text), stop_text
        return out

    def error(self, e: RequestError) -> list[bytes]:
        e.dialect = "anthropic"
        return [_event("error", {"error": e.body()["error"]})]

    def done(self, usage: dict) -> list[bytes]:
        return [
            _event(
                "message_delta",
                {
                    "delta": {"stop_reason": self.reason[0], "stop_sequence": self.reason[1]},
                    "usage": {"output_tokens": usage["completion_tokens"]},
                },
            ),
            _event("message_stop", {}),
        ]
