"""train.py: RL training of a tool-using LLM agent, top to bottom.

    python train.py --config configs/toy_math.yaml [key.sub=value ...]
    torchrun --nproc_per_node 2 train.py --config configs/toy_math.yaml [key.sub=value ...]
    ray job submit -- python train.py --config configs/toy_math.yaml ray.learner_workers=2 [key.sub=value ...]

config -> build (model, tokenizer, envs, engine, learner) -> loop:
    sample prompts -> rollouts (n per prompt, multi-turn, tools) -> rewards -> group advantages
    -> policy update -> push weights to the engine -> weight-sync gate -> eval every k steps -> log -> checkpoint

The engine (rollout.engine=torch|vllm) keeps its own copy of the weights, refreshed by a push after every
update; the gate then checks that it really runs them (rollout.py: sync_probe, logprob_gap, assert_synced)
and stops the run if not. Under torchrun rank 0 samples the probe with its engine and every rank scores it.

With rollout.async_rollouts the engine generates the next step's batch in a background thread while the
learner trains on this one (one-step off-policy, corrected by truncated importance sampling: learner.tis_cap).

With `model.path: default` (the default) the embedded tiny model is built first (sft.py: tokenizer, tiny
Qwen2, SFT warm start) and cached. Everything random is derived from `seed` and the step number, so a
resumed run repeats exactly what an uninterrupted one would have done.

Outputs in runs/<run_name>/: config.yaml (resolved), metrics.jsonl (one JSON object per step),
episodes_step<N>.jsonl (held-out episodes), curves.png (reward and held-out accuracy), checkpoints,
and wandb/ (offline unless WANDB_MODE says otherwise). Shapes: B sequences, T tokens, G group size.

Under torchrun (N processes): every rank builds the same model and the learner shards it (FSDP2,
learner.shard_model). Rank 0 alone owns the inference engine and the envs: it generates each step's
rollouts exactly as one process would (same seeds) and broadcasts the batch; every rank then computes the
same advantages and takes its share of the rows in the update (learner.py, point 4), so a run is
deterministic and its updates equal a single process's. Rank 0 alone evaluates, logs and writes
checkpoints; the engine push gathers the full (LoRA-merged) state dict onto rank 0. The design is the
simplest correct one, and it scales the learner only: rollouts run on one rank while the others wait
(rank-parallel rollouts would need one engine per rank and a gather of the trajectories).

Under Ray (`ray.learner_workers=N`, launch_on_ray): this process only places N actors, and each actor runs
main(cfg) as one of N ranks, exactly as torchrun's processes do; the process group, the sharding and the
loop are the same, so the two launchers log the same records.

With ray.rollout_workers > 0, rank 0 starts (or joins, ray.address) a Ray cluster and N RolloutWorker actors,
each with its own engine, in a placement group (rollout.py, section "Ray"). They play the rollouts and the
held-out evals through the dispatcher of ray.dispatcher (dispatch/* metrics); the push after each update is
one object-store put read by all of them (rollout.push_weights), and the gate samples its probe on worker 0.
With 0 (the default) Ray is never imported and everything runs in this process as described above.
"""
import argparse
import copy
import json
import os
import pickle
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch
import yaml
from tokenizers import Tokenizer
from tqdm import tqdm

import algos
from agent import SamplingParams, rollout_metrics, run_episodes, to_batch
from config import Config, load_config, to_dict
from env import make_env, mix_seed
from eval import dump_episodes, eval_metrics, evaluate, heldout_tasks
from learner import (Critic, TrainBatch, ValueBatch, apply_lora, barrier, broadcast_object, cleanup_distributed,
                     compute_logprobs, compute_values, critic_step, init_distributed, is_main, load_checkpoint,
                     make_learner, merged_state_dict, save_checkpoint, save_merged, shard_model, train_step)
from model import load_model
from plot import save_curves
from rollout import (RayEngine, TorchEngine, VLLMEngine, WorkerSpec, assert_synced, logprob_gap,
                     make_placement_group, start_env_workers, start_rollout_workers, sync_probe)
from sft import build_default_model


PENDING = "pending_rollouts.pkl"                   # async mode: the next step's rollouts, saved with a checkpoint


# What each random draw of a step is for: its seed is mix_seed(run seed, step, purpose, refill round).
SEED_TASKS, SEED_EPISODES, SEED_SYNC_PROBE = 1, 2, 3


def sample_train_tasks(envs: dict, specs: list, n: int, seed: int) -> list:
    """n training tasks, split across envs by weight (largest remainders get the leftover prompts)."""
    total = sum(s.weight for s in specs)
    quotas = [n * s.weight / total for s in specs]
    counts = [int(q) for q in quotas]
    for i in sorted(range(len(specs)), key=lambda i: counts[i] - quotas[i])[: n - sum(counts)]:
        counts[i] += 1
    tasks = []
    for i, (s, c) in enumerate(zip(specs, counts)):
        if c:
            tasks += envs[s.name].sample_tasks("train", c, seed + i)
    return tasks


def collect_rollouts(cfg: Config, engine, envs: dict, tokenizer, step: int):
    """prompts_per_step groups of n_samples episodes -> (trajectories, rounds used, dispatch/* metrics of the
    last round: empty unless the engine is a RayEngine, whose workers play the episodes through a dispatcher).

    With algo.dynamic_sampling (DAPO), groups whose rewards are all equal carry no GRPO signal: they are
    dropped and more prompts are sampled, up to max_refill_rounds extra rounds; the batch may end smaller."""
    want, G = cfg.rollout.prompts_per_step, cfg.rollout.agent.n_samples
    kept: list = []
    rounds = 0
    for r in range(1 + (cfg.algo.max_refill_rounds if cfg.algo.dynamic_sampling else 0)):
        rounds += 1
        tasks = sample_train_tasks(envs, cfg.envs, want, mix_seed(cfg.seed, step, SEED_TASKS, r))
        # no params.seed: the agent loop seeds every turn's call from the episodes' seed (agent.play_episodes)
        params = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                max_tokens=cfg.rollout.max_tokens)
        seed = mix_seed(cfg.seed, step, SEED_EPISODES, r)
        if isinstance(engine, RayEngine):
            trajs, stats = engine.play(tasks, params, seed, judge_weight=cfg.rollout.judge_weight)
            dispatch_metrics = stats.metrics()
        else:
            trajs = run_episodes(engine, envs, tasks, tokenizer, cfg.rollout.agent, params, seed,
                                 judge_weight=cfg.rollout.judge_weight)
            dispatch_metrics = {}
        groups = [trajs[i:i + G] for i in range(0, len(trajs), G)]                     # group-major
        if cfg.algo.dynamic_sampling:
            kept += [g for g in groups if len({t.reward for t in g}) > 1]
        else:
            kept += groups
        if len(kept) >= want:
            break
    if not kept:                                     # nothing informative: keep the last round, skip_uniform decides
        kept = groups
    return [t for g in kept[:want] for t in g], rounds, dispatch_metrics


def build_engine(cfg: Config, model_dir: str, engine_model, weights: dict | None, pad_id: int):
    """The rollout engine (rank 0's), holding its own copy of the learner's weights: `engine_model` (a copy of
    the base model, torch engine) or the folder vLLM loads, then `weights` when the learner is not the base
    (a resumed run; LoRA's merged weights)."""
    if cfg.rollout.engine == "vllm":
        r = cfg.rollout
        engine = VLLMEngine(model_dir, dtype=cfg.model.dtype, seed=cfg.seed, cache_dir=cfg.model.cache_dir,
                            max_model_len=r.agent.max_total_tokens + max(r.max_tokens, r.sync_check_tokens),
                            max_num_seqs=r.max_batch_size, gpu_memory_utilization=r.gpu_memory_utilization)
    else:
        engine = TorchEngine(engine_model, pad_id=pad_id, max_batch_size=cfg.rollout.max_batch_size)
    if weights is not None:
        engine.update_weights(weights)
    return engine


def start_ray_engine(cfg: Config, model_dir: str, envs: dict, weights: dict | None) -> RayEngine:
    """ray.rollout_workers RolloutWorkers (and ray.env_workers EnvWorkers) on the Ray cluster at ray.address, or on
    a local one started here, then `weights` pushed when the learner is not the base model (see build_engine)."""
    try:
        import ray
    except ImportError:
        raise RuntimeError("ray.rollout_workers > 0 needs Ray installed (pip install 'ray>=2.60'), or set "
                           "ray.rollout_workers=0 to play the episodes in this process") from None
    owns_cluster = not ray.is_initialized()       # a test, or a script, may have started it already
    if owns_cluster:
        ray.init(address=cfg.ray.address or None, include_dashboard=False)
    r, rc = cfg.ray, cfg.rollout
    engine_kwargs = {"max_batch_size": rc.max_batch_size}
    if rc.engine == "vllm":
        engine_kwargs = dict(seed=cfg.seed, cache_dir=cfg.model.cache_dir, max_num_seqs=rc.max_batch_size,
                             max_model_len=rc.agent.max_total_tokens + max(rc.max_tokens, rc.sync_check_tokens),
                             gpu_memory_utilization=rc.gpu_memory_utilization)
    spec = WorkerSpec(model_dir=os.path.abspath(model_dir), envs=[(e.name, e.kwargs) for e in cfg.envs],
                      agent=rc.agent, engine=rc.engine, engine_kwargs=engine_kwargs, dtype=cfg.model.dtype,
                      threads=max(1, int(r.cpus_per_worker)))
    pg = make_placement_group(r.rollout_workers, r.cpus_per_worker, r.gpus_per_worker, r.placement_strategy)
    workers = start_rollout_workers(spec, r.rollout_workers, pg)
    env_workers = start_env_workers(envs, spec.model_dir, r.env_workers, r.cpus_per_env_worker)
    engine = RayEngine(workers, env_workers, pg, r.dispatcher, r.chunk_groups, r.max_in_flight, rc.agent,
                       owns_cluster)
    if env_workers:
        ray.get([w.use_env_workers.remote(env_workers) for w in workers])
    if weights is not None:
        engine.update_weights(weights)
    return engine


def sync_threshold(cfg: Config) -> float:
    """rollout.sync_max_logprob_diff, or its default for the dtype (see config.py)."""
    if cfg.rollout.sync_max_logprob_diff is not None:
        return cfg.rollout.sync_max_logprob_diff
    return 1e-3 if cfg.model.dtype == "float32" else 0.5


def timed(fn, *args):
    """fn(*args) -> (*its result, seconds it took): collect_rollouts' time when it runs in a background thread."""
    t = time.time()
    out = fn(*args)
    return (*out, time.time() - t)


class Logger:
    """metrics.jsonl (always) + wandb (optional, offline by default): one record per step at the global step.
    On ranks other than 0 (`enabled=False`) it writes nothing."""

    def __init__(self, run_dir: str, cfg: Config, resume: bool, enabled: bool = True):
        self.file = open(os.path.join(run_dir, "metrics.jsonl"), "a" if resume else "w") if enabled else None
        self.wandb = None
        if cfg.wandb and enabled:
            os.environ.setdefault("WANDB_MODE", "offline")
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb
            self.wandb = wandb.init(project=cfg.wandb_project, name=cfg.run_name, dir=run_dir,
                                    config=to_dict(cfg), resume="allow")

    def log(self, step: int, metrics: dict):
        if self.file is None:
            return
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def finish(self):
        if self.file is not None:
            self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


def main(cfg: Config) -> dict:
    # -------------------------------------------------------------------------
    # setup
    t_start = time.time()
    if cfg.rollout.engine == "openai":
        raise ValueError(f"rollout.engine={cfg.rollout.engine!r} cannot train: its weights cannot be pushed "
                         "(evaluate with it: eval.py --checkpoint DIR rollout.engine=openai)")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    rank, world = init_distributed()              # (0, 1) for `python train.py`; torchrun sets the rest
    torch.manual_seed(cfg.seed)
    run_dir = os.path.join(cfg.out_dir, cfg.run_name)
    if is_main():
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(to_dict(cfg), f, sort_keys=False)

    # -------------------------------------------------------------------------
    # model, tokenizer, envs, engine, learner
    if cfg.model.path == "default" and is_main():
        build_default_model(cfg)                  # rank 0 builds (or finds) the cached model ...
    barrier()                                     # ... the other ranks then find it cached
    model_dir = build_default_model(cfg) if cfg.model.path == "default" else cfg.model.path
    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    pad_id = tokenizer.token_to_id("<|endoftext|>")
    dtype = getattr(torch, cfg.model.dtype)
    model = load_model(model_dir, dtype=dtype)
    ref_model = copy.deepcopy(model) if cfg.learner.kl_coef > 0 else None
    # with the KL in the reward, the loss must not count it a second time
    learner_cfg = replace(cfg.learner, kl_coef=0.0) if cfg.algo.kl_in_reward else cfg.learner
    critic_state, critic_cfg = None, replace(cfg.learner, lr=cfg.algo.critic_lr, lora_rank=0)
    if cfg.algo.advantage == "gae":                   # PPO: a critic initialised from the policy backbone
        critic_state = make_learner(shard_model(Critic(model), critic_cfg), critic_cfg, seed=cfg.seed + 1)
    # --- LoRA and sharding (learner.py): the engine, the reference and the critic get the plain base model
    in_process = is_main() and cfg.rollout.engine == "torch" and not cfg.ray.rollout_workers
    engine_model = copy.deepcopy(model).eval() if in_process else None
    if cfg.learner.lora_rank:                         # only the adapters train; the engine gets merged weights
        lc = cfg.learner
        apply_lora(model, lc.lora_rank, lc.lora_alpha, lc.lora_dropout, tuple(lc.lora_targets), seed=cfg.seed)
    model = shard_model(model, learner_cfg)           # one process: unchanged
    if ref_model is not None:
        ref_model = shard_model(ref_model, learner_cfg)
    state = make_learner(model, learner_cfg, seed=cfg.seed, ref_model=ref_model)
    if cfg.resume:
        state = load_checkpoint(state, cfg.resume)
        if critic_state is not None:
            critic_state = load_checkpoint(critic_state, os.path.join(cfg.resume, "critic"))
    # The engine keeps its own copy of the weights, refreshed after every update through update_weights,
    # whatever the engine: the loop never depends on sharing memory with it. Only rank 0 has one (and the
    # envs): it generates every rollout.
    weights = merged_state_dict(state.model) if cfg.resume or cfg.learner.lora_rank else None
    engine = envs = eval_tasks = None
    if is_main():
        envs = {e.name: make_env(e.name, **e.kwargs) for e in cfg.envs}
        if cfg.ray.rollout_workers:               # the episodes are played by Ray workers, each with its own engine
            engine = start_ray_engine(cfg, model_dir, envs, weights)
        else:
            engine = build_engine(cfg, model_dir, engine_model, weights, pad_id)
        eval_tasks = heldout_tasks(envs, {e.name: e.eval_size for e in cfg.envs}, cfg.eval_seed)
    agent_cfg = cfg.rollout.agent
    G = agent_cfg.n_samples

    def run_eval(step: int) -> dict:
        params = SamplingParams(temperature=cfg.eval_temperature, top_p=cfg.rollout.top_p,
                                max_tokens=cfg.rollout.max_tokens, seed=cfg.eval_seed)
        t0 = time.time()
        if isinstance(engine, RayEngine):             # one episode per held-out task, no judge, as evaluate() plays
            trajs, _ = engine.play([t for name in eval_tasks for t in eval_tasks[name]], params, cfg.eval_seed,
                                   agent=replace(agent_cfg, n_samples=1))
            m = eval_metrics(eval_tasks, trajs)
        else:
            m, trajs = evaluate(engine, envs, eval_tasks, tokenizer, agent_cfg, params, cfg.eval_seed)
        dump_episodes(trajs, os.path.join(run_dir, f"episodes_step{step}.jsonl"))
        return {**m, "perf/eval_seconds": time.time() - t0}

    def checkpoint(name: str, pending=None):
        """Every rank calls it (weights are gathered), rank 0 writes. A LoRA run writes its adapter (PEFT
        files) and, in `final/merged/`, the merged model that eval.py loads."""
        path = os.path.join(run_dir, name)
        save_checkpoint(state, path, extra={"run_name": cfg.run_name}, base_model=model_dir)
        if critic_state is not None:
            save_checkpoint(critic_state, os.path.join(path, "critic"))
        folders = [path]
        if cfg.learner.lora_rank and name == "final":
            save_merged(state.model, os.path.join(path, "merged"))
            folders.append(os.path.join(path, "merged"))
        for folder in folders if is_main() else []:
            for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
                shutil.copy(os.path.join(model_dir, f), folder)
        if pending is not None and is_main():      # async: the next step's batch, already generated from the
            with open(os.path.join(path, PENDING), "wb") as f:  # previous weights, which no checkpoint holds
                pickle.dump(pending, f)

    logger = Logger(run_dir, cfg, resume=bool(cfg.resume), enabled=is_main())
    history = []                                   # (step, metrics) of this process, for the plot
    start = state.step if cfg.resume else 0
    # async (one-step off-policy): `pending` is the next step's rollouts, generated in a background thread
    # while the learner trains; `version` of a batch = the RL steps its weights had taken (staleness: see below)
    pool = ThreadPoolExecutor(max_workers=1) if cfg.rollout.async_rollouts and is_main() else None
    pending = None                   # (trajs, rounds, dispatch metrics, seconds, version) ready for the next step
    if cfg.resume and pool is not None and os.path.exists(os.path.join(cfg.resume, PENDING)):
        with open(os.path.join(cfg.resume, PENDING), "rb") as f:
            pending = pickle.load(f)
    if start == 0 and is_main():
        m = run_eval(0)
        logger.log(0, m)
        history.append((0, m))
        print(f"step 0: held-out accuracy {m['eval/accuracy']:.3f}", flush=True)

    # -------------------------------------------------------------------------
    # the RL loop
    bar = tqdm(range(start + 1, cfg.steps + 1), desc="rl", initial=start, total=cfg.steps, dynamic_ncols=True,
               disable=not is_main())
    for step in bar:
        t0 = time.time()
        # --- rollouts: n samples per prompt, multi-turn with tools, token-exact trajectories (rank 0), then
        #     the batch goes to every rank
        batch, metrics, future = None, {}, None
        if is_main():
            if pending is None:
                trajs, rounds, dispatch_metrics = collect_rollouts(cfg, engine, envs, tokenizer, step)
                version, t_gen = step - 1, time.time() - t0
            else:                                  # async: generated in the background during the last update
                (trajs, rounds, dispatch_metrics, t_gen, version), pending = pending, None
            if pool is not None and step < cfg.steps:   # the next batch, from the current (pre-update) weights
                future = pool.submit(timed, collect_rollouts, cfg, engine, envs, tokenizer, step + 1)
            batch = to_batch(trajs, pad_id)
            # staleness: updates between the weights that sampled the batch and those it trains (0 on-policy;
            # 1 in async mode, where every sample of a batch comes from the same weights)
            metrics = {**rollout_metrics(trajs), "rollout/rounds": rounds, **dispatch_metrics,
                       "rollout/staleness": step - 1 - version}
        batch = broadcast_object(batch)
        t_rollout = time.time() - t0

        # --- rewards -> advantages (algorithm code: see algos.py for the equations)
        t1 = time.time()
        rewards = batch.rewards.clone()                                                # (B,)
        if cfg.algo.overlong_cache:                                                    # DAPO soft overlong punishment
            rewards += algos.overlong_penalty(batch.lengths, agent_cfg.max_total_tokens, cfg.algo.overlong_cache)
        token_kl, old = None, None
        if cfg.algo.kl_in_reward:                                                      # KL as a reward penalty
            lc = cfg.learner
            ref = compute_logprobs(state.ref_model, batch.input_ids, lc.micro_batch_size, lc.temperature,
                                   lc.logprob_chunk_size, batch.loss_mask)             # (B, T)
            old = compute_logprobs(state.model, batch.input_ids, lc.micro_batch_size, lc.temperature,
                                   lc.logprob_chunk_size, batch.loss_mask)             # (B, T) reused by the update
            token_kl = algos.kl_penalty(old, ref, lc.kl_kind) * batch.loss_mask       # (B, T)
            metrics["train/reward_kl"] = float(token_kl.sum(1).mean())
        if cfg.algo.advantage == "gae":
            token_rewards = torch.zeros_like(batch.loss_mask)                          # (B, T)
            last = (batch.loss_mask * torch.arange(batch.loss_mask.shape[1])).argmax(1)  # last generated token
            token_rewards[torch.arange(len(rewards)), last] = rewards                  # reward on the last token
            if token_kl is not None:
                token_rewards -= cfg.learner.kl_coef * token_kl
            old_values = compute_values(critic_state.model, batch.input_ids, cfg.learner.micro_batch_size)
            adv_tok, returns = algos.compute_gae(token_rewards, old_values, batch.loss_mask,
                                                 cfg.algo.gamma, cfg.algo.lam)         # (B, T), (B, T)
            adv_tok = algos.whiten(adv_tok, batch.loss_mask)
            mixed = True
        else:
            if token_kl is not None:
                rewards -= cfg.learner.kl_coef * token_kl.sum(1)
            adv = algos.group_advantages(rewards, G, cfg.algo.advantage)               # (B,)
            adv_tok = adv[:, None] * batch.loss_mask                                   # (B, T)
            mixed = bool(algos.dynamic_sampling_mask(batch.rewards, G).any())

        # --- update (the engine asleep: on a GPU its memory is the learner's meanwhile; in async mode it is
        #     generating the next batch instead)
        if is_main() and pool is None:
            engine.sleep()
        updated = mixed or not cfg.algo.skip_uniform_batches
        if updated:
            state, m = train_step(state, TrainBatch(batch.input_ids, batch.loss_mask, adv_tok, old, batch.logprobs),
                                  learner_cfg)
            metrics.update(m)
            if cfg.algo.advantage == "gae":
                critic_state, m = critic_step(critic_state, ValueBatch(batch.input_ids, batch.loss_mask, old_values,
                                                                       returns), critic_cfg, cfg.algo.value_clip)
                metrics.update(m)
            weights = merged_state_dict(state.model)  # every rank joins the gather onto rank 0 (LoRA merged in)
        metrics["train/skipped_uniform"] = float(not updated)
        t_train = time.time() - t1
        if future is not None:                     # the engine must finish the next batch before the push
            t_wait = time.time()
            pending = (*future.result(), step - 1)   # collect_rollouts' result, its seconds, the weights' version
            metrics["perf/rollout_wait_seconds"] = time.time() - t_wait  # rollout time the update did not hide

        # --- push the new weights to the engine, then the weight-sync gate: the engine continues a few of this
        # step's trajectories with the new weights and the learner scores those tokens; they must agree
        t2 = time.time()
        if is_main():
            engine.wake_up()
            if updated:
                engine.update_weights(weights)
                if isinstance(engine, RayEngine):
                    metrics["dispatch/push_seconds"] = engine.push_seconds
        if cfg.rollout.sync_check_samples:
            probe = None
            if is_main():                              # rank 0 samples with the engine ...
                longest = sorted(trajs[::G], key=lambda t: len(t.token_ids), reverse=True)
                params = SamplingParams(temperature=cfg.rollout.temperature, max_tokens=cfg.rollout.sync_check_tokens,
                                        seed=mix_seed(cfg.seed, step, SEED_SYNC_PROBE))
                probe = sync_probe(engine, [t.token_ids for t in longest[:cfg.rollout.sync_check_samples]], params)
            prompts, gens, temperature = broadcast_object(probe)
            gap = logprob_gap(state.model, prompts, gens, temperature)  # ... every rank scores (a sharded forward)
            metrics["sync/logprob_abs_diff"] = assert_synced(gap, sync_threshold(cfg), len(gens))
        metrics["perf/sync_seconds"] = time.time() - t2
        if is_main():
            t_rollout = t_gen                      # the engine's time for this batch (in the background if async)
        metrics.update({"perf/rollout_seconds": t_rollout, "perf/train_seconds": t_train,
                        "perf/step_seconds": time.time() - t0,
                        "perf/rollout_tokens_per_s": float(batch.loss_mask.sum()) / max(t_rollout, 1e-9),
                        "perf/train_tokens_per_s": int(batch.lengths.sum()) / max(t_train, 1e-9),
                        "perf/elapsed_minutes": (time.time() - t_start) / 60, "perf/world_size": world})

        # --- eval, log, checkpoint
        if is_main():
            if step % cfg.eval_every == 0 or step == cfg.steps:
                metrics.update(run_eval(step))
            logger.log(step, metrics)
            history.append((step, metrics))
            bar.set_postfix(reward=f"{metrics['rollout/reward']:.3f}",
                            acc=f"{metrics.get('eval/accuracy', float('nan')):.3f}")
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            checkpoint(f"checkpoints/step_{step}", pending)

    # -------------------------------------------------------------------------
    # the end: final checkpoint, curves, summary
    checkpoint("final")
    if pool is not None:
        pool.shutdown()
    logger.finish()
    if isinstance(engine, RayEngine):
        engine.shutdown()
    if not is_main():
        cleanup_distributed()
        return {"run_dir": run_dir}
    save_curves(history, os.path.join(run_dir, "curves.png"))
    evals = [(s, m["eval/accuracy"]) for s, m in history if "eval/accuracy" in m]
    summary = {"run_dir": run_dir, "minutes": (time.time() - t_start) / 60, "eval_curve": evals,
               "final_accuracy": evals[-1][1] if evals else None}
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"done in {summary['minutes']:.1f} min; held-out accuracy by step: "
          + ", ".join(f"{s}: {a:.3f}" for s, a in evals))
    cleanup_distributed()
    return summary


def cli(argv=None) -> Config:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="YAML file with what differs from config.py's defaults")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. learner.lr=3e-5")
    args = p.parse_args(argv)
    try:
        return load_config(args.config, args.overrides)
    except (KeyError, TypeError, ValueError) as e:
        sys.exit(f"config error: {e.args[0] if e.args else e}")


# -----------------------------------------------------------------------------
# launching on Ray: the learner's ranks as actors, the same SPMD main() that torchrun starts

PLACEMENT_TIMEOUT_S = 300   # how long to wait for the cluster to free (or an autoscaler to add) the bundles


class LearnerRank:
    """One rank of the learner in a Ray actor (wrapped by ray.remote in launch_on_ray, so that importing
    train.py never imports Ray). It sets torchrun's environment variables, then runs main(cfg)."""

    def address(self) -> tuple[str, int]:
        """This node's IP and a port free on it: rank 0's answer is every rank's MASTER_ADDR and MASTER_PORT."""
        import socket

        import ray
        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def run(self, cfg: Config, env: dict[str, str]) -> dict:
        """main(cfg) as the rank that `env` (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) names."""
        os.environ.update(env)                       # read by init_distributed (torch's env:// rendezvous)
        return main(cfg)


def launch_on_ray(cfg: Config) -> dict:
    """Run main(cfg) as cfg.ray.learner_workers Ray actors, rank i in bundle i of one placement group, and return
    rank 0's summary. So `ray job submit -- python train.py ... ray.learner_workers=2` trains exactly as
    `torchrun --nproc_per_node 2 train.py ...` does. Joins the cluster at ray.address ("" = $RAY_ADDRESS, else a
    local Ray it starts and stops). If an actor fails or dies, the others would wait in a collective forever:
    they are killed, and the error names the rank."""
    rc, n = cfg.ray, cfg.ray.learner_workers
    if "RANK" in os.environ:                         # set by torchrun (and by us, inside an actor)
        raise ValueError(f"ray.learner_workers={n} under torchrun: choose one launcher (torchrun starts the ranks "
                         "itself; ray.learner_workers=N starts them as Ray actors from one `python train.py`)")
    try:
        import ray
    except ImportError as e:
        raise ImportError(f"ray.learner_workers={n} needs Ray: pip install 'ray[default]' (or bash setup.sh)") from e
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    address = rc.address or os.environ.get("RAY_ADDRESS", "")
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if host and port.isdigit():                     # ray.init would retry a dead address for minutes
        import socket
        try:
            socket.create_connection((host, int(port)), timeout=10).close()
        except OSError as e:
            raise ConnectionError(f"no Ray cluster at {address!r} ({e}): start one there with `ray start --head`, "
                                  "or leave ray.address and $RAY_ADDRESS empty to start a local Ray") from None
    started = not ray.is_initialized()             # a connection the caller made is left open at the end
    if started:
        ray.init(address=rc.address or None)
    bundle = {"CPU": rc.cpus_per_learner, **({"GPU": rc.gpus_per_learner} if rc.gpus_per_learner else {})}
    pg = placement_group([bundle] * n, strategy=rc.placement_strategy)
    ranks = []
    try:
        if not ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)[0]:
            raise RuntimeError(f"Ray could not place {n} learner bundles of {bundle} ({rc.placement_strategy}) in "
                               f"{PLACEMENT_TIMEOUT_S} s; the cluster has {ray.cluster_resources()}")
        actor = ray.remote(LearnerRank)
        ranks = [actor.options(num_cpus=rc.cpus_per_learner, num_gpus=rc.gpus_per_learner,
                               scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i))
                 .remote() for i in range(n)]
        master_addr, master_port = ray.get(ranks[0].address.remote())
        # LOCAL_RANK 0: Ray gives each actor its own GPU(s) through CUDA_VISIBLE_DEVICES, so its GPU is device 0
        runs = {r.run.remote(cfg, {"RANK": str(i), "WORLD_SIZE": str(n), "LOCAL_RANK": "0",
                                   "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}): i
                for i, r in enumerate(ranks)}
        results, pending = {}, list(runs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                results[runs[done[0]]] = ray.get(done[0])
            except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as e:  # raised, or the process died
                raise RuntimeError(f"learner rank {runs[done[0]]} of {n} failed: {e}") from e
        return results[0]
    finally:
        for r in ranks:
            ray.kill(r)
        remove_placement_group(pg)
        if started:
            ray.shutdown()


if __name__ == "__main__":
    cfg = cli()
    if cfg.ray.learner_workers:
        launch_on_ray(cfg)
    else:
        main(cfg)
