"""judge.py: an LLM judge of finished training episodes, reached through any engine (a wing of
agent.py's judge hook).

A language model reads a rubric prompt holding the task and the episode's conversation, and replies
with a score; parse_score reads it as a number in [0, 1], and agent.finish_episodes adds
rollout.judge_weight * score to the episode's reward. This is the LLM-as-a-judge of MT-Bench (Zheng
et al. 2023, arXiv 2306.05685: a strong model grading answers on a 1-10 scale, "Rating: [[x]]"),
used as a reward as in RLAIF (Lee et al. 2023, arXiv 2309.00267).

  - Its own model, tokenizer and chat format: the rubric is rendered with the judge's tokenizer
    (chat.render in rollout.judge.chat_format), so the judge may be any checkpoint, unrelated to
    the policy's.
  - Any engine: torch (the folder loaded in this process, on the GPU when there is one), vllm (in
    this process), or openai (a server such as `vllm serve`, on another GPU or machine). Its own
    sampling parameters (rollout.judge.temperature, max_tokens). Token ids in and out, like every
    engine (rollout.py).
  - Batched: every finished episode of a batch is judged in one engine.generate call.
  - Never a crash on a bad reply: a reply that holds no readable score (parse_score says which forms
    are read), or a prompt too long for the judge's context, gets FAILURE_SCORE and is counted
    (Judgment.failed -> rollout/judge_failures). FAILURE_SCORE is the lowest score, 0.0, so a policy
    can never gain by making the judge's reply unreadable (e.g. by injecting text into its
    conversation that derails the judge).
  - Training only, like the rules of env_tau's judge: agent.finish_episodes calls a judge only when
    judge_weight > 0, and eval.py always passes 0, so a judge the policy learns to game can raise
    rollout/reward, never eval/*.

Turned on by rollout.judge.model_path (with rollout.judge_weight > 0): train.build_rollouts builds
it by name, rollout.wing("judge.LLMJudge").from_config(cfg), and hands it to agent.LocalRollouts,
whose finish_episodes calls it in place of the envs' own judges. Docs: docs/judge.md.

Imports: model.py, env.py (Task, mix_seed), tool_calls.py, chat.py, agent.py (Judgment), rollout.py,
runs.py (check_model_folder) (and torch, tokenizers, the standard library).
"""

import dataclasses
import hashlib
import json
import os
import re
import string
from dataclasses import replace

import torch
from tokenizers import Tokenizer

from agent import Judgment
from chat import CHAT_FORMATS, encode, pad_token_id, render, turn_ends
from env import Task, mix_seed
from model import load_model
from rollout import ENGINES, SamplingParams, make_engine
from runs import check_model_folder
from tool_calls import tool_call_text

SCALE = 10  # the rubric's scale: a bare "SCORE: 7" means 7 / SCALE
FAILURE_SCORE = 0.0  # the score of a reply that cannot be read (the lowest: see the docstring)
# the judge's context when its folder's config.json does not say (max_position_embeddings)
CONTEXT = 32768

RUBRIC = """You are grading the work of an AI assistant that can call tools. \
Read the user's task and the whole conversation, then rate how well the assistant solved the task.

The task:
{task}

The conversation:
{conversation}

Rate from 0 (useless or wrong) to 10 (correct, and the tools used sensibly). \
Judge correctness first; do not reward length or politeness. \
Explain briefly, then end your reply with one line of the form
SCORE: <an integer from 0 to 10>"""

# -----------------------------------------------------------------------------
# the settings (rollout.judge.*, config.JudgeConfig), checked here at load (config.WING_CHECKS)

# what a rubric may name: {task} the user's request (the task's prompt), {conversation} the episode
# after the system prompt, as text, {reference} the task's ground-truth answer (for reference-guided
# grading); LLMJudge fills them
RUBRIC_FIELDS = ("task", "conversation", "reference")


def check_rubric(rubric: str) -> str:
    """`rubric` if it is a str.format template that names {conversation} and only RUBRIC_FIELDS;
    else a ValueError naming rollout.judge.rubric (checked at load, and by LLMJudge for a rubric
    given in code)."""
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(rubric) if name is not None}
    except ValueError as e:
        raise ValueError(
            f"rollout.judge.rubric is not a template ({e}): write a literal brace as {{{{ or }}}}"
        )
    if "conversation" not in names or not names <= set(RUBRIC_FIELDS):
        raise ValueError(
            f"rollout.judge.rubric names {sorted(names)}: it must name {{conversation}}, and only "
            f"fields of {list(RUBRIC_FIELDS)}"
        )
    return rubric


def check_config(cfg) -> list:
    """config.WING_CHECKS' hook: every rollout.judge.* setting needs the judge on, a judge needs a
    weight in the reward and this process's rollouts -> its choices (the engine, the
    chat format)."""
    jc = cfg.rollout.judge
    if not jc.model_path:
        changed = [
            f.name
            for f in dataclasses.fields(jc)
            if getattr(jc, f.name) != getattr(type(jc)(), f.name)
        ]
        raise ValueError(
            f"rollout.judge.{changed[0]} is a setting of the LLM judge, which is off: set "
            "rollout.judge.model_path (docs/judge.md)"
        )
    if cfg.rollout.judge_weight <= 0:
        raise ValueError(
            "rollout.judge.model_path sets an LLM judge, but rollout.judge_weight is 0: "
            "set the weight of its score in the reward, e.g. rollout.judge_weight=0.5"
        )
    if cfg.ray.rollout_workers:
        raise ValueError(
            "rollout.judge.model_path: the LLM judge scores episodes played in this process; with "
            "ray.rollout_workers the workers would need one each (not supported): set "
            "ray.rollout_workers=0"
        )
    if jc.temperature < 0:
        raise ValueError(f"rollout.judge.temperature={jc.temperature} must be >= 0 (0: greedy)")
    if jc.max_tokens < 1:
        raise ValueError(
            f"rollout.judge.max_tokens={jc.max_tokens} must be >= 1 (the judge's reply, in tokens)"
        )
    if jc.rubric:
        check_rubric(jc.rubric)
    return [
        ("rollout.judge.engine", jc.engine, ("torch", *ENGINES)),
        ("rollout.judge.chat_format", jc.chat_format, CHAT_FORMATS),
    ]


# -----------------------------------------------------------------------------
# reading a reply, and the judge

_NUMBER = r"(\d+(?:\.\d+)?)"
_SCORE = re.compile(
    r"score\**\s*[:=]\s*\**\s*" + _NUMBER + r"(?:\s*/\s*" + _NUMBER + ")?", re.IGNORECASE
)
_BARE = re.compile(r"\s*" + _NUMBER + r"(?:\s*/\s*" + _NUMBER + r")?\s*")


def parse_score(reply: str, scale: float = SCALE) -> float | None:
    """The judge's score in [0, 1] from its reply text, or None when it cannot be read. Two forms
    are read:
      1. "SCORE: x" or "SCORE: x/y" anywhere in the reply, the last one when there are several (a
         judge that reasons before concluding writes its verdict last): any case, ":" or "=", spaces
         and markdown bold around it allowed ("**Score:** 8/10");
      2. a reply that is nothing but "x" or "x/y" (spaces around allowed).
    x and y are unsigned decimals (7, 7.5). "x/y" means x / y; a lone x is on the rubric's
    0..`scale`. Anything else is unreadable: no such form ("7 out of 10", "seven"), y = 0, or a
    score outside [0, 1] (11/10: not clamped, a judge that breaks its scale is counted,
    not believed)."""
    found = _SCORE.findall(reply) or [m.groups() for m in [_BARE.fullmatch(reply)] if m]
    if not found:
        return None
    x, y = found[-1]
    x, y = float(x), float(y) if y else float(scale)
    if y <= 0 or not 0 <= x / y <= 1:
        return None
    return x / y


def transcript(messages: list[dict]) -> str:
    """An episode's conversation as plain text for the judge, the system prompt (the policy's
    instructions and tool list) left out: one block per message, "USER:", "ASSISTANT:" (its text,
    then each tool call as the policy wrote it, a <tool_call> block) and "TOOL (name):"."""
    blocks = []
    for m in messages:
        role = m["role"]
        if role == "system":
            continue
        if role == "tool":
            blocks.append(f"TOOL ({m.get('name', 'tool')}): {m.get('content', '')}")
            continue
        parts = [str(m.get("content") or "").strip()] + [
            tool_call_text(c) for c in m.get("tool_calls") or []
        ]
        blocks.append(f"{role.upper()}: " + "\n".join(p for p in parts if p))
    return "\n\n".join(blocks)


class LLMJudge:
    """A language model behind an engine that grades finished episodes: agent.finish_episodes'
    `judge`, `judge(tasks, conversations) -> [Judgment]`, one engine call for all of them."""

    def __init__(
        self,
        engine,
        tokenizer: Tokenizer,
        params: SamplingParams,
        chat_format: str = "qwen2.5",
        rubric: str = RUBRIC,
        context: int = CONTEXT,
        seed: int = 0,
    ):
        self.engine, self.tokenizer, self.chat_format = engine, tokenizer, chat_format
        self.rubric = check_rubric(rubric)
        ends = [tokenizer.token_to_id(t) for t in turn_ends(chat_format)]
        if None in ends:
            raise ValueError(
                f"the judge's tokenizer has no {turn_ends(chat_format)}: "
                f"is rollout.judge.chat_format={chat_format!r} its chat format?"
            )
        self.params = replace(params, n=1, stop_token_ids=tuple(ends))
        # prompt tokens at most: the reply must fit after them
        self.max_prompt = context - params.max_tokens
        self.seed = seed

    @classmethod
    def from_config(cls, cfg) -> "LLMJudge":
        """The judge of a run's config (rollout.judge.*): its folder checked, its engine built
        (judge_engine)."""
        jc = cfg.rollout.judge
        path = check_model_folder(
            jc.model_path, "rollout.judge.model_path", weights=jc.engine != "openai"
        )
        tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        context = CONTEXT
        if os.path.isfile(os.path.join(path, "config.json")):
            with open(os.path.join(path, "config.json")) as f:
                context = json.load(f).get("max_position_embeddings", CONTEXT)
        params = SamplingParams(temperature=jc.temperature, max_tokens=jc.max_tokens)
        return cls(
            judge_engine(cfg, tokenizer, context),
            tokenizer,
            params,
            jc.chat_format,
            jc.rubric or RUBRIC,
            context,
            cfg.seed,
        )

    def prompt(self, task: Task, messages: list[dict]) -> list[int]:
        """The judge's prompt ids for one episode: the rubric filled in, as one user message in the
        judge's chat format, with the generation prompt."""
        text = self.rubric.format(
            task=task.prompt, conversation=transcript(messages), reference=task.answer
        )
        return encode(
            self.tokenizer,
            render(
                [{"role": "user", "content": text}],
                add_generation_prompt=True,
                chat_format=self.chat_format,
            ),
        )

    def reply(self, token_ids: list[int]) -> str:
        """A generation's text, up to its first stop token."""
        stop = next(
            (k for k, t in enumerate(token_ids) if t in self.params.stop_token_ids), len(token_ids)
        )
        return self.tokenizer.decode(token_ids[:stop], skip_special_tokens=True)

    def __call__(self, tasks: list[Task], conversations: list[list[dict]]) -> list[Judgment]:
        """One Judgment per episode, in order: the score read from the judge's reply, or
        FAILURE_SCORE and failed when it cannot be read or the prompt is longer than the judge's
        context allows (that one is not sent)."""
        prompts = [self.prompt(t, m) for t, m in zip(tasks, conversations, strict=True)]
        fits = [i for i, p in enumerate(prompts) if len(p) <= self.max_prompt]
        scores: list[float | None] = [None] * len(prompts)
        if fits:
            # one seed per batch of prompts, drawn from their ids: a resumed run judges its batches
            # as an uninterrupted one does (env.mix_seed)
            digest = hashlib.sha256(repr([prompts[i] for i in fits]).encode()).digest()
            params = replace(
                self.params, seed=mix_seed(self.seed, int.from_bytes(digest[:6], "big"))
            )
            gens = self.engine.generate([prompts[i] for i in fits], params)
            for i, gen in zip(fits, gens, strict=True):
                scores[i] = parse_score(self.reply(gen.token_ids))
        return [Judgment(FAILURE_SCORE, failed=True) if s is None else Judgment(s) for s in scores]


def judge_engine(cfg, tokenizer: Tokenizer, context: int):
    """rollout.judge.engine's engine for rollout.judge.model_path: torch (the folder in model.dtype,
    on the GPU when there is one), vllm (in this process, sharing the GPU with the learner and the
    policy's engine at rollout.gpu_memory_utilization) or openai (the server at
    rollout.judge.base_url, asked for the model named model_path)."""
    jc = cfg.rollout.judge
    options = {
        "dtype": cfg.model.dtype,
        "seed": cfg.seed,
        "cache_dir": cfg.model.cache_dir,
        "max_model_len": context,
        "max_batch_size": cfg.rollout.max_batch_size,
        "base_url": jc.base_url,
        "served_model": jc.model_path,
        "gpu_memory_utilization": cfg.rollout.gpu_memory_utilization,
    }
    model = None
    if jc.engine == "torch":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = (
            load_model(jc.model_path, dtype=getattr(torch, cfg.model.dtype))
            .eval()
            .requires_grad_(False)
            .to(device)
        )
    return make_engine(
        jc.engine, jc.model_path, pad_id=pad_token_id(tokenizer), model=model, **options
    )
