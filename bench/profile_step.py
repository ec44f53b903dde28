"""bench/profile_step.py: every phase of a GRPO step against its physical floor, at the default and
10M shapes.

    .venv/bin/python bench/profile_step.py [--shapes default,10m] [--decodes plain,fast,compiled]
                                           [--threads 1] [--repeats 3] [--clock wall|cpu]

The step of bench/grpo_vs_trl.py's sizes without train.py around it: 8 prompts of 58 random tokens x
8 samples, up to 64 new tokens (TorchEngine.generate, once per rollout.decode mode), then a scoring
pass (learner.compute_logprobs: the forward with no gradient that the old-log-prob, reference and
weight-sync passes run) and one learner update on those 64 rows (learner.train_step; both with the
learner's defaults: shared prompts, 4,096-token micro-batches). The weights are random N(0, 0.02):
the ops and shapes, not the tokens, set the time. Per phase it prints:

  model FLOPs   2 per weight per token for a forward, 6 for forward and backward; attention's 4 x
                heads x head_dim per token and key it attends (x3 in the update); the lm_head on the
                scored tokens only (as token_logprobs runs it), in sampling once per sampled token.
                What the phase must compute, once: a group's prompt counts once, as
                learner.shared_prefix and fast_decode.py run it.
  compute floor those FLOPs at this CPU's matmul rate on the phase's own GEMM shapes (the q/k/v and
                gate/up weights fused, as the weights allow), each shape timed alone, best of 20.
  memory floor  sampling's decode steps: the bytes each must read, the weights once and the keys and
                values of every row's context (its group's prompt once per group, its own tokens),
                over this machine's read bandwidth (a sum over 512 MiB, best of 3). A decode step's
                floor is the larger of its two floors.
  measured      the phase's time, best of --repeats, the sides interleaved; x floor = measured /
                floor.
  the rest      torch.profiler's self time by kind of op: gemm (mm, addmm, bmm), sdpa (the fused
                attention kernel), draw (sampling's random numbers: multinomial, exponential,
                cumsum, searchsorted), elementwise, copy/index (copies, gathers, cat, index_put),
                other ops, compiled (Inductor's kernels, decode=compiled), and python (the time no
                op accounts for: the interpreter between launches).
Then, per decode mode at each shape: milliseconds and aten ops launched per decode step (the sampled
tokens' steps, from the profile), where launches per token is what fast_decode.py cuts.

On a machine shared with other jobs, --clock cpu times the process's CPU seconds (one thread: the
wall time it would take alone, give or take the caches other jobs share), a steadier measure than
the wall clock under load.
"""

import argparse
import collections
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from learner import LearnerConfig, TrainBatch, compute_logprobs, make_learner, train_step  # noqa: E402
from model import ModelConfig, init_model  # noqa: E402
from rollout import SamplingParams, make_engine  # noqa: E402

# grpo_vs_trl's shapes over the default model's config (vocab 1017, q/k/v biases)
SHAPES = {
    "default": ModelConfig(vocab_size=1017, attention_bias=True),
    "10m": ModelConfig(
        vocab_size=1017,
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1056,
        attention_bias=True,
    ),
}
P, G, M, PROMPT = 8, 8, 64, 58
KINDS = ("gemm", "sdpa", "draw", "elementwise", "copy/index", "other", "compiled", "python")


# -----------------------------------------------------------------------------
# the floors: FLOPs, bytes, and this machine's rates


def linear_weights(c: ModelConfig) -> int:
    """Weights in the decoder's matmuls (q, k, v, o, gate, up, down), all layers."""
    H, a, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return c.num_hidden_layers * (2 * H * a + 2 * H * kv + 3 * H * c.intermediate_size)


def gemm_shapes(c: ModelConfig, m: int, head: bool = True) -> list[tuple[int, int, int]]:
    """The (M, K, N) matmuls of one forward over m tokens, q/k/v and gate/up fused: one layer's and
    the head's."""
    H, a, kv, I = (
        c.hidden_size,
        c.num_attention_heads * c.head_dim,
        c.num_key_value_heads * c.head_dim,
        c.intermediate_size,
    )
    return [(m, H, a + 2 * kv), (m, a, H), (m, H, 2 * I), (m, I, H)] + (
        [(m, H, c.vocab_size)] if head else []
    )


def timed(fn, clock=time.perf_counter, device=None) -> float:
    """Seconds fn takes on `clock` (a CUDA device synchronised before and after)."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = clock()
    fn()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return clock() - t0


def seconds_per_flop(
    shapes, clock=time.perf_counter, reps: int = 20, device=None, dtype=torch.float32
) -> float:
    """The device's seconds per FLOP on a set of (M, K, N) matmuls, each timed alone (best of reps),
    FLOP-weighted."""
    flops = seconds = 0.0
    for m, k, n in shapes:
        a, b = (
            torch.randn(m, k, device=device, dtype=dtype),
            torch.randn(k, n, device=device, dtype=dtype),
        )
        seconds += min(timed(lambda: a @ b, clock, device) for _ in range(reps))
        flops += 2 * m * k * n
    return seconds / flops


def read_bandwidth(clock=time.perf_counter, mib: int = 512, device=None) -> float:
    """Bytes per second the device reads: a sum over `mib` MiB of fp32, best of 3."""
    x = torch.ones(mib * 2**18, device=device)
    return x.numel() * 4 / min(timed(x.sum, clock, device) for _ in range(3))


def sampling_floor(
    c: ModelConfig,
    prompts: list[int],
    lengths: list[int],
    group: int,
    spf_prefill: float,
    spf_decode: float,
    bandwidth: float,
    bytes_per: int = 4,
) -> dict:
    """The floor of generating rows of these lengths (new tokens each; row i continues prompt i //
    group, of prompts[i // group] tokens): the prefill's FLOPs once per prompt at the prefill's
    rate; each decode step the larger of its FLOPs at the decode rate and its bytes (the weights
    once, the keys and values of every row's
    context: a group's prompt once, each row's own tokens) over the bandwidth. -> {flops, compute,
    memory, floor} (FLOPs, seconds). What any engine must do, whatever its design."""
    L, H, V = c.num_hidden_layers, c.hidden_size, c.vocab_size
    attn = 4 * c.num_attention_heads * c.head_dim * L  # FLOPs per (query, key) pair, all layers
    # bytes of one position's keys and values
    kv = 2 * L * c.num_key_value_heads * c.head_dim * bytes_per
    weights = (linear_weights(c) + H * V) * bytes_per
    prefill = sum(2 * linear_weights(c) * p + attn * p * (p + 1) / 2 for p in prompts)
    out = {
        "flops": prefill,
        "compute": prefill * spf_prefill,
        "memory": 0.0,
        "floor": prefill * spf_prefill,
    }
    for t in range(max(lengths)):
        # rows that sample token t (fed token t-1 first)
        rows = [i for i, n in enumerate(lengths) if n > t]
        fed = rows if t > 0 else []
        flops = 2 * H * V * len(rows) + sum(
            2 * linear_weights(c) + attn * (prompts[i // group] + t) for i in fed
        )
        context = sum(prompts[g] for g in {i // group for i in fed}) + len(fed) * t
        nbytes = weights + kv * context if fed else H * V * bytes_per
        compute, memory = flops * spf_decode, nbytes / bandwidth
        out["flops"] += flops
        out["compute"] += compute
        out["memory"] += memory
        out["floor"] += max(compute, memory)
    return out


def learner_flops(c: ModelConfig, new: list[int], passes: int) -> float:
    """Model FLOPs of `passes` (1: a forward, 3: forward and backward) over the rows, each group's
    prompt once."""
    attn = 4 * c.num_attention_heads * c.head_dim * c.num_hidden_layers
    flops = 0.0
    for g in range(P):
        flops += 2 * linear_weights(c) * PROMPT + attn * PROMPT * (PROMPT + 1) / 2
        for n in new[g * G : (g + 1) * G]:
            flops += (
                2 * linear_weights(c) * n
                + attn * sum(PROMPT + j for j in range(n))
                + 2 * c.hidden_size * c.vocab_size * n
            )
    return passes * flops


# -----------------------------------------------------------------------------
# where the rest goes


def kind_of(name: str) -> str:
    op = name.removeprefix("aten::")
    if op in ("mm", "addmm", "bmm", "baddbmm"):
        return "gemm"
    if "scaled_dot_product" in op:
        return "sdpa"
    if op in (
        "multinomial",
        "exponential_",
        "cumsum",
        "searchsorted",
        "uniform_",
        "rand",
        "normal_",
    ):
        return "draw"
    if op in (
        "copy_",
        "index",
        "index_put_",
        "index_copy_",
        "cat",
        "gather",
        "scatter_",
        "clone",
        "contiguous",
        "index_select",
        "masked_fill",
        "masked_fill_",
        "fill_",
        "zero_",
        "where",
        "_index_put_impl_",
    ):
        return "copy/index"
    if op in (
        "mul",
        "add",
        "sub",
        "div",
        "div_",
        "add_",
        "mul_",
        "pow",
        "mean",
        "rsqrt",
        "silu",
        "exp",
        "exp_",
        "neg",
        "sum",
        "amax",
        "softmax",
        "_softmax",
        "log_softmax",
        "_log_softmax",
        "logsumexp",
        "maximum",
        "minimum",
        "log",
        "sigmoid",
        "isin",
        "argmax",
        "eq",
        "gt",
        "ge",
        "lt",
        "le",
        "ne",
        "bitwise_not",
        "logical_not",
        "logical_and",
        "bitwise_and",
        "cos",
        "sin",
        "tanh",
        "max",
        "min",
        "clamp",
        "abs",
        "_to_copy",
        "to",
        "any",
        "all",
        "cumsum",
    ):
        return "elementwise"
    return "other"


def profile(fn) -> tuple[dict, int]:
    """fn once under torch.profiler -> ({kind: self seconds}, aten ops launched from Python: those
    without an aten parent)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        wall = timed(fn)
    kinds = collections.Counter()
    launched = 0
    for e in prof.events():
        if "CompiledFxGraph" in e.name:
            kinds["compiled"] += e.self_cpu_time_total / 1e6
        if e.name.startswith("aten::"):
            kinds[kind_of(e.name)] += e.self_cpu_time_total / 1e6
            parent = e.cpu_parent
            launched += parent is None or not parent.name.startswith("aten::")
    kinds["python"] = max(0.0, wall - sum(kinds.values()))
    return {k: kinds[k] / wall for k in KINDS}, launched


# -----------------------------------------------------------------------------


def measure(shape: str, decodes: list[str], repeats: int, clock) -> list[dict]:
    c = SHAPES[shape]
    model = init_model(c, seed=0).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, c.vocab_size, (PROMPT,), generator=g).tolist() for _ in range(P)]
    params = SamplingParams(temperature=1.0, max_tokens=M, n=G, seed=1, stop_token_ids=(2,))
    engines = {d: make_engine("torch", "", pad_id=0, model=model, decode=d) for d in decodes}
    gens = engines[decodes[0]].generate(prompts, params)
    new = [len(x.token_ids) for x in gens]
    rows = [prompts[i // G] + x.token_ids for i, x in enumerate(gens)]
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    mask = torch.zeros(ids.shape)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, PROMPT : len(row)] = 1.0
    cfg = LearnerConfig(lr=1e-5, micro_batch_size=P * G)
    state = make_learner(model, cfg, seed=0)
    batch = TrainBatch(
        ids, mask, torch.randn(len(rows))[:, None] * mask, None, None, None, old_from_update=True
    )

    # the machine: matmul rates on each phase's shapes, read bandwidth
    positions = P * PROMPT + sum(new)  # each group's prompt once (learner.shared_prefix)
    mb = positions // 2  # tokens of a micro-batch's matmuls (two here)
    spf = {
        "prefill": seconds_per_flop(gemm_shapes(c, P * PROMPT, head=False), clock),
        "decode": seconds_per_flop(gemm_shapes(c, P * G), clock),
        "learner": seconds_per_flop(gemm_shapes(c, mb), clock),
    }
    bandwidth = read_bandwidth(clock)
    samp = sampling_floor(c, [PROMPT] * P, new, G, spf["prefill"], spf["decode"], bandwidth)
    phases = {
        f"sampling ({d})": (lambda e=e: e.generate(prompts, params)) for d, e in engines.items()
    }
    phases["scoring"] = lambda: compute_logprobs(
        model,
        ids,
        cfg.micro_batch_size,
        mask=mask,
        max_tokens=cfg.max_tokens_per_micro_batch,
        shared_prefix=True,
    )
    phases["update"] = lambda: train_step(state, batch, cfg)
    for fn in phases.values():  # warm (and compile)
        fn()
    seconds = collections.defaultdict(list)
    for _ in range(repeats):  # interleaved
        for name, fn in phases.items():
            seconds[name].append(timed(fn, clock))
    out = []
    for name, fn in phases.items():
        if name.startswith("sampling"):
            flops, compute, memory, floor = (
                samp["flops"],
                samp["compute"],
                samp["memory"],
                samp["floor"],
            )
        else:
            flops = learner_flops(c, new, 1 if name == "scoring" else 3)
            compute, memory = flops * spf["learner"], 0.0
            floor = compute
        kinds, launched = profile(fn)
        best = min(seconds[name])
        out.append(
            {
                "shape": shape,
                "phase": name,
                "gflop": flops / 1e9,
                "compute_floor": compute,
                "memory_floor": memory,
                "floor": floor,
                "seconds": best,
                "x_floor": best / floor,
                "kinds": kinds,
                "launched": launched,
                "steps": max(new) - 1,
                "tokens_per_s": sum(new) / best if name.startswith("sampling") else None,
            }
        )
    rate = {k: 1 / v / 1e9 for k, v in spf.items()}
    print(
        f"## {shape}: {linear_weights(c) / 1e6:.2f}M decoder matmul weights, "
        f"{P} x {G} rows of {PROMPT} + {sum(new) / len(new):.1f} tokens; "
        f"matmul GFLOP/s on the shapes of prefill {rate['prefill']:.0f}, "
        f"decode {rate['decode']:.0f}, learner {rate['learner']:.0f}; "
        f"read {bandwidth / 1e9:.1f} GB/s",
        flush=True,
    )
    return out


def print_tables(results: list[dict]):
    print(
        "\n| shape | phase | model GFLOP | compute floor s | memory floor s | floor s | measured s "
        "| x floor | " + " | ".join(KINDS) + " |"
    )
    print("|" + "---|" * (8 + len(KINDS)))
    for r in results:
        print(
            f"| {r['shape']} | {r['phase']} | {r['gflop']:.1f} | {r['compute_floor']:.3f} "
            f"| {r['memory_floor']:.3f} | {r['floor']:.3f} | {r['seconds']:.3f} "
            f"| **{r['x_floor']:.2f}x** | "
            + " | ".join(f"{r['kinds'][k]:.0%}" for k in KINDS)
            + " |"
        )
    print(
        "\n| shape | decode | tokens/s | x plain | ms per decode step | aten ops per decode step |"
    )
    print("|---|---|---|---|---|---|")
    for shape in dict.fromkeys(r["shape"] for r in results):
        samp = [r for r in results if r["shape"] == shape and r["phase"].startswith("sampling")]
        plain = next((r for r in samp if "(plain)" in r["phase"]), samp[0])
        for r in samp:
            print(
                f"| {shape} | {r['phase'][10:-1]} | {r['tokens_per_s']:.0f} "
                f"| {r['tokens_per_s'] / plain['tokens_per_s']:.2f}x "
                f"| {1e3 * r['seconds'] / r['steps']:.2f} | {r['launched'] / r['steps']:.0f} |"
            )


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shapes", default="default,10m")
    ap.add_argument(
        "--decodes",
        default="plain,fast",
        help="rollout.decode modes sampled, interleaved: plain, fast, "
        "compiled (Inductor compiles C++ first: minutes)",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: process CPU seconds (one thread, a machine shared with other jobs)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    results = []
    for shape in args.shapes.split(","):
        results += measure(shape, args.decodes.split(","), args.repeats, clock)
    print(f"\n{args.threads} thread(s), {args.clock} clock, torch {torch.__version__}")
    print_tables(results)


if __name__ == "__main__":
    main()
