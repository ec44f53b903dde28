"""agent.py: the multi-turn agent loop and its token-exact trajectories.

An *episode* is a conversation between the policy and an environment (env.py):

    prompt = render(system + user)                          tokens, mask 0
    repeat up to max_turns:
        the engine samples an assistant message             tokens, mask 1, engine log-probs
        parse its <tool_call> blocks -> env.Action -> env.step(state, action)
        done? stop.  otherwise render the observation       tokens, mask 0
        (tool responses or a user message) + the next generation prompt

Token-in, token-out. The trajectory is the exact sequence of token ids the engine saw and produced,
built by *appending* ids; the conversation is never re-rendered and re-tokenized. Re-tokenizing
would not give back what was sampled: BPE merges across the boundary between prompt and completion
differ, a decoded completion may not re-encode to the same ids, and some chat templates (Qwen3)
render earlier turns differently once the conversation goes on. The learner must score the very
tokens the engine sampled, or the importance ratio is off from the first step. Only the observation
text is rendered (chat.render_continuation), and it is cut out of chat.render() itself so that the
two cannot diverge.

An engine is anything with `generate(prompts: list[list[int]], params) -> [Generation]` (rollout.py:
token ids in, token ids and log-probs out, n samples per prompt, prompt-major), so this file imports
no engine. A rollout source answers `play(tasks, params, seed, judge_weight, agent) ->
(trajectories, metrics)`: LocalRollouts here, cluster.RayRollouts on Ray workers. It returns one
Trajectory per episode, group-major; an episode that is not one token sequence (a client rewrote its
history; a memory policy, rollout.agent.memory, compacted its context) lists the rows it trains as
(Trajectory.rows), and batch.to_batch gives every row its episode.

Sections: the multi-turn loop | the in-process rollout source | metrics. Trajectories become tensors
in batch.py.
Imports: env.py, chat.py, algos.py (and torch, the standard library).
"""

import hashlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

import algos
from chat import (
    encode,
    make_action,
    parse_assistant_message,
    render,
    render_continuation,
    turn_ends,
)
from env import Action, Env, Task, mix_seed


# -----------------------------------------------------------------------------
# the multi-turn loop


@dataclass
class AgentConfig:
    n_samples: int = 8  # episodes per task (a GRPO group)
    max_turns: int = 4  # assistant turns per episode at most
    # the context window: the whole trajectory (prompt, every turn and observation) at most (the
    # third limit is rollout.max_tokens, tokens per turn)
    max_total_tokens: int = 512
    # sampled tokens per episode, all turns together, at most (0: no limit but the context window)
    max_episode_tokens: int = 0
    # "qwen2.5" (stable re-rendering) | "qwen3" | "llama3" (chat.CHAT_FORMATS)
    chat_format: str = "qwen2.5"
    # qwen3 only: False = empty think block in every generation prompt
    enable_thinking: bool | None = None
    # what the prompt of each next turn holds (wings/memory.py, docs/memory.md): full (the whole
    # episode, one token sequence) | window (the task and the last memory_turns turns) | summary
    # (the policy's own summary and the last turns)
    memory: str = "full"
    memory_turns: int = 4  # window, summary: the recent turns a compacted prompt keeps
    # summary: also compact every this many turns (0: only when the next turn and a summary
    # would not fit)
    summary_every: int = 0
    summary_tokens: int = 128  # summary: the summary's length at most, in tokens
    # summary: False records the summary's tokens as not sampled (mask 0): no gradient flows
    # through them. An ablation switch (docs/memory.md, the vault), not a setting to train with
    summary_gradient: bool = True


@dataclass
class Trajectory:
    """One episode. token_ids, loss_mask and logprobs all have length T (the whole trajectory)."""

    task: Task  # the task this episode solves
    group: int  # index of the task in the batch (GRPO group id)
    sample: int  # index of the episode within its group, 0..n_samples-1
    token_ids: list[int]  # (T,) every token the engine saw or produced, in order
    # (T,) 1 on tokens the policy sampled, 0 on prompt / observation / forced tokens
    loss_mask: list[int]
    logprobs: list[float]  # (T,) engine log-prob on sampled tokens, 0.0 elsewhere
    prompt_len: int  # tokens of the first prompt (system + user + generation prompt)
    # the conversation (reset messages, assistant turns, observations fed back)
    messages: list[dict]
    reward: float = 0.0  # sum of the env's step rewards (0 when the env gave none)
    # (K,) the env's reward for each assistant turn (its step), the judge's share added to the last;
    # they sum to `reward`
    turn_rewards: list[float] = field(default_factory=list)
    # (K,) position of each assistant turn's first token
    turn_starts: list[int] = field(default_factory=list)
    # (K,) key of the state each turn acted from (state_key)
    turn_states: list[int] = field(default_factory=list)
    # the env ended the episode (False if cut by max_turns, a limit, an env error)
    done: bool = False
    num_turns: int = 0  # assistant turns generated
    num_tool_calls: int = 0  # tool calls parsed from the assistant turns
    # assistant turns with a malformed tool call (summed from the env's info)
    parse_failures: int = 0
    tool_errors: int = 0  # tool calls that failed in the env (summed from the env's info)
    tool_timeouts: int = 0  # tool calls that timed out (summed from the env's info)
    # env.reset or env.step raised: that ends the episode, and train.py drops its group
    env_errors: int = 0
    empty_responses: int = 0  # assistant turns whose content is blank
    # "done" | "max_turns" | "episode_tokens" (max_episode_tokens sampled) | "context_full" (no room
    # for the next turn in max_total_tokens) | "env_error"
    finish_reason: str = ""
    # assistant turns cut by rollout.max_tokens (the per-turn limit) before a stop
    truncated_turns: int = 0
    # a turn was cut, or the episode ended, at agent.max_episode_tokens
    truncated_episode: bool = False
    # a turn was cut, an observation left out or the first prompt too long: the context window
    # (agent.max_total_tokens) was full
    context_full: bool = False
    # the last env info (or {"error": ...} after an env error)
    info: dict = field(default_factory=dict)
    # (T,) weight version (updates seen) of the weights that sampled each token, -1 on tokens not
    # sampled, and -1 where the engine does not report one (train.py then stamps the batch's)
    versions: list[int] = field(default_factory=list)
    # (T,) per sampled token, the size of the top-k / top-p set the engine drew it from
    # (Generation.kept_sizes; -1: not reported), 0 on tokens drawn from the whole vocabulary and
    # elsewhere (empty: all 0)
    kept_sizes: list[int] = field(default_factory=list)
    # the rows the episode trains as when it is not one token sequence (its context was rewritten
    # between turns: a client that edited its history, wings/external_agent.py; a memory policy's
    # segments, wings/memory.py), in turn order, each holding its own turns' tokens; the episode's
    # own token_ids are then its last row's. Empty: its one row
    rows: list["Trajectory"] = field(default_factory=list)
    sampled_tokens: int = 0  # tokens the policy sampled in this episode, every row counted
    # memory policies only (rollout.agent.memory): the rows the episode played as; 0: the whole
    # episode was one growing sequence (memory=full)
    segments: int = 0
    compactions: int = 0  # times a memory policy rewrote the context (a new segment)
    # prompt tokens the compactions left out (the context's length less the new prompt's, summed)
    dropped_tokens: int = 0
    summary_failures: int = 0  # summaries that came back empty or were cut at summary_tokens

    def extend(
        self, ids: list[int], sampled: bool = False, logprobs=None, versions=None, kept_sizes=None
    ):
        """Append a span of tokens: the one place a trajectory grows, so its per-token lists stay
        aligned. Sampled (mask 1) with the engine's log-probs, and its versions and kept-set sizes
        when it reports them; or not sampled (mask 0: an observation, a forced <|im_end|>), log-prob
        0, version -1, size 0."""
        n = len(ids)
        self.token_ids += ids
        self.sampled_tokens += n if sampled else 0
        self.loss_mask += [int(sampled)] * n
        self.logprobs += [float(x) for x in logprobs] if logprobs is not None else [0.0] * n
        self.versions += list(versions) if versions else [-1] * n
        self.kept_sizes += list(kept_sizes) if kept_sizes else [0] * n

    def new_segment(self, prompt: list[int]):
        """Start a new row (a segment: wings/memory.py) whose context is `prompt`: the row so far,
        up to its last sampled token (what came after it no sampled token ever saw), becomes one of
        `rows`, and the next turns extend the new one. end_segments adds the last row when the
        episode ends."""
        self.rows.append(self.closed_row())
        self.token_ids = []
        self.loss_mask = []
        self.logprobs = []
        self.versions = []
        self.kept_sizes = []
        self.turn_starts = []
        self.prompt_len = len(prompt)
        self.extend(list(prompt))

    def closed_row(self) -> "Trajectory":
        """This row as it is trained: its tokens up to its last sampled one (the prompt it was given
        and what it sampled), a row of its own (no rows, the episode's fields left to the
        episode)."""
        end = max((k + 1 for k, m in enumerate(self.loss_mask) if m), default=0)
        return replace(
            self,
            token_ids=self.token_ids[:end],
            loss_mask=self.loss_mask[:end],
            logprobs=self.logprobs[:end],
            versions=self.versions[:end],
            kept_sizes=self.kept_sizes[:end],
            turn_starts=list(self.turn_starts),
            rows=[],
            messages=[],
        )

    def retract(self, n: int):
        """Drop the last n tokens, context the engine was never given (a memory policy rewriting the
        observation that ends the row: wings/memory.py); a sampled token is never dropped."""
        if n and any(self.loss_mask[-n:]):
            raise ValueError("retract drops context only, never a sampled token")
        keep = len(self.token_ids) - n
        for name in ("token_ids", "loss_mask", "logprobs", "versions", "kept_sizes"):
            setattr(self, name, getattr(self, name)[:keep])

    def end_segments(self):
        """An episode that played as segments lists its last one too (a row with nothing sampled is
        left out)."""
        if self.rows:
            self.rows = [r for r in self.rows + [self.closed_row()] if r.token_ids]

    @property
    def length_cut(self) -> bool:
        """A length limit cut this episode (a turn, the episode's sampled tokens or the context
        window): what algo.truncation treats. max_turns is not one: it is the env's horizon, not a
        cut answer."""
        return bool(self.truncated_turns or self.truncated_episode or self.context_full)


class StepResult(NamedTuple):
    """What env.step returned for one episode, or the error it raised (then the other fields are
    empty)."""

    state: object  # the env's new state (EnvState or a subclass)
    obs: list  # observation messages
    reward: float  # this step's reward
    done: bool  # the env ended the episode
    info: dict  # the env's info
    error: str | None = None  # "ExceptionName: message" when env.step raised


def step_envs(envs: dict[str, Env], calls: list[tuple[str, object, Action]]) -> list[StepResult]:
    """The default `step_many` of play_episodes: env.step of every (env name, state, action) call,
    in order, in this process. An exception becomes that call's error (a broken env ends its
    episode, not the batch), so a caller elsewhere (an EnvWorker in another process) returns the
    same thing."""
    results = []
    for name, state, action in calls:
        try:
            results.append(StepResult(*envs[name].step(state, action)))
        except Exception as e:
            results.append(StepResult(None, [], 0.0, False, {}, f"{type(e).__name__}: {e}"))
    return results


def run_episodes(
    engine,
    envs: dict[str, Env],
    tasks: list[Task],
    tokenizer,
    cfg: AgentConfig,
    params,
    seed: int,
    judge_weight: float = 0.0,
    step_many=None,
    judge=None,
) -> list[Trajectory]:
    """Play cfg.n_samples episodes of every task, token-in token-out. Returns them group-major
    (all samples of tasks[0], then tasks[1], ...), group = task index, sample = 0..n_samples-1.

    Three pieces, which a pipeline can also run apart (cluster.py's async_pipeline, each on its own
    Ray actors): init_episodes (env.reset, the first prompt rendered and encoded), play_episodes
    (the generation / tool loop), finish_episodes (the judge). `step_many(calls) -> [StepResult]`
    runs a turn's env steps; the default is step_envs over `envs` in this process (cluster.EnvPool
    spreads them over Ray EnvWorkers).

    judge_weight > 0 (training only; evaluate() never passes it): a finished episode's reward gets
    judge_weight * its judge's score added: `judge`'s (an LLM judge, judge.py), else the env's own
    (see Env.judge).
    """
    trajs, states = init_episodes(envs, tasks, tokenizer, cfg, seed)
    play_episodes(
        engine,
        trajs,
        states,
        tokenizer,
        cfg,
        params,
        seed,
        step_many or (lambda calls: step_envs(envs, calls)),
    )
    return finish_episodes(envs, trajs, judge_weight, judge)


def init_episodes(
    envs: dict[str, Env], tasks: list[Task], tokenizer, cfg: AgentConfig, seed: int
) -> tuple[list[Trajectory], list]:
    """env.reset of cfg.n_samples episodes per task and their first prompt, rendered and encoded ->
    (trajectories holding only that prompt, group-major; the env states). An episode whose prompt
    leaves no room for a turn already has finish_reason "context_full". A reset that raises gives an
    empty episode that ended with "env_error" (its error in info), as a step that raises does: the
    batch goes on."""
    trajs = []
    states = []
    for g, task in enumerate(tasks):
        env = envs[task.env]
        for s in range(cfg.n_samples):
            try:
                state, msgs = env.reset(task, seed=mix_seed(seed, g, s))
            except Exception as e:
                trajs.append(
                    Trajectory(
                        task=task,
                        group=g,
                        sample=s,
                        token_ids=[],
                        loss_mask=[],
                        logprobs=[],
                        prompt_len=0,
                        messages=[],
                        env_errors=1,
                        finish_reason="env_error",
                        info={"error": f"{type(e).__name__}: {e}"},
                    )
                )
                states.append(None)
                continue
            text = render(
                msgs,
                env.tools(),
                add_generation_prompt=True,
                chat_format=cfg.chat_format,
                enable_thinking=cfg.enable_thinking,
            )
            ids = encode(tokenizer, text)
            traj = Trajectory(
                task=task,
                group=g,
                sample=s,
                token_ids=[],
                loss_mask=[],
                logprobs=[],
                prompt_len=len(ids),
                messages=list(msgs),
            )
            traj.extend(ids)
            if len(ids) + MIN_ROOM > cfg.max_total_tokens:
                traj.finish_reason, traj.context_full = "context_full", True
            trajs.append(traj)
            states.append(state)
    return trajs, states


def state_key(state) -> int:
    """A stable 56-bit key of the state a turn acts from, for GiGPO's state baseline
    (algo.turn_baseline=state): turns whose keys are equal are taken to start from the same
    environment state. `state` is what the env put in its step info as "state_key" (text: envs whose
    observations do not identify the state, alfworld_lite), else the token ids of the observation
    the turn follows (the first prompt for turn 0), as GiGPO matches identical observations.
    blake2b, not hash(): the same key in every process (Ray workers play parts of one group)."""
    data = (
        state.encode()
        if isinstance(state, str)
        else b"".join(int(t).to_bytes(4, "little") for t in state)
    )
    return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little")


# the smallest budget worth another turn: one sampled token, plus the slot of a forced <|im_end|>
MIN_ROOM = 2
# mix_seed(seed, turn, _MEMORY_SEED): a memory policy's own draws (summaries)
_MEMORY_SEED = 1 << 20


def memory_policy(cfg: AgentConfig, tokenizer):
    """The memory policy of cfg.memory, or None for "full" (the episode is one growing token
    sequence). The others are a wing, wings/memory.py, imported by name (as chat.py imports a wing
    format): an object whose next_prompts(engine, trajectories, params, seed) may start each
    episode's next turn on a new segment."""
    if cfg.memory == "full":
        return None
    return importlib.import_module("wings.memory").Memory(cfg, tokenizer)


def turn_room(traj: Trajectory, cfg: AgentConfig, max_tokens: int) -> dict[str, int]:
    """The three length limits, as the tokens each leaves the next turn to sample: "turn"
    (rollout.max_tokens), "episode" (agent.max_episode_tokens less the tokens already sampled;
    absent at 0) and "context" (agent.max_total_tokens less the trajectory so far, one slot kept for
    a forced <|im_end|>). The turn's budget is the smallest; a turn cut at it is counted against the
    first limit, in this order, that equals it."""
    room = {"turn": max_tokens}
    if cfg.max_episode_tokens:
        room["episode"] = cfg.max_episode_tokens - traj.sampled_tokens
    room["context"] = cfg.max_total_tokens - len(traj.token_ids) - 1
    return room


def play_episodes(
    engine,
    trajs: list[Trajectory],
    states: list,
    tokenizer,
    cfg: AgentConfig,
    params,
    seed: int,
    step_many,
) -> list[Trajectory]:
    """The multi-turn loop over init_episodes' output, extending the trajectories in place (also
    returned).

    Each turn is one batched engine.generate call over all episodes still running, then one
    step_many call with their env steps. Every episode keeps its own token budget: the call asks for
    the largest budget of the batch, and each generation is cut to its own episode's budget
    afterwards (its kept tokens are a valid sample: sampling is causal). One token of each budget is
    kept free for a forced <|im_end|>, so no trajectory exceeds cfg.max_total_tokens (unless its
    prompt alone does: that episode then ends with no turn). A turn's budget is the tightest of the
    three length limits (turn_room); a turn cut at it is counted by the limit that cut it
    (Trajectory.truncated_turns, truncated_episode, context_full).
    """
    # the ids that end a turn: <|im_end|> (llama3: eot, eom)
    ends = [tokenizer.token_to_id(t) for t in turn_ends(cfg.chat_format)]
    if None in ends:
        raise ValueError(
            f"tokenizer has no {turn_ends(cfg.chat_format)} tokens (chat_format {cfg.chat_format})"
        )
    stop_ids = tuple(dict.fromkeys((*ends, *params.stop_token_ids)))

    active = [i for i, t in enumerate(trajs) if not t.finish_reason]
    # the key of the state each episode's next turn acts from (state_key): for turn 0, its prompt's
    state_keys = {i: state_key(trajs[i].token_ids) for i in active}
    # None: each turn's prompt is the whole episode so far (memory=full)
    memory = memory_policy(cfg, tokenizer)
    turn = 0
    while active:
        if memory is not None:  # the prompt of this turn, when a memory policy rewrites the context
            memory.next_prompts(
                engine, [trajs[i] for i in active], params, mix_seed(seed, turn, _MEMORY_SEED)
            )
            # an episode with no room left, even compacted, has ended
            active = [i for i in active if not trajs[i].finish_reason]
            if not active:
                break
        rooms = [turn_room(trajs[i], cfg, params.max_tokens) for i in active]
        budgets = [min(room.values()) for room in rooms]
        call = replace(
            params,
            n=1,
            max_tokens=max(budgets),
            stop_token_ids=stop_ids,
            # reproducible runs: the engine's RNG comes from (seed, turn)
            seed=mix_seed(seed, turn),
        )
        # copies: we extend ours in place
        gens = engine.generate([list(trajs[i].token_ids) for i in active], call)
        if len(gens) != len(active):
            raise RuntimeError(f"engine returned {len(gens)} generations for {len(active)} prompts")
        actions = []
        for i, room, gen in zip(active, rooms, gens):
            trajs[i].turn_states.append(state_keys[i])
            actions.append(
                _add_turn(trajs[i], gen, room, stop_ids, ends, tokenizer, cfg.chat_format)
            )
        results = step_many([(trajs[i].task.env, states[i], a) for i, a in zip(active, actions)])
        still_active = []
        for i, result in zip(active, results):
            cont = _add_step(trajs[i], result, tokenizer, cfg)
            if result.error is None:
                states[i] = result.state
            if cont is not None:  # the episode goes on
                state_keys[i] = state_key(result.info.get("state_key", cont))
                still_active.append(i)
            else:
                trajs[i].end_segments()
        active = still_active
        turn += 1
    return trajs


def cut_generation(gen, budget: int, stop_ids: tuple) -> tuple[list[int], list[float], bool]:
    """A generation's tokens and log-probs up to `budget` and its first stop token (an engine may
    run past it) -> (ids, log-probs, whether it stopped on a stop token)."""
    ids, lps = list(gen.token_ids[:budget]), list(gen.logprobs[:budget])
    for k, t in enumerate(ids):
        if t in stop_ids:
            ids, lps = ids[: k + 1], lps[: k + 1]
            break
    return ids, lps, bool(ids) and ids[-1] in stop_ids


def _add_turn(
    traj: Trajectory,
    gen,
    room: dict[str, int],
    stop_ids: tuple,
    ends: list[int],
    tokenizer,
    chat_format: str,
) -> Action:
    """One generation appended to its episode (cut to the episode's budget, the least of `room`, and
    at its first stop token; closed with a forced <|im_end|> when it was cut, and the cut counted by
    the limit that made it) -> the Action parsed from its text."""
    budget = min(room.values())
    ids, lps, stopped = cut_generation(gen, budget, stop_ids)
    content_ids = ids[:-1] if stopped else ids
    # cut: counted by the first limit equal to the budget (by "turn" when the engine stopped short
    # of the budget on its own)
    if not stopped:
        limit = next(k for k, v in room.items() if v == budget) if len(ids) >= budget else "turn"
        if limit == "turn":
            traj.truncated_turns += 1
        elif limit == "episode":
            traj.truncated_episode = True
        else:
            traj.context_full = True
    traj.turn_starts.append(len(traj.token_ids))
    traj.extend(
        ids,
        sampled=True,
        logprobs=lps,
        versions=(gen.versions or [])[: len(ids)],
        kept_sizes=gen.kept_sizes[: len(ids)],  # empty: not truncated
    )
    if not ids or ids[-1] not in ends:
        # cut by max_tokens (or stopped by another stop token): close the turn so the conversation
        # stays well formed. Forced, not sampled: mask 0, so the policy is not trained on it.
        traj.extend([ends[0]])
    text = tokenizer.decode(content_ids, skip_special_tokens=False)
    action = make_action(text, chat_format)
    traj.num_turns += 1
    traj.num_tool_calls += len(action.tool_calls)
    traj.empty_responses += not text.strip()
    traj.messages.append(parse_assistant_message(text, chat_format))
    return action


def _add_step(
    traj: Trajectory, result: "StepResult", tokenizer, cfg: AgentConfig
) -> list[int] | None:
    """The env's step appended to its episode: reward, counters, and the observation's tokens when
    the episode goes on -> those tokens, or None when it ends here (done, an env error, max_turns,
    no room left: the episode's sampled tokens at max_episode_tokens, or, under memory=full, the
    observation and one more token past the context window; an observation that does not fit is
    left out whole, never cut; a memory policy compacts the context before the next turn
    instead)."""
    state, obs, reward, done, info, error = result
    if error is not None:  # a broken env ends this episode, not the whole batch
        traj.env_errors += 1
        traj.reward = 0.0
        traj.done = False
        traj.finish_reason = "env_error"
        traj.turn_rewards = [0.0] * (len(traj.turn_rewards) + 1)  # every sampled turn, this one too
        traj.info = {"error": error}
        return None
    traj.reward += float(reward)
    traj.turn_rewards.append(float(reward))
    traj.info = dict(info)
    # the env reports what this step added to its counters (Env.step); the trajectory sums them
    traj.parse_failures += int(info.get("parse_failures", 0))
    traj.tool_errors += int(info.get("tool_errors", 0))
    traj.tool_timeouts += int(info.get("tool_timeouts", 0))
    if done:
        traj.done, traj.finish_reason = True, "done"
        return None
    if traj.num_turns >= cfg.max_turns:
        traj.finish_reason = "max_turns"
        return None
    if cfg.max_episode_tokens and traj.sampled_tokens >= cfg.max_episode_tokens:
        traj.finish_reason, traj.truncated_episode = "episode_tokens", True
        return None
    # only the new observation and the next generation prompt are rendered and appended
    cont = encode(tokenizer, render_continuation(obs, cfg.chat_format, cfg.enable_thinking))
    if cfg.memory == "full" and len(traj.token_ids) + len(cont) + MIN_ROOM > cfg.max_total_tokens:
        # no room to answer it: leave it out
        traj.finish_reason, traj.context_full = "context_full", True
        return None
    traj.extend(cont)
    traj.messages += list(obs)
    return cont


class Judgment(NamedTuple):
    """A judge's verdict on one finished episode."""

    # in [0, 1], added to the reward times judge_weight (None: no verdict, as from an env without
    # a judge, and nothing added)
    score: float | None
    failed: bool = False  # the judge's reply could not be read: score is the judge's failure value


# (tasks, conversations) -> one verdict each
Judge = Callable[[list[Task], list[list[dict]]], list[Judgment]]


def env_judges(
    envs: dict[str, Env], tasks: list[Task], conversations: list[list[dict]]
) -> list[Judgment]:
    """The default judge: each episode's env's own (Env.judge, a rule; None for an env without
    one)."""
    return [Judgment(envs[t.env].judge(t, m)) for t, m in zip(tasks, conversations)]


def finish_episodes(
    envs: dict[str, Env], trajs: list[Trajectory], judge_weight: float, judge: Judge | None = None
) -> list[Trajectory]:
    """The end of every episode the env finished: when judge_weight > 0, judge_weight * its judge's
    score added to its reward and to its last turn's (the score kept in info["judge"], and
    info["judge_failed"]). `judge` gets every finished episode of the batch in one call (an LLM
    judge batches them: judge.LLMJudge); None: the envs' own (env_judges). In place; returned."""
    if judge_weight:
        done = [t for t in trajs if t.finish_reason == "done"]
        tasks, conversations = [t.task for t in done], [t.messages for t in done]
        verdicts = (
            judge(tasks, conversations)
            if judge is not None
            else env_judges(envs, tasks, conversations)
        )
        for traj, verdict in zip(done, verdicts, strict=True):
            if verdict.score is not None:
                traj.info["judge"], traj.info["judge_failed"] = float(verdict.score), verdict.failed
                traj.reward += judge_weight * float(verdict.score)
                traj.turn_rewards[-1] += judge_weight * float(verdict.score)
    return trajs


# -----------------------------------------------------------------------------
# the in-process rollout source


class LocalRollouts:
    """The agent loop in this process around one engine: what train.py and eval.py play episodes
    through when no Ray workers do (cluster.RayRollouts answers the same calls, so the training loop
    never asks which it has)."""

    def __init__(
        self,
        engine,
        envs: dict[str, Env],
        tokenizer,
        agent: AgentConfig,
        judge: Judge | None = None,
    ):
        self.engine = engine
        self.envs = envs
        self.tokenizer = tokenizer
        self.agent = agent  # the AgentConfig that play uses unless given another
        self.judge = judge  # finish_episodes' judge (None: the envs' own): an LLM judge, judge.py

    def play(
        self,
        tasks: list[Task],
        params,
        seed: int,
        judge_weight: float = 0.0,
        agent: AgentConfig | None = None,
    ) -> tuple[list[Trajectory], dict[str, float]]:
        """run_episodes on every task -> (trajectories group-major, the engine's prefill metrics).
        `agent` overrides the AgentConfig (eval: n_samples=1)."""
        before = prefill_counts(self.engine)
        trajs = run_episodes(
            self.engine,
            self.envs,
            tasks,
            self.tokenizer,
            agent or self.agent,
            params,
            seed,
            judge_weight=judge_weight,
            judge=self.judge,
        )
        return trajs, prefill_metrics(before, prefill_counts(self.engine), len(trajs))

    def generate(self, prompts: list[list[int]], params) -> list:
        """The engine's generate (the weight-sync gate's probe)."""
        return self.engine.generate(prompts, params)

    def update_weights(self, state_dict: dict, version: int | None = None) -> dict[str, float]:
        """The engine's update_weights (with the weights' `version` for an engine that tags tokens
        with it, the torch engine's partial rollouts) -> no metrics (a Ray push reports its
        seconds)."""
        if version is None:
            self.engine.update_weights(state_dict)
        else:
            self.engine.update_weights(state_dict, version=version)
        return {}

    def sleep(self):
        self.engine.sleep()

    def wake_up(self):
        self.engine.wake_up()

    def shutdown(self):
        """The engine is closed if it can be (vLLM's frees its process group now)."""
        getattr(self.engine, "close", lambda: None)()


# -----------------------------------------------------------------------------
# metrics (trajectories as tensors: batch.py)


def rollout_metrics(trajs: list[Trajectory], group_size: int) -> dict[str, float]:
    """The "rollout/..." metrics of a batch (README.md's metrics table says what each is): means
    over episodes, the share of groups of `group_size` with mixed rewards, the judge's figures when
    a judge scored any, the memory policy's when one played (memory_metrics), and
    "rollout/<env>/reward" per env when the batch mixes envs."""
    if not trajs:
        return {}
    n = len(trajs)

    def mean(xs) -> float:
        return float(sum(xs)) / len(xs)

    out = {
        "rollout/reward": mean([t.reward for t in trajs]),
        "rollout/num_turns": mean([t.num_turns for t in trajs]),
        "rollout/tool_calls": mean([t.num_tool_calls for t in trajs]),
        "rollout/response_tokens": mean(
            [sum(sum(r.loss_mask) for r in t.rows or [t]) for t in trajs]
        ),
        "rollout/total_tokens": mean([sum(len(r.token_ids) for r in t.rows or [t]) for t in trajs]),
        "rollout/parse_failures": mean([t.parse_failures for t in trajs]),
        "rollout/tool_errors": mean([t.tool_errors for t in trajs]),
        "rollout/tool_timeouts": mean([t.tool_timeouts for t in trajs]),
        "rollout/env_errors": mean([t.env_errors for t in trajs]),
        "rollout/empty_responses": mean([t.empty_responses for t in trajs]),
        "rollout/truncated": sum(
            t.finish_reason in ("max_turns", "episode_tokens", "context_full") for t in trajs
        )
        / n,
        "rollout/truncated_turn": sum(t.truncated_turns for t in trajs)
        / max(1, sum(t.num_turns for t in trajs)),
        "rollout/truncated_episode": mean([t.truncated_episode for t in trajs]),
        "rollout/context_full": mean([t.context_full for t in trajs]),
    }
    out["rollout/frac_groups_mixed"] = mean(mixed_groups(trajs, group_size))
    out.update({f"rollout/{k}": v for k, v in memory_metrics(trajs).items()})
    # finish_episodes' verdicts (training only)
    judged = [t.info for t in trajs if "judge" in t.info]
    if judged:
        out["rollout/judge_score"] = mean([i["judge"] for i in judged])
        out["rollout/judge_failures"] = mean([bool(i.get("judge_failed")) for i in judged])
    by_env: dict[str, list[float]] = {}
    for t in trajs:
        by_env.setdefault(t.task.env, []).append(t.reward)
    if len(by_env) > 1:
        for name, rewards in sorted(by_env.items()):
            out[f"rollout/{name}/reward"] = mean(rewards)
    return out


def memory_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """Per episode, when a memory policy played them (Trajectory.segments > 0; none under
    memory=full): segments (rows), compactions, dropped_tokens (prompt tokens left out) and
    summary_failures."""
    if not any(t.segments for t in trajs):
        return {}
    return {
        k: sum(getattr(t, k) for t in trajs) / len(trajs)
        for k in ("segments", "compactions", "dropped_tokens", "summary_failures")
    }


def prefill_counts(engine) -> tuple[int, int]:
    """(prompt tokens the engine has prefilled, prompt tokens it was given) so far, for an engine
    that counts them (rollout.TorchEngine); (0, 0) for one that does not."""
    return getattr(engine, "prefilled_tokens", 0), getattr(engine, "prompt_tokens", 0)


def prefill_metrics(
    before: tuple[int, int], after: tuple[int, int], episodes: int
) -> dict[str, float]:
    """rollout/prefilled_tokens (prompt tokens prefilled per episode, every turn counted) and
    rollout/prefix_cached (the fraction of prompt tokens found in the engine's prefix cache instead)
    between two prefill_counts."""
    prefilled, given = after[0] - before[0], after[1] - before[1]
    if not given or not episodes:
        return {}
    return {
        "rollout/prefilled_tokens": prefilled / episodes,
        "rollout/prefix_cached": 1.0 - prefilled / given,
    }


def mixed_groups(trajs: list[Trajectory], group_size: int) -> list[bool]:
    """Per group of `group_size` consecutive trajectories (group-major, as every rollout source
    returns them), whether its rewards are not all equal: only such a group carries a
    group-advantage signal. The one test of it is algos.dynamic_sampling_mask; DAPO's refill, the
    skip of uniform batches and this metric all use it."""
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float64)  # (B,)
    return algos.dynamic_sampling_mask(rewards, group_size)[::group_size].tolist()  # (B/G,)
