"""async_rollouts.py: the async schedule, a wing of train.py (rollout.async_rollouts): later batches are sampled
while the learner trains on this one, up to rollout.max_staleness updates ahead, optionally with new weights swapped
into generations in flight (rollout.partial_rollouts).

  AsyncSchedule     where each step's batch comes from, and from which weights: the same calls as train.SyncSchedule
                    (take, before_push, pushes, push, pending, shutdown), so the loop never asks which it has.
  ConcurrentEngine  the piece of rollout.TorchEngine this needs (rollout.make_engine adds it when async rollouts are
                    on): one generate at a time across threads, and a push during a generation applied at its next
                    token boundary, each token recording the version of the weights that sampled it.
  staleness_metrics rollout/staleness and rollout/staleness_max.
The learner corrects the staleness with learner.off_policy (algos.off_policy_weights). Docs: docs/async.md.

Imports: rollout.py, model.py, runs.py (and torch, the standard library).
"""
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch

from model import KVCache
from rollout import TorchEngine
from runs import load_pending


# -----------------------------------------------------------------------------
# the schedule

class AsyncSchedule:
    """Where each step's batch comes from, and from which weights (a batch's `version`: the updates they had seen).

    Synchronous runs (train.SyncSchedule): sampled when step s begins, from the weights after update s-1.
    Async, k = rollout.max_staleness: a background thread samples the batches in step order, one at a time, and
    batch s comes from the weights after update v(s) = max(0, s-1-k): it is trained min(k, s-1) updates late,
    corrected by learner.off_policy. take(s) hands the learner batch s and releases batch s+k (its weights, after
    update s-1, are in the engine by then), so up to k batches are queued or being sampled while the learner trains.
      partial_rollouts off: the engine holds one version at a time, so before update s is pushed, before_push() lets
        every batch released so far finish; batch s then comes entirely from v(s) and a run repeats exactly (its seeds
        are mix_seed(seed, s, ...), its weights fixed by the schedule). k = 1 is the one-step async of before; k > 1
        adds staleness but no overlap (each push waits for the batch in flight).
      partial_rollouts on: the push does not wait: the engine applies it at the next token boundary of the
        generation in flight (ConcurrentEngine), whose later tokens carry the new version. Every token of batch s
        still comes from weights of version >= v(s) (staleness <= k), the learner waits only for batch s itself,
        and the engine runs up to k batches ahead. Which token gets which version depends on timing.
    Every sampled token records its version (the engine's with partial rollouts, else the schedule's, stamped here):
    rollout/staleness and rollout/staleness_max are the mean and the max over sampled tokens of (the learner's
    version - the token's). A batch over the bound (possible only when a resumed run's queue was sampled under a
    larger max_staleness) is dropped and sampled again from the current weights (rollout/stale_dropped). pending()
    is the queue a checkpoint saves, so a resumed run continues it."""

    overlaps = True          # the engine samples during the update: it must not sleep

    @classmethod
    def from_config(cls, cfg, collect, rollouts, start: int, resume: str, main: bool) -> "AsyncSchedule":
        """The schedule of a run (train.build_schedule): the queue of a resumed run's checkpoint, and with partial
        rollouts the engine's version numbering set to the RL step. Every rank builds one (pushes() decides who joins
        the weights' gather); rank 0 (main) alone samples."""
        if main and cfg.rollout.partial_rollouts:
            rollouts.engine.version = start       # the engine numbers its weights by RL step, as the schedule does
        return cls(collect, cfg.steps, main, cfg.rollout.max_staleness, cfg.rollout.partial_rollouts,
                   load_pending(resume) if resume else None)

    def __init__(self, collect, steps: int, enabled: bool, max_staleness: int = 1, partial: bool = False,
                 pending: dict | None = None):
        self.collect, self.steps, self.k, self.partial = collect, steps, max_staleness, partial   # collect(step)
        self.pool = ThreadPoolExecutor(max_workers=1) if enabled else None
        self.ready = dict(pending or {})    # step -> (trajectories, metrics, seconds, version): sampled, not taken
        self.futures = {}                   # step -> the Future of the same, released to the background thread
        self.waited = 0.0                   # seconds the learner waited for the background thread this step

    def _sample(self, step: int, version: int) -> tuple:
        t0 = time.time()
        trajs, metrics = self.collect(step)
        if not self.partial:                # the engine held `version` throughout
            for t in trajs:
                t.versions = [version if m else -1 for m in t.loss_mask]
        return trajs, metrics, time.time() - t0, version

    def _result(self, step: int):
        t0 = time.time()
        self.ready[step] = self.futures.pop(step).result()
        self.waited += time.time() - t0

    def take(self, step: int) -> tuple[list, dict, float]:
        """This step's (trajectories, metrics, the engine's seconds for them); in async mode it then releases batch
        step + k, from the weights as they are now (after update step - 1)."""
        self.waited = 0.0
        if step in self.futures:
            self._result(step)
        trajs, metrics, seconds, _ = self.ready.pop(step) if step in self.ready else self._sample(step, step - 1)
        stale = staleness_metrics(trajs, step - 1)
        if stale["rollout/staleness_max"] > (self.k if self.pool is not None else 0):
            trajs, metrics, seconds, _ = self._sample(step, step - 1)
            stale = {**staleness_metrics(trajs, step - 1), "rollout/stale_dropped": 1.0}
        if self.pool is not None:
            for s in range(step + 1, min(step + self.k, self.steps) + 1):
                if s not in self.ready and s not in self.futures:
                    self.futures[s] = self.pool.submit(self._sample, s, max(0, s - 1 - self.k))
        return trajs, {**metrics, **stale}, seconds

    def before_push(self, step: int) -> dict:
        """Before the push of update `step`: without partial rollouts, block until every released batch is sampled
        (they need the older weights) -> the seconds the learner waited for the background thread, this step."""
        if not self.partial:
            for s in sorted(self.futures):
                self._result(s)
        return {"perf/rollout_wait_seconds": self.waited} if self.waited or self.futures or self.ready else {}

    def pushes(self, updated: bool) -> bool:
        """Whether this step's weights go to the engine: with partial rollouts every step, skipped or not (tokens
        from here on are version `step`); else only after an update."""
        return updated or self.partial

    def push(self, rollouts, weights: dict, step: int) -> dict:
        """The push, after before_push: with partial rollouts tagged with its version (the engine applies it at the
        next token boundary of the generation in flight)."""
        return rollouts.update_weights(weights, version=step) if self.partial else rollouts.update_weights(weights)

    def pending(self) -> dict | None:
        """The queue a checkpoint saves: every released batch, sampled (a batch in flight is waited for)."""
        for s in sorted(self.futures):
            self._result(s)
        return dict(self.ready) or None

    def shutdown(self):
        if self.pool is not None:
            self.pool.shutdown()


def staleness_metrics(trajs: list, learner_version: int) -> dict:
    """rollout/staleness (mean) and rollout/staleness_max over every sampled token of the batch: updates between the
    weights that sampled it and the learner's (Trajectory.versions)."""
    lags = [learner_version - v for t in trajs for v, m in zip(t.versions, t.loss_mask) if m]
    return {"rollout/staleness": sum(lags) / len(lags) if lags else 0.0,
            "rollout/staleness_max": float(max(lags, default=0))}


# -----------------------------------------------------------------------------
# the engine piece: generations in a background thread, pushes at token boundaries

class ConcurrentEngine(TorchEngine):
    """A TorchEngine that a background thread samples from while the loop pushes and probes (the sync gate).

    Calls from several threads run one at a time. Partial rollouts: a push that arrives during a generation is
    applied at its next token boundary, and the keys and values of every token so far are recomputed with the new
    weights (as AReaL does, 2505.24298; PipelineRL keeps the old ones instead), so each token's log-prob is exactly
    log pi_v(token | everything before it) under the version v it records (Generation.versions).
    """

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        self.version = 0                # the weights' version, as the pusher numbers them (update_weights)
        self._call = threading.Lock()   # one generate at a time (the async producer and the sync gate share us)
        self._lock = threading.Lock()   # guards _in_flight and _pending
        self._in_flight = False         # a generate is running: a push waits for its next token boundary
        self._pending = None            # (state dict, version) pushed during a generate, not yet applied
        self._versions = []             # (N,) the weights' version at each step of the batch in progress

    def generate(self, prompts, params):
        with self._call:
            with self._lock:
                self._in_flight = True
            try:
                return super().generate(prompts, params)
            finally:
                with self._lock:
                    self._in_flight, pending, self._pending = False, self._pending, None
                    if pending is not None:     # pushed after the last token boundary
                        self._load(*pending)

    def _generate_batch(self, prompts, params, generator, device):
        self._versions = []
        gens = super()._generate_batch(prompts, params, generator, device)
        return [replace(g, versions=self._versions[:len(g.token_ids)]) for g in gens]

    def _token_boundary(self, prompts, rows, real, tokens, cache: KVCache, prompt_end: int, h) -> tuple:
        cache, h = super()._token_boundary(prompts, rows, real, tokens, cache, prompt_end, h)
        if self._pending is not None:      # partial rollouts: new weights from here on
            cache, h = self._swap_weights(prompts, rows, real, tokens, cache, prompt_end, h)
        self._versions.append(self.version)
        return cache, h

    def _swap_weights(self, prompts, rows, real, tokens, cache: KVCache, prompt_end: int, h) -> tuple:
        """A token boundary of partial rollouts: load the pending push, then run every row's tokens so far (prompt and
        generated, in their cache columns) through the new weights into a fresh cache -> (cache, h (b, 1, H) the last
        position's hidden state, from which the next token is sampled)."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return cache, h
        self._load(*pending)
        device, P = real.device, cache.pos                                       # P = prompt_end + tokens fed
        ids = torch.full((len(rows), P), self.pad_id, dtype=torch.long, device=device)    # (b, P)
        for j, r in enumerate(rows.tolist()):
            ids[j, real[j, :prompt_end].nonzero().squeeze(1)] = torch.tensor(prompts[r], device=device)
        ids[:, prompt_end:] = tokens[rows, :P - prompt_end]
        positions = (real[:, :P].long().cumsum(-1) - 1).clamp(min=0)             # (b, P) real tokens only
        fresh = KVCache(self.model.cfg, len(rows), cache.max_len, dtype=cache.k[0].dtype, device=device)
        return fresh, self.model.hidden_states(ids, positions, real, fresh)[:, -1:]

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int | None = None):
        """rollout.TorchEngine.update_weights; `version` (default: one more than the current) tags the tokens sampled
        from then on. During a generate in another thread the dict is copied and applied at that generation's next
        token boundary; this call does not wait for it."""
        self._check(state_dict)
        with self._lock:
            if self._in_flight:             # the caller's tensors may change before the boundary: keep a copy
                self._pending = ({k: v.detach().clone() for k, v in state_dict.items()}, version)
                return
            self._load(state_dict, version)

    @torch.no_grad()
    def _load(self, state_dict: dict, version: int | None = None):
        super()._load(state_dict)
        self.version = self.version + 1 if version is None else version
