"""bench/long_context.py: prefill time and peak memory of long prompts, the engine's chunked prefill
against torch's fused causal attention over the same prompt and against the attention FLOP floor;
the learner's one-row update the same way.

    .venv/bin/python bench/long_context.py                      # 1k-64k, the default model's shape
    .venv/bin/python bench/long_context.py --lengths 1024 8192 --learner-lengths 2048
    .venv/bin/python bench/long_context.py --hidden 320 --layers 8 --heads 8 --kv-heads 2  # ~10M

The model has the embedded default model's shape (a Qwen2 of 128 hidden, 4 layers, 4 query and 2
key/value heads, 1,024 tokens) with max_position_embeddings raised to 131,072, nothing else changed;
its weights are random (time and memory do not depend on them). Every measurement runs in a fresh
process, one thread, so its peak RSS (ru_maxrss) is its own:
  engine   TorchEngine.generate([prompt], 4 new tokens), rollout.prefill_chunk_tokens (2,048): the
           chunked prefill of wings/long_context.py, the KV cache, the decode;
  whole    the same call with the chunk as long as the prompt: the path every prompt took before
           (the (S, S) mask), up to --whole-max tokens;
  fused    model.hidden_states over the unpadded prompt, no cache: torch's fused causal
           scaled_dot_product_attention over the whole prompt, the kernel a user would reach for;
  learner  one row through model.token_logprobs, a loss, backward (the learner's update of one
           sequence, activation checkpointing off).
The floor is the attention's matmul FLOPs (causal: 2 x S^2 x nh x hd x layers, QK and PV) at this
machine's measured fp32 matmul rate, one thread. Prints a markdown table with the ratios.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def model_of(args):
    from model import ModelConfig, init_model

    cfg = ModelConfig(
        model_type="qwen2",
        vocab_size=1024,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or int(args.hidden * 2.75),
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=1 << 17,
        tie_word_embeddings=True,
    )
    return init_model(cfg, 0).eval()


def measure(args) -> dict:
    """One measurement, in this (fresh) process -> {seconds, peak_gb}."""
    import torch

    from rollout import SamplingParams, TorchEngine

    torch.set_num_threads(1)
    model = model_of(args)
    S = args.length
    prompt = torch.randint(3, 1024, (S,), generator=torch.Generator().manual_seed(0)).tolist()
    t0 = time.perf_counter()
    if args.mode in ("engine", "whole"):
        chunk = S if args.mode == "whole" else args.chunk
        engine = TorchEngine(model, 0, prefill_chunk_tokens=chunk)
        engine.generate([prompt], SamplingParams(temperature=0, max_tokens=4))
    elif args.mode == "fused":
        with torch.no_grad():
            model.hidden_states(torch.tensor([prompt]))
    elif args.mode == "learner":
        model.train()
        ids = torch.tensor([prompt])
        mask = torch.ones(1, S)
        logp = model.token_logprobs(ids, mask=mask)
        (-logp.sum() / S).backward()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}


def serve_refusal(args, tokens: int = 72_000) -> tuple[int, float, int]:
    """A request of about `tokens` prompt tokens (a coding harness's first request is 20-70k) to
    wings.serve over a model whose context is 2,048 -> (prompt tokens, seconds to the answer, HTTP
    status), the server started here on a free port."""
    import urllib.error
    import urllib.request

    from sft import SPECIAL_TOKENS, train_tokenizer
    from wings.serve import Server
    from rollout import TorchEngine

    words = [f"word{i % 97} " for i in range(4000)]
    tok = train_tokenizer(["".join(words)], 300, SPECIAL_TOKENS)
    model = model_of(args)
    model.cfg.max_position_embeddings = 2048
    server = Server(TorchEngine(model, 0), tok, "long", max_model_len=2048)
    url = server.start()
    # as many words as make about `tokens` tokens of this tokenizer
    per_word = len(tok.encode("".join(words)).ids) / len(words)
    text = "".join(words[i % 4000] for i in range(int(tokens / per_word)))
    body = json.dumps(
        {"model": "long", "messages": [{"role": "user", "content": text}], "max_tokens": 32000}
    ).encode()
    request = urllib.request.Request(
        url + "/chat/completions", body, {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    try:
        status = urllib.request.urlopen(request).status
    except urllib.error.HTTPError as e:
        status, answer = e.code, json.loads(e.read())
    seconds = time.perf_counter() - t0
    server.stop()
    n = int(answer["error"]["message"].split("the prompt has ")[-1].split()[0].strip(","))
    return n, seconds, status


def matmul_rate() -> float:
    """fp32 FLOP/s of a (1024 x 1024) @ (1024 x 1024) matmul, one thread, best of 5."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * 1024**3 / best


def run(args, mode: str, length: int) -> dict:
    argv = [sys.executable, __file__, "--one", mode, str(length)] + shape_args(args)
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def shape_args(args) -> list[str]:
    return [
        "--hidden", str(args.hidden), "--layers", str(args.layers), "--heads", str(args.heads),
        "--kv-heads", str(args.kv_heads), "--intermediate", str(args.intermediate or 0),
        "--chunk", str(args.chunk),
    ]  # fmt: skip


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--lengths", type=int, nargs="+", default=[1024, 4096, 8192, 16384, 32768, 65536]
    )
    p.add_argument("--learner-lengths", type=int, nargs="+", default=[2048, 8192, 16384, 32768])
    p.add_argument("--whole-max", type=int, default=16384, help="the old path up to this length")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=352)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--chunk", type=int, default=2048, help="rollout.prefill_chunk_tokens")
    p.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        args.mode, args.length = args.one[0], int(args.one[1])
        print(json.dumps(measure(args)))
        return
    rate = matmul_rate()
    hd = args.hidden // args.heads
    print(
        f"model: {args.hidden} hidden, {args.layers} layers, {args.heads}/{args.kv_heads} heads; "
        f"chunk {args.chunk}; matmul {rate / 1e9:.1f} GFLOP/s (one thread)\n"
    )
    print(
        "| prompt tokens | engine s | engine GB | whole s | whole GB | fused s | fused GB "
        "| engine / fused | floor s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    rows = {}
    for S in args.lengths:
        e = run(args, "engine", S)
        w = run(args, "whole", S) if S <= args.whole_max else None
        f = run(args, "fused", S)
        floor = 2 * S * S * args.heads * hd * args.layers / rate
        rows[S] = e
        whole = f"{w['seconds']:.2f} | {w['peak_gb']:.2f}" if w else "- | -"
        print(
            f"| {S:,} | {e['seconds']:.2f} | {e['peak_gb']:.2f} | {whole} | {f['seconds']:.2f} | "
            f"{f['peak_gb']:.2f} | {e['seconds'] / f['seconds']:.2f} | {floor:.2f} |",
            flush=True,
        )
    if len(rows) > 1:
        hi = max(rows)
        lo = 8192 if 8192 in rows and 8192 < hi else min(rows)
        print(
            f"\nengine peak memory at {hi:,} / at {lo:,}: "
            f"{rows[hi]['peak_gb'] / rows[lo]['peak_gb']:.2f}x for {hi / lo:.0f}x the tokens"
        )
    print("\n| update tokens | learner s | learner GB | floor s (x3: forward + backward) |")
    print("|---|---|---|---|")
    learner = {}
    for S in args.learner_lengths:
        r = run(args, "learner", S)
        learner[S] = r
        floor = 3 * 2 * S * S * args.heads * hd * args.layers / rate
        print(f"| {S:,} | {r['seconds']:.2f} | {r['peak_gb']:.2f} | {floor:.2f} |", flush=True)
    if len(learner) > 1:
        hi = max(learner)
        lo = 8192 if 8192 in learner and 8192 < hi else min(learner)
        print(
            f"\nlearner memory at {hi:,} / at {lo:,}: "
            f"{learner[hi]['peak_gb'] / learner[lo]['peak_gb']:.2f}x"
        )
    n, seconds, status = serve_refusal(args)
    print(
        f"\na {n:,}-token request (max_tokens 32,000) to wings.serve, context 2,048: "
        f"answered {status} in {seconds:.2f} s"
    )


if __name__ == "__main__":
    main()
