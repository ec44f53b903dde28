"""runs.py: the run folder, runs/<run_name>/: what a run writes, and what a resumed run reads back.

    config.yaml               the resolved config (write_config)
    metrics.jsonl             one JSON object per step (Logger; also to wandb, offline unless WANDB_MODE says otherwise)
    episodes_step<N>.jsonl    every held-out episode of the eval at step N (eval.dump_episodes)
    checkpoints/step_<N>/     a checkpoint every checkpoint_every steps (save_run_checkpoint)
    final/                    the last checkpoint: a Hugging Face folder (weights, tokenizer) plus the learner's state
    curves.png, summary.json  the reward and held-out accuracy curves, the eval curve and the wall time (finish_run)

Rank 0 alone writes; every rank joins a checkpoint, whose weights are gathered across ranks.
Imports: learner.py (checkpoints) and plot.py (the curves).
"""
import dataclasses
import json
import os
import pickle
import shutil

import yaml

from learner import LearnerState, is_main, save_checkpoint, save_merged
from plot import save_curves

PENDING = "pending_rollouts.pkl"        # async mode: the next step's rollouts, saved with a checkpoint


def write_config(cfg) -> str:
    """The run folder out_dir/run_name, made, with config.yaml in it: the resolved config of the run (config.Config),
    the same tree `--config` reads -> the folder."""
    run_dir = os.path.join(cfg.out_dir, cfg.run_name)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        yaml.safe_dump(dataclasses.asdict(cfg), f, sort_keys=False)
    return run_dir


def save_run_checkpoint(path: str, cfg, model_dir: str, policy: LearnerState, critic: LearnerState | None,
                        pending=None) -> None:
    """The learner (and critic) state in `path`, with the tokenizer files, so the folder is a Hugging Face model.
    Every rank calls it (weights are gathered), rank 0 writes. A LoRA run writes its adapter (PEFT files) and, in
    `final/merged/`, the merged model that eval.py loads. `pending`: async mode's next batch, sampled from the
    previous weights, which no checkpoint holds."""
    save_checkpoint(policy, path, extra={"run_name": cfg.run_name}, base_model=model_dir)
    if critic is not None:
        save_checkpoint(critic, os.path.join(path, "critic"))
    folders = [path]
    if cfg.learner.lora_rank and os.path.basename(path) == "final":
        save_merged(policy.model, os.path.join(path, "merged"))
        folders.append(os.path.join(path, "merged"))
    if not is_main():
        return
    for folder in folders:
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copy(os.path.join(model_dir, f), folder)
    if pending is not None:
        with open(os.path.join(path, PENDING), "wb") as f:
            pickle.dump(pending, f)


def load_pending(path: str):
    """Async mode's next batch saved with the checkpoint at `path`, or None."""
    if not os.path.exists(os.path.join(path, PENDING)):
        return None
    with open(os.path.join(path, PENDING), "rb") as f:
        return pickle.load(f)


class Logger:
    """metrics.jsonl (always) + wandb (optional, offline by default): one record per step at the global step.
    On ranks other than 0 (`enabled=False`) it writes nothing."""

    def __init__(self, run_dir: str, cfg, resume: bool, enabled: bool = True):
        self.file = open(os.path.join(run_dir, "metrics.jsonl"), "a" if resume else "w") if enabled else None
        self.wandb = None
        if cfg.wandb and enabled:
            os.environ.setdefault("WANDB_MODE", "offline")
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb
            self.wandb = wandb.init(project=cfg.wandb_project, name=cfg.run_name, dir=run_dir,
                                    config=dataclasses.asdict(cfg), resume="allow")

    def log(self, step: int, metrics: dict) -> dict:
        """Write one step's record -> the metrics (for the caller's history)."""
        if self.file is None:
            return metrics
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        return metrics

    def finish(self):
        if self.file is not None:
            self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


def finish_run(run_dir: str, history: list, minutes: float) -> dict:
    """curves.png and summary.json from the (step, metrics) history -> the summary."""
    save_curves(history, os.path.join(run_dir, "curves.png"))
    evals = [(s, m["eval/accuracy"]) for s, m in history if "eval/accuracy" in m]
    summary = {"run_dir": run_dir, "minutes": minutes, "eval_curve": evals,
               "final_accuracy": evals[-1][1] if evals else None}
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"done in {minutes:.1f} min; held-out accuracy by step: " + ", ".join(f"{s}: {a:.3f}" for s, a in evals))
    return summary
