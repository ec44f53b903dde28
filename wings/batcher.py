"""batcher.py: continuous batching for serve.py: the requests in flight share the engine's forward
passes, each one sampled with its own seed (a wing of rollout.py, used by wings/serve.py).

One engine thread (Scheduler) owns the engine. Requests (Jobs: a prompt, its SamplingParams, a seed)
queue up, and for a plain rollout.TorchEngine they are served by a ContinuousBatch (Yu et al. 2022,
Orca, "iteration-level scheduling", https://www.usenix.org/conference/osdi22/presentation/yu; vLLM's
scheduler): at every token boundary the waiting requests are prefilled together and join the running
rows, each row samples one token, finished rows leave (when a quarter of the batch has finished,
TorchEngine's rule), and one decode step runs the rest. A request that arrives while 63 others
generate waits for one token, not for the whole batch, and a weight push or the weight-sync gate's
probe (Scheduler.call) runs between batches, never mid-generation, so each request's tokens carry
one weight version.

Per-request seeds. TorchEngine draws a whole call's samples from one torch.Generator, so a row's
tokens would depend on what shares its batch. Here every request has its own generator, and the draw
is split from the rest of sampling: torch.multinomial(p, 1, generator=g) is argmax(p / q) with q ~
Exp(1) drawn from g (the exponential race, the form torch itself computes,
https://github.com/pytorch/pytorch/issues/11931#issuecomment-625882503). Each request draws its q
from its own generator (one small call per request), and everything else is one batched call
(sample_rows: rollout.sample_tokens with the draw passed in; a test checks the two agree, bit for
bit). A request's generator advances exactly as TorchEngine's would for that request alone (its rows
stay in its draws until a quarter of them have finished), so:
  - a seeded request gives the same tokens whatever else shares its batch, and
  - a request alone in the batch is TorchEngine.generate([prompt], params), ids and log-probs to
    the bit.
In a shared batch the log-probs differ from the lone call's in the last bits (~5e-7, measured): a
matrix multiply of 64 rows does not round like one of 1 (no torch CPU kernel is batch-invariant).
They are still exactly the log-probs of the distribution that was sampled, which is what the
learner needs.

Layout. Rows are left-padded into one KVCache, as TorchEngine lays out a call: every row's next
token is written at the same column, its position counted over its own real tokens. Joining rows are
prefilled on their own, then both caches are copied right-aligned into a new one, wide enough for
every row's remaining tokens (the columns that are padding for every row are dropped then). Other
engines (vLLM, a remote server, an engine with a prefix cache or mid-generation pushes: one whose
TorchEngine hooks do something) are served one request at a time.

Shapes: b rows in the batch, V vocab, H hidden, W cache columns, S prefill columns, D distinct
prompts prefilled.
Imports: algos.py (the top-k / top-p set), rollout.py (SamplingParams,
Generation, TorchEngine, KVCache) (and torch, the standard library).
"""

import os
import threading
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

import algos
from rollout import DECODE_RESERVE, Generation, KVCache, SamplingParams, TorchEngine

# TorchEngine's, which its wings override
HOOKS = ("_prefill_layout", "_token_boundary", "_decode", "_rows_done", "_store", "draw")
# an idle engine waits while requests keep arriving this often (Triton's max_queue_delay)
GATHER_S = 0.005
GATHER_ROUNDS = 10  # ... for 10 such waits at most: a lone request starts within 5-50 ms


@dataclass(eq=False)
class Job:
    """One request's sampling: n samples of one prompt. `future` resolves to its n Generations (or
    the engine's exception); on_tokens, when given, is called on the engine thread after every step
    with {sample: new ids}."""

    prompt: list[int]
    params: SamplingParams
    on_tokens: Callable[[dict[int, list[int]]], None] | None = None
    future: Future = field(default_factory=Future)
    cancelled: bool = False  # its client left: it leaves the batch at the next token boundary
    bytes: int = 0  # job_bytes: what serving it may hold at most (0: not counted)


def job_bytes(model, prompt_len: int, params: SamplingParams, chunk_tokens: int) -> int:
    """About the most memory serving one request holds, in bytes: its n rows' keys and values at
    prompt + max_tokens positions (as far as a KVCache can grow), and one prefill chunk's working
    set (its activations and its own causal mask: chunk x (4 H + 3 I + nh x chunk) fp32 numbers).
    An estimate for admission (serve.Server's memory budget), not a measurement."""
    c = model.cfg
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim
    kv *= model.lm_head.weight.element_size()
    chunk = min(prompt_len, chunk_tokens)
    width = 4 * c.hidden_size + 3 * c.intermediate_size + c.num_attention_heads * chunk
    return params.n * (prompt_len + params.max_tokens) * kv + 4 * chunk * width


def default_memory_budget(device) -> int:
    """Half the memory free on the engine's device when the server starts, in bytes: the GPU's on
    CUDA, else the machine's available memory (Linux's MemAvailable)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(device)[0] // 2
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024 // 2
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2


def resolve(future: Future, result=None, error: BaseException | None = None):
    """Set a job's result or error, unless its client cancelled it meanwhile."""
    try:
        future.set_exception(error) if error is not None else future.set_result(result)
    except InvalidStateError:
        pass


def batchable(engine) -> bool:
    """Whether the ContinuousBatch can run `engine`'s model: a TorchEngine whose hooks are
    TorchEngine's own."""
    return isinstance(engine, TorchEngine) and all(
        getattr(type(engine), h) is getattr(TorchEngine, h) for h in HOOKS
    )


def sample_rows(logits, temperature: float, top_p: float, top_k: int, draws):
    """rollout.sample_tokens with its random draw passed in: logits (b, V), draws (b, V) Exp(1)
    samples (None when greedy) -> (tokens (b,), log-probs (b,), kept sizes (b,) or None). The same
    tokens, log-probs and sizes as sample_tokens with a generator that would have drawn `draws`
    (torch.multinomial is argmax(p / q))."""
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(-1)  # (b,)
        logp_all = torch.log_softmax(logits, dim=-1)  # (b, V)
    elif top_p < 1.0 or top_k > 0:
        in_set = algos.truncation_mask(logits, temperature, top_k, top_p)  # (b, V)
        # (b, V)
        probs = torch.softmax((logits / temperature).masked_fill(~in_set, -torch.inf), dim=-1)
        tokens = (probs / draws).argmax(-1)  # (b,)
        return tokens, algos.truncated_logprobs(logits, tokens, in_set, temperature), in_set.sum(-1)
    else:
        logp_all = torch.log_softmax(logits / temperature, dim=-1)  # (b, V)
        tokens = (logp_all.exp() / draws).argmax(-1)  # (b,)
    return tokens, logp_all.gather(-1, tokens[:, None]).squeeze(-1), None


@dataclass(eq=False)
class _Run:
    """A job in the batch: what its samples have produced so far, and its generator."""

    job: Job
    generator: torch.Generator | None
    tokens: list[list[int]]  # (n, t) per sample
    logprobs: list[list[float]]  # (n, t)
    kept: list[list[int]]  # (n, t) top-k / top-p set sizes (empty lists when nothing is truncated)
    stopped: list[bool]  # (n,) a stop id was sampled
    ride: list[int]  # the samples still drawn for: TorchEngine's rows of this call
    steps: int = 0  # tokens sampled per sample so far

    @classmethod
    def start(cls, job: Job) -> "_Run":
        n = job.params.n
        gen = (
            torch.Generator().manual_seed(job.params.seed) if job.params.seed is not None else None
        )
        return cls(
            job,
            gen,
            [[] for _ in range(n)],
            [[] for _ in range(n)],
            [[] for _ in range(n)],
            [False] * n,
            list(range(n)),
        )

    def live(self, s: int) -> bool:
        return (
            not self.stopped[s]
            and self.steps < self.job.params.max_tokens
            and not self.job.cancelled
        )

    @property
    def finished(self) -> bool:
        return not any(self.live(s) for s in range(len(self.stopped)))

    def generations(self) -> list[Generation]:
        return [
            Generation(t, lp, "stop" if stop else "length", kept_sizes=k)
            for t, lp, stop, k in zip(self.tokens, self.logprobs, self.stopped, self.kept)
        ]


class ContinuousBatch:
    """The running rows of a TorchEngine's model: admit(jobs) prefills and joins them, step()
    samples one token for every row and runs one decode step. finished(run) is called for each job
    whose samples are all done."""

    def __init__(self, engine: TorchEngine, finished: Callable[[Job, list[Generation]], None]):
        self.engine, self.model, self.pad_id = engine, engine.model, engine.pad_id
        self.max_rows, self.finished = engine.max_batch_size, finished
        self.runs: list[_Run] = []
        self.rows: list[tuple[_Run, int]] = []  # (b,) each row's run and sample
        self.cache: KVCache | None = None
        # (b, W) key padding mask, (b, 1) positions, (b, 1, H)
        self.real = self.next_pos = self.h = None
        self.was_training = False

    def room(self) -> int:
        return self.max_rows - len(self.rows)

    def held_bytes(self) -> int:
        """What the jobs in the batch may hold at most (job_bytes)."""
        return sum(run.job.bytes for run in self.runs)

    @torch.inference_mode()
    def admit(self, jobs: list[Job]):
        """Prefill the jobs' prompts (each distinct prompt once, left-padded, as TorchEngine's
        _prefill_layout) and add their rows to the batch."""
        runs = [_Run.start(j) for j in jobs]
        prompts = [r.job.prompt for r in runs for _ in range(r.job.params.n)]
        distinct = list({tuple(p): None for p in prompts})
        index = {p: i for i, p in enumerate(distinct)}
        source = torch.tensor([index[tuple(p)] for p in prompts])  # (b_new,) row -> its prompt
        D, S, N = (
            len(distinct),
            max(len(p) for p in distinct),
            max(r.job.params.max_tokens for r in runs),
        )
        ids = torch.full((D, S), self.pad_id, dtype=torch.long)  # (D, S)
        real = torch.zeros(D, S + N, dtype=torch.bool)  # (D, S + N)
        for i, p in enumerate(distinct):
            ids[i, S - len(p) :] = torch.tensor(p, dtype=torch.long)
            real[i, S - len(p) :] = True
        self.engine.prompt_tokens += sum(len(p) for p in distinct)
        self.engine.prefilled_tokens += sum(len(p) for p in distinct)
        if not self.rows:
            self.was_training = self.model.training
            self.model.eval()
        cache = KVCache(
            self.model.cfg,
            D,
            S + N,
            dtype=self.model.lm_head.weight.dtype,
            reserve=S + DECODE_RESERVE,
        )
        positions = (real[:, :S].long().cumsum(-1) - 1).clamp(min=0)  # (D, S)
        # (b_new, 1, H) in chunks, as TorchEngine prefills
        h = self.engine.prefill(ids, positions, real, cache)[source]
        cache.keep_rows(source)
        real, next_pos = real[source], positions[source, -1:] + 1  # (b_new, S + N), (b_new, 1)
        if self.rows:
            cache, real = self._merge(cache, real, runs)
            next_pos, h = torch.cat([self.next_pos, next_pos]), torch.cat([self.h, h])
        self.cache, self.real, self.next_pos, self.h = cache, real, next_pos, h
        self.runs += runs
        self.rows += [(r, s) for r in runs for s in range(r.job.params.n)]

    def _merge(self, cache: KVCache, real, runs: list[_Run]) -> tuple[KVCache, torch.Tensor]:
        """The running rows' cache and the joining rows' in one, both right-aligned at the write
        column, as wide as the longest row's real tokens plus the most tokens any row may
        still sample."""
        old, filled = self.cache, self.cache.pos
        # columns before: padding in all
        first = self.real[:, :filled].float().argmax(-1).min().item()
        used, new = filled - first, cache.pos
        P = max(used, new)  # the new write column
        left = max([r.job.params.max_tokens - r.steps for r in self.runs + runs])
        b_old, b = len(self.rows), len(self.rows) + real.shape[0]
        merged = KVCache(
            self.model.cfg,
            b,
            P + left,
            dtype=cache.k[0].dtype,
            reserve=P + DECODE_RESERVE,
        )
        for layer in range(len(merged.k)):
            for dst, src_old, src_new in ((merged.k, old.k, cache.k), (merged.v, old.v, cache.v)):
                dst[layer][:b_old, :, P - used : P] = src_old[layer][:, :, first:filled]
                dst[layer][b_old:, :, P - new : P] = src_new[layer][:, :, :new]
        merged.pos = P
        mask = torch.zeros(b, P + left, dtype=torch.bool)  # (b, W)
        mask[:b_old, P - used : P] = self.real[:, first:filled]
        mask[b_old:, P - new : P] = real[:, :new]
        mask[:, P:] = True  # every sampled token is real
        return merged, mask

    def _draws(self, rows: list[int], V: int) -> torch.Tensor:
        """Exp(1) draws for `rows` of the batch: each run draws (len(ride), V) from its own
        generator, as torch.multinomial over TorchEngine's rows of that request would; a row whose
        sample is no longer drawn for gets ones (its token is not used)."""
        drawn = {}
        for i in rows:
            run = self.rows[i][0]
            if run not in drawn:
                drawn[run] = torch.empty(len(run.ride), V).exponential_(1, generator=run.generator)
        ones = torch.ones(V)
        return torch.stack(
            [
                drawn[run][run.ride.index(s)] if s in run.ride else ones
                for run, s in (self.rows[i] for i in rows)
            ]
        )  # (len(rows), V)

    @torch.inference_mode()
    def step(self):
        """Sample one token for every row, hand over the jobs that are done, then run one decode
        step for the rows still generating."""
        logits = self.model.lm_head(self.h[:, -1])  # (b, V)
        b, V = logits.shape
        tokens, logprobs, sizes = (
            torch.zeros(b, dtype=torch.long),
            torch.zeros(b),
            torch.zeros(b, dtype=torch.long),
        )
        groups: dict[tuple, list[int]] = {}  # rows sampled alike
        for i, (run, _) in enumerate(self.rows):
            p = run.job.params
            groups.setdefault((p.temperature, p.top_p, p.top_k), []).append(i)
        for (temperature, top_p, top_k), rows in groups.items():
            draws = self._draws(rows, V) if temperature > 0 else None
            idx = torch.tensor(rows)
            tok, lp, size = sample_rows(logits[idx], temperature, top_p, top_k, draws)
            tokens[idx], logprobs[idx] = tok, lp
            if size is not None:
                sizes[idx] = size
        self._record(tokens.tolist(), logprobs.tolist(), sizes.tolist())
        self._next(tokens)

    def _record(self, tokens: list[int], logprobs: list[float], sizes: list[int]):
        """Append each live row's token; finish the runs that are done, and shrink each run's draws
        as TorchEngine drops finished rows (once a quarter of them have finished)."""
        new: dict[_Run, dict[int, list[int]]] = {}
        for i, (run, s) in enumerate(self.rows):
            if run.live(s):
                p = run.job.params
                run.tokens[s].append(tokens[i])
                run.logprobs[s].append(logprobs[i])
                if p.truncates:
                    run.kept[s].append(sizes[i])
                run.stopped[s] = tokens[i] in p.stop_token_ids
                new.setdefault(run, {})[s] = [tokens[i]]
        for run in self.runs:
            run.steps += 1
            if run.job.on_tokens is not None and run in new:
                run.job.on_tokens(new[run])
            live = [s for s in run.ride if run.live(s)]
            if run.finished:
                if not run.job.cancelled:
                    self.finished(run.job, run.generations())
            elif 4 * len(live) <= 3 * len(run.ride):
                run.ride = live
        self.runs = [r for r in self.runs if not r.finished]

    def _next(self, tokens):
        """Drop the finished rows (when a quarter of the batch has finished) and run one
        decode step."""
        live = [i for i, (run, s) in enumerate(self.rows) if run.live(s)]
        if not live:
            self.reset()
            return
        if 4 * len(live) <= 3 * len(self.rows):
            keep = torch.tensor(live)
            self.cache.keep_rows(keep)
            self.real, self.next_pos, tokens = self.real[keep], self.next_pos[keep], tokens[keep]
            self.rows = [self.rows[i] for i in live]
        # (b, 1, H)
        self.h = self.model.hidden_states(tokens[:, None], self.next_pos, self.real, self.cache)
        self.next_pos = self.next_pos + 1

    def reset(self, error: BaseException | None = None):
        """Empty the batch (every job in it failed with `error`, when given) and give the model back
        its mode."""
        for run in self.runs:
            if error is not None:
                resolve(run.job.future, error=error)
        if self.rows or self.runs:
            self.model.train(self.was_training)
        self.runs, self.rows, self.cache, self.real, self.next_pos, self.h = (
            [],
            [],
            None,
            None,
            None,
            None,
        )


class Scheduler:
    """The engine thread. submit(prompt, params) queues a Job; call(fn) runs fn() once no job is
    running (a weight push, the weight-sync gate's generate, sleep / wake_up), the jobs that arrive
    meanwhile waiting for it. Every token is stamped with `version` (an engine that stamps its own,
    async_rollouts', keeps its stamps). Before start() and after stop(), call(fn) runs fn in the
    caller's thread.

    threads: torch's CPU threads on the engine thread (None: those of the thread that calls start(),
    a trainer's `threads`). OpenMP counts threads per thread, so a new thread would start with the
    machine's count, and a different count rounds the model's matrix products differently: the same
    count as the trainer's own engine calls keeps a lone request bit-equal to them."""

    def __init__(
        self,
        engine,
        threads: int | None = None,
        gather_s: float = GATHER_S,
        memory_budget: int | None = None,
    ):
        self.engine, self.version, self.threads, self.gather_s = engine, 0, threads, gather_s
        # bytes the batch's jobs may hold together (job_bytes); None: not counted
        self.memory_budget = memory_budget
        self.batch = ContinuousBatch(engine, self._finish) if batchable(engine) else None
        self.cond = threading.Condition()
        self.waiting: deque[Job] = deque()
        self.commands: deque[tuple[Callable, Future]] = deque()
        self.thread: threading.Thread | None = None
        self.inline = threading.Lock()  # call() without the thread: one at a time

    def start(self):
        if self.thread is None:
            self.stopping = False
            self.threads = self.threads or torch.get_num_threads()
            self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)
            self.thread.start()

    def stop(self):
        if self.thread is not None:
            with self.cond:
                self.stopping = True
                self.cond.notify_all()
            self.thread.join()
            self.thread = None

    def submit(self, prompt: list[int], params: SamplingParams, on_tokens=None) -> Job:
        job = Job(list(prompt), params, on_tokens)
        if self.memory_budget is not None and self.batch is not None:
            job.bytes = job_bytes(
                self.engine.model, len(prompt), params, self.engine.prefill_chunk_tokens
            )
        with self.cond:
            if self.thread is None:
                raise RuntimeError("the scheduler is not running: Server.start() it")
            self.waiting.append(job)
            self.cond.notify()
        return job

    def cancel(self, job: Job):
        """The job's client left: drop it (no result) if it still waits, else at the next
        token boundary."""
        with self.cond:
            job.cancelled = True
            if job in self.waiting:
                self.waiting.remove(job)
        job.future.cancel()

    def call(self, fn: Callable):
        """fn() on the engine thread, once no job is running -> what it returns (or raises)."""
        if self.thread is None:
            with self.inline:
                return fn()
        future = Future()
        with self.cond:
            self.commands.append((fn, future))
            self.cond.notify()
        return future.result()

    def stamp(self, gens: list[Generation]) -> list[Generation]:
        return [
            replace(
                g, versions=list(g.versions) if g.versions else [self.version] * len(g.token_ids)
            )
            for g in gens
        ]

    def _finish(self, job: Job, gens: list[Generation]):
        resolve(job.future, self.stamp(gens))

    def _busy(self) -> bool:
        return self.batch is not None and bool(self.batch.rows)

    def _next(self) -> tuple[tuple | None, list[Job]]:
        """What the loop does next: (a command, []) once the batch is empty, else (None, the jobs
        to admit)."""
        with self.cond:
            while not (self.stopping or self.commands or self.waiting or self._busy()):
                self.cond.wait()
            if self.stopping:
                return None, []
            if self.commands:  # no admission until it has run: the batch drains
                return (self.commands.popleft() if not self._busy() else None), []
            if self.batch is None:
                return None, [self.waiting.popleft()]
            # an idle engine: let the requests that arrive together start together (one prefill,
            # not one per arrival)
            if not self._busy():
                self._gather()
            jobs, room = [], self.batch.room()
            # what the batch may hold after admitting `jobs`; an empty batch takes its first job
            # whatever it needs (serve.Server refuses one that alone exceeds the budget)
            held = self.batch.held_bytes()
            budget = self.memory_budget if self.memory_budget is not None else float("inf")
            while self.waiting and self.waiting[0].params.n <= room:
                if held + self.waiting[0].bytes > budget and (self.batch.runs or jobs):
                    break
                room -= self.waiting[0].params.n
                held += self.waiting[0].bytes
                jobs.append(self.waiting.popleft())
            return None, jobs

    def _gather(self):
        """Wait while requests keep arriving: until none came for gather_s, GATHER_ROUNDS times
        at most."""
        for _ in range(GATHER_ROUNDS):
            seen = len(self.waiting)
            self.cond.wait(self.gather_s)
            if len(self.waiting) == seen or self.commands or self.stopping:
                return

    def _loop(self):
        torch.set_num_threads(self.threads)  # OpenMP's count is per thread: set it in this one
        while True:
            command, jobs = self._next()
            if self.stopping:
                break
            if command is not None:
                fn, future = command
                try:
                    future.set_result(fn())
                except BaseException as e:  # the caller gets it
                    future.set_exception(e)
            elif self.batch is None:
                self._alone(jobs[0])
            else:
                try:
                    if jobs:
                        self.batch.admit(jobs)
                    if self.batch.rows:
                        self.batch.step()
                except Exception as e:
                    # a failed forward: every job in the batch fails, not the loop
                    for job in jobs:
                        resolve(job.future, error=e)
                    self.batch.reset(e)
        self._fail_waiting()

    def _alone(self, job: Job):
        """One request on an engine the batch cannot run: its own engine.generate call."""
        if job.cancelled:
            return
        try:
            gens = self.stamp(self.engine.generate([job.prompt], job.params))
        except Exception as e:
            resolve(job.future, error=e)
            return
        if job.on_tokens is not None:
            job.on_tokens({s: list(g.token_ids) for s, g in enumerate(gens)})
        resolve(job.future, gens)

    def _fail_waiting(self):
        with self.cond:
            jobs, self.waiting = list(self.waiting), deque()
            commands, self.commands = list(self.commands), deque()
        for job in jobs:
            job.future.cancel()
        for _, future in commands:
            future.set_exception(RuntimeError("the server stopped"))
        if self.batch is not None:
            self.batch.reset(RuntimeError("the server stopped"))
