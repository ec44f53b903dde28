"""bench/multiturn.py: multi-turn rollouts with and without TorchEngine's prefix cache, same
episodes, one run.

    .venv/bin/python bench/multiturn.py                                   # tau_lite and
    alfworld_lite .venv/bin/python bench/multiturn.py --configs configs/alfworld_lite.yaml --tasks
    32 --n 8 --threads 2 .venv/bin/python bench/multiturn.py --random                          # no
    SFT build: random weights

Without the cache, every turn of an episode prefills the whole conversation so far; with it
(rollout.prefix_cache_tokens > 0) a turn prefills only what the last turn did not run through the
model: the observation, the next generation prompt and the last sampled token. For each config: its
embedded default model (built and cached on first use, as train.py does; --random: random weights of
its shape), `tasks` held-out tasks x `n` samples through the agent loop (agent.LocalRollouts, the
config's turns and budgets, temperature 1, a fixed seed). The two engines share the model
and the threads; after one warm-up each they take turns (A B A B), `repeats` timed rollouts each,
the same seed every time, so both play exactly the same episodes: the script checks that the
trajectories match token for token. Prints per engine the prompt tokens prefilled per episode (all
turns), the sampled tokens per second (median), and the ratios.
"""

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from agent import LocalRollouts  # noqa: E402
from chat import render  # noqa: E402
from config import load_config  # noqa: E402
from env import make_env  # noqa: E402
from eval import heldout_tasks  # noqa: E402
from model import ModelConfig, init_model, load_model, save_model  # noqa: E402
from rollout import SamplingParams, TorchEngine  # noqa: E402
from sft import build_default_model, train_tokenizer, write_tokenizer_files  # noqa: E402
from wings.prefix_cache import PrefixCachedEngine  # noqa: E402


def random_default_model(cfg, envs) -> str:
    """The default model's shape with random weights and a BPE tokenizer trained on 500
    demonstrations (no SFT, which takes an hour on a loaded CPU): its samples are noise, so episodes
    run to the config's turn or token limit."""
    rng = random.Random(0)
    env = next(iter(envs.values()))
    texts = [
        render(env.demonstration(t, rng, True), env.tools())
        for t in env.sample_tasks("train", 500, 0)
    ]
    tokenizer = train_tokenizer(texts, cfg.sft.vocab_size)
    s = cfg.sft
    mcfg = ModelConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads,
        tie_word_embeddings=True,
    )
    out = tempfile.mkdtemp(prefix="bench_multiturn_")
    write_tokenizer_files(tokenizer, out, "qwen2.5")
    save_model(init_model(mcfg, seed=0), out)
    return out


def bench_config(path: str, args) -> list[str]:
    """Table rows for one config, after checking that both engines played the same episodes."""
    cfg = load_config(path, ["wandb=false"])
    envs = {e.name: make_env(e.name, **e.kwargs) for e in cfg.envs}
    model_dir = random_default_model(cfg, envs) if args.random else build_default_model(cfg)
    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    tasks = [
        t
        for ts in heldout_tasks(
            envs, {e.name: args.tasks for e in cfg.envs}, cfg.eval_seed
        ).values()
        for t in ts
    ][: args.tasks]
    agent_cfg = replace(cfg.rollout.agent, n_samples=args.n)
    params = SamplingParams(
        temperature=1.0, top_p=cfg.rollout.top_p, max_tokens=cfg.rollout.max_tokens
    )
    model = load_model(model_dir).eval()
    pad_id = tokenizer.token_to_id("<|endoftext|>")
    sources = {
        "full prefill": LocalRollouts(TorchEngine(model, pad_id), envs, tokenizer, agent_cfg),
        "prefix cache": LocalRollouts(
            PrefixCachedEngine(model, pad_id=pad_id, prefix_cache_tokens=args.cache_tokens),
            envs,
            tokenizer,
            agent_cfg,
        ),
    }
    seconds = {name: [] for name in sources}
    played = {}
    for r in range(args.repeats + 1):  # round 0 is the warm-up
        for name, source in sources.items():
            t0 = time.perf_counter()
            trajs, metrics = source.play(tasks, params, seed=args.seed)
            if r:
                seconds[name].append(time.perf_counter() - t0)
            played[name] = (trajs, metrics)
    (a, ma), (b, mb) = played["full prefill"], played["prefix cache"]
    same = sum(x.token_ids == y.token_ids for x, y in zip(a, b))
    sampled = sum(sum(t.loss_mask) for t in a)
    episodes = len(a)
    print(
        f"\n{path}: {len(tasks)} tasks x {args.n} samples, "
        f"{sum(t.num_turns for t in a) / episodes:.1f} turns and "
        f"{sum(len(t.token_ids) for t in a) / episodes:.0f} tokens per episode, "
        f"{sampled} sampled tokens; identical trajectories: {same} of {episodes}"
    )
    rows, speed = [], {}
    for name, m in (("full prefill", ma), ("prefix cache", mb)):
        sec = statistics.median(seconds[name])
        speed[name] = sampled / sec
        rows.append(
            f"| {cfg.envs[0].name} | {name} | {m['rollout/prefilled_tokens']:.0f} | "
            f"{m['rollout/prefix_cached']:.2f} | {sec:.2f} | {speed[name]:,.0f} |"
        )
    fewer = ma["rollout/prefilled_tokens"] / mb["rollout/prefilled_tokens"]
    rows.append(
        f"| {cfg.envs[0].name} | ratio | {fewer:.2f}x fewer | | | "
        f"{speed['prefix cache'] / speed['full prefill']:.2f}x |"
    )
    return rows


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--configs", nargs="+", default=["configs/tau_lite.yaml", "configs/alfworld_lite.yaml"]
    )
    p.add_argument("--tasks", type=int, default=16, help="held-out tasks per config")
    p.add_argument("--n", type=int, default=4, help="episodes per task")
    p.add_argument(
        "--repeats", type=int, default=2, help="timed rollouts per engine, after one warm-up each"
    )
    p.add_argument(
        "--cache-tokens",
        type=int,
        default=1_000_000,
        help="rollout.prefix_cache_tokens of the cached engine",
    )
    p.add_argument(
        "--random",
        action="store_true",
        help="random weights of the default model's shape instead of the "
        "SFT-trained default model (see random_default_model)",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = [r for path in args.configs for r in bench_config(path, args)]
    print(
        f"\n{args.threads} thread(s), median of {args.repeats} interleaved rollouts per engine, "
        "temperature 1"
    )
    print(
        "| env | engine | prompt tokens prefilled per episode | share found in the cache "
        "| seconds per rollout | sampled tokens/s |"
    )
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
