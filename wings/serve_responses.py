"""serve_responses.py: OpenAI's Responses API (POST /v1/responses) as a dialect of serve.py's chat
endpoint: a request is translated into the OpenAI chat request serve.Server already serves, and the
reply (or its stream of events) back, as serve_anthropic.py does for Anthropic's Messages. So a
Responses request is rendered by the same chat format, sampled by the same engine call and captured
in the same records as a chat completion (a wing of serve.py's).

    https://platform.openai.com/docs/api-reference/responses/create     the request and the response
    https://platform.openai.com/docs/api-reference/responses-streaming  the events of stream=true

What maps to what:
  instructions                         -> the system message, first
  input, a string                      -> one user message
  input items:
    message, role system or developer  -> a system message
    message, role user                 -> a user message (its input_text parts joined)
    message, role assistant            -> an assistant message (its output_text parts joined)
    reasoning                          -> the reasoning of the next assistant message (its
                                          reasoning_text parts, else its encrypted_content,
                                          which this server writes as the reasoning text itself)
    function_call                      -> a tool call of the assistant message just before it
                                          (a new assistant message when none is open)
    function_call_output               -> a tool message
  tools, type function                 -> chat tools {"type": "function", "function": {...}}
  max_output_tokens, user              -> max_tokens, the session (as chat's `user`)
  the response: a reasoning item when the chat format thought (Qwen3), a message item with the
  text, then a function_call item per tool call; status "incomplete" (max_output_tokens) when the
  tokens ran out.
Built-in tools (web_search, file_search, ...: a model served here cannot call them) and namespaces
(groups of functions, which a chat template cannot write) are dropped and counted. Refused (400,
OpenAI's error object): previous_response_id, conversation and item_reference items (this server
stores nothing: every request carries its whole input), images and files, tool_choice other than
auto, text.format other than text, background. IGNORED lists the fields accepted without effect;
docs/serve.md's table says why for each.

Imports: wings/serve_http.py (RequestError) (and the standard library).
"""

import json
import time

from wings.serve_http import RequestError

# the same meaning as in a chat request
PASSED = ("model", "temperature", "top_p", "top_k", "stream", "seed")
# accepted and ignored: none changes what is sampled (docs/serve.md's field table)
IGNORED = (
    "store",
    "include",
    "parallel_tool_calls",
    "prompt_cache_key",
    "prompt_cache_retention",
    "client_metadata",
    "metadata",
    "service_tier",
    "safety_identifier",
    "truncation",
    "stream_options",
    "max_tool_calls",
)
# the content parts read as text
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def _text(content, where: str) -> str:
    """A message's content: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        for j, p in enumerate(content):
            if p.get("type") not in TEXT_PARTS or not isinstance(p.get("text"), str):
                raise RequestError(
                    400,
                    f"{where}[{j}]: {p.get('type')!r} parts are not supported (text parts only: "
                    "no images, audio or files)",
                    where,
                )
        return "".join(p["text"] for p in content)
    raise RequestError(400, f"{where} must be a string or a list of text parts", where)


def _reasoning(item: dict, where: str) -> str:
    parts = item.get("content") or []
    if parts:
        return _text(parts, f"{where}.content")
    text = item.get("encrypted_content")
    return text if isinstance(text, str) else ""


def _call(item: dict, where: str) -> dict:
    if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
        raise RequestError(
            400, f"{where}: a function_call needs call_id, name and arguments (strings)", where
        )
    return {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }


def _messages(items, where: str = "input") -> list[dict]:
    """The input items -> chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise RequestError(400, "input must be a string or a list of input items", where)
    out, reasoning = [], None
    # the assistant message that function_call items join, while one is open
    assistant = None
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        kind = item.get("type", "message")
        if kind == "reasoning":
            reasoning = _reasoning(item, at)
            continue
        if kind == "function_call":
            if assistant is None:
                assistant = {"role": "assistant", "content": None}
                out.append(assistant)
            assistant.setdefault("tool_calls", []).append(_call(item, at))
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise RequestError(400, f"{at}: a function_call_output needs a call_id", at)
            content = _text(output, f"{at}.output")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": content})
            assistant = None
        elif kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise RequestError(
                    400, f"{at}.role must be system, developer, user or assistant", at
                )
            text = _text(item.get("content"), f"{at}.content")
            if role == "assistant":
                assistant = {"role": "assistant", "content": text}
                out.append(assistant)
                continue
            out.append({"role": "user" if role == "user" else "system", "content": text})
            assistant = None
        else:
            raise RequestError(
                400,
                f"{at}: {kind!r} items are not supported (message, reasoning, function_call and "
                "function_call_output; this server stores nothing, so no item_reference)",
                at,
            )
        if reasoning is not None and out[-1]["role"] == "assistant":
            out[-1]["reasoning_content"] = reasoning
        reasoning = None
    return out


def _tools(tools) -> tuple[list[dict] | None, list[str]]:
    """Function tools -> chat tools, and the built-in tools' types left out."""
    if tools is None:
        return None, []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RequestError(400, "tools must be a list of tool objects", "tools")
    out, dropped = [], []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            dropped.append(f"tools.{t.get('type')}")
            continue
        if not isinstance(t.get("name"), str):
            raise RequestError(400, f"tools[{i}].name must be a string", "tools")
        fn = {
            "name": t["name"],
            **({"description": t["description"]} if t.get("description") else {}),
            "parameters": t.get("parameters") or {"type": "object", "properties": {}},
        }
        out.append({"type": "function", "function": fn})
    return out or None, dropped


def to_chat(body: dict) -> tuple[dict, str | None, list[str], bool | None]:
    """A Responses request -> (the chat request that serve.Server serves, the session named by
    `user`, the fields ignored or dropped, whether the model should think: None for its default,
    False for reasoning.effort "none")."""
    for key in ("previous_response_id", "conversation"):
        if body.get(key) is not None:
            raise RequestError(
                400,
                f"{key}: this server stores no responses; send the whole conversation as input",
                key,
            )
    if body.get("background"):
        raise RequestError(400, "background responses are not supported", "background")
    if (body.get("tool_choice") or "auto") != "auto":
        raise RequestError(
            400, "tool_choice other than auto is not supported by this server", "tool_choice"
        )
    text = body.get("text") or {}
    if not isinstance(text, dict) or (text.get("format") or {"type": "text"}) != {"type": "text"}:
        raise RequestError(400, "text.format other than text is not supported", "text")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError(400, "instructions must be a string", "instructions")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    messages += _messages(body.get("input"))
    tools, ignored = _tools(body.get("tools"))
    ignored += [k for k in IGNORED if body.get(k) not in (None, [], {})]
    ignored += ["text.verbosity"] if text.get("verbosity") is not None else []
    reasoning = body.get("reasoning") or {}
    if not isinstance(reasoning, dict):
        raise RequestError(400, "reasoning must be an object", "reasoning")
    ignored += [f"reasoning.{k}" for k in reasoning if k != "effort"]
    think = False if reasoning.get("effort") == "none" else None
    max_tokens = body.get("max_output_tokens")
    chat = {
        **{k: body[k] for k in PASSED if k in body},
        "messages": messages,
        "tools": tools,
        **({"max_tokens": max_tokens} if max_tokens is not None else {}),
    }
    return chat, body.get("user"), ignored, think


# -----------------------------------------------------------------------------
# the response, whole or as events


class Response:
    """The Responses object of a chat reply (one choice), built item by item, so that the stream
    (Events) and the unstreamed answer are the same object: its id, the items' ids and the echo of
    the request's settings."""

    def __init__(self, reply_id: str, model: str, body: dict):
        self.id = "resp_" + reply_id.split("-")[-1]
        self.head = {
            "id": self.id,
            "object": "response",
            "created_at": int(time.time()),
            "model": model,
            "instructions": body.get("instructions"),
            "tools": [t for t in body.get("tools") or [] if t.get("type") == "function"],
            "tool_choice": "auto",
            "parallel_tool_calls": bool(body.get("parallel_tool_calls", True)),
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "user": body.get("user"),
            "metadata": body.get("metadata") or {},
            "error": None,
            "incomplete_details": None,
        }
        # the reasoning text travels back as encrypted_content when the client asks for it
        self.encrypted = "reasoning.encrypted_content" in (body.get("include") or [])

    def reasoning_item(self, text: str) -> dict:
        return {
            "id": f"rs_{self.id[5:]}",
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
            **({"encrypted_content": text} if self.encrypted else {}),
            "status": "completed",
        }

    def message_item(self, text: str, status: str = "completed") -> dict:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {
            "id": f"msg_{self.id[5:]}",
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [part] if status == "completed" else [],
        }

    def call_item(self, call: dict) -> dict:
        return {
            "id": f"fc_{call['id']}",
            "type": "function_call",
            "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": call["function"]["arguments"],
            "status": "completed",
        }

    def output(self, message: dict) -> list[dict]:
        """An OpenAI assistant message -> its output items."""
        out = []
        if message.get("reasoning_content") is not None:
            out.append(self.reasoning_item(message["reasoning_content"]))
        if message.get("content") or not message.get("tool_calls"):
            out.append(self.message_item(message.get("content") or ""))
        return out + [self.call_item(c) for c in message.get("tool_calls") or []]

    def whole(self, output: list[dict], finish_reason: str | None, usage: dict | None) -> dict:
        done = finish_reason is not None
        incomplete = finish_reason == "length"
        return {
            **self.head,
            "status": "in_progress" if not done else "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": output,
            "usage": None
            if usage is None
            else {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"],
            },
        }


def response(reply: dict, body: dict) -> dict:
    """A chat completion (one choice) -> the Responses object."""
    r = Response(reply["id"], reply["model"], body)
    choice = reply["choices"][0]
    return r.whole(r.output(choice["message"]), choice["finish_reason"], reply["usage"])


class Events:
    """The server-sent events of a streamed response (one choice): response.created and
    response.in_progress; a reasoning item fed delta by delta when the model thinks; a message item
    fed delta by delta; then the function_call items and response.completed (or
    response.incomplete) once the reply is known. The same calls as serve_openai.py's ChatChunks:
    start, thinking, text, end, done, error."""

    def __init__(self, reply_id: str, model: str, body: dict):
        self.response = Response(reply_id, model, body)
        self.sequence = 0
        self.items: list[dict] = []  # the output items, as they are closed
        self.open: dict | None = None  # the item being streamed: its output index and text
        self.finish: str | None = None

    def event(self, kind: str, **data) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()

    def start(self, n: int) -> list[bytes]:
        head = self.response.whole([], None, None)
        return [
            self.event("response.created", response=head),
            self.event("response.in_progress", response=head),
        ]

    def _open(self, kind: str) -> list[bytes]:
        """Open a reasoning or a message item (closing the other)."""
        if self.open is not None and self.open["kind"] == kind:
            return []
        out = self._close()
        index = len(self.items)
        if kind == "reasoning":
            item = {**self.response.reasoning_item(""), "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = self.response.message_item("", status="in_progress")
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.open = {"kind": kind, "index": index, "id": item["id"], "text": ""}
        return out + [
            self.event("response.output_item.added", output_index=index, item=item),
            self.event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            ),
        ]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        o, self.open = self.open, None
        where = {"item_id": o["id"], "output_index": o["index"], "content_index": 0}
        if o["kind"] == "reasoning":
            item = self.response.reasoning_item(o["text"])
            done = [self.event("response.reasoning_text.done", **where, text=o["text"])]
        else:
            item = self.response.message_item(o["text"])
            done = [self.event("response.output_text.done", **where, text=o["text"], logprobs=[])]
        self.items.append(item)
        return done + [
            self.event("response.content_part.done", **where, part=item["content"][0]),
            self.event("response.output_item.done", output_index=o["index"], item=item),
        ]

    def _delta(self, kind: str, delta: str) -> list[bytes]:
        out = self._open(kind)
        self.open["text"] += delta
        where = {"item_id": self.open["id"], "output_index": self.open["index"], "content_index": 0}
        if kind == "reasoning":
            return out + [self.event("response.reasoning_text.delta", **where, delta=delta)]
        return out + [self.event("response.output_text.delta", **where, delta=delta, logprobs=[])]

    def thinking(self, i: int, delta: str) -> list[bytes]:
        return self._delta("reasoning", delta)

    def text(self, i: int, delta: str) -> list[bytes]:
        return self._delta("message", delta)

    def end(self, i: int, choice: dict, stop_text: str | None) -> list[bytes]:
        message = choice["message"]
        out = []
        # a reply with no text and no call still has its (empty) message item, as unstreamed
        kinds = [it["type"] for it in self.items] + [self.open["kind"] if self.open else None]
        if "message" not in kinds and not message.get("tool_calls"):
            out += self._open("message")
        out += self._close()
        for call in message.get("tool_calls") or []:
            index, item = len(self.items), self.response.call_item(call)
            where = {"item_id": item["id"], "output_index": index}
            out += [
                self.event(
                    "response.output_item.added",
                    output_index=index,
                    item={**item, "arguments": "", "status": "in_progress"},
                ),
                self.event(
                    "response.function_call_arguments.delta", **where, delta=item["arguments"]
                ),
                self.event(
                    "response.function_call_arguments.done", **where, arguments=item["arguments"]
                ),
                self.event("response.output_item.done", output_index=index, item=item),
            ]
            self.items.append(item)
        self.finish = choice["finish_reason"]
        return out

    def error(self, e: RequestError) -> list[bytes]:
        return [self.event("error", code=e.code, message=e.message, param=e.param)]

    def done(self, usage: dict) -> list[bytes]:
        whole = self.response.whole(self.items, self.finish, usage)
        kind = "response.incomplete" if whole["status"] == "incomplete" else "response.completed"
        return [self.event(kind, response=whole)]
