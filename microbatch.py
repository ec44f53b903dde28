"""microbatch.py: which rows of a batch run together, the plan every learner pass follows
(learner.py's scoring, update, critic and SFT): micro-batches capped by rows and by token positions,
rows of similar length together, balanced across torchrun's ranks, and the rows of a group that
share a prompt kept together so it runs once (model.SharedPrefix; Prefix Grouper, Liu et al. 2025,
https://arxiv.org/abs/2506.05433). How rows are split does not change the update (learner.py's
docstring, points 3 to 5), so this is free to pick what runs fastest.

  row_lens            each row's length up to its last trained token: what a pass needs to run
  rank_micro_batches  this rank's micro-batches: [MicroBatch(rows, dummy, shared)]
  positions_run       the token positions a micro-batch needs, and the ones it runs (their ratio
                      is perf/pad_fraction)

Shapes: B rows, T tokens, m rows of one micro-batch.
Imports: model.py (SharedPrefix), distributed.py (ranks) (and torch, the standard library).
"""

from typing import NamedTuple

import torch
import torch.distributed as dist

from distributed import all_reduce_, get_rank, get_world_size
from model import SharedPrefix


def row_lens(mask: torch.Tensor) -> torch.Tensor:
    """(B,) position of each row's last trained token + 1: the causal model never needs to look
    further, so everything after it is padding as far as the update is concerned. At least 2 (when T
    allows): a row with no trained token still makes a one-position loss that is 0 but has a graph,
    so its backward runs (under FSDP a rank that skipped it would leave the other ranks waiting in a
    collective)."""
    pos = torch.arange(1, mask.shape[1] + 1)
    return (mask.bool() * pos).max(dim=1).values.clamp(min=min(2, mask.shape[1]))  # (B,)


def _units(lens: torch.Tensor, share: tuple | None) -> list[tuple[torch.Tensor, int]]:
    """The rows that go to a micro-batch together, each unit with the length of the prefix its rows
    share: [(row indices, shared length)]. Without `share`, every row alone (shared length 0). With
    share = (input_ids, mask), the rows whose tokens before their first trained one are the same (a
    group's prompt: found from the ids, not assumed) form one unit, sharing their longest common
    prefix; a row with no partner stays alone."""
    if share is None:
        return [(torch.tensor([i]), 0) for i in range(len(lens))]
    ids, mask = share
    first = mask.bool().int().argmax(dim=1)  # (B,) first trained token
    keys: dict[bytes, list[int]] = {}
    for i in range(len(lens)):
        keys.setdefault(ids[i, : int(first[i])].numpy().tobytes(), []).append(i)
    units = []
    for rows in keys.values():
        rows = torch.tensor(rows)
        if len(rows) == 1:
            units.append((rows, 0))
            continue
        # the rows read `need` hidden states; they share them up to the first position where a row
        # differs from the first row, or all `need` of them
        need = int(lens[rows].max()) - 1
        differs = (ids[rows, :need] != ids[rows[:1], :need]).any(dim=0)  # (need,)
        units.append((rows, int(differs.int().argmax()) if bool(differs.any()) else need))
    return units


def _layout(
    units: list[tuple[torch.Tensor, int]], lens: torch.Tensor, always: bool = False
) -> tuple[torch.Tensor, SharedPrefix | None]:
    """A micro-batch of units -> (its rows, in order; the model's SharedPrefix over them, or None
    when no unit shares anything: the plain forward). A row alone in a shared micro-batch is run as
    a prefix of its own.
    always: a SharedPrefix with both forwards (prefixes, continuations) whatever the rows share, so
    that under FSDP every rank's micro-batches make the same sequence of collectives."""
    rows = torch.cat([r for r, _ in units])  # (m,)
    if all(p == 0 for _, p in units) and not always:
        return rows, None
    # per unit: the place of its first row in `rows` (start counts the rows placed so far) and its
    # prefix's length (a row alone: all but its last position); per row: its unit
    lead = []
    plens = []
    group = []
    start = 0
    for g, (r, p) in enumerate(units):
        lead.append(start)
        plens.append(p if p > 0 else int(lens[r[0]]) - 1)
        group += [g] * len(r)
        start += len(r)
    plens, group = torch.tensor(plens), torch.tensor(group)
    # the most positions past its prefix that any row needs (at least 1 when `always`)
    cont = int((lens[rows] - 1 - plens[group]).max().clamp(min=int(always)))
    return rows, SharedPrefix(torch.tensor(lead), plens, group, cont)


class MicroBatch(NamedTuple):
    rows: torch.Tensor  # (m,) long, rows of the (mini-)batch
    dummy: bool  # only there to join the collectives: weight 0
    # the rows' shared prefixes, indexing into rows (None: every row whole)
    shared: SharedPrefix | None


def rank_micro_batches(
    lens: torch.Tensor, size: int, max_tokens: int = 0, share: tuple | None = None
) -> list[MicroBatch]:
    """This rank's micro-batches, units of rows of similar length together (sorted), so a long row
    pads few short ones. The update does not depend on how rows are split (file docstring, point 3),
    so the grouping is free. Rank r takes every world-th unit of the sorted order (each rank gets a
    similar token count). As many units as fit `size` rows and, with max_tokens > 0, positions run
    (positions_run) <= max_tokens (one unit at least): short rows go many to a micro-batch, long
    ones few. share = (input_ids, mask): rows that share a prompt go together and run it once
    (_units; a group larger than `size` is split). A rank left with fewer micro-batches than the
    others gets `dummy` ones (the shortest row, weight 0): under FSDP each forward/backward is a
    collective that every rank must join."""
    units = []
    for rows, p in _units(lens, share):
        units += [(rows[i : i + size], p) for i in range(0, len(rows), size)]
    key = torch.tensor([int(lens[r].max()) for r, _ in units])
    order = torch.argsort(key, stable=True)
    mine = [units[i] for i in order[get_rank() :: get_world_size()].tolist()]
    both = share is not None and get_world_size() > 1  # FSDP: the same forwards on every rank

    # the positions a micro-batch of these units runs
    def cost(us) -> int:
        rows, shared = _layout(us, lens, both)
        return positions_run(lens[rows], shared)[1]

    plan = []
    current = []
    for u in mine:
        fits = sum(len(r) for r, _ in current) + len(u[0]) <= size and (
            max_tokens == 0 or cost(current + [u]) <= max_tokens
        )
        if current and not fits:
            plan.append(current)
            current = []
        current.append(u)
    if current:
        plan.append(current)
    plan = [
        MicroBatch(rows, False, shared) for rows, shared in (_layout(us, lens, both) for us in plan)
    ]
    if get_world_size() > 1:
        n = all_reduce_(torch.tensor([len(plan)]), dist.ReduceOp.MAX).item()
        shortest = torch.argsort(lens, stable=True)[:1]
        plan += [MicroBatch(shortest, True, _layout([(shortest, 0)], lens, both)[1])] * (
            n - len(plan)
        )
    return plan


def positions_run(lens: torch.Tensor, shared: SharedPrefix | None) -> tuple[int, int]:
    """(positions a micro-batch's rows need, positions it runs): row lengths up to the last trained
    token and rows x the longest; with shared prefixes each prefix once plus the continuations
    (padding included in the second). Their ratio is the work's padding share
    (perf/pad_fraction)."""
    if shared is None:
        return int(lens.sum()), len(lens) * int(lens.max())
    cont = (lens - 1 - shared.lens[shared.group]).clamp(min=0)  # (m,)
    return int(shared.lens.sum() + cont.sum()), (
        len(shared.lens) * int(shared.lens.max()) + len(lens) * shared.cont
    )
