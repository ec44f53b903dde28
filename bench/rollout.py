"""bench/rollout.py: generation speed of TorchEngine vs VLLMEngine, same model, same prompts, one
run.

    .venv/bin/python bench/rollout.py                                  # the embedded default model,
    toy-math prompts .venv/bin/python bench/rollout.py --prompts 64 --n 8 --max-tokens 96 --repeats
    5 .venv/bin/python bench/rollout.py --hidden 512 --layers 8          # a bigger random model,
    same tokenizer .venv/bin/python bench/rollout.py --model /path/to/Qwen2.5-0.5B-Instruct

Both engines get exactly the same work: the same token-id prompts (held-out toy-math tasks, rendered
and tokenized as the agent loop does), n samples each at temperature 1, and no stop token, so every
row generates exactly max_tokens tokens. Each engine is warmed up once, then the two take turns,
`repeats` timed calls each (taking turns spreads any other load on the machine over both); tokens/s
is generated tokens over wall time, median over the calls. Both run in this process with the same
torch threads. Prints a markdown table and the ratio.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from chat import render  # noqa: E402
from config import load_config  # noqa: E402
from env import make_env  # noqa: E402
from eval import heldout_tasks  # noqa: E402
from model import ModelConfig, init_model, load_model, save_model  # noqa: E402
from rollout import SamplingParams, TorchEngine  # noqa: E402
from sft import build_default_model  # noqa: E402
from wings.engine_vllm import VLLMEngine  # noqa: E402


def prompts_for(cfg, tokenizer, count: int) -> list[list[int]]:
    """The first prompt of `count` held-out episodes, token ids exactly as run_episodes builds
    them."""
    envs = {e.name: make_env(e.name, **e.kwargs) for e in cfg.envs}
    tasks = [
        t
        for ts in heldout_tasks(envs, {e.name: count for e in cfg.envs}, cfg.eval_seed).values()
        for t in ts
    ]
    out = []
    for i, task in enumerate(tasks[:count]):
        env = envs[task.env]
        _, messages = env.reset(task, seed=i)
        text = render(
            messages,
            env.tools(),
            add_generation_prompt=True,
            chat_format=cfg.rollout.agent.chat_format,
        )
        out.append(tokenizer.encode(text, add_special_tokens=False).ids)
    return out


def random_model_dir(base_dir: str, hidden: int, layers: int, out: str) -> str:
    """A randomly initialised Qwen2 of the given size with base_dir's tokenizer files: speed does
    not depend on what the weights say, and without stop tokens every row still generates max_tokens
    tokens."""
    base = load_model(base_dir).cfg
    heads = max(1, hidden // 64)
    cfg = ModelConfig(
        vocab_size=base.vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=64,
        tie_word_embeddings=base.tie_word_embeddings,
    )
    save_model(init_model(cfg, seed=0), out)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        with open(os.path.join(base_dir, f)) as src, open(os.path.join(out, f), "w") as dst:
            dst.write(src.read())
    return out


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--config",
        default="configs/toy_math.yaml",
        help="envs, chat format, default-model settings",
    )
    p.add_argument(
        "--model", default=None, help="a Hugging Face folder (default: the embedded default model)"
    )
    p.add_argument(
        "--hidden",
        type=int,
        default=0,
        help="bench a random model of this width instead (head_dim 64)",
    )
    p.add_argument("--layers", type=int, default=8, help="... and this many layers")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--threads", type=int, default=0, help="torch threads for both engines (0: torch's default)"
    )
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_config(args.config, ["wandb=false"])
    model_dir = args.model or build_default_model(cfg)
    tmp = tempfile.mkdtemp(prefix="bench_rollout_")
    if args.hidden:
        model_dir = random_model_dir(
            model_dir, args.hidden, args.layers, os.path.join(tmp, "model")
        )
    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    prompts = prompts_for(cfg, tokenizer, args.prompts)
    rows = len(prompts) * args.n
    params = lambda seed: SamplingParams(
        n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=seed
    )

    model = load_model(model_dir, dtype=getattr(torch, args.dtype))
    engines = {
        "torch": TorchEngine(
            model.eval(), pad_id=tokenizer.token_to_id("<|endoftext|>"), max_batch_size=rows
        ),
        "vllm": VLLMEngine(
            model_dir,
            dtype=args.dtype,
            max_model_len=max(map(len, prompts)) + args.max_tokens,
            max_num_seqs=rows,
            seed=0,
            cache_dir=tmp,
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in engines}
    for name, engine in engines.items():  # warm-up: first-call allocations, caches, kernels
        engine.generate(prompts, params(0))
    for r in range(args.repeats):
        for name, engine in engines.items():
            t0 = time.perf_counter()
            gens = engine.generate(prompts, params(r + 1))
            times[name].append(time.perf_counter() - t0)
            # the same work for both
            assert sum(len(g.token_ids) for g in gens) == rows * args.max_tokens

    params_m = sum(t.numel() for t in model.parameters()) / 1e6  # a tied matrix counted once
    name = (
        f"random Qwen2, hidden {args.hidden} x {args.layers} layers"
        if args.hidden
        else os.path.basename(model_dir.rstrip("/"))
    )
    print(
        f"\n{name} ({params_m:.2f} M parameters, {args.dtype}), "
        f"{len(prompts)} prompts x {args.n} samples = {rows} rows, "
        f"prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
        f"{args.max_tokens} new tokens each, T=1, {torch.get_num_threads()} threads, "
        f"median of {args.repeats}"
    )
    print("| engine | seconds per call | new tokens per call | tokens/s |")
    print("|---|---|---|---|")
    speed = {}
    for name, ts in times.items():
        sec = statistics.median(ts)
        speed[name] = rows * args.max_tokens / sec
        print(f"| {name} | {sec:.2f} | {rows * args.max_tokens} | {speed[name]:,.0f} |")
    print(f"\nvllm / torch: {speed['vllm'] / speed['torch']:.2f}x")


if __name__ == "__main__":
    main()
