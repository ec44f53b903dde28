"""cluster.py: everything Ray: rollout workers and env workers in a placement group, the dispatchers
that play a batch of episodes on them, the object-store weight push, and the learner's ranks as
Ray actors.

Two independent uses, each off unless asked for:
  rollouts   `ray.rollout_workers=M`: start_ray_rollouts starts M RolloutWorker actors (an engine,
             the tokenizer and the envs each; rollout.make_engine builds the engine) and optionally
             EnvWorker actors for CPU-heavy env work. RayRollouts answers the calls of
             agent.LocalRollouts (play, generate, update_weights, sleep, wake_up, shutdown), so
             train.py drives either without asking which. A dispatcher (async_batch,
             async_batch_bounded, async_pipeline) spreads a batch over the workers in chunks of
             `chunk_groups` task groups; chunk c is played with the seed mix_seed(seed, its first
             group), so whichever worker plays it, and whatever the schedule, the trajectories are
             the same: the dispatchers differ only in time. Weights reach the workers through the
             object store: one ray.put of numpy arrays, read zero-copy by every worker on the node
             (torch tensors would be pickled on the way).
  launching  `ray.learner_workers=N`: launch_on_ray starts N LearnerRank actors, each setting
             torchrun's variables and running the same entry point (train.main) as one rank: `ray
             job submit -- python train.py ...` trains exactly as `torchrun --nproc_per_node N
             train.py ...` does.

A wing: train.py reaches it by name (rollout.wing) when ray.rollout_workers or ray.learner_workers
is set; its settings are config.RayConfig, checked by check_config (config.WING_CHECKS). `ray` is
imported only inside the functions that use it, and the engines only inside RolloutWorker, so
importing this file needs neither. Docs: docs/scaling.md.
Imports: env.py, chat.py (pad_token_id), agent.py, rollout.py (inside RolloutWorker) (and torch, the
standard library; ray and tokenizers where used).
"""

import dataclasses
import os
import time
import warnings
from dataclasses import dataclass, field

import torch

from agent import (
    AgentConfig,
    StepResult,
    Trajectory,
    finish_episodes,
    init_episodes,
    play_episodes,
    run_episodes,
    step_envs,
)
from chat import pad_token_id
from env import Action, Env, Task, make_env, mix_seed


# -----------------------------------------------------------------------------
# the ray: section of the config (config.RayConfig), checked here

DISPATCHERS = ("async_batch", "async_batch_bounded", "async_pipeline")  # ray.dispatcher (dispatch)
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # ray.placement_strategy


def check_config(cfg) -> list:
    """config.WING_CHECKS' hook: the ray section, checked at load before anything is built ->
    its choices."""
    ray_cfg = cfg.ray
    if (
        ray_cfg.learner_workers < 0
        or ray_cfg.cpus_per_learner <= 0
        or ray_cfg.gpus_per_learner < 0
        or ray_cfg.gpus_per_learner % 1
    ):
        raise ValueError(
            "ray.learner_workers must be >= 0 (0: no learner actors), ray.cpus_per_learner > 0 and "
            "ray.gpus_per_learner a whole number >= 0 (NCCL cannot put two ranks on one GPU)"
        )
    if (
        min(ray_cfg.rollout_workers, ray_cfg.env_workers, ray_cfg.max_in_flight) < 0
        or ray_cfg.chunk_groups < 1
    ):
        raise ValueError(
            "ray.rollout_workers, env_workers and max_in_flight must be >= 0, ray.chunk_groups >= 1"
        )
    if ray_cfg.env_workers and not ray_cfg.rollout_workers:
        raise ValueError(
            "ray.env_workers serve Ray rollout workers: set ray.rollout_workers > 0 too"
        )
    if (
        ray_cfg.rollout_workers
        and ray_cfg.dispatcher == "async_pipeline"
        and not ray_cfg.env_workers
    ):
        raise ValueError(
            "ray.dispatcher=async_pipeline runs its init and evaluate stages on env workers: "
            "set ray.env_workers >= 1"
        )
    if ray_cfg.max_in_flight and ray_cfg.dispatcher == "async_batch":
        raise ValueError(
            "ray.max_in_flight bounds the async_batch_bounded and async_pipeline dispatchers; "
            "ray.dispatcher=async_batch submits every chunk at once"
        )
    if ray_cfg.rollout_workers and cfg.rollout.engine not in ("torch", "vllm"):
        raise ValueError(
            f"ray.rollout_workers needs rollout.engine torch or vllm, not {cfg.rollout.engine!r}"
        )
    return [
        ("ray.placement_strategy", ray_cfg.placement_strategy, PLACEMENT_STRATEGIES),
        ("ray.dispatcher", ray_cfg.dispatcher, DISPATCHERS),
    ]


# -----------------------------------------------------------------------------
# rollout workers, env workers, dispatchers


@dataclass
class WorkerSpec:
    """What a RolloutWorker builds itself from, in its own process (the spec is pickled to
    the actor)."""

    model_dir: str  # Hugging Face folder: config.json, tokenizer.json, *.safetensors
    envs: list[tuple[str, dict]]  # (name, env.make_env kwargs) of every env a task may come from
    agent: AgentConfig  # turns, token budget, chat format; n_samples is the group size
    engine: str = "torch"  # rollout.make_engine's kind: "torch" or "vllm"
    # rollout.make_engine's keywords (rollout.engine_options)
    engine_kwargs: dict = field(default_factory=dict)
    threads: int = 1  # torch CPU threads of the worker (Ray gives a 1-CPU actor 1 OMP thread)


@dataclass
class NumpyWeights:
    """A state dict as numpy arrays, the form the object store hands out zero-copy. numpy has no
    bfloat16: those tensors travel as their int16 bit patterns, named in `bfloat16`."""

    arrays: dict  # {HF name: np.ndarray}
    bfloat16: tuple = ()  # names whose array holds bfloat16 bits

    @staticmethod
    def from_torch(state_dict: dict[str, torch.Tensor]) -> "NumpyWeights":
        """The tensors as arrays sharing their memory (a copy only for a tensor off the CPU or
        not contiguous)."""
        arrays, bf16 = {}, []
        for name, t in state_dict.items():
            t = t.detach().cpu().contiguous()
            if t.dtype == torch.bfloat16:
                t = t.view(torch.int16)  # same bits, a dtype numpy has
                bf16.append(name)
            arrays[name] = t.numpy()
        return NumpyWeights(arrays, tuple(bf16))

    def to_torch(self) -> dict[str, torch.Tensor]:
        """Tensors that share the arrays' memory (read-only in the object store: engines copy out
        of them)."""
        with warnings.catch_warnings():  # "the given NumPy array is not writable": we only read
            warnings.simplefilter("ignore", UserWarning)
            out = {name: torch.from_numpy(a) for name, a in self.arrays.items()}
        return {
            name: t.view(torch.bfloat16) if name in self.bfloat16 else t for name, t in out.items()
        }


class RolloutWorker:
    """An engine, the tokenizer and the envs in one process (a Ray actor; start_rollout_workers
    makes them): it plays chunks of episodes with agent.run_episodes and takes weight pushes. A
    plain class, so a test or a debugger can also build one in-process."""

    def __init__(self, spec: WorkerSpec):
        from tokenizers import Tokenizer

        from rollout import make_engine

        torch.set_num_threads(spec.threads)
        self.spec = spec
        self.tokenizer = Tokenizer.from_file(os.path.join(spec.model_dir, "tokenizer.json"))
        if spec.engine not in ("torch", "vllm"):
            raise ValueError(f"RolloutWorker: engine {spec.engine!r} is not 'torch' or 'vllm'")
        self.engine = make_engine(
            spec.engine, spec.model_dir, pad_id=pad_token_id(self.tokenizer), **spec.engine_kwargs
        )
        self.envs = {name: make_env(name, **kwargs) for name, kwargs in spec.envs}
        self.step_many = None  # env steps in this process, unless use_env_workers gives an EnvPool
        self.busy = 0.0  # seconds spent playing episodes, for the dispatchers' idle fraction

    def run_episodes(
        self,
        tasks: list[Task],
        params,
        seed: int,
        judge_weight: float = 0.0,
        agent: AgentConfig | None = None,
    ) -> list[Trajectory]:
        """A whole chunk: agent.run_episodes on these tasks (groups numbered from 0). `agent`
        overrides the spec's (eval: n=1)."""
        t0 = time.perf_counter()
        try:
            return run_episodes(
                self.engine,
                self.envs,
                tasks,
                self.tokenizer,
                agent or self.spec.agent,
                params,
                seed,
                judge_weight=judge_weight,
                step_many=self.step_many,
            )
        finally:
            self.busy += time.perf_counter() - t0

    def play_episodes(
        self,
        trajs: list[Trajectory],
        states: list,
        params,
        seed: int,
        agent: AgentConfig | None = None,
    ) -> list[Trajectory]:
        """The pipeline's middle stage: agent.play_episodes on an EnvWorker's
        init_episodes output."""
        t0 = time.perf_counter()
        try:
            step_many = self.step_many or (lambda calls: step_envs(self.envs, calls))
            return play_episodes(
                self.engine,
                trajs,
                states,
                self.tokenizer,
                agent or self.spec.agent,
                params,
                seed,
                step_many,
            )
        finally:
            self.busy += time.perf_counter() - t0

    def generate(self, prompts: list[list[int]], params) -> list:
        """The engine's generate (train.py's weight-sync gate samples on worker 0)."""
        return self.engine.generate(prompts, params)

    def update_weights(self, weights: NumpyWeights):
        """Copy pushed weights into the engine (Ray resolves push_weights' object ref to the
        shared arrays)."""
        self.engine.update_weights(weights.to_torch())

    def use_env_workers(self, env_workers: list):
        """Run env steps on these EnvWorker actors from now on (an EnvPool), or in this process
        for []."""
        self.step_many = EnvPool(env_workers) if env_workers else None

    def sleep(self):
        """The engine's sleep (frees its GPU memory while the learner trains; a no-op on CPU)."""
        self.engine.sleep()

    def wake_up(self):
        """The engine's wake_up, before the next push."""
        self.engine.wake_up()

    def busy_seconds(self) -> float:
        """Seconds spent playing episodes since the start: a dispatcher reads it before and after
        (idle fraction)."""
        return self.busy


class EnvWorker:
    """Env work off the rollout workers, for CPU-heavy envs (code grading, python_exec, a judge):
    env steps (EnvPool), and the async_pipeline's init and evaluate stages. Holds its own copies of
    the envs (passed in, so an env defined anywhere travels with them) and of the tokenizer (for
    init's prompts)."""

    def __init__(self, envs: dict[str, Env], model_dir: str):
        from tokenizers import Tokenizer

        self.envs = envs
        self.tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))

    def step(self, calls: list[tuple[str, object, Action]]) -> list[StepResult]:
        """agent.step_envs here: an env that raises comes back as that call's error, exactly
        as in-process."""
        return step_envs(self.envs, calls)

    def init_episodes(
        self, tasks: list[Task], seed: int, agent: AgentConfig
    ) -> tuple[list[Trajectory], list]:
        """The pipeline's first stage: agent.init_episodes (env.reset, first prompts rendered
        and encoded)."""
        return init_episodes(self.envs, tasks, self.tokenizer, agent, seed)

    def finish_episodes(self, trajs: list[Trajectory], judge_weight: float) -> list[Trajectory]:
        """The pipeline's last stage: agent.finish_episodes (the judge, when judge_weight > 0)."""
        return finish_episodes(self.envs, trajs, judge_weight)


class EnvPool:
    """A `step_many` for agent.play_episodes that spreads a turn's env steps over EnvWorker actors:
    contiguous shards, one remote call per worker, results back in the calls' order. Env steps
    depend only on (state, action), so the trajectories are the same as with in-process steps."""

    def __init__(self, env_workers: list):
        if not env_workers:
            raise ValueError("EnvPool needs at least one EnvWorker")
        self.workers = list(env_workers)

    def __call__(self, calls: list[tuple[str, object, Action]]) -> list[StepResult]:
        n = len(self.workers)
        bounds = [len(calls) * k // n for k in range(n + 1)]
        refs = [
            w.step.remote(calls[a:b]) for w, a, b in zip(self.workers, bounds, bounds[1:]) if b > a
        ]
        return [r for shard in _get(refs, "an EnvWorker") for r in shard]


def make_placement_group(
    n: int, cpus: float, gpus: float = 0, strategy: str = "PACK", wait_s: float = 120
):
    """One bundle per worker ({"CPU": cpus}, plus {"GPU": gpus} when asked), reserved all at once.
    PACK puts the bundles on as few nodes as possible (one machine: workers next to the learner);
    SPREAD puts them on as many nodes as possible (a multi-node cluster: one worker per machine's
    GPUs). Raises when the cluster cannot hold them within wait_s, rather than waiting for ever."""
    import ray
    from ray.util.placement_group import placement_group

    bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    pg = placement_group([dict(bundle) for _ in range(n)], strategy=strategy)
    if not pg.wait(wait_s):
        ray.util.remove_placement_group(pg)
        raise RuntimeError(
            f"Ray cannot place {n} workers of {bundle} ({strategy}) in {wait_s:g} s; the cluster "
            f"has {ray.cluster_resources()}: lower ray.cpus_per_worker / gpus_per_worker or the "
            "worker count"
        )
    return pg


def start_rollout_workers(spec: WorkerSpec, n: int, placement_group, first_bundle: int = 0) -> list:
    """n RolloutWorker actors, worker i in bundle first_bundle + i of the placement group (its CPU
    and GPU share)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundles = placement_group.bundle_specs
    workers = []
    for i in range(n):
        b = bundles[first_bundle + i]
        strategy = PlacementGroupSchedulingStrategy(
            placement_group, placement_group_bundle_index=first_bundle + i
        )
        workers.append(
            ray.remote(RolloutWorker)
            .options(
                num_cpus=b.get("CPU", 0), num_gpus=b.get("GPU", 0), scheduling_strategy=strategy
            )
            .remote(spec)
        )
    return workers


def start_env_workers(envs: dict[str, Env], model_dir: str, n: int, cpus: float = 1) -> list:
    """n EnvWorker actors of `cpus` CPUs each, placed wherever Ray finds room (they need no GPU)."""
    import ray

    return [ray.remote(EnvWorker).options(num_cpus=cpus).remote(envs, model_dir) for _ in range(n)]


def push_weights(workers: list, state_dict: dict[str, torch.Tensor]) -> float:
    """Send the learner's weights to every worker -> seconds taken. One ray.put: the workers of a
    node read the same arrays in its object store (no copy per worker until the engine copies
    them in)."""
    import ray

    t0 = time.perf_counter()
    ref = ray.put(NumpyWeights.from_torch(state_dict))
    _get([w.update_weights.remote(ref) for w in workers], "a RolloutWorker")
    return time.perf_counter() - t0


@dataclass
class DispatchStats:
    """How one dispatch went; metrics() gives train.py's dispatch/* (see the README's
    metrics table)."""

    kind: str  # the dispatcher
    wall_seconds: float  # first submit to last result
    trajectories: int  # episodes played
    sampled_tokens: int  # tokens the engines sampled (loss-mask 1)
    busy_seconds: list[float]  # per rollout worker: time spent playing episodes during the dispatch
    chunks: int  # units of work (chunk_groups task groups each)
    max_in_flight: int  # most chunks submitted and not yet finished at one time

    @property
    def idle_fraction(self) -> float:
        """Mean over rollout workers of 1 - busy / wall: the share of the dispatch a
        worker waited."""
        return sum(1 - b / max(self.wall_seconds, 1e-9) for b in self.busy_seconds) / max(
            len(self.busy_seconds), 1
        )

    def metrics(self) -> dict[str, float]:
        wall = max(self.wall_seconds, 1e-9)
        return {
            "dispatch/wall_seconds": self.wall_seconds,
            "dispatch/trajectories_per_s": self.trajectories / wall,
            "dispatch/tokens_per_s": self.sampled_tokens / wall,
            "dispatch/idle_fraction": self.idle_fraction,
            "dispatch/max_busy_seconds": max(self.busy_seconds, default=0.0),
            "dispatch/chunks": float(self.chunks),
            "dispatch/max_in_flight": float(self.max_in_flight),
        }


def dispatch(
    kind: str,
    workers: list,
    tasks: list[Task],
    params,
    seed: int,
    judge_weight: float = 0.0,
    agent: AgentConfig | None = None,
    chunk_groups: int = 1,
    max_in_flight: int = 0,
    env_workers: list = (),
) -> tuple[list[Trajectory], DispatchStats]:
    """Play every task's group on the rollout workers -> (trajectories group-major, as run_episodes
    would number them, and DispatchStats). The unit of work is a chunk of `chunk_groups` tasks,
    played with mix_seed(seed, first group). The dispatchers (the names of SkyRL's
    "Toy Math Agent" example):

      async_batch          every chunk submitted at once, round-robin over the workers; wait
                           for all.
      async_batch_bounded  at most max_in_flight chunks in flight (0: one per worker); a worker that
                           finishes gets the next chunk, so fast workers take more.
      async_pipeline       init (EnvWorker: env.reset + prompts) -> run (RolloutWorker: generation
                           and tool loop) -> evaluate (EnvWorker: the judge) as stages with queues
                           between them, each on its own actors, so chunk i+1's init overlaps chunk
                           i's run and chunk i-1's evaluate. Needs env_workers: the first half run
                           init, the rest evaluate (one worker does both). At most max_in_flight
                           chunks (0: two per worker) between init and evaluate.

    `agent` overrides the workers' AgentConfig (eval: n_samples=1; the pipeline needs it to split
    the stages).
    """
    if kind not in DISPATCHERS:
        raise ValueError(f"unknown dispatcher {kind!r}; choose from {list(DISPATCHERS)}")
    if not workers:
        raise ValueError("dispatch needs at least one RolloutWorker")
    if chunk_groups < 1 or max_in_flight < 0:
        raise ValueError(
            f"chunk_groups must be >= 1 and max_in_flight >= 0 "
            f"(got {chunk_groups}, {max_in_flight})"
        )
    if kind == "async_pipeline" and (not env_workers or agent is None):
        raise ValueError(
            "async_pipeline needs env_workers (its init and evaluate stages) and the AgentConfig"
        )
    starts = list(range(0, len(tasks), chunk_groups))
    chunks = [
        (first, tasks[first : first + chunk_groups], mix_seed(seed, first)) for first in starts
    ]
    busy0 = _get([w.busy_seconds.remote() for w in workers], "a RolloutWorker")
    t0 = time.perf_counter()
    if kind == "async_pipeline":
        results, peak = _pipeline(
            workers,
            list(env_workers),
            chunks,
            params,
            judge_weight,
            agent,
            max_in_flight or 2 * len(workers),
        )
    else:
        bound = len(chunks) if kind == "async_batch" else (max_in_flight or len(workers))
        results, peak = _bounded(workers, chunks, params, judge_weight, agent, bound)
    wall = time.perf_counter() - t0
    busy = [
        b - b0
        for b, b0 in zip(_get([w.busy_seconds.remote() for w in workers], "a RolloutWorker"), busy0)
    ]
    # chunk-local group ids -> the batch's
    trajs = [
        dataclasses.replace(t, group=t.group + first)
        for (first, _, _), part in zip(chunks, results)
        for t in part
    ]
    stats = DispatchStats(
        kind, wall, len(trajs), sum(sum(t.loss_mask) for t in trajs), busy, len(chunks), peak
    )
    return trajs, stats


def _bounded(workers, chunks, params, judge_weight, agent, bound: int):
    """async_batch (bound = every chunk) and async_batch_bounded: at most `bound` chunks in flight;
    the first `bound` go round-robin, then each finished chunk's worker takes the next one ->
    (results by chunk, peak)."""
    import ray

    results = [None] * len(chunks)
    in_flight, free, peak = {}, [], 0  # ref -> (chunk index, worker)

    def collect_one():
        (ref,), _ = ray.wait(list(in_flight), num_returns=1)
        c, worker = in_flight.pop(ref)
        results[c] = _get(ref, "a RolloutWorker")
        free.append(worker)

    for c, (_, tasks, seed) in enumerate(chunks):
        if len(in_flight) >= bound:
            collect_one()
        worker = workers[c % len(workers)] if c < bound else free.pop(0)
        in_flight[worker.run_episodes.remote(tasks, params, seed, judge_weight, agent)] = (
            c,
            worker,
        )
        peak = max(peak, len(in_flight))
    while in_flight:
        collect_one()
    return results, peak


def _pipeline(workers, env_workers, chunks, params, judge_weight, agent, bound: int):
    """async_pipeline: three stages, each a queue of chunks waiting for a free actor of its stage.
    Objects go from stage to stage through the object store (the driver holds refs only; an error of
    an early stage surfaces when the chunk's evaluate result is fetched) -> (results by chunk, peak
    chunks in flight)."""
    import ray

    half = max(1, len(env_workers) // 2)
    free = {
        "init": env_workers[:half],
        "run": list(workers),
        "evaluate": env_workers[half:] or env_workers[:],
    }
    # chunk indices, in order
    queued = {"init": list(range(len(chunks))), "run": [], "evaluate": []}
    inputs = {}  # chunk -> the refs its next stage takes
    in_flight = {}  # ref -> (stage, chunk, actor)
    results, started, finished, peak = [None] * len(chunks), 0, 0, 0
    while any(queued.values()) or in_flight:
        for stage in ("evaluate", "run", "init"):  # later stages first: finish what is started
            while queued[stage] and free[stage] and (stage != "init" or started - finished < bound):
                c, actor = queued[stage].pop(0), free[stage].pop(0)
                _, tasks, seed = chunks[c]
                if stage == "init":
                    # (trajs, states)
                    inputs[c] = actor.init_episodes.options(num_returns=2).remote(
                        tasks, seed, agent
                    )
                    ref, started = inputs[c][1], started + 1
                elif stage == "run":
                    ref = inputs[c] = actor.play_episodes.remote(*inputs[c], params, seed, agent)
                else:
                    ref = actor.finish_episodes.remote(inputs.pop(c), judge_weight)
                in_flight[ref] = (stage, c, actor)
                peak = max(peak, started - finished)
        (ref,), _ = ray.wait(list(in_flight), num_returns=1)
        stage, c, actor = in_flight.pop(ref)
        free[stage].append(actor)
        if stage == "evaluate":
            results[c], finished = _get(ref, "an EnvWorker or a RolloutWorker"), finished + 1
        else:
            queued["run" if stage == "init" else "evaluate"].append(c)
    return results, peak


def _get(refs, who: str):
    """ray.get, with a worker that died turned into an error that says so (not Ray's long
    actor traceback)."""
    import ray

    try:
        return ray.get(refs)
    except ray.exceptions.RayActorError as e:
        raise RuntimeError(
            f"{who} died ({type(e).__name__}): its chunk of episodes is lost. Look for the cause "
            f"(out of memory, a crash in the engine) in the Ray logs; the run stops here"
        ) from e


class RayRollouts:
    """Rollout workers (and env workers) seen by train.py as one rollout source, answering the same
    calls as agent.LocalRollouts: play() runs a batch of tasks through the configured dispatcher,
    generate() samples on worker 0 (the weight-sync gate's probe: every worker got the same push),
    update_weights() is push_weights to every worker, sleep()/wake_up() go to every
    worker's engine."""

    def __init__(
        self,
        workers: list,
        env_workers: list,
        placement_group,
        dispatcher: str,
        chunk_groups: int,
        max_in_flight: int,
        agent: AgentConfig,
        owns_cluster: bool = False,
    ):
        self.workers, self.env_workers, self.placement_group = workers, env_workers, placement_group
        # shutdown() also stops Ray when the caller started it for us
        self.owns_cluster = owns_cluster
        self.dispatcher, self.chunk_groups, self.max_in_flight = (
            dispatcher,
            chunk_groups,
            max_in_flight,
        )
        self.agent = agent

    def play(
        self,
        tasks: list[Task],
        params,
        seed: int,
        judge_weight: float = 0.0,
        agent: AgentConfig | None = None,
    ) -> tuple[list[Trajectory], dict[str, float]]:
        """dispatch with the configured dispatcher -> (trajectories group-major, its
        dispatch/* metrics)."""
        trajs, stats = dispatch(
            self.dispatcher,
            self.workers,
            tasks,
            params,
            seed,
            judge_weight,
            agent or self.agent,
            self.chunk_groups,
            self.max_in_flight,
            self.env_workers,
        )
        return trajs, stats.metrics()

    def generate(self, prompts: list[list[int]], params) -> list:
        """Worker 0's engine.generate."""
        return _get(self.workers[0].generate.remote(prompts, params), "RolloutWorker 0")

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> dict[str, float]:
        """push_weights to every worker -> {"dispatch/push_seconds": its seconds}."""
        return {"dispatch/push_seconds": push_weights(self.workers, state_dict)}

    def sleep(self):
        """Every worker's engine sleeps (GPU memory freed for the learner; a no-op on CPU)."""
        _get([w.sleep.remote() for w in self.workers], "a RolloutWorker")

    def wake_up(self):
        """Every worker's engine wakes up."""
        _get([w.wake_up.remote() for w in self.workers], "a RolloutWorker")

    def shutdown(self):
        """Stop the actors and free their placement group; then Ray itself, if it was started for
        these workers."""
        import ray

        for actor in self.workers + self.env_workers:
            ray.kill(actor)
        ray.util.remove_placement_group(self.placement_group)
        if self.owns_cluster:
            ray.shutdown()


def start_ray_rollouts(
    cfg, model_dir: str, envs: dict[str, Env], engine_kwargs: dict, weights: dict | None = None
) -> RayRollouts:
    """cfg.ray.rollout_workers RolloutWorkers (and cfg.ray.env_workers EnvWorkers) on the Ray
    cluster at cfg.ray.address, or on a local one started here, each building its engine with
    rollout.make_engine( cfg.rollout.engine, model_dir, **engine_kwargs); then `weights` pushed when
    the learner is not the base model (a resumed run; LoRA's merged weights). `cfg` is config.Config
    (only cfg.ray, cfg.rollout, cfg.envs read)."""
    try:
        import ray
    except ImportError:
        raise RuntimeError(
            "ray.rollout_workers > 0 needs Ray installed (pip install 'ray>=2.60'), or set "
            "ray.rollout_workers=0 to play the episodes in this process"
        ) from None
    owns_cluster = not ray.is_initialized()  # a test, or a script, may have started it already
    if owns_cluster:
        ray.init(address=cfg.ray.address or None, include_dashboard=False)
    ray_cfg, agent = cfg.ray, cfg.rollout.agent
    spec = WorkerSpec(
        model_dir=os.path.abspath(model_dir),
        envs=[(e.name, e.kwargs) for e in cfg.envs],
        agent=agent,
        engine=cfg.rollout.engine,
        engine_kwargs=engine_kwargs,
        threads=max(1, int(ray_cfg.cpus_per_worker)),
    )
    pg = make_placement_group(
        ray_cfg.rollout_workers,
        ray_cfg.cpus_per_worker,
        ray_cfg.gpus_per_worker,
        ray_cfg.placement_strategy,
    )
    workers = start_rollout_workers(spec, ray_cfg.rollout_workers, pg)
    env_workers = start_env_workers(
        envs, spec.model_dir, ray_cfg.env_workers, ray_cfg.cpus_per_env_worker
    )
    rollouts = RayRollouts(
        workers,
        env_workers,
        pg,
        ray_cfg.dispatcher,
        ray_cfg.chunk_groups,
        ray_cfg.max_in_flight,
        agent,
        owns_cluster,
    )
    if env_workers:
        ray.get([w.use_env_workers.remote(env_workers) for w in workers])
    if weights is not None:
        rollouts.update_weights(weights)
    return rollouts


# -----------------------------------------------------------------------------
# launching on Ray: the learner's ranks as actors, the same SPMD entry point that torchrun starts

# how long to wait for the cluster to free (or an autoscaler to add) the bundles
PLACEMENT_TIMEOUT_S = 300


class LearnerRank:
    """One rank of the learner in a Ray actor (wrapped by ray.remote in launch_on_ray, so that
    importing cluster.py never imports Ray). It sets torchrun's environment variables, then
    runs entry(cfg)."""

    def address(self) -> tuple[str, int]:
        """This node's IP and a port free on it: rank 0's answer is every rank's MASTER_ADDR
        and MASTER_PORT."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def run(self, entry, cfg, env: dict[str, str]) -> dict:
        """entry(cfg) as the rank that `env` (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
        MASTER_PORT) names."""
        os.environ.update(env)  # read by init_distributed (torch's env:// rendezvous)
        return entry(cfg)


def launch_on_ray(cfg, entry) -> dict:
    """Run entry(cfg) (train.main) as cfg.ray.learner_workers Ray actors, rank i in bundle i of one
    placement group, and return rank 0's result. So `ray job submit -- python train.py ...
    ray.learner_workers=2` trains exactly as `torchrun --nproc_per_node 2 train.py ...` does. The
    entry point is an argument, so this file imports no training code. Joins the cluster at
    ray.address ("" = $RAY_ADDRESS, else a local Ray it starts and stops). If an actor fails or
    dies, the others would wait in a collective forever: they are killed, and the error names
    the rank."""
    rc, n = cfg.ray, cfg.ray.learner_workers
    if "RANK" in os.environ:  # set by torchrun (and by us, inside an actor)
        raise ValueError(
            f"ray.learner_workers={n} under torchrun: choose one launcher "
            "(torchrun starts the ranks itself; "
            "ray.learner_workers=N starts them as Ray actors from one `python train.py`)"
        )
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            f"ray.learner_workers={n} needs Ray: pip install 'ray[default]' (or bash setup.sh)"
        ) from e
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    address = rc.address or os.environ.get("RAY_ADDRESS", "")
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if host and port.isdigit():  # ray.init would retry a dead address for minutes
        import socket

        try:
            socket.create_connection((host, int(port)), timeout=10).close()
        except OSError as e:
            raise ConnectionError(
                f"no Ray cluster at {address!r} ({e}): start one there with `ray start --head`, "
                "or leave ray.address and $RAY_ADDRESS empty to start a local Ray"
            ) from None
    started = not ray.is_initialized()  # a connection the caller made is left open at the end
    if started:
        ray.init(address=rc.address or None)
    bundle = {
        "CPU": rc.cpus_per_learner,
        **({"GPU": rc.gpus_per_learner} if rc.gpus_per_learner else {}),
    }
    pg = placement_group([bundle] * n, strategy=rc.placement_strategy)
    ranks = []
    try:
        if not ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)[0]:
            raise RuntimeError(
                f"Ray could not place {n} learner bundles of {bundle} ({rc.placement_strategy}) in "
                f"{PLACEMENT_TIMEOUT_S} s; the cluster has {ray.cluster_resources()}"
            )
        actor = ray.remote(LearnerRank)
        ranks = [
            actor.options(
                num_cpus=rc.cpus_per_learner,
                num_gpus=rc.gpus_per_learner,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=i
                ),
            ).remote()
            for i in range(n)
        ]
        master_addr, master_port = ray.get(ranks[0].address.remote())
        # LOCAL_RANK 0: Ray gives each actor its own GPU(s) through CUDA_VISIBLE_DEVICES, so its GPU
        # is device 0
        runs = {
            r.run.remote(
                entry,
                cfg,
                {
                    "RANK": str(i),
                    "WORLD_SIZE": str(n),
                    "LOCAL_RANK": "0",
                    "MASTER_ADDR": master_addr,
                    "MASTER_PORT": str(master_port),
                },
            ): i
            for i, r in enumerate(ranks)
        }
        results, pending = {}, list(runs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                results[runs[done[0]]] = ray.get(done[0])
            except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as e:
                # raised, or the process died
                raise RuntimeError(f"learner rank {runs[done[0]]} of {n} failed: {e}") from e
        return results[0]
    finally:
        for r in ranks:
            ray.kill(r)
        remove_placement_group(pg)
        if started:
            ray.shutdown()
