"""qlora.py: QLoRA written out, a wing of learner.py (model.quantize=nf4, with
learner.lora_rank > 0).

The frozen base of a LoRA run stored as 4-bit NormalFloat (NF4) instead of fp32/bf16, as in Dettmers
et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs" (https://arxiv.org/abs/2305.14314):
blockwise absmax quantization (block 64) to the 16 NF4 levels, packed two codes a byte, and double
quantization of the absmax constants (block 256, 8 bits). Every forward dequantizes the weight on
the fly (pure torch, the same code on a GPU); the adapters stay in the model's dtype and are the
only parameters that train. The engine still gets plain full-precision
weights: each module's `fold_into` writes the dequantized base plus the adapter, W' = deq(W) + s * B
@ A, into learner.merged_state_dict's dict, so the weight-sync gate compares the engine against the
very weights the learner computes with. Adapter files are LoRA's own (lora.LoRAFiles, PEFT names):
QLoRALinear is a LoRALinear. train.build_learner calls apply_qlora instead of lora.apply_lora when
model.quantize=nf4. Docs: docs/qlora.md.

Shapes: N a weight's element count (out * in), nb = N / 64 blocks, ng = nb / 256 groups of absmax
constants, r LoRA rank, in/out a linear layer's input/output features.
Imports: wings/lora.py (and torch, the standard library).
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

from wings.lora import LoRALinear, apply_lora

BLOCK = 64  # weights per absmax constant (the paper's blocksize 64)
# absmax constants per second-level constant (the paper's blocksize 256 for double quantization)
ABSMAX_BLOCK = 256


def check_config(cfg) -> list:
    """config.WING_CHECKS' hook: model.quantize is none or nf4, and an NF4 base has LoRA adapters
    to train."""
    if cfg.model.quantize not in ("none", "nf4"):
        raise ValueError(
            f"model.quantize={cfg.model.quantize!r} must be 'none' or 'nf4' "
            "(4-bit NormalFloat base, QLoRA)"
        )
    if cfg.model.quantize == "nf4" and not cfg.learner.lora_rank:
        raise ValueError(
            "model.quantize=nf4 freezes the base in 4 bits, so only LoRA adapters can train: "
            "set learner.lora_rank > 0 (e.g. learner.lora_rank=16 learner.lr=2e-3), "
            "or model.quantize=none"
        )
    return []


# -----------------------------------------------------------------------------
# the NF4 data type (Dettmers et al. 2023, section 3 and appendix E)
#
# NF4 puts its 16 levels at quantiles of N(0, 1), rescaled into [-1, 1], so that each level receives
# the same share of normally distributed weights (information-theoretically optimal for N(0, sigma)
# data after absmax scaling). A symmetric k-bit quantile grid has no exact 0; NF4 is asymmetric
# instead: 8 quantiles for the positive half and 7 for the negative half, both ending at the same
# tail probability `offset`, plus an exact 0. bitsandbytes' create_normal_map uses offset =
# 0.9677083 = ((1 - 1/(2*15)) + (1 - 1/(2*16))) / 2, the mean of the tail probabilities that a
# 15-level and a 16-level grid would use; the paper's appendix E lists the values it gives.


def nf4_levels(offset: float = 0.9677083) -> torch.Tensor:
    """The 16 NF4 levels, ascending, in [-1, 1], with level 7 exactly 0: (16,) float32."""
    normal = torch.distributions.Normal(0.0, 1.0)
    # (8,) Q(offset) .. > 0
    pos = normal.icdf(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    # (7,) -Q(offset) .. < 0
    neg = -normal.icdf(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])
    levels = torch.cat([pos, neg, torch.zeros(1, dtype=torch.float64)]).sort().values  # (16,)
    return (levels / levels.max()).float()


NF4 = nf4_levels()  # (16,)
NF4_MAX_GAP = float((NF4[1:] - NF4[:-1]).max())  # 0.3038: the widest step, between -1 and -0.6962


# -----------------------------------------------------------------------------
# blockwise quantization (pure functions: tensors in, tensors out)


def pack4(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte, the first in the high nibble: (N,) uint8 in [0, 16), N even ->
    (N/2,) uint8."""
    return (codes[0::2] << 4) | codes[1::2]


def unpack4(packed: torch.Tensor) -> torch.Tensor:
    """pack4's inverse: (N/2,) uint8 -> (N,) uint8."""
    return torch.stack([packed >> 4, packed & 15], dim=-1).flatten()  # (N/2, 2) -> (N,)


def quantize_blockwise(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Absmax quantization to NF4, block by block: each block of `block` consecutive weights
    (row-major) is divided by its largest magnitude c and every weight takes the nearest NF4 level.
    w: any shape, N elements with N a multiple of `block` -> (codes (N,) uint8 in [0, 16),
    absmax c (nb,) float32)."""
    x = w.detach().float().reshape(-1, block)  # (nb, block)
    absmax = x.abs().amax(dim=1)  # (nb,)
    x = x / absmax.clamp_min(torch.finfo(torch.float32).tiny)[:, None]  # (nb, block) in [-1, 1]
    mids = (NF4[1:] + NF4[:-1]).to(x.device) / 2  # (15,) decision boundaries
    codes = torch.bucketize(x, mids).to(torch.uint8)  # (nb, block) nearest level
    return codes.flatten(), absmax


def dequantize_blockwise(
    codes: torch.Tensor, absmax: torch.Tensor, block: int = BLOCK, levels: torch.Tensor = NF4
) -> torch.Tensor:
    """w ~ NF4[code] * c, block by block: codes (N,) uint8, absmax (nb,) -> (N,) float32."""
    x = levels.to(absmax.device)[codes.long()].reshape(-1, block)  # (nb, block)
    return (x * absmax[:, None].float()).flatten()  # (N,)


def quantize_absmax(
    absmax: torch.Tensor, block: int = ABSMAX_BLOCK
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Double quantization (paper, section 3): the fp32 absmax constants are quantized again, to 8
    bits, in blocks of `block`. They are all positive, so their mean is subtracted first to centre
    them for a symmetric quantizer.
    Departure: the paper uses 8-bit floats (blockwise dynamic quantization); this uses symmetric
    int8 with one fp32 scale per block, the same 8 bits, whose error is at most half a step,
    max|c - mean| / 254, for every constant.
    absmax (nb,) -> (q (nb,) int8, scale (ng,) float32, mean () float32)."""
    mean = absmax.mean()
    centred = absmax - mean  # (nb,)
    ng = -(-centred.numel() // block)
    padded = F.pad(centred, (0, ng * block - centred.numel())).reshape(ng, block)  # (ng, block)
    scale = padded.abs().amax(dim=1) / 127  # (ng,)
    q = torch.round(padded / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None])
    return q.flatten()[: absmax.numel()].to(torch.int8), scale, mean


def dequantize_absmax(
    q: torch.Tensor, scale: torch.Tensor, mean: torch.Tensor, block: int = ABSMAX_BLOCK
) -> torch.Tensor:
    """c ~ mean + q * scale: q (nb,) int8, scale (ng,), mean () -> (nb,) float32."""
    return mean + q.float() * scale.repeat_interleave(block)[: q.numel()]  # (nb,)


class NF4Weight(NamedTuple):
    """A weight stored as NF4 with double-quantized constants: ~0.516 bytes per weight (4 bits +
    8/64 bits + 32/(64 * 256) bits, the paper's 4.127 bits), against 4 (fp32) or 2 (bf16)."""

    codes: torch.Tensor  # (N/2,) uint8: two 4-bit NF4 codes per byte (pack4)
    absmax_q: torch.Tensor  # (nb,) int8: each block's absmax, quantized (quantize_absmax)
    absmax_scale: torch.Tensor  # (ng,) float32: one scale per 256 absmax constants
    # () float32: the mean subtracted from the constants before quantizing them
    absmax_mean: torch.Tensor


def quantize_nf4(w: torch.Tensor) -> NF4Weight:
    """A weight (any shape; its element count a multiple of 64) -> NF4Weight. Refuses a count that
    is not a multiple of the block rather than pad it: every projection of the supported models
    has one."""
    if w.numel() % BLOCK:
        raise ValueError(
            f"quantize_nf4: a weight of shape {tuple(w.shape)} has {w.numel()} elements, "
            f"not a multiple of the block size {BLOCK}"
        )
    codes, absmax = quantize_blockwise(w)
    return NF4Weight(pack4(codes), *quantize_absmax(absmax))


def dequantize_nf4(
    q: NF4Weight, shape: tuple, dtype: torch.dtype, levels: torch.Tensor = NF4
) -> torch.Tensor:
    """NF4Weight -> the weight it stands for, in `dtype` (computed in fp32)."""
    absmax = dequantize_absmax(q.absmax_q, q.absmax_scale, q.absmax_mean)  # (nb,)
    return dequantize_blockwise(unpack4(q.codes), absmax, levels=levels).reshape(shape).to(dtype)


# -----------------------------------------------------------------------------
# frozen NF4 layers
#
# A layer keeps only the NF4Weight as buffers (not parameters: they never train, and FSDP2 leaves
# buffers unsharded and optimizers never see them) and dequantizes in forward. The backward
# recomputes the dequantized weight instead of letting autograd save it: otherwise every layer's
# full-precision weight would stay alive from its forward to its backward, which is the memory
# quantization is for (bitsandbytes' MatMul4Bit does the same).

_FIELDS = NF4Weight._fields


def _store(module: torch.nn.Module, weight: torch.Tensor):
    """Quantize `weight` (out, in) into `module`'s buffers weight_codes, weight_absmax_q,
    weight_absmax_scale, weight_absmax_mean; remember its shape and dtype (what fold_into
    gives back)."""
    q = quantize_nf4(weight)
    for field, t in zip(_FIELDS, q):
        module.register_buffer(f"weight_{field}", t)
    # moves with the module to its device
    module.register_buffer("nf4_levels", NF4.clone(), persistent=False)
    module.weight_shape, module.weight_dtype = tuple(weight.shape), weight.dtype


def _nf4(module: torch.nn.Module) -> NF4Weight:
    return NF4Weight(*(getattr(module, f"weight_{field}") for field in _FIELDS))


def dequantized_weight(module: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The (out, in) weight an NF4 layer stands for, in `dtype`."""
    return dequantize_nf4(_nf4(module), module.weight_shape, dtype, module.nf4_levels)


class _NF4Matmul(torch.autograd.Function):
    """y = x deq(W)^T, whose backward dequantizes W again (nothing of W's size is saved for it). No
    gradient for W."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
        ctx.module = module
        return F.linear(x, dequantized_weight(module, x.dtype))  # (..., out)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        W = dequantized_weight(ctx.module, grad_y.dtype)  # (out, in)
        return grad_y @ W, None  # (..., in)


def nf4_linear(x: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    """An NF4 layer's frozen part, x deq(W)^T + b, computed in x's dtype: (..., in) -> (...,
    out)."""
    y = _NF4Matmul.apply(x, module)  # (..., out)
    return y if module.bias is None else y + module.bias.to(x.dtype)


def _fold_nf4(module: torch.nn.Module, sd: dict, name: str):
    """Replace `name`'s NF4 buffers in a full state dict by the plain weight they stand for (the
    engine's name and dtype). Reads the dict's tensors, so it works on a gathered (FSDP) dict as on
    a live one."""
    q = NF4Weight(*(sd.pop(f"{name}.weight_{field}") for field in _FIELDS))
    sd[f"{name}.weight"] = dequantize_nf4(q, module.weight_shape, module.weight_dtype)  # (out, in)


class NF4Linear(torch.nn.Module):
    """A frozen nn.Linear stored as NF4: the weight dequantized in every forward, the bias kept as
    is (frozen). learner.merged_state_dict folds it (fold_into) into the plain `<name>.weight` an
    engine loads."""

    def __init__(self, base: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        _store(self, base.weight)
        self.bias = base.bias  # (out,) frozen, or None
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nf4_linear(x, self)

    def fold_into(self, sd: dict, name: str):
        _fold_nf4(self, sd, name)


class QLoRALinear(LoRALinear):
    """A LoRALinear whose frozen weight is stored as NF4: y = x deq(W)^T + b + s * dropout(x) A^T
    B^T. Built from the LoRALinear that lora.apply_lora made, so its adapters (A drawn as a LoRA run
    draws it, B = 0) and scaling are that module's, and LoRA's adapter files and hooks serve it
    unchanged (it is a LoRALinear)."""

    def __init__(self, lora: LoRALinear):
        # not LoRALinear.__init__: it would draw new adapters; these are `lora`'s
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = lora.in_features, lora.out_features
        _store(self, lora.weight)
        self.bias = lora.bias  # (out,) frozen, or None
        self.lora_A, self.lora_B = lora.lora_A, lora.lora_B  # (r, in), (out, r)
        self.scaling, self.dropout = lora.scaling, lora.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nf4_linear(x, self)  # (..., out)
        # (..., out)
        z = F.linear(F.linear(self.dropout(x), self.lora_A.to(x.dtype)), self.lora_B.to(x.dtype))
        return y + self.scaling * z

    def fold_into(self, sd: dict, name: str):
        """deq(W) into `name.weight` first, then LoRA's fold: W' = deq(W) + s * B @ A."""
        _fold_nf4(self, sd, name)
        super().fold_into(sd, name)


# -----------------------------------------------------------------------------
# the entry point train.build_learner calls


def quantize_linears(model: torch.nn.Module) -> torch.nn.Module:
    """In place: every nn.Linear and LoRALinear inside the decoder layers (model.model.layers)
    becomes NF4Linear or QLoRALinear. The embeddings, the norms and lm_head stay as they are (as in
    bitsandbytes' default, which keeps lm_head; the default and Qwen2.5 small models tie it to the
    embedding). The full-precision weights are dropped as each layer is converted, so the peak is
    the fp model plus one layer."""
    layers = model.model.layers
    for parent in list(layers.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LoRALinear) and not isinstance(child, QLoRALinear):
                setattr(parent, name, QLoRALinear(child))
            elif isinstance(child, torch.nn.Linear):
                setattr(parent, name, NF4Linear(child))
    return model


def apply_qlora(
    model: torch.nn.Module,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    seed: int = 0,
) -> torch.nn.Module:
    """lora.apply_lora (same arguments, same adapters), then every linear layer of the decoder
    quantized to NF4 (quantize_linears): only the adapters require grad, the base is ~0.52 bytes per
    weight. Apply before shard_model and make_learner, as apply_lora."""
    return quantize_linears(apply_lora(model, rank, alpha, dropout, targets, seed))
