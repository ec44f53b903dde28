"""memory.py: what an agent keeps of an episode longer than its context window, the prompt of each
next turn under rollout.agent.memory (a wing of agent.py: agent.memory_policy reaches it by name;
docs/memory.md).

  full     (agent.py itself, the default) the whole episode is one growing token sequence; an
           episode that fills the window ends "context_full".
  window   each turn's prompt is the system prompt and the task, the last memory_turns turns, and
           the env's state line when it offers one (its step info["state_line"]:
           env.Env.state_line).
  summary  the episode grows as one sequence until the next turn, an observation as long as the last
           and a summary after them would not fit (or every summary_every turns); then the policy is
           asked, in its own chat format, to summarise its progress (SUMMARY_REQUEST), and the
           episode goes on from the system prompt, the task, that summary, the last memory_turns
           turns and the state line. The summary is sampled by the policy: it trains like any turn
           (rollout.agent.summary_gradient=false, an ablation's switch, records it as not sampled).

Segments. A rewritten context starts a new row (agent.Trajectory.new_segment): each row holds
exactly the prompt the engine was given and what it sampled (log-probs, versions, kept sizes),
nothing re-tokenized, and trains as a row of its episode (batch.to_batch), every row given its
episode's advantage (algos.py's segment credit says why that is an unbiased policy gradient;
tests/test_memory.py proves it on a toy MDP). A summary is one more turn of its episode, reward 0:
with algo.credit=turn its return is what the episode earned after it.

A compacted prompt is the first prompt's tokens up to the end of the task's turn (the system prompt
and the task, as the engine saw them), then chat.render_continuation of the messages it keeps (the
summary, as a user message; the recent turns' assistant and tool messages; the state line, as a user
message), ending in the generation prompt. If it does not fit, fewer recent turns are kept; if
nothing fits, the episode ends "context_full", as under full. Counted per episode (Trajectory
fields, memory_metrics): segments, compactions, dropped_tokens, summary_failures (a summary that
came back empty, which the prompt then leaves out, or was cut at summary_tokens, which it keeps).

Imports: algos.py (SEQUENCE_RATIO_KINDS), env.py, chat.py, agent.py, rollout.py (Generation,
SamplingParams: replayed demonstrations) (and the standard library).
"""

from dataclasses import replace

from algos import SEQUENCE_RATIO_KINDS
from agent import (
    MIN_ROOM,
    AgentConfig,
    Trajectory,
    cut_generation,
    init_episodes,
    play_episodes,
    state_key,
    step_envs,
)
from chat import encode, render, render_continuation, turn_ends
from env import Env, Task
from rollout import Generation, SamplingParams

MEMORIES = ("full", "window", "summary")
SUMMARY_REQUEST = (
    "Your context is full. "
    "Summarize what you have done and learned so far, and what is left to do, in a few lines. "
    "The episode then goes on from this summary and your last turns."
)
SUMMARY_HEAD = "Summary of your progress so far:\n"


def check_config(cfg) -> list:
    """config.WING_CHECKS' hook: the memory settings of rollout.agent -> its choice (the
    policy's name)."""
    agent = cfg.rollout.agent
    if agent.memory == "full" and (
        agent.memory_turns,
        agent.summary_every,
        agent.summary_tokens,
        agent.summary_gradient,
    ) != (4, 0, 128, True):
        raise ValueError(
            "rollout.agent.memory_turns, summary_every, summary_tokens and summary_gradient are "
            "settings of rollout.agent.memory=window or summary, not of full (docs/memory.md)"
        )
    if agent.memory_turns < 0 or agent.summary_every < 0 or agent.summary_tokens < 1:
        raise ValueError(
            "rollout.agent.memory_turns and summary_every must be >= 0, summary_tokens >= 1"
        )
    # a segmented episode is several rows: a sequence-level loss would average (seq-mean-*) and
    # take its importance ratio (gspo, gspo_token, gmpo) per row, as if each row were an episode
    sequence_level = cfg.learner.loss.agg_mode.startswith("seq-mean")
    if agent.memory != "full" and (
        sequence_level or cfg.learner.policy_loss in SEQUENCE_RATIO_KINDS
    ):
        raise ValueError(
            f"rollout.agent.memory={agent.memory} plays an episode as several rows (segments), and "
            f"learner.loss.agg_mode={cfg.learner.loss.agg_mode} with "
            f"learner.policy_loss={cfg.learner.policy_loss} would treat each row as a sequence of "
            "its own: use token-mean with a token-level loss (docs/memory.md)"
        )
    if agent.memory != "full" and cfg.rollout.external_agent:
        raise ValueError(
            "rollout.agent.memory shapes our agent loop's prompts; "
            "with rollout.external_agent your agent keeps its own context: leave memory=full"
        )
    return [("rollout.agent.memory", agent.memory, MEMORIES)]


class Memory:
    """agent.play_episodes' memory policy for cfg.memory (window or summary): next_prompts, before
    every turn, may start an episode's next turn on a new segment. One object per play_episodes
    call: it keeps, per episode, the first prompt's system-and-task tokens, the turns the current
    row's prompt carries, and the last summary."""

    def __init__(self, cfg: AgentConfig, tokenizer):
        if cfg.memory not in MEMORIES[1:]:
            raise ValueError(f"rollout.agent.memory={cfg.memory!r} is not one of {list(MEMORIES)}")
        self.cfg, self.tokenizer = cfg, tokenizer
        self.ends = [tokenizer.token_to_id(t) for t in turn_ends(cfg.chat_format)]
        self.request_len = len(self._encode([{"role": "user", "content": SUMMARY_REQUEST}]))
        # id(trajectory) -> system + task tokens, as first given
        self.prefix: dict[int, list[int]] = {}
        self.carried: dict[int, int] = {}  # ... -> env turns the current row's prompt carries
        self.since: dict[int, int] = {}  # ... -> num_turns at the last compaction
        # ... -> the last summary ("" before one, or after a failure)
        self.summary: dict[int, str] = {}

    def _encode(self, messages: list[dict]) -> list[int]:
        return encode(
            self.tokenizer,
            render_continuation(messages, self.cfg.chat_format, self.cfg.enable_thinking),
        )

    def next_prompts(self, engine, trajs: list[Trajectory], params, seed: int):
        """Before a turn: each episode whose context this policy rewrites starts a new segment
        (window: more than memory_turns turns in context; summary: a summary is due, sampled here in
        one engine call)."""
        for t in trajs:
            if id(t) not in self.prefix:  # its first turn: the first prompt is the whole context
                first = t.token_ids[: t.prompt_len]
                cut = max(
                    (k + 1 for k, x in enumerate(first) if x == self.ends[0]), default=len(first)
                )
                self.prefix[id(t)], self.carried[id(t)], self.since[id(t)], self.summary[id(t)] = (
                    first[:cut],
                    0,
                    0,
                    "",
                )
                t.segments = 1
        if self.cfg.memory == "window":
            for t in trajs:
                # more turns than it keeps, or an observation that overfilled the window
                overfull = len(t.token_ids) + MIN_ROOM > self.cfg.max_total_tokens
                if self.carried[id(t)] + len(t.turn_starts) > self.cfg.memory_turns or overfull:
                    self.compact(t)
            return
        due = [
            t
            for t in trajs
            if t.num_turns
            and (
                self.cfg.summary_every
                and t.num_turns - self.since[id(t)] >= self.cfg.summary_every
                or len(t.token_ids)
                + params.max_tokens
                + self._last_observation(t)
                + self.request_len
                + self.cfg.summary_tokens
                + MIN_ROOM
                > self.cfg.max_total_tokens
            )
        ]
        if due:
            self.summarize(engine, due, params, seed)

    def _last_observation(self, t: Trajectory) -> int:
        """The tokens of the observation that ends t's row: what the next one may cost again."""
        return len(self._encode(recent_turns(t.messages, 1)[1:]))

    def summarize(self, engine, trajs: list[Trajectory], params, seed: int):
        """Ask each episode's policy for a summary in one engine call: the observation that ends its
        row is rendered again with SUMMARY_REQUEST after it, the summary sampled (mask 1, a turn of
        reward 0), then the context compacted around it. No room left to ask: a failure, compacted
        on the last summary."""
        asked, prompts, budgets = [], [], []
        for t in trajs:
            obs = recent_turns(t.messages, 1)[1:]  # the last observation, which ends the row
            request = self._encode(obs + [{"role": "user", "content": SUMMARY_REQUEST}])
            room = (
                self.cfg.max_total_tokens
                - (len(t.token_ids) - self._last_observation(t) + len(request))
                - 1
            )
            if room < 1:
                t.summary_failures += 1
                self.compact(t)
                continue
            t.retract(self._last_observation(t))
            t.extend(request)
            asked.append(t)
            budgets.append(min(self.cfg.summary_tokens, room))
            prompts.append(list(t.token_ids))
        if not asked:
            return
        stop_ids = tuple(dict.fromkeys((*self.ends, *params.stop_token_ids)))
        call = replace(params, n=1, max_tokens=max(budgets), stop_token_ids=stop_ids, seed=seed)
        for t, prompt, budget, gen in zip(asked, prompts, budgets, engine.generate(prompts, call)):
            ids, lps, stopped = cut_generation(gen, budget, stop_ids)
            t.turn_starts.append(len(t.token_ids))
            t.turn_states.append(state_key(prompt))
            t.turn_rewards.append(0.0)
            # summary_gradient=False (the ablation): recorded as not sampled, mask 0, so no gradient
            # flows through the summary; its row then ends before the request (closed_row)
            if self.cfg.summary_gradient:
                t.extend(
                    ids,
                    sampled=True,
                    logprobs=lps,
                    versions=(gen.versions or [])[: len(ids)],
                    kept_sizes=gen.kept_sizes[: len(ids)],
                )
            else:
                t.extend(ids)
            if not stopped:  # cut at its budget: closed, as a turn is
                t.extend([self.ends[0]])
            text = self.tokenizer.decode(
                ids[:-1] if stopped else ids, skip_special_tokens=False
            ).strip()
            t.summary_failures += not stopped or not text
            self.summary[id(t)] = text
            self.compact(t)

    def compact(self, t: Trajectory):
        """Start t's next turn on a new segment: the system prompt and the task, the summary, the
        last memory_turns turns (fewer when they do not fit) and the state line; nothing fits: the
        episode ends context_full."""
        head = (
            [{"role": "user", "content": SUMMARY_HEAD + self.summary[id(t)]}]
            if self.summary[id(t)]
            else []
        )
        line = t.info.get("state_line")
        tail = [{"role": "user", "content": line}] if line else []
        for k in range(min(self.cfg.memory_turns, t.num_turns), -1, -1):
            prompt = self.prefix[id(t)] + self._encode(head + recent_turns(t.messages, k) + tail)
            if len(prompt) + MIN_ROOM <= self.cfg.max_total_tokens:
                t.dropped_tokens += max(0, len(t.token_ids) - len(prompt))
                t.new_segment(prompt)
                t.segments, t.compactions = t.segments + 1, t.compactions + 1
                self.carried[id(t)], self.since[id(t)] = k, t.num_turns
                return
        t.finish_reason, t.context_full = "context_full", True
        if not t.rows:
            # still its first row: it too ends at its last sampled token (the observation and the
            # generation prompt after it were never given to the engine)
            t.retract(len(t.token_ids) - len(t.closed_row().token_ids))
        t.end_segments()


def recent_turns(messages: list[dict], k: int) -> list[dict]:
    """The messages of the last k env turns of a conversation: each turn an assistant message and
    the observation messages after it (the reset messages before the first turn are not a turn)."""
    starts = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return list(messages[starts[-k] :]) if k and starts else []


# -----------------------------------------------------------------------------
# demonstrations as segments: what sft.py trains the embedded model on under a memory policy


def expert_summary(info: dict) -> str:
    """The expert's summary of an episode so far, from the env's last step info: its "summary" (an
    env whose expert writes one, envs/env_vault.py; a compacted prompt never shows it), else its
    state line (which the compacted prompt shows anyway), else empty."""
    return info.get("summary") or info.get("state_line") or ""


class _Replay:
    """An engine that answers each turn with the expert's next turn (log-prob 0), and a summary
    request with the expert's summary (expert_summary of the env's last info): a demonstration
    played through the agent loop, so that SFT sees each turn's prompt exactly as the memory policy
    builds it in RL."""

    def __init__(self, turns: list[list[int]], asks_summary, summary):
        self.turns, self.asks_summary, self.summary = iter(turns), asks_summary, summary

    def generate(self, prompts: list[list[int]], params) -> list[Generation]:
        out = [self.summary() if self.asks_summary(p) else next(self.turns) for p in prompts]
        return [Generation(ids, [0.0] * len(ids), "stop") for ids in out]


def demonstration_rows(
    env: Env, task: Task, messages: list[dict], tokenizer, cfg: AgentConfig, max_tokens: int
) -> list[tuple[list[int], list[int]]]:
    """The (token ids, loss mask) rows of one expert demonstration (env.demonstration's messages) as
    memory policy cfg.memory segments it, with rollout.max_tokens = max_tokens (when a summary is
    due depends on it): the expert's turns replayed through agent.play_episodes, the env stepping
    for real, so each row is exactly a prompt the policy will be given and the expert's answer to it
    (mask 1)."""
    tools, fmt = env.tools(), cfg.chat_format
    turns = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":  # the turn's text as render() writes it, up to its end token
            before = render(
                messages[:i],
                tools,
                add_generation_prompt=True,
                chat_format=fmt,
                enable_thinking=cfg.enable_thinking,
            )
            after = render(
                messages[: i + 1], tools, chat_format=fmt, enable_thinking=cfg.enable_thinking
            )
            turns.append(encode(tokenizer, after[len(before) :].rstrip("\n")))
    one = replace(cfg, n_samples=1, max_turns=len(turns))
    trajs, states = init_episodes({env.name: env}, [task], tokenizer, one, seed=0)
    memory = Memory(one, tokenizer)
    request = memory._encode([{"role": "user", "content": SUMMARY_REQUEST}])
    engine = _Replay(
        turns,
        lambda p: p[-len(request) :] == request,
        lambda: encode(tokenizer, expert_summary(trajs[0].info) + turn_ends(fmt)[0]),
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    play_episodes(
        engine,
        trajs,
        states,
        tokenizer,
        one,
        params,
        0,
        lambda calls: step_envs({env.name: env}, calls),
    )
    return [(r.token_ids, r.loss_mask) for r in trajs[0].rows or trajs]
