"""env_vault.py: "vault", a world where remembering must be learned: a fact the episode shows at its
first turn is needed at its last, the turns between outgrow the context window, and no state line
carries the fact (docs/memory.md, "The vault").

The world. A vault, its code (three digits) written on a note, and 1-3 crates to carry out first.
Three tools:
    vault_note()            read the note: "Vault code 482.\nNext crate: 57. Crates left: 3."
                            (once: read again, it is blank)
    vault_carry(crate)      carry the crate the last observation named next: "Crate 57 carried.
                            Its tag: <tag_letters random letters>.\nNext crate: 13. Crates left: 2."
    vault_open(code)        once every crate is out: the code opens the vault (reward 1) or the
                            episode ends shut (reward 0); before, "The vault stays shut until every
                            crate is carried." (an invalid action, as a wrong crate, the note read
                            again or a message without a tool call is)
Neither the system prompt nor the task holds the code (a compacted prompt always keeps both), and
the world has no state line (Env.state_line is None): the code is shown once, by the note. Every
observation ends with a line on where the episode stands (the next crate, the crates left), so a
window of the last turn suffices for everything but the code. The tags make the observations long
(64 letters are ~65 tokens with the embedded model's BPE), so an episode outgrows a window of ~200
tokens, and memory=window drops the note while memory=full runs out of room. They are letters, not
digits: the only digits an episode shows are the numbers the policy copies.

The expert: the note, each crate in turn, the code. Its summary, asked by memory=summary when the
context is full, is the env's, in info["summary"] after every step (wings/memory.py's
demonstration_rows answers a summary request with it; a compacted prompt never shows it, unlike a
state line), written as the observations write it (the run's BPE splits at digits and newlines
only, so each line's tokens are the same in the note, the summary and the prompt that quotes it):
"Vault code 482.\nNext crate: 13. Crates left: 2." A forgetful expert leaves the code's line out:
`summary_keeps` is the share of tasks, by a stable hash of the task id, whose expert summaries keep
it, so a model SFT-trained on the demonstrations keeps it about that often, and its success is
limited by what its summaries keep. The system prompt says what a summary is for, in the memory
policy's own words, so that the run's BPE holds the summary request in ~30 tokens, not ~120.

Split: by the code, a stable hash (TEST_PERCENT of the 900 codes are held out): a held-out task's
code was never seen in training, so it must be read and copied, not recalled.
info["metrics"]: "success", "crates_left", "invalid_actions" after every step.

Imports: tools.py, env.py (and the standard library).
"""

import hashlib
import json
import random
from dataclasses import dataclass, replace

from env import (
    Action,
    Env,
    EnvState,
    Task,
    ToolCall,
    assistant_message,
    register_env,
    sample_distinct,
    split_of,
    tool_message,
)
from tools import tool

TEST_PERCENT = 20  # share of the codes held out; fixed for every config
SUCCESS = "success"  # the answer vault_open records when the code opens the vault
SHUT = "shut"  # ... and when it does not


@dataclass(frozen=True)
class VaultState(EnvState):
    """One episode; every call returns a new one (dataclasses.replace)."""

    carried: int = 0  # crates carried out so far, in the task's order
    read: bool = False  # the note was read
    # wrong crates, the note read again, an early vault_open, messages without a tool call
    invalid_actions: int = 0


def crates_of(state: VaultState) -> list[str]:
    return state.task.meta["crates"]


def progress(state: VaultState) -> str:
    """'Next crate: 13. Crates left: 2.', or the end of the chores: a line of its own in every
    observation and expert summary, so its tokens are the same everywhere (the run's BPE splits at
    digits and newlines only)."""
    crates = crates_of(state)
    left = len(crates) - state.carried
    if not left:
        return "All crates are carried: open the vault."
    return f"Next crate: {crates[state.carried]}. Crates left: {left}."


def tag(task: Task, i: int, letters: int) -> str:
    """Crate i's tag: `letters` random lowercase letters, the same for the same task (random.Random
    of a string is seeded by its SHA-512: stable across processes). Letters, not digits: the only
    digits an episode shows are the code and the crates, the numbers the policy copies."""
    rng = random.Random(f"{task.id}/{i}")
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(letters))


def invalid(state: VaultState, text: str) -> tuple[VaultState, str, None]:
    """An action that does nothing: counted, and the observation says where the episode stands."""
    state = replace(state, invalid_actions=state.invalid_actions + 1)
    return state, f"{text}\n{progress(state)}", None


@tool("vault_note", "Read the note.", {"type": "object", "properties": {}}, bounded=True)
def vault_note(env, state):
    """The note shows the code (and the first crate), once: read again, it is blank (an invalid
    action), so the code cannot be fetched again at the end. The code's line is the expert
    summary's first line, word for word."""
    if state.read:
        return invalid(state, "The note is blank now.")
    state = replace(state, read=True)
    return state, f"Vault code {state.task.answer}.\n{progress(state)}", None


@tool(
    "vault_carry",
    "Carry a crate out.",
    {"type": "object", "properties": {"crate": {"type": "string"}}, "required": ["crate"]},
    bounded=True,
)
def vault_carry(env, state, crate):
    """Carry out the crate named next; any other is an invalid action."""
    crates = crates_of(state)
    if state.carried == len(crates) or crate.strip() != crates[state.carried]:
        return invalid(state, f"No crate {crate[:8]} to carry.")
    label = tag(state.task, state.carried, env.tag_letters)
    state = replace(state, carried=state.carried + 1)
    return state, f"Crate {crate.strip()} carried. Its tag: {label}.\n{progress(state)}", None


@tool(
    "vault_open",
    "Open the vault with its code.",
    {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    bounded=True,
)
def vault_open(env, state, code):
    """With every crate out, one try: the episode ends, opened (the right code) or shut."""
    if state.carried < len(crates_of(state)):
        return invalid(state, "The vault stays shut until every crate is carried.")
    opened = code.strip() == state.task.answer
    return replace(state, done=True, answer=SUCCESS if opened else SHUT), "", None


@register_env("vault")
class VaultEnv(Env):
    """Read a code, carry 1-3 crates (long observations), open the vault with the code; reward 1
    when it opens. See the file docstring."""

    tool_names = ("vault_note", "vault_carry", "vault_open")

    def __init__(
        self,
        crates: tuple[int, int] = (1, 3),
        tag_letters: int = 96,
        summary_keeps: float = 1.0,
    ):
        if not 1 <= crates[0] <= crates[1] <= 9:
            raise ValueError(f"crates {crates} must be (least, most) with 1 <= least <= most <= 9")
        if tag_letters < 0 or not 0.0 <= summary_keeps <= 1.0:
            raise ValueError("tag_letters must be >= 0 and summary_keeps in [0, 1]")
        self.crates = tuple(crates)  # the crates a task asks to carry: (least, most)
        self.tag_letters = tag_letters  # letters of each crate's tag (the observations' length)
        # share of tasks whose expert summary keeps the code (a stable hash of the task id decides)
        self.summary_keeps = summary_keeps

    def system_prompt(self) -> str:
        # the memory policy's words (wings/memory.py's SUMMARY_REQUEST and SUMMARY_HEAD) are here
        # too: the run's BPE, trained on the demonstrations, then holds them in ~30 tokens, not ~120
        return (
            "Open the vault. Read the note first: it holds the code. "
            "Then carry out every crate, each time the one named next, and open the vault. "
            "Your context is full when the next turn would not fit: you are then asked to "
            "summarize what you have done and learned so far, and what is left to do, in a few "
            "lines. The episode then goes on from this summary and your last turns: the summary "
            "of your progress so far is all you keep."
        )

    def sample_tasks(self, split: str, n: int, seed: int) -> list[Task]:
        """n distinct tasks of `split`: a code of 100-999 (its hash decides the split) and
        distinct two-digit crates."""

        def draw(rng: random.Random) -> Task | None:
            code = str(rng.randint(100, 999))
            crates = rng.sample(range(10, 100), rng.randint(*self.crates))
            if split_of(f"vault/{code}", TEST_PERCENT) != split:
                return None
            meta = {"crates": [str(c) for c in crates]}
            key = json.dumps([code, meta["crates"]])
            return Task(
                env=self.name,
                id=f"{self.name}/{hashlib.sha256(key.encode()).hexdigest()[:16]}",
                prompt=f"Carry out the {len(crates)} crates, then open the vault with its code.",
                answer=code,
                meta=meta,
            )

        return sample_distinct(draw, split, n, seed)

    def reset(self, task: Task, seed: int) -> tuple[VaultState, list[dict]]:
        """A fresh vault; `seed` is unused (the world is deterministic)."""
        _, messages = super().reset(task, seed)
        return VaultState(task=task), messages

    def keeps(self, task: Task) -> bool:
        """Whether the expert's summaries of `task` keep the code: a stable hash of its id, below
        summary_keeps."""
        h = int(hashlib.sha256(f"keep/{task.id}".encode()).hexdigest(), 16) % 10**6
        return h < self.summary_keeps * 10**6

    def summary(self, state: VaultState) -> str:
        """The expert's summary of the episode so far (info["summary"]): the code when the note was
        read and the expert keeps it, and where the chores stand."""
        code = f"Vault code {state.task.answer}.\n" if state.read and self.keeps(state.task) else ""
        return code + progress(state)

    def step(
        self, state: VaultState, action: Action
    ) -> tuple[VaultState, list[dict], float, bool, dict]:
        """Env.step, plus the expert's summary (info["summary"]) and info["metrics"] after every
        step."""
        state, obs, reward, done, info = super().step(state, action)
        info["summary"] = self.summary(state)
        info["metrics"] = {
            "success": float(state.answer == SUCCESS),
            "crates_left": float(len(crates_of(state)) - state.carried),
            "invalid_actions": float(state.invalid_actions),
        }
        return state, obs, reward, done, info

    def on_text(
        self, state: VaultState, text: str
    ) -> tuple[VaultState, list[dict], float, bool, dict]:
        """A message without a tool call does nothing: an invalid action, not an answer."""
        state, text, _ = invalid(state, "Call a tool.")
        return state, [tool_message("error", text)], 0.0, False, {}

    def score(self, task: Task, answer: str | None) -> float:
        return 1.0 if answer == SUCCESS else 0.0

    def format_ok(self, answer: str) -> bool:
        return answer == SUCCESS

    def demonstration(self, task: Task, rng: random.Random, use_tools: bool) -> list[dict]:
        """The expert: the note, each crate in order, the code (one path: rng and use_tools are
        unused)."""
        calls = [ToolCall("vault_note", {})]
        calls += [ToolCall("vault_carry", {"crate": c}) for c in task.meta["crates"]]
        calls.append(ToolCall("vault_open", {"code": task.answer}))
        state, messages = self.reset(task, seed=0)
        for call in calls:
            state, obs, reward, done, _ = self.step(state, Action(text="", tool_calls=(call,)))
            messages.append(assistant_message("", [call]))
            messages += [] if done else obs
        if reward != 1.0:  # never train on a demonstration that is wrong
            raise RuntimeError(f"the expert did not open the vault of {task.id}")
        return messages

    def random_action(self, state: VaultState, rng: random.Random) -> Action:
        """The floor: a random tool with random digits (a crate of 10-99, a code of 100-999)."""
        name = rng.choice(self.tool_names)
        arguments = {
            "vault_note": {},
            "vault_carry": {"crate": str(rng.randint(10, 99))},
            "vault_open": {"code": str(rng.randint(100, 999))},
        }[name]
        return Action(text="", tool_calls=(ToolCall(name, arguments),))
