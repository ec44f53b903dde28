"""serve_openai.py: OpenAI's API as serve.py reads and writes it: the checks of a chat or
completions request's fields (their types and ranges, what is refused, the messages and tools
reduced to what chat.render reads) and the chunks of a streamed answer (a wing of serve.py's;
serve_anthropic.py is the other dialect).

  the chat request (messages, tools)  https://platform.openai.com/docs/api-reference/chat/create
  the chunks of stream=true           https://platform.openai.com/docs/api-reference/chat-streaming

A bad field is a serve_http.RequestError (400, naming it), answered as OpenAI's error object.

Imports: wings/serve_http.py (RequestError) (and the standard library).
"""

import json
import math
import time

from wings.serve_http import RequestError

# fields that would change the result and that this server does not implement: refused unless
# at their default
REFUSED = {
    "logit_bias": (None, {}),
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None),
    "echo": (False, None),
    "suffix": (None,),
    "best_of": (None, 1),
    "tool_choice": (None, "auto"),
    "functions": (None,),
    "function_call": (None,),
    "response_format": (None, {"type": "text"}),
    "top_logprobs": (None, 0),
    "min_tokens": (None, 0),
    "min_p": (None, 0, 0.0),
    "prompt_logprobs": (None,),
}


def number_field(body: dict, key: str, default, lo: float, hi: float, integer: bool = False):
    """body[key] checked: a number (an integer) in [lo, hi], or `default` when absent; else a 400
    naming it."""
    x = body.get(key)
    if x is None:
        return default
    ok = isinstance(x, int) if integer else isinstance(x, (int, float))
    if (
        isinstance(x, bool)
        or not ok
        or not (lo <= x <= hi)
        or (isinstance(x, float) and math.isnan(x))
    ):
        kind = "an integer" if integer else "a number"
        raise RequestError(400, f"{key} must be {kind} in [{lo}, {hi}], got {x!r}", key)
    return x


def valid_unicode(text: str, where: str) -> str:
    """`text`, or a 400 when it holds a lone surrogate (JSON's "\\ud800" alone): not text a
    tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(
            400,
            f"{where} holds a lone surrogate ({text[e.start : e.end]!r} at {e.start}): text must "
            "be valid Unicode",
            where,
        ) from None
    return text


def _text(content, where: str, optional: bool = False) -> str:
    """A message's content: a string, or OpenAI's list of {"type": "text", "text": ...}
    parts joined."""
    if content is None and optional:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise RequestError(
        400, f"{where} must be a string or a list of text parts (no images, audio or files)", where
    )


def _arguments(arguments):
    """A tool call's arguments as chat.render reads them: a JSON string that holds an object is
    read, so it is rendered as the server wrote it when it returned the call (tool_calls.tojson),
    however the client re-serialised it (Qwen Code sends JSON.stringify's compact form back); any
    other string is rendered as it came."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


def _assistant(m: dict, where: str) -> dict:
    msg = {
        "role": "assistant",
        "content": _text(m.get("content"), where + ".content", optional=True),
    }
    calls = m.get("tool_calls") or []
    if not isinstance(calls, list):
        raise RequestError(400, f"{where}.tool_calls must be a list", where + ".tool_calls")
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not (
            isinstance(fn, dict)
            and isinstance(fn.get("name"), str)
            and isinstance(fn.get("arguments"), (str, dict))
        ):
            raise RequestError(
                400,
                f"{where}.tool_calls[{j}] must be {{'type': 'function', 'function': "
                f"{{'name': str, 'arguments': str}}}}",
                f"{where}.tool_calls",
            )
    if calls:
        msg["tool_calls"] = [
            {
                "type": "function",
                "function": {
                    "name": c["function"]["name"],
                    "arguments": _arguments(c["function"]["arguments"]),
                },
            }
            for c in calls
        ]
    if isinstance(m.get("reasoning_content"), str):
        msg["reasoning_content"] = m["reasoning_content"]
    return msg


def chat_messages(body: dict) -> tuple[list[dict], list[dict] | None]:
    """The request's messages and tools, checked and reduced to what chat.render reads (OpenAI's
    chat schema: roles system / user / assistant / tool; assistant tool_calls [{"type": "function",
    "function": {"name", "arguments"}}]; tools [{"type": "function", "function": {"name",
    "parameters": a JSON schema object}}])."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            role = m.get("role") if isinstance(m, dict) else m
            raise RequestError(
                400, f"{where}.role must be system, user, assistant or tool, got {role!r}", where
            )
        out.append(
            _assistant(m, where)
            if m["role"] == "assistant"
            else {"role": m["role"], "content": _text(m.get("content"), where + ".content")}
        )
    tools = body.get("tools")
    if tools is not None and not (
        isinstance(tools, list)
        and all(
            isinstance(t, dict)
            and t.get("type") == "function"
            and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str)
            for t in tools
        )
    ):
        raise RequestError(
            400,
            "tools must be a list of {'type': 'function', 'function': {'name': str, ...}}",
            "tools",
        )
    for i, t in enumerate(tools or []):
        # OpenAI and vLLM answer 400 too: the schema of the arguments is an object
        schema = t["function"].get("parameters")
        if schema is not None and not (
            isinstance(schema, dict) and schema.get("type", "object") == "object"
        ):
            raise RequestError(
                400,
                f"tools[{i}].function.parameters must be a JSON Schema object ({{'type': "
                f"'object', 'properties': ...}}), got {schema!r:.80}",
                "tools",
            )
    return out, tools or None


class ChatChunks:
    """The server-sent events of a streamed chat completion
    (https://platform.openai.com/docs/api-reference/chat- streaming): a role delta per choice,
    content deltas, then per choice its tool calls as one tool_calls delta each and a last delta
    with its finish_reason (and log-probs), the usage (stream_options.include_usage), [DONE]."""

    kind = "chat.completion.chunk"

    def __init__(self, reply_id: str, model: str, include_usage: bool):
        self.id, self.model, self.usage, self.created = (
            reply_id,
            model,
            include_usage,
            int(time.time()),
        )

    def chunk(self, choices: list, **extra) -> bytes:
        data = {
            "id": self.id,
            "object": self.kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **({"usage": None} if self.usage else {}),
            **extra,
        }
        return b"data: " + json.dumps(data).encode() + b"\n\n"

    def start(self, n: int) -> list[bytes]:
        return [
            self.chunk(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    for i in range(n)
                ]
            )
        ]

    def text(self, i: int, delta: str) -> list[bytes]:
        return [
            self.chunk(
                [{"index": i, "delta": {"content": delta}, "logprobs": None, "finish_reason": None}]
            )
        ]

    def end(self, i: int, choice: dict, stop_text: str | None) -> list[bytes]:
        calls = choice["message"].get("tool_calls") or []
        out = (
            [
                self.chunk(
                    [
                        {
                            "index": i,
                            "delta": {
                                "tool_calls": [{"index": j, **c} for j, c in enumerate(calls)]
                            },
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
            ]
            if calls
            else []
        )
        return out + [
            self.chunk(
                [
                    {
                        "index": i,
                        "delta": {},
                        "logprobs": choice["logprobs"],
                        "finish_reason": choice["finish_reason"],
                    }
                ]
            )
        ]

    def done(self, usage: dict) -> list[bytes]:
        return ([self.chunk([], usage=usage)] if self.usage else []) + [b"data: [DONE]\n\n"]

    def error(self, e: RequestError) -> list[bytes]:
        return [b"data: " + json.dumps(e.body()).encode() + b"\n\n"]


class CompletionChunks(ChatChunks):
    """A streamed completion's events: text deltas, then per choice a last chunk with its
    finish_reason, stop_reason and (when asked for) its log-probs and token ids."""

    kind = "text_completion"

    def start(self, n: int) -> list[bytes]:
        return []

    def text(self, i: int, delta: str) -> list[bytes]:
        return [self.chunk([{"index": i, "text": delta, "logprobs": None, "finish_reason": None}])]

    def end(self, i: int, choice: dict, stop_text: str | None) -> list[bytes]:
        return [self.chunk([{**choice, "index": i, "text": ""}])]
