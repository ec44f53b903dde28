"""The LLM judge (judge.py, docs/judge.md): the score forms it reads, the failure value and its
count, one engine call per batch with the judge's own sampling, agent.finish_episodes' judge hook
(hand-computed rewards), the config's checks, a tiny judge model through the torch engine, and the
safety rule end to end: a judge that rewards length moves rollout/reward in train.main while eval/*
is computed without it."""

import itertools
import json
import os
from dataclasses import replace

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from agent import Judgment, Trajectory, finish_episodes, rollout_metrics
import config
from env import Env, Task
from rollout import Generation, SamplingParams
from wings import judge
from wings.judge import FAILURE_SCORE, RUBRIC, LLMJudge, parse_score, transcript
from test_train import tiny  # noqa: F401  (tiny: the session's default model, built once)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """A byte-level tokenizer with Qwen's chat tokens: any text encodes and decodes back exactly."""
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(["SCORE: 7/10 the answer is 84"], trainer)
    return t


class ScriptedEngine:
    """An engine that answers each prompt with `reply(prompt text)`, and records every call."""

    def __init__(self, tok: Tokenizer, reply):
        self.tok, self.reply, self.calls = tok, reply, []

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        self.calls.append((prompts, params))
        out = []
        for p in prompts:
            ids = self.tok.encode(
                self.reply(self.tok.decode(p, skip_special_tokens=False)), add_special_tokens=False
            ).ids + [self.tok.token_to_id("<|im_end|>")]
            out.append(Generation(ids, [0.0] * len(ids), "stop"))
        return out


TASK = Task("toy_math", "toy_math/1", "What is 12*7?", "84")
CONVERSATION = [
    {"role": "system", "content": "You have tools."},
    {"role": "user", "content": "What is 12*7?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "python_eval", "arguments": {"code": "12*7"}}}
        ],
    },
    {"role": "tool", "name": "python_eval", "content": "84"},
    {"role": "assistant", "content": "The answer is 84."},
]


# -----------------------------------------------------------------------------
# reading a reply


@pytest.mark.parametrize(
    "reply, score",
    [
        ("SCORE: 7/10", 0.7),
        ("The work is fine.\nSCORE: 7", 0.7),
        ("score = 3", 0.3),
        ("Score: 8 / 8", 1.0),
        ("**Score:** 6/10", 0.6),
        ("SCORE: 2 at first... final SCORE: 9", 0.9),
        ("SCORE: 7.5", 0.75),
        ("SCORE: 0", 0.0),
        ("7", 0.7),
        (" 0.5/1 \n", 0.5),
        ("10/10", 1.0),
    ],
)
def test_the_documented_forms_read_as_a_score(reply, score):
    assert parse_score(reply) == pytest.approx(score, abs=1e-12)


@pytest.mark.parametrize(
    "reply",
    [
        "",
        "great job",
        "7 out of 10",
        "SCORE: seven",
        "SCORE: 11/10",
        "SCORE: 11",
        "SCORE: 3/0",
        "SCORE: -2",
        "I give it a 7",
        "7 8",
    ],
)
def test_anything_else_is_unreadable(reply):
    assert parse_score(reply) is None


def test_a_bare_score_is_on_the_rubrics_scale():
    assert (
        parse_score("SCORE: 3", scale=5) == pytest.approx(0.6) and parse_score("4", scale=4) == 1.0
    )


# -----------------------------------------------------------------------------
# the prompt


def test_transcript_leaves_out_the_system_prompt_and_shows_tool_calls():
    assert transcript(CONVERSATION) == (
        "USER: What is 12*7?\n\n"
        'ASSISTANT: <tool_call>\n{"name": "python_eval", "arguments": {"code": "12*7"}}\n'
        "</tool_call>\n\n"
        "TOOL (python_eval): 84\n\n"
        "ASSISTANT: The answer is 84."
    )


def test_the_prompt_is_the_rubric_as_one_user_turn_in_the_judges_format(tok):
    j = LLMJudge(
        ScriptedEngine(tok, lambda p: ""),
        tok,
        SamplingParams(),
        rubric="Task: {task}\nRef: {reference}\n{conversation}",
    )
    text = tok.decode(j.prompt(TASK, CONVERSATION), skip_special_tokens=False)
    assert text == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
        "<|im_end|>\n<|im_start|>user\nTask: What is 12*7?\nRef: 84\n"
        + transcript(CONVERSATION)
        + "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_judge_in_another_chat_format_needs_its_tokens(tok):
    with pytest.raises(ValueError, match="chat_format='llama3'"):
        LLMJudge(ScriptedEngine(tok, lambda p: ""), tok, SamplingParams(), chat_format="llama3")


@pytest.mark.parametrize(
    "rubric", ["no field", "{task} only", "{conversation} {answer}", "{conversation"]
)
def test_a_bad_rubric_is_refused(tok, rubric):
    with pytest.raises(ValueError, match="rollout.judge.rubric"):
        LLMJudge(ScriptedEngine(tok, lambda p: ""), tok, SamplingParams(), rubric=rubric)


# -----------------------------------------------------------------------------
# one call per batch, its own sampling, failures counted


def test_one_engine_call_judges_the_whole_batch_with_the_judges_sampling(tok):
    replies = itertools.cycle(["Fine. SCORE: 7/10", "no idea", "SCORE: 12/10", "4"])
    engine = ScriptedEngine(tok, lambda p: next(replies))
    j = LLMJudge(engine, tok, SamplingParams(temperature=0.3, max_tokens=17, top_p=0.9), seed=5)
    verdicts = j([TASK] * 4, [CONVERSATION] * 4)
    assert verdicts == [
        Judgment(0.7),
        Judgment(FAILURE_SCORE, True),
        Judgment(FAILURE_SCORE, True),
        Judgment(0.4),
    ]
    assert len(engine.calls) == 1 and len(engine.calls[0][0]) == 4
    params = engine.calls[0][1]
    assert (params.temperature, params.max_tokens, params.top_p, params.n) == (0.3, 17, 0.9, 1)
    assert params.stop_token_ids == (tok.token_to_id("<|im_end|>"),) and params.seed is not None
    j([TASK] * 4, [CONVERSATION] * 4)
    assert engine.calls[1][1].seed == params.seed  # the same batch, the same seed (a resumed run)
    assert j([], []) == [] and len(engine.calls) == 2  # nothing finished: no call


def test_a_prompt_too_long_for_the_judge_is_a_failure_and_not_sent(tok):
    engine = ScriptedEngine(tok, lambda p: "SCORE: 10/10")
    short = LLMJudge(engine, tok, SamplingParams(max_tokens=8)).prompt(TASK, CONVERSATION[:2])
    j = LLMJudge(engine, tok, SamplingParams(max_tokens=8), context=len(short) + 8)
    assert j([TASK, TASK], [CONVERSATION, CONVERSATION[:2]]) == [
        Judgment(FAILURE_SCORE, True),
        Judgment(1.0),
    ]
    assert len(engine.calls[0][0]) == 1


# -----------------------------------------------------------------------------
# agent.finish_episodes' judge hook


def episode(reward: float, finish: str, turns: list[float]) -> Trajectory:
    return Trajectory(
        task=TASK,
        group=0,
        sample=0,
        token_ids=[1],
        loss_mask=[0],
        logprobs=[0.0],
        prompt_len=1,
        messages=list(CONVERSATION),
        reward=reward,
        turn_rewards=list(turns),
        finish_reason=finish,
        num_turns=len(turns),
    )


def test_finish_episodes_adds_the_weighted_verdict_to_finished_episodes_only():
    seen = []

    def judge_fn(tasks, conversations):
        seen.append(len(tasks))
        return [Judgment(0.8), Judgment(FAILURE_SCORE, failed=True)]

    trajs = [
        episode(1.0, "done", [0.0, 1.0]),
        episode(0.0, "max_turns", [0.0, 0.0]),
        episode(0.5, "done", [0.5]),
    ]
    finish_episodes({}, trajs, 0.5, judge_fn)
    assert seen == [2]  # the cut episode is never judged
    assert [t.reward for t in trajs] == [pytest.approx(1.4), 0.0, 0.5]
    assert trajs[0].turn_rewards == [0.0, pytest.approx(1.4)] and trajs[1].turn_rewards == [
        0.0,
        0.0,
    ]
    assert trajs[0].info == {"judge": 0.8, "judge_failed": False} and trajs[1].info == {}
    assert trajs[2].info == {"judge": 0.0, "judge_failed": True}
    m = rollout_metrics(trajs, 3)
    assert m["rollout/judge_score"] == pytest.approx(0.4) and m["rollout/judge_failures"] == 0.5
    assert m["rollout/reward"] == pytest.approx((1.4 + 0.0 + 0.5) / 3)
    untouched = [episode(1.0, "done", [1.0])]
    # weight 0 (every eval): the judge is never called
    finish_episodes({}, untouched, 0.0, judge_fn)
    assert (
        seen == [2]
        and untouched[0].reward == 1.0
        and "rollout/judge_score" not in rollout_metrics(untouched, 1)
    )


def test_without_a_judge_the_envs_own_judge_is_used():
    class Ruled(Env):
        name = "toy_math"

        def judge(self, task, messages):
            return 0.25

    trajs = [episode(1.0, "done", [1.0]), episode(0.0, "done", [0.0])]
    finish_episodes({"toy_math": Ruled()}, trajs, 2.0)
    assert [t.reward for t in trajs] == [1.5, 0.5] and trajs[0].info == {
        "judge": 0.25,
        "judge_failed": False,
    }
    plain = [episode(1.0, "done", [1.0])]
    finish_episodes({"toy_math": Env()}, plain, 2.0)  # an env without a judge: nothing added
    assert plain[0].reward == 1.0 and plain[0].info == {}


# -----------------------------------------------------------------------------
# the config

JUDGE_ON = ["rollout.judge.model_path=some/folder", "rollout.judge_weight=0.5"]


@pytest.mark.parametrize(
    "override, says",
    [
        (
            "rollout.judge.engine=openai",
            "rollout.judge.engine is a setting of the LLM judge, which is off",
        ),
        ("rollout.judge.base_url=http://x:1/v1", "rollout.judge.base_url is a setting"),
        ("rollout.judge.chat_format=llama3", "rollout.judge.chat_format is a setting"),
        ("rollout.judge.temperature=0.7", "rollout.judge.temperature is a setting"),
        ("rollout.judge.max_tokens=9", "rollout.judge.max_tokens is a setting"),
        ("rollout.judge.rubric='{conversation}'", "rollout.judge.rubric is a setting"),
    ],
)
def test_a_judge_setting_without_a_judge_is_refused(override, says):
    with pytest.raises(ValueError, match=says):
        config.load_config(None, [override])


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["rollout.judge.model_path=some/folder"], "rollout.judge_weight is 0"),
        ([*JUDGE_ON, "ray.rollout_workers=1"], "ray.rollout_workers=0"),
        (
            [*JUDGE_ON, "rollout.judge.engine=tourch"],
            "rollout.judge.engine='tourch' is not one of .*did you mean 'torch'",
        ),
        (
            [*JUDGE_ON, "rollout.judge.chat_format=qwen4"],
            "rollout.judge.chat_format='qwen4' is not one of",
        ),
        (
            [*JUDGE_ON, "rollout.judge.temperature=-0.1"],
            "rollout.judge.temperature=-0.1 must be >= 0",
        ),
        ([*JUDGE_ON, "rollout.judge.max_tokens=0"], "rollout.judge.max_tokens=0 must be >= 1"),
        ([*JUDGE_ON, "rollout.judge.rubric='{task}'"], r"rollout.judge.rubric names \['task'\]"),
        (
            [*JUDGE_ON, "rollout.judge.rubric='{conversation'"],
            "rollout.judge.rubric is not a template",
        ),
    ],
)
def test_a_bad_judge_config_is_refused_at_load(overrides, says):
    with pytest.raises(ValueError, match=says):
        config.load_config(None, overrides)


def test_a_judge_config_loads_and_its_catalogue_is_judges(monkeypatch):
    jc = config.load_config(
        None, [*JUDGE_ON, "rollout.judge.rubric='{task} {conversation} {reference}'"]
    ).rollout.judge
    assert (jc.model_path, jc.engine, jc.temperature, jc.max_tokens) == (
        "some/folder",
        "torch",
        0.0,
        256,
    )
    seen = []  # one rubric check, at load and in code:
    # the wing's own,
    monkeypatch.setattr(judge, "check_rubric", lambda rubric: seen.append(rubric) or rubric)
    # reached by name at load
    config.load_config(None, [*JUDGE_ON, "rollout.judge.rubric='{conversation}'"])
    assert seen == ["{conversation}"] and config.WING_CHECKS["wings.judge"] == ("rollout.judge",)
    assert config.load_config(None, JUDGE_ON).rollout.judge.rubric == ""  # "": judge.RUBRIC
    assert "{conversation}" in RUBRIC


def test_a_judge_folder_that_is_not_a_model_is_refused(tmp_path):
    cfg = config.load_config(
        None, ["rollout.judge.model_path=" + str(tmp_path), "rollout.judge_weight=1"]
    )
    with pytest.raises(ValueError, match="rollout.judge.model_path"):
        LLMJudge.from_config(cfg)


# -----------------------------------------------------------------------------
# a tiny judge model through a real engine


@pytest.fixture(scope="module")
def tiny_model(tiny):  # noqa: F811
    from sft import build_default_model

    return build_default_model(tiny())


@pytest.mark.slow
def test_a_tiny_judge_model_through_the_torch_engine(tiny, tiny_model):  # noqa: F811
    """The embedded tiny model as the judge, rendered with its own tokenizer, through
    rollout.TorchEngine: it writes no score (it was never taught to), so each verdict is what
    parse_score reads from its greedy reply, or the failure value, counted; nothing raises, and
    sampled judgments (temperature 1) of the same batch repeat."""
    cfg = tiny(
        f"rollout.judge.model_path={tiny_model}",
        "rollout.judge_weight=1",
        "rollout.judge.max_tokens=24",
    )
    j = LLMJudge.from_config(cfg)
    assert (
        type(j.engine).__name__ == "TorchEngine"
        and j.params.max_tokens == 24
        and j.params.temperature == 0
    )
    conversations = [CONVERSATION, CONVERSATION[:2], CONVERSATION[:4]]
    # greedy: any seed
    gens = j.engine.generate([j.prompt(TASK, m) for m in conversations], j.params)
    expected = [parse_score(j.reply(g.token_ids)) for g in gens]
    verdicts = j([TASK] * 3, conversations)
    assert verdicts == [
        Judgment(FAILURE_SCORE, True) if s is None else Judgment(s) for s in expected
    ]
    assert any(v.failed for v in verdicts)  # the untaught model does fail to write a score
    j.params = replace(j.params, temperature=1.0)
    assert j([TASK] * 3, conversations) == j([TASK] * 3, conversations)


# -----------------------------------------------------------------------------
# the safety rule, end to end


def length_judge(tok: Tokenizer) -> ScriptedEngine:
    """A judge anyone can game: one point out of 10 per 40 characters of conversation (capped at
    10)."""

    def reply(prompt: str) -> str:
        conversation = prompt.split("The conversation:\n", 1)[1].split("\n\nRate from 0", 1)[0]
        return f"Long is good. SCORE: {min(10, len(conversation) // 40)}/10"

    return ScriptedEngine(tok, reply)


@pytest.mark.slow
def test_a_gameable_judge_moves_training_reward_and_never_eval(tiny, tiny_model, monkeypatch):  # noqa: F811
    """Two runs from the same seed, with and without a length-rewarding judge (weight 2). Step 1's
    episodes are the same (same weights, same seeds), so the judged run's rollout/reward is the
    plain run's plus exactly 2 * judge_score * (the fraction of episodes the env finished: only
    those are judged); the held-out metrics at step 0 are equal, no eval/* metric names the judge,
    and the judge was called once per training step and never by an eval (eval at steps 0, 2 and
    3)."""
    engines = []

    def scripted(cfg, tokenizer, context):
        engines.append(length_judge(tokenizer))
        return engines[-1]

    monkeypatch.setattr(judge, "judge_engine", scripted)
    common = ["steps=3", "eval_every=2", "log_timings=false", f"model.path={tiny_model}"]
    plain = tiny(*common, "run_name=judge_off")
    judged = tiny(
        *common,
        "run_name=judge_on",
        f"rollout.judge.model_path={tiny_model}",
        "rollout.judge_weight=2",
    )
    from train import main

    runs = [
        [json.loads(line) for line in open(os.path.join(main(c)["run_dir"], "metrics.jsonl"))]
        for c in (plain, judged)
    ]
    off, on = runs
    assert [r["step"] for r in on] == [0, 1, 2, 3]
    evals = lambda r: {k: v for k, v in r.items() if k.startswith("eval/")}  # noqa: E731
    assert evals(on[0]) == evals(off[0]) and evals(on[0])  # held out: computed without it
    assert not any("judge" in k for r in on + off for k in evals(r))
    assert not any("judge" in k for r in off for k in r)  # no judge, no judge metrics
    s1, b1 = on[1], off[1]
    # the same episodes at step 1
    assert s1["rollout/response_tokens"] == b1["rollout/response_tokens"]
    finished = 1 - s1["rollout/truncated"]
    assert finished > 0 and s1["rollout/judge_score"] > 0 and s1["rollout/judge_failures"] == 0
    assert s1["rollout/reward"] - b1["rollout/reward"] == pytest.approx(
        2 * s1["rollout/judge_score"] * finished, abs=1e-9
    )
    for r in on[1:]:  # training reward carries the judge
        assert (
            r["rollout/judge_score"] > 0
            and r["rollout/reward"]
            >= 2 * r["rollout/judge_score"] * (1 - r["rollout/truncated"]) - 1e-9
        )
    (engine,) = engines
    assert len(engine.calls) == 3  # one per training step, none in eval
