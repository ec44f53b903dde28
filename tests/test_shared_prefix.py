"""learner.shared_prefix: rows that share their first tokens run them once (model.PrefixKV), and
nothing else changes.

The reference is the plain path (every row whole), in float64, where both are exact to ~1e-16: the
gradient and the losses must agree to 1e-10 relative, on single-turn groups, multi-turn rows
(observations masked out, some samples agreeing past the prompt), rows that share nothing, every
micro-batch split and token budget, gradient checkpointing, the KL and entropy terms, top-k scoring,
LoRA, and the scoring passes (old, reference). tests/test_distributed.py checks the same gradient
under two-process FSDP on gloo.
"""

import copy

import pytest
import torch

from learner import (
    LearnerConfig,
    TrainBatch,
    compute_logprobs,
    make_learner,
    train_step,
    truncated_score,
)
from microbatch import rank_micro_batches, row_lens
from model import ModelConfig, PrefixKV, SharedPrefix, init_model

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
TOL = 1e-10


def rows_of(kind: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (B, T), loss mask (B, T)) of a batch of `kind`:
    single  3 groups of 4 samples after a shared prompt (lengths 6-8), two samples of a group
            agreeing on their first 2 tokens, and one row alone;
    multi   2 groups of 4 multi-turn rows: prompt, sampled turn, observation (masked), sampled turn;
            two rows of a group identical through their first turn and observation;
    none    8 rows that share nothing (every row whole: the plain forward), one with no trained
            token."""
    g = torch.Generator().manual_seed(seed)
    T = 30
    ids, mask = torch.zeros(0, T, dtype=torch.long), torch.zeros(0, T)

    def add(parts):  # parts: [(tokens, trained)]
        nonlocal ids, mask
        row, m, t = torch.zeros(1, T, dtype=torch.long), torch.zeros(1, T), 0
        for tok, trained in parts:
            row[0, t : t + len(tok)], m[0, t : t + len(tok)] = tok, float(trained)
            t += len(tok)
        ids, mask = torch.cat([ids, row]), torch.cat([mask, m])

    def rand(n):
        return torch.randint(1, CFG.vocab_size, (n,), generator=g)

    if kind == "single":
        for k in range(3):
            prompt = rand(6 + k)
            first = rand(2)
            for i in range(4):
                sample = rand(3 + (i * 5 + k) % 7)
                if i in (1, 2):
                    sample[:2] = first
                add([(prompt, 0), (sample, 1)])
        add([(rand(9), 0), (rand(4), 1)])
    elif kind == "multi":
        for k in range(2):
            prompt, turn, obs = rand(5 + k), rand(3), rand(4)
            for i in range(4):
                a = turn if i < 2 else rand(2 + i)
                o = obs if i < 2 else rand(3)
                add([(prompt, 0), (a, 1), (o, 0), (rand(2 + (i + k) % 4), 1)])
    else:
        for i in range(8):
            add([(rand(4 + i % 3), 0), (rand(2 + i % 5), i != 3)])
    return ids, mask


def batch_of(kind: str) -> TrainBatch:
    ids, mask = rows_of(kind)
    g = torch.Generator().manual_seed(1)
    adv = torch.randn(len(ids), 1, generator=g) * mask  # (B, T)
    return TrainBatch(ids, mask, adv, old_from_update=True)


def update(model, batch: TrainBatch, cfg: LearnerConfig, ref=None) -> tuple[torch.Tensor, dict]:
    """The gradient the optimizer is given (flattened) and the metrics of one train_step."""
    state = make_learner(copy.deepcopy(model), cfg, seed=0, ref_model=ref)
    grads = []
    state.optimizer.register_step_pre_hook(
        lambda *_: grads.append(
            torch.cat([p.grad.flatten() for p in state.model.parameters() if p.requires_grad])
        )
    )
    _, metrics = train_step(state, batch, cfg)
    return grads[0], metrics


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).abs().max()) <= TOL * float(b.abs().max())


@pytest.fixture(scope="module")
def model():
    return init_model(CFG, seed=0).double()


SETTINGS = [
    dict(micro_batch_size=32),
    dict(micro_batch_size=3),
    dict(micro_batch_size=1),
    dict(max_tokens_per_micro_batch=40),
    dict(max_tokens_per_micro_batch=1),
    dict(gradient_checkpointing=True, micro_batch_size=5),
    dict(entropy_coef=0.01, policy_loss="gspo"),
]


@pytest.mark.parametrize("kind", ["single", "multi", "none"])
@pytest.mark.parametrize(
    "setting", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items())
)
def test_shared_prefixes_give_the_gradient_and_losses_of_whole_rows(model, kind, setting):
    batch = batch_of(kind)
    plain, m_plain = update(
        model, batch, LearnerConfig(grad_clip=0.0, shared_prefix=False, **setting)
    )
    shared, m_shared = update(
        model, batch, LearnerConfig(grad_clip=0.0, shared_prefix=True, **setting)
    )
    assert plain.abs().max() > 0
    assert close(shared, plain)
    for k in ("train/pg_loss", "train/entropy"):
        assert m_shared[k] == pytest.approx(m_plain[k], rel=TOL, abs=1e-14), k


def test_kl_term_and_the_scoring_passes_under_shared_prefixes(model):
    """The reference's log-probs (a KL term in the loss), pi_old from compute_logprobs (with top-k
    sets: the truncated score) and a second PPO epoch: all the same as whole rows."""
    batch = batch_of("multi")
    ref = init_model(CFG, seed=1).double()
    kept = torch.where(batch.loss_mask > 0, torch.tensor(5), torch.tensor(0))  # (B, T) top-5 sets
    scored = {}
    for share in (False, True):
        old = compute_logprobs(
            model,
            batch.input_ids,
            3,
            mask=batch.loss_mask,
            shared_prefix=share,
            score=truncated_score,
            score_args=kept,
        )  # (B, T)
        ref_lp = compute_logprobs(
            ref, batch.input_ids, 3, mask=batch.loss_mask, shared_prefix=share
        )
        cfg = LearnerConfig(
            grad_clip=0.0, shared_prefix=share, kl_coef=0.1, ppo_epochs=2, micro_batch_size=3
        )
        b = TrainBatch(
            batch.input_ids,
            batch.loss_mask,
            batch.advantages,
            old_logprobs=old - 0.05 * batch.loss_mask,
            ref_logprobs=ref_lp,
            kept_sizes=kept,
        )
        scored[share] = (old, ref_lp, *update(model, b, cfg, ref=copy.deepcopy(ref)))
    (old0, ref0, g0, m0), (old1, ref1, g1, m1) = scored[False], scored[True]
    assert close(old1, old0) and close(ref1, ref0) and close(g1, g0)
    assert m1["train/kl"] == pytest.approx(m0["train/kl"], rel=TOL)


def test_lora_adapters_get_the_same_gradient(model):
    from wings.lora import apply_lora

    batch = batch_of("single")
    grads = []
    for share in (False, True):
        m = copy.deepcopy(model)
        apply_lora(m, 4, 8.0, 0.0, ("q_proj", "v_proj", "down_proj"), seed=0)
        m.double()
        grads.append(
            update(m, batch, LearnerConfig(grad_clip=0.0, shared_prefix=share, lora_rank=4))[0]
        )
    assert grads[0].abs().max() > 0 and close(grads[1], grads[0])


def test_groups_are_found_from_the_ids_and_kept_whole():
    """A group's rows go to one micro-batch (split only by micro_batch_size), its prefix is the
    longest common prefix of its rows (past the prompt where samples agree), a row alone or a batch
    that shares nothing runs whole, and the positions run drop from rows x longest to about prompt +
    samples."""
    ids, mask = rows_of("single")
    lens = row_lens(mask)
    plan = rank_micro_batches(lens, 32, 0, (ids, mask))
    assert len(plan) == 1
    rows, _, shared = plan[0]
    assert sorted(rows.tolist()) == list(range(13))
    groups = [rows[shared.group == g].tolist() for g in range(len(shared.lens))]
    assert sorted(map(sorted, groups)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12]]
    for g, members in enumerate(groups):
        if len(members) > 1:
            block = ids[members]
            lcp = int((block != block[:1]).any(0).int().argmax())
            assert int(shared.lens[g]) == lcp
            assert lcp == 6 + members[0] // 4  # the prompt: rows 0 and 3 differ after it
    # micro_batch_size 3 splits each group of 4 into 3 + 1: no micro-batch mixes a group's rows with
    # another's
    for mb in rank_micro_batches(lens, 3, 0, (ids, mask)):
        assert len(mb.rows) <= 3
    plain = rank_micro_batches(row_lens(rows_of("none")[1]), 32, 0, rows_of("none"))
    assert all(mb.shared is None for mb in plain)


def test_prefix_kv_is_the_plain_forward(model):
    """model.shared_hidden_states: each row's hidden states equal the plain forward's at every
    position it is run for, prefixes and continuations (fp64: to 1e-12)."""
    ids, mask = rows_of("multi")
    lens = row_lens(mask)
    rows, _, shared = rank_micro_batches(lens, 32, 0, (ids, mask))[0]
    L = int(lens.max())
    x = ids[rows, :L]
    plain = model.hidden_states(x)  # (B, L, H)
    h, where = model.shared_hidden_states(x, shared)
    for b in range(len(rows)):
        n = int(lens[rows[b]]) - 1  # positions the row's scores read
        torch.testing.assert_close(h[where[b, :n]], plain[b, :n], rtol=0, atol=1e-12)
    assert isinstance(PrefixKV(), PrefixKV) and isinstance(shared, SharedPrefix)
