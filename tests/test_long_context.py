"""Tests for long contexts: chunked prefill (wings/long_context.py, TorchEngine.prefill), the
KV cache that grows as it is used (rollout.KVCache), the decode step without a mask where every key
is real, and the server's admission by context and memory budget (wings/serve.py, wings/batcher.py).

Oracles: the whole-prompt forward (a prompt run in chunks gives the same hidden states and keys
up to float rounding, and the same greedy tokens through every engine piece); the code as it was (a
prompt no longer than a chunk takes exactly the old path, bit for bit); the official `openai` and
`anthropic` clients reading the server's refusals. The chunk sizes are tiny, so every path runs in
milliseconds; bench/long_context.py measures the long prompts themselves.
"""

import copy
import dataclasses

import pytest
import torch

import rollout
from conftest import need
from model import ModelConfig, init_model
from rollout import KVCache, SamplingParams, TorchEngine, make_engine
from test_agent import tok  # noqa: F401 (a fixture)
from test_openai_engine import tiny_model
from test_serve import post
from wings.long_context import prefill
from wings.serve import Server

MODEL = "tiny"


def left_padded(lengths: list[int], vocab: int, new: int = 4, seed: int = 0):
    """Prompts of these lengths, left-padded as TorchEngine lays them out -> (ids (B, S), positions
    (B, S), real (B, S + new))."""
    g = torch.Generator().manual_seed(seed)
    S = max(lengths)
    ids = torch.randint(0, vocab, (len(lengths), S), generator=g)
    real = torch.zeros(len(lengths), S + new, dtype=torch.bool)
    for i, n in enumerate(lengths):
        real[i, S - n :] = True
    positions = (real[:, :S].long().cumsum(-1) - 1).clamp(min=0)
    return ids, positions, real


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("lengths", [[37], [37, 5, 23, 37], [9, 40]])
def test_a_prompt_prefilled_in_chunks_is_the_whole_prompt_prefilled(family, lengths):
    cfg = ModelConfig(
        model_type=family,
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = init_model(cfg, 0).eval()
    ids, positions, real = left_padded(lengths, cfg.vocab_size)
    B, S = ids.shape
    whole = KVCache(cfg, B, S + 4)
    with torch.no_grad():
        h_whole = prefill(model, ids, positions, real, whole, chunk_tokens=S)
        for chunk in (1, 4, 7, 16, S - 1):
            cache = KVCache(cfg, B, S + 4)
            h = prefill(model, ids, positions, real, cache, chunk_tokens=chunk)
            torch.testing.assert_close(h, h_whole, rtol=0, atol=2e-6)
            # every real key and value the same (padding columns are never read)
            keys = real[:, None, :S, None]
            for a, b in zip(cache.k + cache.v, whole.k + whole.v):
                torch.testing.assert_close(
                    a[:, :, :S].masked_fill(~keys, 0),
                    b[:, :, :S].masked_fill(~keys, 0),
                    rtol=0,
                    atol=2e-6,
                )


def test_a_prompt_no_longer_than_a_chunk_takes_the_whole_prompt_path_bit_for_bit():
    model = tiny_model(97, 0).eval()
    ids, positions, real = left_padded([30, 12, 30], 97)
    with torch.no_grad():
        old = KVCache(model.cfg, 3, 34)
        h_old = model.hidden_states(ids, positions, real, old)[:, -1:]
        new = KVCache(model.cfg, 3, 34)
        h_new = TorchEngine(model, 0, prefill_chunk_tokens=30).prefill(ids, positions, real, new)
    assert torch.equal(h_old, h_new)
    assert all(torch.equal(a, b) for a, b in zip(old.k + old.v, new.k + new.v))


def test_a_decode_step_over_real_keys_builds_no_mask_and_computes_the_same(monkeypatch):
    model = tiny_model(97, 0).eval()
    masks = []
    forward = model.hidden_states

    def spy(ids, positions=None, key_padding_mask=None, kv_cache=None, mask=None):
        if ids.shape[1] == 1:  # a decode step
            masks.append(key_padding_mask)
        return forward(ids, positions, key_padding_mask, kv_cache, mask)

    monkeypatch.setattr(model, "hidden_states", spy)
    engine = TorchEngine(model, 0)
    params = SamplingParams(temperature=0, max_tokens=3)
    engine.generate([[5, 6, 7], [8, 9, 10]], params)  # one length: no padding
    assert masks and all(m is None for m in masks)
    masks.clear()
    engine.generate([[5, 6, 7], [8, 9]], params)
    assert masks and all(m is not None for m in masks)
    # and a mask of real keys only computes exactly what no mask does
    ids, positions, real = left_padded([20, 20], 97)
    with torch.no_grad():
        outs = []
        for mask in (real, None):
            cache = KVCache(model.cfg, 2, 24)
            forward(ids, positions, real, cache)
            outs.append(forward(ids[:, -1:], positions[:, -1:] + 1, mask, cache))
    assert torch.equal(*outs)


def test_the_kv_cache_holds_what_it_is_given_and_grows_as_it_is_used():
    cfg = tiny_model(97, 0).cfg
    cache = KVCache(cfg, 2, max_len=100, reserve=10)
    assert cache.k[0].shape[2] == 10
    written = []
    for n in (6, 4, 1, 20):
        k = torch.randn(2, cfg.num_key_value_heads, n, cfg.head_dim)
        for layer in range(cfg.num_hidden_layers):
            got, _ = cache.update(layer, k, k)
        cache.pos += n
        written.append(k)
        assert torch.equal(got, torch.cat(written, dim=2))
    assert cache.k[0].shape[2] == 31 * 3 // 2  # grown to 1.5x the columns needed
    with pytest.raises(ValueError, match="overflow"):
        cache.update(0, torch.randn(2, cfg.num_key_value_heads, 70, cfg.head_dim), k)


@pytest.mark.parametrize(
    "pieces",
    [
        {},
        {"decode": "fast"},
        {"prefix_cache_tokens": 4096},
        {"concurrent": True},
    ],
)
def test_every_torch_engine_piece_samples_the_same_with_chunks(pieces, monkeypatch):
    """Greedy tokens and log-probs with 5-token chunks equal those of whole prompts, for the plain
    engine and each of its pieces; and no cache reserves a 1,500-token request's columns."""
    model = tiny_model(97, 0).eval()
    columns = []

    class Recorded(KVCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            columns.append(self.k[0].shape[2])

    for where in ("rollout", "wings.prefix_cache", "wings.fast_decode"):
        module = pytest.importorskip(where)
        monkeypatch.setattr(module, "KVCache", Recorded)
    prompts = [list(range(3, 3 + n)) for n in (23, 9, 30)]
    params = SamplingParams(n=2, temperature=0, max_tokens=6)
    outs = []
    for chunk in (64, 5):
        engine = make_engine(
            "torch", "", pad_id=0, model=copy.deepcopy(model), prefill_chunk_tokens=chunk, **pieces
        )
        out = engine.generate(prompts, params)
        # a second turn, continuing the first: the prefix cache's hits
        again = [p + o.token_ids for p, o in zip(prompts, out[::2])]
        outs.append(out + engine.generate(again, params))
        long = engine.generate([prompts[0]], dataclasses.replace(params, max_tokens=1500))
        assert len(long[0].token_ids) == 1500
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    for a, b in zip(outs[0], outs[1]):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
    assert columns and max(columns) < 30 + rollout.DECODE_RESERVE + 1


def test_a_long_request_is_refused_by_the_dialect_and_the_server_serves_the_next(tok):
    """Past the context: OpenAI's context_length_exceeded, Anthropic's invalid_request_error; past
    the memory budget the same, before any tensor is made; then an ordinary request on the same
    server is answered."""
    openai = need("openai", "the official OpenAI client")
    anthropic = need("anthropic", "the official Anthropic client")
    model = tiny_model(tok.get_vocab_size(), 0, max_position_embeddings=1 << 17).eval()
    engine = TorchEngine(model, 0, prefill_chunk_tokens=64)
    # a budget of 1 MiB: this model's keys and values take 512 bytes a token
    server = Server(engine, tok, MODEL, max_model_len=600, memory_budget_bytes=1 << 20)
    server.start()
    try:
        chat = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
        messages = anthropic.Anthropic(
            base_url=server.url[: -len("/v1")], api_key="unused", max_retries=0
        )
        too_long = "count " * 2000
        ordinary = [{"role": "user", "content": "What is 2+3?"}]
        with pytest.raises(openai.BadRequestError) as e:
            chat.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": too_long}], max_tokens=8
            )
        assert e.value.code == "context_length_exceeded"
        with pytest.raises(anthropic.BadRequestError) as e:
            messages.messages.create(
                model=MODEL, max_tokens=8, messages=[{"role": "user", "content": too_long}]
            )
        assert e.value.body["error"]["type"] == "invalid_request_error"
        # within the context, past the memory budget: 64 samples of 500 tokens
        status, body = post(
            server.url,
            "/chat/completions",
            {"model": MODEL, "messages": ordinary, "max_tokens": 500, "n": 64},
        )
        assert status == 400 and body["error"]["code"] == "context_length_exceeded"
        assert "memory budget" in body["error"]["message"]
        reply = chat.chat.completions.create(model=MODEL, messages=ordinary, max_tokens=8)
        assert reply.choices[0].finish_reason in ("stop", "length")
    finally:
        server.stop()


def test_a_prompt_longer_than_a_chunk_is_served_as_the_engine_samples_it(tok):
    """A lone request is the engine's own call, bit for bit (as tests/test_serve.py has it), and so
    is one whose prompt runs in chunks."""
    model = tiny_model(tok.get_vocab_size(), 0, max_position_embeddings=4096).eval()
    server = Server(TorchEngine(copy.deepcopy(model), 0, prefill_chunk_tokens=16), tok, MODEL)
    server.start()
    try:
        status, reply = post(
            server.url,
            "/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "count " * 100}],
                "max_tokens": 8,
                "temperature": 0,
                "user": "long",
            },
        )
        assert status == 200, reply
        (call,) = server.capture.calls("long")
        assert len(call.prompt_ids) > 100
        params = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=server.turn_ends)
        direct = TorchEngine(model, 0, prefill_chunk_tokens=16).generate([call.prompt_ids], params)
        assert call.samples[0].token_ids == direct[0].token_ids
        assert call.samples[0].logprobs == direct[0].logprobs
    finally:
        server.stop()
