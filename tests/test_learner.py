"""Learner: micro-batch split invariance, SFT learns, non-finite guard, exact checkpoint resume."""

import copy
import math
import os
import sys
from dataclasses import replace

import pytest
import torch

from algos import OffPolicyConfig
from learner import (
    LearnerConfig,
    TrainBatch,
    make_learner,
    sft_step,
    train_step,
)
from model import ModelConfig, init_model
from runs import load_checkpoint, save_checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_cases import scored  # noqa: E402

CFG = ModelConfig(
    model_type="qwen2",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)


def make_batch(B=8, T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CFG.vocab_size, (B, T), generator=g)
    mask = torch.zeros(B, T)
    for b in range(B):  # ragged responses, one row fully masked
        if b != 3:
            mask[b, 4 : 4 + 1 + b % 7] = 1
    adv = torch.randn(B, 1, generator=g) * mask  # (B, T)
    return TrainBatch(ids, mask, adv)


def first_step_grad(state):
    """AdamW's first step stores exp_avg = (1 - beta1) * grad: read the accumulated gradient back
    from it."""
    b1 = state.optimizer.param_groups[0]["betas"][0]
    return torch.cat(
        [state.optimizer.state[p]["exp_avg"].flatten() / (1 - b1) for p in state.model.parameters()]
    )


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batch_split_invariance(agg):
    model = init_model(CFG, seed=0)
    batch = make_batch()
    grads = []
    for mbs in (8, 3, 1):
        cfg = LearnerConfig(micro_batch_size=mbs, grad_clip=0.0)
        cfg.loss.agg_mode = agg
        state = make_learner(copy.deepcopy(model), cfg, seed=0)
        state, m = train_step(state, scored(state, batch, cfg), cfg)
        grads.append(first_step_grad(state))
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(grads[2], grads[0], rtol=1e-4, atol=1e-7)


def test_sft_step_learns():
    state = make_learner(
        init_model(CFG, seed=0), LearnerConfig(lr=1e-2, micro_batch_size=4), seed=0
    )
    b = make_batch()
    losses = [
        sft_step(state, b.input_ids, b.loss_mask, LearnerConfig(lr=1e-2, micro_batch_size=4))[1][
            "sft/loss"
        ]
        for _ in range(30)
    ]
    assert losses[-1] < 0.5 * losses[0]


def test_nonfinite_gradient_skips_the_step():
    cfg = LearnerConfig(micro_batch_size=4)
    state = make_learner(init_model(CFG, seed=0), cfg, seed=0)
    before = copy.deepcopy(state.model.state_dict())
    b = make_batch()
    b.advantages[0, 4] = float("nan")  # a NaN on a trained token
    state, m = train_step(state, scored(state, b, cfg), cfg)
    assert m["train/skipped_nonfinite"] == 1.0
    for k, v in state.model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_checkpoint_resume_is_exact(tmp_path):
    cfg = LearnerConfig(lr=1e-3, micro_batch_size=3, mini_batches=2, ppo_epochs=2)
    state = make_learner(init_model(CFG, seed=0), cfg, seed=0)
    batches = [make_batch(seed=s) for s in range(4)]
    for b in batches[:2]:
        state, _ = train_step(state, scored(state, b, cfg), cfg)
    save_checkpoint(state, str(tmp_path / "ck"))
    for b in batches[2:]:
        state, _ = train_step(state, scored(state, b, cfg), cfg)

    # different init and RNG on purpose
    resumed = make_learner(init_model(CFG, seed=1), cfg, seed=123)
    resumed = load_checkpoint(resumed, str(tmp_path / "ck"))
    assert resumed.optimizer_step == 2 * 4
    for b in batches[2:]:
        resumed, _ = train_step(resumed, scored(resumed, b, cfg), cfg)
    assert resumed.optimizer_step == state.optimizer_step
    for (k, a), (_, b) in zip(state.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), k


def test_off_policy_corrections_in_the_update():
    """learner.off_policy weights each token's loss by algos.off_policy_weights(pi_old, pi_engine):
    kind=none (the default) leaves the update bit for bit as without the engine's log-probs and only
    logs the mismatch KL; token TIS scales by min(pi_old / mu, cap); sequence TIS by a row's whole
    product; masked IS zeroes the tokens (or the rows) outside its band. Each is compared with a
    plain update whose advantages carry the same weights (on the first pass the ratio is 1, so the
    loss is linear in the advantages). Missing log-probs are a clear error."""
    from learner import compute_logprobs

    model, batch = init_model(CFG, seed=0), make_batch()
    old = compute_logprobs(model, batch.input_ids, 4, mask=batch.loss_mask)
    mask, adv = batch.loss_mask, batch.advantages
    n = mask.sum(1, keepdim=True)  # (B, 1) valid tokens per row
    row1 = torch.zeros_like(mask)
    row1[1] = mask[1]  # row 1's tokens
    tok = torch.zeros_like(mask)
    tok[2, 5] = 1.0  # one token of row 2
    assert mask[2, 5] == 1

    def update(off_policy, engine, advantages):
        # no clipping: raw grads
        cfg = LearnerConfig(micro_batch_size=4, grad_clip=0.0, off_policy=off_policy)
        state = make_learner(copy.deepcopy(model), cfg, seed=0)
        state, m = train_step(
            state, TrainBatch(batch.input_ids, mask, advantages, old, engine_logprobs=engine), cfg
        )
        return first_step_grad(state), m

    plain, m = update(OffPolicyConfig(), None, adv)
    assert not any("offpolicy" in k or "mismatch" in k for k in m)
    off = old - 0.5 * mask  # the engine found every token rarer
    g, m = update(OffPolicyConfig(), off, adv)
    assert torch.equal(g, plain) and "train/offpolicy_weight_mean" not in m
    assert m["train/mismatch_kl_k1"] == pytest.approx(-0.5, rel=1e-5)  # mean log mu - log pi_old
    # (config, engine log-probs, the advantages that give the same gradient without a correction)
    cases = [
        (OffPolicyConfig(kind="tis", tis_cap=2.0), off, adv * math.exp(0.5)),  # 1.65 < cap
        (OffPolicyConfig(kind="tis", tis_cap=1.2), off, adv * 1.2),  # every token capped
        # the product
        (OffPolicyConfig(kind="tis", level="sequence", tis_cap=100.0), off, adv * (0.5 * n).exp()),
        (
            OffPolicyConfig(kind="tis", level="sequence", tis_cap=2.0),
            off,
            adv * (0.5 * n).exp().clamp(max=2.0),
        ),
        # e^1 > 2: dropped
        (OffPolicyConfig(kind="mis", mis_low=0.5, mis_high=2.0), old - tok, adv * (1 - tok)),
        (
            OffPolicyConfig(kind="mis", level="sequence", mis_low=0.5, mis_high=2.0),
            old - row1,
            adv * (1 - row1),
        ),
        # geometric mean of
        (
            OffPolicyConfig(kind="mis", level="sequence", mis_low=0.5, mis_high=2.0),
            old - tok,
            # row 2: kept, weighted
            adv * torch.where(torch.arange(8)[:, None] == 2, math.exp(1 / float(n[2])), 1.0),
        ),
    ]
    for off_policy, engine, equivalent in cases:
        g, m = update(off_policy, engine, adv)
        want, _ = update(OffPolicyConfig(), None, equivalent)
        assert g.abs().max() > 0
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-7, msg=str(off_policy))
        assert {
            "train/offpolicy_weight_mean",
            "train/offpolicy_token_masked_frac",
            "train/offpolicy_seq_masked_frac",
            "train/mismatch_kl_k3",
        } <= set(m)
    assert m["train/offpolicy_token_masked_frac"] == 0
    _, m = update(
        OffPolicyConfig(kind="mis", level="sequence", mis_low=0.5, mis_high=2.0), old - row1, adv
    )
    # row 1: 2 tokens
    assert m["train/offpolicy_token_masked_frac"] == pytest.approx(2 / mask.sum().item())
    assert m["train/offpolicy_seq_masked_frac"] == pytest.approx(1 / 7)  # of 7 non-empty rows
    tis_cfg = LearnerConfig(micro_batch_size=4, off_policy=OffPolicyConfig(kind="tis"))
    with pytest.raises(ValueError, match="engine_logprobs"):
        train_step(
            make_learner(copy.deepcopy(model), tis_cfg, seed=0),
            replace(batch, old_logprobs=old),
            tis_cfg,
        )
    plain_cfg = LearnerConfig(micro_batch_size=4, grad_clip=0.0)
    with pytest.raises(ValueError, match="old_logprobs"):  # pi_old has one owner: the caller
        train_step(make_learner(copy.deepcopy(model), plain_cfg, seed=0), batch, plain_cfg)


@pytest.mark.parametrize("loss", ["ppo", "gspo", "sapo"])
def test_on_policy_update_skips_the_old_logprob_pass_with_the_same_gradient(loss):
    """One mini-batch, one epoch: pi_old taken from the update's own log-probs (detached) instead of
    a scoring pass. Same process, same shapes, same ops: the recomputed pi_old is bit for bit the
    update's log-probs, so the ratio is exactly 1 either way and the gradients and metrics must be
    *equal*, not close."""
    from learner import old_logprobs_needed

    model, batch = init_model(CFG, seed=0), make_batch()
    cfg = LearnerConfig(micro_batch_size=3, grad_clip=0.0, policy_loss=loss, entropy_coef=0.01)
    assert not old_logprobs_needed(cfg)
    grads, metrics = [], []
    for b in (lambda s: scored(s, batch, cfg), lambda s: replace(batch, old_from_update=True)):
        state = make_learner(copy.deepcopy(model), cfg, seed=0)
        state, m = train_step(state, b(state), cfg)
        grads.append(first_step_grad(state))
        metrics.append(m)
    assert grads[0].abs().max() > 0
    assert torch.equal(grads[1], grads[0])
    assert metrics[1] == metrics[0]
    for off_policy in (
        replace(cfg, mini_batches=2),
        replace(cfg, ppo_epochs=2),
        replace(cfg, off_policy=OffPolicyConfig(kind="tis")),
        replace(cfg, lora_rank=4, lora_dropout=0.1),
    ):
        assert old_logprobs_needed(off_policy)
    with pytest.raises(ValueError, match="on-policy"):  # two optimizer steps: pi_old must be scored
        two = replace(cfg, mini_batches=2)
        train_step(
            make_learner(copy.deepcopy(model), two, seed=0),
            replace(batch, old_from_update=True),
            two,
        )


def test_token_budget_micro_batches_pack_by_length_and_keep_the_gradient():
    """learner.max_tokens_per_micro_batch packs rows (sorted by length) while rows x longest <= the
    budget: every row once, no micro-batch over budget unless it is one row, less padding than fixed
    rows; and the gradient is the one of the whole batch at once (tolerance of
    test_micro_batch_split_invariance: another summation order)."""
    from microbatch import rank_micro_batches, row_lens

    batch = make_batch(B=8, T=12)
    lens = row_lens(batch.loss_mask)
    for budget in (1, 10, 24, 1000):
        plan = rank_micro_batches(lens, 32, budget)
        assert sorted(torch.cat([mb.rows for mb in plan]).tolist()) == list(range(8))
        for idx, _, _ in plan:
            assert len(idx) == 1 or len(idx) * int(lens[idx].max()) <= budget
    model = init_model(CFG, seed=0)
    grads, pads = [], []
    for kw in (
        {"micro_batch_size": 8},
        {"micro_batch_size": 3},
        {"max_tokens_per_micro_batch": 20},
        {"max_tokens_per_micro_batch": 9},
    ):
        cfg = LearnerConfig(grad_clip=0.0, **kw)
        state = make_learner(copy.deepcopy(model), cfg, seed=0)
        state, m = train_step(state, scored(state, batch, cfg), cfg)
        grads.append(first_step_grad(state))
        pads.append(m["perf/pad_fraction"])
        assert 0.0 <= m["perf/pad_fraction"] < 1.0
    for g in grads[1:]:
        torch.testing.assert_close(g, grads[0], rtol=1e-4, atol=1e-7)
    # packing by length wastes less than 3 fixed rows, than 8
    assert pads[3] < pads[2] < pads[1] < pads[0]
    assert pads[3] == 0.0  # budget 9: one row each (lengths 2..11), no padding at all


def sampled_batch(model, params, prompts, pad=0):
    """Rollouts of a TorchEngine as a TrainBatch: prompt + generation per row, right-padded, mask on
    the generated tokens, the engine's log-probs and kept-set sizes, random advantages."""
    from batch import pad_right
    from rollout import TorchEngine

    gens = TorchEngine(model, pad).generate(prompts, params)
    rows = [prompts[i // params.n] for i in range(len(gens))]
    ids = pad_right([p + g.token_ids for p, g in zip(rows, gens)], pad, torch.long)  # (B, T)
    mask = pad_right(
        [[0] * len(p) + [1] * len(g.token_ids) for p, g in zip(rows, gens)], 0, torch.float
    )
    engine = pad_right([[0.0] * len(p) + g.logprobs for p, g in zip(rows, gens)], 0.0, torch.float)
    kept = pad_right(
        [[0] * len(p) + (g.kept_sizes or [0] * len(g.token_ids)) for p, g in zip(rows, gens)],
        0,
        torch.long,
    )
    adv = torch.randn(len(gens), 1, generator=torch.Generator().manual_seed(0)) * mask  # (B, T)
    return TrainBatch(ids, mask, adv, engine_logprobs=engine, kept_sizes=kept)


def peaked_model(seed=0):
    model = init_model(CFG, seed)
    with torch.no_grad():
        # larger weights than N(0, 0.02): peaked logits, so top-p keeps a real subset
        g = torch.Generator().manual_seed(seed + 1)
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize(
    "top_k,top_p,temperature", [(0, 0.9, 1.0), (0, 0.6, 0.8), (5, 1.0, 1.0), (8, 0.8, 1.2)]
)
def test_top_k_top_p_batches_are_scored_on_the_sampled_sets(top_k, top_p, temperature):
    """The learner trains what the engine sampled: pi_old, scored on the recorded sets, equals the
    engine's log-probs to float rounding (mismatch KL < 1e-9: the learner's full forward and the
    engine's KV-cache decode sum in other orders, ~1e-6 per log-prob), and the update's ratio pi /
    pi_old is exactly 1 (same process, same
    ops: bit for bit, as in
    test_on_policy_update_skips_the_old_logprob_pass_with_the_same_gradient). Scored over the full
    vocabulary, the same batch is off by the dropped mass."""
    from learner import compute_logprobs, truncated_score
    from rollout import SamplingParams

    model = peaked_model()
    params = SamplingParams(
        n=4, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=10, seed=2
    )
    batch = sampled_batch(model, params, [[5, 9, 3, 7], [4, 1], [13, 6, 6, 1, 2, 8]])
    assert batch.kept_sizes[batch.loss_mask.bool()].min() >= 1
    cfg = LearnerConfig(micro_batch_size=5, grad_clip=0.0, temperature=temperature)
    old = compute_logprobs(
        model,
        batch.input_ids,
        5,
        temperature,
        256,
        batch.loss_mask,
        score=truncated_score,
        score_args=batch.kept_sizes,
        shared_prefix=True,
    )
    grads = []
    for b in (replace(batch, old_logprobs=old), replace(batch, old_from_update=True)):
        state = make_learner(copy.deepcopy(model), cfg, seed=0)
        state, m = train_step(state, b, cfg)
        grads.append(first_step_grad(state))
    # the ratio is 1 bit for bit: the gradient with the scored pi_old equals the one with pi_old =
    # pi.detach() exactly (the logged ratio_min/max are micro-batch-weighted sums of 1.0, so they
    # carry summation rounding)
    assert torch.equal(grads[0], grads[1]) and grads[0].abs().max() > 0
    assert m["train/ratio_min"] == pytest.approx(1.0, abs=1e-6) and m[
        "train/ratio_max"
    ] == pytest.approx(1.0, abs=1e-6)
    state = make_learner(copy.deepcopy(model), cfg, seed=0)
    _, m = train_step(state, replace(batch, old_logprobs=old), cfg)
    assert abs(m["train/mismatch_kl_k1"]) < 1e-6 and m["train/mismatch_kl_k3"] < 1e-9
    full = compute_logprobs(model, batch.input_ids, 5, temperature, 256, batch.loss_mask)
    _, m = train_step(
        make_learner(copy.deepcopy(model), cfg, seed=0),
        replace(batch, old_logprobs=full, kept_sizes=None),
        cfg,
    )
    assert m["train/mismatch_kl_k1"] > 1e-3  # mu puts more mass on every sampled token


def test_infer_kept_sizes_from_the_engines_log_probs():
    """vLLM's route, on a TorchEngine's samples: forget the recorded sizes (-1) and infer them from
    the sampled tokens' truncated log-probs on the learner's logits. The inferred sets reproduce the
    engine's log-probs to float rounding (1e-5, as the recorded ones do), and they are the recorded
    sets except where one more tail token moves the log-sum-exp by less than that rounding."""
    from learner import compute_logprobs, infer_kept_sizes, truncated_score
    from rollout import SamplingParams

    model = peaked_model()
    params = SamplingParams(n=8, temperature=1.0, top_p=0.9, top_k=20, max_tokens=12, seed=5)
    batch = sampled_batch(model, params, [[5, 9, 3, 7], [4, 1], [13, 6, 6, 1, 2, 8]])
    on = batch.loss_mask.bool()
    hidden = torch.where(on, -1, batch.kept_sizes)
    inferred = infer_kept_sizes(
        model, batch.input_ids, hidden, batch.engine_logprobs, micro_batch_size=5
    )
    assert torch.equal(inferred[~on], batch.kept_sizes[~on]) and inferred[on].min() >= 1
    # all 288 here, on this CPU
    assert (inferred[on] == batch.kept_sizes[on]).float().mean() >= 0.98
    logp = compute_logprobs(
        model,
        batch.input_ids,
        5,
        1.0,
        256,
        batch.loss_mask,
        score=truncated_score,
        score_args=inferred,
    )
    assert (logp - batch.engine_logprobs)[on].abs().max() <= 1e-5
    with pytest.raises(ValueError, match="infer_kept_sizes"):
        train_step(
            make_learner(copy.deepcopy(model), LearnerConfig(), seed=0),
            replace(batch, kept_sizes=hidden, old_from_update=True),
            LearnerConfig(),
        )


def test_critic_step_follows_the_update_schedule_and_its_value_clip_binds():
    """critic_step takes ppo_epochs x mini_batches optimizer steps, as train_step does. Its first
    step starts from the old values, where the clip cannot bind (V - V_old = 0): with one step per
    batch algo.value_clip changes nothing, with two it bounds the second step (vf_clip_frac > 0 for
    a clip far below the first step's move)."""
    from learner import Critic, ValueBatch, compute_values, critic_step

    batch = make_batch()
    g = torch.Generator().manual_seed(3)
    # (B, T) far from V = 0
    returns = 5.0 * torch.randn(batch.input_ids.shape, generator=g) * batch.loss_mask

    def run(value_clip, **kw):
        cfg = LearnerConfig(lr=1e-2, micro_batch_size=3, **kw)
        state = make_learner(Critic(init_model(CFG, seed=0)), cfg, seed=1)
        old = compute_values(state.model, batch.input_ids, cfg.micro_batch_size)
        state, m = critic_step(
            state, ValueBatch(batch.input_ids, batch.loss_mask, old, returns), cfg, value_clip
        )
        return state, m, compute_values(state.model, batch.input_ids, cfg.micro_batch_size)

    one_wide, m1, v1 = run(10.0)
    one_tight, m2, v2 = run(1e-4)
    assert one_wide.optimizer_step == one_tight.optimizer_step == 1
    assert m1["critic/vf_clip_frac"] == m2["critic/vf_clip_frac"] == 0.0 and torch.equal(v1, v2)
    two_wide, m3, v3 = run(10.0, ppo_epochs=2)
    two_tight, m4, v4 = run(1e-4, ppo_epochs=2)
    assert two_wide.optimizer_step == two_tight.optimizer_step == 2
    assert m3["critic/vf_clip_frac"] == 0.0 < m4["critic/vf_clip_frac"]  # mean over the two steps
    assert not torch.equal(v3, v4)
    assert run(1e-4, mini_batches=2)[0].optimizer_step == 2  # rows shuffled by the critic's own RNG
