"""async_rollouts.py: the async schedule, a wing of train.py (rollout.async_rollouts): later batches
are sampled while the learner trains on this one, up to rollout.max_staleness updates ahead,
optionally with new weights swapped into generations in flight (rollout.partial_rollouts).

  AsyncSchedule     where each step's batch comes from, and from which weights: the calls of
                    train.SyncSchedule (before_push, pushes, push, pending, shutdown), and take(s),
                    the batch it sampled ahead, which train.main asks for where the sync schedule
                    calls collect_rollouts itself (overlaps: True).
  ConcurrentEngine  the piece of rollout.TorchEngine this needs (rollout.make_engine adds it when
                    async rollouts are on): one generate at a time across threads, and a push during
                    a generation applied at its next token boundary, each token recording the
                    version of the weights that sampled it.
  SwapRecord        partial rollouts: where each push landed (per generate call of the background
                    thread, the token step at which each version took over), written to the run
                    folder and carried by checkpoints, so a run is replayed bit for bit from it
                    (rollout.partial_replay) and a resumed run re-samples exactly what the
                    kill lost.
  staleness_metrics rollout/staleness and rollout/staleness_max.
The learner corrects the staleness with learner.off_policy (algos.off_policy_weights). Docs:
docs/async.md.

Imports: rollout.py, runs.py (and torch, the standard library).
"""

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import replace

import torch

from rollout import DECODE_RESERVE, KVCache, TorchEngine
from runs import load_pending


# -----------------------------------------------------------------------------
# the schedule


def check_config(cfg) -> list:
    """config.WING_CHECKS' hook: the async schedule's settings (rollout.async_rollouts,
    max_staleness, partial_rollouts, partial_replay), checked at load. No choices of its
    own ([])."""
    rollout = cfg.rollout
    if rollout.async_rollouts and cfg.learner.off_policy.kind == "none":
        raise ValueError(
            "rollout.async_rollouts trains on samples from the previous weights: set "
            "learner.off_policy.kind=tis (learner.off_policy.tis_cap, e.g. 2.0) or mis so "
            "importance sampling corrects for them"
        )
    if rollout.max_staleness < 1:
        raise ValueError(
            f"rollout.max_staleness={rollout.max_staleness} must be >= 1 (updates the engine may "
            "run ahead of the learner; 1: one-step async)"
        )
    if rollout.max_staleness > 1 and not rollout.async_rollouts:
        raise ValueError(
            f"rollout.max_staleness={rollout.max_staleness} bounds async rollouts: "
            "set rollout.async_rollouts=true "
            "(without it every batch is sampled from the current weights)"
        )
    if rollout.partial_rollouts and not (
        rollout.async_rollouts and rollout.engine == "torch" and not cfg.ray.rollout_workers
    ):
        raise ValueError(
            "rollout.partial_rollouts swaps weights into a generation in flight: it needs "
            "rollout.async_rollouts=true and the in-process torch engine (rollout.engine=torch, "
            "ray.rollout_workers=0)"
        )
    if rollout.partial_replay and not rollout.partial_rollouts:
        raise ValueError(
            f"rollout.partial_replay={rollout.partial_replay!r} replays where the pushes of a run "
            "with partial rollouts landed: set rollout.partial_rollouts=true (without it no push "
            "lands mid-generation, and a run repeats exactly anyway)"
        )
    if (
        rollout.async_rollouts
        and rollout.engine == "vllm"
        and (rollout.top_p < 1 or rollout.top_k > 0)
    ):
        raise ValueError(
            "rollout.engine=vllm with top_p < 1 or top_k > 0 needs synchronous rollouts: vLLM does "
            "not report the kept set, and the learner infers it from the sampled token's log-prob "
            "on its own weights, which async rollouts have already moved (engine_vllm.VLLMEngine). "
            "Use rollout.async_rollouts=false, or rollout.engine=torch"
        )
    return []


class AsyncSchedule:
    """Where each step's batch comes from, and from which weights (a batch's `version`: the updates
    they had seen).

    Synchronous runs (train.SyncSchedule): sampled when step s begins, from the weights after update
    s-1. Async, k = rollout.max_staleness: a background thread samples the batches in step order,
    one at a time, and batch s comes from the weights after update v(s) = max(0, s-1-k): it is
    trained min(k, s-1) updates late, corrected by learner.off_policy. take(s) hands the learner
    batch s and releases batch s+k (its weights, after update s-1, are in the engine by then), so up
    to k batches are queued or being sampled while the learner trains.
      partial_rollouts off: the engine holds one version at a time, so before update s is pushed,
        before_push() lets every batch released so far finish; batch s then comes entirely from v(s)
        and a run repeats exactly (its seeds are mix_seed(seed, s, ...), its weights fixed by the
        schedule). k = 1 is the one-step async of before; k > 1 adds staleness but no overlap (each
        push waits for the batch in flight).
      partial_rollouts on: the push does not wait: the engine applies it at the next token boundary
        of the generation in flight (ConcurrentEngine), whose later tokens carry the new version.
        Every token of batch s still comes from weights of version >= v(s) (staleness <= k), the
        learner waits only for batch s itself, and the engine runs up to k batches ahead. Which
        token gets which version depends on timing: the engine records it (SwapRecord), and
        rollout.partial_replay makes a run follow a record instead of the clock.
    Every sampled token records its version (the engine's with partial rollouts, else the
    schedule's, stamped here): rollout/staleness and rollout/staleness_max are the mean and the max
    over sampled tokens of (the learner's version - the token's). A batch over the bound (possible
    only when a resumed run's queue was sampled under a larger max_staleness) is dropped and sampled
    again from the current weights (rollout/stale_dropped). pending() is the queue a checkpoint
    saves, so a resumed run continues it; with partial rollouts the swap record so far goes with it.

    Replaying a record cannot deadlock (rollout.partial_replay; the record made by a run of the same
    config and seed, checkpoint_every included). The background thread's generate calls form one
    sequence (batches in step order, calls in order), and a call waits, before it starts and holding
    no lock, until every version its entry names has been pushed; pushes are held by the engine
    until the token step the record names, so the loop never waits for them. Three facts of the
    recorded run: (1) version v is pushed after take(v), which needed batch v sampled whole, so a
    call of batch s that saw v has s > v; (2) every call that saw only versions below v started
    before push v arrived, so its batch had been released by take(j), j <= v; (3) a checkpoint after
    step c waits for every released batch (up to c + k) with pushes up to c done, so those batches
    saw versions <= c. In the replay the loop blocks only in take(s) (pushes up to s-1 done; by (1)
    the calls of batch s and of those before it need versions <= s-1), in pending() at a checkpoint
    (by (3), when the replay checkpoints at the recorded steps), and for the engine's call lock
    during its eval and weight-sync gate (the waiting call holds no lock, and a call that holds it
    has every version it needs, so it ends). The background thread blocks only for a version not yet
    pushed or a batch not yet released, which the loop's progress brings, by (1) and (2). A record
    that breaks these (made with another config, checkpoint_every or seed) would hang: the loop
    notices, while it waits for a batch, that the engine waits for a version only the loop can push,
    and stops the run with an error."""

    # the engine samples during the update (it must not sleep), and take(s) gives the batch
    overlaps = True

    @classmethod
    def from_config(
        cls, cfg, collect, rollouts, start: int, resume: str, main: bool
    ) -> "AsyncSchedule":
        """The schedule of a run (train.build_schedule): the queue of a resumed run's checkpoint,
        and with partial rollouts the engine's version numbering set to the RL step. Every rank
        builds one (pushes() decides who joins the weights' gather); rank 0 (main) alone samples."""
        queue = load_pending(resume) if resume else None
        # SavedQueue (partial rollouts); a plain dict from older runs
        carried = getattr(queue, "swaps", [])
        engine = None
        if main and cfg.rollout.partial_rollouts:
            engine = rollouts.engine
            run_dir = os.path.join(cfg.out_dir, cfg.run_name)
            own = bool(resume) and os.path.abspath(resume).startswith(
                os.path.abspath(run_dir) + os.sep
            )
            record = SwapRecord.open(run_dir, carried, cfg.rollout.partial_replay, own)
            # the record's calls this run makes: batches after the checkpoint, not in its queue,
            # within the run
            plan = {
                key: e
                for key, e in record.plan.items()
                if start < key[0] <= cfg.steps and key[0] not in (queue or {})
            }
            # the engine numbers its weights by RL step, as we do
            engine.number_from(start, record, plan)
        return cls(
            collect,
            cfg.steps,
            main,
            cfg.rollout.max_staleness,
            cfg.rollout.partial_rollouts,
            queue,
            engine,
        )

    def __init__(
        self,
        collect,
        steps: int,
        enabled: bool,
        max_staleness: int = 1,
        partial: bool = False,
        pending: dict | None = None,
        engine=None,
    ):
        # collect(step)
        self.collect, self.steps, self.k, self.partial = collect, steps, max_staleness, partial
        self.engine = engine  # partial rollouts: the ConcurrentEngine (its record, its replay)
        self.pool = ThreadPoolExecutor(max_workers=1) if enabled else None
        # step -> (trajectories, metrics, seconds, version): sampled, not taken
        self.ready = dict(pending or {})
        self.futures = {}  # step -> the Future of the same, released to the background thread
        self.waited = 0.0  # seconds the learner waited for the background thread this step

    def _sample(self, step: int, version: int, background: bool = False) -> tuple:
        t0 = time.time()
        # the background thread's generate calls are numbered by batch, recorded and replayed
        # (partial rollouts); a batch the loop samples itself (the first, a dropped one) sees no
        # push mid-call: the loop is the pusher
        numbered = (
            self.engine.batch(step) if background and self.engine is not None else nullcontext()
        )
        with numbered:
            trajs, metrics = self.collect(step)
        if not self.partial:  # the engine held `version` throughout
            for t in trajs:
                t.versions = [version if m else -1 for m in t.loss_mask]
        return trajs, metrics, time.time() - t0, version

    def _result(self, step: int):
        t0 = time.time()
        future = self.futures.pop(step)
        while True:
            try:
                self.ready[step] = future.result(timeout=1.0)
                break
            except TimeoutError:  # still sampling: unless a replay waits for what we alone can push
                if self.engine is not None:
                    self.engine.check_not_stuck()
        self.waited += time.time() - t0

    def take(self, step: int) -> tuple[list, dict, float]:
        """This step's (trajectories, metrics, the engine's seconds for them); in async mode it then
        releases batch step + k, from the weights as they are now (after update step - 1)."""
        self.waited = 0.0
        if step in self.futures:
            self._result(step)
        trajs, metrics, seconds, _ = (
            self.ready.pop(step) if step in self.ready else self._sample(step, step - 1)
        )
        stale = staleness_metrics(trajs, step - 1)
        if stale["rollout/staleness_max"] > (self.k if self.pool is not None else 0):
            trajs, metrics, seconds, _ = self._sample(step, step - 1)
            stale = {**staleness_metrics(trajs, step - 1), "rollout/stale_dropped": 1.0}
        if self.pool is not None:
            for s in range(step + 1, min(step + self.k, self.steps) + 1):
                if s not in self.ready and s not in self.futures:
                    self.futures[s] = self.pool.submit(
                        self._sample, s, max(0, s - 1 - self.k), True
                    )
        return trajs, {**metrics, **stale}, seconds

    def before_push(self, step: int) -> dict:
        """Before the push of update `step`: without partial rollouts, block until every released
        batch is sampled (they need the older weights) -> the seconds the learner waited for the
        background thread, this step."""
        if not self.partial:
            for s in sorted(self.futures):
                self._result(s)
        return (
            {"perf/rollout_wait_seconds": self.waited}
            if self.waited or self.futures or self.ready
            else {}
        )

    def pushes(self, updated: bool) -> bool:
        """Whether this step's weights go to the engine: with partial rollouts every step, skipped
        or not (tokens from here on are version `step`); else only after an update."""
        return updated or self.partial

    def push(self, rollouts, weights: dict, step: int) -> dict:
        """The push, after before_push: with partial rollouts tagged with its version (the engine
        applies it at the next token boundary of the generation in flight)."""
        return (
            rollouts.update_weights(weights, version=step)
            if self.partial
            else rollouts.update_weights(weights)
        )

    def pending(self) -> dict | None:
        """What a checkpoint saves: the queue, every released batch, sampled (a batch in flight is
        waited for); with partial rollouts with the swap record so far (SavedQueue)."""
        for s in sorted(self.futures):
            self._result(s)
        if self.engine is not None and self.engine.record is not None:
            return SavedQueue(self.ready, list(self.engine.record.entries))
        return dict(self.ready) or None

    def shutdown(self):
        if self.pool is not None:
            self.pool.shutdown()
        if self.engine is not None and self.engine.record is not None:
            self.engine.record.close()


class SavedQueue(dict):
    """A checkpoint's queue, {step: (trajectories, metrics, seconds, version)} as without partial
    rollouts, carrying .swaps, the swap record's entries so far (SwapRecord): a resumed run has the
    record up to its checkpoint."""

    def __init__(self, queue: dict, swaps: list[dict]):
        super().__init__(queue)
        self.swaps = swaps


def staleness_metrics(trajs: list, learner_version: int) -> dict:
    """rollout/staleness (mean) and rollout/staleness_max over every sampled token of the batch:
    updates between the weights that sampled it and the learner's (Trajectory.versions)."""
    lags = [learner_version - v for t in trajs for v, m in zip(t.versions, t.loss_mask) if m]
    return {
        "rollout/staleness": sum(lags) / len(lags) if lags else 0.0,
        "rollout/staleness_max": float(max(lags, default=0)),
    }


# -----------------------------------------------------------------------------
# the engine piece: background generations, pushes at token boundaries, recorded or replayed


def _per_thread(name: str) -> property:
    """An int attribute that each thread reads and writes apart (0 until that thread sets it):
    self._local.<name>."""
    return property(
        lambda self: getattr(self._local, name, 0), lambda self, n: setattr(self._local, name, n)
    )


class ConcurrentEngine(TorchEngine):
    """A TorchEngine that a background thread samples from while the loop pushes and probes (the
    sync gate).

    Calls from several threads run one at a time. Partial rollouts: a push that arrives during a
    generation is applied at its next token boundary, and the keys and values of every token so far
    are recomputed with the new weights (as AReaL does, 2505.24298; PipelineRL keeps the old ones
    instead), so each token's log-prob is exactly log pi_v(token | everything before it) under the
    version v it records (Generation.versions).

    Record and replay. The background thread's calls are numbered (batch(step): call i of batch
    `step`); at the end of each, its entry goes to the SwapRecord: the version it started with (its
    prefill's) and [token step, version] for each push applied at a token boundary (then
    recomputed). With a plan (entries to replay, from_config), a numbered call first waits until
    every version its entry names has been pushed (holding no lock: the loop's eval and gate go on),
    starts from the entry's version, and applies each version at the entry's token step, no sooner
    and no later: pushes are held meanwhile (copied), never applied when they arrive. A call of
    another thread (eval, the gate, a batch the loop samples itself) runs the latest weights pushed,
    as it does without a plan: with pushes held, it borrows them for the call and puts the older
    ones back. Once the plan is used up, pushes land by the clock again (and are recorded). The
    prompt-token counters (rollout/prefilled_tokens) count each thread's calls apart, so a batch's
    metric does not depend on which eval or gate calls ran meanwhile.
    """

    def __init__(self, model, **kwargs):
        # per thread: the prefill counters, the batch being sampled and its calls
        self._local = threading.local()
        super().__init__(model, **kwargs)
        self.version = 0  # the weights' version, as the pusher numbers them (update_weights)
        self.latest = 0  # the highest version pushed
        self.record = None  # the SwapRecord the background thread's calls go to (from_config)
        self.plan = {}  # (step, call) -> the record entry that call replays, until it has run
        # one generate at a time (the async producer and the sync gate share us)
        self._call = threading.Lock()
        self._lock = threading.Condition()  # guards what follows; notified on every push
        self._in_flight = False  # a generate is running: a push waits for a token boundary
        self._held = {}  # version -> state dict pushed and not yet applied
        self._waiting = None  # the version a numbered call waits for before it starts, or None
        self._aborted = False  # the loop found the replay stuck: the waiting call gives up
        self._versions = []  # (N,) the weights' version at each step of the batch in progress
        # the call in progress: token steps so far, [step, version] applied,
        # the replayed swaps {step: version}
        self._steps, self._swaps, self._at = 0, [], None

    # each thread counts its own prompt tokens (agent.prefill_counts reads them around its calls)
    prefilled_tokens = _per_thread("prefilled")
    prompt_tokens = _per_thread("prompt")

    def number_from(self, version: int, record=None, plan: dict | None = None):
        """Number the weights from `version` on (a resumed run's RL step); record the background
        thread's calls to `record` and replay `plan` ({(step, call): entry};
        AsyncSchedule.from_config)."""
        with self._lock:
            self.version = self.latest = version
            self._held.clear()
            self.record, self.plan = record, dict(plan or {})
        # a loop that dies (an error, Ctrl-C) while a replayed call waits for its push: the
        # interpreter's exit joins the background thread, so stop the wait first (concurrent.futures
        # registers its own join the same way)
        if self.plan:
            threading._register_atexit(self.abort)

    def abort(self):
        """Stop a replayed call's wait for a push (it raises): the loop has stopped, or found the
        replay stuck."""
        with self._lock:
            self._aborted = True
            self._lock.notify_all()

    @contextmanager
    def batch(self, step: int):
        """The calls made inside, in this thread, are those of batch `step`: numbered 0, 1, ...,
        recorded, replayed."""
        self._local.batch, self._local.calls = step, 0
        try:
            yield
        finally:
            self._local.batch = None

    def generate(self, prompts, params):
        step = getattr(self._local, "batch", None)
        key = None
        if step is not None:
            key, self._local.calls = (step, self._local.calls), self._local.calls + 1
        entry = self._replayed(key)
        with self._call:
            with self._lock:
                self._in_flight, self._steps, self._swaps = True, 0, []
                self._at = dict((t, v) for t, v in entry["swaps"]) if entry is not None else None
                if entry is not None:
                    self._apply(entry["start"])
                borrowed = self._borrow() if key is None else None
                start = self.version
            try:
                gens = super().generate(prompts, params)
            finally:
                with self._lock:
                    self._in_flight, self._at = False, None
                    if borrowed is not None:  # give the call's borrowed weights back
                        self._load(*borrowed)
                    done = (
                        {
                            "step": key[0],
                            "call": key[1],
                            "start": start,
                            "swaps": self._swaps,
                            "token_steps": self._steps,
                        }
                        if key is not None
                        else None
                    )
                    if entry is not None:
                        del self.plan[key]
                    if not self.plan and self._held:
                        # pushed after the last token boundary: land now
                        self._apply(max(self._held))
            if entry is not None and (
                done["swaps"] != entry["swaps"] or done["token_steps"] != entry["token_steps"]
            ):
                raise RuntimeError(
                    f"rollout.partial_replay: call {key[1]} of batch {key[0]} ran "
                    f"{done['token_steps']} token steps with swaps {done['swaps']}, "
                    f"the record says {entry['token_steps']} with {entry['swaps']}: "
                    "the record is another run's"
                )
            if done is not None and self.record is not None:
                self.record.write(done)
        return gens

    def _replayed(self, key) -> dict | None:
        """The record entry call `key` replays (None: it runs by the clock), once every version it
        names is pushed."""
        if key is None or not self.plan:
            return None
        with self._lock:
            entry = self.plan.get(key)
            if entry is None:
                raise RuntimeError(
                    f"rollout.partial_replay: the record has no call {key[1]} of batch {key[0]} "
                    f"but still has {min(self.plan)} (batch, call) to replay: it is another run's"
                )
            self._waiting = max([entry["start"], *(v for _, v in entry["swaps"])])
            while self.latest < self._waiting and not self._aborted:
                self._lock.wait()
            self._waiting = None
            if self._aborted:
                raise RuntimeError("rollout.partial_replay: stopped by the loop (see its error)")
        return entry

    def check_not_stuck(self):
        """Called by the loop while it waits for a batch: a RuntimeError when a replayed call waits
        for a version the loop has not pushed (only the waiting loop could push it: a record another
        run made)."""
        with self._lock:
            waiting, latest = self._waiting, self.latest
        if waiting is not None and waiting > latest:
            self.abort()
            raise RuntimeError(
                "rollout.partial_replay: a recorded call waits for the weights after update "
                f"{waiting}, but the learner is at {latest} and waits for that call's batch: "
                "the record was made by a run with another config, seed or checkpoint_every "
                "(a checkpoint waits for the batches in flight)"
            )

    def _apply(self, version: int):
        """Between calls (lock held): load the held push `version` unless it is the current one;
        drop older ones."""
        if version != self.version:
            if version not in self._held:
                raise RuntimeError(
                    f"rollout.partial_replay: version {version} is not among the pushed weights "
                    f"held ({sorted(self._held)}; the engine is at {self.version})"
                )
            self._load(self._held[version], version)
        self._held = {v: sd for v, sd in self._held.items() if v > version}

    def _borrow(self) -> tuple | None:
        """A call of the loop's own thread while pushes are held for the replay: it runs the latest
        weights pushed -> (the weights it replaced, their version) to put back after, or None when
        it already has them."""
        if not self._held or max(self._held) <= self.version:
            return None
        saved = ({k: p.detach().clone() for k, p in self.model.named_parameters()}, self.version)
        self._load(self._held[max(self._held)], max(self._held))
        return saved

    def _generate_batch(self, prompts, params, generator, device):
        self._versions = []
        gens = super()._generate_batch(prompts, params, generator, device)
        return [replace(g, versions=self._versions[: len(g.token_ids)]) for g in gens]

    def _token_boundary(
        self, prompts, rows, real, tokens, cache: KVCache, prompt_end: int, h
    ) -> tuple:
        cache, h = super()._token_boundary(prompts, rows, real, tokens, cache, prompt_end, h)
        with self._lock:  # replayed: the version the record names here; else the latest push
            version = (
                self._at.get(self._steps) if self._at is not None else max(self._held, default=None)
            )
            state = (
                self._held.get(version) if version is not None and version != self.version else None
            )
            if state is not None:
                self._held = {v: sd for v, sd in self._held.items() if v > version}
        if state is not None:  # partial rollouts: new weights from here on
            self._load(state, version)
            cache, h = self._recompute(prompts, rows, real, tokens, cache, prompt_end)
            self._swaps.append([self._steps, version])
        self._versions.append(self.version)
        self._steps += 1
        return cache, h

    def _recompute(self, prompts, rows, real, tokens, cache: KVCache, prompt_end: int) -> tuple:
        """A token boundary of partial rollouts, new weights just loaded: run every row's tokens so
        far (prompt and generated, in their cache columns) through them into a fresh cache ->
        (cache, h (b, 1, H) the last position's hidden state, from which the next token
        is sampled)."""
        device, P = real.device, cache.pos  # P = prompt_end + tokens fed
        ids = torch.full((len(rows), P), self.pad_id, dtype=torch.long, device=device)  # (b, P)
        for j, r in enumerate(rows.tolist()):
            ids[j, real[j, :prompt_end].nonzero().squeeze(1)] = torch.tensor(
                prompts[r], device=device
            )
        ids[:, prompt_end:] = tokens[rows, : P - prompt_end]
        positions = (real[:, :P].long().cumsum(-1) - 1).clamp(min=0)  # (b, P) real tokens only
        fresh = KVCache(
            self.model.cfg,
            len(rows),
            cache.max_len,
            dtype=cache.k[0].dtype,
            device=device,
            reserve=P + DECODE_RESERVE,
        )
        return fresh, self.prefill(ids, positions, real, fresh)

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int | None = None):
        """rollout.TorchEngine.update_weights; `version` (default: one more than the latest) tags
        the tokens sampled from then on. Applied now when no call is running and no plan is being
        replayed; else the dict is copied (the caller's tensors may change) and held: by the clock,
        the call in flight applies the latest at its next token boundary (or when it ends);
        replayed, where the record says. This call never waits for either."""
        self._check(state_dict)
        with self._lock:
            version = self.latest + 1 if version is None else version
            self.latest = max(self.latest, version)
            if not self._in_flight and not self.plan:
                self._held.clear()
                self._load(state_dict, version)
            else:
                self._held[version] = {k: v.detach().clone() for k, v in state_dict.items()}
                if self.plan:  # keep what the plan names, and the latest (for the loop's own calls)
                    named = {
                        v
                        for e in self.plan.values()
                        for v in [e["start"], *(w for _, w in e["swaps"])]
                    }
                    self._held = {
                        v: sd for v, sd in self._held.items() if v in named or v == self.latest
                    }
            self._lock.notify_all()

    @torch.no_grad()
    def _load(self, state_dict: dict, version: int):
        super()._load(state_dict)
        self.version = version


# -----------------------------------------------------------------------------
# the swap record

# in the run folder: one line per generate call of the background thread
RECORD = "partial_swaps.jsonl"


class SwapRecord:
    """Where the pushes of a run with partial rollouts landed: one JSON line per generate call of
    the background thread, {"step": the batch, "call": its number within the batch (0, 1, ...: one
    per agent turn, and per refill round), "start": the version its prefill ran, "swaps": [[token
    step, version], ...] each push applied at that token boundary (the tokens from that step on are
    sampled by it), "token_steps": boundaries it ran}. Per row, the version of each token follows
    (Trajectory.versions): start before the first swap, then each swap's. Written to <run
    folder>/partial_swaps.jsonl as each call ends (flushed), sorted by (step, call), which is the
    order the background thread makes them; a checkpoint carries the entries so far
    (AsyncSchedule.pending).

    On resume, the file is rewritten from the checkpoint's entries, plus, without
    rollout.partial_replay, the run's own entries recorded after the checkpoint and before the kill:
    the resumed run replays those for the batches it samples again (what the kill lost comes back
    the same), and records by the clock after them. With rollout.partial_replay=PATH (a record, or
    the run folder holding one), PATH's entries are replayed instead."""

    def __init__(self, path: str, entries: list[dict], plan: dict):
        self.path, self.plan = path, plan  # plan: (step, call) -> entry to replay
        self.entries = sorted(entries, key=_key)
        self.keys = {_key(e) for e in self.entries}
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write("".join(json.dumps(e) + "\n" for e in self.entries))
        os.replace(tmp, path)
        self.file = open(path, "a")

    @classmethod
    def open(
        cls, run_dir: str, carried: list[dict], replay: str = "", own: bool = False
    ) -> "SwapRecord":
        """The record of a run starting (carried: []) or resuming from a checkpoint (`carried`: its
        entries; `own`: the checkpoint is this run folder's, whose record may go further)."""
        path = os.path.join(run_dir, RECORD)
        if replay:
            return cls(path, carried, {_key(e): e for e in read_record(replay)})
        known = {_key(e) for e in carried}
        later = [
            e
            for e in (read_record(path) if own and os.path.exists(path) else [])
            if _key(e) not in known
        ]
        entries = [*carried, *later]
        return cls(path, entries, {_key(e): e for e in entries})

    def write(self, entry: dict):
        """A call's entry, as the call ends (one already in the file, a replayed one, is not
        written twice)."""
        if _key(entry) in self.keys:
            return
        self.entries.append(entry)
        self.keys.add(_key(entry))
        self.file.write(json.dumps(entry) + "\n")
        self.file.flush()

    def close(self):
        self.file.close()


def _key(entry: dict) -> tuple[int, int]:
    return entry["step"], entry["call"]


def read_record(path: str) -> list[dict]:
    """The entries of a swap record, `path` the file or the run folder holding it; a last line cut
    by a kill is dropped. A missing record is a ValueError naming rollout.partial_replay."""
    path = os.path.join(path, RECORD) if os.path.isdir(path) else path
    if not os.path.exists(path):
        raise ValueError(
            f"rollout.partial_replay={path}: no such swap record (a run with "
            f"rollout.partial_rollouts writes {RECORD} in its run folder)"
        )
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]
