"""batch.py: trajectories as right-padded tensors, the boundary between agent loop and learner.

to_batch(trajectories, pad_id) -> RolloutBatch: every episode's row, or the rows it lists
(agent.Trajectory.rows: a client that rewrote its history, a memory policy's segments), stacked into
(B, T) tensors, each row told its episode (RolloutBatch.episode) and its turns numbered within the
episode, so that advantages are computed per episode and given back to all its rows
(RolloutBatch.episode_rows; train.compute_advantages).

Shapes: B rows (one per episode, unless an episode lists rows), T tokens (the longest row; shorter
ones right-padded), K turns, E episodes, G group size.
Imports: agent.py (Trajectory) (and torch).
"""

from dataclasses import dataclass

import torch

from agent import Trajectory


@dataclass
class RolloutBatch:
    """Trajectories as right-padded tensors, rows in the order given (group-major from
    run_episodes). An episode is one row, or the several rows it lists (Trajectory.rows); the
    per-episode fields (rewards, turn_rewards, turn_mask, turn_states, length_cut) are repeated on
    each of its rows, and `episode` says whose row a row is. to_batch fills every field;
    kept_sizes, length_cut and episode default to None for a batch built by hand, and their
    comments say how None is read."""

    # (B, T) long, right-padded with pad_id
    input_ids: torch.Tensor
    # (B, T) float, 1 on sampled tokens, 0 on prompt/observation/forced/padding
    loss_mask: torch.Tensor
    # (B, T) float, the engine's log-prob of token t (0 where the mask is 0)
    logprobs: torch.Tensor
    # (B,) float, the episode's reward
    rewards: torch.Tensor
    # (B, K) float, each assistant turn's reward (K = the most turns; 0 past the last)
    turn_rewards: torch.Tensor
    # (B, K) float, 1 on the turns the episode took
    turn_mask: torch.Tensor
    # (B, T) long, the assistant turn of each sampled token, -1 elsewhere
    turn_index: torch.Tensor
    # (B, K) long, the state key of each turn (Trajectory.turn_states), -1 past the last
    turn_states: torch.Tensor
    # (B,) long, real tokens per row (the rest is padding)
    lengths: torch.Tensor
    # (B, T) long, the size of the top-k / top-p set the engine drew token t from (-1: not
    # reported, the learner infers it), 0 on tokens drawn from the whole vocabulary, on tokens not
    # sampled and on padding. None (a batch built by hand): read as all 0
    kept_sizes: torch.Tensor | None = None
    # (B,) bool, a length limit cut the row's episode (Trajectory.length_cut). None (a batch built
    # by hand): read as no episode cut
    length_cut: torch.Tensor | None = None
    # (B,) long, the episode of each row, 0..E-1 in row order (group-major). None (a batch built by
    # hand): read as one row per episode
    episode: torch.Tensor | None = None

    def episode_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(B,) each row's episode and (E,) each episode's last row. A group baseline is taken over
        episodes, each read from its last row (where its last turn and its reward are), then given
        back to every row of it."""
        B = len(self.rewards)
        episode = self.episode if self.episode is not None else torch.arange(B)  # (B,)
        # (B,) a row ends its episode when the next row is another episode's (the last row does)
        ends = torch.ones(B, dtype=torch.bool)
        ends[:-1] = episode[1:] != episode[:-1]
        return episode, ends.nonzero()[:, 0]  # (B,), (E,)


def to_batch(trajs: list[Trajectory], pad_id: int) -> RolloutBatch:
    """Stack trajectories into right-padded tensors (T = the longest row): each episode's row, or
    its rows (Trajectory.rows), a row's turns numbered within its episode."""
    if not trajs:
        raise ValueError("to_batch needs at least one trajectory")
    rows = [r for t in trajs for r in (t.rows or [t])]
    episode = [e for e, t in enumerate(trajs) for _ in (t.rows or [t])]
    eps = [trajs[e] for e in episode]  # each row's episode
    first_turn = [
        sum(len(r.turn_starts) for r in t.rows[:j])
        for t in trajs
        for j in range(len(t.rows or [t]))
    ]
    loss_mask = pad_right([t.loss_mask for t in rows], 0.0, torch.float)  # (B, T)
    turns = [[1.0] * len(t.turn_rewards) for t in eps]
    # a row's per-token fields (B, T) and length come from the row itself; its per-turn fields
    # (B, K), reward and length_cut from its episode (eps)
    return RolloutBatch(
        input_ids=pad_right([t.token_ids for t in rows], pad_id, torch.long),
        loss_mask=loss_mask,
        logprobs=pad_right([t.logprobs for t in rows], 0.0, torch.float),
        kept_sizes=pad_right([t.kept_sizes or [0] * len(t.token_ids) for t in rows], 0, torch.long),
        rewards=torch.tensor([t.reward for t in eps], dtype=torch.float),
        turn_rewards=pad_right([t.turn_rewards or [0.0] for t in eps], 0.0, torch.float),
        turn_mask=pad_right([m or [0.0] for m in turns], 0.0, torch.float),
        turn_index=_turn_index([t.turn_starts for t in rows], loss_mask, first_turn),
        turn_states=pad_right([t.turn_states or [-1] for t in eps], -1, torch.long),
        lengths=torch.tensor([len(t.token_ids) for t in rows], dtype=torch.long),
        length_cut=torch.tensor([t.length_cut for t in eps], dtype=torch.bool),
        episode=torch.tensor(episode, dtype=torch.long),
    )


def _turn_index(
    turn_starts: list[list[int]], loss_mask: torch.Tensor, first_turn: list[int]
) -> torch.Tensor:
    """(B, T) the assistant turn each sampled token belongs to (the last turn starting at or before
    it, counted from the row's first_turn), -1 on every token the policy did not sample (prompt,
    observations, forced <|im_end|>, padding)."""
    B, T = loss_mask.shape
    # starts (B, K), padded with T (no turn starts there); pos and turn (B, T): the last turn that
    # starts at or before each position, -1 before the first
    starts = pad_right([s or [T] for s in turn_starts], T, torch.long)
    pos = torch.arange(T).expand(B, T).contiguous()
    turn = torch.searchsorted(starts, pos, right=True) - 1
    first = torch.tensor(first_turn, dtype=torch.long)[:, None]  # (B, 1)
    return torch.where(loss_mask.bool() & (turn >= 0), turn + first, -1)


def pad_right(rows: list[list], value, dtype: torch.dtype) -> torch.Tensor:
    """Rows of different lengths as one (B, T) tensor, T the longest row, filled with `value` past
    each row's end (to_batch's trajectories; sft.py's demonstrations)."""
    out = torch.full((len(rows), max(len(r) for r in rows)), value, dtype=dtype)  # (B, T)
    for b, row in enumerate(rows):
        out[b, : len(row)] = torch.tensor(row, dtype=dtype)
    return out
