"""Memory policies (wings/memory.py, rollout.agent.memory): segments are exactly what the engine was
given and sampled; window with K at least the episode trains exactly what full trains; summaries are
sampled turns, counted when they fail; and the credit rule (algos.segment_advantages,
algos.turn_advantages across segments) is an unbiased policy gradient, proved by exact enumeration
on a toy MDP with a compaction step, where a summary that does not matter to the reward gets an
expected gradient of exactly 0, and scoring the post-compaction turn on the whole history instead is
measurably biased.
"""

import itertools
import re
from dataclasses import dataclass, replace

import pytest
import torch

import algos
from agent import AgentConfig, rollout_metrics, run_episodes
from batch import to_batch
from chat import encode, render_continuation
from config import load_config
from env import Task
from eval import eval_metrics
from rollout import Generation, SamplingParams
from test_agent import fake_logprob, tok  # noqa: F401  (tok: the module's tokenizer fixture)
from test_train import tiny  # noqa: F401  (the tiny run config of the end-to-end tests)
from wings.memory import SUMMARY_HEAD, SUMMARY_REQUEST, Memory, demonstration_rows, recent_turns

f64 = torch.float64
IM_END = "<|im_end|>"


# -----------------------------------------------------------------------------
# a walk: call step(n) with the next number until the goal; each observation says where the walker
# is


@dataclass(frozen=True)
class WalkState:
    task: object
    at: int = 0


class WalkEnv:
    """Reach task.answer by calling step(n) with n = where you are + 1; a wrong step ends the
    episode (reward 0). Every observation is long (PAD words), so a full episode outgrows a small
    window. state_line: where you are."""

    name = "walk"
    PAD = " ".join(["road"] * 12)
    TOOLS = [
        {
            "type": "function",
            "function": {
                "name": "step",
                "description": "Take a step.",
                "parameters": {
                    "type": "object",
                    "properties": {"n": {"type": "integer"}},
                    "required": ["n"],
                },
            },
        }
    ]

    def __init__(self, state_line: bool = True):
        self.with_state_line = state_line

    def tools(self):
        return self.TOOLS

    def reset(self, task, seed):
        return WalkState(task), [
            {"role": "system", "content": "Walk."},
            {"role": "user", "content": task.prompt},
        ]

    def step(self, state, action):
        call = action.tool_calls[0] if action.tool_calls else None
        if call is None or call.arguments.get("n") != state.at + 1:
            return state, [], 0.0, True, {}
        state = replace(state, at=state.at + 1)
        done = state.at == int(state.task.answer)
        info = {"state_line": f"You have walked {state.at} steps."} if self.with_state_line else {}
        return (
            state,
            (
                []
                if done
                else [{"role": "tool", "name": "step", "content": f"At {state.at}. {self.PAD}"}]
            ),
            float(done),
            done,
            info,
        )

    def demonstration(self, task, rng=None, use_tools=True):
        messages = [
            {"role": "system", "content": "Walk."},
            {"role": "user", "content": task.prompt},
        ]
        for k in range(1, int(task.answer) + 1):
            messages.append(
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"type": "function", "function": {"name": "step", "arguments": {"n": k}}}
                    ],
                }
            )
            if k < int(task.answer):
                messages.append({"role": "tool", "name": "step", "content": f"At {k}. {self.PAD}"})
        return messages


def walk_task(n: int) -> Task:
    return Task(env="walk", id=f"walk-{n}", prompt=f"Walk to {n}.", answer=str(n))


def step_text(n: int) -> str:
    return '<tool_call>\n{"name": "step", "arguments": {"n": %d}}\n</tool_call>' % n


class WalkEngine:
    """Reads where the walker is from the prompt (the last "At k.", or the last summary "I am at
    k.") and steps on; a summary request is answered with `summary(k)` (None: "I am at k."). Records
    every prompt and reply."""

    def __init__(self, tok, summary=None):
        self.tok, self.summary, self.calls, self.replies = tok, summary, [], {}

    def generate(self, prompts, params):
        self.calls.append(([list(p) for p in prompts], params))
        im_end, out = self.tok.token_to_id(IM_END), []
        for p in prompts:
            text = self.tok.decode(p, skip_special_tokens=False)
            at = max([0] + [int(k) for k in re.findall(r"(?:At|I am at) (\d+)\.", text)])
            if SUMMARY_REQUEST in text.rsplit("<|im_start|>user", 1)[-1]:
                reply = self.summary(at) if self.summary else f"I am at {at}."
            else:
                reply = step_text(at + 1)
            ids = encode(self.tok, reply + IM_END)[: params.max_tokens]
            self.replies[tuple(p)] = ids
            out.append(
                Generation(
                    ids,
                    [fake_logprob(t) for t in ids],
                    "stop" if ids[-1:] == [im_end] else "length",
                )
            )
        return out


def play(
    tok, memory="full", turns=4, n=6, max_total=4096, summary=None, state_line=True, G=2, **kw
):
    cfg = AgentConfig(
        n_samples=G,
        max_turns=n + 2,
        max_total_tokens=max_total,
        memory=memory,
        memory_turns=turns,
        **kw,
    )
    engine = WalkEngine(tok, summary)
    trajs = run_episodes(
        engine,
        {"walk": WalkEnv(state_line)},
        [walk_task(n)],
        tok,
        cfg,
        SamplingParams(max_tokens=40),
        seed=0,
    )
    return trajs, engine, cfg


# -----------------------------------------------------------------------------
# window


def test_window_segments_are_exactly_what_the_engine_was_given_and_sampled(tok):
    trajs, engine, cfg = play(tok, memory="window", turns=2, n=7)
    given = {tuple(p) for prompts, _ in engine.calls for p in prompts}
    im_end = tok.token_to_id(IM_END)
    for tr in trajs:
        assert (tr.reward, tr.done, tr.num_turns) == (1.0, True, 7)
        # turns 0-2 in one row, then each turn a segment of its own
        assert len(tr.rows) == 1 + (7 - 3)
        assert (tr.segments, tr.compactions) == (5, 4) and tr.dropped_tokens > 0
        assert tr.token_ids == tr.rows[-1].token_ids
        first = tr.rows[0].token_ids[: tr.rows[0].prompt_len]
        # system + task, as first given
        prefix = first[: max(k + 1 for k, x in enumerate(first) if x == im_end)]
        sampled = 0
        for j, row in enumerate(tr.rows):
            starts = row.turn_starts
            assert starts and row.loss_mask[-1] == 1  # a row ends at its last sampled token
            for s, e in zip(starts, starts[1:] + [len(row.token_ids)]):
                prompt = tuple(row.token_ids[:s])
                assert prompt in given  # the engine was given exactly this prompt ...
                reply = engine.replies[prompt]
                assert row.token_ids[s : s + len(reply)] == reply  # ... and sampled exactly this
                assert row.loss_mask[s : s + len(reply)] == [1] * len(reply) and row.loss_mask[
                    :s
                ].count(1) == sum(
                    len(engine.replies[tuple(row.token_ids[:x])]) for x in starts if x < s
                )
                assert row.logprobs[s : s + len(reply)] == [fake_logprob(t) for t in reply]
            sampled += sum(row.loss_mask)
            if j:  # a compacted prompt: system + task, the last 2 turns, the
                # state line; built from the messages, nothing sampled
                msgs = tr.messages[: 2 * (j + 2) + 2]
                want = prefix + encode(
                    tok,
                    render_continuation(
                        recent_turns(msgs, 2)
                        + [{"role": "user", "content": f"You have walked {j + 2} steps."}]
                    ),
                )
                assert row.token_ids[: row.prompt_len] == want
        assert sampled == tr.sampled_tokens


def test_window_at_least_the_episode_trains_exactly_what_full_trains(tok):
    """(b): with memory_turns at least the episode's turns no compaction happens: the same
    trajectories, the same batch, the same advantages, token for token."""
    full, _, _ = play(tok, memory="full", n=5, G=3)
    window, _, _ = play(tok, memory="window", turns=6, n=5, G=3)
    for a, b in zip(full, window):
        assert (a.token_ids, a.loss_mask, a.logprobs, a.turn_starts, a.turn_rewards, a.rows) == (
            b.token_ids,
            b.loss_mask,
            b.logprobs,
            b.turn_starts,
            b.turn_rewards,
            b.rows,
        )
    ba, bb = to_batch(full, 0), to_batch(window, 0)
    for f in (
        "input_ids",
        "loss_mask",
        "logprobs",
        "rewards",
        "turn_index",
        "turn_rewards",
        "episode",
    ):
        assert torch.equal(getattr(ba, f), getattr(bb, f)), f
    for kind in ("grpo", "rloo"):
        adv = [
            algos.segment_advantages(
                algos.group_advantages(b.rewards, 3, kind), b.episode_rows()[0], b.loss_mask
            )
            for b in (ba, bb)
        ]
        assert torch.equal(*adv)
    turn = [
        algos.broadcast_turns(algos.turn_advantages(b.turn_rewards, b.turn_mask, 3), b.turn_index)
        for b in (ba, bb)
    ]
    assert torch.equal(*turn)
    assert (
        "rollout/segments" not in rollout_metrics(full, 3)
        and rollout_metrics(window, 3)["rollout/segments"] == 1
    )


def test_a_window_too_small_ends_the_episode_context_full(tok):
    trajs, _, _ = play(tok, memory="window", turns=1, n=6, max_total=60)
    assert all(t.finish_reason == "context_full" and t.context_full for t in trajs)


class LineWalk(WalkEnv):
    """A WalkEnv whose state line says where the walker is ("At k.", what WalkEngine reads),
    padded with `extra` words: a compacted prompt carries the position, or is made too long to
    fit."""

    def __init__(self, extra: int = 0):
        super().__init__(state_line=True)
        self.extra = extra

    def step(self, state, action):
        state, obs, reward, done, info = super().step(state, action)
        if "state_line" in info:
            info["state_line"] = " ".join([f"At {state.at}."] + ["mile"] * self.extra)
        return state, obs, reward, done, info


def play_lines(tok, max_total: int, extra: int = 0, memory: str = "window", turns: int = 0):
    """Walks to 6 on LineWalk, keeping `turns` turns (0: every compacted prompt is the system
    prompt, the task and the state line)."""
    cfg = AgentConfig(
        n_samples=2, max_turns=8, max_total_tokens=max_total, memory=memory, memory_turns=turns
    )
    env = {"walk": LineWalk(extra)}
    params = SamplingParams(max_tokens=40)
    return run_episodes(WalkEngine(tok), env, [walk_task(6)], tok, cfg, params, seed=0)


def test_every_episode_ending_context_full_in_one_turn_is_not_a_crash(tok):
    """A state line too long for the window: every episode's first compaction fails in the same
    turn, so none is left to play (it was max() of an empty list, and the batch was lost)."""
    trajs = play_lines(tok, max_total=300, extra=60)
    assert [(t.finish_reason, t.num_turns) for t in trajs] == [("context_full", 1)] * 2


@pytest.mark.parametrize("memory", ["window", "summary"])
def test_a_row_ends_at_its_last_sampled_token_when_the_first_compaction_fails(tok, memory):
    """The failed compaction's episode has no rows yet: its one row is trimmed as every closed row
    is, so it does not end with the observation and generation prompt the engine never saw."""
    for t in play_lines(tok, max_total=300, extra=60, memory=memory):
        assert t.context_full and not t.rows and t.loss_mask[-1] == 1
        assert len(t.loss_mask) == len(t.token_ids) == len(t.logprobs) == len(t.versions)


@pytest.mark.parametrize("memory,turns", [("window", 0), ("window", 4), ("summary", 0)])
def test_context_full_only_when_even_the_compacted_prompt_cannot_fit(tok, memory, turns):
    """An observation that overfills the window is not the end under a memory policy: the policy
    compacts first (system + task + state line fit in 220 tokens; a window of 4 turns keeps fewer
    when they do not fit), and the walk is finished. Under full the same window ends every episode
    context_full after one turn."""
    for t in play_lines(tok, max_total=220, memory=memory, turns=turns):
        assert (t.finish_reason, t.reward, t.num_turns, t.context_full) == ("done", 1.0, 6, False)
        assert t.compactions == 5 and all(len(r.token_ids) <= 220 for r in t.rows)
    full = play_lines(tok, max_total=220, memory="full")
    assert [(t.finish_reason, t.num_turns) for t in full] == [("context_full", 1)] * 2


# -----------------------------------------------------------------------------
# summary


def test_summaries_are_sampled_turns_and_the_episode_goes_on_from_them(tok):
    trajs, engine, cfg = play(tok, memory="summary", turns=1, n=8, max_total=700, summary_tokens=24)
    for tr in trajs:
        assert tr.reward == 1.0 and tr.compactions >= 1 and tr.summary_failures == 0
        assert len(tr.rows) == tr.compactions + 1 == tr.segments
        # each summary a turn of reward 0
        assert len(tr.turn_rewards) == tr.num_turns + tr.compactions
        assert tr.turn_rewards.count(0.0) >= tr.compactions
        for before, after in zip(tr.rows, tr.rows[1:]):
            text = tok.decode(before.token_ids, skip_special_tokens=False)
            assert SUMMARY_REQUEST in text  # the request, then the summary: sampled
            last = before.turn_starts[-1]
            summary = tok.decode(before.token_ids[last:], skip_special_tokens=False)
            assert summary.startswith("I am at") and all(before.loss_mask[last:])
            head = tok.decode(after.token_ids[: after.prompt_len], skip_special_tokens=False)
            assert (
                SUMMARY_HEAD + summary.replace(IM_END, "") in head and SUMMARY_REQUEST not in head
            )
    batch = to_batch(trajs, 0)
    assert (
        int(batch.turn_index.max())
        == len(trajs[0].turn_rewards) - 1
        == batch.turn_rewards.shape[1] - 1
    )
    m = rollout_metrics(trajs, 2)
    assert (
        m["rollout/compactions"] >= 1
        and m["rollout/summary_failures"] == 0
        and m["rollout/segments"] >= 2
    )
    e = eval_metrics({"walk": [walk_task(8)]}, trajs, 2)
    assert e["eval/walk/compactions"] == m["rollout/compactions"]


@pytest.mark.parametrize(
    "summary, failed", [(lambda at: "", True), (lambda at: "I am at %d. " % at + "x " * 60, True)]
)
def test_a_failed_summary_is_counted(tok, summary, failed):
    """An empty summary is left out of the prompt; one cut at summary_tokens is kept as cut; both
    are counted."""
    trajs, _, _ = play(
        tok, memory="summary", turns=1, n=8, max_total=700, summary_tokens=24, summary=summary
    )
    for tr in trajs:
        assert tr.summary_failures == tr.compactions >= 1
        heads = [
            tok.decode(r.token_ids[: r.prompt_len], skip_special_tokens=False) for r in tr.rows[1:]
        ]
        assert all((SUMMARY_HEAD in h) is (summary(0) != "") for h in heads)


def test_summary_every_m_turns(tok):
    trajs, _, _ = play(tok, memory="summary", turns=2, n=7, summary_every=3)
    assert all(t.compactions == 2 and t.reward == 1.0 for t in trajs)  # after turns 3 and 6


# -----------------------------------------------------------------------------
# demonstrations as segments, config


def test_demonstration_rows_are_the_segments_the_loop_plays(tok):
    """SFT under a memory policy trains on the rows RL will see: the expert's turns replayed through
    the loop give the same rows (ids and mask) as the engine playing those turns."""
    cfg = AgentConfig(max_turns=10, max_total_tokens=4096, memory="window", memory_turns=2)
    env = WalkEnv()
    rows = demonstration_rows(env, walk_task(6), env.demonstration(walk_task(6)), tok, cfg, 40)
    played, _, _ = play(tok, memory="window", turns=2, n=6, G=1)
    assert rows == [(r.token_ids, r.loss_mask) for r in played[0].rows] and len(rows) == 1 + (6 - 3)


def test_summary_demonstrations_take_the_state_line_as_the_experts_summary(tok):
    """Under summary memory a demonstration's summary turns are the env's state line (mask 1), and
    the rows after a compaction start from it."""
    cfg = AgentConfig(
        max_turns=10, max_total_tokens=4096, memory="summary", memory_turns=1, summary_every=2
    )
    env = WalkEnv()
    rows = demonstration_rows(env, walk_task(5), env.demonstration(walk_task(5)), tok, cfg, 40)
    assert len(rows) == 3  # compacted after turns 2 and 4
    for ids, mask in rows[:-1]:
        text = tok.decode(ids, skip_special_tokens=False)
        assert SUMMARY_REQUEST in text and text.endswith("steps.<|im_end|>") and mask[-1] == 1
    assert SUMMARY_HEAD + "You have walked 4 steps." in tok.decode(
        rows[-1][0], skip_special_tokens=False
    )


def test_memory_settings_are_checked_at_load():
    assert (
        load_config(
            None, ["rollout.agent.memory=window", "rollout.agent.memory_turns=2"]
        ).rollout.agent.memory_turns
        == 2
    )
    for overrides, says in (
        (["rollout.agent.memory=windw"], "did you mean 'window'"),
        (["rollout.agent.memory_turns=2"], "not of full"),
        (["rollout.agent.memory=summary", "rollout.agent.summary_tokens=0"], "summary_tokens >= 1"),
        (
            ["rollout.agent.memory=window", "rollout.external_agent=a.py:run"],
            "keeps its own context",
        ),
        # sequence-level losses would treat each segment as an episode: refused
        (["rollout.agent.memory=summary", "algo.name=gspo"], "treat each row as a sequence"),
        (
            ["rollout.agent.memory=window", "learner.loss.agg_mode=seq-mean-token-mean"],
            "treat each row as a sequence",
        ),
    ):
        with pytest.raises(ValueError, match=says):
            load_config(None, overrides)
    with pytest.raises(ValueError):
        Memory(AgentConfig(memory="full"), None)


# -----------------------------------------------------------------------------
# the credit rule, by exact enumeration
#
# A toy MDP with a compaction step. Turn 1 (context c0): action a1. The env then shows a key o, o =
# 1 with probability P_KEY[a1]. Compaction: the policy writes a summary s of what it saw, s ~ pi_s(.
# | a1, o). Turn 2, on the compacted context (c0, s) alone (the key itself is dropped): a2 ~ pi_2(.
# | s). Reward R = R_A1 * a1 + [a2 == o]. Each episode trains as two rows: row 0 holds a1 and s
# (sampled on the full context), row 1 holds a2 (sampled on the compacted one). Every policy is a
# softmax table; the parameters are theta = (t1 (2,), ts (2, 2, 2), t2 (2, 2), tf (2, 2, 2, 2)): tf
# is a table over the whole history (a1, o, s) that never acts, what scoring the post-compaction
# turn on the whole history would train.

P_KEY = torch.tensor([0.3, 0.8], dtype=f64)
R_A1 = 0.2
SIZES = {"t1": (2,), "ts": (2, 2, 2), "t2": (2, 2), "tf": (2, 2, 2, 2)}
OUTCOMES = list(itertools.product(range(2), repeat=4))  # (a1, o, s, a2)


def init_theta(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*v, generator=g, dtype=f64) for k, v in SIZES.items()}


def outcome_probs(theta, summary_matters=True):
    """(16,) the probability of each (a1, o, s, a2), differentiable in theta; and (16,) its
    reward."""
    p1, ps, p2 = (torch.softmax(theta[k], -1) for k in ("t1", "ts", "t2"))
    probs, rewards = [], []
    for a1, o, s, a2 in OUTCOMES:
        po = P_KEY[a1] if o else 1 - P_KEY[a1]
        probs.append(p1[a1] * po * ps[a1, o, s] * p2[s, a2])
        rewards.append(R_A1 * a1 + (float(a2 == o) if summary_matters else 0.0))
    return torch.stack(probs), torch.tensor(rewards, dtype=f64)


def token_scores(theta, whole_history=False):
    """(16, 2 rows, 2 tokens, D) grad log pi of each sampled token, row 0 = [a1, s], row 1 = [a2,
    padding]; with whole_history, a2 scored on the (a1, o, s) table instead of the context it was
    sampled from."""
    flat = torch.cat([theta[k].reshape(-1) for k in SIZES]).detach().requires_grad_()

    def unflat(v):
        out, i = {}, 0
        for k, shape in SIZES.items():
            n = int(torch.tensor(shape).prod())
            out[k], i = v[i : i + n].reshape(shape), i + n
        return out

    scores = torch.zeros(len(OUTCOMES), 2, 2, flat.numel(), dtype=f64)
    for x, (a1, o, s, a2) in enumerate(OUTCOMES):
        th = unflat(flat)
        logps = [
            torch.log_softmax(th["t1"], -1)[a1],
            torch.log_softmax(th["ts"][a1, o], -1)[s],
            torch.log_softmax(th["tf"][a1, o, s] if whole_history else th["t2"][s], -1)[a2],
        ]
        for (row, tok_), lp in zip(((0, 0), (0, 1), (1, 0)), logps):
            (scores[x, row, tok_],) = torch.autograd.grad(lp, flat)
    return scores


def exact_gradient(theta, summary_matters=True):
    flat = {k: v.clone().requires_grad_() for k, v in theta.items()}
    probs, rewards = outcome_probs(flat, summary_matters)
    grads = torch.autograd.grad(
        (probs * rewards).sum(), [flat[k] for k in SIZES], allow_unused=True
    )
    return torch.cat(
        [
            (g if g is not None else torch.zeros_like(flat[k])).reshape(-1)
            for g, k in zip(grads, SIZES)
        ]
    )


def expected_estimate(theta, G, kind, summary_matters=True, whole_history=False, credit="episode"):
    """E[(1/G) sum_i g_i] over every group of G episodes, exactly: each group's rows, advantages
    through algos.segment_advantages (episode credit) or algos.turn_advantages across segments (turn
    credit)."""
    probs, rewards = outcome_probs(theta, summary_matters)
    probs = probs.detach()
    scores = token_scores(theta, whole_history)  # (16, 2, 2, D)
    # (N, G) outcome of each episode
    groups = torch.tensor(list(itertools.product(range(len(OUTCOMES)), repeat=G)))
    N = len(groups)
    x = groups.reshape(-1)  # (N*G,) episodes, group-major
    if credit == "episode":
        adv = algos.group_advantages(rewards[x], G, kind)  # (E,)
        episode = torch.arange(N * G).repeat_interleave(2)  # (2E,) two rows per episode
        mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=f64).repeat(N * G, 1)  # (2E, 2)
        # (E, rows, tokens)
        token_adv = algos.segment_advantages(adv, episode, mask).reshape(N * G, 2, 2)
    else:
        a1, o, s, a2 = (torch.tensor([c[i] for c in OUTCOMES])[x] for i in range(4))
        turn_rewards = torch.stack(
            [
                R_A1 * a1.to(f64),
                torch.zeros(N * G, dtype=f64),
                # (E, 3): a1, summary, a2
                (a2 == o).to(f64) * float(summary_matters),
            ],
            1,
        )
        turn = algos.turn_advantages(turn_rewards, torch.ones(N * G, 3), G)  # (E, 3)
        token_adv = torch.stack(
            [turn[:, :2], torch.stack([turn[:, 2], torch.zeros(N * G, dtype=f64)], 1)], 1
        )
    g = (token_adv[..., None] * scores[x]).sum((1, 2)).reshape(N, G, -1).mean(1)  # (N, D)
    weight = probs[groups].prod(1)  # (N,)
    return (weight[:, None] * g).sum(0)


@pytest.mark.parametrize(
    "credit, kind, scale",
    [("episode", "rloo", 1.0), ("episode", "drgrpo", 2 / 3), ("turn", None, 1.0)],
)
def test_segment_credit_is_an_unbiased_policy_gradient(credit, kind, scale):
    """(a): over rows that each hold the context a token was sampled from, E[g] is the true gradient
    (RLOO; Dr.GRPO's group mean scales it by (G - 1) / G; turn credit's leave-one-out turn baseline
    across segments: exact)."""
    theta = init_theta()
    exact = exact_gradient(theta)
    est = expected_estimate(theta, 3, kind, credit=credit)
    assert exact.abs().max() > 0.05
    torch.testing.assert_close(est, scale * exact, rtol=1e-10, atol=1e-12)


def test_a_summary_that_does_not_matter_gets_zero_expected_gradient():
    """(c): when the reward does not depend on the summary (nor on what it conditions), the
    summary's parameters (ts) and the post-compaction turn's (t2) get an expected gradient of
    exactly 0, while a1's is the true one."""
    theta = init_theta(1)
    exact = exact_gradient(theta, summary_matters=False)
    for credit in ("episode", "turn"):
        est = expected_estimate(theta, 3, "rloo", summary_matters=False, credit=credit)
        n1 = 2
        assert est[n1:].abs().max() < 1e-15 and exact[n1:].abs().max() < 1e-15
        torch.testing.assert_close(est, exact, rtol=1e-10, atol=1e-14)
        assert exact[:n1].abs().max() > 0.01


def test_scoring_the_compacted_turn_on_the_whole_history_is_biased():
    """The rows must hold the context each token was sampled from: scoring a2 on the whole history
    (a1, o, s), what re-tokenizing the full conversation would do, trains a table that never acted
    and misses t2's gradient."""
    theta = init_theta()
    exact = exact_gradient(theta)
    est = expected_estimate(theta, 3, "rloo", whole_history=True)
    t2 = slice(2 + 8, 2 + 8 + 4)
    assert est[t2].abs().max() == 0 and exact[t2].abs().max() > 0.02
    assert est[2 + 8 + 4 :].abs().max() > 0.01  # ... and pushes tf, which never acted


# -----------------------------------------------------------------------------
# end to end


@pytest.mark.slow
def test_train_main_with_a_memory_policy(tiny):
    """The embedded model warm-started on its demonstrations as segments, then RL on rows: the
    segments are counted, the gate holds, held-out evals count the same per env."""
    import json
    import os

    from train import main

    run = main(
        tiny(
            "steps=2",
            "eval_every=2",
            "run_name=memory_window",
            "rollout.agent.memory=window",
            "rollout.agent.memory_turns=1",
        )
    )["run_dir"]
    lines = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]
    for l in lines[1:]:
        assert l["rollout/segments"] >= 1 and l["sync/logprob_abs_diff"] < 1e-3
    assert lines[-1]["rollout/compactions"] > 0 and "eval/toy_math/segments" in lines[-1]
