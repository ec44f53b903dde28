"""Nothing silent: every knob of config.py's Config tree does something, or start-up refuses it, or
it is listed here as inert, with the reason.

KNOBS names every leaf of the tree (test_the_table_names_every_leaf keeps it so: a new knob must be
added here). Each entry sets its knob to a legal non-default value on a tiny two-step run, on top of
`context` (the overrides that make the knob apply: learner.loss.gspo_clip_low needs
learner.policy_loss=gspo, and a second pass over the batch for the ratio to leave 1), and compares
the run with the run of the context alone (its baseline; every configuration runs once per session).
Observed: the metrics of metrics.jsonl (wall-clock ones by presence only), the weights (every
*.safetensors of final/), the held-out episode dumps, the files written, and with model.path=default
the default model built (its weights and sft_log.json). A number or a weight that moved by float
rounding only (RTOL, ATOL) counts as unchanged. The expectations:
  changes  something observable differs beyond rounding (`stops`: the run stops with an error, the
           knob's effect);
  refused  load_config, runs.check_paths or train.main raises ValueError/KeyError/TypeError naming
           the key, before the run logs a step;
  inert    nothing observable can change in this setting (a logging destination, a GPU-only knob
           on a CPU, a Ray knob with Ray off, a speed knob); `why` says so, and the run differs
           from the baseline by rounding at most.
bench/knobs.py runs the same walk and records what each knob was seen to do in bench/knobs.json;
docs/knobs.md is generated from the config tree's source, this table and those records
(bench/knobs.py --page), and test_the_page_is_generated checks it is, with a row for every leaf.

The base run (BASE): tests/test_train.py's TINY, smaller still (FAST: 4 episodes a step), two steps,
evals at steps 0 and 2. The policy is TINY's default model, built once and passed as model.path (a
rollout knob would otherwise rebuild it: its cache key holds the envs, the agent and the sampling
settings); sft.* knobs build their own, cheaply (SFT). The tiny model solves almost nothing, so
every toy-math reward would be 0, every advantage 0, and the knobs of the update would have nothing
to act on: the base adds DAPO's overlong penalty over the whole length range (SIGNAL), which makes
the rewards within a group differ by the episodes' lengths.
"""

import dataclasses
import difflib
import glob
import hashlib
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# tiny: the session's default model, built once
from test_train import TINY, tiny  # noqa: E402,F401
from conftest import environ_restored  # noqa: E402

import config  # noqa: E402

# -----------------------------------------------------------------------------
# the table

CHANGES, REFUSED, INERT = "changes", "refused", "inert"


@dataclass(frozen=True)
class Knob:
    # the value tried, as on the command line (YAML); <model>: the tiny default model's folder,
    # <run>: this run's own folder
    value: str
    # overrides the knob needs to apply; the baseline is the run with these alone
    context: tuple = ()
    expect: str = CHANGES  # changes | refused | inert
    why: str = ""  # inert: why nothing observable can change here; else an optional note
    stops: bool = False  # changes: the change is that the run stops, mid-way, with an error
    # changes only where the CPU has bf16 (CPU_BF16); start-up refuses it elsewhere (`expected`)
    bf16_cpu: bool = False


# learner.precision=bf16
CPU_BF16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()

# contexts shared by several knobs (one baseline each)
# a second pass over the batch: the ratio leaves 1, so clips can bind
EPOCHS = ("learner.ppo_epochs=2",)
# samples from the previous weights: importance weights leave 1
ASYNC = ("rollout.async_rollouts=true",)
TIS, MIS = ("learner.off_policy.kind=tis",), ("learner.off_policy.kind=mis",)
# a critic that moves fast, and a second pass over the batch where a value clip could bind
PPO = ("algo.name=ppo", *EPOCHS, "algo.critic_lr=1e-2")
LORA = ("learner.lora_rank=2",)
# the engine holds merged bf16 weights: its log-probs and the learner's differ by ~3e-3, so the
# weight-sync gate has a gap to measure
BF16_LORA = ("model.dtype=bfloat16", *LORA)
RAY = ("ray.rollout_workers=1",)  # a local Ray, started and stopped by the run
KL = ("learner.kl_coef=0.1",)
TURN = ("algo.credit=turn",)
# the customer's same reply to any chat: states some episodes share
TURN_STATES = (
    *TURN,
    "envs.0.name=tau_lite",
    "rollout.agent.n_samples=4",
    "rollout.agent.max_turns=3",
)
SFT_TINY = (
    "model.path=default",
    "rollout.agent.n_samples=4",
    "rollout.agent.max_turns=4",
    "rollout.max_tokens=40",
    # TINY's own default model (its cache key): its SFT evals solve a few
    "envs.0.eval_size=8",
)
SFT = (
    "model.path=default",
    "sft.num_demos=64",
    "sft.max_steps=4",
    "sft.eval_every=2",
    "sft.eval_size=2",
    "sft.batch_size=8",
)  # the default model built in this run (cheaply), not TINY's prebuilt one
TWO_ENVS = ("envs=[{name: toy_math, eval_size: 2}, {name: text_math, eval_size: 2}]",)


def loss(kind):
    return (f"learner.policy_loss={kind}", *EPOCHS)


RAY_OFF = "Ray is off (ray.rollout_workers=0, ray.learner_workers=0): nothing reads it"
LEARNER_ACTORS = (
    "a resource of the learner actors, which ray.learner_workers starts from train.py's command "
    "line only (cluster.launch_on_ray): no actors here; tests/test_launch.py runs them"
)
JUDGE_OFF = (
    "a setting of the LLM judge, refused while rollout.judge.model_path is unset (the base run has "
    "no judge); tests/test_judge.py checks each with a judge on (scripted engines, the config's "
    "checks, the tiny model as the judge through the torch engine)"
)
PERF = (
    "speed or memory only (seen in perf/*, which is wall-clock): the numbers agree to float "
    "rounding"
)

KNOBS: dict[str, Knob] = {
    # --- the run
    "seed": Knob("1"),
    "run_name": Knob("renamed"),
    "out_dir": Knob("<run>/elsewhere"),
    "steps": Knob("3"),
    "eval_every": Knob("1"),
    "eval_temperature": Knob("0.5"),
    "eval_seed": Knob("7"),
    "eval.n_samples": Knob("2"),
    "eval.pass_k": Knob("[1, 2]", ("eval.n_samples=2",)),
    "checkpoint_every": Knob("1"),
    "keep_checkpoints": Knob("1", ("checkpoint_every=1",)),
    "resume": Knob("<run>/no_such_checkpoint", expect=REFUSED),
    "log_timings": Knob("false"),
    "wandb": Knob("true"),
    "wandb_project": Knob(
        "other",
        ("wandb=true",),
        INERT,
        "a logging destination: the project a wandb server files the run under (offline here)",
    ),
    "threads": Knob("1", (), INERT, "torch's CPU threads: " + PERF.replace(" or memory", "")),
    "peak_flops": Knob(
        "1e12",
        (),
        INERT,
        "the denominator of perf/mfu alone, a wall-clock metric (compared by presence only)",
    ),
    # --- model
    "model.path": Knob("<run>/no_such_model", expect=REFUSED),
    "model.dtype": Knob("bfloat16"),
    "model.cache_dir": Knob("<run>/cache", SFT),
    "model.quantize": Knob(
        "nf4",
        LORA,
        why="the base in 4 bits: other logits, samples and adapters; without LoRA "
        "it is refused (tests/test_qlora.py)",
    ),
    # --- envs (the first env of the list)
    "envs.0.name": Knob("text_math"),
    "envs.0.weight": Knob("3.0", TWO_ENVS),
    "envs.0.eval_size": Knob("3"),
    "envs.0.kwargs": Knob("{max_operand: 10}"),
    # --- rollout
    "rollout.engine": Knob(
        "openai",
        ("rollout.base_url=http://127.0.0.1:9/v1",),
        stops=True,
        why="no server in this walk: the run stops at its first request; tests/"
        "test_openai_training.py trains through serve.py and `vllm serve`, and tests/"
        "test_vllm_engine.py runs vllm (slow to start)",
    ),
    "rollout.base_url": Knob(
        "http://elsewhere:8000/v1",
        (),
        INERT,
        "the openai engine's alone, and this walk runs "
        "the torch engine; tests/test_openai_training.py trains through a server",
    ),
    "rollout.served_model": Knob(
        "other",
        (),
        INERT,
        "the openai engine's alone, and this walk runs the torch engine; "
        "tests/test_openai_training.py trains through a server",
    ),
    "rollout.api_key_env": Knob(
        "NANO_SKYRL_SERVE_TOKEN",
        expect=REFUSED,
        why="the openai engine's alone (refused "
        "with torch); tests/test_openai_training.py pushes with it",
    ),
    "rollout.weights_dir": Knob(
        "<run>/pushed",
        expect=REFUSED,
        why="the openai engine's alone (refused with torch); "
        "tests/test_openai_training.py trains through `vllm serve` with it",
    ),
    "rollout.prompts_per_step": Knob("3"),
    "rollout.temperature": Knob("0.7"),
    "rollout.top_p": Knob("0.9"),
    "rollout.top_k": Knob("5"),
    "rollout.max_tokens": Knob("8"),
    "rollout.max_batch_size": Knob(
        "1",
        why="the engine's one generator is drawn batch by batch, so the "
        "samples depend on it (rollout.TorchEngine says so)",
    ),
    "rollout.prefill_chunk_tokens": Knob(
        "8",
        (),
        INERT,
        "a memory knob: later chunks attend to the cached keys (wings/long_context.py), the "
        "same attention up to float rounding",
    ),
    "rollout.prefix_cache_tokens": Knob("4096"),
    "rollout.decode": Knob(
        "fast",
        why="wings/fast_decode.py draws each token by the inverse CDF from one uniform "
        "per row: other random numbers from the same law, so other samples",
    ),
    "rollout.gpu_memory_utilization": Knob(
        "0.3", (), INERT, "the vllm engine's share of a GPU: no GPU, no vllm here"
    ),
    "rollout.sync_check_samples": Knob("0"),
    "rollout.sync_check_tokens": Knob("1", BF16_LORA),
    "rollout.sync_max_logprob_diff": Knob("1e-4", BF16_LORA, stops=True),
    "rollout.judge_weight": Knob(
        "1.0",
        ("envs.0.name=tau_lite", "envs.0.kwargs={judge: rules}"),
        INERT,
        "adds a judge's score to finished episodes of envs with a judge (tau_lite); the tiny "
        "model never finishes a tau_lite episode, and toy_math has no judge (there the knob "
        "is ignored, not refused); tests/test_env_tau.py plays judged episodes",
    ),
    "rollout.judge.model_path": Knob(
        "<model>",
        ("rollout.judge_weight=1.0",),
        why="the tiny model as an LLM judge "
        "(judge.py): its verdicts are logged (rollout/judge_score, judge_failures) and "
        "added to the rewards",
    ),
    "rollout.judge.engine": Knob("openai", expect=REFUSED, why=JUDGE_OFF),
    "rollout.judge.base_url": Knob("http://elsewhere:8001/v1", expect=REFUSED, why=JUDGE_OFF),
    "rollout.judge.chat_format": Knob("llama3", expect=REFUSED, why=JUDGE_OFF),
    "rollout.judge.temperature": Knob("0.7", expect=REFUSED, why=JUDGE_OFF),
    "rollout.judge.max_tokens": Knob("16", expect=REFUSED, why=JUDGE_OFF),
    "rollout.judge.rubric": Knob("'{conversation}'", expect=REFUSED, why=JUDGE_OFF),
    "rollout.async_rollouts": Knob("true", TIS),
    "rollout.max_staleness": Knob("2", (*ASYNC, *TIS, "steps=3")),
    "rollout.partial_rollouts": Knob(
        "true",
        expect=REFUSED,
        why="refused without async rollouts; with them its "
        "effect depends on timing (tests/test_async_rollouts.py)",
    ),
    "rollout.partial_replay": Knob(
        "<run>/partial_swaps.jsonl",
        expect=REFUSED,
        why="refused without partial "
        "rollouts; with them it replays a record bit for bit (tests/test_async_rollouts.py, "
        "tests/test_kill_resume.py)",
    ),
    "rollout.external_agent": Knob(
        "examples/calc_agent.py:run",
        why="the example agent plays the episodes through "
        "serve.Server, each call seeded by its session: other samples (needs openai; "
        "tests/test_external_agent.py)",
    ),
    "rollout.agent.n_samples": Knob("3"),
    "rollout.agent.max_turns": Knob("1"),
    "rollout.agent.max_total_tokens": Knob("150", ("algo.overlong_cache=100",)),
    "rollout.agent.max_episode_tokens": Knob("6"),
    "rollout.agent.chat_format": Knob(
        "qwen3",
        (),
        INERT,
        "toy math's conversations (a system prompt, tools, no "
        "reasoning) render byte for byte alike in qwen2.5 and qwen3, and the agent loop "
        "appends tokens, never re-renders; the formats differ without a system prompt, "
        "with reasoning blocks or enable_thinking (tests/test_agent.py checks both "
        "against the checkpoints' jinja templates)",
    ),
    "rollout.agent.enable_thinking": Knob("false", ("rollout.agent.chat_format=qwen3",)),
    "rollout.agent.memory": Knob(
        "window",
        (),
        CHANGES,
        "toy math's episodes fit the default memory_turns whole, "
        "so they train as full's; the segments are counted (rollout/segments)",
    ),
    "rollout.agent.memory_turns": Knob(
        "0",
        ("rollout.agent.memory=window",),
        why="a turn's prompt keeps no earlier "
        "turn: toy math's second turn loses its first (FAST's episodes have two turns "
        "at most, so a window of 1 would keep all of it)",
    ),
    "rollout.agent.summary_every": Knob("1", ("rollout.agent.memory=summary",)),
    "rollout.agent.summary_tokens": Knob(
        "8", ("rollout.agent.memory=summary", "rollout.agent.summary_every=1")
    ),
    "rollout.agent.summary_gradient": Knob(
        "false",
        ("rollout.agent.memory=summary", "rollout.agent.summary_every=1"),
        why="the summaries are recorded as not sampled: they leave the rows and the update",
    ),
    # --- algo
    "algo.name": Knob("rloo"),
    "algo.advantage": Knob("rloo"),
    "algo.credit": Knob("turn"),
    "algo.turn_gamma": Knob("0.5", TURN),
    "algo.turn_baseline": Knob("state", TURN_STATES),
    "algo.teacher_path": Knob("<run>/no_such_teacher", expect=REFUSED),
    "algo.distill_coef": Knob("2.0", ("algo.teacher_path=<model>",)),
    "algo.skip_uniform_batches": Knob(
        "true",
        ("rollout.max_tokens=1",),
        why="one-token turns: every episode of a group is its prompt, one token and the forced "
        "end, reward 0 and the same length, so every advantage is 0 and the knob decides "
        "whether the batch still updates (a batch is skipped only when every advantage is 0; "
        "the base's overlong penalty gives its batches a signal)",
    ),
    "algo.dynamic_sampling": Knob("true"),
    "algo.max_refill_rounds": Knob("1", ("algo.dynamic_sampling=true",)),
    "algo.overlong_cache": Knob("300"),
    "algo.truncation": Knob("mask"),
    "algo.truncation_penalty": Knob(
        "0.5",
        ("algo.truncation=penalize", *PPO),
        why="every base episode is cut, so a "
        "group baseline cancels a flat penalty; a critic's does not",
    ),
    "algo.kl_in_reward": Knob("true", KL),
    "algo.gamma": Knob("0.5", PPO),
    "algo.lam": Knob("0.5", PPO),
    "algo.critic_lr": Knob("1e-3", PPO),
    "algo.value_clip": Knob("0.001", PPO),
    # --- learner
    "learner.lr": Knob("1e-4"),
    "learner.warmup_steps": Knob("2"),
    "learner.weight_decay": Knob("0.1"),
    "learner.betas": Knob("[0.5, 0.9]"),
    "learner.grad_clip": Knob("0.001"),
    "learner.micro_batch_size": Knob(
        "1",
        (),
        INERT,
        PERF + " (another summation order); tests/test_learner.py checks the gradient",
    ),
    "learner.max_tokens_per_micro_batch": Knob(
        "64",
        (),
        INERT,
        PERF + " (another summation order); tests/test_learner.py checks the gradient",
    ),
    "learner.shared_prefix": Knob(
        "false",
        (),
        INERT,
        PERF + " (another summation order); tests/test_learner.py checks the gradient",
    ),
    "learner.precision": Knob(
        "bf16", (), CHANGES, "refused on a CPU without avx512_bf16 or AMX", bf16_cpu=True
    ),
    "learner.mini_batches": Knob("2"),
    "learner.ppo_epochs": Knob("2"),
    "learner.temperature": Knob("0.7"),
    "learner.logprob_chunk_size": Knob(
        "16", (), INERT, PERF + " (it bounds the logits block in memory)"
    ),
    "learner.gradient_checkpointing": Knob(
        "true", (), INERT, PERF + " (activations recomputed in backward)"
    ),
    "learner.policy_loss": Knob("gspo", EPOCHS),
    "learner.loss.clip_low": Knob("0.001", EPOCHS),
    "learner.loss.clip_high": Knob("0.001", EPOCHS),
    "learner.loss.dual_clip_c": Knob("1.001", loss("dual_clip")),
    "learner.loss.dapo_clip_high": Knob("0.001", loss("dapo")),
    "learner.loss.gspo_clip_low": Knob("0.1", loss("gspo")),
    "learner.loss.gspo_clip_high": Knob("0.1", loss("gspo")),
    "learner.loss.sapo_tau_pos": Knob("2.0", loss("sapo")),
    "learner.loss.sapo_tau_neg": Knob("2.0", loss("sapo")),
    "learner.loss.cispo_clip_low": Knob("0.001", loss("cispo")),
    "learner.loss.cispo_clip_high": Knob("0.001", loss("cispo")),
    "learner.loss.gmpo_clip_low": Knob("0.001", loss("gmpo")),
    "learner.loss.gmpo_clip_high": Knob("0.001", loss("gmpo")),
    "learner.loss.log_ratio_clamp": Knob("0.001", EPOCHS),
    "learner.loss.agg_mode": Knob("seq-mean-token-mean"),
    "learner.loss.agg_norm": Knob(
        "128", ("learner.loss.agg_mode=seq-mean-token-sum-norm", "learner.loss.agg_norm=64")
    ),
    "learner.kl_coef": Knob("0.1"),
    "learner.kl_kind": Knob("k1", KL),
    "learner.entropy_coef": Knob("0.01"),
    "learner.off_policy.kind": Knob("tis", BF16_LORA),
    "learner.off_policy.level": Knob("sequence", (*ASYNC, *TIS)),
    "learner.off_policy.tis_cap": Knob("1.0", (*ASYNC, *TIS)),
    "learner.off_policy.mis_low": Knob("0.999", (*ASYNC, *MIS)),
    "learner.off_policy.mis_high": Knob("1.001", (*ASYNC, *MIS)),
    "learner.mixed_precision": Knob(
        "false",
        (),
        INERT,
        "read only under torchrun on GPUs (FSDP2's mixed precision); "
        "ignored on a CPU and in one process",
    ),
    "learner.lora_rank": Knob("2"),
    "learner.lora_alpha": Knob("32", LORA),
    "learner.lora_dropout": Knob("0.1", LORA),
    "learner.lora_targets": Knob("[q_proj, v_proj]", LORA),
    # --- sft: the default model, built in the run (model.path=default)
    "sft.max_steps": Knob("2", SFT),
    "sft.batch_size": Knob("4", SFT),
    "sft.lr": Knob("3e-3", SFT),
    "sft.tool_use_prob": Knob("1.0", SFT),
    "sft.eval_every": Knob("4", SFT),
    "sft.eval_size": Knob("3", SFT_TINY),
    "sft.target_accuracy": Knob("0.0", SFT),
    "sft.num_demos": Knob("32", SFT),
    "sft.vocab_size": Knob("500", SFT),
    "sft.hidden_size": Knob("16", SFT),
    "sft.num_layers": Knob("1", SFT),
    "sft.num_heads": Knob("4", SFT),
    "sft.num_kv_heads": Knob("2", SFT),
    "sft.intermediate_size": Knob("32", SFT),
    "sft.seed": Knob("5", SFT),
    "sft.short_context_steps": Knob("2", SFT),
    "sft.short_context_tokens": Knob("8", (*SFT, "sft.short_context_steps=2")),
    # --- ray
    "ray.address": Knob(
        "127.0.0.1:6379", (), INERT, RAY_OFF + "; tests/test_launch.py joins a cluster by it"
    ),
    "ray.placement_strategy": Knob(
        "SPREAD", (), INERT, RAY_OFF + "; on one node every strategy places alike"
    ),
    "ray.learner_workers": Knob(
        "2",
        (),
        INERT,
        "read by train.py's command line (cluster.launch_on_ray), not by "
        "main(cfg), which the walk calls; tests/test_launch.py runs it",
    ),
    "ray.cpus_per_learner": Knob("2.0", (), INERT, LEARNER_ACTORS),
    "ray.gpus_per_learner": Knob("1.0", (), INERT, LEARNER_ACTORS),
    "ray.rollout_workers": Knob(
        "1",
        why="a local Ray, started by the run and stopped at its end; the workers seed "
        "their episodes per chunk of groups, so the episodes differ too",
    ),
    "ray.env_workers": Knob("1", expect=REFUSED),
    "ray.dispatcher": Knob("async_batch_bounded", RAY),
    "ray.chunk_groups": Knob("2", RAY),
    "ray.max_in_flight": Knob("2", (*RAY, "ray.dispatcher=async_batch_bounded")),
    "ray.cpus_per_worker": Knob(
        "0.5", (), INERT, RAY_OFF + "; tests/test_ray.py runs rollout workers with it"
    ),
    "ray.gpus_per_worker": Knob(
        "1.0", (), INERT, RAY_OFF + "; a GPU per rollout worker, and there is no GPU"
    ),
    "ray.cpus_per_env_worker": Knob(
        "0.5", (), INERT, RAY_OFF + " (env workers serve Ray rollout workers)"
    ),
}


def leaves(cls=config.Config, prefix: str = "") -> list[str]:
    """The dotted keys of every leaf of the config tree: a field whose default is a dataclass is a
    subtree; `envs`, a list of EnvSpec, has the first entry's fields as its leaves."""
    keys = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            keys += leaves(type(default), f"{prefix}{f.name}.")
        elif f.name == "envs":
            keys += [f"{prefix}envs.0.{g.name}" for g in dataclasses.fields(config.EnvSpec)]
        else:
            keys.append(prefix + f.name)
    return keys


# -----------------------------------------------------------------------------
# the walk

FAST = [
    "rollout.prompts_per_step=2",
    "rollout.agent.n_samples=2",
    "rollout.max_tokens=16",
    "rollout.agent.max_turns=2",
    "envs.0.eval_size=2",
]  # TINY's run, smaller: 4 episodes a step, 2 held-out tasks
SIGNAL = ["algo.overlong_cache=700"]  # rewards differ within a group (see the file docstring)
BASE = [*TINY, *FAST, *SIGNAL, "steps=2", "eval_every=100", "checkpoint_every=0"]
# float rounding: a number that moved less is "the same up to rounding", not a change
RTOL, ATOL = 1e-4, 1e-5


def is_timing(metric: str) -> bool:
    """Metrics whose values are wall-clock (compared by presence only)."""
    return (
        metric.startswith("perf/")
        or "seconds" in metric
        or metric.endswith("_per_s")
        or metric == "dispatch/idle_fraction"
    )


@dataclass
class Outcome:
    kind: str  # changes | refused | rounding (only float rounding moved) | same | error (mid-run)
    seen: list  # changes / rounding: what moved; refused / error: the message


def compare(x, y) -> str:
    """ "same", "rounding" (numbers, or tensors, within RTOL/ATOL) or "differs"."""
    if isinstance(x, dict) and isinstance(y, dict):  # a file's tensors
        if x.keys() != y.keys() or any(
            x[k].shape != y[k].shape or x[k].dtype != y[k].dtype for k in x
        ):
            return "differs"
        if all(torch.equal(x[k], y[k]) for k in x):
            return "same"
        close = all(torch.allclose(x[k].float(), y[k].float(), rtol=RTOL, atol=ATOL) for k in x)
        return "rounding" if close else "differs"
    if x == y:
        return "same"
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (x, y))
    return "rounding" if numbers and abs(x - y) <= ATOL + RTOL * abs(y) else "differs"


def text(path: str) -> str:
    with open(path) as f:
        return f.read()


def observe(sandbox: str, run_dir: str, model_dir: str | None) -> dict:
    """What a finished run left: {observable: {name: value}}. Metrics by (name, step); weights as
    tensors, per file; episode dumps as text; the files written under the run's own folder; the
    default model built for the run."""
    from safetensors.torch import load_file

    metrics = {}
    for record in map(json.loads, text(os.path.join(run_dir, "metrics.jsonl")).splitlines()):
        for k, v in record.items():
            if k != "step":
                metrics[f"{k}@{record['step']}"] = None if is_timing(k) else v
    files = set()
    for path in glob.glob(os.path.join(sandbox, "**"), recursive=True):
        if os.path.isfile(path):
            # wandb names its files by time and a random
            parts = os.path.relpath(path, sandbox).split(os.sep)
            # id: its folder
            files.add("/".join(parts[: parts.index("wandb") + 1] if "wandb" in parts else parts))
    final = os.path.join(run_dir, "final")
    weights = {
        os.path.relpath(p, final): load_file(p)
        for p in glob.glob(os.path.join(final, "**", "*.safetensors"), recursive=True)
    }
    episodes = {
        os.path.basename(p): text(p)
        for p in glob.glob(os.path.join(run_dir, "episodes_step*.jsonl"))
    }
    obs = {
        "metrics": metrics,
        "weights": weights,
        "episodes": episodes,
        "files": dict.fromkeys(files, True),
    }
    if model_dir is not None:
        log = json.loads(text(os.path.join(model_dir, "sft_log.json")))
        log = {**log, "seconds": None, "history": [{**h, "seconds": None} for h in log["history"]]}
        obs["default model"] = {
            "model.safetensors": load_file(os.path.join(model_dir, "model.safetensors")),
            "sft_log.json": json.dumps(log, sort_keys=True),
        }
    return obs


ORDER = ("metrics", "weights", "episodes", "files", "default model")


def differences(a: dict, b: dict) -> tuple[list[str], list[str]]:
    """(what differs, what moved by float rounding only) between two observations, one short line
    per observable: 'metrics: train/pg_loss, ...', 'weights', 'files: +2 (...)'."""
    differ, rounding = [], []
    for what in ORDER:
        x, y = a.get(what, {}), b.get(what, {})
        verdicts = {k: compare(x.get(k, "absent"), y.get(k, "absent")) for k in x.keys() | y.keys()}
        for verdict, out in (("differs", differ), ("rounding", rounding)):
            names = sorted(k for k, v in verdicts.items() if v == verdict)
            if what == "metrics":  # a metric once, whichever steps moved
                names = sorted({n.rsplit("@", 1)[0] for n in names})
            if not names:
                continue
            if what == "files":
                added, gone = [n for n in names if n in y], [n for n in names if n in x]
                out.append(
                    "files:"
                    + "".join(
                        f" {sign}{len(ns)} ({ns[0]}{', ...' if len(ns) > 1 else ''})"
                        for sign, ns in (("+", added), ("-", gone))
                        if ns
                    )
                )
            elif what == "weights" and names == ["model.safetensors"]:
                out.append("weights")
            else:
                out.append(
                    f"{what}: "
                    + ", ".join(names[:4] + ([f"+{len(names) - 4} more"] if len(names) > 4 else []))
                )
    return differ, rounding


class Walk:
    """Runs knobs and their baselines, each configuration once. `model_dir`: TINY's default model
    (the policy of every run but the sft.* ones); `root`: where the runs go, one folder each (its
    out_dir, and its <run>)."""

    def __init__(self, model_dir: str, root: str):
        self.model_dir, self.root = model_dir, root
        self.cache_dir = os.path.dirname(model_dir)
        # the overrides of a run -> ("ran" | "refused" | "error", what)
        self.results: dict[tuple, tuple] = {}

    def cached(self, extra: tuple, name: str) -> tuple:
        """run(name, extra), once per distinct `extra`."""
        if extra not in self.results:
            self.results[extra] = self.run(name, extra)
        return self.results[extra]

    def run(self, name: str, extra: tuple) -> tuple:
        """One run of BASE + `extra`, in-process, in the folder root/name -> ("refused", message) |
        ("error",
        message: it broke after logging a step) | ("ran", observation)."""
        from runs import check_paths
        from sft import model_folder
        from train import main

        sandbox = os.path.join(self.root, name)
        shutil.rmtree(sandbox, ignore_errors=True)
        os.makedirs(sandbox)
        fill = [o.replace("<model>", self.model_dir).replace("<run>", sandbox) for o in extra]
        overrides = [
            *BASE,
            f"model.path={self.model_dir}",
            f"model.cache_dir={self.cache_dir}",
            f"out_dir={sandbox}/runs",
            *fill,
        ]
        try:
            cfg = check_paths(config.load_config("configs/toy_math.yaml", overrides))
        except (ValueError, KeyError, TypeError) as e:
            return "refused", str(e)
        threads = torch.get_num_threads()
        # a run on Ray starts a local cluster, which sets its variables for the process
        with environ_restored():
            # ray.rollout_workers: a local Ray, as tests/test_ray.py
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            try:
                run_dir = main(cfg)["run_dir"]
            except Exception as e:  # before the first record: refused; after it: the run broke
                logged = glob.glob(os.path.join(sandbox, "**", "metrics.jsonl"), recursive=True)
                if isinstance(e, (ValueError, KeyError, TypeError)) and not any(
                    os.path.getsize(p) for p in logged
                ):
                    return "refused", str(e)
                return "error", f"{type(e).__name__}: {e}"
            finally:
                torch.set_num_threads(threads)  # `threads` sets a process-wide count
                ray = sys.modules.get("ray")
                if ray is not None and ray.is_initialized():
                    # a run that failed leaves its local Ray up
                    ray.shutdown()
        return "ran", observe(
            sandbox, run_dir, model_folder(cfg) if cfg.model.path == "default" else None
        )

    def baseline(self, context: tuple):
        kind, what = self.cached(
            tuple(context), "base-" + hashlib.sha1(repr(context).encode()).hexdigest()[:8]
        )
        assert kind == "ran", f"the baseline of context {context} did not run: {what}"
        return what

    def check(self, key: str) -> Outcome:
        """Run knob `key` and compare it with its context's baseline."""
        knob = KNOBS[key]
        kind, what = self.cached((*knob.context, f"{key}={knob.value}"), key)
        if kind != "ran":
            return Outcome(kind, [what])
        differ, rounding = differences(self.baseline(knob.context), what)
        if differ:
            return Outcome(CHANGES, differ)
        return Outcome("rounding" if rounding else "same", rounding)


def expected(key: str) -> str:
    """What KNOBS[key] expects on this machine: changes | refused | inert."""
    knob = KNOBS[key]
    return REFUSED if knob.bf16_cpu and not CPU_BF16 else knob.expect


def problem(key: str, outcome: Outcome) -> str | None:
    """Why `outcome` is not what KNOBS[key] expects, or None when it is."""
    knob = dataclasses.replace(KNOBS[key], expect=expected(key))
    said = f"{outcome.kind}: {'; '.join(outcome.seen) or 'nothing moved'}"
    if knob.expect == REFUSED and outcome.kind != REFUSED:
        return f"expected a refusal at start-up, got {said}"
    if knob.expect == REFUSED and key not in outcome.seen[0]:
        return f"the refusal does not name {key}: {outcome.seen[0]}"
    if knob.expect == INERT and outcome.kind not in ("same", "rounding"):
        return f"listed as inert, but {said}"
    if (
        knob.expect == CHANGES
        and knob.stops
        and (outcome.kind != "error" or key not in outcome.seen[0])
    ):
        return f"expected the run to stop, saying {key}, got {said}"
    if knob.expect == CHANGES and not knob.stops and outcome.kind != CHANGES:
        return f"nothing observable changed ({said}) with context {list(knob.context)}"
    return None


# -----------------------------------------------------------------------------
# the tests


def test_the_table_names_every_leaf():
    """A knob added to config.py must be added to KNOBS, with what it is expected to do."""
    walked = leaves()
    assert len(walked) == len(set(walked)) > 100
    assert set(KNOBS) == set(walked), (
        f"missing from KNOBS: {sorted(set(walked) - set(KNOBS))}; "
        f"not a config leaf: {sorted(set(KNOBS) - set(walked))}"
    )


def generator():
    """bench/knobs.py, the page's generator (it imports this file for KNOBS and the walk)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
    import knobs

    return knobs


def test_the_page_is_generated():
    """docs/knobs.md is bench/knobs.py --page's output, with a row for every leaf of the tree: a
    knob added to config.py has its row (not walked until the walk runs), and a comment edited in
    the source shows on the page once it is regenerated."""
    knobs = generator()
    with open(knobs.PAGE) as f:
        committed = f.read()
    generated = knobs.page()
    diff = difflib.unified_diff(
        committed.splitlines(), generated.splitlines(), "docs/knobs.md", "generated", lineterm=""
    )
    if committed != generated:
        pytest.fail(
            f"docs/knobs.md is not the generator's output: run {knobs.COMMAND}\n"
            + "\n".join(list(diff)[:20])
        )
    rows = re.findall(r"^\| `([^`]+)` \|", committed, re.MULTILINE)
    assert rows == leaves()


def test_a_fields_comment_is_read_from_the_margin_or_the_lines_above(tmp_path, monkeypatch):
    """The page's "what it is": the comment lines directly above a field (not a `# ---` banner,
    not past a blank line) then its margin comment, whichever the formatter left."""
    import importlib.util

    knobs = generator()
    (tmp_path / "fields.py").write_text(
        "from dataclasses import dataclass\n\n\n@dataclass\nclass C:\n"
        '    """Doc."""\n\n'
        "    a: int = 1  # in the margin\n"
        "    # --- a banner, no field's\n"
        "    # above, line one\n"
        "    # and line two\n"
        "    b: str = '#not a comment'\n\n"
        "    # cut off by the blank line\n\n"
        "    c: tuple = (\n        1,\n    )  # on the last line\n"
        "    # above\n"
        "    d: float | None = None  # and beside\n"
        "    e: int = 0\n"
    )
    spec = importlib.util.spec_from_file_location("fields", tmp_path / "fields.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "fields", module)  # where field_notes finds the file
    spec.loader.exec_module(module)
    assert knobs.field_notes(module.C) == {
        "a": ("int", "in the margin"),
        "b": ("str", "above, line one and line two"),
        "c": ("tuple", "on the last line"),
        "d": ("float | None", "above and beside"),
        "e": ("int", ""),
    }


def test_every_inert_knob_says_why_and_every_value_is_new_and_legal():
    for key, knob in KNOBS.items():
        assert knob.expect in (CHANGES, REFUSED, INERT), key
        assert knob.expect != INERT or knob.why.strip(), f"{key} is inert: say why"
        assert not knob.stops or knob.expect == CHANGES, key
        if knob.expect != REFUSED:  # the config loads, and the knob moved (paths are checked later)
            fill = [
                o.replace("<model>", "m").replace("<run>", "r")
                for o in (*knob.context, f"{key}={knob.value}")
            ]
            cfg = config.load_config("configs/toy_math.yaml", [*BASE, *fill])
            assert cfg != config.load_config("configs/toy_math.yaml", [*BASE, *fill[:-1]]), (
                f"{key}={knob.value} is the value it already has"
            )


@pytest.fixture(scope="session")
def walk(tiny, tmp_path_factory):
    from sft import build_default_model

    return Walk(build_default_model(tiny()), str(tmp_path_factory.mktemp("knobs")))


@pytest.mark.slow
def test_the_base_run_repeats_bit_for_bit(walk):
    """A second run of the base config observes exactly what the first did: what the walk sees is
    the knob's."""
    kind, again = walk.run("base-again", ())
    assert kind == "ran", again
    assert differences(walk.baseline(()), again) == ([], [])


@pytest.mark.slow
@pytest.mark.parametrize("key", list(KNOBS))
def test_knob(walk, key):
    why = problem(key, walk.check(key))
    assert why is None, f"{key}={KNOBS[key].value}: {why}"
