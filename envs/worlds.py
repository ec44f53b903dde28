"""worlds.py: what the worlds (env_*.py) share beyond env.py: an expert's actions replayed through
step() into a demonstration (replay, replay_commands), the JSON-lines files they read (read_jsonl),
and tasks as a dataset on disk (write_tasks, read_tasks; `python -m envs.worlds <env> <split> <n>`
writes one). The core never imports this file.

Imports: env.py.
"""

import gzip
import io
import json
import os
from collections.abc import Callable

from env import Action, Env, EnvState, Task, ToolCall, assistant_message


def replay(
    env: Env,
    task: Task,
    actions: list[Action],
    check: Callable[[int, EnvState, bool], None] | None = None,
) -> tuple[EnvState, list[dict], float, bool]:
    """An expert's `actions` played through env.step from env.reset(task, seed=0), as the agent loop
    plays a model's
    -> (the last state, the conversation, the last step's reward, done): the demonstration of a
    world whose expert is a script (tau_lite; alfworld_lite and textworld through replay_commands).

    The conversation is what the agent's transcript holds: [system, user], then each action as an
    assistant message and its observations, except those of the step that ends the episode (the
    agent stops there). `check(i, state, done)` runs after action i and raises if the expert went
    wrong there: no wrong demonstration is ever trained on. RuntimeError when the episode ends with
    actions left."""
    state, messages = env.reset(task, seed=0)
    reward, done = 0.0, False
    for i, action in enumerate(actions):
        if done:
            raise RuntimeError(f"the episode of {task.id} ended before the expert script did")
        state, obs, reward, done, _ = env.step(state, action)
        messages.append(assistant_message(action.text, list(action.tool_calls)))
        messages += [] if done else obs
        if check is not None:
            check(i, state, done)
    return state, messages, reward, done


def replay_commands(
    env: Env, task: Task, tool_name: str, commands: list[str], what: str
) -> tuple[EnvState, list[dict]]:
    """replay for a world played through one command tool (alfworld_lite's house_act, textworld's
    tw_act) whose state counts invalid_actions -> (the last state, the conversation). RuntimeError
    naming the command (`what` and its index): one was not admissible, or the episode did not end
    exactly at the last one."""

    def check(i: int, state: EnvState, done: bool) -> None:
        if done != (i == len(commands) - 1) or state.invalid_actions:
            raise RuntimeError(
                f"{what} {i} {commands[i]!r} of {task.id}: done={done}, "
                f"invalid={state.invalid_actions}"
            )

    actions = [Action(text="", tool_calls=(ToolCall(tool_name, {"command": c}),)) for c in commands]
    state, messages, _, _ = replay(env, task, actions, check)
    return state, messages


def read_jsonl(path: str | os.PathLike, data: bytes | None = None) -> list[tuple[int, dict]]:
    """(line number, record) of each non-blank line of a JSON-lines file, gzipped or not (told by
    the gzip magic number, not the name): every file a world reads. `data`: the file's bytes when
    the caller already holds them (a package's resource); `path` then only names it in errors.
    ValueError naming the file and line: a line that is not JSON, or not a JSON object."""
    if data is None:
        with open(path, "rb") as f:
            data = f.read()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    records = []
    # newline=None: lines end as in a file opened as text (\n, \r\n, \r), never inside a JSON
    # string (U+2028)
    for number, line in enumerate(io.StringIO(data.decode("utf-8"), newline=None), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} line {number} is not JSON: {e.msg}") from None
        if not isinstance(record, dict):
            raise ValueError(
                f"{path} line {number} is a JSON {type(record).__name__}, not an object"
            )
        records.append((number, record))
    return records


def write_tasks(tasks: list[Task], path: str) -> None:
    """Tasks as JSON lines ({"env", "id", "prompt", "answer", "meta"}), in order: a dataset
    on disk."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:  # read_jsonl reads UTF-8
        for t in tasks:
            f.write(
                json.dumps(
                    {
                        "env": t.env,
                        "id": t.id,
                        "prompt": t.prompt,
                        "answer": t.answer,
                        "meta": t.meta,
                    },
                    ensure_ascii=False,
                    sort_keys=True,
                )
                + "\n"
            )


def read_tasks(path: str) -> list[Task]:
    """The tasks write_tasks wrote."""
    return [Task(**record) for _, record in read_jsonl(path)]


if __name__ == "__main__":
    # Write an env's tasks as JSON lines, deterministically from the seed:
    #   python -m envs.worlds tool_use test 500 --seed 0 --out data/tool_use_test.jsonl [--kwargs
    # '{"hops": 2}']
    import argparse

    p = argparse.ArgumentParser(description="write an env's tasks as JSON lines")
    p.add_argument("env")
    p.add_argument("split", choices=["train", "test"])
    p.add_argument("n", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kwargs", default="{}", help="JSON object of make_env arguments")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    # env.make_env imports the env's own file by name (env.ENTRY_POINTS), which registers it
    import env

    write_tasks(
        env.make_env(a.env, **json.loads(a.kwargs)).sample_tasks(a.split, a.n, a.seed), a.out
    )
    print(f"wrote {a.n} {a.env} {a.split} tasks to {a.out}")
