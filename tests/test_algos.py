"""Tests for algos.py: hand-computed cases, finite-difference gradients, and identities between
algorithms.

Every expected number below is worked out by hand (or with `math` on scalars) in the comment next to
it, never by calling the code under test. Masked positions hold nan / inf garbage wherever possible,
so a leak through a multiply shows up as a nan.
"""

import ast
import math
from pathlib import Path

import pytest
import torch

import algos
from algos import (
    OffPolicyConfig,
    PolicyLossConfig,
    aggregate,
    broadcast_turns,
    compute_gae,
    distillation_advantages,
    dynamic_sampling_mask,
    group_advantages,
    kept_mask_from_size,
    kept_size_from_logprob,
    kl_penalty,
    off_policy_weights,
    overlong_penalty,
    policy_loss,
    reinforce_pp_advantages,
    truncated_logprobs,
    truncation_mask,
    turn_advantages,
    value_loss,
    whiten,
)

NAN, INF = float("nan"), float("inf")
f64 = torch.float64


def close(actual, expected, rtol=1e-6, atol=1e-9):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=f64),
        torch.as_tensor(expected, dtype=f64),
        rtol=rtol,
        atol=atol,
    )


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


# ----------------------------------------------------------------------------- file hygiene


def test_imports_only_torch():
    tree = ast.parse(Path(algos.__file__).read_text())
    roots = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    roots |= {
        node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
    }
    assert roots <= {"torch", "dataclasses", "__future__"}, roots


def test_inputs_are_not_mutated():
    g = torch.Generator().manual_seed(0)
    B, T = 4, 5
    tensors = {k: torch.randn(B, T, generator=g, dtype=f64) for k in ("a", "b", "c", "d")}
    mask = torch.ones(B, T)
    mask[1, 3:] = 0
    tensors["a"][1, 4] = NAN
    copies = {k: v.clone() for k, v in tensors.items()}
    a, b, c, d = tensors.values()
    compute_gae(a, b, mask, 0.9, 0.8)
    whiten(a, mask)
    for kind in algos.POLICY_LOSS_KINDS:
        policy_loss(kind, a, b, c, mask, PolicyLossConfig())
    value_loss(a, b, c, mask, 0.2)
    aggregate(a, mask, "seq-mean-token-mean")
    for kind in algos.KL_KINDS:
        kl_penalty(a, b, kind)
    rewards = d[:, 0].clone()
    r_copy = rewards.clone()
    for kind in algos.GROUP_ADVANTAGE_KINDS:
        group_advantages(rewards, 2, kind)
    dynamic_sampling_mask(rewards, 2)
    for k in tensors:
        torch.testing.assert_close(tensors[k], copies[k], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(rewards, r_copy) and torch.equal(mask[1], torch.tensor([1.0, 1, 1, 0, 0]))


# ----------------------------------------------------------------------------- GAE and whitening


def test_gae_hand_computed():
    # gamma = 0.9, lam = 0.8, gamma * lam = 0.72, reward only at the end
    # t=2: delta = 1 + 0 - 0.7 = 0.3;           A = 0.3
    # t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03;    A = 0.03 + 0.72*0.3 = 0.246
    # t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04;    A = 0.04 + 0.72*0.246 = 0.21712
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=f64)
    values = torch.tensor([[0.5, 0.6, 0.7]], dtype=f64)
    adv, ret = compute_gae(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.8)
    close(adv, [[0.21712, 0.246, 0.3]], rtol=1e-12)
    close(ret, [[0.71712, 0.846, 1.0]], rtol=1e-12)

    # The same trajectory with a tool response (masked, garbage) in the middle and padding at the
    # end: masked tokens are skipped, so the valid outputs are unchanged and the masked outputs are
    # 0.
    rewards = torch.tensor([[0.0, NAN, INF, 0.0, 1.0, 7.0]], dtype=f64)
    values = torch.tensor([[0.5, INF, NAN, 0.6, 0.7, -3.0]], dtype=f64)
    mask = torch.tensor([[1, 0, 0, 1, 1, 0]])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv, [[0.21712, 0, 0, 0.246, 0.3, 0]], rtol=1e-12)
    close(ret, [[0.71712, 0, 0, 0.846, 1.0, 0]], rtol=1e-12)


def test_gae_monte_carlo_limit_and_compression():
    # gamma = lam = 1: A_t = (sum of rewards from t on) - V_t.
    rewards = torch.tensor([[1.0, 2.0, 3.0]], dtype=f64)
    values = torch.tensor([[0.5, -1.0, 2.0]], dtype=f64)
    adv, _ = compute_gae(rewards, values, torch.ones(1, 3), 1.0, 1.0)
    close(adv, [[6 - 0.5, 5 + 1.0, 3 - 2.0]], rtol=1e-12)

    # Random rows with holes equal the GAE of the rows with the holes squeezed out.
    g = torch.Generator().manual_seed(1)
    B, T = 3, 9
    mask = torch.rand(B, T, generator=g) < 0.6
    mask[2] = False  # a fully masked row
    r = torch.randn(B, T, generator=g, dtype=f64)
    v = torch.randn(B, T, generator=g, dtype=f64)
    r_garbage = torch.where(mask, r, NAN)
    v_garbage = torch.where(mask, v, INF)
    adv, ret = compute_gae(r_garbage, v_garbage, mask, 0.95, 0.9)
    for b in range(B):
        n = int(mask[b].sum())
        a_b, ret_b = compute_gae(
            r[b, mask[b]][None], v[b, mask[b]][None], torch.ones(1, n), 0.95, 0.9
        )
        close(adv[b, mask[b]], a_b[0], rtol=1e-12)
        close(ret[b, mask[b]], ret_b[0], rtol=1e-12)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_whiten():
    x = torch.tensor([[1.0, 2.0, NAN], [3.0, INF, 0.0]], dtype=f64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # valid values 1, 2, 3: mean 2, unbiased variance (1 + 0 + 1) / 2 = 1
    out = whiten(x, mask)
    close(out, [[-1 / math.sqrt(1 + 1e-8), 0, 0], [1 / math.sqrt(1 + 1e-8), 0, 0]], rtol=1e-12)
    with pytest.raises(ValueError):
        whiten(x, torch.tensor([[1, 0, 0], [0, 0, 0]]))


# ----------------------------------------------------------------------------- group advantages


def test_group_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.3, 0.3, 0.3, 0.3], dtype=f64)
    # group 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3); group 1 all equal -> 0
    s = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    close(group_advantages(rewards, 4, "grpo"), [s, -s, -s, s, 0, 0, 0, 0], rtol=1e-10)
    close(group_advantages(rewards, 4, "drgrpo"), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0], rtol=1e-12)
    # rloo: 1 - mean(0, 0, 1) = 2/3; 0 - mean(1, 0, 1) = -2/3
    close(
        group_advantages(rewards, 4, "rloo"), [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0], rtol=1e-12
    )
    # uneven group: rloo is R_i minus the mean of the others
    close(
        group_advantages(torch.tensor([3.0, 0.0, 0.0], dtype=f64), 3, "rloo"),
        [3.0, -1.5, -1.5],
        rtol=1e-12,
    )


@pytest.mark.parametrize("kind", algos.GROUP_ADVANTAGE_KINDS)
def test_group_advantages_all_equal_is_exactly_zero(kind):
    for value in (0.1, 0.0, 1.0, -7.3):
        # float32 mean of 0.1s is not exactly 0.1
        adv = group_advantages(torch.full((3,), value), 3, kind)
        assert torch.equal(adv, torch.zeros(3)), (kind, value, adv)


def test_group_advantages_errors():
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(5), 2, "grpo")
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(4), 1, "rloo")
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(4), 1, "grpo")
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(4), 2, "reinforce")


# ----------------------------------------------------------------------------- policy losses, hand
# cases


def run_loss(kind, ratios, adv, mask, cfg=PolicyLossConfig(), garbage=NAN):
    """policy_loss on given ratios (old_logp = 0, logp = log r); masked entries are replaced by
    garbage."""
    mask = torch.as_tensor(mask)
    logp = torch.log(torch.as_tensor(ratios, dtype=f64))
    logp = torch.where(mask.bool(), logp, garbage).requires_grad_()
    old = torch.where(mask.bool(), torch.zeros_like(logp), -garbage)
    adv = torch.where(mask.bool(), torch.as_tensor(adv, dtype=f64), garbage)
    loss, metrics = policy_loss(kind, logp, old, adv, mask, cfg)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss, metrics, grad


def test_ppo_clips_both_sides_for_both_signs():
    # r = 1.5, A=+1: clipped at 1.2 -> -1.2, no grad     r = 0.5, A=+1: not clipped -> -0.5, grad -r
    # A = -0.5 r = 0.5, A=-1: clipped at 0.8 -> 0.8, no grad      r = 1.5, A=-1: not clipped -> 1.5,
    # grad -r A = 1.5 token-mean over 4 valid tokens: (-1.2 - 0.5 + 0.8 + 1.5) / 4 = 0.15
    loss, m, grad = run_loss(
        "ppo", [[1.5, 0.5, 0.5, 1.5, 1.0]], [[1.0, 1.0, -1.0, -1.0, 0.0]], [[1, 1, 1, 1, 0]]
    )
    close(loss, 0.15, rtol=1e-12)
    close(grad, [[0, -0.5 / 4, 0, 1.5 / 4, 0]], rtol=1e-12)
    close(m["clip_frac_low"], 0.25)
    close(m["clip_frac_high"], 0.25)
    close(m["ratio_mean"], 1.0)
    close(m["ratio_min"], 0.5)
    close(m["ratio_max"], 1.5)
    k3 = lambda r: r - 1 - math.log(r)
    close(m["approx_kl"], (2 * k3(1.5) + 2 * k3(0.5)) / 4)
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())
    assert set(m) == {
        "clip_frac_low",
        "clip_frac_high",
        "approx_kl",
        "ratio_mean",
        "ratio_min",
        "ratio_max",
    }


def test_dual_clip_caps_negative_advantages():
    # r = 5, A=-1: PPO 5, dual-clip min(5, c=3) = 3 (no grad)   r = 2, A=-1: 2 < 3 untouched, grad 2
    # r = 0.5, A=-1: 0.8 (clip low)                              r = 1.5, A=+1: -1.2 (clip high)
    args = ([[5.0, 2.0, 0.5, 1.5]], [[-1.0, -1.0, -1.0, 1.0]], [[1, 1, 1, 1]])
    loss_ppo, _, _ = run_loss("ppo", *args)
    loss, m, grad = run_loss("dual_clip", *args)
    close(loss_ppo, (5 + 2 + 0.8 - 1.2) / 4, rtol=1e-12)
    close(loss, (3 + 2 + 0.8 - 1.2) / 4, rtol=1e-12)
    close(grad, [[0, 2 / 4, 0, 0]], rtol=1e-12)
    close(m["clip_frac_high"], 0.5)  # the cap and the ordinary high clip
    close(m["clip_frac_low"], 0.25)


def test_dapo_clip_higher():
    # r = 1.25, A=+1: PPO clips at 1.2, DAPO (ceiling 1.28) does not; r = 1.3 is clipped by both;
    # r = 0.75, A=-1: both clip at the same floor 0.8.
    args = ([[1.25, 1.3, 0.75]], [[1.0, 1.0, -1.0]], [[1, 1, 1]])
    loss_ppo, m_ppo, grad_ppo = run_loss("ppo", *args)
    loss, m, grad = run_loss("dapo", *args)
    close(loss_ppo, (-1.2 - 1.2 + 0.8) / 3, rtol=1e-12)
    close(grad_ppo, [[0, 0, 0]])
    close(loss, (-1.25 - 1.28 + 0.8) / 3, rtol=1e-12)
    close(grad, [[-1.25 / 3, 0, 0]], rtol=1e-12)
    close(m_ppo["clip_frac_high"], 2 / 3)
    close(m["clip_frac_high"], 1 / 3)


@pytest.mark.parametrize("kind", ["gspo", "gspo_token"])
def test_gspo_sequences_inside_and_outside_the_band(kind):
    # Band (1 - 3e-4, 1 + 4e-4). Token log-ratios per row, seq-mean-token-mean over B = 4 rows:
    # row 0: [0, 6e-4, 0], A=+1: s = exp(2e-4), inside (though one token alone, exp(6e-4), is
    # outside)
    #        -> loss -s, every token gets gradient -A s / |y| / B = -s / 3 / 4
    # row 1: [1e-3, 1e-3], A=+1: s = exp(1e-3) > 1 + 4e-4 -> loss -(1 + 4e-4), no gradient
    # row 2: [-5e-4, -5e-4, -5e-4], A=-1: s = exp(-5e-4) < 1 - 3e-4 -> loss (1 - 3e-4), no gradient
    # row 3: fully masked garbage -> contributes 0, still counts in B
    lr = [[0.0, 6e-4, 0.0], [1e-3, 1e-3, 0.0], [-5e-4, -5e-4, -5e-4], [0.0, 0.0, 0.0]]
    ratios = torch.tensor(lr, dtype=f64).exp()
    adv = [[1.0] * 3, [1.0] * 3, [-1.0] * 3, [1.0] * 3]
    mask = [[1, 1, 1], [1, 1, 0], [1, 1, 1], [0, 0, 0]]
    cfg = PolicyLossConfig(agg_mode="seq-mean-token-mean")
    loss, m, grad = run_loss(kind, ratios, adv, mask, cfg)
    s0, s1, s2 = math.exp(2e-4), math.exp(1e-3), math.exp(-5e-4)
    close(loss, (-s0 - (1 + 4e-4) + (1 - 3e-4) + 0) / 4, rtol=1e-12)
    close(grad, [[-s0 / 12] * 3, [0.0] * 3, [0.0] * 3, [0.0] * 3], rtol=1e-10)
    # metrics are over the 3 sequences with a valid token
    close(m["clip_frac_high"], 1 / 3)
    close(m["clip_frac_low"], 1 / 3)
    close(m["ratio_mean"], (s0 + s1 + s2) / 3, rtol=1e-12)
    close(m["ratio_min"], s2, rtol=1e-12)
    close(m["ratio_max"], s1, rtol=1e-12)


def test_gspo_token_weights_each_token_by_its_own_advantage():
    # One on-policy sequence (s = 1) of 2 tokens with per-token advantages A = [1, 3],
    # seq-mean-token-mean.
    # gspo:       loss = -mean_t(A_t) s,  d s / d logp_t = s / 2   -> grad = -2 * 1/2 = [-1, -1]
    # gspo_token: loss = -mean_t(A_t s_t), d s_t / d logp_t = s_t  -> grad = -A_t / 2 = [-0.5, -1.5]
    cfg = PolicyLossConfig(agg_mode="seq-mean-token-mean")
    loss, _, grad = run_loss("gspo", [[1.0, 1.0]], [[1.0, 3.0]], [[1, 1]], cfg)
    loss_tok, _, grad_tok = run_loss("gspo_token", [[1.0, 1.0]], [[1.0, 3.0]], [[1, 1]], cfg)
    close(loss, -2.0, rtol=1e-12)
    close(loss_tok, -2.0, rtol=1e-12)
    close(grad, [[-1.0, -1.0]], rtol=1e-12)
    close(grad_tok, [[-0.5, -1.5]], rtol=1e-12)


def test_sapo_hand_computed():
    # f(r) = sigmoid(tau (r - 1)) * 4 / tau; loss -f(r) A; d loss / d logp = -A f'(r) r, f'(r) = 4 s
    # (1 - s) r = 1.2, A=+1, tau 1.0;  r = 0.8, A=-1, tau 1.05;  r = 3.0, A=+2, tau 1.0 (gate nearly
    # shut)
    ratios, advs, taus = [1.2, 0.8, 3.0], [1.0, -1.0, 2.0], [1.0, 1.05, 1.0]
    loss, m, grad = run_loss("sapo", [ratios], [advs], [[1, 1, 1]])
    exp_loss, exp_grad = 0.0, []
    for r, a, tau in zip(ratios, advs, taus):
        s = sigmoid(tau * (r - 1))
        exp_loss += -s * 4 / tau * a / 3
        exp_grad.append(-a * 4 * s * (1 - s) * r / 3)
    close(loss, exp_loss, rtol=1e-12)
    close(grad, [exp_grad], rtol=1e-10)
    close(m["clip_frac_low"], 0.0)
    close(m["clip_frac_high"], 0.0)


def test_sapo_gradient_weight_is_one_at_ratio_one():
    # On-policy, d(-loss)/d logp_t = A_t for both signs (so both temperatures); token sums, B = 1.
    adv = [[1.0, -1.0, 0.5, -2.0]]
    cfg = PolicyLossConfig(agg_mode="seq-mean-token-sum")
    _, _, grad = run_loss("sapo", [[1.0] * 4], adv, [[1, 1, 1, 1]], cfg)
    close(-grad, adv, rtol=1e-12)


@pytest.mark.parametrize("kind", algos.POLICY_LOSS_KINDS)
def test_masked_garbage_does_not_leak(kind):
    g = torch.Generator().manual_seed(2)
    ratios = (0.1 * torch.randn(3, 4, generator=g, dtype=f64)).exp()
    adv = torch.randn(3, 1, generator=g, dtype=f64).expand(3, 4)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]])
    results = [run_loss(kind, ratios, adv, mask, garbage=x) for x in (0.0, NAN, INF, -INF, 1e30)]
    loss0, m0, grad0 = results[0]
    assert torch.isfinite(grad0).all() and (grad0[mask == 0] == 0).all()
    for loss, m, grad in results[1:]:
        close(loss, loss0, rtol=0, atol=0)
        close(grad, grad0, rtol=0, atol=0)
        for k in m0:
            close(m[k], m0[k], rtol=0, atol=0)


def test_policy_loss_unknown_kind():
    with pytest.raises(ValueError):
        policy_loss(
            "reinforce",
            torch.zeros(1, 1),
            torch.zeros(1, 1),
            torch.zeros(1, 1),
            torch.ones(1, 1),
            PolicyLossConfig(),
        )


# ----------------------------------------------------------------------------- gradients vs finite
# differences


def finite_difference(f, x, eps=1e-6):
    grad = torch.zeros_like(x)
    for i in range(x.numel()):
        xp, xm = x.clone(), x.clone()
        xp.view(-1)[i] += eps
        xm.view(-1)[i] -= eps
        grad.view(-1)[i] = (f(xp) - f(xm)) / (2 * eps)
    return grad


@pytest.mark.parametrize("agg_mode", algos.AGG_MODES)
@pytest.mark.parametrize("kind", algos.POLICY_LOSS_KINDS)
def test_policy_loss_gradient_matches_finite_differences(kind, agg_mode):
    g = torch.Generator().manual_seed(3)
    B, T = 4, 5
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 1, 1, 0], [0, 0, 0, 0, 0]])
    valid = mask.bool()
    # token log-ratios on the scale of each kind's band, so some tokens / sequences are clipped
    scale = 5e-4 if kind.startswith("gspo") else 0.3
    old = torch.randn(B, T, generator=g, dtype=f64) - 2
    logp = old + scale * torch.randn(B, T, generator=g, dtype=f64)
    # a sequence-level advantage, broadcast
    adv = torch.randn(B, 1, generator=g, dtype=f64).expand(B, T)
    logp, old = torch.where(valid, logp, INF), torch.where(valid, old, NAN)
    adv = torch.where(valid, adv, NAN)
    # cispo's band narrowed to PPO's so that the data clips some weights
    cfg = PolicyLossConfig(agg_mode=agg_mode, agg_norm=7.0, cispo_clip_low=0.2, cispo_clip_high=0.2)

    def f(x):
        if kind == "cispo":
            # the paper's loss -sg(w) A log pi: its weight is a constant, held at the point's value
            w = (logp - old).exp().clamp(0.8, 1.2)
            return aggregate(-w * adv * x, mask, agg_mode, 7.0)
        return policy_loss(kind, x, old, adv, mask, cfg)[0]

    x = logp.clone().requires_grad_()
    loss, metrics = policy_loss(kind, x, old, adv, mask, cfg)
    (grad,) = torch.autograd.grad(loss, x)
    fd = finite_difference(f, logp)
    close(grad, fd, rtol=1e-6, atol=1e-8)
    assert grad.abs().sum() > 1e-3
    if kind != "sapo":  # the data must exercise both clipped and unclipped tokens
        clipped = metrics["clip_frac_low"] + metrics["clip_frac_high"]
        assert 0 < clipped < 1, (kind, clipped)


# ----------------------------------------------------------------------------- identities


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_grpo_without_clipping_is_reinforce(agg_mode):
    # On-policy with the clip disabled, grad of the PPO loss = grad of -A * logp (REINFORCE) with
    # GRPO's A.
    g = torch.Generator().manual_seed(4)
    B, T, G = 8, 6, 4
    rewards = torch.randint(0, 2, (B,), generator=g).to(f64)
    rewards[:G] = torch.tensor([1.0, 0.0, 0.0, 0.0])
    adv = group_advantages(rewards, G, "grpo")[:, None].expand(B, T)  # (B, T)
    mask = (torch.rand(B, T, generator=g) < 0.8).long()
    logp = (torch.randn(B, T, generator=g, dtype=f64) - 2).requires_grad_()
    cfg = PolicyLossConfig(clip_low=1e9, clip_high=1e9, agg_mode=agg_mode)
    loss, _ = policy_loss("ppo", logp, logp.detach(), adv, mask, cfg)
    (grad,) = torch.autograd.grad(loss, logp)
    (grad_reinforce,) = torch.autograd.grad(aggregate(-adv * logp, mask, agg_mode), logp)
    close(grad, grad_reinforce, rtol=1e-12, atol=1e-15)
    assert grad.abs().max() > 0.01


@pytest.mark.parametrize("kind", ["gspo", "gspo_token"])
def test_gspo_on_length_one_sequences_is_ppo(kind):
    # One valid token per row (at varying positions, garbage around it): s_i is that token's ratio.
    g = torch.Generator().manual_seed(5)
    B, T = 8, 3
    mask = torch.zeros(B, T, dtype=torch.long)
    mask[torch.arange(B), torch.arange(B) % T] = 1
    ratios = (0.3 * torch.randn(B, T, generator=g, dtype=f64)).exp()
    adv = torch.randn(B, T, generator=g, dtype=f64)
    cfg = PolicyLossConfig(gspo_clip_low=0.2, gspo_clip_high=0.2, agg_mode="seq-mean-token-mean")
    loss_ppo, m_ppo, grad_ppo = run_loss("ppo", ratios, adv, mask, cfg)
    loss, m, grad = run_loss(kind, ratios, adv, mask, cfg)
    close(loss, loss_ppo, rtol=1e-12)
    close(grad, grad_ppo, rtol=1e-12)
    for k in m_ppo:
        close(m[k], m_ppo[k], rtol=1e-12)
    assert 0 < m["clip_frac_low"] + m["clip_frac_high"] < 1


# ----------------------------------------------------------------------------- aggregation


def test_aggregate_modes():
    loss = torch.tensor([[1.0, 2.0, NAN], [INF, 5.0, 6.0], [3.0, 4.0, 5.0]], dtype=f64)
    # row 1 fully masked, still counts in B = 3
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 1]])
    close(aggregate(loss, mask, "token-mean"), (1 + 2 + 3 + 5) / 4, rtol=1e-12)
    close(aggregate(loss, mask, "seq-mean-token-sum"), (3 + 0 + 8) / 3, rtol=1e-12)
    close(aggregate(loss, mask, "seq-mean-token-mean"), (1.5 + 0 + 4) / 3, rtol=1e-12)
    close(aggregate(loss, mask, "seq-mean-token-sum-norm", norm=4), 11 / (3 * 4), rtol=1e-12)
    close(aggregate(loss, torch.zeros(3, 3), "token-mean"), 0.0)
    with pytest.raises(ValueError):
        aggregate(loss, mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError):
        aggregate(loss, mask, "sum")


# ----------------------------------------------------------------------------- KL, entropy, value
# loss


def test_kl_penalty_hand_computed():
    logp = torch.tensor([-1.0, 0.0, -100.0], dtype=f64)
    ref = torch.tensor([-2.0, -100.0, 0.0], dtype=f64)
    close(kl_penalty(logp, ref, "k1"), [1.0, 100.0, -100.0], rtol=1e-12)
    close(kl_penalty(logp, ref, "k2"), [0.5, 5000.0, 5000.0], rtol=1e-12)
    # k3, log rho = ref - logp = -1: e^-1 - 1 + 1 = e^-1; -100 clamps to -20: e^-20 + 19 -> 10
    # (clamp); +100 clamps to 20: e^20 - 21 -> 10 (clamp)
    close(kl_penalty(logp, ref, "k3"), [math.exp(-1), 10.0, 10.0], rtol=1e-12)
    with pytest.raises(ValueError):
        kl_penalty(logp, ref, "k4")


def test_k1_and_k3_are_unbiased():
    # Tokens sampled from pi: E[k1] = E[k3] = KL(pi || ref) exactly; check to 5 standard errors.
    g = torch.Generator().manual_seed(6)
    log_pi = torch.log_softmax(torch.tensor([1.0, 0.5, -0.5, -1.0, 0.0], dtype=f64), -1)
    log_ref = torch.log_softmax(torch.tensor([0.0, 1.0, 0.0, -2.0, 0.5], dtype=f64), -1)
    kl = (log_pi.exp() * (log_pi - log_ref)).sum()
    x = torch.multinomial(log_pi.exp(), 200_000, replacement=True, generator=g)
    for kind in ("k1", "k3"):
        k = kl_penalty(log_pi[x], log_ref[x], kind)
        assert abs(k.mean() - kl) < 5 * k.std() / math.sqrt(len(x)), kind


def test_value_loss_hand_computed():
    # clip 0.2, V_clip = V_old + clip(V - V_old, -0.2, 0.2)
    # tok0: V 1.5 old 1 R 2:   (V-R)^2 = 0.25, V_clip 1.2 -> 0.64 -> 0.32, clipped term wins (no
    # grad)
    # tok1: V 1.1 old 1 R 2:   both 0.81 -> 0.405, not clipped, grad (V - R) / 4 = -0.225
    # tok2: V 1.5 old 1 R 1.4: 0.01 vs 0.04 -> 0.02, clipped (no grad)
    # tok3: V 1.5 old 1 R 0:   2.25 vs 1.44 -> 1.125, not clipped, grad 1.5 / 4 = 0.375
    values = torch.tensor([[1.5, 1.1, 1.5, 1.5, NAN]], dtype=f64, requires_grad=True)
    old = torch.tensor([[1.0, 1.0, 1.0, 1.0, INF]], dtype=f64)
    returns = torch.tensor([[2.0, 2.0, 1.4, 0.0, NAN]], dtype=f64)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, m = value_loss(values, old, returns, mask, clip=0.2)
    (grad,) = torch.autograd.grad(loss, values)
    close(loss, (0.32 + 0.405 + 0.02 + 1.125) / 4, rtol=1e-12)
    close(grad, [[0, -0.225, 0, 0.375, 0]], rtol=1e-12)
    close(m["vf_clip_frac"], 0.5)


# ----------------------------------------------------------------------------- DAPO extras


def test_dynamic_sampling_mask():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.25])
    keep = dynamic_sampling_mask(rewards, 3)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [False] * 3 + [True] * 3 + [False] * 3 + [True] * 3
    with pytest.raises(ValueError):
        dynamic_sampling_mask(rewards, 5)


def test_overlong_penalty():
    # L_max 100, L_cache 20: free up to 80, then a ramp (80 - |y|) / 20 down to -1 at 100, -1 beyond
    lengths = torch.tensor([50, 80, 81, 90, 100, 120])
    close(overlong_penalty(lengths, 100, 20), [0, 0, -0.05, -0.5, -1, -1], rtol=1e-6)
    assert overlong_penalty(lengths, 100, 20).is_floating_point()
    with pytest.raises(ValueError):
        overlong_penalty(lengths, 100, 0)


def test_truncation_treatment_hand_computed():
    rewards, cut = torch.tensor([1.0, 0.5, 0.0]), torch.tensor([False, True, True])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0], [1, 1, 1]], dtype=torch.float)
    r, m = algos.truncation_treatment(rewards, mask, cut, "keep")
    assert r is rewards and m is mask
    r, m = algos.truncation_treatment(rewards, mask, cut, "mask")
    assert torch.equal(r, rewards) and torch.equal(
        m, torch.tensor([[0, 1, 1], [0, 0, 0], [0, 0, 0]]).float()
    )
    r, m = algos.truncation_treatment(rewards, mask, cut, "penalize", penalty=0.25)
    assert torch.equal(r, torch.tensor([1.0, 0.25, -0.25])) and m is mask
    # inputs untouched
    assert torch.equal(rewards, torch.tensor([1.0, 0.5, 0.0])) and mask[1, 1] == 1
    with pytest.raises(ValueError, match="unknown truncation"):
        algos.truncation_treatment(rewards, mask, cut, "drop")


# ----------------------------------------------------------------------------- truncated importance
# sampling


def test_token_tis_weights_hand_computed():
    old = torch.tensor([[math.log(0.5), math.log(0.2), math.log(0.9), NAN]], dtype=f64)
    # the engine's
    mu = torch.tensor([[math.log(0.5), math.log(0.4), math.log(0.1), INF]], dtype=f64)
    mask = torch.tensor([[1.0, 1, 1, 0]])
    w, m = off_policy_weights(
        old, mu, mask, OffPolicyConfig(kind="tis", level="token", tis_cap=2.0)
    )
    close(w, [[1.0, 0.5, 2.0, 0.0]])  # 0.9/0.1 = 9 truncated to the cap; garbage masked out
    close(m["offpolicy_weight_mean"], 3.5 / 3)
    close(m["offpolicy_clip_frac"], 1 / 3)
    r = torch.tensor([1.0, 0.5, 9.0], dtype=f64)  # k3 of KL(mu || pi_old): mean of (r - 1) - log r
    close(m["mismatch_kl_k3"], ((r - 1) - r.log()).mean())
    assert not w.requires_grad


def test_policy_loss_weights_scale_each_tokens_loss():
    g = torch.Generator().manual_seed(1)
    logp = torch.randn(3, 5, generator=g, dtype=f64, requires_grad=True)
    old, adv = (
        logp.detach() + 0.1 * torch.randn(3, 5, generator=g, dtype=f64),
        torch.randn(3, 5, generator=g, dtype=f64),
    )
    mask = torch.ones(3, 5)
    cfg = PolicyLossConfig(agg_mode="token-mean")
    plain, _ = policy_loss("ppo", logp, old, adv, mask, cfg)
    ones, _ = policy_loss("ppo", logp, old, adv, mask, cfg, weights=torch.ones(3, 5, dtype=f64))
    close(ones, plain)
    w = torch.zeros(3, 5, dtype=f64)
    w[1, 2] = 3.0  # only one token counts, three times over
    weighted, _ = policy_loss("ppo", logp, old, adv, mask, cfg, weights=w)
    # each token's own loss gradient (token-mean over 15)
    per_token = torch.autograd.grad(plain * 15, logp)[0]
    grad = torch.autograd.grad(weighted * 15, logp)[0]
    close(grad[1, 2], 3 * per_token[1, 2])
    assert grad.abs().sum() == grad[1, 2].abs()


# ----------------------------------------------------------------------------- later families:
# their imports, their inputs left alone


def test_new_functions_do_not_mutate_inputs():
    g = torch.Generator().manual_seed(10)
    B, T, K, V = 4, 5, 3, 7
    a, b, c = (torch.randn(B, T, generator=g, dtype=f64) for _ in range(3))
    a[1, 4] = NAN
    mask = torch.ones(B, T)
    mask[1, 3:] = 0
    rewards = torch.randn(B, generator=g, dtype=f64)
    turn_r = torch.randn(B, K, generator=g, dtype=f64)
    turn_m = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
    keys = torch.randint(0, 3, (B, K), generator=g)
    turn_index = torch.tensor([[-1, 0, 0, 1, 2]] * B)
    logits = torch.randn(B, V, generator=g, dtype=f64)
    tokens = torch.zeros(B, dtype=torch.long)
    inputs = [a, b, c, mask, rewards, turn_r, turn_m, keys, turn_index, logits, tokens]
    copies = [x.clone() for x in inputs]
    reinforce_pp_advantages(rewards, b, mask, kl_coef=0.1, group_size=2)
    distillation_advantages(a, b, mask, task_advantages=c)
    for baseline in algos.TURN_BASELINES:
        turn_advantages(turn_r, turn_m, 2, 0.9, baseline, keys)
    broadcast_turns(turn_r, turn_index)
    for kind in algos.OFF_POLICY_KINDS:
        for level in algos.OFF_POLICY_LEVELS:
            off_policy_weights(a, b, mask, OffPolicyConfig(kind=kind, level=level))
    kept = truncation_mask(logits, 0.8, 3, 0.9)
    kept_mask_from_size(logits, kept.sum(-1), tokens)
    truncated_logprobs(logits, tokens, kept | torch.nn.functional.one_hot(tokens, V).bool(), 0.8)
    for x, x0 in zip(inputs, copies):
        torch.testing.assert_close(x, x0, rtol=0, atol=0, equal_nan=True)


# ----------------------------------------------------------------------------- CISPO, GMPO


def test_cispo_hand_computed_keeps_every_tokens_gradient():
    # Default band: floor 1 - 1 = 0 (none), ceiling 1 + 4 = 5. w = sg(clip(r)); loss -w A log r;
    # grad -w A / N. r = 1.5, A=+1: w 1.5 (PPO would clip it: no gradient)   r = 0.5, A=+1: w 0.5
    # r = 6.0, A=-1: w 5 (capped, the gradient still flows)    r = 0.8, A=-1: w 0.8
    ratios, advs = [1.5, 0.5, 6.0, 0.8], [1.0, 1.0, -1.0, -1.0]
    loss, m, grad = run_loss("cispo", [ratios + [1.0]], [advs + [0.0]], [[1, 1, 1, 1, 0]])
    w = [1.5, 0.5, 5.0, 0.8]
    close(loss, sum(-wi * a * math.log(r) for wi, a, r in zip(w, advs, ratios)) / 4, rtol=1e-12)
    close(grad, [[-1.5 / 4, -0.5 / 4, 5.0 / 4, 0.8 / 4, 0.0]], rtol=1e-12)
    close(m["clip_frac_high"], 0.25)
    close(m["clip_frac_low"], 0.0)
    _, _, grad_ppo = run_loss("ppo", [ratios + [1.0]], [advs + [0.0]], [[1, 1, 1, 1, 0]])
    assert grad_ppo[0, 0] == 0 and grad[0, 0] != 0  # the token PPO drops, CISPO trains


def test_cispo_keeps_the_gradient_of_tokens_beyond_the_overflow_guard():
    # The guard clamps log r to +-20 only inside exp: a token however far off-policy keeps CISPO's
    # -sg(w) A. One token, A = 1, old_logp = -21.5, logp = -0.5 (log r = 21): w = min(e^20, 1 + 4) =
    # 5, gradient -5.
    logp = torch.tensor([[-0.5]], dtype=f64, requires_grad=True)
    old, adv, mask = (
        torch.tensor([[-21.5]], dtype=f64),
        torch.ones(1, 1, dtype=f64),
        torch.ones(1, 1),
    )
    (grad,) = torch.autograd.grad(
        policy_loss("cispo", logp, old, adv, mask, PolicyLossConfig())[0], logp
    )
    close(grad, [[-5.0]], rtol=1e-12)
    for lr in (19.9, 21.0, 100.0):  # below and above the guard: the same gradient
        loss, m, grad = run_loss("cispo", [[math.exp(min(lr, 700.0))]], [[1.0]], [[1]])
        close(grad, [[-5.0]], rtol=1e-12)
    # bounds (0.2, 0.28), log r = -21: w = max(e^-20, 0.8) = 0.8, gradient -0.8
    cfg = PolicyLossConfig(cispo_clip_low=0.2, cispo_clip_high=0.28)
    logp = torch.tensor([[-21.5]], dtype=f64, requires_grad=True)
    loss, m = policy_loss("cispo", logp, torch.tensor([[-0.5]], dtype=f64), adv, mask, cfg)
    (grad,) = torch.autograd.grad(loss, logp)
    close(grad, [[-0.8]], rtol=1e-12)
    close(loss, 0.8 * 21.0, rtol=1e-12)  # -w A log r, with log r itself unclamped
    # the ratio is the guarded one (no overflow, no underflow)
    close(m["ratio_max"], math.exp(-20.0), rtol=1e-12)


def test_gmpo_far_off_token_keeps_its_share_of_the_gradient():
    # A = 1, log r = [-25, 0, 0, 0] (token-mean over one row): only the ceiling binds for A >= 0, so
    # c = log r; the sequence ratio is s = exp(-25 / 4) (the guard clamps the mean, -6.25, not the
    # token) and every token's gradient is -A s / 4, the far-off one's included (before the fix it
    # had none: its log r was cut at -20).
    cfg = PolicyLossConfig(agg_mode="seq-mean-token-mean")
    lr = torch.tensor([[-25.0, 0.0, 0.0, 0.0]], dtype=f64)
    loss, m, grad = run_loss("gmpo", lr.exp(), [[1.0] * 4], [[1, 1, 1, 1]], cfg)
    s = math.exp(-25 / 4)
    close(loss, -s, rtol=1e-12)
    close(grad, [[-s / 4] * 4], rtol=1e-12)
    # a whole sequence beyond the guard: the ratio stays finite (e^20), and its gradient is the
    # guard's 0
    loss, m, grad = run_loss("gmpo", [[math.exp(30.0)] * 2], [[-1.0] * 2], [[1, 1]], cfg)
    close(loss, math.exp(20.0), rtol=1e-12)
    assert torch.isfinite(loss) and (grad == 0).all()


def test_cispo_on_policy_is_reinforce():
    # r = 1 everywhere: w = 1, so grad = grad of -A log pi, for any band
    g = torch.Generator().manual_seed(11)
    adv = torch.randn(3, 4, generator=g, dtype=f64)
    cfg = PolicyLossConfig(agg_mode="seq-mean-token-sum", cispo_clip_low=0.1, cispo_clip_high=0.1)
    loss, m, grad = run_loss("cispo", torch.ones(3, 4), adv, torch.ones(3, 4), cfg)
    close(loss, 0.0, atol=1e-15)
    close(grad, -adv / 3, rtol=1e-12)


def test_gmpo_hand_computed():
    # gmpo band +-0.4 in log space, seq-mean-token-mean over B = 2 rows.
    # row 0, A=+1, log r = [0.5, -0.1, 0.2]: the ceiling binds on token 0 -> c = [0.4, -0.1, 0.2],
    #   s0 = exp(0.5 / 3), loss -s0; tokens 1, 2 get d/dlogp = -s0 / 3 (token 0: 0); / B
    # row 1, A=-1, log r = [-0.6, 0.5]: the floor binds on token 0 -> c = [-0.4, 0.5],
    #   s1 = exp(0.1 / 2), loss +s1; token 1 gets +s1 / 2 (token 0: 0); / B
    lr = torch.tensor([[0.5, -0.1, 0.2], [-0.6, 0.5, 0.0]], dtype=f64)
    adv = [[1.0] * 3, [-1.0] * 3]
    cfg = PolicyLossConfig(agg_mode="seq-mean-token-mean")
    loss, m, grad = run_loss("gmpo", lr.exp(), adv, [[1, 1, 1], [1, 1, 0]], cfg)
    s0, s1 = math.exp(0.5 / 3), math.exp(0.1 / 2)
    close(loss, (-s0 + s1) / 2, rtol=1e-12)
    close(grad, [[0.0, -s0 / 6, -s0 / 6], [0.0, s1 / 4, 0.0]], rtol=1e-12)
    # per-sequence metrics: row 0 clips 1/3 of its tokens high, row 1 half of its tokens low
    close(m["clip_frac_high"], (1 / 3 + 0) / 2)
    close(m["clip_frac_low"], (0 + 1 / 2) / 2)
    # unclipped geometric means
    close(m["ratio_mean"], (math.exp(0.6 / 3) + math.exp(-0.1 / 2)) / 2, rtol=1e-12)


def test_gmpo_on_length_one_sequences_is_ppo():
    # One token: -A exp(c) = -A min(r, e^hi) (A > 0) or -A max(r, e^-lo) (A < 0): PPO with 1 +
    # eps_high = e^hi and 1 - eps_low = e^-lo.
    g = torch.Generator().manual_seed(12)
    B, T = 10, 3
    mask = torch.zeros(B, T, dtype=torch.long)
    mask[torch.arange(B), torch.arange(B) % T] = 1
    ratios = (0.3 * torch.randn(B, T, generator=g, dtype=f64)).exp()
    adv = torch.randn(B, T, generator=g, dtype=f64)
    cfg = PolicyLossConfig(
        clip_low=1 - math.exp(-0.25),
        clip_high=math.exp(0.2) - 1,
        gmpo_clip_low=0.25,
        gmpo_clip_high=0.2,
        agg_mode="seq-mean-token-mean",
    )
    loss_ppo, m_ppo, grad_ppo = run_loss("ppo", ratios, adv, mask, cfg)
    loss, m, grad = run_loss("gmpo", ratios, adv, mask, cfg)
    close(loss, loss_ppo, rtol=1e-12)
    close(grad, grad_ppo, rtol=1e-12, atol=1e-15)
    for k in m_ppo:
        close(m[k], m_ppo[k], rtol=1e-12)
    assert 0 < m["clip_frac_low"] + m["clip_frac_high"] < 1


# ----------------------------------------------------------------------------- REINFORCE++,
# distillation


def test_reinforce_pp_hand_computed():
    # rewards [1, 0]; kl_coef 0.5; gamma 1. Token rewards: row 0 [-0.05, -0.1, 1 - 0.15], row 1 [0,
    # -0.25] returns (sums to the end): row 0 [0.70, 0.75, 0.85], row 1 [-0.25, -0.25]
    # mean 1.8 / 5 = 0.36; deviations .34 .39 .49 -.61 -.61; unbiased var 1.252 / 4 = 0.313
    rewards = torch.tensor([1.0, 0.0], dtype=f64)
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.0, 0.5, NAN]], dtype=f64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = reinforce_pp_advantages(rewards, kl, mask, kl_coef=0.5)
    s = math.sqrt(0.313 + 1e-8)
    close(adv, [[0.34 / s, 0.39 / s, 0.49 / s], [-0.61 / s, -0.61 / s, 0.0]], rtol=1e-10)


def test_reinforce_pp_baseline_and_discount():
    # -baseline: rewards [1, 0 | 0.5, 0.5], G = 2 -> [0.5, -0.5 | 0, 0], no KL, gamma 1: every token
    # of a row carries its centred reward; 2 tokens each: values [.5 .5 -.5 -.5 0 0 0 0], mean 0,
    # var 1 / 7
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5], dtype=f64)
    adv = reinforce_pp_advantages(rewards, None, torch.ones(4, 2), group_size=2)
    a = 0.5 / math.sqrt(1 / 7 + 1e-8)
    close(adv, [[a, a], [-a, -a], [0, 0], [0, 0]], rtol=1e-10)
    # gamma 0.5 with a hole (a tool response) in row 0: the hole neither discounts nor earns
    # row 0 [1 0 1] returns [0.5, -, 1]; row 1 [1 1 1] returns [0.25, 0.5, 1]: reward 1 each
    mask = torch.tensor([[1, 0, 1], [1, 1, 1]])
    adv = reinforce_pp_advantages(torch.ones(2, dtype=f64), None, mask, gamma=0.5)
    x = torch.tensor([0.5, 1.0, 0.25, 0.5, 1.0], dtype=f64)
    z = (x - x.mean()) / math.sqrt(x.var().item() + 1e-8)
    close(adv, [[z[0], 0.0, z[1]], [z[2], z[3], z[4]]], rtol=1e-10)
    with pytest.raises(ValueError):
        reinforce_pp_advantages(torch.ones(2, 1), None, mask)


def test_distillation_advantages_hand_computed():
    student = torch.tensor([[-1.0, -2.0, NAN]], dtype=f64)
    teacher = torch.tensor([[-1.5, -1.0, INF]], dtype=f64)
    mask = torch.tensor([[1, 1, 0]])
    adv, m = distillation_advantages(student, teacher, mask, coef=2.0)
    close(adv, [[-1.0, 2.0, 0.0]], rtol=1e-12)  # 2 * (teacher - student)
    close(m["distill_reverse_kl"], (0.5 - 1.0) / 2, rtol=1e-12)  # mean of student - teacher
    adv, _ = distillation_advantages(
        student, teacher, mask, torch.tensor([[0.3, 0.3, NAN]], dtype=f64), coef=2.0
    )
    close(adv, [[-0.7, 2.3, 0.0]], rtol=1e-12)


def test_distillation_policy_gradient_is_minus_the_reverse_kl_gradient():
    # Exact expectation over a categorical student: sum_y p(y) A(y) grad log p(y) with A = log q -
    # log p equals -grad KL(p || q) (the "-1" of grad KL vanishes since E[grad log p] = 0).
    g = torch.Generator().manual_seed(13)
    theta = torch.randn(9, generator=g, dtype=f64, requires_grad=True)
    log_q = torch.log_softmax(torch.randn(9, generator=g, dtype=f64), -1)
    log_p = torch.log_softmax(theta, -1)
    adv, _ = distillation_advantages(log_p.detach()[None], log_q[None], torch.ones(1, 9))
    # policy-gradient loss, exact expectation
    surrogate = -(log_p.exp().detach() * adv[0] * log_p).sum()
    (grad_pg,) = torch.autograd.grad(surrogate, theta, retain_graph=True)
    (grad_kl,) = torch.autograd.grad((log_p.exp() * (log_p - log_q)).sum(), theta)
    close(grad_pg, grad_kl, rtol=1e-10, atol=1e-14)
    assert grad_kl.abs().max() > 1e-2


# ----------------------------------------------------------------------------- turn-level credit
# assignment


def test_turn_advantages_hand_computed():
    # G = 2, K = 3, gamma 0.5. Episode 0 rewards [1, 0, 2], episode 1 [0, 1] (2 turns).
    # returns: ep 0 [1 + 0.5 (0 + 0.5 * 2) = 1.5, 1, 2], ep 1 [0 + 0.5 * 1 = 0.5, 1]
    rewards = torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, NAN]], dtype=f64)
    turn_mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # position (leave-one-out): ep 0 [1.5 - 0.5, 1 - 1, 2 - 0 (no other episode has a 3rd turn)]
    #                           ep 1 [0.5 - 1.5, 1 - 1]
    adv = turn_advantages(rewards, turn_mask, 2, gamma=0.5, baseline="position")
    close(adv, [[1.0, 0.0, 2.0], [-1.0, 0.0, 0.0]], rtol=1e-12)
    # state keys ep 0 [5, 7, 9], ep 1 [5, 9]: ep 0 turn 1 (key 7) has no match -> position baseline
    # (1); ep 0 turn 2 (key 9) matches ep 1 turn 1 (R = 1); ep 1 turn 1 (key 9) matches ep 0 turn 2
    # (R = 2)
    keys = torch.tensor([[5, 7, 9], [5, 9, -1]])
    adv = turn_advantages(rewards, turn_mask, 2, gamma=0.5, baseline="state", state_keys=keys)
    close(adv, [[1.0, 0.0, 1.0], [-1.0, -1.0, 0.0]], rtol=1e-12)
    # ep 0 visits key 5 twice: its own turn 0 is never in its turn-1 baseline (that return depends
    # on turn 1's action) ep 0 turn 1: b = R_{1,0} = 0.5 -> 0.5;  ep 1 turn 0: b = mean(1.5, 1) =
    # 1.25 -> -0.75
    keys = torch.tensor([[5, 5, 9], [5, 9, -1]])
    adv = turn_advantages(rewards, turn_mask, 2, gamma=0.5, baseline="state", state_keys=keys)
    close(adv, [[1.0, 0.5, 1.0], [-0.75, -1.0, 0.0]], rtol=1e-12)


def test_broadcast_turns_and_errors():
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=f64)
    turn_index = torch.tensor([[-1, 0, 0, -1, 1, 1], [-1, -1, 0, 1, -1, -1]])
    close(broadcast_turns(values, turn_index), [[0, 1, 1, 0, 2, 2], [0, 0, 3, 4, 0, 0]], rtol=0)
    with pytest.raises(ValueError):
        broadcast_turns(values, torch.tensor([[2, 0], [0, 0]]))
    r, m = torch.zeros(4, 2), torch.ones(4, 2)
    with pytest.raises(ValueError):
        turn_advantages(r, m, 3)  # 4 episodes are not groups of 3
    with pytest.raises(ValueError):
        turn_advantages(r, m, 2, baseline="state")  # no state keys
    with pytest.raises(ValueError):
        turn_advantages(r, m, 2, baseline="episode")


# A two-turn bandit where the policy decides whether to take a second turn (verl RFC #7244's
# setting). Turn 0, state 0: action 0 answers now (reward 1, the episode ends); action 1 calls a
# tool (reward 0.3, an intermediate reward) and the tool's result is good (state 1) with probability
# 0.6, else bad (state 2). Turn 1: in the good state action 0 earns 2 (action 1: 0); in the bad
# state action 1 earns 0.5 (action 0: 0). softmax policy logits per state
THETA = torch.tensor([[0.2, -0.1], [0.5, 0.0], [-0.3, 0.4]], dtype=f64)
P_GOOD, R_ANSWER, R_TOOL = 0.6, 1.0, 0.3
R_TURN1 = torch.tensor([[2.0, 0.0], [0.0, 0.5]], dtype=f64)  # [good, bad] x action


def bandit_values(theta, gamma):
    """Exact Q and V by enumeration: (J, Q (3, 2), V (3,)), differentiable in theta."""
    pi = torch.softmax(theta, -1)
    v_good, v_bad = (pi[1] * R_TURN1[0]).sum(), (pi[2] * R_TURN1[1]).sum()
    q0 = torch.stack(
        [
            torch.tensor(R_ANSWER, dtype=f64),
            R_TOOL + gamma * (P_GOOD * v_good + (1 - P_GOOD) * v_bad),
        ]
    )
    Q = torch.stack([q0, R_TURN1[0], R_TURN1[1]])
    V = (pi * Q).sum(-1)
    return V[0], Q, V


def sample_bandit(n_groups, G, seed):
    g = torch.Generator().manual_seed(seed)
    B = n_groups * G
    pi = torch.softmax(THETA, -1)
    a0 = (torch.rand(B, generator=g, dtype=f64) < pi[0, 1]).long()
    s1 = torch.where(torch.rand(B, generator=g, dtype=f64) < P_GOOD, 1, 2)
    a1 = (torch.rand(B, generator=g, dtype=f64) < pi[s1, 1]).long()
    go_on = a0 == 1
    rewards = torch.stack(
        [torch.where(go_on, R_TOOL, R_ANSWER), torch.where(go_on, R_TURN1[s1 - 1, a1], 0.0)], 1
    )
    turn_mask = torch.stack([torch.ones(B, dtype=torch.bool), go_on], 1)  # (B, 2)
    states = torch.stack([torch.zeros(B, dtype=torch.long), s1], 1)  # (B, 2)
    actions = torch.stack([a0, a1], 1)  # (B, 2)
    return rewards, turn_mask, states, actions


def group_gradients(adv, turn_mask, states, actions, G):
    """Per group, the mean over its episodes of sum_k A_k grad_theta log pi(a_k | s_k): (n_groups,
    6)."""
    pi = torch.softmax(THETA, -1)
    # (B, 2, 2) d log pi / d theta[s]
    score = torch.nn.functional.one_hot(actions, 2).to(f64) - pi[states]
    contrib = torch.where(turn_mask, adv, 0.0)[..., None] * score  # (B, 2, 2)
    # (B, 3, 2)
    grad = torch.einsum("bks,bka->bsa", torch.nn.functional.one_hot(states, 3).to(f64), contrib)
    return grad.reshape(-1, G, 6).mean(1)


def mean_and_se(per_group):
    return per_group.mean(0), per_group.std(0) / math.sqrt(per_group.shape[0])


def naive_per_turn_normalised(rewards, turn_mask, G):
    """MT-GRPO-style: centre each turn's reward on its turn index's group mean, then sum over the
    turns the episode went on to take (gamma 1). The baseline's number of terms follows the
    episode's own stopping turn."""
    K = rewards.shape[1]
    r, m = rewards.reshape(-1, G, K), turn_mask.reshape(-1, G, K).to(f64)
    mean = (r * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)
    centred = (r - mean) * m
    return (centred.flip(-1).cumsum(-1).flip(-1) * m).reshape(-1, K)


def naive_mean_with_self(rewards, turn_mask, G):
    """Returns-to-go minus the group mean at the same turn index, the sample's own return included
    (GRPO's mean)."""
    K = rewards.shape[1]
    m = turn_mask.to(f64)
    R = (rewards * m).flip(-1).cumsum(-1).flip(-1).reshape(-1, G, K)
    mg = m.reshape(-1, G, K)
    mean = (R * mg).sum(1, keepdim=True) / mg.sum(1, keepdim=True).clamp(min=1)
    return ((R - mean) * mg).reshape(-1, K)


@pytest.mark.parametrize("baseline", algos.TURN_BASELINES)
def test_turn_advantages_give_an_unbiased_policy_gradient(baseline):
    # Monte Carlo E[sum_k A_k grad log pi(a_k | s_k)] vs the exact grad J by enumeration, to 4
    # standard errors (groups are independent; episodes within a group are not, so the error is
    # taken over groups).
    G, n_groups = 4, 40_000
    theta = THETA.clone().requires_grad_()
    (exact,) = torch.autograd.grad(bandit_values(theta, 1.0)[0], theta)
    rewards, turn_mask, states, actions = sample_bandit(n_groups, G, seed=16)
    adv = turn_advantages(rewards, turn_mask, G, gamma=1.0, baseline=baseline, state_keys=states)
    est, se = mean_and_se(group_gradients(adv, turn_mask, states, actions, G))
    assert (se < 0.01).all()
    assert ((est - exact.reshape(6)).abs() < 4 * se).all(), (est, exact.reshape(6), se)


@pytest.mark.parametrize("naive", [naive_per_turn_normalised, naive_mean_with_self])
def test_naive_turn_baselines_are_measurably_biased(naive):
    G, n_groups = 4, 40_000
    theta = THETA.clone().requires_grad_()
    (exact,) = torch.autograd.grad(bandit_values(theta, 1.0)[0], theta)
    rewards, turn_mask, states, actions = sample_bandit(n_groups, G, seed=16)
    est, se = mean_and_se(
        group_gradients(naive(rewards, turn_mask, G), turn_mask, states, actions, G)
    )
    z = (est - exact.reshape(6)).abs() / se
    assert z.max() > 10, z
    # the same samples through turn_advantages stay within noise (the comparison is on equal
    # footing)
    adv = turn_advantages(rewards, turn_mask, G, gamma=1.0)
    est, se = mean_and_se(group_gradients(adv, turn_mask, states, actions, G))
    assert ((est - exact.reshape(6)).abs() < 4 * se).all()


def test_turn_advantage_given_the_action_matches_the_closed_form():
    # E[A | s, a] over turns that have a match: Q(s, a) - V(s) for the state baseline (the true
    # advantage), and Q(s, a) - (mean value of the states seen at that turn index) for the position
    # baseline. gamma = 0.9.
    G, n_groups, gamma = 4, 40_000, 0.9
    _, Q, V = bandit_values(THETA, gamma)
    v_turn1 = P_GOOD * V[1] + (1 - P_GOOD) * V[2]
    rewards, turn_mask, states, actions = sample_bandit(n_groups, G, seed=17)
    # which turns have a match in another episode of the group (brute force over the group)
    st, tm = states.reshape(-1, G, 2), turn_mask.reshape(-1, G, 2)
    other = ~torch.eye(G, dtype=torch.bool)
    same_state = (
        (st[:, :, None, :] == st[:, None, :, :]) & tm[:, None, :, :] & other[None, :, :, None]
    )
    has_state = same_state.any(2).reshape(-1, 2)  # (B, 2)
    has_position = (tm[:, None, :, :] & other[None, :, :, None]).any(2).reshape(-1, 2)
    for baseline, has_match, target in (
        ("state", has_state, Q - V[:, None]),
        ("position", has_position, Q - torch.stack([V[0], v_turn1, v_turn1])[:, None]),
    ):
        adv = turn_advantages(
            rewards, turn_mask, G, gamma=gamma, baseline=baseline, state_keys=states
        )
        for s in range(3):
            for a in range(2):
                cell = turn_mask & has_match & (states == s) & (actions == a)  # (B, 2)
                S = torch.where(cell, adv, 0.0).reshape(-1, G * 2).sum(1)  # per group: sum, count
                C = cell.reshape(-1, G * 2).sum(1).to(f64)
                mean = S.sum() / C.sum()
                # ratio estimator (delta)
                se = ((S - mean * C).std() / C.mean()) / math.sqrt(n_groups)
                assert C.sum() > 1000 and abs(mean - target[s, a]) < 4 * se, (
                    baseline,
                    s,
                    a,
                    mean,
                    target[s, a],
                    se,
                )
    # and the two targets differ where the states at turn 1 differ in value, so the test tells them
    # apart
    assert (V[1] - v_turn1).abs() > 0.2


# ----------------------------------------------------------------------------- off-policy
# corrections


def off_policy_case():
    # rho = pi_old / mu: row 0 [1, 0.6, 9], row 1 [1.1, 1.2], row 2 empty; masked entries are
    # garbage
    rho = torch.tensor([[1.0, 0.6, 9.0], [1.1, 1.2, 1.0], [1.0, 1.0, 1.0]], dtype=f64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    mu = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.1, INF], [NAN, INF, -INF]], dtype=f64)
    old = torch.where(mask.bool(), mu + rho.log(), NAN)
    return old, mu, mask, rho


@pytest.mark.parametrize(
    "kind,level,cfg_kw,expected,clip,tok_masked,seq_masked",
    [
        ("none", "token", {}, [[1, 1, 1], [1, 1, 0]], 0, 0, 0),
        ("tis", "token", {"tis_cap": 2.0}, [[1, 0.6, 2], [1.1, 1.2, 0]], 1 / 5, 0, 0),
        # sequence products 5.4 -> 2 (capped) and 1.32
        ("tis", "sequence", {"tis_cap": 2.0}, [[2, 2, 2], [1.32, 1.32, 0]], 3 / 5, 0, 0),
        # 9 leaves [0.5, 2]: dropped; the rest keep their ratio
        (
            "mis",
            "token",
            {"mis_low": 0.5, "mis_high": 2.0},
            [[1, 0.6, 0], [1.1, 1.2, 0]],
            0,
            1 / 5,
            1 / 2,
        ),
        # geometric means 5.4^(1/3) = 1.754 (outside [0.5, 1.5]: row dropped) and 1.32^(1/2) = 1.149
        # (kept, its weight)
        (
            "mis",
            "sequence",
            {"mis_low": 0.5, "mis_high": 1.5},
            [[0, 0, 0], [1.32**0.5, 1.32**0.5, 0]],
            0,
            3 / 5,
            1 / 2,
        ),
    ],
)
def test_off_policy_weights_hand_computed(
    kind, level, cfg_kw, expected, clip, tok_masked, seq_masked
):
    old, mu, mask, rho = off_policy_case()
    w, m = off_policy_weights(old, mu, mask, OffPolicyConfig(kind=kind, level=level, **cfg_kw))
    close(w, expected + [[0, 0, 0]], rtol=1e-12)
    close(m["offpolicy_weight_mean"], sum(map(sum, expected)) / 5, rtol=1e-12)
    close(m["offpolicy_clip_frac"], clip)
    close(m["offpolicy_token_masked_frac"], tok_masked)
    close(m["offpolicy_seq_masked_frac"], seq_masked)
    r = torch.tensor([1.0, 0.6, 9.0, 1.1, 1.2], dtype=f64)
    close(m["mismatch_kl_k1"], (-r.log()).mean(), rtol=1e-12)
    close(m["mismatch_kl_k3"], (r - 1 - r.log()).mean(), rtol=1e-12)
    assert not w.requires_grad and all(v.dim() == 0 for v in m.values())


def test_mismatch_kl_estimates_are_unbiased():
    # Tokens drawn from mu: E[k1] = E[k3] = KL(mu || pi_old) exactly; check to 5 standard errors.
    g = torch.Generator().manual_seed(15)
    log_mu = torch.log_softmax(torch.tensor([1.0, 0.2, -0.5, 0.0, -1.0], dtype=f64), -1)
    log_old = torch.log_softmax(torch.tensor([0.7, 0.5, -0.2, 0.1, -1.5], dtype=f64), -1)
    kl = (log_mu.exp() * (log_mu - log_old)).sum()
    x = torch.multinomial(log_mu.exp(), 100_000, replacement=True, generator=g)
    _, m = off_policy_weights(
        log_old[x][None], log_mu[x][None], torch.ones(1, len(x)), OffPolicyConfig(kind="none")
    )
    log_rho = log_old[x] - log_mu[x]
    for key, per_sample in (
        ("mismatch_kl_k1", -log_rho),
        ("mismatch_kl_k3", log_rho.exp() - 1 - log_rho),
    ):
        se = per_sample.std() / math.sqrt(len(x))
        assert abs(m[key] - kl) < 5 * se, (key, m[key], kl, se)


def test_off_policy_garbage_and_errors():
    old, mu, mask, _ = off_policy_case()
    for kind in algos.OFF_POLICY_KINDS:
        for level in algos.OFF_POLICY_LEVELS:
            w, m = off_policy_weights(old, mu, mask, OffPolicyConfig(kind=kind, level=level))
            assert torch.isfinite(w).all() and (w[mask == 0] == 0).all()
            assert all(torch.isfinite(v) for v in m.values())
    for bad in (
        dict(kind="is"),
        dict(level="turn"),
        dict(kind="tis", tis_cap=0.0),
        dict(kind="mis", mis_low=1.2, mis_high=2.0),
        dict(kind="mis", mis_low=0.0),
    ):
        with pytest.raises(ValueError):
            off_policy_weights(old, mu, mask, OffPolicyConfig(**bad))


# ----------------------------------------------------------------------------- sampling truncation


def reference_kept(z, top_k, top_p):
    """Brute force on Python floats, straight from the definitions: O(V^2) per row."""
    V = len(z)
    in_k = [top_k == 0 or sum(z[u] > z[v] for u in range(V)) < top_k for v in range(V)]
    zmax = max(z)
    e = [math.exp(z[v] - zmax) if in_k[v] else 0.0 for v in range(V)]
    total = math.fsum(e)
    p = [x / total for x in e]
    return [
        in_k[v] and (top_p >= 1 or math.fsum(p[u] for u in range(V) if z[u] > z[v]) < top_p)
        for v in range(V)
    ]


SETTINGS = [
    (1.0, 0, 1.0),
    (1.0, 5, 1.0),
    (0.7, 0, 0.9),
    (1.3, 10, 0.5),
    (1.0, 3, 0.95),
    (2.0, 0, 0.3),
    (1.0, 1, 1.0),
    (0.5, 0, 0.999),
    (1.0, 100, 0.8),
]


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
def test_truncation_mask_matches_brute_force(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(18)
    smooth = 2 * torch.randn(32, 30, generator=g, dtype=f64)
    tied = torch.round(2 * torch.randn(32, 30, generator=g, dtype=f64)) / 2  # many exact ties
    for logits in (smooth, tied):
        kept = truncation_mask(logits, temperature, top_k, top_p)
        ref = [reference_kept((row / temperature).tolist(), top_k, top_p) for row in logits]
        assert kept.tolist() == ref
        # the top token is always kept
        assert kept.gather(-1, logits.argmax(-1, keepdim=True)).all()
    # permuting the vocabulary permutes the kept set: ties are decided by value, never by position
    perm = torch.randperm(30, generator=g)
    assert torch.equal(
        truncation_mask(tied[:, perm], temperature, top_k, top_p),
        truncation_mask(tied, temperature, top_k, top_p)[:, perm],
    )


def test_truncation_mask_hand_computed():
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=f64)
    logits = p.log()
    # 0.8 above < .85
    assert truncation_mask(logits, 1.0, top_p=0.85).tolist() == [[True, True, True, False]]
    # 0.8 above >= .75
    assert truncation_mask(logits, 1.0, top_p=0.75).tolist() == [[True, True, False, False]]
    # top-k 2 renormalises to [0.625, 0.375]: top_p 0.7 keeps both, 0.6 only the first
    assert truncation_mask(logits, 1.0, top_k=2, top_p=0.7).tolist() == [[True, True, False, False]]
    assert truncation_mask(logits, 1.0, top_k=2, top_p=0.6).tolist() == [
        [True, False, False, False]
    ]
    assert truncation_mask(logits, 1.0, top_p=1e-9).tolist() == [[True, False, False, False]]
    # ties: two tokens of mass 0.348 each share the top; top_p 0.3 keeps both (nothing is strictly
    # above either), top_k 1 keeps both, top_k 3 keeps the tied pair below too
    tied = torch.tensor([[0.0, 1.0, 1.0, 0.0, -1.0]], dtype=f64)
    assert truncation_mask(tied, 1.0, top_p=0.3).tolist() == [[False, True, True, False, False]]
    assert truncation_mask(tied, 1.0, top_k=1).tolist() == [[False, True, True, False, False]]
    assert truncation_mask(tied, 1.0, top_k=3).tolist() == [[True, True, True, True, False]]
    for bad in (dict(temperature=0.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1)):
        with pytest.raises(ValueError):
            truncation_mask(logits, **{"temperature": 1.0, **bad})


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
def test_sampling_with_truncation_then_scoring_is_on_policy(temperature, top_k, top_p):
    # The engine: truncate, renormalise, sample, report log p and the kept-set size. The learner:
    # rebuild the set from the size on its own (here equal) logits and score: the same log-prob to
    # 1e-12, ratio 1.
    g = torch.Generator().manual_seed(19)
    logits = 3 * torch.randn(256, 50, generator=g, dtype=f64)
    logits[:64] = torch.round(logits[:64])  # ties too
    kept = truncation_mask(logits, temperature, top_k, top_p)
    z = logits / temperature
    probs = torch.where(kept, (z - z.amax(-1, keepdim=True)).exp(), 0.0)
    probs = probs / probs.sum(-1, keepdim=True)  # the engine's distribution
    tokens = torch.multinomial(probs, 1, generator=g).squeeze(-1)
    engine_logp = probs.gather(-1, tokens[:, None]).squeeze(-1).log()
    kept_size = kept.sum(-1)  # the compact record
    rebuilt = kept_mask_from_size(logits, kept_size, tokens)
    assert torch.equal(rebuilt, kept)
    learner_logp = truncated_logprobs(logits, tokens, rebuilt, temperature)
    close(learner_logp, engine_logp, rtol=0, atol=1e-12)
    assert (learner_logp > -torch.inf).all()
    # the learner's distribution sums to one over the kept set
    all_logp = truncated_logprobs(
        logits[:, None, :].expand(-1, 50, -1),
        torch.arange(50).expand(256, 50),
        kept[:, None, :].expand(-1, 50, -1),
        temperature,
    )
    close(all_logp.exp().sum(-1), torch.ones(256), rtol=0, atol=1e-12)


def test_kept_mask_from_size_on_the_learners_logits():
    # The learner's logits differ by rounding: its own top-k by size, and the sampled token is
    # always kept.
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.999, -1.0]], dtype=f64)
    kept = truncation_mask(logits, 1.0, top_k=3)  # {0, 1, 2}
    assert kept.sum().item() == 3
    # token 2 now ranks below token 3
    learner = logits + torch.tensor([[0.0, 0.0, -0.002, 0.0, 0.0]], dtype=f64)
    assert kept_mask_from_size(learner, kept.sum(-1)).tolist() == [[True, True, False, True, False]]
    forced = kept_mask_from_size(learner, kept.sum(-1), tokens=torch.tensor([2]))
    assert forced.tolist() == [[True, True, True, True, False]]
    assert torch.isfinite(truncated_logprobs(learner, torch.tensor([2]), forced, 1.0)).all()
    # the ranking does not depend on the temperature: rebuild from raw logits what was cut at
    # temperature 0.6
    g = torch.Generator().manual_seed(20)
    x = torch.randn(16, 40, generator=g, dtype=f64)
    kept = truncation_mask(x, 0.6, top_k=7, top_p=0.7)
    assert torch.equal(kept_mask_from_size(x, kept.sum(-1)), kept)
    with pytest.raises(ValueError):
        kept_mask_from_size(x, torch.zeros(16))


def test_truncated_logprobs_gradient():
    # Analytic: d log p(y) / d logit_v = (1[v = y] - p_trunc(v)) / T on kept logits, exactly 0 on
    # dropped ones; and torch.autograd.gradcheck (finite differences) with the kept set rebuilt at
    # every evaluation.
    g = torch.Generator().manual_seed(21)
    T = 0.8
    logits = 2 * torch.randn(6, 12, generator=g, dtype=f64)
    kept = truncation_mask(logits, T, top_k=6, top_p=0.9)
    tokens = torch.multinomial(kept.to(f64), 1, generator=g).squeeze(-1)
    x = logits.clone().requires_grad_()
    (grad,) = torch.autograd.grad(truncated_logprobs(x, tokens, kept, T).sum(), x)
    p = torch.where(kept, (logits / T).exp(), 0.0)
    p = p / p.sum(-1, keepdim=True)
    expected = (torch.nn.functional.one_hot(tokens, 12).to(f64) - p) / T
    close(grad, expected, rtol=1e-12, atol=1e-15)
    assert (grad[~kept] == 0).all()
    kept_size = kept.sum(-1)

    def f(z):
        return truncated_logprobs(z, tokens, kept_mask_from_size(z.detach(), kept_size, tokens), T)

    assert torch.autograd.gradcheck(
        f, (logits.clone().requires_grad_(),), eps=1e-6, atol=1e-8, rtol=1e-6
    )


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
def test_kept_size_from_logprob_recovers_the_set(temperature, top_k, top_p):
    # vLLM's route: the engine reports only the truncated log-prob of its sample. On the same logits
    # the size is recovered exactly (distinct logits: every added token moves the log-sum-exp by far
    # more than 1e-12); on logits perturbed by ~1e-6 (another kernel's rounding) the rebuilt
    # log-prob still matches the engine's to within the perturbation, while the full-vocabulary
    # log-prob does not.
    g = torch.Generator().manual_seed(22)
    logits = 3 * torch.randn(256, 50, generator=g, dtype=f64)
    kept = truncation_mask(logits, temperature, top_k, top_p)
    tokens = torch.multinomial(kept.to(f64), 1, generator=g).squeeze(-1)
    engine_logp = truncated_logprobs(logits, tokens, kept, temperature)
    n = kept_size_from_logprob(logits, tokens, engine_logp, temperature)
    assert torch.equal(n, kept.sum(-1))
    noise = 1e-6 * torch.randn(256, 50, generator=g, dtype=f64)
    noisy = logits + noise
    n = kept_size_from_logprob(noisy, tokens, engine_logp, temperature)
    learner = truncated_logprobs(noisy, tokens, kept_mask_from_size(noisy, n, tokens), temperature)
    # z_y - LSE moves by at most 2 max|noise| / T under the true set: the best n does at least as
    # well
    assert (learner - engine_logp).abs().max() <= 2 * noise.abs().max() / temperature
    if top_p < 1 or top_k:
        full = torch.log_softmax(noisy / temperature, -1).gather(-1, tokens[:, None]).squeeze(-1)
        assert (full - engine_logp).abs().max() > 1e-3


def test_kept_size_from_logprob_hand_computed():
    # p = [0.5, 0.3, 0.15, 0.05]: log-probs of token 0 under the top 1, 2, 3, 4 sets are log 1, log
    # .5/.8, log .5/.95, log .5; token 2 cannot come from a set smaller than 3 whatever the log-prob
    # says
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=f64).log()[None].expand(4, 4)
    lp = torch.tensor([0.0, math.log(0.5 / 0.8), math.log(0.5 / 0.95), math.log(0.5)], dtype=f64)
    assert kept_size_from_logprob(logits, torch.zeros(4, dtype=torch.long), lp, 1.0).tolist() == [
        1,
        2,
        3,
        4,
    ]
    assert kept_size_from_logprob(
        logits[:1], torch.tensor([2]), torch.tensor([0.0], dtype=f64), 1.0
    ).tolist() == [3]
