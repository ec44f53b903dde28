"""End to end on a tiny config: the embedded default model builds and loads in transformers, main()
runs and writes what it promises, and a resumed run ends bit-identical to an uninterrupted one."""

import copy
import json
import os
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from conftest import need

import algos
from config import load_config
from train import main

TINY = [
    "sft.num_demos=400",
    "sft.max_steps=40",
    "sft.eval_every=20",
    "sft.eval_size=8",
    "sft.batch_size=16",
    "sft.hidden_size=32",
    "sft.num_layers=2",
    "sft.num_heads=2",
    "sft.num_kv_heads=1",
    "sft.intermediate_size=64",
    "sft.vocab_size=600",
    "sft.target_accuracy=1.1",
    "envs.0.eval_size=8",
    "rollout.prompts_per_step=4",
    "rollout.agent.n_samples=4",
    "rollout.max_tokens=40",
    "rollout.agent.max_total_tokens=768",
    "learner.micro_batch_size=8",
    "learner.lr=1e-3",
    "wandb=false",
    "algo.skip_uniform_batches=false",
]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("nano")
    return lambda *extra: load_config(
        "configs/toy_math.yaml",
        TINY + [f"model.cache_dir={root}/cache", f"out_dir={root}/runs", *extra],
    )


@pytest.mark.slow
def test_main_smoke(tiny):
    cfg = tiny("steps=3", "eval_every=2", "run_name=smoke", "wandb=true")
    summary = main(cfg)
    run = summary["run_dir"]
    lines = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]
    assert [l["step"] for l in lines] == [0, 1, 2, 3]
    assert (
        "eval/accuracy" in lines[0] and "eval/accuracy" in lines[2] and "eval/accuracy" in lines[3]
    )
    for l in lines[1:]:
        assert {"rollout/reward", "train/pg_loss", "train/grad_norm", "perf/step_seconds"} <= set(l)
        assert l["rollout/response_tokens"] > 0  # the policy did get to speak
        assert all(
            k == "step" or k.split("/")[0] in {"train", "rollout", "eval", "perf", "sync"}
            for k in l
        )
        # the weight-sync gate ran
        assert l["sync/logprob_abs_diff"] < 1e-3 and l["perf/sync_seconds"] > 0
        assert l["perf/old_logprob_pass"] == 0.0  # one update per batch: pi_old = pi, detached
        assert (
            l["perf/mfu"] > 0
            and l["perf/peak_memory_gib"] > 0.05
            and 0 <= l["perf/pad_fraction"] < 1
        )
    png = open(os.path.join(run, "curves.png"), "rb").read()
    assert png.startswith(b"\x89PNG") and len(png) > 1000
    for f in ("config.json", "model.safetensors", "tokenizer.json", "trainer_state.pt"):
        assert os.path.exists(os.path.join(run, "final", f)), f
    episodes = [json.loads(l) for l in open(os.path.join(run, "episodes_step3.jsonl"))]
    assert len(episodes) == 8 and {"messages", "reward"} <= set(episodes[0])
    assert os.path.isdir(os.path.join(run, "wandb"))


@pytest.mark.slow
def test_top_k_top_p_run_trains_what_it_samples(tiny):
    """rollout.top_p / top_k end to end: the engine records each token's kept set, the learner
    scores the same truncated distribution, so pi_old agrees with the engine's log-probs (mismatch
    KL < 1e-8, as on-policy runs without truncation: only float rounding) although top-p drops mass
    on every step. Two mini-batches make the pi_old pass run, which logs the mismatch."""
    cfg = tiny(
        "steps=2",
        "eval_every=100",
        "run_name=topp",
        "rollout.top_p=0.8",
        "rollout.top_k=12",
        "learner.mini_batches=2",
    )
    lines = [json.loads(l) for l in open(os.path.join(main(cfg)["run_dir"], "metrics.jsonl"))][1:]
    for l in lines:
        assert l["perf/old_logprob_pass"] == 1.0 and l["train/mismatch_kl_k3"] < 1e-8
        assert abs(l["train/mismatch_kl_k1"]) < 1e-5 and l["sync/logprob_abs_diff"] < 1e-3


def same_file(a: str, b: str) -> bool:
    with open(a, "rb") as f, open(b, "rb") as g:
        return f.read() == g.read()


# every batch shape whose RL step takes several optimizer steps, and the states a checkpoint must
# hold beside the
# policy: PPO's critic, LoRA's adapters
RESUME_CASES = {
    "one_update": [],
    "mini_batches": ["learner.mini_batches=2", "learner.ppo_epochs=2"],
    "ppo": ["algo.name=ppo", "learner.mini_batches=2"],
    "lora": [
        "learner.lora_rank=4",
        "learner.lora_alpha=8",
        "learner.lr=3e-3",
        "learner.mini_batches=2",
    ],
}


@pytest.mark.parametrize("case", list(RESUME_CASES))
@pytest.mark.slow
def test_resume_is_exact(tiny, case):
    """Resumed from checkpoints/step_2 into the same run folder, the run continues at RL step 3 (not
    at the optimizer step, which runs ahead with mini-batches and epochs), logs steps 3-4 exactly as
    the uninterrupted run, and ends with its bytes: weights (or adapters), optimizer state,
    metrics.jsonl."""
    extra = [
        "steps=4",
        "eval_every=2",
        "learner.entropy_coef=0.01",
        "log_timings=false",
        *RESUME_CASES[case],
    ]
    full = main(tiny(*extra, "checkpoint_every=2", f"run_name=full_{case}"))["run_dir"]
    half = main(tiny(*extra, "steps=2", "checkpoint_every=2", f"run_name=half_{case}"))["run_dir"]
    assert (
        json.load(open(os.path.join(half, "checkpoints", "step_2", "checkpoint.json")))["rl_step"]
        == 2
    )
    resumed = main(tiny(*extra, f"run_name=half_{case}", f"resume={half}/checkpoints/step_2"))[
        "run_dir"
    ]
    lines = [json.loads(l) for l in open(os.path.join(resumed, "metrics.jsonl"))]
    assert [l["step"] for l in lines] == [0, 1, 2, 3, 4]  # nothing twice, nothing lost
    weights = "adapter_model.safetensors" if case == "lora" else "model.safetensors"
    for f in (
        weights,
        "trainer_state.pt",
        "critic/model.safetensors" if case == "ppo" else weights,
    ):
        assert same_file(os.path.join(full, "final", f), os.path.join(resumed, "final", f)), f
    assert same_file(os.path.join(full, "metrics.jsonl"), os.path.join(resumed, "metrics.jsonl"))
    a, start = (
        load_file(os.path.join(full, "final", weights)),
        load_file(os.path.join(half, "checkpoints", "step_2", weights)),
    )
    assert any(not torch.equal(a[k], start[k]) for k in a)  # steps 3-4 did train


@pytest.mark.slow
def test_resume_auto_continues_the_latest_complete_checkpoint(tiny):
    """resume=auto with nothing to resume starts fresh; after a kill it continues from the newest
    complete checkpoint (a half-written folder, or one without its marker, is passed over), cuts
    metrics.jsonl back to that step and removes later episode dumps; a changed config is refused,
    naming the keys."""
    extra = [
        "eval_every=1",
        "checkpoint_every=1",
        "learner.entropy_coef=0.01",
        "log_timings=false",
        "run_name=auto",
        "resume=auto",
    ]
    run = main(tiny(*extra, "steps=3"))["run_dir"]  # nothing to resume: fresh
    assert [json.loads(l)["step"] for l in open(os.path.join(run, "metrics.jsonl"))] == [0, 1, 2, 3]
    # what a kill at step 3 leaves: step_3 renamed back into an unfinished write, final/ gone, a
    # torn last line
    shutil.rmtree(os.path.join(run, "final"))
    os.rename(
        os.path.join(run, "checkpoints", "step_3"),
        os.path.join(run, "checkpoints", "step_3.partial"),
    )
    # and step_2 never finished
    os.remove(os.path.join(run, "checkpoints", "step_2", "checkpoint.json"))
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:
        f.write('{"step": 4, "rollout/rew')
    with pytest.raises(ValueError, match=r"differs from this config in \['learner.lr'\]"):
        main(tiny(*extra, "steps=3", "learner.lr=5e-4"))
    summary = main(tiny(*extra, "steps=3"))  # from step_1
    assert [json.loads(l)["step"] for l in open(os.path.join(run, "metrics.jsonl"))] == [0, 1, 2, 3]
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["step_1", "step_2", "step_3"]
    assert summary["eval_curve"][0][0] == 0  # the curves keep the old steps
    os.makedirs(os.path.join(run, "checkpoints", "step_4.partial"))  # a write a kill interrupted
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        main(tiny(*extra[:-1], "steps=4", f"resume={run}/checkpoints/step_4.partial"))


@pytest.mark.slow
def test_keep_checkpoints_removes_old_ones_after_the_new_one(tiny):
    run = main(
        tiny(
            "steps=3", "eval_every=100", "checkpoint_every=1", "keep_checkpoints=2", "run_name=keep"
        )
    )
    assert sorted(os.listdir(os.path.join(run["run_dir"], "checkpoints"))) == ["step_2", "step_3"]


@pytest.mark.parametrize(
    "algo",
    [
        "grpo",
        "drgrpo",
        "rloo",
        "dapo",
        "gspo",
        "sapo",
        "cispo",
        "gmpo",
        "reinforce_pp",
        "reinforce_pp_baseline",
        "ppo",
    ],
)
@pytest.mark.slow
def test_every_algorithm_runs_in_the_loop(tiny, algo):
    """algo.name selects the whole algorithm; each one makes real updates in main() (the learning
    itself is measured by bench/algos.py)."""
    cfg = tiny(
        "steps=2",
        "eval_every=100",
        f"run_name=algo_{algo}",
        f"algo.name={algo}",
        "learner.entropy_coef=0.01",
    )
    summary = main(cfg)
    lines = [json.loads(l) for l in open(os.path.join(summary["run_dir"], "metrics.jsonl"))]
    assert all(l["train/updates"] >= 1 and l["train/grad_norm"] > 0 for l in lines[1:])
    if algo == "ppo":
        assert all("critic/value_loss" in l for l in lines[1:])
        assert os.path.exists(
            os.path.join(summary["run_dir"], "final", "critic", "model.safetensors")
        )
    if algo == "dapo":
        assert all(l["rollout/rounds"] >= 1 for l in lines[1:])


@pytest.mark.slow
def test_turn_credit_in_the_loop(tiny):
    """algo.credit=turn trains through main() on multi-turn toy math (tool call, then answer)."""
    summary = main(
        tiny(
            "steps=2",
            "eval_every=100",
            "run_name=turn_credit",
            "algo.credit=turn",
            "algo.advantage=rloo",
            "learner.entropy_coef=0.01",
        )
    )
    lines = [json.loads(l) for l in open(os.path.join(summary["run_dir"], "metrics.jsonl"))]
    assert all(l["train/updates"] >= 1 and l["train/grad_norm"] > 0 for l in lines[1:])
    with pytest.raises(ValueError, match="algo.credit=turn"):
        tiny("algo.credit=turn", "algo.name=ppo")
    summary = main(
        tiny(
            "steps=1",
            "eval_every=100",
            "run_name=turn_state",
            "algo.credit=turn",
            "algo.turn_baseline=state",
        )
    )  # GiGPO's state baseline, keys from the loop
    assert os.path.exists(os.path.join(summary["run_dir"], "final", "model.safetensors"))


def test_turn_credit_broadcasts_each_turns_advantage():
    """train.turn_credit on a hand-made batch: one turn per episode is RLOO; with two turns each
    turn's tokens get their own return minus the other episode's at that position; a penalty added
    to the episode reward lands on its last turn."""
    from batch import RolloutBatch
    from train import turn_credit

    # G = 2. Episode 0: turns at tokens 1-2 and 4, rewards [0.5, 1]; episode 1: one turn at tokens
    # 1-3, reward 0.
    turn_index = torch.tensor([[-1, 0, 0, -1, 1], [-1, 0, 0, 0, -1]])
    mask = (turn_index >= 0).float()
    rewards = torch.tensor([1.5, 0.0])
    batch = RolloutBatch(
        input_ids=torch.zeros(2, 5, dtype=torch.long),
        loss_mask=mask,
        logprobs=torch.zeros(2, 5),
        rewards=rewards,
        turn_rewards=torch.tensor([[0.5, 1.0], [0.0, 0.0]]),
        turn_mask=torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
        turn_index=turn_index,
        turn_states=torch.tensor([[7, 8], [7, -1]]),
        lengths=torch.tensor([5, 4]),
    )
    # returns (gamma 1): ep 0 [1.5, 1], ep 1 [0]; baselines: ep 0 [0, none -> 0], ep 1 [1.5]
    torch.testing.assert_close(
        turn_credit(batch, rewards, 2, 1.0, "position"),
        torch.tensor([[0, 1.5, 1.5, 0, 1.0], [0, -1.5, -1.5, -1.5, 0]]),
    )
    # gamma 0.5: ep 0 turn 0 return 0.5 + 0.5 * 1 = 1; a -0.25 penalty on ep 0 goes to its turn 1
    torch.testing.assert_close(
        turn_credit(batch, rewards - torch.tensor([0.25, 0.0]), 2, 0.5, "position"),
        torch.tensor([[0, 0.875, 0.875, 0, 0.75], [0, -0.875, -0.875, -0.875, 0]]),
    )
    one_turn = replace(
        batch,
        turn_rewards=torch.tensor([[1.5, 0.0], [0.0, 0.0]]),
        turn_mask=torch.tensor([[1.0, 0.0], [1.0, 0.0]]),
        turn_index=turn_index.clamp(max=0) - (turn_index < 0).long(),
    )
    one_turn_mask = (one_turn.turn_index >= 0).float()
    torch.testing.assert_close(
        turn_credit(one_turn, rewards, 2, 1.0, "position"),
        algos.group_advantages(rewards, 2, "rloo")[:, None] * one_turn_mask,
    )


def test_turn_credit_state_baseline_matches_states_across_positions():
    """algo.turn_baseline=state: a turn is compared with the other episodes' turns from the same
    state key, at any position (GiGPO's anchor states); a turn whose state no other episode visited
    keeps the position baseline."""
    from batch import RolloutBatch
    from train import turn_credit

    # G = 2. Episode 0 visits states [A, B], episode 1 [B, C]; rewards: ep 0 [0, 1], ep 1 [1, 0].
    turn_index = torch.tensor([[0, 1], [0, 1]])
    batch = RolloutBatch(
        input_ids=torch.zeros(2, 2, dtype=torch.long),
        loss_mask=torch.ones(2, 2),
        logprobs=torch.zeros(2, 2),
        rewards=torch.tensor([1.0, 1.0]),
        turn_rewards=torch.tensor([[0.0, 1.0], [1.0, 0.0]]),
        turn_mask=torch.ones(2, 2),
        turn_index=turn_index,
        turn_states=torch.tensor([[10, 11], [11, 12]]),
        lengths=torch.tensor([2, 2]),
    )
    # returns: ep 0 [1, 1], ep 1 [1, 0]. State B (ep 0 turn 1, ep 1 turn 0): each other's return, 1
    # and 1. A and C were visited once: the position baseline, the other episode's return at that
    # turn (1, then 1).
    torch.testing.assert_close(
        turn_credit(batch, batch.rewards, 2, 1.0, "state"),
        torch.tensor([[1.0 - 1.0, 1.0 - 1.0], [1.0 - 1.0, 0.0 - 1.0]]),
    )
    # the position baseline differs on B: ep 0 turn 1 vs ep 1 turn 1 (return 0), ep 1 turn 0 vs ep 0
    # turn 0 (1)
    torch.testing.assert_close(
        turn_credit(batch, batch.rewards, 2, 1.0, "position"),
        torch.tensor([[0.0, 1.0], [0.0, -1.0]]),
    )


def episode_rows_case():
    """G = 2, two groups. Episode 0 is one row with two turns (prompt 2 tokens, turn 0 = 2 tokens,
    an observation, turn 1 = 1 token); as rows it is its two requests, each row its own prompt then
    its turn's tokens. Episodes 1-3 are one row of one turn. -> (the one-row trajectories, the same
    with episode 0 as rows)."""
    from agent import Trajectory
    from env import Task

    def traj(ids, mask, reward, turn_rewards, starts, rows=()):
        return Trajectory(
            task=Task(env="toy_math", id="t", prompt="", answer=""),
            group=0,
            sample=0,
            token_ids=ids,
            loss_mask=mask,
            logprobs=[-0.5 * m for m in mask],
            prompt_len=2,
            messages=[],
            reward=reward,
            turn_rewards=turn_rewards,
            turn_starts=starts,
            rows=list(rows),
        )

    whole = traj([1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 0, 1], 1.0, [0.25, 0.75], [2, 5])
    row_a = traj([1, 2, 3, 4], [0, 0, 1, 1], 0.0, [], [2])
    # history rewritten by the client
    row_b = traj([1, 9, 9, 3, 4, 5, 6], [0, 0, 0, 0, 0, 0, 1], 0.0, [], [6])
    split = traj(row_b.token_ids, row_b.loss_mask, 1.0, [0.25, 0.75], [6], rows=[row_a, row_b])
    others = [traj([1, 2, 7], [0, 0, 1], r, [r], [2]) for r in (0.0, 1.0, 1.0)]
    return [whole, *others], [split, *others]


def test_to_batch_gives_every_row_its_episode_and_numbers_turns_within_it():
    from batch import to_batch

    _, trajs = episode_rows_case()
    batch = to_batch(trajs, pad_id=0)
    assert batch.input_ids.shape == (5, 7) and batch.lengths.tolist() == [4, 7, 3, 3, 3]
    assert batch.episode.tolist() == [0, 0, 1, 2, 3]
    episode, last = batch.episode_rows()
    assert episode.tolist() == [0, 0, 1, 2, 3] and last.tolist() == [1, 2, 3, 4]
    assert batch.rewards.tolist() == [1.0, 1.0, 0.0, 1.0, 1.0]  # the episode's, on each row
    assert (
        batch.turn_rewards[:2].tolist() == [[0.25, 0.75]] * 2
        and batch.turn_mask[:2].tolist() == [[1, 1]] * 2
    )
    assert batch.turn_index[0].tolist() == [-1, -1, 0, 0, -1, -1, -1]  # row 0: the episode's turn 0
    assert batch.turn_index[1].tolist() == [-1] * 6 + [1]  # row 1: its turn 1
    assert to_batch(episode_rows_case()[0], pad_id=0).episode.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("credit", ["episode", "turn"])
def test_an_episode_as_rows_gets_the_advantages_it_gets_as_one_row(tiny, credit):
    """The group baseline is over episodes: episode 0 split into two rows counts once in its group,
    and each sampled token of each row gets the advantage the same token gets when the episode is
    one row (GRPO, and turn credit)."""
    from batch import to_batch
    from train import compute_advantages

    cfg = tiny(
        "rollout.agent.n_samples=2",
        f"algo.credit={credit}",
        "algo.advantage=rloo" if credit == "turn" else "algo.advantage=grpo",
    )
    whole, split = (to_batch(t, pad_id=0) for t in episode_rows_case())
    (a, _, _, informative_a), (b, _, _, informative_b) = (
        compute_advantages(cfg, x, None, None) for x in (whole, split)
    )
    assert informative_a and informative_b
    sampled = lambda adv, mask: adv[mask.bool()].tolist()  # noqa: E731
    assert sampled(b.advantages[:2], b.loss_mask[:2]) == sampled(a.advantages[:1], a.loss_mask[:1])
    assert torch.equal(b.advantages[2:, :6], a.advantages[1:]) and not b.advantages[2:, 6:].any()
    assert bool((a.advantages[0] != 0).any())
    if credit == "episode":  # GRPO over the 4 episodes
        expected = algos.group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2, "grpo")
        assert sampled(b.advantages[:2], b.loss_mask[:2]) == [float(expected[0])] * 3


def test_the_skip_reads_the_advantages_so_a_shaped_reward_still_teaches(tiny):
    """A batch is skipped when every advantage is 0, decided from the rewards the advantages come
    from: with DAPO's overlong penalty two episodes of equal raw reward but different lengths are
    a mixed group (the penalty's signal is in the shaped rewards); without it they are not."""
    from batch import to_batch
    from train import compute_advantages

    # one group of two episodes, both reward 1.0: one short, one in the overlong zone
    trajs, _ = episode_rows_case()
    short = trajs[1]
    long = copy.deepcopy(short)
    long.group, long.sample = 0, 1
    long.token_ids = short.token_ids + [7] * 40
    long.loss_mask = short.loss_mask + [1] * 40
    long.logprobs = short.logprobs + [-0.5] * 40
    for t in (short, long):
        t.reward, t.turn_rewards = 1.0, [1.0]
    batch = to_batch([short, long], pad_id=0)
    plain = tiny("rollout.agent.n_samples=2", "algo.overlong_cache=0")
    shaped = tiny(
        "rollout.agent.n_samples=2",
        "rollout.agent.max_total_tokens=48",
        "algo.overlong_cache=40",
    )
    _, _, _, informative = compute_advantages(plain, batch, None, None)
    assert not informative
    train_batch, _, _, informative = compute_advantages(shaped, batch, None, None)
    assert informative and bool((train_batch.advantages != 0).any())


@pytest.mark.slow
def test_on_policy_distillation(tiny):
    """algo.teacher_path: a teacher (here a run's final policy, moved away from the start by one
    step of a strong entropy bonus: the tiny model's rewards are all 0) scores the student's
    samples; algo.name=distill trains on that per-token reverse KL alone, the default mixes it
    in."""
    teacher = os.path.join(
        main(
            tiny(
                "steps=1",
                "eval_every=100",
                "run_name=teacher",
                "learner.lr=1e-2",
                "learner.entropy_coef=0.5",
            )
        )["run_dir"],
        "final",
    )
    for extra in (["algo.name=distill"], ["algo.distill_coef=0.5"]):
        summary = main(
            tiny(
                "steps=2",
                "eval_every=100",
                "run_name=distill",
                f"algo.teacher_path={teacher}",
                *extra,
            )
        )
        lines = [json.loads(l) for l in open(os.path.join(summary["run_dir"], "metrics.jsonl"))][1:]
        assert all(l["train/distill_reverse_kl"] > 0 and l["train/grad_norm"] > 0 for l in lines)
    with pytest.raises(ValueError, match="algo.teacher_path"):
        tiny("algo.name=distill")


@pytest.mark.slow
def test_kl_in_reward_and_in_loss(tiny):
    for extra in (["learner.kl_coef=0.1"], ["learner.kl_coef=0.1", "algo.kl_in_reward=true"]):
        summary = main(
            tiny("steps=1", "eval_every=100", "run_name=kl", "learner.entropy_coef=0.01", *extra)
        )
        line = [json.loads(l) for l in open(os.path.join(summary["run_dir"], "metrics.jsonl"))][-1]
        assert ("train/reward_kl" in line) == ("algo.kl_in_reward=true" in extra)
        assert ("train/kl" in line) == ("algo.kl_in_reward=true" not in extra)
        # the reward's KL reads pi_old
        assert line["perf/old_logprob_pass"] == float("algo.kl_in_reward=true" in extra)


@pytest.mark.slow
def test_eval_cli_on_a_checkpoint(tiny, tmp_path):
    import eval as eval_py

    summary = main(tiny("steps=1", "eval_every=100", "run_name=for_eval"))
    final = os.path.join(summary["run_dir"], "final")
    out = tmp_path / "episodes.jsonl"
    metrics = eval_py.main(
        [
            "--checkpoint",
            final,
            "--config",
            "configs/toy_math.yaml",
            "--out",
            str(out),
            "envs.0.eval_size=8",
            "rollout.agent.max_total_tokens=768",
        ]
    )
    episodes = [json.loads(l) for l in open(out)]
    assert len(episodes) == 8
    assert metrics["eval/accuracy"] == pytest.approx(sum(e["reward"] for e in episodes) / 8)
    for k in (
        "eval/toy_math/mean_turns",
        "eval/toy_math/tool_calls",
        "eval/toy_math/tokens",
        "eval/toy_math/parse_failure_rate",
    ):
        assert k in metrics


def check_pass_at_k(metrics: dict, prefix: str, n: int, ks: tuple):
    """pass@k of each k, mean@n, in [0, 1] and ordered as they must be: pass@k grows with k, and on
    an env whose reward is 0 or 1 (toy math) pass@1 is the mean reward."""
    passes = [metrics[f"{prefix}pass@{k}"] for k in ks]
    assert all(0.0 <= p <= 1.0 for p in passes) and passes == sorted(passes), passes
    assert (
        metrics[f"{prefix}pass@1"]
        == pytest.approx(metrics[f"{prefix}mean@{n}"])
        == metrics[f"{prefix}accuracy"]
    )


@pytest.mark.slow
def test_pass_at_k_through_train_and_eval(tiny, tmp_path, capsys):
    """eval.n_samples=4 eval.pass_k=[1,2,4]: train.py's evals and eval.py play 4 sampled episodes
    per held-out task and report pass@k; eval.py on the final checkpoint repeats the run's last eval
    exactly."""
    import eval as eval_py

    extra = ["eval.n_samples=4", "eval.pass_k=[1,2,4]", "eval_temperature=1.0"]
    summary = main(tiny("steps=1", "eval_every=100", "run_name=pass_k", *extra))
    lines = [json.loads(l) for l in open(os.path.join(summary["run_dir"], "metrics.jsonl"))]
    for line in lines:  # step 0 and the final eval
        check_pass_at_k(line, "eval/toy_math/", 4, (1, 2, 4))
        # one env: the mean over envs is it
        assert line["eval/pass@4"] == line["eval/toy_math/pass@4"]
    episodes = [
        json.loads(l) for l in open(os.path.join(summary["run_dir"], "episodes_step1.jsonl"))
    ]
    assert [e["sample"] for e in episodes] == [0, 1, 2, 3] * 8  # 8 held-out tasks x 4 samples
    assert len({e["task_id"] for e in episodes}) == 8

    out = tmp_path / "episodes.jsonl"
    metrics = eval_py.main(
        [
            "--checkpoint",
            os.path.join(summary["run_dir"], "final"),
            "--config",
            "configs/toy_math.yaml",
            "--out",
            str(out),
            "envs.0.eval_size=8",
            "rollout.max_tokens=40",
            "rollout.agent.max_total_tokens=768",
            *extra,
        ]
    )
    assert len(open(out).readlines()) == 32
    for k in ("pass@1", "pass@2", "pass@4", "mean@4"):
        assert metrics[f"eval/toy_math/{k}"] == pytest.approx(lines[-1][f"eval/toy_math/{k}"])
    printed = capsys.readouterr().out
    assert "eval/toy_math/pass@4" in printed and "eval/toy_math/mean@4" in printed
    scripted = eval_py.main(
        ["--policy", "random", "--config", "configs/toy_math.yaml", "envs.0.eval_size=8", *extra]
    )
    check_pass_at_k(scripted, "random/toy_math/", 4, (1, 2, 4))
    assert "random/toy_math/pass@2" in capsys.readouterr().out


@pytest.mark.slow
def test_async_one_step_off_policy_and_its_exact_resume(tiny):
    """rollout.async_rollouts: each batch after the first was sampled by the weights one update old
    (rollout/staleness 1), the update corrects with truncated IS, and a run resumed from a
    checkpoint (which keeps the already generated next batch) ends bit-identical to the
    uninterrupted one."""
    # entropy_coef: every update moves the weights whatever the rewards (a batch of all-zero rewards
    # has zero advantages, and no gradient without it), so the batches after the first are
    # off-policy for real
    extra = [
        "steps=4",
        "eval_every=100",
        "rollout.async_rollouts=true",
        "learner.off_policy.kind=tis",
        "learner.off_policy.tis_cap=2.0",
        "learner.entropy_coef=0.01",
    ]
    full = main(tiny(*extra, "checkpoint_every=2", "run_name=async_full"))
    lines = [json.loads(l) for l in open(os.path.join(full["run_dir"], "metrics.jsonl"))][1:]
    assert [l["rollout/staleness"] for l in lines] == [0, 1, 1, 1]
    assert all(
        "train/offpolicy_weight_mean" in l and l["sync/logprob_abs_diff"] < 1e-3 for l in lines
    )
    assert (
        all("perf/rollout_wait_seconds" in l for l in lines[:3])
        and "perf/rollout_wait_seconds" not in lines[3]
    )
    # off-policy for real: the engine's log-probs are not the learner's pi_old after the first step
    assert lines[0]["train/mismatch_kl_k3"] < 1e-8 < lines[1]["train/mismatch_kl_k3"]
    half = os.path.join(full["run_dir"], "checkpoints", "step_2")
    resumed = main(tiny(*extra, "run_name=async_resumed", f"resume={half}"))
    a = load_file(os.path.join(full["run_dir"], "final", "model.safetensors"))
    b = load_file(os.path.join(resumed["run_dir"], "final", "model.safetensors"))
    for k in a:
        assert torch.equal(a[k], b[k]), k
    again = [json.loads(l) for l in open(os.path.join(resumed["run_dir"], "metrics.jsonl"))]
    for x, y in zip(lines[2:], again):
        assert x["step"] == y["step"] and x["rollout/reward"] == y["rollout/reward"]
        assert x["train/pg_loss"] == y["train/pg_loss"] and y["rollout/staleness"] == 1


ASYNC = [
    "eval_every=100",
    "rollout.async_rollouts=true",
    "learner.off_policy.kind=tis",
    "learner.off_policy.tis_cap=2.0",
    "learner.entropy_coef=0.01",
]


@pytest.mark.slow
def test_bounded_staleness_schedule_queue_and_exact_resume(tiny):
    """rollout.max_staleness=2: batch s comes from the weights after update max(0, s-3) (staleness
    0, 1, 2, 2, ... on every token), the checkpoint after step 2 holds the queue (batches 3 and 4,
    sampled from the base weights and from update 1), and a run resumed from it ends with the
    uninterrupted run's bytes and metrics."""
    from runs import load_pending

    extra = [*ASYNC, "steps=5", "rollout.max_staleness=2"]
    full = main(tiny(*extra, "checkpoint_every=2", "run_name=stale2_full"))["run_dir"]
    lines = [json.loads(l) for l in open(os.path.join(full, "metrics.jsonl"))][1:]
    assert [l["rollout/staleness"] for l in lines] == [0, 1, 2, 2, 2]
    assert [l["rollout/staleness_max"] for l in lines] == [0, 1, 2, 2, 2]
    assert all(
        "rollout/stale_dropped" not in l and l["sync/logprob_abs_diff"] < 1e-3 for l in lines
    )
    half = os.path.join(full, "checkpoints", "step_2")
    queue = load_pending(half)
    assert sorted(queue) == [3, 4]
    for step, version in ((3, 0), (4, 1)):
        trajs = queue[step][0]
        assert {v for t in trajs for v, m in zip(t.versions, t.loss_mask) if m} == {version}
    resumed = main(tiny(*extra, "run_name=stale2_resumed", f"resume={half}"))["run_dir"]
    for f in ("model.safetensors", "trainer_state.pt"):
        assert same_file(os.path.join(full, "final", f), os.path.join(resumed, "final", f)), f
    again = [json.loads(l) for l in open(os.path.join(resumed, "metrics.jsonl"))]
    for x, y in zip(lines[2:], again):
        assert x["step"] == y["step"] and x["rollout/reward"] == y["rollout/reward"]
        assert (
            x["train/pg_loss"] == y["train/pg_loss"]
            and x["rollout/staleness"] == y["rollout/staleness"]
        )
    # resumed under a tighter bound (k=1), both queued batches are two updates old when their step
    # comes: each is dropped and sampled again from the current weights
    tight = main(tiny(*ASYNC, "steps=4", "run_name=stale2_tight", f"resume={half}"))["run_dir"]
    lines = [json.loads(l) for l in open(os.path.join(tight, "metrics.jsonl"))]
    assert [
        (l["step"], l["rollout/staleness_max"], l.get("rollout/stale_dropped")) for l in lines
    ] == [(3, 0, 1), (4, 0, 1)]


@pytest.mark.slow
def test_partial_rollouts_stay_within_the_bound_and_log_their_versions(tiny):
    """rollout.partial_rollouts: the push never waits for the batch in flight, so which token gets
    which version depends on timing (not asserted); what holds is asserted: every token is within
    the bound, and every queued batch's behaviour log-probs are a re-scoring of its tokens under the
    weights of the version each records (the checkpoint after step v holds version v; version 0 is
    the base model), within the weight-sync gate's 1e-3."""
    from model import load_model
    from rollout import default_sync_threshold
    from runs import load_pending
    from sft import model_folder

    cfg = tiny(
        *ASYNC,
        "steps=4",
        "rollout.max_staleness=2",
        "rollout.partial_rollouts=true",
        "checkpoint_every=1",
        "run_name=partial",
    )
    run = main(cfg)["run_dir"]
    lines = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))][1:]
    assert lines[0]["rollout/staleness_max"] == 0
    assert all(0 <= l["rollout/staleness"] <= l["rollout/staleness_max"] <= 2 for l in lines)
    assert all(
        l["sync/logprob_abs_diff"] < 1e-3 and "rollout/stale_dropped" not in l for l in lines
    )
    models = {0: load_model(model_folder(cfg))}
    models.update({v: load_model(os.path.join(run, "checkpoints", f"step_{v}")) for v in (1, 2, 3)})
    checked = 0
    for v in (1, 2, 3):
        for step, (trajs, *_) in load_pending(
            os.path.join(run, "checkpoints", f"step_{v}")
        ).items():
            for t in trajs:
                ids = torch.tensor([t.token_ids])
                for version in {x for x, m in zip(t.versions, t.loss_mask) if m}:
                    assert max(0, step - 3) <= version <= v  # within the bound, never ahead
                    with torch.no_grad():
                        # (T,)
                        logp = models[version].token_logprobs(
                            ids, temperature=cfg.rollout.temperature
                        )[0]
                    at = [
                        i
                        for i, (x, m) in enumerate(zip(t.versions, t.loss_mask))
                        if m and x == version
                    ]
                    gap = (logp[at] - torch.tensor(t.logprobs)[at]).abs().max()
                    assert gap < default_sync_threshold("float32"), (step, version, float(gap))
                    checked += len(at)
    assert checked > 100


@pytest.mark.slow
def test_a_run_resumed_from_its_final_checkpoint_keeps_its_swap_record(tiny):
    """resume=auto on a finished run continues from final/ (runs.latest_checkpoint prefers it at
    equal steps); a run replaying a record (rollout.partial_replay) rewrites its own record from
    that checkpoint's entries alone, so final/ must carry them: without, a kill after final/ was
    written left an empty record (the intermittent failure of
    tests/test_kill_resume.py[partial_replay], whose third kill can land there)."""
    extra = [*ASYNC, "steps=2", "rollout.partial_rollouts=true", "algo.skip_uniform_batches=false"]
    reference = main(tiny(*extra, "run_name=partial_ref"))["run_dir"]
    # as the kill test's runs
    cfg = tiny(*extra, "run_name=partial_final", f"rollout.partial_replay={reference}")
    record = os.path.join(main(cfg)["run_dir"], "partial_swaps.jsonl")
    before = open(record).read()
    assert (
        before == open(os.path.join(reference, "partial_swaps.jsonl")).read()
        and before.count("\n") >= 2
    )
    main(replace(cfg, resume="auto"))
    assert open(record).read() == before


def test_async_rollouts_need_an_off_policy_correction(tiny):
    with pytest.raises(ValueError, match="learner.off_policy.kind=tis"):
        tiny("rollout.async_rollouts=true")
    tiny(
        "rollout.async_rollouts=true",
        "learner.off_policy.kind=mis",
        "learner.off_policy.level=sequence",
    )


def test_peak_flops_override_table_and_measured():
    """perf/mfu's denominator: the config's peak_flops wins; on a CPU, a measured matmul (any real
    CPU does more than 1e8 FLOP/s and less than 1e13 fp32 on a 512 x 512 matmul with the threads it
    has)."""
    from runs import peak_flops, peak_memory_gib

    cpu = torch.device("cpu")
    assert peak_flops(cpu, 5e12) == 5e12
    assert 1e8 < peak_flops(cpu) < 1e13
    assert peak_memory_gib(cpu) > 0.05  # this process holds torch: > 50 MiB


@pytest.mark.slow
def test_in_process_torch_engine_shares_the_learners_parameters_only_when_it_can(tiny):
    """One process, no LoRA, no async rollouts: the engine's model is the policy's module (no copy,
    no push; the smoke and resume tests run this way and the weight-sync gate checks it); otherwise
    a copy that is pushed into."""
    from config import learner_configs
    from train import build_learner, model_folder, shares_engine_model

    cfg = tiny()
    assert shares_engine_model(cfg)
    policy, _, engine_model = build_learner(cfg, model_folder(cfg), "", *learner_configs(cfg), True)
    assert engine_model is policy.model
    for extra in (
        ["learner.lora_rank=4"],
        ["rollout.async_rollouts=true", "learner.off_policy.kind=tis"],
        [
            "rollout.async_rollouts=true",
            "learner.off_policy.kind=tis",
            "rollout.partial_rollouts=true",
        ],
        ["rollout.engine=vllm"],
    ):
        assert not shares_engine_model(tiny(*extra)), extra
    lora = tiny("learner.lora_rank=4")
    policy, _, engine_model = build_learner(
        lora, model_folder(lora), "", *learner_configs(lora), shares_engine_model(lora)
    )
    assert engine_model is not policy.model and engine_model is not None
