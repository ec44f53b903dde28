"""The vault (envs/env_vault.py): the expert opens every vault and random play none; the code is
shown once, never in the task, the system prompt or a state line; the expert's summary comes in
info["summary"], keeping the code for the share summary_keeps of the tasks; at the budget of
configs/vault_memory.yaml a policy that copies perfectly from its prompt opens every vault under
memory=summary with the expert's summaries, and only the 1-crate ones under full and window (the
code is gone); and rollout.agent.summary_gradient=false records the summary unsampled (mask 0).
"""

import random
import re
from dataclasses import replace

import pytest

import sft
from agent import run_episodes
from batch import to_batch
from chat import encode, render
from config import load_config
from env import Action, ToolCall, make_env
from eval import play_scripted
from rollout import Generation, SamplingParams
from wings.memory import SUMMARY_REQUEST, Memory, demonstration_rows, expert_summary

CONFIG = "configs/vault_memory.yaml"
IM_END = "<|im_end|>"
NOTE = Action(text="", tool_calls=(ToolCall("vault_note", {}),))


@pytest.fixture(scope="module")
def cfg():
    return load_config(CONFIG, [])


@pytest.fixture(scope="module")
def env(cfg):
    return make_env("vault", **cfg.envs[0].kwargs)


@pytest.fixture(scope="module")
def tok(env):
    """The run's kind of tokenizer (sft.train_tokenizer) on 300 rendered demonstrations."""
    demos = [
        env.demonstration(t, random.Random(0), True) for t in env.sample_tasks("train", 300, 0)
    ]
    return sft.train_tokenizer([render(m, env.tools()) for m in demos], 1024)


def test_the_expert_opens_every_vault_and_random_play_none(env):
    tasks = env.sample_tasks("test", 40, 1)
    expert = play_scripted(env, tasks, "expert", 0, 8)
    assert all(e["reward"] == 1.0 and e["done"] for e in expert)
    assert {e["turns"] for e in expert} == {3, 4, 5}  # the note, 1-3 crates, the code
    random_play = play_scripted(env, tasks, "random", 0, 8, n_samples=4)
    assert sum(e["reward"] for e in random_play) == 0.0


def test_the_code_is_shown_once_and_only_by_the_note(env):
    task = env.sample_tasks("train", 1, 0)[0]
    state, messages = env.reset(task, seed=0)
    assert all(task.answer not in m["content"] for m in messages)
    demo = env.demonstration(task, random.Random(0), True)
    shown = [
        m for m in demo if m["role"] == "tool" and f"Vault code {task.answer}." in m["content"]
    ]
    assert len(shown) == 1 and shown[0]["name"] == "vault_note"
    *_, info = env.step(state, env.random_action(state, random.Random(0)))
    assert "state_line" not in info and "summary" in info
    # the splits hold out codes: a held-out code never appears in training
    train = {t.answer for t in env.sample_tasks("train", 400, 0)}
    assert not train & {t.answer for t in env.sample_tasks("test", 60, 0)}


@pytest.mark.parametrize("keeps", [0.0, 0.25, 1.0])
def test_summary_keeps_is_the_share_of_tasks_whose_expert_summary_keeps_the_code(keeps):
    env = make_env("vault", summary_keeps=keeps)
    tasks = env.sample_tasks("train", 400, 0)
    kept = []
    for task in tasks:
        state, _ = env.reset(task, seed=0)
        *_, info = env.step(state, NOTE)
        kept.append(f"Vault code {task.answer}." in info["summary"])
        assert info["summary"].endswith(f"Crates left: {len(task.meta['crates'])}.")
    assert abs(sum(kept) / len(kept) - keeps) < 0.06
    # decided by the task, not by the draw: another env object keeps the same ones
    again = make_env("vault", summary_keeps=keeps)
    assert [again.keeps(t) for t in tasks] == kept


def test_the_expert_summary_is_the_summary_key_before_the_state_line():
    assert expert_summary({"summary": "a", "state_line": "b"}) == "a"
    assert expert_summary({"state_line": "b"}) == "b"
    assert expert_summary({}) == ""


def test_sft_rows_hold_the_expert_summary_and_show_the_code_only_through_it(cfg, env, tok):
    """Under memory=summary each demonstration's rows fit the window; its summaries are
    info["summary"], sampled (mask 1); a compacted prompt shows the code only when the expert's
    summary kept it."""
    agent = cfg.rollout.agent
    for task in env.sample_tasks("train", 24, 3):
        demo = env.demonstration(task, random.Random(0), True)
        rows = demonstration_rows(env, task, demo, tok, agent, cfg.rollout.max_tokens)
        assert len(rows) == len(task.meta["crates"]) + 1  # a summary after every carry
        for ids, mask in rows:
            assert len(ids) <= agent.max_total_tokens and mask[-1] == 1
        for ids, _ in rows[1:]:
            prompt = tok.decode(ids, skip_special_tokens=False).rsplit("<|im_start|>assistant", 1)
            assert (f"Vault code {task.answer}." in prompt[0]) is env.keeps(task)


class Reader:
    """A policy that copies perfectly from its prompt: the note first, then the crate the prompt
    names next, then the vault with the last code the prompt shows ("000" when none); asked for a
    summary, it writes the expert's, keeping the code when it can see it."""

    def __init__(self, tok):
        self.tok = tok

    def generate(self, prompts, params):
        out = []
        for p in prompts:
            text = self.tok.decode(p, skip_special_tokens=False)
            codes = re.findall(r"(?:code is|Vault code) (\d+)", text)
            crates = re.findall(r"Next crate: (\d+)", text)
            if SUMMARY_REQUEST in text.rsplit("<|im_start|>user", 1)[-1]:
                left = re.findall(r"Crates left: \d+\.|All crates are carried[^.]*\.", text)[-1]
                reply = (f"Vault code {codes[-1]}. " if codes else "") + (
                    f"Next crate: {crates[-1]}. {left}" if "left" in left else left
                )
            elif "vault_note" not in text.split("<|im_start|>user", 2)[-1] and not codes:
                reply = _call("vault_note", {})
            elif "All crates are carried" in text.rsplit("<|im_start|>user", 1)[-1]:
                reply = _call("vault_open", {"code": codes[-1] if codes else "000"})
            else:
                reply = _call("vault_carry", {"crate": crates[-1]})
            ids = encode(self.tok, reply + IM_END)[: params.max_tokens]
            out.append(Generation(ids, [0.0] * len(ids), "stop"))
        return out


def _call(name: str, arguments: dict) -> str:
    args = ", ".join(f'"{k}": "{v}"' for k, v in arguments.items())
    return f'<tool_call>\n{{"name": "{name}", "arguments": {{{args}}}}}\n</tool_call>'


def read(cfg, env, tok, memory: str, n: int = 30, **agent):
    """The Reader's episodes of n held-out tasks under `memory` at the config's budget."""
    a = replace(cfg.rollout.agent, n_samples=1, memory=memory, **agent)
    params = SamplingParams(max_tokens=cfg.rollout.max_tokens)
    tasks = env.sample_tasks("test", n, 5)
    return run_episodes(Reader(tok), {"vault": env}, tasks, tok, a, params, seed=0)


def test_at_the_budget_only_a_summary_carries_the_code(cfg, env, tok):
    """The floors and the ceiling of configs/vault_memory.yaml for a policy that copies perfectly:
    full runs out of room past one crate, a window (as many recent turns as fit) has dropped the
    note by the end of a longer episode, and summaries that keep the code open every vault."""
    one = lambda t: len(t.task.meta["crates"]) == 1  # noqa: E731
    full = read(cfg, env, tok, "full", memory_turns=4)
    assert all(t.reward == (1.0 if one(t) else 0.0) for t in full)
    assert all(t.finish_reason == "context_full" for t in full if not one(t))
    window = read(cfg, env, tok, "window", memory_turns=4)
    assert all(t.reward == (1.0 if one(t) else 0.0) for t in window)
    assert any(t.compactions for t in window)
    summary = read(cfg, env, tok, "summary")
    assert all(t.reward == 1.0 and t.summary_failures == 0 for t in summary)
    assert all(t.compactions == len(t.task.meta["crates"]) for t in summary)
    assert 0 < sum(one(t) for t in full) < len(full)


def test_summary_gradient_off_records_the_summary_unsampled(cfg, env, tok):
    """rollout.agent.summary_gradient=false (the ablation): the same episodes, but no summary token
    is sampled (mask 1), so none is trained: each row ends at its last tool call, before the
    request."""
    on, off = (
        read(cfg, env, tok, "summary", n=8),
        read(cfg, env, tok, "summary", n=8, summary_gradient=False),
    )
    request = Memory(cfg.rollout.agent, tok)._encode([{"role": "user", "content": SUMMARY_REQUEST}])

    def asks(row):
        return any(
            row.token_ids[k : k + len(request)] == request for k in range(len(row.token_ids))
        )

    for a, b in zip(on, off):
        assert a.reward == b.reward == 1.0 and a.compactions == b.compactions
        assert b.sampled_tokens < a.sampled_tokens
        assert all(asks(r) for r in a.rows[:-1]) and not any(asks(r) for r in b.rows)
        assert [r.prompt_len for r in a.rows] == [r.prompt_len for r in b.rows]
    batch = to_batch(off, 0)
    assert batch.loss_mask.sum() == sum(b.sampled_tokens for b in off)
    with pytest.raises(ValueError, match="summary_gradient"):
        load_config(None, ["rollout.agent.summary_gradient=false"])
