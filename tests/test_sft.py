"""sft.py: SFT data is cut exactly where the agent loop cuts a rollout, so the warm start trains on
the token sequences the policy is later asked to produce."""

import random

from agent import AgentConfig, run_episodes
from chat import encode, render
from rollout import Generation, SamplingParams
from env import make_env
from sft import tokenize_conversation, train_tokenizer


def spans(ids, mask):
    """The runs of mask-1 tokens, in order."""
    out, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            out.append(cur)
            cur = []
    return out + ([cur] if cur else [])


class ReplayEngine:
    """Answers each generate call with the next assistant turn of a demonstration, as the policy
    would."""

    def __init__(self, turns):
        self.turns = list(turns)

    def generate(self, prompts, params):
        assert len(prompts) == 1
        turn = self.turns.pop(0)
        return [Generation(turn, [0.0] * len(turn), "stop")]


def test_sft_tokens_equal_the_agent_loops_tokens():
    env = make_env("toy_math")
    rng = random.Random(0)
    tasks = env.sample_tasks("train", 40, 0)
    demos = [env.demonstration(t, rng, use_tools=i % 2 == 0) for i, t in enumerate(tasks)]
    tok = train_tokenizer([render(d, env.tools()) for d in demos], 600)
    for task, demo in zip(tasks[:6], demos[:6]):
        ids, mask = tokenize_conversation(demo, env.tools(), tok, "qwen2.5")
        # 1. cutting into spans does not change the tokenization of the whole conversation
        assert ids == encode(tok, render(demo, env.tools())[:-1])
        # 2. the trained spans are the assistant turns, each ending with <|im_end|>
        turns = spans(ids, mask)
        assert len(turns) == sum(m["role"] == "assistant" for m in demo)
        assert all(t[-1] == tok.token_to_id("<|im_end|>") for t in turns)
        # 3. the agent loop, fed those turns as the policy's output, builds the very same ids and
        # mask
        traj = run_episodes(
            ReplayEngine(turns),
            {"toy_math": env},
            [task],
            tok,
            AgentConfig(n_samples=1, max_total_tokens=4096),
            SamplingParams(),
            seed=0,
        )[0]
        assert traj.reward == 1.0 and traj.done
        assert traj.token_ids == ids and traj.loss_mask == mask


def test_the_short_context_warm_up_trains_each_rows_last_tokens_then_whole_rows(
    tmp_path, monkeypatch
):
    """sft.short_context_steps: the first steps train each row cut to its last short_context_tokens
    (its loss mask cut with it), the later steps whole rows. Off (0), neither setting enters the
    cache key: every model built before the warm-up existed keeps its folder."""
    import sft
    from dataclasses import replace
    from config import load_config

    widths, real = [], sft.sft_step

    def spy(state, input_ids, loss_mask, cfg):
        assert input_ids.shape == loss_mask.shape
        widths.append(input_ids.shape[1])
        return real(state, input_ids, loss_mask, cfg)

    monkeypatch.setattr(sft, "sft_step", spy)
    cfg = load_config(
        "configs/toy_math.yaml",
        [
            f"model.cache_dir={tmp_path}",
            "sft.num_demos=16",
            "sft.max_steps=4",
            "sft.eval_every=100",
            "sft.eval_size=2",
            "sft.batch_size=4",
            "sft.hidden_size=16",
            "sft.num_layers=1",
            "sft.intermediate_size=32",
            "sft.short_context_steps=2",
            "sft.short_context_tokens=8",
        ],
    )
    sft.build_default_model(cfg, log=lambda msg: None)
    assert [w <= 8 for w in widths] == [True, True, False, False]
    base = load_config("configs/toy_math.yaml")
    key = sft.default_model_dir(base, base.sft)
    assert key == sft.default_model_dir(base, replace(base.sft, short_context_tokens=9))
    assert key != sft.default_model_dir(base, replace(base.sft, short_context_steps=1))
