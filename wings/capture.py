"""capture.py: what serve.py records of every call, per session, and the agent.Trajectory rows a
session trains as (a wing of agent.py, used by wings/serve.py and wings/external_agent.py).

A session is the calls that name one id (the X-Session-Id header, OpenAI's `user`, Anthropic's
metadata.user_id). For every call the Capture keeps the exact prompt ids, sampled ids, engine
log-probs, kept-set sizes and the weight version of every token (typed records: Call, Sample),
nothing re-tokenized.

Serving order. A call's place in its session is reserved when it is handed to the engine
(Capture.reserve, in the order the requests arrived), and its record fills that place when its
answer is complete: two calls of one session in flight together are recorded in the order they were
served, whichever finishes first. A call whose client left before its answer was complete is not
recorded (Capture.disconnected counts them), so no half record is kept. Sessions idle for ttl_s are
forgotten (Capture.expired), so a long-running server needs no consumer.

The tree. A call continues an earlier one when its prompt is that call's prompt followed by one of
its samples, token for token (continued_sample: the prefix invariant); link() gives every call the
latest such call of the LINK_WINDOW before it (Call.parent_call) and the sample (Call.parent).
session_trajectories turns the tree into rows:
  - one row per end (a call no later call continues) and per sample of it: the chain from its root,
    first prompt (mask 0), each continued completion (mask 1, with its log-probs, kept sizes,
    versions), the tokens each next prompt adds (mask 0: tool results, user turns, the <|im_end|> of
    a cut turn), as agent.play_episodes appends them. An honest multi-turn client is one chain: one
    row, the trajectory our agent loop builds;
  - a retried request (the client timed out and resent it: a later call has the same prompt ids)
    that nothing continues is an orphan: dropped, counted in serve/orphans; the resend's chain
    is trained;
  - n > 1 with the client continuing one choice: the row holds that choice; the others are
    serve/unused_samples;
  - a side call (a title or a summary request that neither continues nor is continued) and a
    rewritten history (the client dropped a think block, edited a message) start chains of their
    own: each its own row (serve/branched 1).
Rows hold only ids the engine saw or sampled. Rewards are 0: the server does not know them.

Imports: env.py (Task), agent.py (Trajectory) (and the standard library).
"""

import threading
import time
from dataclasses import dataclass, field, replace

from agent import Trajectory
from env import Task

# how many earlier calls a call is matched against (a retry, an undo or a side call sits close)
LINK_WINDOW = 32


@dataclass
class Sample:
    """One completion of a call, exactly as the engine sampled it."""

    token_ids: list[int]  # (N,) sampled ids, the stop token included when one ended it
    logprobs: list[float]  # (N,) engine log-probs (rollout.Generation.logprobs)
    kept_sizes: list[int]  # (N,) top-k / top-p set sizes; empty: drawn from the whole vocabulary
    versions: list[int]  # (N,) weight version that sampled each token
    finish_reason: str  # "stop" | "length" (the engine's)
    tool_calls: int = 0  # tool calls returned to the client (chat)
    parse_error: str | None = None  # chat.make_action's parse error: the call went back as text
    message: dict | None = None  # chat: the assistant message returned (OpenAI's format)


@dataclass
class Call:
    """One request: its prompt ids and its n samples, with the earlier call of the session
    it continues."""

    endpoint: str  # "chat" | "completions" | "messages"
    prompt_ids: list[int]  # (P,) the ids the engine was given
    samples: list[Sample]  # (n,) its completions
    # the sample of parent_call that prompt_ids extend, None: not extended
    parent: int | None = None
    # chat: the request's messages (the conversation so far)
    messages: list = field(default_factory=list)
    # the index in its session of the call it continues, None: a root
    parent_call: int | None = None

    @classmethod
    def from_dict(cls, d: dict) -> "Call":
        """A Call from its JSON (GET /v1/sessions/ID), for a trainer reading a remote
        server's capture."""
        return cls(**{**d, "samples": [Sample(**s) for s in d["samples"]]})


def continued_sample(prev: Call, prompt: list[int]) -> int | None:
    """The index of the first sample s of `prev` such that prev.prompt_ids + s.token_ids is a prefix
    of `prompt` (the prefix invariant), or None."""
    P = len(prev.prompt_ids)
    if prompt[:P] != prev.prompt_ids:
        return None
    for i, s in enumerate(prev.samples):
        if prompt[P : P + len(s.token_ids)] == s.token_ids:
            return i
    return None


def link(calls: list[Call]) -> list[Call]:
    """Copies of a session's calls, each with the call it continues: the latest of the LINK_WINDOW
    before it."""
    out = []
    for j, call in enumerate(calls):
        parent_call = parent = None
        for i in range(j - 1, max(-1, j - 1 - LINK_WINDOW), -1):
            parent = continued_sample(calls[i], call.prompt_ids)
            if parent is not None:
                parent_call = i
                break
        out.append(replace(call, parent=parent, parent_call=parent_call))
    return out


@dataclass(eq=False)
class Slot:
    """A call's place in its session, reserved when the engine is given the call."""

    session: str | None
    entry: "_Entry | None"
    index: int


@dataclass(eq=False)
class _Entry:
    calls: list  # Call, or None while in flight (or when its client left)
    used: float  # the clock when a call was last reserved or recorded


class Capture:
    """Per-session records of every call, safe to use from any thread. ttl_s: a session not used for
    this long is forgotten; clock: seconds (time.monotonic; a test passes its own)."""

    def __init__(self, ttl_s: float = 3600.0, clock=time.monotonic):
        self.lock = threading.Lock()
        self.ttl_s, self.clock = ttl_s, clock
        self.sessions: dict[str, _Entry] = {}
        self.unsessioned_calls = 0  # calls that named no session (served, not recorded)
        # calls whose client left before their answer was complete (not recorded)
        self.disconnected = 0
        self.expired = 0  # sessions forgotten after ttl_s idle
        self.swept = clock()

    def reserve(self, session: str | None) -> Slot:
        """The next place in `session`, in serving order (call it in the order the calls reach
        the engine)."""
        with self.lock:
            now = self.clock()
            self._expire(now)
            if session is None:
                return Slot(None, None, 0)
            entry = self.sessions.setdefault(session, _Entry([], now))
            entry.calls.append(None)
            entry.used = now
            return Slot(session, entry, len(entry.calls) - 1)

    def record(self, slot: Slot, call: Call) -> Call:
        """Fill the slot with `call` (dropped if its session was popped or expired meanwhile)."""
        with self.lock:
            if slot.session is None:
                self.unsessioned_calls += 1
            elif self.sessions.get(slot.session) is slot.entry:
                slot.entry.calls[slot.index] = call
                slot.entry.used = self.clock()
            return call

    def abandon(self, slot: Slot, disconnected: bool = True):
        """The call is not kept: its client left (counted), or the engine failed. A place it filled
        already (a stream whose last event could not be written) is emptied again."""
        with self.lock:
            self.disconnected += disconnected
            if slot.session is not None and self.sessions.get(slot.session) is slot.entry:
                slot.entry.calls[slot.index] = None

    def _expire(self, now: float):
        if now - self.swept < min(self.ttl_s, 60.0) / 4:
            return
        self.swept = now
        old = [s for s, e in self.sessions.items() if now - e.used > self.ttl_s]
        for s in old:
            del self.sessions[s]
        self.expired += len(old)

    def calls(self, session: str) -> list[Call]:
        """The session's recorded calls in serving order, linked (Call.parent_call, Call.parent)."""
        with self.lock:
            entry = self.sessions.get(session)
            return link([c for c in entry.calls if c is not None]) if entry else []

    def pop(self, session: str) -> list[Call]:
        """A session's calls (as calls()), forgotten here (what a trainer does once it has
        taken them)."""
        with self.lock:
            entry = self.sessions.pop(session, None)
            return link([c for c in entry.calls if c is not None]) if entry else []


def session_trajectories(
    calls: list[Call], session: str = ""
) -> tuple[list[Trajectory], dict[str, float]]:
    """A session's calls (in serving order) -> (agent.Trajectory rows, metrics), as the module
    docstring says: one row per end of the tree and per sample of it, orphans dropped. messages: the
    end call's messages and its reply.
    Metrics: serve/turns (calls), serve/rows, serve/branched (1: more than one chain), serve/orphans
    (retried calls dropped), serve/unused_samples (samples of kept calls no row holds),
    serve/multi_sample_ends (ends with n > 1: which sample a client went on with is not known)."""
    if not calls:
        return [], {}
    calls = link(calls)
    task = Task(env="serve", id=session, prompt="", answer="")
    continued = {c.parent_call for c in calls if c.parent_call is not None}
    last_sent = {tuple(c.prompt_ids): j for j, c in enumerate(calls)}  # a prompt's latest call
    orphans = {
        j for j, c in enumerate(calls) if j not in continued and last_sent[tuple(c.prompt_ids)] > j
    }
    ends = [j for j in range(len(calls)) if j not in continued and j not in orphans]

    def add(traj: Trajectory, s: Sample):
        traj.turn_starts.append(len(traj.token_ids))
        traj.extend(
            s.token_ids,
            sampled=True,
            logprobs=s.logprobs,
            versions=s.versions,
            kept_sizes=s.kept_sizes,
        )
        traj.num_turns += 1
        traj.num_tool_calls += s.tool_calls
        traj.parse_failures += s.parse_error is not None
        traj.truncated_turns += s.finish_reason == "length"
        traj.finish_reason = "done" if s.finish_reason == "stop" else "max_tokens"

    rows, used = [], set()
    for end in ends:
        chain = [end]
        while calls[chain[-1]].parent_call is not None:
            chain.append(calls[chain[-1]].parent_call)
        chain.reverse()
        for s, last in enumerate(calls[end].samples):
            traj = Trajectory(
                task=task,
                group=0,
                sample=len(rows),
                token_ids=[],
                loss_mask=[],
                logprobs=[],
                prompt_len=len(calls[chain[0]].prompt_ids),
                messages=calls[end].messages + ([last.message] if last.message else []),
            )
            traj.extend(list(calls[chain[0]].prompt_ids))
            for prev, nxt in zip(chain, chain[1:]):
                add(traj, calls[prev].samples[calls[nxt].parent])
                used.add((prev, calls[nxt].parent))
                traj.extend(calls[nxt].prompt_ids[len(traj.token_ids) :])  # observations: mask 0
            add(traj, last)
            used.add((end, s))
            rows.append(traj)
    kept = sum(len(c.samples) for j, c in enumerate(calls) if j not in orphans)
    return rows, {
        "serve/branched": float(len(ends) > 1),
        "serve/turns": float(len(calls)),
        "serve/rows": float(len(rows)),
        "serve/orphans": float(len(orphans)),
        "serve/unused_samples": float(kept - len(used)),
        "serve/multi_sample_ends": float(sum(len(calls[j].samples) > 1 for j in ends)),
    }
