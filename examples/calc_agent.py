"""examples/calc_agent.py: a ReAct agent with a calculator tool, written only against the `openai`
client, that train.py can train (rollout.external_agent=examples/calc_agent.py:run;
docs/external_agent.md).

    python train.py --config configs/toy_math.yaml rollout.external_agent=examples/calc_agent.py:run

The loop (ReAct, Yao et al. 2022, https://arxiv.org/abs/2210.03629, with native tool calls in place
of the "Action:" text lines): ask the model; run every tool call it makes with the agent's own tools
and send the results back; stop when it calls finish, replies without a tool call, or MAX_TURNS
requests were made. It returns its final answer as text, which the trainer grades with the env's own
grader: the agent never sees the reference answer.

Its tools are its own: `python_eval` is a calculator (integer and float arithmetic parsed with
`ast`, no Python is run, unlike toy_math's sandbox), `finish` ends the episode. Their names,
descriptions and the system prompt are the ones toy_math renders, because the default model was
SFT-warm-started on that very prompt (sft.py): a tiny model sees other words as another task, and
would start RL from nothing. Give your own agent its own prompt and tools when its model reads
instructions.

Nothing here imports this repository: the file is what a user's agent looks like.
"""

import ast
import json
import operator
import re
import threading

import openai

SYSTEM = "Solve the problem. Use python_eval to compute and finish to give the answer."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "python_eval",
            "description": "Run Python code and return the result.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string"}},
                "required": ["code"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "finish",
            "description": "Submit the final answer.",
            "parameters": {
                "type": "object",
                "properties": {"answer": {"type": "string"}},
                "required": ["answer"],
            },
        },
    },
]
MAX_TURNS = 4  # requests per episode at most
timeout_s = 120.0  # seconds an episode may take; train.py reads this attribute of run (below)

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculate(expression: str) -> str:
    """An arithmetic expression -> its value as text, or "Error: ..." (never raises): numbers, + - *
    / // % ** and parentheses; powers with exponents up to 100, so a call cannot hang the agent."""

    def value(node):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, (int, float))
            and not isinstance(node.value, bool)
        ):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 100:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    try:
        return str(value(ast.parse(expression.strip(), mode="eval").body))
    except Exception as e:
        return f"Error: {type(e).__name__}: {e}"


_clients: dict[str, openai.OpenAI] = {}
_clients_lock = threading.Lock()


def client_for(base_url: str) -> openai.OpenAI:
    """One client per server, shared by the episodes' threads (its connection pool is
    thread-safe)."""
    with _clients_lock:
        if base_url not in _clients:
            _clients[base_url] = openai.OpenAI(
                base_url=base_url, api_key="unused", max_retries=0, timeout=60.0
            )
        return _clients[base_url]


def run(task: dict, base_url: str, session: str) -> str:
    """One episode of task["prompt"] -> the final answer (text; "" when the model gave none)."""
    client = client_for(base_url)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["prompt"]}]
    for _ in range(MAX_TURNS):
        try:
            reply = client.chat.completions.create(
                model="policy", messages=messages, tools=TOOLS, user=session
            )
        except openai.BadRequestError as e:
            if e.code == "context_length_exceeded":
                # the conversation outgrew the context window: no answer
                return ""
            raise
        message = reply.choices[0].message
        # sent back as it came: the prefix stays exact
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:  # a plain reply is the answer: its last number
            numbers = re.findall(r"-?\d+(?:\.\d+)?", message.content or "")
            return numbers[-1] if numbers else ""
        for call in message.tool_calls:
            try:
                arguments = json.loads(call.function.arguments)
            except json.JSONDecodeError:
                arguments = {}
            if call.function.name == "finish":
                return str(arguments.get("answer", ""))
            if call.function.name == "python_eval":
                result = calculate(str(arguments.get("code", "")))
            else:
                result = f"Error: unknown tool {call.function.name!r}. Tools: python_eval, finish."
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""  # out of turns


run.timeout_s = timeout_s
