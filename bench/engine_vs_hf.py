"""bench/engine_vs_hf.py: TorchEngine.generate vs transformers' generate, same weights, prompts and
threads, one run.

    .venv/bin/python bench/engine_vs_hf.py                            # the default model's shape,
    ~10M, ~100M .venv/bin/python bench/engine_vs_hf.py --shapes default 10m --threads 2 --rows 32
    --max-tokens 96

For each shape a Qwen2 model with random weights (N(0, 0.02), model.init_model) is saved once and
loaded by both
sides: model.load_model for TorchEngine, AutoModelForCausalLM.from_pretrained for transformers
(fp32, its default SDPA attention). Both get the same `rows` distinct token-id prompts of different
lengths (left-padded for transformers, as TorchEngine pads them itself), sample at temperature 1
with no top-k/top-p and no stop token, and are forced to exactly max_tokens new tokens
(transformers: min_new_tokens = max_new_tokens, no eos). The logits of the two models are compared
first, so both really hold the same weights. After one warm-up call each the two take turns (A B A
B), `repeats` timed calls each; tokens/s is generated tokens over wall time, median over the calls.
Peak memory: a thread samples this process's RSS every 2 ms during each call; "peak extra RSS" is
the highest sample above the RSS before the call (the call's own buffers: KV cache, activations),
max over the calls. Shapes (vocabulary 1024, the embedded tokenizer's size, head_dim 64 except the
default):
  default  hidden 128, 4 layers, 4 heads / 2 kv, MLP 352, tied embeddings (the embedded default
  model, ~0.8M) 10m      hidden 384, 6 layers, 6 heads / 3 kv, MLP 1056 (~10M)
  100m     hidden 768, 14 layers, 12 heads / 6 kv, MLP 2112 (~100M)
transformers is only a benchmark dependency here (bash setup.sh test installs it).
"""

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from model import ModelConfig, init_model, load_model, save_model  # noqa: E402
from rollout import SamplingParams, TorchEngine  # noqa: E402

VOCAB, PAD = 1024, 0
SHAPES = {
    "default": dict(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=352,
        tie_word_embeddings=True,
    ),
    "10m": dict(
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=3,
        intermediate_size=1056,
        head_dim=64,
    ),
    "100m": dict(
        hidden_size=768,
        num_hidden_layers=14,
        num_attention_heads=12,
        num_key_value_heads=6,
        intermediate_size=2112,
        head_dim=64,
    ),
}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Highest RSS of this process above its value at entry, sampled every 2 ms while the block
    runs."""

    def __enter__(self):
        self.base, self.peak, self.running = rss_bytes(), 0, True
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def _poll(self):
        while self.running:
            self.peak = max(self.peak, rss_bytes() - self.base)
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, rss_bytes() - self.base)


def hf_generate(model, prompts: list[list[int]], max_tokens: int, seed: int) -> torch.Tensor:
    """transformers' generate on left-padded prompts, forced to exactly max_tokens new tokens -> (B,
    max_tokens)."""
    L = max(map(len, prompts))
    ids = torch.full((len(prompts), L), PAD, dtype=torch.long)
    mask = torch.zeros(len(prompts), L, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p) :] = torch.tensor(p)
        mask[i, L - len(p) :] = 1
    torch.manual_seed(seed)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        eos_token_id=None,
        pad_token_id=PAD,
    )
    return out[:, L:]


def bench_shape(name: str, args, transformers) -> str:
    tmp = tempfile.mkdtemp(prefix="bench_engine_hf_")
    cfg = ModelConfig(vocab_size=VOCAB, **SHAPES[name])
    save_model(init_model(cfg, seed=0), tmp)
    ours = load_model(tmp).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(
        args.min_prompt, args.max_prompt + 1, (args.rows,), generator=g
    ).tolist()
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]
    with torch.no_grad():  # the same weights, read the same way
        x = torch.tensor([prompts[0]])
        gap = float((ours(x) - hf(x).logits).abs().max())
    assert gap < 1e-3, f"{name}: the two models' logits differ by {gap}"

    engine = TorchEngine(ours, PAD, max_batch_size=args.rows)
    sides = {
        "engine": lambda seed: [
            o.token_ids
            for o in engine.generate(
                prompts, SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=seed)
            )
        ],
        "transformers": lambda seed: hf_generate(hf, prompts, args.max_tokens, seed).tolist(),
    }
    seconds = {side: [] for side in sides}
    peak = {side: 0 for side in sides}
    for r in range(args.repeats + 1):  # round 0 is the warm-up
        for side, run in sides.items():
            with PeakRSS() as mem:
                t0 = time.perf_counter()
                out = run(r)
                dt = time.perf_counter() - t0
            assert sum(map(len, out)) == args.rows * args.max_tokens, side  # the same work for both
            if r:
                seconds[side].append(dt)
                peak[side] = max(peak[side], mem.peak)
    tokens = args.rows * args.max_tokens
    speed = {side: tokens / statistics.median(ts) for side, ts in seconds.items()}
    params_m = sum(p.numel() for p in ours.parameters()) / 1e6
    return (
        f"| {name} ({params_m:.1f}M) | {speed['engine']:,.0f} | {speed['transformers']:,.0f} | "
        f"**{speed['engine'] / speed['transformers']:.2f}x** | {peak['engine'] / 2**20:.0f} | "
        f"{peak['transformers'] / 2**20:.0f} |"
    )


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--rows", type=int, default=16, help="distinct prompts, one sample each")
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per row, exactly")
    p.add_argument(
        "--repeats", type=int, default=3, help="timed calls per side, after one warm-up each"
    )
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    import transformers

    torch.set_num_threads(args.threads)
    rows = [bench_shape(name, args, transformers) for name in args.shapes]
    print(
        f"\n{args.rows} prompts of {args.min_prompt}-{args.max_prompt} tokens, "
        f"{args.max_tokens} new tokens each, temperature 1, fp32, {args.threads} thread(s), "
        f"median of {args.repeats} interleaved calls; "
        f"torch {torch.__version__}, transformers {transformers.__version__}"
    )
    print(
        "| shape | engine tokens/s | transformers tokens/s | engine / transformers "
        "| engine peak extra RSS MiB | transformers peak extra RSS MiB |"
    )
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
