"""algos.py: Nano-SkyRL's RL math as pure functions: advantages, policy losses, KL, value loss.

This is the file to copy into another project or to read next to the papers. It imports only torch,
holds no state and never mutates its inputs: tensors go in, new tensors (and for losses a metrics
dict) come out. Each function's docstring gives its equation and the paper it comes from.

Shapes (one letter per dimension):
    B  sequences in the batch (rows), B = num_groups * G for group methods; rows are group-major,
       i.e. rows [g*G, (g+1)*G) are the G samples of prompt g
    T  tokens per row (the padded response length)
    G  group size (samples per prompt)
    V  vocabulary size
    K  turns per episode (the padded number of assistant turns), for turn-level credit assignment
    N  rows of a flattened logit block (N = B * T, or any leading shape: those functions take
       (..., V))

How to read it. `mask` is (B, T) with 1 on tokens the policy sampled and 0 on padding, prompt and
tool-output tokens. Masked positions may hold garbage (even inf / nan), so they are removed with
torch.where (0 * nan is nan, a multiply would leak it). Advantages are per token, (B, T): a
sequence-level advantage (GRPO, RLOO, ...) is broadcast over the row's tokens by the caller.
Sections, top to bottom: advantages -> policy losses -> aggregation -> KL / value -> DAPO's
batch-level extras. Code inside a `# --- algorithm ---` fence is the equation; the rest is
plumbing (checks, metrics).

Papers:
    PPO                     Schulman et al. 2017, arXiv:1707.06347
    GAE                     Schulman et al. 2015, arXiv:1506.02438
    dual-clip PPO           Ye et al. 2019, arXiv:1912.09729
    GRPO (DeepSeekMath)     Shao et al. 2024, arXiv:2402.03300
    RLOO                    Ahmadian et al. 2024, arXiv:2402.14740
    Dr. GRPO                Liu et al. 2025, arXiv:2503.20783
    DAPO                    Yu et al. 2025, arXiv:2503.14476
    GSPO                    Zheng et al. 2025, arXiv:2507.18071
    SAPO                    Gao et al. (Qwen) 2025, "Soft Adaptive Policy Optimization",
                            arXiv:2511.20347
    truncated IS (TIS)      Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
                            Off-Policy RL Training" (blog); Espeholt et al. 2018 (IMPALA,
                            V-trace), arXiv:1802.01561
    k1 / k2 / k3 KL         J. Schulman, "Approximating KL Divergence" (blog, 2020)
    CISPO (MiniMax-M1)      MiniMax 2025, arXiv:2506.13585
    GMPO                    Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv:2507.20673
    REINFORCE++             Hu et al. 2025, arXiv:2501.03262
    GKD / on-policy distil. Agarwal et al. 2023, arXiv:2306.13649; Lu et al. (Thinking Machines)
                            2025, "On-Policy Distillation" (blog)
    IcePop, rollout masking Ling Team (Ring-1T) 2025, arXiv:2510.18855; Liu, Li et al. 2025, "When
                            Speed Kills Stability: Demystifying RL Collapse from the
                            Training-Inference Mismatch" (blog)
    GiGPO                   Feng et al. 2025, arXiv:2505.10978
    nucleus (top-p)         Holtzman et al. 2019, arXiv:1904.09751

The families added after the first release live in their own sections below the DAPO extras:
REINFORCE++ / distillation / turn-level advantages, off-policy corrections, sampling truncation.
Imports: none of our files (torch, the standard library).
"""

from dataclasses import dataclass

import torch

GROUP_ADVANTAGE_KINDS = ("grpo", "drgrpo", "rloo")
POLICY_LOSS_KINDS = ("ppo", "dual_clip", "dapo", "gspo", "gspo_token", "sapo", "cispo", "gmpo")
# one ratio per sequence: metrics average over sequences
SEQUENCE_RATIO_KINDS = ("gspo", "gspo_token", "gmpo")
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3")


def _check(name: str, value: str, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; expected one of {allowed}")


# ----------------------------------------------------------------------------- advantages


@torch.no_grad()
def at_last(values, mask):
    """values (N,) placed at the last valid position of each row of mask (N, T), 0 elsewhere ->
    (N, T). PPO's episode reward on the episode's last sampled token, where GAE starts; turn
    credit's reward shaping on the episode's last turn. A row with no valid position gets its
    value at position 0."""
    last = (mask * torch.arange(mask.shape[1])).argmax(1)  # (N,)
    out = torch.zeros(mask.shape, dtype=values.dtype)  # (N, T)
    out[torch.arange(len(values)), last] = values
    return out


def compute_gae(rewards, values, mask, gamma: float, lam: float):
    """Generalized Advantage Estimation, per token, run backwards over valid tokens only
    (arXiv:1506.02438).

        delta_t = r_t + gamma * V_{t'} - V_t        t' = next valid token after t
                                                    (V = 0 past the last one)
        A_t     = delta_t + gamma * lam * A_{t'}
        R_t     = A_t + V_t                          (the value target)

    A position with mask 0 (tool output, padding) is skipped: its reward and value are ignored and
    V_{t'}, A_{t'} carry through it unchanged, so a tool response neither discounts nor bootstraps.
    rewards, values, mask: (B, T). Returns (advantages, returns), both (B, T), 0 where masked.
    """
    valid = mask.bool()
    B, T = rewards.shape
    # V and A of the next valid token, (B,) each; advantages (B, T), filled right to left
    next_value = rewards.new_zeros(B)
    next_adv = rewards.new_zeros(B)
    advantages = torch.zeros_like(rewards)
    # --- algorithm ---
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # (B,)
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = torch.where(valid[:, t], adv, 0.0)
        next_adv = torch.where(valid[:, t], adv, next_adv)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
    returns = torch.where(valid, advantages + values, 0.0)  # (B, T)
    # --- end algorithm ---
    return advantages, returns


def whiten(x, mask, eps: float = 1e-8):
    """(x - mean) / sqrt(var + eps), with the mean and the unbiased variance over valid tokens
    only; 0 at masked positions.

    Used on GAE advantages (PPO). x, mask: (B, T) -> (B, T).
    """
    valid = mask.bool()
    n = valid.sum()
    if n < 2:
        raise ValueError(
            f"whiten needs at least 2 valid tokens for an unbiased variance, got {int(n)}"
        )
    xv = torch.where(valid, x, 0.0)
    mean = xv.sum() / n
    var = torch.where(valid, (xv - mean) ** 2, 0.0).sum() / (n - 1)  # unbiased (Bessel)
    return torch.where(valid, (xv - mean) * torch.rsqrt(var + eps), 0.0)


def group_advantages(rewards, group_size: int, kind: str):
    """Critic-free advantages from G samples of the same prompt: rewards (B,) -> (B,), group-major.

        grpo    A_i = (R_i - mean_g R) / (std_g R + 1e-6)     unbiased std
                                                              (GRPO, arXiv:2402.03300)
        drgrpo  A_i =  R_i - mean_g R                         no std division
                                                              (Dr. GRPO, arXiv:2503.20783)
        rloo    A_i =  R_i - mean_{j != i} R_j = G/(G-1) (R_i - mean_g R)
                                                              (RLOO, arXiv:2402.14740)

    A group whose rewards are all equal carries no signal and gets exactly 0 (never NaN or a
    rounding residue such as 1e-17).
    """
    _check("advantage kind", kind, GROUP_ADVANTAGE_KINDS)
    B, G = rewards.shape[0], group_size
    if G < 1 or B % G != 0:
        raise ValueError(f"batch of {B} rewards is not a whole number of groups of size {G}")
    if G < 2 and kind != "drgrpo":
        raise ValueError(f"{kind} needs group_size >= 2 (a std / a leave-one-out mean), got {G}")
    r = rewards.reshape(-1, G)  # (B/G, G)
    r = r if r.is_floating_point() else r.float()
    # --- algorithm ---
    mean = r.mean(dim=1, keepdim=True)  # (B/G, 1)
    if kind == "grpo":
        adv = (r - mean) / (r.std(dim=1, keepdim=True) + 1e-6)
    elif kind == "drgrpo":
        adv = r - mean
    else:  # rloo: R_i - (sum_g R - R_i) / (G - 1)
        adv = r - (r.sum(dim=1, keepdim=True) - r) / (G - 1)
    # --- end algorithm ---
    all_equal = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)
    return torch.where(all_equal, 0.0, adv).view(B)


def segment_advantages(episode_adv, episode, mask):
    """Each row's tokens get its episode's advantage: episode_adv (E,), episode (B,) the episode of
    each row, mask (B, T) the sampled tokens -> (B, T). An episode is one row, or several: a memory
    policy's segments (each the prompt the engine was given and what it sampled: a compacted
    context, a summary the policy wrote), a client's rewritten history. The estimator, with pi the
    policy and c_t the context token a_t was sampled from:

        g = sum_i A_i sum_{rows r of i} sum_{t in r, sampled} grad log pi(a_t | c_t)

    Why it is unbiased. Within an episode every token is one action of one policy acting on the
    context it was given, and a compaction (a summary, a window) only decides the next contexts: it
    is part of the environment as the agent sees it, or an action (a summary is sampled, so it is
    one). Then sum_t grad log pi(a_t | c_t) is the score of the episode's probability, and
    A_i = R_i - b_i with b_i independent of episode i (rloo's leave-one-out mean; drgrpo's group
    mean scales the gradient by (G - 1) / G) is REINFORCE with a baseline. It needs each token
    scored on exactly the context it was sampled from: scoring the tokens after a compaction on the
    whole history instead is the gradient of another policy, biased (tests/test_memory.py shows both
    by exact enumeration on a toy MDP with a compaction step). A summary whose content the reward
    does not depend on gets an expected gradient of exactly 0, like any action that changes nothing.
    """
    return episode_adv[episode][:, None] * mask  # (B, T)


# ----------------------------------------------------------------------------- policy losses


@dataclass
class PolicyLossConfig:
    """Hyperparameters of every policy loss (policy_loss); each kind reads only its own fields."""

    # PPO eps_low: ratio floor 1 - clip_low (ppo, dual_clip, dapo)
    clip_low: float = 0.2
    # PPO eps_high: ratio ceiling 1 + clip_high (ppo, dual_clip)
    clip_high: float = 0.2
    # dual-clip cap c: loss of a negative-advantage token is at most -c * A
    dual_clip_c: float = 3.0
    # DAPO clip-higher ceiling 1 + 0.28 (its floor is still clip_low)
    dapo_clip_high: float = 0.28
    # GSPO sequence-ratio floor 1 - 3e-4 (the paper's value)
    gspo_clip_low: float = 3e-4
    # GSPO sequence-ratio ceiling 1 + 4e-4
    gspo_clip_high: float = 4e-4
    # SAPO gate temperature for tokens with A > 0
    sapo_tau_pos: float = 1.0
    # SAPO gate temperature for tokens with A < 0 (sharper: negatives are riskier)
    sapo_tau_neg: float = 1.05
    # CISPO IS-weight floor 1 - 1.0 = 0, i.e. none: the paper sets eps_low "large"
    cispo_clip_low: float = 1.0
    # CISPO IS-weight ceiling 1 + 4.0 (the paper tunes only this bound; SkyRL's 5.0)
    cispo_clip_high: float = 4.0
    # GMPO token log-ratio floor -0.4 (ratio e^-0.4), binds where A < 0
    gmpo_clip_low: float = 0.4
    # GMPO token log-ratio ceiling +0.4 (ratio e^0.4), binds where A > 0
    gmpo_clip_high: float = 0.4
    # exp's argument is clamped to [-c, c], so a ratio never overflows (algos._exp)
    log_ratio_clamp: float = 20.0
    # how token losses become one scalar, see aggregate()
    agg_mode: str = "token-mean"
    # constant normalizer for agg_mode="seq-mean-token-sum-norm" (e.g. max tokens)
    agg_norm: float | None = None


def _clipped_surrogate(ratio, adv, eps_low, eps_high, dual_c=None):
    """PPO's clipped surrogate per token. Returns (loss, clipped_low, clipped_high), all (B, T).

        L = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))      (PPO, arXiv:1707.06347)
        if A < 0 and dual_c: L = min(L, -A c)                      (dual-clip, arXiv:1912.09729)

    clipped_* flag tokens whose gradient the clip zeroes: r > 1 + eps_high with A > 0 (or r > c
    with A < 0 under dual-clip) is "high"; r < 1 - eps_low with A < 0 is "low".
    """
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps_low, 1 + eps_high))  # (B, T)
    clipped_low = (adv < 0) & (ratio < 1 - eps_low)
    clipped_high = (adv > 0) & (ratio > 1 + eps_high)
    if dual_c is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * dual_c), loss)
        clipped_high = clipped_high | ((adv < 0) & (ratio > dual_c))
    return loss, clipped_low, clipped_high


def _seq_log_ratio(log_ratio, valid):
    """GSPO's length-normalized sequence log-ratio: (1/|y_i|) sum_t log(pi/pi_old).
    (B, T) -> (B, 1)."""
    n = valid.sum(dim=1, keepdim=True).clamp(min=1)
    # log_ratio is already 0 at masked positions
    return log_ratio.sum(dim=1, keepdim=True) / n


def _exp(log_ratio, cfg):
    """exp(clamp(log_ratio, -c, c)), c = cfg.log_ratio_clamp: the clamp lives only inside the
    exponentials, as an overflow guard. A loss that also uses log r itself (cispo) or averages it
    first (gspo, gmpo) gets it unclamped, so no token loses its gradient to the guard there. Where a
    ratio is exponentiated per token (ppo, dual_clip, dapo, sapo), a token beyond +-c has ratio
    e^+-c and no gradient: such a token is clipped anyway, or (A < 0, r > e^c, plain PPO) its
    gradient A r would be huge."""
    c = cfg.log_ratio_clamp
    return log_ratio.clamp(-c, c).exp()


def _ppo(log_ratio, adv, valid, cfg):
    ratio = _exp(log_ratio, cfg)
    return (ratio, *_clipped_surrogate(ratio, adv, cfg.clip_low, cfg.clip_high))


def _dual_clip(log_ratio, adv, valid, cfg):
    ratio = _exp(log_ratio, cfg)
    return (ratio, *_clipped_surrogate(ratio, adv, cfg.clip_low, cfg.clip_high, cfg.dual_clip_c))


def _dapo(log_ratio, adv, valid, cfg):
    # DAPO's "clip-higher": a wider ceiling lets low-probability tokens grow, fighting
    # entropy collapse.
    ratio = _exp(log_ratio, cfg)
    return (ratio, *_clipped_surrogate(ratio, adv, cfg.clip_low, cfg.dapo_clip_high))


def _gspo(log_ratio, adv, valid, cfg):
    # s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|), one ratio per sequence, clipped as a whole.
    ratio = _exp(_seq_log_ratio(log_ratio, valid), cfg).expand_as(log_ratio)  # (B, T)
    return (ratio, *_clipped_surrogate(ratio, adv, cfg.gspo_clip_low, cfg.gspo_clip_high))


def _gspo_token(log_ratio, adv, valid, cfg):
    # s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)]: the value of s_i, but the gradient of a token
    # ratio, so a per-token advantage A_{i,t} weights its own token (the GSPO paper's GSPO-token).
    seq = _seq_log_ratio(log_ratio, valid).detach()
    ratio = _exp(seq, cfg) * (log_ratio - log_ratio.detach()).exp()  # (B, T)
    return (ratio, *_clipped_surrogate(ratio, adv, cfg.gspo_clip_low, cfg.gspo_clip_high))


def _sapo(log_ratio, adv, valid, cfg):
    # f(r) = sigmoid(tau (r - 1)) * 4 / tau has slope 1 at r = 1, like the plain surrogate r * A
    # (gradient weight 1 on-policy), then its slope decays smoothly instead of cutting to 0 like a
    # clip. No hard clip, so no token counts as clipped.
    ratio = _exp(log_ratio, cfg)
    tau = torch.full_like(adv, cfg.sapo_tau_neg).masked_fill(adv > 0, cfg.sapo_tau_pos)
    gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau  # (B, T)
    no_clip = torch.zeros_like(valid)
    return ratio, -gate * adv, no_clip, no_clip


def _cispo(log_ratio, adv, valid, cfg):
    # The clipped ratio is a constant weight (sg), so a token outside the band keeps the gradient
    # A * w of REINFORCE instead of losing it as under PPO: rare, low-probability "fork" tokens
    # keep learning. -sg(w) A log(pi / pi_old) is the paper's -sg(w) A log pi minus a constant:
    # the same gradient. log r is used unclamped there, so a token however far off-policy keeps
    # its gradient -w A (w at its cap).
    ratio = _exp(log_ratio, cfg)
    w = ratio.detach().clamp(1 - cfg.cispo_clip_low, 1 + cfg.cispo_clip_high)  # (B, T)
    # "clipped" here: the weight was capped (the token's gradient still flows, scaled by the cap)
    clipped_low = ratio < 1 - cfg.cispo_clip_low
    clipped_high = ratio > 1 + cfg.cispo_clip_high
    return ratio, -w * adv * log_ratio, clipped_low, clipped_high


def _gmpo(log_ratio, adv, valid, cfg):
    # Token log-ratios are clipped pessimistically for the sign of A (only the ceiling binds where
    # A >= 0, only the floor where A < 0, as PPO's min does), then averaged: the sequence ratio is
    # their geometric mean, so one outlier token moves it by 1/|y| of its log instead of dominating
    # a sum. The overflow guard clamps the mean, not the tokens: a token far outside the band (only
    # one side of it binds) keeps its 1/|y| share of the gradient unless the whole sequence's mean
    # is beyond +-log_ratio_clamp.
    lo, hi = -cfg.gmpo_clip_low, cfg.gmpo_clip_high
    clipped = torch.where(adv >= 0, log_ratio.clamp(max=hi), log_ratio.clamp(min=lo))
    seq_ratio = _exp(_seq_log_ratio(clipped, valid), cfg).expand_as(log_ratio)  # (B, T)
    clipped_low = (adv < 0) & (log_ratio < lo)
    clipped_high = (adv > 0) & (log_ratio > hi)
    # the unclipped sequence ratio, for the metrics
    ratio = _exp(_seq_log_ratio(log_ratio, valid), cfg).expand_as(log_ratio)
    return ratio, -adv * seq_ratio, clipped_low, clipped_high


# kind -> fn(log_ratio (B, T), adv (B, T), valid (B, T), cfg)
#      -> (ratio, token_loss, clipped_low, clipped_high), all (B, T).
# log_ratio (unclamped: each loss exponentiates with _exp) and adv arrive zeroed where masked.
POLICY_LOSSES = {
    "ppo": _ppo,
    "dual_clip": _dual_clip,
    "dapo": _dapo,
    "gspo": _gspo,
    "gspo_token": _gspo_token,
    "sapo": _sapo,
    "cispo": _cispo,
    "gmpo": _gmpo,
}


def policy_loss(kind: str, logp, old_logp, advantages, mask, cfg: PolicyLossConfig, weights=None):
    """Policy-gradient loss of `kind`, aggregated by aggregate(., mask, cfg.agg_mode, cfg.agg_norm).

    With r_t = exp(logp_t - old_logp_t) and A_t = advantages (all (B, T)); every exponential's
    argument is clamped to +-log_ratio_clamp (an overflow guard, _exp says where that leaves a
    gradient and where not):
        ppo         max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))         arXiv:1707.06347
        dual_clip   ppo, then min(., -c A) where A < 0 (c = dual_clip_c)       arXiv:1912.09729
        dapo        ppo with ceiling 1 + dapo_clip_high ("clip-higher")        arXiv:2503.14476
        gspo        ppo on s_i = exp(mean_t log r_t), band gspo_clip_low/high  arXiv:2507.18071
        gspo_token  gspo with s_{i,t} = sg[s_i] r_t / sg[r_t] (equal value, token-wise gradient)
        sapo        -f(r) A,  f(r) = sigmoid(tau (r - 1)) 4 / tau,             arXiv:2511.20347
                    tau = tau_pos if A > 0 else tau_neg
        cispo       -sg(clip(r, 1 - cispo_clip_low, 1 + cispo_clip_high)) A log r
                    (MiniMax-M1, arXiv:2506.13585: the weight is clipped and constant, every
                    token keeps its gradient)
        gmpo        -A exp(mean_t c_t),  c_t = min(log r_t, gmpo_clip_high) if A >= 0
                                         c_t = max(log r_t, -gmpo_clip_low) if A < 0
                    (arXiv:2507.20673: the geometric mean of token ratios clipped in log
                    space; mean over the row's valid tokens)
    GRPO is "ppo" with group advantages; the GSPO paper's averaging is
    agg_mode="seq-mean-token-mean". `weights` (B, T), optional and constant: each token's loss is
    multiplied by it before aggregation (the off-policy weights of off_policy_weights, when the
    samples came from another policy).

    Returns (loss: 0-dim tensor with grad, metrics: dict of detached 0-dim tensors):
        clip_frac_low / clip_frac_high  share of tokens whose gradient a clip zeroed (below /
                                        above the band); for cispo, whose weight the clip
                                        capped (their gradient still flows)
        approx_kl                       k3 estimate of KL(pi_old || pi): (r - 1) - log r
        ratio_mean / ratio_min / ratio_max
    Metrics average over valid tokens, or for gspo / gspo_token / gmpo (one ratio per sequence, the
    unclipped geometric mean for gmpo) over sequences with any valid token.
    """
    _check("policy loss", kind, POLICY_LOSS_KINDS)
    valid = mask.bool()
    log_ratio = torch.where(valid, logp - old_logp, 0.0)  # (B, T) garbage removed
    adv = torch.where(valid, advantages, 0.0)
    ratio, token_loss, clipped_low, clipped_high = POLICY_LOSSES[kind](log_ratio, adv, valid, cfg)
    if weights is not None:
        token_loss = token_loss * weights.detach()
    token_loss = torch.where(valid, token_loss, 0.0)
    loss = aggregate(token_loss, valid, cfg.agg_mode, cfg.agg_norm)

    with torch.no_grad():

        def mean(x):
            return _metric_mean(x.to(log_ratio.dtype), valid, per_seq=kind in SEQUENCE_RATIO_KINDS)

        any_valid = valid.any()
        metrics = {
            "clip_frac_low": mean(clipped_low),
            "clip_frac_high": mean(clipped_high),
            "approx_kl": mean(
                _exp(log_ratio, cfg)
                - 1
                - log_ratio.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
            ),
            "ratio_mean": mean(ratio),
            "ratio_min": torch.where(any_valid, torch.where(valid, ratio, torch.inf).amin(), 0.0),
            "ratio_max": torch.where(any_valid, torch.where(valid, ratio, -torch.inf).amax(), 0.0),
        }
    return loss, metrics


def _metric_mean(x, valid, per_seq: bool):
    """Mean of x over valid tokens, or (per_seq) the mean over non-empty rows of each row's
    token mean."""
    x = torch.where(valid, x, 0.0)
    if not per_seq:
        return x.sum() / valid.sum().clamp(min=1)
    n = valid.sum(dim=1)
    row = x.sum(dim=1) / n.clamp(min=1)  # (B,)
    return row.sum() / (n > 0).sum().clamp(min=1)


# ----------------------------------------------------------------------------- aggregation


def aggregate(loss, mask, mode: str, norm: float | None = None):
    """Reduce a (B, T) token loss to a scalar. Masked positions are ignored (garbage-safe).

        token-mean               sum_{b,t} m L / max(sum m, 1)
                                 every token weighs the same (DAPO)
        seq-mean-token-sum       (1/B) sum_b sum_t m L
        seq-mean-token-mean      (1/B) sum_b (sum_t m L / sum_t m)
                                 every sequence weighs the same (GRPO)
        seq-mean-token-sum-norm  sum_{b,t} m L / (B * norm)
                                 a constant normalizer, no length bias (Dr. GRPO)
    Sequence modes divide by B, fully masked rows included (they contribute 0).
    """
    _check("aggregation mode", mode, AGG_MODES)
    valid = mask.bool()
    B = loss.shape[0]
    masked = torch.where(valid, loss, 0.0)  # (B, T)
    if mode == "token-mean":
        return masked.sum() / valid.sum().clamp(min=1)
    if mode == "seq-mean-token-sum":
        return masked.sum(dim=1).sum() / B
    if mode == "seq-mean-token-mean":
        return (masked.sum(dim=1) / valid.sum(dim=1).clamp(min=1)).sum() / B
    if norm is None:
        raise ValueError(
            "agg_mode 'seq-mean-token-sum-norm' needs a constant normalizer (agg_norm)"
        )
    return masked.sum() / (B * norm)


# ----------------------------------------------------------------------------- KL, value


def kl_penalty(logp, ref_logp, kind: str):
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi (Schulman,
    "Approximating KL").

    With log rho = ref_logp - logp (= log pi_ref/pi), elementwise, any shape:
        k1 = -log rho = logp - ref_logp     unbiased, high variance, can be negative
        k2 = 0.5 (log rho)^2                biased, low variance, >= 0
        k3 = rho - 1 - log rho              unbiased, low variance, >= 0 ("low_var_kl" in verl;
                                            the GRPO paper's in-loss KL). log rho is clamped to
                                            [-20, 20] and k3 to [-10, 10], as in verl, for
                                            stability (which biases it only for extreme ratios).
    Either add beta * kl to the loss or subtract it from the per-token reward (a config switch).
    """
    _check("KL kind", kind, KL_KINDS)
    log_rho = ref_logp - logp
    if kind == "k1":
        return -log_rho
    if kind == "k2":
        return 0.5 * log_rho**2
    log_rho = log_rho.clamp(-20, 20)
    return (log_rho.exp() - 1 - log_rho).clamp(-10, 10)


def value_loss(values, old_values, returns, mask, clip: float, agg_mode: str = "token-mean"):
    """PPO's clipped value loss (arXiv:1707.06347; clipping as in OpenAI baselines). All inputs
    (B, T).

        V_clip = V_old + clip(V - V_old, -clip, clip)
        L      = 0.5 * max((V - R)^2, (V_clip - R)^2)
    Returns (loss aggregated with agg_mode, {"vf_clip_frac": share of valid tokens where the
    clipped term won}).
    """
    valid = mask.bool()
    # zero the garbage first: backward of (v - R)^2 multiplies by (v - R), and 0 * nan is nan
    values, old_values, returns = (
        torch.where(valid, x, 0.0) for x in (values, old_values, returns)
    )
    v_clip = old_values + (values - old_values).clamp(-clip, clip)  # (B, T)
    err = (values - returns) ** 2
    err_clip = (v_clip - returns) ** 2
    loss = aggregate(0.5 * torch.maximum(err, err_clip), valid, agg_mode)
    with torch.no_grad():
        frac = _metric_mean((err_clip > err).to(err.dtype), valid, per_seq=False)
    return loss, {"vf_clip_frac": frac}


# ------------------------------------------------------------------------ DAPO batch-level extras


def dynamic_sampling_mask(rewards, group_size: int):
    """DAPO dynamic sampling (arXiv:2503.14476, sec. 3.2): keep the groups whose rewards differ.

    A group with one reward value has zero group advantage everywhere, so it adds no gradient and
    shrinks the effective batch; the training loop drops it and samples more prompts until the batch
    is full again (or a retry budget runs out). rewards (B,) group-major -> bool (B,).
    """
    B, G = rewards.shape[0], group_size
    if G < 1 or B % G != 0:
        raise ValueError(f"batch of {B} rewards is not a whole number of groups of size {G}")
    r = rewards.reshape(-1, G)  # (B/G, G)
    mixed = r.amax(dim=1) != r.amin(dim=1)
    return mixed.repeat_interleave(G)


def overlong_penalty(lengths, max_len: int, cache_len: int):
    """DAPO soft overlong punishment (arXiv:2503.14476, eq. 13), added to the reward.
    lengths (B,) -> (B,) float.

        R = 0                                     |y| <= L_max - L_cache
        R = ((L_max - L_cache) - |y|) / L_cache   L_max - L_cache < |y| <= L_max
                                                  (a ramp from 0 to -1)
        R = -1                                    L_max < |y|
    i.e. clamp(((L_max - L_cache) - |y|) / L_cache, -1, 0).
    """
    if cache_len <= 0 or cache_len > max_len:
        raise ValueError(
            f"need 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}"
        )
    return ((max_len - cache_len - lengths.float()) / cache_len).clamp(-1.0, 0.0)


TRUNCATION_KINDS = ("keep", "mask", "penalize")


def truncation_treatment(rewards, mask, cut, kind: str = "keep", penalty: float = 1.0):
    """What an episode cut by a length limit trains on. rewards (B,), mask (B, T), cut bool
    (B,) -> (rewards, mask), new tensors where they change.

        keep       R_i, as sampled: the cut answer is scored like any other
        mask       no loss on row i's tokens (DAPO's overlong filtering, arXiv:2503.14476
                   sec. 3.4): its reward still enters its group's baseline, so the other rows'
                   advantages are those of the whole group
        penalize   R_i - penalty: a cut answer is worse than its score says (DAPO's overlong
                   reward shaping with a flat step; algo.overlong_cache is the ramp over the
                   context window)
    """
    if kind not in TRUNCATION_KINDS:
        raise ValueError(
            f"unknown truncation treatment {kind!r}, expected one of {TRUNCATION_KINDS}"
        )
    if kind == "mask":
        return rewards, mask * (~cut).to(mask.dtype)[:, None]
    if kind == "penalize":
        return rewards - penalty * cut.to(rewards.dtype), mask
    return rewards, mask


# ---------------------------------------------------------------------- REINFORCE++, distillation


@torch.no_grad()
def reinforce_pp_advantages(
    rewards,
    kl,
    mask,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    group_size: int | None = None,
    eps: float = 1e-8,
):
    """REINFORCE++ advantages (Hu et al. 2025, arXiv:2501.03262): per-token KL in the reward,
    returns, batch whitening.

        R'_i      = R_i                        REINFORCE++            (group_size None)
        R'_i      = R_i - mean_{g(i)} R        REINFORCE++-baseline   (group_size G, group-major)
        r_{i,t}   = R'_i [t = last valid token of row i] - kl_coef * KL_{i,t}
        ret_{i,t} = sum_{valid t' >= t} gamma^{n(t, t')} r_{i,t'}
                    n(t, t') = valid tokens in (t, t']  (paper: gamma 1)
        A_{i,t}   = (ret_{i,t} - mean ret) / std ret
                    mean and unbiased std over all valid tokens of the batch

    With gamma = 1 this is the paper's A_t = R - beta sum_{t' >= t} KL_{t'}. `kl` (B, T) is the
    caller's per-token estimate of KL(pi_old || pi_ref) (the paper's k1 = old_logp - ref_logp, i.e.
    kl_penalty(old_logp, ref_logp, "k1")), or None for no KL. The global whitening replaces GRPO's
    per-group std: no group can be blown up by a tiny std. Masked tokens (tool output) are skipped
    like in compute_gae: they neither discount nor earn. rewards (B,), kl and mask (B, T) ->
    advantages (B, T), 0 at masked positions.
    """
    valid = mask.bool()
    B, T = valid.shape
    r = rewards if rewards.is_floating_point() else rewards.float()
    if r.shape != (B,):
        raise ValueError(f"rewards must be (B,) = ({B},), got {tuple(r.shape)}")
    if group_size is not None:
        r = group_advantages(r, group_size, "drgrpo")  # (B,) R - group mean
    # --- algorithm ---
    # (B,) each row's last valid token, -1 for an empty row
    last = torch.where(valid, torch.arange(T, device=valid.device), -1).amax(dim=1)
    token_r = torch.zeros(B, T, dtype=r.dtype, device=r.device)
    token_r[last >= 0, last[last >= 0]] = r[last >= 0]  # the outcome at the last token
    if kl is not None:
        token_r = token_r - kl_coef * torch.where(valid, kl, 0.0).to(r.dtype)
    # GAE with V = 0 and lam = 1 gives the returns
    returns, _ = compute_gae(token_r, torch.zeros_like(token_r), valid, gamma, 1.0)
    adv = whiten(returns, valid, eps)
    # --- end algorithm ---
    return adv


@torch.no_grad()
def distillation_advantages(
    student_logp, teacher_logp, mask, task_advantages=None, coef: float = 1.0
):
    """On-policy distillation: each sampled token's advantage is the teacher's log-prob minus
    the student's.

        A_t = coef * (log pi_teacher(y_t) - log pi_student(y_t))
              [+ A_task_t when task_advantages is given]

    The student samples y ~ pi_student and the teacher scores the same tokens;
    log pi_teacher - log pi_student is minus the one-sample (k1) estimate of the per-token reverse
    KL(pi_student || pi_teacher), so a policy-gradient step on it minimises the reverse KL on the
    student's own distribution of states (GKD, Agarwal et al. 2023, arXiv:2306.13649; Thinking
    Machines' "On-Policy Distillation", 2025, which uses it with discount 0, as here: each token
    gets only its own term). Mixed with a task advantage (e.g. GRPO's, broadcast) the coefficient
    weighs imitation against reward. `student_logp` are the log-probs of the policy that sampled
    (pi_old or the engine's). All (B, T) -> (advantages (B, T), 0 off the mask,
    {"distill_reverse_kl": mean over valid tokens of log pi_student - log pi_teacher, the k1
    estimate of KL(student || teacher)}).
    """
    valid = mask.bool()
    gap = torch.where(valid, teacher_logp - student_logp, 0.0)  # (B, T) -k1 of the reverse KL
    adv = coef * gap
    if task_advantages is not None:
        adv = adv + torch.where(valid, task_advantages, 0.0)
    metrics = {"distill_reverse_kl": -_metric_mean(gap, valid, per_seq=False)}
    return adv, metrics


# --------------------------------------------------------------------- turn-level credit assignment

TURN_BASELINES = ("position", "state")


@torch.no_grad()
def turn_advantages(
    turn_rewards,
    turn_mask,
    group_size: int,
    gamma: float = 1.0,
    baseline: str = "position",
    state_keys=None,
):
    """Per-turn advantages for multi-turn episodes with a reward at every turn. All (B, K) ->
    (B, K), rows group-major.

        R_{i,k} = sum_{k' >= k} gamma^{k'-k} r_{i,k'}     return-to-go over the episode's own turns
        b_{i,k} = mean { R_{j,k'} : j != i in i's group, (j, k') matches (i, k) }
                                                          leave-one-out baseline
        A_{i,k} = R_{i,k} - b_{i,k}

    "matches" is `baseline`:
        position  k' = k: the same turn index (MT-GRPO-style, Zeng et al. 2025, arXiv:2505.11821)
        state     state_keys[j, k'] == state_keys[i, k]: the same environment state anywhere in
                  another episode of the group (GiGPO's anchor states, Feng et al. 2025,
                  arXiv:2505.10978); a turn whose state no other episode visited falls back to
                  the position baseline
    and a turn with nothing to match at all gets b = 0 (its plain return).

    Why it is unbiased. The policy gradient sum_k grad log pi(a_{i,k} | s_{i,k}) (R_{i,k} - b_{i,k})
    is unbiased iff E[grad log pi(a_{i,k} | s_{i,k}) b_{i,k}] = 0, which holds when b_{i,k} does not
    depend on a_{i,k} given s_{i,k}. Here b_{i,k} averages the returns of the OTHER episodes of the
    group, which are independent of episode i: every own turn is excluded (a later own turn's return
    depends on a_{i,k}), and which turns match depends only on the other episodes and on s_{i,k}.
    The returns are summed within each episode BEFORE the baseline, so no baseline term is counted
    once per own remaining turn: per-turn normalisation first and summation after (the natural
    construction) subtracts sum_{k' >= k} mean_j r_{j,k'} over the turns the episode itself went on
    to take, a baseline that depends on its own stopping decisions (verl RFC #7244). Including the
    sample's own return in the mean (GRPO's group mean) scales each turn's signal by
    m / (m + 1), m the number of other turns matched, which differs between turns: biased too. No
    std division, for the same reason (the std contains R_{i,k}); whiten the result over the whole
    batch if a scale is wanted.

    Conditioned on the action, E[A_{i,k} | s, a] = Q(s, a) - E[b]: with the state baseline (and keys
    that identify the state, visited once per episode) that is the true advantage Q(s, a) - V(s);
    the position baseline subtracts the mean value of all states seen at turn k instead, still an
    unbiased gradient but a noisier per-turn signal where states at one turn index differ. A state's
    value can depend on the turns left (a max_turns budget): fold the turn index into the key when
    it does.

    turn_rewards, turn_mask: (B, K), turn_mask 1 on the turns episode i took (a prefix of the row);
    state_keys (B, K) integers, needed for baseline="state". Returns advantages (B, K), 0 on turns
    not taken; broadcast them to tokens with broadcast_turns.
    """
    _check("turn baseline", baseline, TURN_BASELINES)
    valid = turn_mask.bool()
    B, K = valid.shape
    G = group_size
    if G < 1 or B % G != 0:
        raise ValueError(f"batch of {B} episodes is not a whole number of groups of size {G}")
    if baseline == "state" and (state_keys is None or state_keys.shape != (B, K)):
        raise ValueError(f"baseline='state' needs state_keys of shape ({B}, {K})")
    r = torch.where(valid, turn_rewards, 0.0)
    r = r if r.is_floating_point() else r.float()
    # --- algorithm ---
    # (B, K) the returns R_{i,k}: GAE with V = 0 and lam = 1
    returns, _ = compute_gae(r, torch.zeros_like(r), valid, gamma, 1.0)
    position = torch.arange(K, device=valid.device).expand(B, K)
    b, n = _loo_baseline(returns, valid, position, G)  # (B, K), (B, K)
    if baseline == "state":
        b_state, n_state = _loo_baseline(returns, valid, state_keys, G)
        # a turn whose state no other episode visited keeps the position baseline
        b = torch.where(n_state > 0, b_state, b)
        n = torch.where(n_state > 0, n_state, n)
    adv = returns - torch.where(n > 0, b, 0.0)
    # --- end algorithm ---
    return torch.where(valid, adv, 0.0)


def _loo_baseline(returns, valid, keys, G: int):
    """Mean of R_{j,k'} over the turns of the OTHER episodes of the group with
    keys[j,k'] == keys[i,k], and its count.

    (B, K) -> (B, K), (B, K). Turn (i, k) is compared with every turn of its group: (G K) x (G K)
    per group.
    """
    B, K = returns.shape
    # a group's turns side by side: R, v and key are (B/G, G K); episode (G K,) is each turn's
    R = returns.reshape(-1, G * K)
    v = valid.reshape(-1, G * K)
    key = keys.reshape(-1, G * K)
    episode = torch.arange(G, device=R.device).repeat_interleave(K)
    other = episode[:, None] != episode[None, :]  # (G K, G K) never the own episode
    # (B/G, G K, G K)
    match = (key[:, :, None] == key[:, None, :]) & other & v[:, :, None] & v[:, None, :]
    n = match.sum(dim=2)  # (B/G, G K)
    total = (match.to(R.dtype) * torch.where(v, R, 0.0)[:, None, :]).sum(dim=2)
    return (total / n.clamp(min=1)).reshape(B, K), n.reshape(B, K)


def broadcast_turns(turn_values, turn_index):
    """Give every token its turn's value: out[b, t] = turn_values[b, turn_index[b, t]], and 0
    where turn_index < 0.

    turn_values (B, K); turn_index (B, T) integers, the assistant turn a token belongs to, -1 on
    prompt, tool output and padding tokens. Returns (B, T).
    """
    K = turn_values.shape[1]
    if (turn_index >= K).any():
        raise ValueError(f"turn_index holds a turn >= K = {K}")
    out = turn_values.gather(1, turn_index.clamp(min=0).long())  # (B, T)
    return torch.where(turn_index >= 0, out, 0.0)


# ------------------------------------------------------------------------ off-policy corrections

OFF_POLICY_KINDS = ("none", "tis", "mis")
OFF_POLICY_LEVELS = ("token", "sequence")


@dataclass
class OffPolicyConfig:
    """How the learner corrects for samples drawn from the engine's mu instead of pi_old
    (off_policy_weights)."""

    # none: weight 1 (metrics only) | tis: truncated IS | mis: masked IS
    kind: str = "none"
    # token: one weight per token | sequence: one weight per sequence
    level: str = "token"
    # tis: the weight is min(ratio, tis_cap)
    tis_cap: float = 2.0
    # mis: ratios outside [mis_low, mis_high] are masked (weight 0)
    mis_low: float = 0.5
    # mis: the upper end of that band
    mis_high: float = 2.0


def off_policy_weights(old_logp, behaviour_logp, mask, cfg: OffPolicyConfig):
    """Per-token weights that make samples from the engine's mu count as samples from pi_old.
    All (B, T).

    With rho_t = pi_old(y_t) / mu(y_t) (old_logp is the learner's recomputation, behaviour_logp
    the engine's):
        none, any level   w_t = 1
                          no correction; the metrics still say how far off-policy the batch is
        tis,  token       w_t = min(rho_t, cap)
                          truncated IS (IMPALA's rho-bar, arXiv:1802.01561; Yao et al. 2025)
        tis,  sequence    w_t = min(prod_t rho_t, cap)
                          the exact sequence ratio, truncated
        mis,  token       w_t = rho_t [low <= rho_t <= high]
                          IcePop (arXiv:2510.18855): a token the two engines disagree on leaves
                          the gradient
        mis,  sequence    w_t = g_i [low <= g_i <= high],  g_i = exp(mean_t log rho_t)
                          the whole sequence is dropped when its geometric-mean ratio leaves the
                          band (ICEPOP-style two-sided masking, GSPO's length-normalised ratio as
                          the weight)
    Truncation keeps every sample and bounds its weight (a small bias for a bounded variance);
    masking drops the samples where the engine and the learner disagree most (they are likely
    numerical accidents, e.g. an MoE routing flip), so they contribute nothing rather than a capped,
    still-wrong gradient. The product of a long sequence's ratios leaves any band almost surely, so
    sequence masking uses the geometric mean (verl's "geometric" rejection, Liu, Li et al. 2025).
    Multiply the result into policy_loss(..., weights=w).

    Returns (weights (B, T), detached, 0 off the mask; metrics, 0-dim, detached):
        offpolicy_weight_mean       mean w over valid tokens
        offpolicy_clip_frac         share of valid tokens whose weight the tis cap truncated
        offpolicy_token_masked_frac share of valid tokens whose weight mis set to 0
        offpolicy_seq_masked_frac   share of sequences (with a valid token) with at least one
                                    masked token
        mismatch_kl_k1              mean log mu - log pi_old: k1 estimate of KL(mu || pi_old)
        mismatch_kl_k3              mean rho - 1 - log rho: k3 estimate of KL(mu || pi_old), >= 0
    """
    _check("off-policy kind", cfg.kind, OFF_POLICY_KINDS)
    _check("off-policy level", cfg.level, OFF_POLICY_LEVELS)
    if cfg.kind == "tis" and cfg.tis_cap <= 0:
        raise ValueError(f"tis needs tis_cap > 0, got {cfg.tis_cap}")
    if cfg.kind == "mis" and not 0 < cfg.mis_low <= 1 <= cfg.mis_high:
        raise ValueError(
            f"mis needs 0 < mis_low <= 1 <= mis_high, got [{cfg.mis_low}, {cfg.mis_high}]"
        )
    valid = mask.bool()
    log_rho = torch.where(valid, old_logp - behaviour_logp, 0.0).detach()  # (B, T) garbage removed
    zeros = torch.zeros_like(valid)
    clipped, masked = zeros, zeros  # (B, T) bool
    # --- algorithm ---
    if cfg.kind == "none":
        w = torch.ones_like(log_rho)
    elif cfg.kind == "tis":
        log_r = (
            log_rho if cfg.level == "token" else log_rho.sum(dim=1, keepdim=True).expand_as(log_rho)
        )
        w = log_r.clamp(max=20.0).exp().clamp(max=cfg.tis_cap)  # min(r, cap): IMPALA's rho-bar
        clipped = log_r > _log(cfg.tis_cap)
    else:  # mis
        log_r = (
            log_rho if cfg.level == "token" else _seq_log_ratio(log_rho, valid).expand_as(log_rho)
        )
        masked = (log_r < _log(cfg.mis_low)) | (log_r > _log(cfg.mis_high))
        # in the band, the weight is the ratio itself
        w = log_r.exp()
    w = torch.where(valid & ~masked, w, 0.0)
    # --- end algorithm ---
    with torch.no_grad():
        clipped, masked = clipped & valid, masked & valid
        has_token = valid.any(dim=1)
        seq_masked = masked.any(dim=1) & has_token
        log_rho_c = log_rho.clamp(max=20.0)  # rho < e^20: k3 stays finite
        metrics = {
            "offpolicy_weight_mean": _metric_mean(w, valid, per_seq=False),
            "offpolicy_clip_frac": _metric_mean(clipped.to(w.dtype), valid, per_seq=False),
            "offpolicy_token_masked_frac": _metric_mean(masked.to(w.dtype), valid, per_seq=False),
            "offpolicy_seq_masked_frac": (
                seq_masked.sum().to(w.dtype) / has_token.sum().clamp(min=1)
            ),
            "mismatch_kl_k1": _metric_mean(-log_rho, valid, per_seq=False),
            "mismatch_kl_k3": _metric_mean(
                torch.expm1(log_rho_c) - log_rho_c, valid, per_seq=False
            ),
        }
    return w, metrics


def _log(x: float) -> float:
    """log of a positive Python number, as a Python float (a bound usable on any device)."""
    return torch.tensor(x, dtype=torch.float64).log().item()


# ------------------------------------------------------------ sampling truncation (top-k / top-p)


def truncation_mask(logits, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """The set of tokens a top-k / top-p sampler may draw from, as a boolean mask.
    logits (..., V) -> bool (..., V).

    With z = logits / temperature and p = softmax(z), in the order vLLM and HF apply them:
        top-k   v is kept iff fewer than k tokens have z_u > z_v                         (0: off)
        top-p   with p' = p renormalised over the top-k set, v is kept iff it is in that set and
                sum_{u : z_u > z_v} p'_u < top_p                                         (1: off)
    i.e. nucleus sampling (Holtzman et al. 2019, arXiv:1904.09751) keeps the smallest top set whose
    mass reaches top_p: a token is dropped once the tokens strictly more likely than it already hold
    top_p. The top token has nothing above it, so it is always kept. Ties: both rules compare
    strictly greater logits, so tokens with equal logits are kept or dropped together; the kept set
    is {v : z_v >= threshold}, whatever order a sort puts ties in (deterministic, and the same on
    every engine). The engine samples from softmax(z) restricted to this set, and the learner must
    score with the same set (truncated_logprobs): then the on-policy ratio is 1. The engine can
    return the set compactly as its size, kept.sum(-1), and the learner rebuild it on its own logits
    with kept_mask_from_size.
    """
    if temperature <= 0:
        raise ValueError(
            f"truncation needs temperature > 0 (greedy decoding is an argmax), got {temperature}"
        )
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0: off), got {top_k}")
    # z, sorted_z, order and keep are (..., V); keep is in sorted order until the end
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    V = z.shape[-1]
    sorted_z, order = z.sort(dim=-1, descending=True, stable=True)
    keep = torch.ones_like(sorted_z, dtype=torch.bool)
    # --- algorithm ---
    if 0 < top_k < V:
        keep = sorted_z >= sorted_z[..., top_k - 1 : top_k]  # ties with the k-th all kept
    if top_p < 1:
        # p (..., V), renormalised over the top-k set
        p = torch.softmax(sorted_z.masked_fill(~keep, -torch.inf), dim=-1)
        cum = p.cumsum(dim=-1)
        # the mass of the tokens above each one: an exclusive prefix sum
        mass_above = torch.cat([torch.zeros_like(cum[..., :1]), cum[..., :-1]], dim=-1)
        n_keep = ((mass_above < top_p) & keep).sum(dim=-1, keepdim=True)  # >= 1: mass_above[0] = 0
        # (..., 1) the last kept logit; its ties join it
        threshold = sorted_z.gather(-1, n_keep - 1)
        keep = keep & (sorted_z >= threshold)
    # --- end algorithm ---
    return torch.zeros_like(keep).scatter(-1, order, keep)  # (..., V) back in vocab order


def kept_mask_from_size(logits, kept_size, tokens=None):
    """Rebuild a sampler's kept set from its size: the kept_size[n] tokens with the largest
    logits, as bool (..., V).

    logits (..., V) (at any positive temperature: the ranking is the same); kept_size (...) integers
    in [1, V], the engine's truncation_mask(...).sum(-1). On the engine's own logits this returns
    exactly its set, ties included (the set is closed under ties, so any order of the ties gives
    it). On the learner's logits, which differ from the engine's by rounding, the set is the
    learner's own top kept_size. `tokens` (...), optional: the sampled tokens are kept even if a
    rounding difference pushed one just outside, so its log-prob is finite (the engine did draw it);
    on equal logits this changes nothing.
    """
    V = logits.shape[-1]
    k = kept_size.long()
    if ((k < 1) | (k > V)).any():
        raise ValueError(f"kept_size must be in [1, V = {V}]")
    order = logits.argsort(dim=-1, descending=True, stable=True)
    in_top = torch.arange(V, device=logits.device) < k[..., None]  # (..., V) rank < k
    kept = torch.zeros_like(in_top).scatter(-1, order, in_top)  # (..., V) vocab order
    if tokens is not None:
        kept = kept.scatter(-1, tokens[..., None].long(), True)
    return kept


def truncated_logprobs(logits, tokens, kept, temperature: float):
    """log p(y) under the truncated, renormalised sampler: log softmax(logits / T, restricted
    to kept) at y.

        log p(y) = z_y - log sum_{v in kept} exp(z_v),   z = logits / T,   y in kept

    logits (..., V) with grad, tokens (...), kept bool (..., V) (truncation_mask or
    kept_mask_from_size) -> (...). Gradients flow through the kept logits only; a dropped logit does
    not enter the normaliser, so it gets no gradient (that is the distribution the engine sampled
    from). A token outside `kept` gets -inf.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    logp = torch.log_softmax(z.masked_fill(~kept, -torch.inf), dim=-1)  # (..., V) -inf off the set
    return logp.gather(-1, tokens[..., None].long()).squeeze(-1)  # (...)


def kept_size_from_logprob(logits, tokens, logprob, temperature: float):
    """The size n of the top-n set under which token y has the truncated log-prob `logprob`,
    as long (...).

        n = argmin_n | z_y - log sum_{top n} exp(z) - logprob |,   z = logits / T,
        over n > #{v : z_v > z_y}

    For an engine that reports the log-prob of its sample under the truncated distribution but not
    the set it kept (vLLM with logprobs_mode=processed_logprobs). logits (..., V), tokens (...),
    logprob (...). The top-n log-sum-exp grows with n (each token adds mass), so z_y - LSE_n falls
    with n and the match is unique, except among tail tokens whose mass is below float rounding,
    where every choice gives the same log-prob to that rounding. n is at least y's rank: y was
    drawn, so it was kept. On the logits that sampled it gives the set truncation_mask chose; on
    logits that differ by rounding, the set that reproduces the engine's log-prob best. Rebuild the
    set with kept_mask_from_size(logits, n, tokens).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    V = z.shape[-1]
    # (..., V) the log-sum-exp of the top n, for n = 1..V
    lse = z.sort(dim=-1, descending=True).values.logcumsumexp(dim=-1)
    z_y = z.gather(-1, tokens[..., None].long())
    # --- algorithm ---
    gap = (z_y - lse - logprob[..., None].to(z.dtype)).abs()  # (..., V) at n = 1..V
    above = (z > z_y).sum(dim=-1, keepdim=True)  # (..., 1) tokens ranked above y
    # n - 1 < above: y is not in the set
    gap = gap.masked_fill(torch.arange(V, device=z.device) < above, torch.inf)
    # --- end algorithm ---
    return gap.argmin(dim=-1) + 1  # (...) the first best n
