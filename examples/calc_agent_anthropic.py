"""examples/calc_agent_anthropic.py: calc_agent.py's twin written only against the `anthropic`
client (Anthropic's Messages API: tool_use and tool_result blocks), trainable the same way
(docs/external_agent.md):

    python train.py --config configs/toy_math.yaml
    rollout.external_agent=examples/calc_agent_anthropic.py:run

The same ReAct loop, tools, system prompt and answer as calc_agent.py, which it imports for them (so
the two cannot drift apart): the server renders a Messages request through the same chat format, so
an episode played by either agent is the same tokens. Two things differ from the OpenAI client:
Anthropic's client takes the server's URL without the /v1, and the session goes in metadata.user_id.
The run's sampling settings are the server's (a request may not choose them), so this agent sends
none.

Nothing here imports this repository: the file is what a user's agent looks like.
"""

import os
import re
import sys
import threading

import anthropic

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling, calc_agent.py
from calc_agent import MAX_TURNS, SYSTEM, TOOLS, calculate, timeout_s  # noqa: E402 (the twin's own tools and prompt)

# the OpenAI tool schemas as Anthropic's: {name, description, input_schema}
ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]

_clients: dict[str, anthropic.Anthropic] = {}
_clients_lock = threading.Lock()


def client_for(base_url: str) -> anthropic.Anthropic:
    """One client per server, shared by the episodes' threads. Anthropic's client adds /v1/messages
    itself."""
    root = base_url[:-3] if base_url.endswith("/v1") else base_url
    with _clients_lock:
        if root not in _clients:
            _clients[root] = anthropic.Anthropic(
                base_url=root, api_key="unused", max_retries=0, timeout=60.0
            )
        return _clients[root]


def run(task: dict, base_url: str, session: str) -> str:
    """One episode of task["prompt"] -> the final answer (text; "" when the model gave none)."""
    client = client_for(base_url)
    messages = [{"role": "user", "content": task["prompt"]}]
    for _ in range(MAX_TURNS):
        try:
            reply = client.messages.create(
                model="policy",
                max_tokens=1024,
                system=SYSTEM,
                messages=messages,
                tools=ANTHROPIC_TOOLS,
                metadata={"user_id": session},
            )
        except anthropic.BadRequestError as e:
            if "context length" in str(e):  # the conversation outgrew the context window: no answer
                return ""
            raise
        messages.append(
            {
                "role": "assistant",
                "content": [b.model_dump(exclude_none=True) for b in reply.content],
            }
        )
        calls = [b for b in reply.content if b.type == "tool_use"]
        if not calls:  # a plain reply is the answer: its last number
            text = "".join(b.text for b in reply.content if b.type == "text")
            numbers = re.findall(r"-?\d+(?:\.\d+)?", text)
            return numbers[-1] if numbers else ""
        results = []
        for call in calls:
            if call.name == "finish":
                return str(call.input.get("answer", ""))
            if call.name == "python_eval":
                result = calculate(str(call.input.get("code", "")))
            else:
                result = f"Error: unknown tool {call.name!r}. Tools: python_eval, finish."
            results.append({"type": "tool_result", "tool_use_id": call.id, "content": result})
        messages.append({"role": "user", "content": results})
    return ""  # out of turns


run.timeout_s = timeout_s
