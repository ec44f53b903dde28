"""config.py: the one config tree of a run, filled from YAML files and `key.sub=value` overrides.

Every knob of a run is a field of the dataclass tree below, with a comment saying what it does. A
YAML file in configs/ holds only what differs from these defaults; the command line can override
any leaf:

    python train.py --config configs/toy_math.yaml rollout.temperature=0.8 learner.lr=3e-5

Values are type-checked against the field's type; an unknown key is an error that names the closest
valid key (a typo must never silently train with the default). A wing's settings are checked by the
wing (WING_CHECKS). The files a config names are checked by the entry points (runs.check_paths); bad
input ends as one line, `config error: ...`, and exit status 2 (config_exit), before anything is
built. The resolved config is saved with the run.
Imports: agent.py and learner.py (the dataclasses it assembles), algos.py and chat.py (the
catalogues it checks names in).
"""

import dataclasses
import difflib
import importlib
import sys
import types
import typing
from dataclasses import dataclass, field, replace

import yaml

import algos
from agent import AgentConfig
from chat import CHAT_FORMATS
from learner import LearnerConfig


@dataclass
class ModelSpec:
    """Where the policy comes from (model.ModelConfig is its architecture, read from the
    folder's config.json)."""

    # a Hugging Face folder (config.json, tokenizer.json, *.safetensors), or "default": the embedded
    # tiny model, built on first use and cached
    path: str = "default"
    # parameter dtype of the learner and the torch engine: float32 | bfloat16 | float16
    dtype: str = "float32"
    cache_dir: str = ".cache"  # where the embedded default model is built and cached
    # the frozen base of a LoRA run: "none" (model.dtype) or "nf4" (4-bit NormalFloat, QLoRA:
    # wings/qlora.py; needs learner.lora_rank > 0)
    quantize: str = "none"


@dataclass
class EnvSpec:
    name: str = "toy_math"  # an env registered in env.py (env.make_env)
    weight: float = 1.0  # share of each training batch's prompts drawn from this env
    # held-out tasks evaluated for this env (its own eval/<name>/... metrics)
    eval_size: int = 256
    # passed to env.make_env(name, **kwargs) (difficulty knobs)
    kwargs: dict = field(default_factory=dict)


@dataclass
class JudgeConfig:
    """An LLM judge of finished training episodes (wings/judge.py, docs/judge.md), on when
    model_path is set: its score in [0, 1] is added times rollout.judge_weight, in place of the
    envs' own judges. Training only."""

    # the judge's Hugging Face folder (its tokenizer renders the rubric; the openai engine asks its
    # server for a model of this name). "": no LLM judge
    model_path: str = ""
    # torch | vllm (in this process) | openai (the server at base_url)
    engine: str = "torch"
    base_url: str = "http://localhost:8001/v1"  # engine=openai: the judge's server, ending in /v1
    # the judge's chat format (chat.CHAT_FORMATS), its own, not the policy's
    chat_format: str = "qwen2.5"
    temperature: float = 0.0  # the judge's sampling temperature (0: greedy)
    # the judge's reply, in tokens at most (cut before its score: a failure)
    max_tokens: int = 256
    # the judge's prompt, a template of judge.RUBRIC_FIELDS ("": judge.RUBRIC)
    rubric: str = ""


@dataclass
class RolloutConfig:
    # torch (rollout.TorchEngine) | vllm (wings/engine_vllm.py, in this process) | openai
    # (wings/engine_openai.py, a server: evaluates any, trains through wings/serve.py or a `vllm
    # serve` that reloads weights_dir; docs/engines.md)
    engine: str = "torch"
    # openai engine: the server (e.g. `vllm serve`), ending in /v1
    base_url: str = "http://localhost:8000/v1"
    # openai engine: the model name the server knows (default: model.path)
    served_model: str = ""
    # openai engine: the environment variable holding the server's token ("": none)
    api_key_env: str = ""
    # openai engine through `vllm serve`: each push is written here and the server reloads it. "":
    # pushes go to the server's POST /v1/weights (wings/serve.py)
    weights_dir: str = ""
    # tasks per RL step; each is sampled agent.n_samples times (the group)
    prompts_per_step: int = 16
    # sampling temperature (the learner scores at the same temperature)
    temperature: float = 1.0
    top_p: float = 1.0  # nucleus sampling mass, in (0, 1] (1: off)
    # sample among the top_k most likely tokens only (0: off); applied before top_p
    top_k: int = 0
    max_tokens: int = 96  # new tokens per assistant turn at most
    max_batch_size: int = 256  # sequences the engine decodes at once
    # torch engine: prompts run through the model this many tokens at a time, so a long prompt's
    # prefill takes memory linear in its length (wings/long_context.py)
    prefill_chunk_tokens: int = 2048
    # torch engine: keep the keys/values of up to this many positions between calls, so a turn
    # prefills only its new tokens (wings/prefix_cache.py); 0: off
    prefix_cache_tokens: int = 0
    # torch engine's decode step: plain (model.py) | fast (wings/fast_decode.py: a group's prompt
    # read once; floats and draws move: off) | compiled (fast, compiled)
    decode: str = "plain"
    # vllm engine on a GPU: its share of GPU memory; the learner needs the rest
    gpu_memory_utilization: float = 0.5
    # the weight-sync gate after every push (rollout.py): the engine continues this many
    # trajectories (one per group, longest first), the learner scores them (0: off)
    sync_check_samples: int = 4
    # the weight-sync gate: tokens each of those trajectories is continued by
    sync_check_tokens: int = 8
    # the weight-sync gate: the run stops past this log-prob gap (None: default_sync_threshold)
    sync_max_logprob_diff: float | None = None
    # training only: + judge_weight * a judge's score (the env's, or rollout.judge's)
    judge_weight: float = 0.0
    judge: JudgeConfig = field(default_factory=JudgeConfig)  # an LLM judge, off (wings/judge.py)
    # sample later batches while the learner trains (wings/async_rollouts.py); needs
    # learner.off_policy (tis or mis)
    async_rollouts: bool = False
    # async_rollouts: the engine runs up to this many updates ahead of the learner
    max_staleness: int = 1
    # async_rollouts, in-process torch engine: pushes land mid-generation, at the next token
    # boundary, recorded in the run's partial_swaps.jsonl
    partial_rollouts: bool = False
    # partial_rollouts: land each push where this record (or run folder) says, not by the clock: the
    # recorded run again, bit for bit. "": by the clock
    partial_replay: str = ""
    # "path/to/agent.py:function": your own OpenAI-client agent plays the episodes
    # (wings/external_agent.py, docs/external_agent.md). "": our agent loop
    external_agent: str = ""
    # turns, token budget, chat format, group size
    agent: AgentConfig = field(default_factory=AgentConfig)


@dataclass
class AlgoConfig:
    # a preset of ALGO_PRESETS below: it sets the defaults of the knobs it names
    name: str = "grpo"
    # grpo|drgrpo|rloo (algos.group_advantages) | reinforce_pp|reinforce_pp_baseline
    # (algos.reinforce_pp_advantages) | gae (a critic) | none (distillation alone)
    advantage: str = "grpo"
    # episode: every sampled token gets its episode's advantage | turn: each turn's tokens get its
    # return minus a leave-one-out baseline (algos.turn_advantages)
    credit: str = "episode"
    turn_gamma: float = 1.0  # credit=turn: discount across turns
    # credit=turn: position (the group's turns at the same index) | state (their turns from the same
    # state, GiGPO's anchor states)
    turn_baseline: str = "position"
    # on-policy distillation: a folder with the policy's tokenizer; each sampled token gains
    # distill_coef * (log pi_teacher - log pi) (algos.distillation_advantages)
    teacher_path: str = ""
    distill_coef: float = 1.0  # weight of that teacher term against the task advantage
    # no update when every advantage is 0 (with a group baseline: no group whose rewards, after
    # reward shaping, differ)
    skip_uniform_batches: bool = True
    # DAPO: drop groups whose rewards are all equal, sample more prompts to refill
    dynamic_sampling: bool = False
    # extra rollout rounds at most per step when dynamic_sampling is on
    max_refill_rounds: int = 3
    # DAPO's soft overlong punishment ramp, in tokens (algos.overlong_penalty; 0: off)
    overlong_cache: int = 0
    # an episode cut by a length limit trains: keep (as sampled) | mask (no loss) | penalize (reward
    # less truncation_penalty) (algos.truncation_treatment)
    truncation: str = "keep"
    # truncation=penalize: subtracted from a cut episode's reward
    truncation_penalty: float = 1.0
    # learner.kl_coef * KL(policy || ref) from the reward instead of in the loss
    kl_in_reward: bool = False
    gamma: float = 1.0  # discount over tokens: GAE (ppo) and REINFORCE++'s returns
    lam: float = 1.0  # GAE lambda (ppo)
    critic_lr: float = 1e-4  # critic AdamW learning rate (ppo)
    # clip of the value update around the old values (ppo; algos.value_loss)
    value_clip: float = 0.2


# What each algorithm changes from the defaults (dotted keys, applied before YAML and overrides).
ALGO_PRESETS: dict[str, dict] = {
    "grpo": {},  # DeepSeekMath, 2402.03300
    # Dr.GRPO, 2503.20783: no std, no length norm
    "drgrpo": {
        "algo.advantage": "drgrpo",
        "learner.loss.agg_mode": "seq-mean-token-sum-norm",
        "learner.loss.agg_norm": 64.0,
    },
    "rloo": {"algo.advantage": "rloo"},  # RLOO, 2402.14740
    # DAPO, 2503.14476
    "dapo": {
        "learner.policy_loss": "dapo",
        "algo.dynamic_sampling": True,
        "algo.overlong_cache": 64,
    },
    # GSPO, 2507.18071
    "gspo": {"learner.policy_loss": "gspo", "learner.loss.agg_mode": "seq-mean-token-mean"},
    "sapo": {"learner.policy_loss": "sapo"},  # SAPO (Qwen), 2511.20347
    "cispo": {"learner.policy_loss": "cispo"},  # CISPO (MiniMax-M1), 2506.13585
    # GMPO, 2507.20673
    "gmpo": {"learner.policy_loss": "gmpo", "learner.loss.agg_mode": "seq-mean-token-mean"},
    "reinforce_pp": {"algo.advantage": "reinforce_pp"},  # REINFORCE++, 2501.03262
    # REINFORCE++-baseline, 2501.03262
    "reinforce_pp_baseline": {"algo.advantage": "reinforce_pp_baseline"},
    # on-policy distillation alone (GKD 2306.13649); set algo.teacher_path
    "distill": {"algo.advantage": "none"},
    "ppo": {"algo.advantage": "gae"},  # PPO with a critic, 1707.06347
}


@dataclass
class SFTConfig:
    """The warm start of the embedded default model (only used when model.path == "default")."""

    max_steps: int = 600  # SFT optimizer steps at most
    # demonstrations per step (rows, under a memory policy: its segments)
    batch_size: int = 64
    lr: float = 1e-3  # AdamW learning rate (constant after a short warmup)
    # share of demonstrations that call python_eval before finish (the rest answer)
    tool_use_prob: float = 0.5
    eval_every: int = 50  # steps between held-out accuracy checks
    # held-out tasks of each accuracy check, sampled at rollout.temperature
    eval_size: int = 64
    # stop once sampled held-out accuracy reaches this (a minority solved)
    target_accuracy: float = 0.25
    num_demos: int = 10000  # distinct training demonstrations
    vocab_size: int = 1024  # byte-level BPE vocabulary at most, special tokens included
    hidden_size: int = 128  # the tiny Qwen2 model's width
    num_layers: int = 4  # its decoder layers
    num_heads: int = 4  # its query heads
    num_kv_heads: int = 2  # its key/value heads
    intermediate_size: int = 352  # its MLP width
    # seed of the tokenizer corpus, the init and the SFT data (None: the run's seed)
    seed: int | None = None
    # the first steps train each row's last short_context_tokens only: attention learns to read
    # the last turn before a long prompt dilutes it (docs/memory.md)
    short_context_steps: int = 0
    # tokens at the end of each row that those first steps train
    short_context_tokens: int = 64


@dataclass
class EvalConfig:
    """Held-out evaluation beyond one episode per task (eval.py). The tasks themselves are set
    by envs[i].eval_size and eval_seed."""

    # episodes per held-out task, each with its own seed (set eval_temperature > 0)
    n_samples: int = 1
    # report eval/<env>/pass@k for each k (eval.pass_at_k)
    pass_k: list[int] = field(default_factory=lambda: [1])


@dataclass
class RayConfig:
    """The `ray:` section (wings/cluster.py, docs/scaling.md): learner ranks as Ray actors,
    and rollout workers."""

    # the cluster to join: "HEAD_IP:6379", or "": $RAY_ADDRESS if set, else a local Ray
    address: str = ""
    # PACK (few nodes) | SPREAD | STRICT_PACK | STRICT_SPREAD
    placement_strategy: str = "PACK"
    # --- the learner's ranks as actors (launch_on_ray)

    # N > 0: N learner actors, one rank each; 0: this process (or torchrun's ranks)
    learner_workers: int = 0
    # CPUs Ray reserves for each learner actor (its torch threads default to this)
    cpus_per_learner: float = 1.0
    # GPUs Ray reserves for each learner actor: 1 on GPU machines (one rank per GPU)
    gpus_per_learner: float = 0.0
    # --- rollout workers and dispatchers (start_ray_rollouts, dispatch); rank 0 alone talks to them

    # RolloutWorker actors (an engine + the agent loop each); 0: this process
    rollout_workers: int = 0
    # EnvWorker actors for CPU-heavy env steps (async_pipeline needs at least 1)
    env_workers: int = 0
    # async_batch | async_batch_bounded | async_pipeline (dispatch)
    dispatcher: str = "async_batch"
    # task groups per unit of work: one worker call, one seed (from its first group)
    chunk_groups: int = 1
    # chunks in flight at most (bounded dispatchers; 0: one or two per worker)
    max_in_flight: int = 0
    cpus_per_worker: float = 1.0  # CPUs in each rollout worker's placement-group bundle
    # GPUs in each rollout worker's bundle (0 on CPU machines, 1: a GPU of its own)
    gpus_per_worker: float = 0.0
    # CPUs of each env worker (no GPU; placed wherever Ray finds room)
    cpus_per_env_worker: float = 1.0


@dataclass
class Config:
    # seeds task sampling, the engine and the learner (all derived per step)
    seed: int = 0
    run_name: str = "toy_math"  # the run folder is out_dir/run_name
    out_dir: str = "runs"  # where run folders go
    steps: int = 40  # RL steps
    # held-out eval every k steps (and always at step 0 and at the end)
    eval_every: int = 10
    eval_temperature: float = 0.0  # sampling temperature of held-out evals (0: greedy)
    # picks the held-out tasks, the same for every run seed so runs compare
    eval_seed: int = 1234
    eval: EvalConfig = field(default_factory=EvalConfig)  # samples per held-out task and pass@k
    checkpoint_every: int = 0  # save a checkpoint every k steps (0: only at the end)
    # keep the newest k of checkpoints/ (0: all); older ones go once a new one is in place
    keep_checkpoints: int = 0
    # a checkpoint folder to resume from exactly, or "auto": the run's latest one
    resume: str = ""
    # wall-clock metrics (runs.is_timing); false: every record reproduces bit for bit
    log_timings: bool = True
    wandb: bool = True  # log to wandb (offline unless WANDB_MODE says otherwise)
    wandb_project: str = "nano-skyrl"  # the wandb project the runs log to
    threads: int = 0  # torch CPU threads (0: torch's default)
    # the device's peak FLOP/s for perf/mfu (0: runs.GPU_PEAK_FLOPS, or measured)
    peak_flops: float = 0.0
    model: ModelSpec = field(default_factory=ModelSpec)
    # training mix and held-out sets
    envs: list[EnvSpec] = field(default_factory=lambda: [EnvSpec()])
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    # Ray rollout workers and learner actors (wings/cluster.py)
    ray: RayConfig = field(default_factory=RayConfig)


# -----------------------------------------------------------------------------
# filling the tree: dict -> dataclass, with type checks and helpful errors

ENGINE_KINDS = ("torch", "vllm", "openai")  # rollout.make_engine's kinds
# train.compute_advantages' kinds
ADVANTAGE_KINDS = algos.GROUP_ADVANTAGE_KINDS + (
    "reinforce_pp",
    "reinforce_pp_baseline",
    "gae",
    "none",
)


def _did_you_mean(word, choices) -> str:
    """'; did you mean 'x'?' for the valid choice closest to a misspelt key or value, or ''
    when there is none."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.0)
    return f"; did you mean {close[0]!r}?" if close else ""


def _check(value, tp, key: str):
    """Coerce a YAML value to the field's type, or raise naming the key."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"config key '{key}' must be a mapping, got {value!r}")
        return from_dict(tp, value, key + ".")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _check(value, a, key)
            except (TypeError, ValueError):
                pass
        raise TypeError(f"config key '{key}' expects {tp}, got {value!r}")
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"config key '{key}' must be a list, got {value!r}")
        if tp is tuple or origin is tuple:
            return tuple(value)
        (inner,) = typing.get_args(tp) or (typing.Any,)
        return [_check(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise TypeError(f"config key '{key}' must be a mapping, got {value!r}")
        return dict(value)
    if tp is float and isinstance(value, str):
        try:  # YAML reads '3e-5' (no dot) as a string
            return float(value)
        except ValueError:
            raise TypeError(f"config key '{key}' expects float, got {value!r}") from None
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp in (int, str, bool) and not (
        isinstance(value, tp) and not (tp is int and isinstance(value, bool))
    ):
        raise TypeError(f"config key '{key}' expects {tp.__name__}, got {value!r}")
    return value


def from_dict(cls, d: dict, prefix: str = ""):
    """Build dataclass `cls` from a (partial) dict; an unknown key raises, naming the closest
    valid one."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in d.items():
        if k not in names:
            raise KeyError(
                f"unknown config key '{prefix}{k}'"
                f"{_did_you_mean(prefix + k, [prefix + n for n in names])}"
            )
        kwargs[k] = _check(v, hints[k], prefix + k)
    return cls(**kwargs)


def load_config(path: str | None = None, overrides: list[str] = ()) -> Config:
    """Defaults <- algo preset <- YAML file <- `key.sub=value` overrides (their values parsed
    as YAML: 3e-5, true)."""
    patches = []
    if path:
        with open(path) as f:
            patch = _yaml(f.read(), path)
        if not isinstance(patch, (dict, type(None))):
            raise TypeError(
                f"{path} must hold a mapping of config keys, not a {type(patch).__name__}"
            )
        patches.append(patch or {})
    for o in overrides:
        if "=" not in o:
            raise ValueError(f"override '{o}' must look like key.sub=value")
        k, v = o.split("=", 1)
        patch = {}
        _set_path(patch, k.strip(), _yaml(v, f"override '{o}'"))
        patches.append(patch)
    name = Config().algo.name  # the preset is the last algo.name given anywhere
    for p in patches:
        name = (p.get("algo") or {}).get("name", name) if isinstance(p.get("algo"), dict) else name
    if name not in ALGO_PRESETS:
        raise ValueError(
            f"unknown algo.name {name!r}; choose from {list(ALGO_PRESETS)}"
            f"{_did_you_mean(name, ALGO_PRESETS)}"
        )
    preset: dict = {}
    for k, v in ALGO_PRESETS[name].items():
        _set_path(preset, k, v)
    d = dataclasses.asdict(Config())
    for p in [preset] + patches:
        _merge(d, p, "")
    return validate(from_dict(Config, d))


def _yaml(text: str, where: str):
    """yaml.safe_load, a syntax error as one ValueError line that says where."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ValueError(f"{where} is not valid YAML: {problem or e}{at}") from None


def validate(cfg: Config) -> Config:
    """String choices and combinations of knobs are checked here, before anything is built,
    not at their first use."""
    choices = [
        ("algo.advantage", cfg.algo.advantage, ADVANTAGE_KINDS),
        ("learner.policy_loss", cfg.learner.policy_loss, algos.POLICY_LOSS_KINDS),
        ("learner.loss.agg_mode", cfg.learner.loss.agg_mode, algos.AGG_MODES),
        ("learner.kl_kind", cfg.learner.kl_kind, algos.KL_KINDS),
        ("learner.off_policy.kind", cfg.learner.off_policy.kind, algos.OFF_POLICY_KINDS),
        ("learner.off_policy.level", cfg.learner.off_policy.level, algos.OFF_POLICY_LEVELS),
        ("rollout.engine", cfg.rollout.engine, ENGINE_KINDS),
        ("algo.truncation", cfg.algo.truncation, algos.TRUNCATION_KINDS),
        ("rollout.agent.chat_format", cfg.rollout.agent.chat_format, CHAT_FORMATS),
        ("model.dtype", cfg.model.dtype, ("float32", "bfloat16", "float16")),
        ("learner.precision", cfg.learner.precision, ("fp32", "bf16")),
        ("algo.credit", cfg.algo.credit, ("episode", "turn")),
        ("algo.turn_baseline", cfg.algo.turn_baseline, algos.TURN_BASELINES),
    ]
    for key, value, allowed in choices:
        check_choice(key, value, allowed)
    if cfg.learner.loss.agg_mode == "seq-mean-token-sum-norm" and not cfg.learner.loss.agg_norm:
        raise ValueError(
            "learner.loss.agg_mode=seq-mean-token-sum-norm needs learner.loss.agg_norm (a constant)"
        )
    if (
        cfg.algo.advantage not in ("gae", "reinforce_pp", "none")
        and cfg.rollout.agent.n_samples < 2
    ):
        raise ValueError(
            f"algo.advantage={cfg.algo.advantage} is a group baseline: it needs "
            "rollout.agent.n_samples >= 2"
        )
    if cfg.algo.turn_baseline != "position" and cfg.algo.credit != "turn":
        raise ValueError(
            f"algo.turn_baseline={cfg.algo.turn_baseline} is a baseline per turn: "
            "set algo.credit=turn"
        )
    if cfg.algo.credit == "turn" and cfg.algo.advantage not in algos.GROUP_ADVANTAGE_KINDS:
        raise ValueError(
            f"algo.credit=turn is a group baseline per turn: it cannot go with algo.advantage="
            f"{cfg.algo.advantage} (use grpo, drgrpo or rloo)"
        )
    if cfg.algo.advantage == "none" and not cfg.algo.teacher_path:
        raise ValueError(
            "algo.advantage=none (algo.name=distill) learns from a teacher alone: "
            "set algo.teacher_path"
        )
    if cfg.algo.advantage == "none" and cfg.algo.kl_in_reward:
        raise ValueError(
            "algo.advantage=none has no reward to put a KL in: "
            "use learner.kl_coef (no algo.kl_in_reward)"
        )
    if not 0 <= cfg.algo.overlong_cache <= cfg.rollout.agent.max_total_tokens:
        raise ValueError(
            f"algo.overlong_cache={cfg.algo.overlong_cache} must be >= 0 and at most "
            f"rollout.agent.max_total_tokens={cfg.rollout.agent.max_total_tokens} "
            "(the penalty ramps over the last overlong_cache tokens of the budget)"
        )
    if cfg.rollout.agent.max_episode_tokens < 0:
        raise ValueError(
            f"rollout.agent.max_episode_tokens={cfg.rollout.agent.max_episode_tokens} must be >= 0 "
            "(0: no limit but the context window)"
        )
    if cfg.algo.truncation_penalty != 1.0 and cfg.algo.truncation != "penalize":
        raise ValueError(
            "algo.truncation_penalty applies to algo.truncation=penalize, "
            f"not {cfg.algo.truncation!r}"
        )
    if cfg.rollout.agent.enable_thinking is not None and cfg.rollout.agent.chat_format != "qwen3":
        raise ValueError(
            "rollout.agent.enable_thinking applies to rollout.agent.chat_format=qwen3 only (the "
            f"format with a think block), not {cfg.rollout.agent.chat_format!r}: leave it unset"
        )
    if cfg.algo.kl_in_reward and cfg.learner.kl_coef <= 0:
        raise ValueError("algo.kl_in_reward needs learner.kl_coef > 0")
    off = cfg.learner.off_policy
    if (off.kind == "tis" and off.tis_cap <= 0) or (
        off.kind == "mis" and not 0 < off.mis_low <= 1 <= off.mis_high
    ):
        raise ValueError(
            "learner.off_policy needs tis_cap > 0 (tis) and 0 < mis_low <= 1 <= mis_high (mis), "
            f"got tis_cap={off.tis_cap}, mis_low={off.mis_low}, mis_high={off.mis_high}"
        )
    if not 0 < cfg.rollout.top_p <= 1:
        raise ValueError(
            f"rollout.top_p={cfg.rollout.top_p} must be in (0, 1] (1: off; 0.9 keeps the smallest "
            "set of tokens holding 90% of the mass)"
        )
    if cfg.rollout.top_k < 0:
        raise ValueError(f"rollout.top_k={cfg.rollout.top_k} must be >= 0 (0: off)")
    if cfg.rollout.prefill_chunk_tokens < 1:
        raise ValueError(
            f"rollout.prefill_chunk_tokens={cfg.rollout.prefill_chunk_tokens} must be >= 1"
        )
    if cfg.eval.n_samples < 1:
        raise ValueError(
            f"eval.n_samples={cfg.eval.n_samples} must be >= 1 (episodes per held-out task)"
        )
    if any(not 1 <= k <= cfg.eval.n_samples for k in cfg.eval.pass_k):
        raise ValueError(
            f"eval.pass_k={cfg.eval.pass_k} needs every k between 1 and eval.n_samples="
            f"{cfg.eval.n_samples}: pass@k draws k of a task's n samples (e.g. eval.n_samples=10 "
            "eval.pass_k=[1,5,10])"
        )
    if not cfg.envs:
        raise ValueError("envs is empty: name at least one environment")
    if cfg.keep_checkpoints < 0 or cfg.checkpoint_every < 0:
        raise ValueError(
            "checkpoint_every and keep_checkpoints must be >= 0 (0: only at the end; 0: keep all)"
        )
    check_wings(cfg)
    return cfg


def check_choice(key: str, value, allowed):
    if value not in allowed:
        raise ValueError(
            f"{key}={value!r} is not one of {list(allowed)}{_did_you_mean(value, allowed)}"
        )


# Each wing checks its own settings, reached by name as rollout.ENGINES reaches the engines:
# "module" -> the config keys it owns. Its check_config(cfg) runs when any of them differs from the
# default: it raises ValueError on a bad combination and returns its choices, (key, value, allowed)
# triples checked here like the core's. So a run that touches no wing's setting imports no wing, and
# a wing never imports this file.
WING_CHECKS = {
    "wings.async_rollouts": (
        "rollout.async_rollouts",
        "rollout.max_staleness",
        "rollout.partial_rollouts",
        "rollout.partial_replay",
    ),
    "wings.cluster": ("ray",),
    "wings.judge": ("rollout.judge",),
    "wings.external_agent": ("rollout.external_agent",),
    "wings.engine_openai": ("rollout.api_key_env", "rollout.weights_dir"),
    "wings.lora": ("learner.lora_rank", "learner.lora_alpha", "learner.lora_targets"),
    "wings.qlora": ("model.quantize",),
    "wings.fast_decode": ("rollout.decode",),
    "wings.memory": (
        "rollout.agent.memory",
        "rollout.agent.memory_turns",
        "rollout.agent.summary_every",
        "rollout.agent.summary_tokens",
        "rollout.agent.summary_gradient",
    ),
}


def check_wings(cfg: Config):
    """Run the check_config of every wing in WING_CHECKS whose settings this config changes,
    then check the choices it returns."""

    def get(tree, key):
        for part in key.split("."):
            tree = getattr(tree, part)
        return tree

    default = Config()
    for module, keys in WING_CHECKS.items():
        if any(get(cfg, k) != get(default, k) for k in keys):
            for key, value, allowed in importlib.import_module(module).check_config(cfg):
                check_choice(key, value, allowed)


# keys that were moved: the error says where to, since a did-you-mean cannot guess it
RENAMED = {
    "learner.tis_cap": (
        "use learner.off_policy.kind=tis and learner.off_policy.tis_cap=<cap> "
        "(the same weights, min(pi_old / pi_engine, cap) per token)"
    )
}


def _set_path(d: dict, dotted: str, value):
    *parents, last = dotted.split(".")
    for p in parents:
        d = d.setdefault(p, {})
    d[last] = value


def _merge(base: dict, patch: dict, prefix: str):
    """Recursive merge that refuses keys the defaults do not have, so a typo fails here, with
    a hint."""
    for k, v in patch.items():
        if isinstance(base, list):
            base[int(k)] = _merge_value(base[int(k)], v, f"{prefix}{k}")
            continue
        if k not in base:
            if prefix + str(k) in RENAMED:
                raise KeyError(f"config key '{prefix}{k}' was renamed: {RENAMED[prefix + str(k)]}")
            hint = _did_you_mean(prefix + str(k), [prefix + b for b in base])
            raise KeyError(f"unknown config key '{prefix}{k}'{hint}")
        base[k] = _merge_value(base[k], v, f"{prefix}{k}")


def _merge_value(old, new, key: str):
    if isinstance(old, dict) and isinstance(new, dict) and key.endswith("kwargs"):
        # an env's own knobs: free-form (no key check), and a later one keeps the others
        return {**old, **new}
    if isinstance(old, dict) and isinstance(new, dict):
        _merge(old, new, key + ".")
        return old
    if isinstance(old, list) and isinstance(new, dict):  # 'envs.0.weight=2' patches one list entry
        for i, v in new.items():
            old[int(i)] = _merge_value(old[int(i)], v, f"{key}.{i}")
        return old
    if key == "envs" or key.endswith(".envs"):
        return [
            _merge_value(dataclasses.asdict(EnvSpec()), e, f"{key}.{i}")
            if isinstance(e, dict)
            else e
            for i, e in enumerate(new)
        ]
    return new


def learner_configs(cfg: Config) -> tuple[LearnerConfig, LearnerConfig]:
    """(the policy's learner config, the critic's). With the KL in the reward, the policy's
    loss must not count it again."""
    policy = replace(cfg.learner, kl_coef=0.0) if cfg.algo.kl_in_reward else cfg.learner
    return policy, replace(cfg.learner, lr=cfg.algo.critic_lr, lora_rank=0)


# -----------------------------------------------------------------------------
# how an entry point ends on bad input (the paths a config names are checked in runs.check_paths)


def config_exit(e: Exception):
    """How an entry point ends on bad input: `config error: ...` (one line, on stderr) and exit
    status 2, the status argparse gives bad arguments. Raises SystemExit; its str() is that line,
    for whoever catches it (tests)."""
    message = "config error: " + " ".join(str(e.args[0] if len(e.args) == 1 else e).split())
    print(message, file=sys.stderr, flush=True)
    stop = SystemExit(message)
    stop.code = 2
    raise stop
