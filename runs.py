"""runs.py: the run folder, runs/<run_name>/: what a run writes, and what a resumed run reads back.

    config.yaml               the resolved config (write_config)
    metrics.jsonl             one JSON object per step (Logger; also to wandb, offline unless
                              WANDB_MODE says otherwise)
    episodes_step<N>.jsonl    every held-out episode of the eval at step N (eval.dump_episodes)
    checkpoints/step_<N>/     a checkpoint every checkpoint_every steps (save_run_checkpoint),
                              keep_checkpoints kept
    final/                    the last checkpoint: a Hugging Face folder (weights, tokenizer) plus
                              the learner's state
    curves.png, summary.json  the reward and held-out accuracy curves, the eval curve and the wall
                              time (finish_run)

Nothing is lost when a run is killed (preemption, OOM, Ctrl-C, SIGKILL) at any moment:
  - a checkpoint folder is complete or absent: it is written into `<name>.partial/`, its marker
    (checkpoint.json, with the RL step) written last, then renamed into place; a loader refuses a
    folder without the marker;
  - `resume=auto` continues from the latest complete checkpoint of the run folder (or starts fresh
    when there is none), so a preemptible job is relaunched with the same command; a run folder
    whose config.yaml differs from the new config (in anything but RESUME_FREE_KEYS) is refused,
    naming the keys;
  - on resume the logs are cut back to the checkpoint: metrics.jsonl keeps the records up to its
    step and the episode dumps after it are removed, so the logs always match the weights (and
    wandb resumes the same run).
Rank 0 alone writes; every rank joins a checkpoint, whose weights are gathered across ranks. A
checkpoint holds the learner's state (save_checkpoint: the weights in Hugging Face layout, the
optimizer, its step and the RNGs), and load_checkpoint restores it exactly. At the end of the file:
the perf metrics of a step (PerfMeter): perf/mfu over the device's peak FLOP/s,
perf/peak_memory_gib, and the wall-clock seconds and tokens per second of each phase.
Imports: model.py, plot.py (the curves), distributed.py, env.py, learner.py (the learner's state)
(and torch, safetensors, wandb, yaml, the standard library).
"""

import dataclasses
import glob
import json
import os
import pickle
import re
import resource
import secrets
import shutil
import time

import torch
import yaml
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from distributed import FULL_STATE, barrier, full_state_dict, is_main, is_sharded
from env import env_class
from learner import LearnerState, merged_state_dict
from model import Transformer, safetensors_files, save_model, train_flops
from plot import save_curves

# async mode: the queued batches (async_rollouts.AsyncSchedule), saved with a checkpoint
PENDING = "pending_rollouts.pkl"
# written last into a checkpoint folder: {"rl_step", "optimizer_step", ...}
MARKER = "checkpoint.json"
# what may change between a run and its resumed continuation: how long it runs, where and how it is
# launched, how it is logged and checkpointed; anything else would silently train a different run
RESUME_FREE_KEYS = (
    "steps",
    "resume",
    "threads",
    "wandb",
    "wandb_project",
    "log_timings",
    "peak_flops",
    "checkpoint_every",
    "keep_checkpoints",
    "ray.address",
    "ray.learner_workers",
    "ray.cpus_per_learner",
    "ray.gpus_per_learner",
    "ray.placement_strategy",
)


# -----------------------------------------------------------------------------
# the config, and what a resumed run must agree with


def write_config(cfg) -> str:
    """The run folder out_dir/run_name, made, with config.yaml in it: the resolved config of the run
    (config.Config), the same tree `--config` reads -> the folder."""
    run_dir = os.path.join(cfg.out_dir, cfg.run_name)
    os.makedirs(run_dir, exist_ok=True)
    _write_atomic(
        os.path.join(run_dir, "config.yaml"),
        yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False),
    )
    return run_dir


def resolve_resume(cfg) -> str:
    """The checkpoint folder this run continues from, "" for a fresh start. `resume=auto`: the
    latest complete checkpoint of this run's folder (checkpoints/step_<N>/ or final/), "" when there
    is none. A path: that folder, which must be a complete checkpoint. Either way, resuming into a
    run folder that already has a config.yaml needs the same config up to RESUME_FREE_KEYS
    (ValueError naming the differing keys)."""
    run_dir = os.path.join(cfg.out_dir, cfg.run_name)
    path = latest_checkpoint(run_dir) if cfg.resume == "auto" else cfg.resume
    if not path:
        return ""
    checkpoint_step(path)  # a complete checkpoint, or a clear error
    old = os.path.join(run_dir, "config.yaml")
    if os.path.exists(old):
        with open(old) as f:
            differ = _differing_keys(yaml.safe_load(f) or {}, dataclasses.asdict(cfg))
        differ = [k for k in differ if k not in RESUME_FREE_KEYS]
        if differ:
            raise ValueError(
                f"resume into {run_dir}: its config.yaml differs from this config in {differ}; "
                "resume with the same config (only steps and the launch keys may change) or use "
                "another run_name"
            )
    return path


def _differing_keys(a, b, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two config dicts (lists of env specs compared
    whole)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [
            k
            for key in sorted(set(a) | set(b))
            for k in _differing_keys(a.get(key), b.get(key), f"{prefix}{key}.")
        ]
    return [] if _plain(a) == _plain(b) else [prefix.rstrip(".")]


def _plain(x):
    """YAML reads tuples back as lists: compare the two alike."""
    return [_plain(v) for v in x] if isinstance(x, (list, tuple)) else x


# -----------------------------------------------------------------------------
# a learner's checkpoint: weights in Hugging Face layout + optimizer, optimizer step and RNG state
# beside them


def save_checkpoint(
    state: LearnerState, path: str, extra: dict | None = None, base_model: str = ""
) -> None:
    """Write `path/` as a loadable HF folder (config.json, model.safetensors) plus
    `trainer_state.pt` (optimizer, optimizer step, RNG states) and `trainer_state.json` (that step
    and `extra`, human-readable). A LoRA model writes only its adapter (save_adapter: PEFT names;
    `base_model` goes into adapter_config.json).
    Sharded: every rank calls it (weights and optimizer state are gathered), rank 0 writes. The
    optimizer state is keyed by parameter name, so a checkpoint resumes under any number of
    processes."""
    model = state.model
    # a wing's adapters (lora.py): only they train, only they are saved
    adapter = getattr(model, "adapter", None)
    if adapter is not None:
        adapter.save(model, path, base_model)
        sd = {}
    else:
        sd = full_state_dict(model)
    optim = get_optimizer_state_dict(model, state.optimizer, options=FULL_STATE)
    if not is_main():
        return
    os.makedirs(path, exist_ok=True)
    if sd and isinstance(model, Transformer):
        # Hugging Face layout: loadable by any engine. save_model reads a module: a sharded one is
        # not one
        save_model(_plain_model(model.cfg, sd) if is_sharded(model) else model, path)
    elif sd:
        save_file(
            {k: v.detach().clone() for k, v in sd.items()},  # clone: tied weights
            os.path.join(path, "model.safetensors"),
        )
    torch.save(
        {
            "optimizer": optim,
            "optimizer_step": state.optimizer_step,
            "rng": state.rng.get_state(),
            "torch_rng": torch.get_rng_state(),
        },
        os.path.join(path, "trainer_state.pt"),
    )
    with open(os.path.join(path, "trainer_state.json"), "w") as f:
        json.dump({"optimizer_step": state.optimizer_step, **(extra or {})}, f, indent=2)


def _plain_model(cfg, sd: dict) -> Transformer:
    """An unsharded Transformer holding the tensors of `sd` (no copy)."""
    with torch.device("meta"):
        plain = Transformer(cfg)
    plain.load_state_dict(sd, strict=False, assign=True)
    plain.tie_weights()
    return plain


def save_merged(model: Transformer, path: str) -> None:
    """A Hugging Face folder (config.json, model.safetensors) of merged_state_dict(model): a LoRA
    run's weights as a plain model that eval.py, transformers or vLLM load. Every rank calls it,
    rank 0 writes."""
    sd = merged_state_dict(model)
    if is_main():
        save_model(_plain_model(model.cfg, {k: v.detach().cpu() for k, v in sd.items()}), path)


def _tied(model) -> bool:
    m = model if isinstance(model, Transformer) else model.backbone
    return m.cfg.tie_word_embeddings


def load_checkpoint(state: LearnerState, path: str) -> LearnerState:
    """Restore weights (or a LoRA model's adapters), optimizer, optimizer step and RNG from `path`
    into `state` (built the same way as when saved, with any number of processes). Every rank reads
    the files."""
    adapter = getattr(state.model, "adapter", None)
    if adapter is not None:
        adapter.load(state.model, path)
    else:
        sd = {}
        for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            sd.update(load_file(f))
        expected = set(state.model.state_dict())
        missing = [
            k
            for k in expected - set(sd)
            if not (k.endswith("lm_head.weight") and _tied(state.model))
        ]
        unexpected = sorted(set(sd) - expected)
        if missing or unexpected:
            raise ValueError(
                f"checkpoint {path}: missing {sorted(missing)[:5]}, unexpected {unexpected[:5]}"
            )
        if is_sharded(state.model):  # each rank keeps its shard of the full tensors
            set_model_state_dict(
                state.model, sd, options=StateDictOptions(full_state_dict=True, strict=False)
            )
        else:
            state.model.load_state_dict(sd, strict=False)
    ts = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
    set_optimizer_state_dict(
        state.model,
        state.optimizer,
        ts["optimizer"],
        options=StateDictOptions(full_state_dict=True),
    )
    for group in state.optimizer.param_groups:
        # the loader hands tuples (AdamW's betas) back as lists: the same
        # as saved
        group.update(
            {k: tuple(v) for k, v in group.items() if k != "params" and isinstance(v, list)}
        )
    state.rng.set_state(ts["rng"])
    torch.set_rng_state(ts["torch_rng"])
    return dataclasses.replace(state, optimizer_step=ts["optimizer_step"])


# -----------------------------------------------------------------------------
# checkpoints: complete or absent


def save_run_checkpoint(
    path: str,
    cfg,
    model_dir: str,
    policy: LearnerState,
    critic: LearnerState | None,
    rl_step: int,
    pending=None,
) -> None:
    """The learner (and critic) state in `path`, with the tokenizer files, so the folder is a
    Hugging Face model, and the RL step it was taken after. Written into `path.partial/`, the marker
    last, then renamed into place, so a kill at any moment leaves the previous checkpoint or this
    one, never half of one. Every rank calls it (weights are gathered), rank 0 writes. A LoRA run
    writes its adapter (PEFT files) and, in `final/merged/`, the merged model that eval.py loads.
    `pending`: async mode's queue of batches sampled from earlier weights, which no checkpoint
    holds. Then keeps the newest cfg.keep_checkpoints of checkpoints/ (0: all)."""
    tmp = path + ".partial"
    if is_main():
        shutil.rmtree(tmp, ignore_errors=True)  # what a kill left of an earlier attempt
    save_checkpoint(
        policy, tmp, extra={"run_name": cfg.run_name, "rl_step": rl_step}, base_model=model_dir
    )
    if critic is not None:
        save_checkpoint(critic, os.path.join(tmp, "critic"))
    folders = [tmp]
    if cfg.learner.lora_rank and os.path.basename(path) == "final":
        save_merged(policy.model, os.path.join(tmp, "merged"))
        folders.append(os.path.join(tmp, "merged"))
    if is_main():
        for folder in folders:
            for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
                shutil.copy(os.path.join(model_dir, f), folder)
        if pending is not None:
            with open(os.path.join(tmp, PENDING), "wb") as f:
                pickle.dump(pending, f)
        _write_atomic(
            os.path.join(tmp, MARKER),
            json.dumps(
                {
                    "rl_step": rl_step,
                    "optimizer_step": policy.optimizer_step,
                    "run_name": cfg.run_name,
                },
                indent=2,
            ),
        )
        _fsync_tree(tmp)
        _swap_into_place(tmp, path)
        if os.path.basename(os.path.dirname(path)) == "checkpoints":
            prune_checkpoints(os.path.dirname(path), cfg.keep_checkpoints)
    barrier()  # no rank reads a checkpoint rank 0 is still renaming


def checkpoint_step(path: str) -> int:
    """The RL step of the complete checkpoint at `path`; ValueError when it is not one (a folder a
    kill left half written has no marker)."""
    marker = os.path.join(path, MARKER)
    if not os.path.exists(marker):
        what = (
            "does not exist"
            if not os.path.exists(path)
            else f"has no {MARKER} (not a complete checkpoint)"
        )
        raise ValueError(f"resume={path}: the folder {what}")
    with open(marker) as f:
        return int(json.load(f)["rl_step"])


def latest_checkpoint(run_dir: str) -> str:
    """The complete checkpoint of `run_dir` with the highest RL step (final/ counts), or "" when
    there is none."""
    candidates = _step_folders(os.path.join(run_dir, "checkpoints")) + [
        os.path.join(run_dir, "final")
    ]
    complete = [
        (checkpoint_step(p), p.endswith("final"), p)
        for p in candidates
        if os.path.exists(os.path.join(p, MARKER))
    ]
    return max(complete)[2] if complete else ""


def _step_folders(folder: str) -> list[str]:
    """checkpoints/step_<N> folders, by N: never a step_<N>.partial (a write a kill interrupted,
    marker or not)."""
    found = [
        (int(m.group(1)), p)
        for p in glob.glob(os.path.join(folder, "step_*"))
        if (m := re.fullmatch(r"step_(\d+)", os.path.basename(p)))
    ]
    return [p for _, p in sorted(found)]


def prune_checkpoints(folder: str, keep: int) -> None:
    """Remove all but the newest `keep` complete checkpoints of `folder` (keep 0: remove none).
    Called after a new one is in place, so a kill here loses nothing needed."""
    complete = [p for p in _step_folders(folder) if os.path.exists(os.path.join(p, MARKER))]
    for p in complete[:-keep] if keep > 0 else []:
        shutil.rmtree(p)


def load_pending(path: str) -> dict | None:
    """What the async schedule saved with the checkpoint at `path`
    (async_rollouts.AsyncSchedule.pending): its queue, {step: (trajectories, metrics, seconds,
    version)} (with partial rollouts a dict that also carries the swap record so far,
    async_rollouts.SavedQueue), or None when nothing was saved."""
    if not os.path.exists(os.path.join(path, PENDING)):
        return None
    with open(os.path.join(path, PENDING), "rb") as f:
        return pickle.load(f)


def _swap_into_place(tmp: str, path: str) -> None:
    """Rename the finished `tmp` folder to `path`. A folder cannot be renamed over a non-empty one:
    an older `path` (a re-written final/) is first renamed aside, then removed; a kill in between
    leaves `path` absent, not wrong."""
    old = path + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(os.path.dirname(path) or ".")


def _write_atomic(path: str, text: str) -> None:
    """Write a file as a whole or not at all: a temporary file beside it, flushed to disk, then
    renamed."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_tree(folder: str) -> None:
    """Flush every file of a folder to disk before the rename that publishes it (a power loss, not
    only a kill)."""
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(root)


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -----------------------------------------------------------------------------
# logs that match the weights

# how a wall-clock metric outside perf/ is named
TIMING_SUFFIXES = ("_seconds", "_per_s", "idle_fraction")


def is_timing(key: str) -> bool:
    """Whether a metric is wall-clock (it differs between two runs of the same seed): perf/*, or
    named so."""
    return key.startswith("perf/") or key.endswith(TIMING_SUFFIXES)


class Logger:
    """metrics.jsonl (always) + wandb (optional, offline by default): one record per RL step. On
    ranks other than 0 (`enabled=False`) it writes nothing. Resumed after `resume_step`, it first
    cuts the logs back to that step: metrics.jsonl keeps its records up to it (nothing is logged
    twice, nothing kept is lost), the episode dumps of later evals are removed, and wandb resumes
    the same run (its id is kept in the run folder) from that step. log_timings=false drops the
    wall-clock metrics (is_timing: perf/*, and any key ending in _seconds, _per_s or idle_fraction,
    as Ray's dispatch/* and an env's score_seconds), so a record is reproducible bit for bit."""

    def __init__(self, run_dir: str, cfg, resume_step: int | None = None, enabled: bool = True):
        self.file = None  # metrics.jsonl, opened when enabled
        self.wandb = None  # the wandb run, when enabled and cfg.wandb
        self.log_timings = cfg.log_timings
        self.history = []  # (step, metrics): the records kept, for the curves
        if not enabled:
            return
        path = os.path.join(run_dir, "metrics.jsonl")
        if resume_step is not None:
            self.history = [(r["step"], r) for r in read_metrics(path) if r["step"] <= resume_step]
            _write_atomic(path, "".join(json.dumps(r) + "\n" for _, r in self.history))
            for dump in glob.glob(os.path.join(run_dir, "episodes_step*.jsonl")):
                if int(re.search(r"episodes_step(\d+)\.jsonl$", dump).group(1)) > resume_step:
                    os.remove(dump)
        self.file = open(path, "a" if resume_step is not None else "w")
        if cfg.wandb:
            self.wandb = _wandb_run(run_dir, cfg, resume_step)

    def log(self, step: int, metrics: dict) -> dict:
        """Write one step's record -> the metrics."""
        if self.file is None:
            return metrics
        if not self.log_timings:
            metrics = {k: v for k, v in metrics.items() if not is_timing(k)}
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        self.history.append((step, {"step": step, **metrics}))
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        return metrics

    def finish(self):
        if self.file is not None:
            self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


def read_metrics(path: str) -> list[dict]:
    """The records of a metrics.jsonl; a last line cut by a kill (no newline, not JSON) is
    dropped."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return records


def _wandb_run(run_dir: str, cfg, resume_step: int | None):
    """A wandb run, offline unless WANDB_MODE says otherwise, whose id is kept in the run folder: a
    resumed run continues the same wandb run, rewound to the checkpoint's step (wandb's resume_from)
    when it can be."""
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    id_file = os.path.join(run_dir, "wandb_run_id")
    run_id = (
        open(id_file).read().strip()
        if resume_step is not None and os.path.exists(id_file)
        else None
    )
    if run_id is None:
        run_id = secrets.token_hex(4)  # wandb's ids: 8 lowercase letters and digits
        _write_atomic(id_file, run_id)
    kwargs = dict(
        project=cfg.wandb_project, name=cfg.run_name, dir=run_dir, config=dataclasses.asdict(cfg)
    )
    if resume_step is not None and os.environ["WANDB_MODE"] != "offline":
        try:  # rewind: the steps logged after the checkpoint are replaced
            return wandb.init(resume_from=f"{run_id}?_step={resume_step}", **kwargs)
        except Exception:  # a server without rewind: resume, later steps logged again
            pass
    return wandb.init(id=run_id, resume="allow", **kwargs)


def finish_run(run_dir: str, history: list, minutes: float) -> dict:
    """curves.png and summary.json from the (step, metrics) history -> the summary."""
    save_curves(history, os.path.join(run_dir, "curves.png"))
    evals = [(s, m["eval/accuracy"]) for s, m in history if "eval/accuracy" in m]
    summary = {
        "run_dir": run_dir,
        "minutes": minutes,
        "eval_curve": evals,
        "final_accuracy": evals[-1][1] if evals else None,
    }
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(
        f"done in {minutes:.1f} min; held-out accuracy by step: "
        + ", ".join(f"{s}: {a:.3f}" for s, a in evals)
    )
    return summary


# -----------------------------------------------------------------------------
# the files and folders a config names: checked by the entry points (train.cli, eval.main) before
# anything is built, so a wrong path is one clear line (config.config_exit), not a traceback from
# deep inside tokenizers or torch.load. config.load_config stays pure (tests build configs with
# paths that do not exist); these read the file system.


def _named(key: str, path) -> str:
    # a flag, or a config key
    return f"{key} {path!r}" if key.startswith("--") else f"{key}={path!r}"


def check_file(path, key: str) -> str:
    """`path` if it is a file; else ValueError naming `key` (a config key, or a flag like
    --config)."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"{_named(key, path)} must be the path of a file")
    if not os.path.isfile(path):
        raise ValueError(
            f"{_named(key, path)}: "
            + ("a folder, not a file" if os.path.isdir(path) else "no such file")
        )
    return path


def _check_folder(path, key: str, what: str) -> str:
    """`path` if it is a folder; else ValueError naming `key`, the path and `what` it should be."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"{_named(key, path)} must be the path of {what}")
    if not os.path.isdir(path):
        raise ValueError(
            f"{_named(key, path)}: "
            + (f"a file, not {what}" if os.path.exists(path) else "no such folder")
        )
    return path


def _refuse_missing(path: str, key: str, what: str, missing: list[str]) -> str:
    """`path` when nothing is `missing`; else ValueError naming `key`, the path and everything
    missing."""
    if missing:
        listed = missing[0] if len(missing) == 1 else ", ".join(missing[:-1]) + " or " + missing[-1]
        raise ValueError(f"{_named(key, path)} is not {what}: it has no {listed}")
    return path


def check_model_folder(path, key: str, weights: bool = True) -> str:
    """`path` if it is a Hugging Face model folder as model.load_model and the engines read it:
    config.json, tokenizer.json and the weights (model.safetensors, or the shards
    model.safetensors.index.json lists); else ValueError naming `key` and what is missing.
    weights=False: only the tokenizer is read (the openai engine's folder). The one check for any
    model a config names (the policy, a checkpoint, a teacher or reference)."""
    what = "a Hugging Face model folder"
    _check_folder(path, key, what)
    needs = (["config.json"] if weights else []) + ["tokenizer.json"]
    missing = [n for n in needs if not os.path.isfile(os.path.join(path, n))]
    if weights:
        # model.safetensors, or every shard of an index that must read {"weight_map": {name: file}}
        try:
            shards = safetensors_files(path)
        except (OSError, ValueError, KeyError, AttributeError, TypeError):
            raise ValueError(
                f"{_named(key, path)}: its model.safetensors.index.json is not a readable index"
            ) from None
        absent = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        if shards == ["model.safetensors"] and absent:
            missing.append(
                "weights (model.safetensors, or model.safetensors.index.json and its shards)"
            )
        else:
            missing += [f"{s} (listed in model.safetensors.index.json)" for s in absent]
    return _refuse_missing(path, key, what, missing)


def check_checkpoint_folder(path, key: str, critic: bool = False) -> str:
    """`path` if it is a complete checkpoint folder that a run resumes from (save_checkpoint
    wrote trainer_state.pt, and critic/trainer_state.pt for PPO's critic when `critic`;
    runs.save_run_checkpoint wrote its marker last, so a folder a kill left half written has none);
    else ValueError naming `key`."""
    what = "a checkpoint folder"
    _check_folder(path, key, what)
    needs = ["trainer_state.pt", MARKER] + (["critic/trainer_state.pt"] if critic else [])
    return _refuse_missing(
        path, key, what, [n for n in needs if not os.path.isfile(os.path.join(path, n))]
    )


def check_paths(cfg, training: bool = True):
    """Every file and folder `cfg` names, checked -> cfg; else ValueError naming the key and the
    path. Envs: the kwargs their class lists in `file_kwargs` (the dataset env's path and
    test_path). training=True (train.py) also checks what only training reads: model.path
    ("default" is built on first use), rollout.external_agent's file, algo.teacher_path and resume
    (a complete checkpoint; "auto" finds the run's latest one itself), and refuses to resume into a
    run folder whose config.yaml differs (runs.resolve_resume)."""
    for i, spec in enumerate(cfg.envs):
        for name in env_class(spec.name).file_kwargs:
            if spec.kwargs.get(name) is not None:
                check_file(spec.kwargs[name], f"envs.{i}.kwargs.{name}")
    if training and cfg.model.path != "default":
        check_model_folder(cfg.model.path, "model.path")
    if training and cfg.rollout.external_agent:  # "path.py:function" (config.py checked the form)
        check_file(cfg.rollout.external_agent.rpartition(":")[0], "rollout.external_agent")
    if training and cfg.algo.teacher_path:
        check_model_folder(cfg.algo.teacher_path, "algo.teacher_path")
    if training and cfg.resume and cfg.resume != "auto":
        check_checkpoint_folder(cfg.resume, "resume", critic=cfg.algo.advantage == "gae")
    if training and cfg.resume:  # resuming into a run folder whose config.yaml is another run's
        resolve_resume(cfg)
    return cfg


# -----------------------------------------------------------------------------
# perf metrics: MFU and peak memory

# Dense bf16 tensor-core peaks (FLOP/s, no sparsity) from the vendors' data sheets, matched against
# torch.cuda.get_device_name() in this order (the first name that is a substring wins)
GPU_PEAK_FLOPS = [
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("V100", 125e12),
]


# (device, threads) -> FLOP/s: measured once per process
_MEASURED_FLOPS: dict[tuple[str, int], float] = {}


def measured_matmul_flops(device: torch.device, threads: int, reps: int = 8) -> float:
    """FLOP/s of one square matmul on `device` (the best of `reps`): fp32 (512, 512) on a CPU with
    `threads` torch threads, bf16 (4096, 4096) on a GPU. What the device reaches: perf/mfu's
    denominator when no peak is known. Measured once per device and thread count. Its inputs come
    from a generator of its own: drawing them from the global one would move the run's random
    stream, and a resumed run (which measures again) would save another RNG state than the run it
    continues."""
    key = (str(device), threads)
    if key not in _MEASURED_FLOPS:
        n, dtype = (4096, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
        g = torch.Generator(device=device).manual_seed(0)
        a, b = (torch.randn(n, n, dtype=dtype, device=device, generator=g) for _ in range(2))
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        a @ b  # warm-up
        best = float("inf")
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            a @ b
            sync()
            best = min(best, time.perf_counter() - t0)
        _MEASURED_FLOPS[key] = 2 * n**3 / best
    return _MEASURED_FLOPS[key]


def peak_flops(device: torch.device, override: float = 0.0) -> float:
    """The device's peak FLOP/s: `override` (config peak_flops) if set, a GPU's from GPU_PEAK_FLOPS,
    else measured."""
    if override > 0:
        return override
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in GPU_PEAK_FLOPS:
            if key in name:
                return flops
    return measured_matmul_flops(device, torch.get_num_threads())


class PerfMeter:
    """perf/mfu and perf/peak_memory_gib of the learner, step by step: the model FLOPs of an update
    (every epoch) over its time and the peak of the devices that ran it (world processes of
    `device`, measured once, at the start)."""

    def __init__(self, device: torch.device, override: float, world: int):
        self.device = device
        self.world = world  # processes that run the learner
        self.peak = peak_flops(device, override)

    def measure(
        self, model, lengths: torch.Tensor, epochs: int, seconds: float, updated: bool
    ) -> dict:
        """The perf metrics of one step: mfu only when the step updated the model; peak memory
        always."""
        out = {}
        if updated:
            out["perf/mfu"] = (
                train_flops(model, lengths) * epochs / max(seconds, 1e-9) / (self.peak * self.world)
            )
        out["perf/peak_memory_gib"] = peak_memory_gib(self.device)
        return out

    def times(
        self, batch, rollout: float, train: float, sync: float, step: float, elapsed: float
    ) -> dict:
        """The wall-clock metrics of one step (seconds of each phase, tokens per second) for
        batch.RolloutBatch `batch`, and the processes that trained it."""
        return {
            "perf/sync_seconds": sync,
            "perf/rollout_seconds": rollout,
            "perf/train_seconds": train,
            "perf/step_seconds": step,
            "perf/rollout_tokens_per_s": float(batch.loss_mask.sum()) / max(rollout, 1e-9),
            "perf/train_tokens_per_s": int(batch.lengths.sum()) / max(train, 1e-9),
            "perf/elapsed_minutes": elapsed / 60,
            "perf/world_size": self.world,
        }


def peak_memory_gib(device: torch.device) -> float:
    """The learner's peak memory so far: CUDA's max allocated on a GPU, else this process's peak
    RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB
