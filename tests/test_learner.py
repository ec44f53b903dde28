"""Learner: micro-batch split invariance, SFT learns, non-finite guard, exact checkpoint resume."""
import copy
import math
import os
import sys
from dataclasses import replace

import pytest
import torch

from learner import LearnerConfig, TrainBatch, load_checkpoint, make_learner, save_checkpoint, sft_step, train_step
from model import ModelConfig, init_model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_cases import scored  # noqa: E402

CFG = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)


def make_batch(B=8, T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CFG.vocab_size, (B, T), generator=g)
    mask = torch.zeros(B, T)
    for b in range(B):                                   # ragged responses, one row fully masked
        if b != 3:
            mask[b, 4: 4 + 1 + b % 7] = 1
    adv = torch.randn(B, 1, generator=g) * mask          # (B, T)
    return TrainBatch(ids, mask, adv)


def first_step_grad(state):
    """AdamW's first step stores exp_avg = (1 - beta1) * grad: read the accumulated gradient back from it."""
    b1 = state.optimizer.param_groups[0]["betas"][0]
    return torch.cat([state.optimizer.state[p]["exp_avg"].flatten() / (1 - b1) for p in state.model.parameters()])


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
    state = make_learner(init_model(CFG, seed=0), LearnerConfig(lr=1e-2, micro_batch_size=4), seed=0)
    b = make_batch()
    losses = [sft_step(state, b.input_ids, b.loss_mask, LearnerConfig(lr=1e-2, micro_batch_size=4))[1]["sft/loss"]
              for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0]


def test_nonfinite_gradient_skips_the_step():
    cfg = LearnerConfig(micro_batch_size=4)
    state = make_learner(init_model(CFG, seed=0), cfg, seed=0)
    before = copy.deepcopy(state.model.state_dict())
    b = make_batch()
    b.advantages[0, 4] = float("nan")                    # a NaN on a trained token
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

    resumed = make_learner(init_model(CFG, seed=1), cfg, seed=123)        # different init and RNG on purpose
    resumed = load_checkpoint(resumed, str(tmp_path / "ck"))
    assert resumed.optimizer_step == 2 * 4
    for b in batches[2:]:
        resumed, _ = train_step(resumed, scored(resumed, b, cfg), cfg)
    assert resumed.optimizer_step == state.optimizer_step
    for (k, a), (_, b) in zip(state.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), k


def test_truncated_importance_sampling_in_the_update():
    """tis_cap > 0 weights each token by min(pi_old / pi_engine, cap): with the engine's log-probs equal to
    the learner's the update is unchanged; off-policy log-probs change it; missing ones are a clear error."""
    model, batch = init_model(CFG, seed=0), make_batch()
    plain_cfg = LearnerConfig(micro_batch_size=4, grad_clip=0.0)          # no clipping: gradients compare raw
    tis_cfg = LearnerConfig(micro_batch_size=4, grad_clip=0.0, tis_cap=2.0)
    from learner import compute_logprobs
    old = compute_logprobs(model, batch.input_ids, 4, mask=batch.loss_mask)
    grads = {}
    for name, cfg, engine in [("plain", plain_cfg, None), ("same", tis_cfg, old),
                              ("off", tis_cfg, old - 0.5 * batch.loss_mask)]:   # the engine found tokens rarer
        state = make_learner(copy.deepcopy(model), cfg, seed=0)
        b = TrainBatch(batch.input_ids, batch.loss_mask, batch.advantages, old, engine_logprobs=engine)
        state, m = train_step(state, b, cfg)
        grads[name] = first_step_grad(state)
        if cfg.tis_cap:
            assert {"train/tis_weight_mean", "train/tis_clip_frac", "train/behaviour_kl"} <= set(m)
    torch.testing.assert_close(grads["same"], grads["plain"], rtol=1e-5, atol=1e-8)
    # pi_old / mu = e^0.5 = 1.65 < cap on every token: the gradient is exactly scaled by it
    torch.testing.assert_close(grads["off"], grads["plain"] * math.exp(0.5), rtol=1e-4, atol=1e-7)
    with pytest.raises(ValueError, match="engine_logprobs"):
        train_step(make_learner(copy.deepcopy(model), tis_cfg, seed=0), replace(batch, old_logprobs=old), tis_cfg)
    with pytest.raises(ValueError, match="old_logprobs"):                # pi_old has one owner: the caller
        train_step(make_learner(copy.deepcopy(model), plain_cfg, seed=0), batch, plain_cfg)


@pytest.mark.parametrize("loss", ["ppo", "gspo", "sapo"])
def test_on_policy_update_skips_the_old_logprob_pass_with_the_same_gradient(loss):
    """One mini-batch, one epoch: pi_old taken from the update's own log-probs (detached) instead of a scoring pass.
    Same process, same shapes, same ops: the recomputed pi_old is bit for bit the update's log-probs, so the ratio
    is exactly 1 either way and the gradients and metrics must be *equal*, not close."""
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
    for off_policy in (replace(cfg, mini_batches=2), replace(cfg, ppo_epochs=2), replace(cfg, tis_cap=2.0),
                       replace(cfg, lora_rank=4, lora_dropout=0.1)):
        assert old_logprobs_needed(off_policy)
    with pytest.raises(ValueError, match="on-policy"):               # two optimizer steps: pi_old must be scored
        two = replace(cfg, mini_batches=2)
        train_step(make_learner(copy.deepcopy(model), two, seed=0), replace(batch, old_from_update=True), two)


def test_token_budget_micro_batches_pack_by_length_and_keep_the_gradient():
    """learner.max_tokens_per_micro_batch packs rows (sorted by length) while rows x longest <= the budget: every
    row once, no micro-batch over budget unless it is one row, less padding than fixed rows; and the gradient is
    the one of the whole batch at once (tolerance of test_micro_batch_split_invariance: another summation order)."""
    from learner import _rank_micro_batches, _row_lens
    batch = make_batch(B=8, T=12)
    lens = _row_lens(batch.loss_mask)
    for budget in (1, 10, 24, 1000):
        plan = _rank_micro_batches(lens, 32, budget)
        assert sorted(torch.cat([idx for idx, _ in plan]).tolist()) == list(range(8))
        for idx, _ in plan:
            assert len(idx) == 1 or len(idx) * int(lens[idx].max()) <= budget
    model = init_model(CFG, seed=0)
    grads, pads = [], []
    for kw in ({"micro_batch_size": 8}, {"micro_batch_size": 3}, {"max_tokens_per_micro_batch": 20},
               {"max_tokens_per_micro_batch": 9}):
        cfg = LearnerConfig(grad_clip=0.0, **kw)
        state = make_learner(copy.deepcopy(model), cfg, seed=0)
        state, m = train_step(state, scored(state, batch, cfg), cfg)
        grads.append(first_step_grad(state))
        pads.append(m["perf/pad_fraction"])
        assert 0.0 <= m["perf/pad_fraction"] < 1.0
    for g in grads[1:]:
        torch.testing.assert_close(g, grads[0], rtol=1e-4, atol=1e-7)
    assert pads[3] < pads[2] < pads[1] < pads[0]   # packing by length wastes less than 3 fixed rows, than 8
    assert pads[3] == 0.0                         # budget 9: one row each (lengths 2..11), no padding at all
