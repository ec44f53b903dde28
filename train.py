"""train.py: RL training of a tool-using LLM agent, the loop top to bottom.

    python train.py --config configs/toy_math.yaml [key.sub=value ...]

The algorithm (GRPO by default; algo.name picks the others, config.ALGO_PRESETS), each step:
  1. rollouts: prompts_per_step tasks, n_samples episodes each (a group), multi-turn with tools,
     token-exact (collect_rollouts, agent.py). DAPO's dynamic sampling drops groups whose rewards
     are all equal and samples more.
  2. advantages: compute_advantages runs every forward pass it needs (the reference's log-probs for
     a KL, the learner's pi_old, a teacher's, a critic's values), then the math in algos.py: the
     episode reward (+ DAPO's overlong penalty, - a KL when algo.kl_in_reward) less a group
     baseline, broadcast to the episode's sampled tokens (GRPO, Dr.GRPO, RLOO; per turn with
     algo.credit=turn), or returns whitened over the batch (REINFORCE++), or GAE (PPO); plus a
     teacher's per-token term (algo.teacher_path).
  3. update: learner.train_step, the clipped policy loss over epochs, mini-batches and
     micro-batches (and PPO's critic on the same schedule). A batch whose advantages are all 0 has
     nothing to teach: it is skipped.
  4. push + gate: the new weights go to the engine (or it reads the learner's own parameters), then
     the weight-sync gate (rollout.py): engine and learner must agree on a few continuations.
  5. eval, log, checkpoint: held-out evaluation every eval_every steps, metrics.jsonl (+ wandb),
     checkpoints.

Departures from the papers: an episode's reward (the sum of its step rewards) goes to every token it
sampled, in every row it trains as (batch.RolloutBatch.episode_rows); batches without signal are
skipped.

A rollout source plays the episodes (agent.LocalRollouts), a schedule says when weights are pushed
(SyncSchedule); wings answer the same calls, reached by name (rollout.wing), and the async wing's
schedule also samples ahead. Under torchrun every rank runs main(): rank 0 alone plays, evaluates
and writes; every rank takes its share of the update. Every random draw is mix_seed(seed, step,
purpose): a resumed run repeats an uninterrupted one exactly. Outputs: runs/<run_name>/ (runs.py).
Shapes: B rows (episodes), T tokens, G group size, E episodes, K turns.

Imports: model.py, algos.py, distributed.py, env.py, chat.py, agent.py, batch.py, rollout.py,
learner.py, config.py, runs.py, eval.py, sft.py (and torch, tokenizers, tqdm, the standard library).
"""

import argparse
import copy
import os
import time

import torch
from tokenizers import Tokenizer
from tqdm import tqdm

import algos
from agent import LocalRollouts, mixed_groups, rollout_metrics
from batch import RolloutBatch, to_batch
from chat import pad_token_id
from config import Config, config_exit, learner_configs, load_config
from distributed import (
    broadcast_object,
    cleanup_distributed,
    get_world_size,
    init_distributed,
    is_main,
    shard_model,
)
from env import make_env, mix_seed, sample_mixture
from eval import heldout_tasks, run_eval
from learner import (
    Critic,
    LearnerState,
    TrainBatch,
    ValueBatch,
    compute_logprobs,
    compute_values,
    critic_step,
    infer_kept_sizes,
    make_learner,
    merged_state_dict,
    old_logprobs_needed,
    set_precision,
    train_step,
    truncated_score,
)
from model import load_model
from rollout import SamplingParams, engine_options, make_engine, weight_sync_gate, wing
from runs import (
    Logger,
    PerfMeter,
    check_file,
    check_paths,
    checkpoint_step,
    finish_run,
    load_checkpoint,
    resolve_resume,
    save_run_checkpoint,
    write_config,
)
from sft import model_folder

# the purposes of a step's random draws: mix_seed(seed, step, purpose[, round])
SEED_TASKS = 1
SEED_EPISODES = 2
SEED_SYNC_PROBE = 3


# -----------------------------------------------------------------------------
# 1. rollouts


def collect_rollouts(cfg: Config, rollouts, envs: dict, step: int) -> tuple[list, dict]:
    """prompts_per_step groups of n_samples episodes -> (trajectories group-major, rollout/* and
    dispatch/* metrics). A group with a failed episode (its env raised) is dropped whole, never
    half-trained, and more prompts are sampled in its place, up to algo.max_refill_rounds extra
    rounds; so are groups whose rewards are all equal with DAPO's algo.dynamic_sampling. The batch
    may end smaller; with no group left it is an error, naming the failures."""
    want = cfg.rollout.prompts_per_step
    G = cfg.rollout.agent.n_samples
    # no params.seed: the agent loop seeds every turn's call from the episodes' seed
    params = SamplingParams.of(cfg.rollout)
    kept = []  # groups with a signal (all whole groups, without dynamic sampling)
    uniform = []  # whole groups whose rewards are all equal (dynamic sampling)
    failed = 0  # episodes whose env raised
    dropped = 0  # groups dropped for them
    errors = []  # the first error of each round that had one
    for r in range(1 + cfg.algo.max_refill_rounds):
        weights = [(e.name, e.weight) for e in cfg.envs]
        task_seed = mix_seed(cfg.seed, step, SEED_TASKS, r)
        tasks = sample_mixture(envs, weights, "train", want, task_seed)
        episode_seed = mix_seed(cfg.seed, step, SEED_EPISODES, r)
        trajs, dispatch_metrics = rollouts.play(
            tasks, params, episode_seed, judge_weight=cfg.rollout.judge_weight
        )
        groups = [trajs[i : i + G] for i in range(0, len(trajs), G)]  # group-major
        broken = [any(t.finish_reason == "env_error" for t in g) for g in groups]
        failed += sum(t.finish_reason == "env_error" for t in trajs)
        dropped += sum(broken)
        errors += [t.info.get("error", "") for t in trajs if t.finish_reason == "env_error"][:1]
        whole = [g for g, b in zip(groups, broken) if not b]
        if cfg.algo.dynamic_sampling:
            mixed = mixed_groups([t for g in whole for t in g], G)
        else:
            mixed = [True] * len(whole)
        kept += [g for g, is_mixed in zip(whole, mixed) if is_mixed]
        uniform += [g for g, is_mixed in zip(whole, mixed) if not is_mixed]
        if len(kept) >= want:
            break
        if not any(broken) and not cfg.algo.dynamic_sampling:
            break
    if not kept:
        # nothing informative: the uniform groups, and skip_uniform_batches decides
        kept = uniform[-want:]
    if not kept:
        raise RuntimeError(
            f"step {step}: every episode group of {r + 1} rollout rounds had a failed episode "
            f"({failed} failed), e.g. {errors[0] if errors else '?'}"
        )
    trajs = [t for g in kept[:want] for t in g]
    return trajs, {
        **rollout_metrics(trajs, G),
        "rollout/rounds": r + 1,
        "rollout/failed_episodes": failed,
        "rollout/dropped_groups": dropped,
        **dispatch_metrics,
    }


class SyncSchedule:
    """When weights are pushed, the reference way: batch s is sampled when step s begins (main calls
    collect_rollouts), from the weights after update s-1. The async wing's schedule
    (wings/async_rollouts.AsyncSchedule) answers the same calls and samples ahead instead."""

    # the engine idles during the update: it may sleep (on a GPU the learner gets its memory),
    # and no batch was sampled ahead of its step
    overlaps = False

    def before_push(self, step: int) -> dict:
        # nothing is sampling: nothing to wait for
        return {}

    def pushes(self, updated: bool) -> bool:
        # after an update
        return updated

    def push(self, rollouts, weights: dict, step: int) -> dict:
        return rollouts.update_weights(weights)

    def pending(self) -> None:
        # batches sampled ahead, which a checkpoint saves: none
        return None

    def shutdown(self):
        # no thread to stop
        pass


# -----------------------------------------------------------------------------
# 2. advantages (algorithm code: algos.py has the equations and the papers)


def compute_advantages(
    cfg: Config,
    batch: RolloutBatch,
    policy: LearnerState,
    critic: LearnerState | None,
    teacher: torch.nn.Module | None = None,
) -> tuple[TrainBatch, ValueBatch | None, dict, bool]:
    """Rewards -> per-token advantages, and what the update scores against -> (TrainBatch,
    ValueBatch or None, metrics, whether any advantage is non-zero: a batch whose advantages are all
    0 carries no signal, and algo.skip_uniform_batches skips its update). First every forward pass
    the math needs, each once (the one owner of the log-probs before the update): the reference
    policy's (the KL), the learner's (pi_old), the teacher's (distillation), the critic's values
    (PPO); then the reward shaping and the advantages, in algos.py."""
    lc = cfg.learner
    G = cfg.rollout.agent.n_samples
    metrics = {}
    rewards = batch.rewards.clone()  # (B,)
    mask = batch.loss_mask  # (B, T)
    episode, last_row = (
        batch.episode_rows()
    )  # (B,) each row's episode, (E,) each episode's last row
    if batch.length_cut is not None:
        # the episodes a length limit cut: kept, masked or penalized
        rewards, mask = algos.truncation_treatment(
            rewards, mask, batch.length_cut, cfg.algo.truncation, cfg.algo.truncation_penalty
        )

    # --- the forward passes. A top-k / top-p sample is scored on the set it was sampled from
    # (learner.py, "scoring"); the reference and the teacher on the whole vocabulary.
    set_sizes = None  # (B, T)
    if batch.kept_sizes is not None and bool(batch.kept_sizes.any()):
        set_sizes = infer_kept_sizes(
            policy.model,
            batch.input_ids,
            batch.kept_sizes,
            batch.logprobs,
            lc.micro_batch_size,
            lc.temperature,
            lc.logprob_chunk_size,
            lc.max_tokens_per_micro_batch,
            lc.shared_prefix,
        )
    trunc = {} if set_sizes is None else dict(score=truncated_score, score_args=set_sizes)

    def score(model, **kw) -> torch.Tensor:
        """(B, T) a model's log-probs of the trained tokens, micro-batched."""
        return compute_logprobs(
            model,
            batch.input_ids,
            lc.micro_batch_size,
            lc.temperature,
            lc.logprob_chunk_size,
            mask,
            lc.max_tokens_per_micro_batch,
            shared_prefix=lc.shared_prefix,
            **kw,
        )

    ref = score(policy.ref_model) if lc.kl_coef > 0 else None  # (B, T)
    # pi_old; None when the update is exactly on-policy and takes pi_old = pi, detached
    old = None
    if old_logprobs_needed(lc) or cfg.algo.kl_in_reward or teacher is not None:
        old = score(policy.model, **trunc)  # (B, T)
    teacher_logprobs = score(teacher) if teacher is not None else None  # (B, T)
    old_values = None
    if cfg.algo.advantage == "gae":
        old_values = compute_values(critic.model, batch.input_ids, lc.micro_batch_size)  # (B, T)
    metrics["perf/old_logprob_pass"] = float(old is not None)

    # --- the reward shaping and the advantages (algorithm code: algos.py)
    if cfg.algo.overlong_cache:
        # DAPO's soft overlong punishment
        max_len = cfg.rollout.agent.max_total_tokens
        rewards += algos.overlong_penalty(batch.lengths, max_len, cfg.algo.overlong_cache)
    token_kl = None
    if cfg.algo.kl_in_reward:
        # the KL as a reward penalty, per token
        token_kl = algos.kl_penalty(old, ref, lc.kl_kind) * mask  # (B, T)
        metrics["train/reward_kl"] = float(token_kl.sum(1).mean())
    values = None
    if cfg.algo.advantage == "gae":
        # PPO: the reward on the episode's last sampled token, a critic's baseline
        token_rewards = algos.at_last(rewards, mask)  # (B, T)
        if token_kl is not None:
            token_rewards -= lc.kl_coef * token_kl
        adv, returns = algos.compute_gae(
            token_rewards, old_values, mask, cfg.algo.gamma, cfg.algo.lam
        )  # (B, T) x2
        adv = algos.whiten(adv, mask)
        values = ValueBatch(batch.input_ids, mask, old_values, returns)
    elif cfg.algo.advantage.startswith("reinforce_pp"):
        # REINFORCE++: the KL per token, returns whitened over the batch
        if cfg.algo.advantage == "reinforce_pp_baseline":
            # the group mean as a baseline: R - group mean
            rewards = algos.group_advantages(rewards[last_row], G, "drgrpo")[episode]  # (B,)
        adv = algos.reinforce_pp_advantages(rewards, token_kl, mask, lc.kl_coef, cfg.algo.gamma)
    elif cfg.algo.advantage == "none":
        # the teacher's term alone
        adv = torch.zeros_like(mask)  # (B, T)
    else:
        # a group baseline: GRPO, Dr. GRPO, RLOO
        if token_kl is not None:
            rewards -= lc.kl_coef * token_kl.sum(1)
        if cfg.algo.credit == "turn":
            adv = turn_credit(batch, rewards, G, cfg.algo.turn_gamma, cfg.algo.turn_baseline)
        else:
            episode_adv = algos.group_advantages(rewards[last_row], G, cfg.algo.advantage)  # (E,)
            adv = algos.segment_advantages(episode_adv, episode, mask)  # (B, T)
    if teacher is not None:
        # on-policy distillation
        adv, m = algos.distillation_advantages(
            old, teacher_logprobs, mask, adv, cfg.algo.distill_coef
        )  # (B, T)
        metrics["train/distill_reverse_kl"] = float(m["distill_reverse_kl"])
    # all 0: no group with mixed (shaped) rewards, nothing for the update to learn from
    informative = bool((adv != 0).any())
    loss_ref = None if cfg.algo.kl_in_reward else ref  # the KL is counted once
    train_batch = TrainBatch(
        batch.input_ids,
        mask,
        adv,
        old,
        batch.logprobs,
        loss_ref,
        old_from_update=old is None,
        kept_sizes=set_sizes,
    )
    return train_batch, values, metrics, informative


def turn_credit(
    batch: RolloutBatch, rewards: torch.Tensor, G: int, gamma: float, baseline: str
) -> torch.Tensor:
    """algo.credit=turn: each assistant turn's advantage (algos.turn_advantages, its baseline per
    turn position or per state as algo.turn_baseline says), given to that turn's sampled tokens ->
    (B, T). What `rewards` (B,) adds to the env's (the overlong penalty, a KL in the reward) is
    counted on the episode's last turn, where it was earned. Episodes are read from their last rows,
    turns numbered within the episode (RolloutBatch.episode_rows)."""
    episode, last_row = batch.episode_rows()  # (B,), (E,)
    turn_mask = batch.turn_mask[last_row]  # (E, K)
    added = (rewards - batch.rewards)[last_row]  # (E,)
    turn_rewards = batch.turn_rewards[last_row] + algos.at_last(added, turn_mask)  # (E, K)
    states = batch.turn_states[last_row]
    adv = algos.turn_advantages(turn_rewards, turn_mask, G, gamma, baseline, states)  # (E, K)
    return algos.broadcast_turns(adv[episode], batch.turn_index)  # (B, T)


# -----------------------------------------------------------------------------
# building the learner, the rollout source and the schedule


def build_learner(
    cfg: Config, model_dir: str, resume: str, policy_cfg, critic_cfg, engine_reads_learner: bool
) -> tuple[LearnerState, LearnerState | None, torch.nn.Module | None]:
    """-> (the policy's learner state, PPO's critic or None, the model of an in-process torch engine
    or None). All start from the base model; LoRA wraps only the policy, then sharding (torchrun),
    then `resume`'s states. The engine's model is the policy's own module when
    `engine_reads_learner` (shares_engine_model), else a copy."""
    model = load_model(model_dir, dtype=getattr(torch, cfg.model.dtype))
    ref_model = copy.deepcopy(model) if cfg.learner.kl_coef > 0 else None
    critic = None
    if cfg.algo.advantage == "gae":
        # PPO: a critic initialised from the policy's backbone
        critic = make_learner(shard_model(Critic(model), critic_cfg), critic_cfg, seed=cfg.seed + 1)
    engine_model = None
    if is_main() and cfg.rollout.engine == "torch" and not cfg.ray.rollout_workers:
        # rank 0's own engine, in this process
        engine_model = model if engine_reads_learner else copy.deepcopy(model).eval()
    if cfg.learner.lora_rank:
        # Only the adapters train, and the engine gets merged weights. QLoRA: the same adapters
        # on a base stored in 4 bits (model.quantize).
        lc = cfg.learner
        if cfg.model.quantize == "nf4":
            wrap = wing("wings.qlora.apply_qlora")
        else:
            wrap = wing("wings.lora.apply_lora")
        targets = tuple(lc.lora_targets)
        wrap(model, lc.lora_rank, lc.lora_alpha, lc.lora_dropout, targets, seed=cfg.seed)
    # one process: unsharded, on the GPU if there is one
    model = shard_model(model, policy_cfg)
    if ref_model is not None:
        ref_model = shard_model(ref_model, policy_cfg)
    policy = make_learner(model, policy_cfg, seed=cfg.seed, ref_model=ref_model)
    if engine_model is not None:
        # the engine computes where the learner does (rank 0's GPU, or the CPU), in its precision
        engine_model.to(next(model.parameters()).device)
        set_precision(engine_model, policy_cfg.precision)
    if resume:
        policy = load_checkpoint(policy, resume)
        if critic is not None:
            critic = load_checkpoint(critic, os.path.join(resume, "critic"))
    return policy, critic, engine_model


def shares_engine_model(cfg: Config) -> bool:
    """Whether the in-process torch engine can read the learner's parameters instead of a copy that
    every update is pushed into: one process (not shards), no LoRA (the engine needs the adapters
    merged in) and no async rollouts (the engine would sample while the update writes). The
    weight-sync gate still checks it after every update."""
    return (
        cfg.rollout.engine == "torch"
        and not cfg.ray.rollout_workers
        and get_world_size() == 1
        and not cfg.learner.lora_rank
        and not cfg.rollout.async_rollouts
    )


def build_teacher(cfg: Config, tokenizer) -> torch.nn.Module | None:
    """algo.teacher_path's model, frozen and sharded like the policy, or None; its tokenizer must be
    the policy's."""
    if not cfg.algo.teacher_path:
        return None
    vocab = Tokenizer.from_file(os.path.join(cfg.algo.teacher_path, "tokenizer.json")).get_vocab()
    if vocab != tokenizer.get_vocab():
        raise ValueError(
            f"algo.teacher_path={cfg.algo.teacher_path!r} has another tokenizer than the policy: "
            "it must score the very token ids the policy sampled"
        )
    teacher = load_model(cfg.algo.teacher_path, dtype=getattr(torch, cfg.model.dtype))
    teacher.requires_grad_(False).eval()
    return shard_model(teacher, cfg.learner)


def build_rollouts(
    cfg: Config, model_dir: str, envs: dict, tokenizer, engine_model, weights: dict | None
):
    """Rank 0's rollout source: Ray workers (wings/cluster.py), the user's agent
    (wings/external_agent.py) or the agent loop, around an engine built here; `weights` pushed first
    when the learner is not the base model (a resumed run; LoRA's merged weights). An LLM judge
    (wings/judge.py) when rollout.judge.model_path is set."""
    if cfg.ray.rollout_workers:
        return wing("wings.cluster.start_ray_rollouts")(
            cfg, model_dir, envs, engine_options(cfg), weights
        )
    engine = make_engine(
        cfg.rollout.engine,
        model_dir,
        pad_id=pad_token_id(tokenizer),
        model=engine_model,
        **engine_options(cfg),
    )
    if weights is not None:
        engine.update_weights(weights)
    judge = None  # the envs' own rewards
    if cfg.rollout.judge.model_path:
        judge = wing("wings.judge.LLMJudge").from_config(cfg)
    if cfg.rollout.external_agent:
        # the user's own agent plays, through a server over the engine
        return wing("wings.external_agent.ExternalRollouts")(
            cfg, engine, envs, tokenizer, judge=judge
        )
    return LocalRollouts(engine, envs, tokenizer, cfg.rollout.agent, judge=judge)


def build_schedule(cfg: Config, rollouts, envs: dict, start: int, resume: str):
    """SyncSchedule, or with rollout.async_rollouts the async wing's schedule, which samples ahead
    in a thread of its own, calling collect_rollouts (every rank builds it; rank 0 samples)."""
    if not cfg.rollout.async_rollouts:
        return SyncSchedule()
    AsyncSchedule = wing("wings.async_rollouts.AsyncSchedule")

    def collect(step: int) -> tuple[list, dict]:
        return collect_rollouts(cfg, rollouts, envs, step)

    return AsyncSchedule.from_config(cfg, collect, rollouts, start, resume, is_main())


# -----------------------------------------------------------------------------
# the loop


def main(cfg: Config) -> dict:
    # --- setup
    t_start = time.time()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    # rank 0 of 1 for `python train.py`; torchrun sets both
    _, world = init_distributed()
    torch.manual_seed(cfg.seed)
    # "" for a fresh start; with resume=auto, the run's latest complete checkpoint
    resume = resolve_resume(cfg)
    start = checkpoint_step(resume) if resume else 0  # the RL steps already taken
    run_dir = write_config(cfg) if is_main() else os.path.join(cfg.out_dir, cfg.run_name)

    # --- build: the model, tokenizer and learner; on rank 0 the envs, the rollout source and the
    # held-out tasks
    model_dir = model_folder(cfg)  # model.path, or the embedded default (sft.py builds it)
    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    policy_cfg, critic_cfg = learner_configs(cfg)
    # an engine that reads the policy's own parameters needs no pushes
    engine_reads_learner = shares_engine_model(cfg)
    policy, critic, engine_model = build_learner(
        cfg, model_dir, resume, policy_cfg, critic_cfg, engine_reads_learner
    )
    teacher = build_teacher(cfg, tokenizer)  # None unless on-policy distillation
    # what the engine loads first when the learner is not the base model: a resumed run's
    # weights, or LoRA's merged in (every rank joins the gather)
    weights = None
    if (resume or cfg.learner.lora_rank) and not engine_reads_learner:
        weights = merged_state_dict(policy.model)
    rollouts = envs = eval_tasks = None
    if is_main():
        envs = {e.name: make_env(e.name, **e.kwargs) for e in cfg.envs}
        rollouts = build_rollouts(cfg, model_dir, envs, tokenizer, engine_model, weights)
        eval_tasks = heldout_tasks(envs, {e.name: e.eval_size for e in cfg.envs}, cfg.eval_seed)
    perf = PerfMeter(next(policy.model.parameters()).device, cfg.peak_flops, world)
    # on a resume the logs are cut back to its step
    logger = Logger(run_dir, cfg, resume_step=start if resume else None, enabled=is_main())
    schedule = build_schedule(cfg, rollouts, envs, start, resume)
    shown = {}  # the progress bar's: the last held-out accuracy
    if start == 0 and is_main():
        path = os.path.join(run_dir, "episodes_step0.jsonl")
        m = logger.log(0, run_eval(cfg, rollouts, eval_tasks, path))
        print(f"step 0: held-out accuracy {m['eval/accuracy']:.3f}", flush=True)
        shown["heldout"] = f"{m['eval/accuracy']:.3f}"

    # --- the RL loop
    bar = tqdm(
        range(start + 1, cfg.steps + 1),
        desc="rl",
        initial=start,
        total=cfg.steps,
        dynamic_ncols=True,
        disable=not is_main(),
    )
    for step in bar:
        t0 = time.time()
        # 1. rollouts: rank 0 plays this step's groups, or takes the batch that the async
        # schedule sampled ahead; every rank gets the batch
        trajs = []
        metrics = {}
        batch = None
        if is_main():
            if schedule.overlaps:
                trajs, metrics, t_rollout = schedule.take(step)
            else:
                trajs, metrics = collect_rollouts(cfg, rollouts, envs, step)
                t_rollout = time.time() - t0
            batch = to_batch(trajs, pad_token_id(tokenizer))
        batch = broadcast_object(batch)
        if not is_main():
            t_rollout = time.time() - t0  # the wait for rank 0's batch

        # 2. advantages, 3. update (the engine asleep: on a GPU the learner has its memory)
        t1 = time.time()
        train_batch, value_batch, adv_metrics, informative = compute_advantages(
            cfg, batch, policy, critic, teacher
        )
        metrics.update(adv_metrics)
        if is_main() and not schedule.overlaps:
            rollouts.sleep()
        updated = informative or not cfg.algo.skip_uniform_batches
        if updated:
            policy, update_metrics = train_step(policy, train_batch, policy_cfg)
            metrics.update(update_metrics)
            if critic is not None:
                critic, m = critic_step(critic, value_batch, critic_cfg, cfg.algo.value_clip)
                metrics.update(m)
        metrics["train/skipped_uniform"] = float(not updated)
        t_train = time.time() - t1
        epochs = policy_cfg.ppo_epochs
        metrics.update(perf.measure(policy.model, batch.lengths, epochs, t_train, updated))

        # 4. push the new weights to the engine (the schedule says when), then the weight-sync
        # gate (rollout.py explains it)
        t2 = time.time()
        if is_main():
            metrics.update(schedule.before_push(step))
            rollouts.wake_up()
        if not engine_reads_learner and schedule.pushes(updated):
            # every rank joins the gather onto rank 0 (LoRA merged in)
            weights = merged_state_dict(policy.model)
            if is_main():
                metrics.update(schedule.push(rollouts, weights, step))
        if cfg.rollout.sync_check_samples:
            seed = mix_seed(cfg.seed, step, SEED_SYNC_PROBE)
            metrics.update(weight_sync_gate(cfg, rollouts, policy.model, trajs, seed))
        t_all = time.time() - t_start
        metrics.update(
            perf.times(batch, t_rollout, t_train, time.time() - t2, time.time() - t0, t_all)
        )

        # 5. eval (eval.py), log and checkpoint (runs.py)
        if is_main():
            if step % cfg.eval_every == 0 or step == cfg.steps:
                path = os.path.join(run_dir, f"episodes_step{step}.jsonl")
                metrics.update(run_eval(cfg, rollouts, eval_tasks, path))
                shown["heldout"] = f"{metrics['eval/accuracy']:.3f}"
            logger.log(step, metrics)
            bar.set_postfix(reward=f"{metrics['rollout/reward']:.3f}", **shown)
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            path = os.path.join(run_dir, "checkpoints", f"step_{step}")
            save_run_checkpoint(path, cfg, model_dir, policy, critic, step, schedule.pending())

    # --- the end: the final checkpoint (with the schedule's queue: a run resumed from it keeps
    # the swap record), curves, summary
    path = os.path.join(run_dir, "final")
    end = max(start, cfg.steps)
    save_run_checkpoint(path, cfg, model_dir, policy, critic, end, schedule.pending())
    schedule.shutdown()
    logger.finish()
    summary = {"run_dir": run_dir}
    if is_main():
        rollouts.shutdown()
        summary = finish_run(run_dir, logger.history, (time.time() - t_start) / 60)
    cleanup_distributed()
    return summary


def cli(argv=None) -> Config:
    """The command line -> the run's config, its paths checked; bad input ends here: one line, exit
    status 2."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--config", default=None, help="YAML file with what differs from config.py's defaults"
    )
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. learner.lr=3e-5")
    args = p.parse_args(argv)
    try:
        if args.config is not None:
            check_file(args.config, "--config")
        return check_paths(load_config(args.config, args.overrides))
    except (KeyError, TypeError, ValueError) as e:
        config_exit(e)


if __name__ == "__main__":
    cfg = cli()
    if cfg.ray.learner_workers:
        wing("wings.cluster.launch_on_ray")(cfg, main)
    else:
        main(cfg)
