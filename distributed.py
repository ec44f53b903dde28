"""distributed.py: torchrun's process group and FSDP2, as the few helpers every entry point uses the
same way.

`python train.py` is one process and every helper here is then a no-op (is_main() is True,
broadcast_object returns its argument, shard_model returns the model, on the GPU if there is one).
Under `torchrun --nproc_per_node N` (or Ray learner actors, cluster.py) rank 0 alone plays,
evaluates, logs and writes; every rank joins the collectives: the batch's broadcast, the sharded
forward and backward, the full state dict's gather. Docs: docs/scaling.md.

Imports: none of our files (torch, the standard library).
"""

import contextlib
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)


# `python train.py` is one process and none of this does anything. Under torchrun every rank builds
# the same model and calls the same learner functions on the same global batch; the learner splits
# rows across ranks (learner.py's docstring, point 4). Every forward and backward of a sharded model
# is a collective (parameters are all-gathered per layer), so every rank must run the same number of
# them: `microbatch.rank_micro_batches` pads a rank that has fewer rows with zero-weight
# micro-batches.


def init_distributed() -> tuple[int, int]:
    """Join torchrun's process group (RANK, WORLD_SIZE, MASTER_ADDR... in the environment) or stay a
    single process. gloo on CPU, NCCL on GPUs (one GPU per rank: LOCAL_RANK). -> (rank, world
    size)"""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl")
        else:
            dist.init_process_group("gloo")
    return get_rank(), get_world_size()


def cleanup_distributed() -> None:
    """Leave the process group (a no-op in one process). Every rank calls it at the end of an entry
    point."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def barrier() -> None:
    """Wait for every rank (a no-op in one process): e.g. until rank 0 has built a shared file."""
    if dist.is_initialized() and not _ALONE[0]:
        dist.barrier()


_ALONE = [False]  # inside alone(): this rank works by itself, as if it were the only process


@contextlib.contextmanager
def alone():
    """Rank 0 doing work the other ranks wait for (sft.model_folder builds the default model):
    inside, the helpers see one process (rank 0 of 1), so no collective is started that the waiting
    ranks would never join and no rows are split across ranks. The build is then the one `python
    train.py` makes."""
    before = _ALONE[0]
    _ALONE[0] = True
    try:
        yield
    finally:
        _ALONE[0] = before


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() and not _ALONE[0] else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() and not _ALONE[0] else 1


def is_main() -> bool:
    """Rank 0: the only rank that logs, evaluates and writes files."""
    return get_rank() == 0


def _on_gpu() -> bool:
    return dist.is_initialized() and dist.get_backend() == "nccl"


def all_reduce_(t: torch.Tensor, op=None) -> torch.Tensor:
    """In-place all_reduce (default SUM) of a CPU tensor; NCCL only reduces GPU tensors, so it goes
    there and back."""
    if get_world_size() == 1:
        return t
    op = dist.ReduceOp.SUM if op is None else op
    if _on_gpu():
        g = t.cuda()
        dist.all_reduce(g, op=op)
        t.copy_(g.cpu())
    else:
        dist.all_reduce(t, op=op)
    return t


def broadcast_object(obj, src: int = 0):
    """Rank src's Python object on every rank (pickled): the rollout batch that rank 0 generated."""
    if get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(
        box,
        src=src,
        device=torch.device("cuda", torch.cuda.current_device()) if _on_gpu() else None,
    )
    return box[0]


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def shard_model(model: torch.nn.Module, cfg) -> torch.nn.Module:
    """FSDP2 (https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html), written out: each
    decoder layer is its own unit (its parameters are all-gathered just before it runs and freed
    after), then the root takes what is left (embeddings, final norm, lm_head; a Critic's value
    head). In one process the model comes back unsharded, moved to the GPU if there is one. On GPUs
    the model moves to this rank's GPU and, with cfg.mixed_precision, computes in bf16 while
    gradients are reduced in fp32 (the fp32 master weights stay sharded)."""
    if get_world_size() == 1:
        if torch.cuda.is_available():
            return model.to(torch.device("cuda", torch.cuda.current_device()))
        return model
    mp = MixedPrecisionPolicy()  # CPU: compute in the parameters' own dtype
    if _on_gpu():
        model.to(torch.device("cuda", torch.cuda.current_device()))
        if cfg.mixed_precision:
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    decoder = getattr(model, "backbone", model)  # a learner.Critic wraps the policy's decoder
    for layer in decoder.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    if hasattr(model, "token_logprobs"):
        # FSDP2 hooks forward() only; the learner enters through token_logprobs, so hook that too
        register_fsdp_forward_method(model, "token_logprobs")
    # Our micro-batch weights already make the per-rank losses sum to the global loss: sum the
    # gradients, do not average them (FSDP's default divides by the world size). Plain SUM
    # collectives: gloo has no pre-multiplied sum. Each fully_shard unit keeps its own setting, so
    # set it on all of them.
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
    return model


FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model as plain tensors with their Hugging Face names (LoRA adapters included as
    `<module>.lora_A`/`.lora_B`; see merged_state_dict for the engine's view). Sharded: every rank
    must call it (it all-gathers); rank 0 gets the dict on the CPU, the others an empty dict. One
    process: the live state_dict (no copy, as before)."""
    if not is_sharded(model):
        return model.state_dict()
    sd = get_model_state_dict(model, options=FULL_STATE)
    return sd if is_main() else {}
