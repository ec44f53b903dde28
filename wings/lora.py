"""lora.py: LoRA written out, a wing of learner.py (learner.lora_rank > 0).

Only the adapters train; the frozen base keeps its Hugging Face names, so a base checkpoint loads
into a wrapped model unchanged. The learner reaches this file through two hooks, never by name:
merged_state_dict folds every module that has `fold_into` (LoRALinear) into plain weights for the
engine, and runs.save_checkpoint / load_checkpoint call the model's `adapter` (LoRAFiles:
PEFT-compatible adapter files). train.build_learner calls apply_lora when the config asks for it.
Docs: docs/lora.md.

Shapes: r LoRA rank, in/out a linear layer's input/output features.
Imports: distributed.py (and torch, safetensors, the standard library).
"""

import json
import math
import os

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from distributed import is_main, is_sharded


# LoRA, written out (Hu et al. 2021, https://arxiv.org/abs/2106.09685)
#
# A wrapped linear computes  y = x W^T + b + s * dropout(x) A^T B^T,  s = alpha / r,  with W, b
# frozen and only A (r, in) and B (out, r) trained. B starts at zero, so the wrapped model starts
# *equal* to the base. The engine never sees LoRA: merged_state_dict folds W + s * B @ A into plain
# Hugging Face weights in memory. Adapter files use PEFT's names and config, so `peft` (and vLLM's
# LoRA loader) read them.


def check_config(cfg) -> list:
    """config.WING_CHECKS' hook: LoRA's settings (learner.lora_rank, lora_alpha, lora_targets). No
    choices ([])."""
    lc = cfg.learner
    if lc.lora_rank < 0 or (lc.lora_rank and (lc.lora_alpha <= 0 or not lc.lora_targets)):
        raise ValueError(
            "learner.lora_rank must be >= 0 (0: off); "
            "with LoRA on, lora_alpha > 0 and lora_targets non-empty"
        )
    return []


class LoRALinear(torch.nn.Module):
    """A frozen nn.Linear plus a trainable low-rank update. The frozen weight keeps its Hugging Face
    name (`...q_proj.weight`), so the base checkpoint loads into a wrapped model unchanged."""

    def __init__(
        self,
        base: torch.nn.Linear,
        rank: int,
        alpha: float,
        dropout: float,
        generator: torch.Generator,
    ):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight  # (out, in) frozen
        self.bias = base.bias  # (out,) frozen, or None
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        dt = base.weight.dtype
        self.lora_A = torch.nn.Parameter(torch.empty(rank, self.in_features, dtype=dt))  # (r, in)
        # PEFT's init: A like an nn.Linear's default (kaiming-uniform, a = sqrt(5)), B = 0
        torch.nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5), generator=generator)
        self.lora_B = torch.nn.Parameter(torch.zeros(self.out_features, rank, dtype=dt))  # (out, r)
        self.scaling = alpha / rank
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)  # (..., out)
        z = F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B)  # (..., r) -> (..., out)
        return y + self.scaling * z

    def fold_into(self, sd: dict, name: str):
        """learner.merged_state_dict's hook: replace this module's entries of a full state dict `sd`
        (under `name`) by the one plain weight an engine loads, W' = W + s * B @ A (in fp32, then
        back to W's dtype)."""
        # (r, in) (out, r) (out, in)
        A, B, W = sd.pop(f"{name}.lora_A"), sd.pop(f"{name}.lora_B"), sd[f"{name}.weight"]
        # (out, in)
        sd[f"{name}.weight"] = (W.float() + self.scaling * (B.float() @ A.float())).to(W.dtype)


def apply_lora(
    model: torch.nn.Module,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    seed: int = 0,
) -> torch.nn.Module:
    """Wrap every nn.Linear whose attribute name is in `targets` with LoRALinear, in place, and
    freeze everything else: afterwards only the adapters require grad. `seed` draws the A matrices
    (every rank must draw the same ones). Apply before shard_model and before make_learner (its
    optimizer takes the parameters that require grad)."""
    model.requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    wrapped = []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if name in targets and isinstance(child, torch.nn.Linear):
                setattr(parent, name, LoRALinear(child, rank, alpha, dropout, g))
                wrapped.append(f"{parent_name}.{name}" if parent_name else name)
    if not wrapped:
        raise ValueError(f"apply_lora: no nn.Linear named one of {list(targets)} in the model")
    # how runs.save_checkpoint / load_checkpoint write and read the adapters
    model.adapter = LoRAFiles()
    # what save_adapter writes into adapter_config.json
    model.lora_config = {
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted({w.rsplit(".", 1)[-1] for w in wrapped}),
    }
    return model


def _lora_modules(model: torch.nn.Module) -> list[tuple[str, LoRALinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


def _peft_name(name: str, which: str) -> str:
    """'model.layers.0.self_attn.q_proj', 'A' ->
    'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' (PEFT wraps the model twice, as
    `base_model.model`, and stores each adapter matrix as a Linear's weight)."""
    return f"base_model.model.{name}.lora_{which}.weight"


def save_adapter(model: torch.nn.Module, path: str, base_model: str = "") -> None:
    """Write `path/adapter_model.safetensors` (PEFT names) and `path/adapter_config.json` (PEFT
    fields). Only the adapters are gathered and written. Sharded: every rank calls it,
    rank 0 writes."""
    if is_sharded(model):
        sd = get_model_state_dict(
            model,
            options=StateDictOptions(
                full_state_dict=True, cpu_offload=True, ignore_frozen_params=True
            ),
        )
    else:
        sd = model.state_dict()
    if not is_main():
        return
    tensors = {}
    for name, _ in _lora_modules(model):
        for which in ("A", "B"):
            tensors[_peft_name(name, which)] = (
                sd[f"{name}.lora_{which}"].detach().cpu().contiguous()
            )
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
        **model.lora_config,
    }
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def load_adapter(model: torch.nn.Module, path: str) -> torch.nn.Module:
    """Copy the adapters in `path` (save_adapter's files) into a model wrapped by apply_lora with
    the same rank and targets. Every adapter must be present and no other name; every rank reads
    the files."""
    with open(os.path.join(path, "adapter_config.json")) as f:
        config = json.load(f)
    if config["r"] != model.lora_config["r"] or float(config["lora_alpha"]) != float(
        model.lora_config["lora_alpha"]
    ):
        raise ValueError(
            f"adapter {path}: r={config['r']}, alpha={config['lora_alpha']} but the model has "
            f"r={model.lora_config['r']}, alpha={model.lora_config['lora_alpha']}"
        )
    tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
    names = {_peft_name(n, w): f"{n}.lora_{w}" for n, _ in _lora_modules(model) for w in ("A", "B")}
    if set(tensors) != set(names):
        raise ValueError(
            f"adapter {path}: missing {sorted(set(names) - set(tensors))[:5]}, "
            f"unexpected {sorted(set(tensors) - set(names))[:5]}"
        )
    sd = {names[k]: v for k, v in tensors.items()}
    if is_sharded(model):  # each rank keeps its shard of the full tensors
        set_model_state_dict(
            model, sd, options=StateDictOptions(full_state_dict=True, strict=False)
        )
    else:
        with torch.no_grad():
            params = dict(model.named_parameters())
            for k, v in sd.items():
                params[k].copy_(v)
    return model


class LoRAFiles:
    """The `adapter` apply_lora puts on a model: runs.save_checkpoint writes only the adapters
    (PEFT's files) and load_checkpoint reads them back, through these two calls."""

    save = staticmethod(save_adapter)
    load = staticmethod(load_adapter)
