"""bench/grpo_vs_trl.py: the whole GRPO step of train.py vs TRL's GRPOTrainer on the same work, side
by side.

    .venv/bin/python bench/grpo_vs_trl.py --trl-python /path/to/venv/bin/python
        [--sizes default,10m,10m-long,multiturn] [--sides ours,trl,ours-bf16,trl-bf16,ours-plain]
        [--threads 1] [--prompts 8 --group 8 --max-tokens 64 --steps 10 --pairs 3] [--turns 3]

Same model folder, same prompts (token for token), same P prompts x G samples x up to M new tokens,
one optimizer step per RL step, fp32, the same thread count, 10 steps per run. Each run is its own
process (so start-up, peak RSS and threads are its own), run interleaved A B A B: a warm-up pair
(not counted; --warmup-pairs), then `pairs` timed pairs.

  ours  train.main on toy_math, single turn (rollout.agent.max_turns=1; `multiturn` below: K turns),
        the in-process torch engine, no eval but one held-out task at step 0 and at the end, no
        wandb, the final checkpoint only (after the timed steps). Loss: learner.policy_loss=ppo
        (clip 0.2), token-mean over the batch; advantage (r - mean_g) / (std_g + 1e-6); on-policy,
        so no old-log-prob pass (perf/old_logprob_pass = 0); algo.skip_uniform_batches=false (TRL
        updates on an all-zero-advantage batch too, and a random model's rewards are all 0); the
        weight-sync gate (4 trajectories x 8 tokens) stays on, as in every run. Reward: toy_math's
        (the number given to finish, or the last number of a plain-text answer).
  trl   TRL's GRPOTrainer (the TRL side is this file run with --trl-python: trl, transformers,
        datasets are imported only there; they are not dependencies of the project). GRPOConfig is
        fixed to the same work: use_cpu, fp32, beta 0, num_iterations 1, no vLLM (HF generate,
        temperature 1, top_p 1, top_k 0), gradient checkpointing off, constant lr,
        per_device_train_batch_size = micro-batch and gradient accumulation so that one generation
        round of P x G feeds one optimizer step. Loss: TRL's default loss_type=dapo, PPO-clip 0.2
        summed over all completion tokens of the batch / their number (the same token-mean);
        advantage (r - mean_g) / (std_g + 1e-4). Reward: the last number of the completion equals
        the answer. The prompts are our rendered chat prompts, given as raw text (TRL's
        non-conversational path), tokenized from the folder's tokenizer.json verbatim; the child
        checks its ids equal ours on every prompt. It stops at <|im_end|>, as ours does.

Figures per side: median seconds per step (wall time between consecutive step ends: ours from
metrics.jsonl's perf/elapsed_minutes, TRL from on_step_end callbacks), split into sampling (ours
perf/rollout_seconds; TRL the time inside model.generate, timed by a wrapper), update (ours
perf/train_seconds: advantages and the learner update; TRL the rest of the step: reward, forward,
backward, optimizer, logging) and other (ours: the weight-sync gate and logging; TRL: none, by that
definition); "all but sampling" is that share of the step. Start-up: process start to the first
step's start (imports, model load, trainer or learner set-up; ours also the one-task eval at step
0). Peak RSS: the child's ru_maxrss, read by the parent with os.wait4. Ratios are ours / TRL per
timed pair, then the median; "speed" is TRL's step time over ours (> 1: we are faster).

Sides (each its own process, interleaved in the order given): `ours` (train.py's defaults: shared
prompts run once, token-budget micro-batches), `ours-plain` (learner.shared_prefix=false,
learner.max_tokens_per_micro_batch=0: every row whole, micro_batch_size rows: the update as it was
before both), `ours-bf16` (learner.precision=bf16), `trl`, and `trl-bf16` (GRPOConfig bf16=True:
autocast on the CPU), `ours-keepmem` (ours with glibc's malloc tuned to keep freed memory,
KEEP_FREED: blocks up to 32 MiB from the heap, never trimmed, so a step's activations reuse the last
step's pages instead of mapping and freeing them), `ours-fast` (rollout.decode=fast:
wings/fast_decode.py's decode step), `ours-compiled` (rollout.decode=compiled). Ratios are printed
for each pair present of: ours / trl, ours-bf16 / trl-bf16, ours-bf16 / ours, ours / ours-plain,
ours-keepmem / ours, ours-fast / trl, ours-fast / ours, ours-compiled / ours.

Sizes: `default` (the embedded default model of configs/toy_math.yaml, built with sft.py on first
use and cached in
--cache-dir), `10m` (the same tokenizer and a Qwen2 shape with random N(0, 0.02) weights,
bench/engine_vs_hf.py's 10m shape: hidden 384, 6 layers, 6 heads / 3 kv, head_dim 64, MLP 1056;
~10.8M parameters), `10m-long` (the 10m model, its prompts opening with a long system prompt,
LONG_SYSTEM: the tool and format instructions an agent's prompt carries; both sides get the toy_math
tasks through the `dataset` env, rendered the same way). A random model rarely samples <|im_end|>,
so its episodes run to M tokens, and its rewards are all 0.

`multiturn` (the default model, toy_math, the prompts of `default`): episodes of up to K assistant
turns (--turns, 3) with toy_math's own tools, python_eval and finish. The budget of an episode after
its prompt is C = K x M + (K - 1) x TOOL_RESULT_TOKENS (sampled tokens and tool results together).
  ours  as above, with rollout.agent.max_turns=K, rollout.max_tokens=M per turn and the context
        window agent.max_total_tokens = the longest prompt + C + 1. The env ends an episode at a
        finish call (its answer graded) or at a message without tool calls (its last number graded);
        a python_eval result comes back as
        "\n<|im_start|>user\n<tool_response>\n<text>\n</tool_response><|im_end|>\n<|im_start|>assistant\n".
  trl   GRPOTrainer with tools=[python_eval, finish], conversational prompts (the env's system and
        user messages), max_tool_calling_iterations=K - 1 (K generation rounds),
        max_completion_length=C. Our env does the work: the TRL child imports env.py and chat.py
        from the repo (standard library only) once TRL is loaded. python_eval returns our env's
        run_tool text for the same call (the same sandbox); finish returns "". The reward steps each
        episode's assistant messages through our env's step until it would have ended the episode
        (env_tools), so both sides are graded by the same code. The folder's chat template is not
        TRL's qwen2.5 template byte for byte (TRL recognises templates by equality, to parse
        <tool_call> blocks), so the TRL side sets TRL's own qwen2_5 template, and renders each tool
        function as our env's schema of that name (transformers would write one from the docstring,
        with a description per argument that ours has not). The child checks that every prompt it
        renders has our ids, and that a tool result's ids (TRL's _get_tool_suffix_ids) equal our
        agent's (chat.render_continuation, encoded).
  Where the loops differ (the work table shows what each episode did, per side):
  - Ending: TRL ends an episode only at a turn without tool calls (or after K rounds). After a
    finish call it renders finish's empty result and samples another turn, which ours never does;
    the reward ignores those turns.
  - Length: ours caps each turn at M tokens and the episode at C; TRL caps only the episode at C (a
    turn may sample up to C tokens, cut afterwards to fit), and drops a tool result that would not
    fit, ending the episode.
  - Parsing: ours repairs malformed tool-call JSON and reports the problem as an observation; TRL's
    parser reads a turn it cannot parse as plain text, which ends the episode (graded as a text
    answer).
  - Sampling time: ours perf/rollout_seconds (the agent loop: every turn, the tools, the env); TRL
    the time in its _generate (every generation round, the tool calls, parsing and re-tokenizing
    between them), not the time in model.generate alone as in the single-turn sizes (kept in the
    child's JSON as generate_s).

TRL goes in a scratch venv outside the repo (the versions measured; torch first, so that nothing
pulls a CUDA build, and a dry run must not list torch among what it would install):
    python3.11 -m venv /tmp/trl/venv && /tmp/trl/venv/bin/pip install torch==2.13.0
    PINS="torch==2.13.0 trl==1.16.0 transformers==5.23.0 accelerate==1.15.0 datasets==5.2.0"
    /tmp/trl/venv/bin/pip install --dry-run $PINS && /tmp/trl/venv/bin/pip install $PINS
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

# a child's start-up is measured from here (before torch or trl is imported)
T_PROCESS = time.time()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHAPE_10M = dict(
    hidden_size=384,
    num_hidden_layers=6,
    num_attention_heads=6,
    num_key_value_heads=3,
    intermediate_size=1056,
    head_dim=64,
    tie_word_embeddings=False,
)
# ModelConfig fields over the default model's
SHAPES = {"default": {}, "10m": SHAPE_10M, "10m-long": SHAPE_10M, "multiturn": {}}
# multiturn: a tool result's share of an episode's budget
# (its turn boundaries take 16 tokens; a number ~1-4 more)
TOOL_RESULT_TOKENS = 32
LONG_SYSTEM = " ".join(
    [  # 10m-long's system prompt
        "You are a careful assistant that solves arithmetic problems with tools.",
        "Read the problem twice. Work out each intermediate quantity before the final one.",
        "When a step needs exact arithmetic, call the calculator tool "
        "with a plain expression such as 12 * (3 + 4);",
        "do not call it with words, units or variables. "
        "Wait for the tool's answer before you go on.",
        "If a tool returns an error, fix the expression and call it again rather than guessing.",
        "Keep every number you have found; never round unless the problem asks for it.",
        "When you know the final answer, call finish with the number alone, "
        "with no words and no units.",
        "Answers are integers unless the problem says otherwise. Negative answers keep their sign.",
        "Do not explain your reasoning at length: one short sentence per step is enough.",
        "Never call finish before you have checked the answer against the problem's question.",
    ]
    * 2
)
KEEP_FREED = {
    "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=17179869184"
}
SIDES = {  # side -> (worker, its train.py overrides or TRL's bf16 flag, its environment)
    "ours": ("ours", [], {}),
    "ours-bf16": ("ours", ["learner.precision=bf16"], {}),
    "ours-plain": (
        "ours",
        ["learner.shared_prefix=false", "learner.max_tokens_per_micro_batch=0"],
        {},
    ),
    # glibc's malloc keeps freed blocks up to 32 MiB (no munmap/trim)
    "ours-keepmem": ("ours", [], KEEP_FREED),
    "ours-fast": ("ours", ["rollout.decode=fast"], {}),  # wings/fast_decode.py's decode step
    "ours-compiled": ("ours", ["rollout.decode=compiled"], {}),  # ... under torch.compile
    "trl": ("trl", [], {}),
    "trl-bf16": ("trl", ["--bf16"], {}),
}
RATIOS = [
    ("ours", "trl"),
    ("ours-bf16", "trl-bf16"),
    ("ours-bf16", "ours"),
    ("ours", "ours-plain"),
    ("ours-keepmem", "ours"),
    ("ours-fast", "trl"),
    ("ours-fast", "ours"),
    ("ours-compiled", "ours"),
]
N_TRL_PROMPTS = 512  # distinct train prompts written for TRL's dataset (it draws P per step)


# -----------------------------------------------------------------------------
# the parent: models, prompts, interleaved runs, the table


def default_model(cache_dir: str) -> str:
    """The embedded default model of configs/toy_math.yaml (built by sft.py on first use, then
    cached)."""
    from config import load_config
    from sft import build_default_model

    cfg = load_config(
        os.path.join(ROOT, "configs", "toy_math.yaml"), [f"model.cache_dir={cache_dir}"]
    )
    return build_default_model(cfg)


def make_folder(size: str, base: str, out: str) -> str:
    """The model folder of `size`: the default model itself, or its config with SHAPES[size] and
    random weights."""
    if not SHAPES[size]:
        return base
    from dataclasses import replace

    from model import ModelConfig, init_model, save_model

    with open(os.path.join(base, "config.json")) as f:
        mcfg = replace(ModelConfig.from_hf(json.load(f)), **SHAPES[size])
    save_model(init_model(mcfg, seed=0), out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        # what a checkpoint copies
        shutil.copy(os.path.join(base, name), out)
    return out


def env_config(size: str, work: str, seed: int) -> str:
    """The envs list our side trains on, as a YAML file: toy_math, or for a `-long` size the same
    tasks through the `dataset` env with LONG_SYSTEM as the system prompt (written to `work`)."""
    path = os.path.join(work, f"envs_{size}.yaml")
    if not size.endswith("-long"):
        envs = [{"name": "toy_math", "eval_size": 1}]
    else:
        from env import make_env

        tasks = os.path.join(work, "toy_math_tasks.jsonl")
        toy = make_env("toy_math")
        with open(tasks, "w") as f:
            for split in ("train", "test"):
                for t in toy.sample_tasks(split, 2000, seed):
                    f.write(json.dumps({"problem": t.prompt, "answer": t.answer}) + "\n")
        envs = [
            {
                "name": "dataset",
                "eval_size": 1,
                "kwargs": {"path": tasks, "system_prompt": LONG_SYSTEM},
            }
        ]
    with open(path, "w") as f:
        json.dump({"envs": envs}, f)  # JSON is YAML
    return path


def write_prompts(folder: str, path: str, seed: int, envs: str) -> float:
    """TRL's train file: the train tasks of our side's env (envs: env_config's file) rendered
    exactly as agent.init_episodes renders them, with our token ids (the TRL child checks its own
    against them) and the messages they render (the multi-turn TRL side's conversational prompts) ->
    their mean length in tokens."""
    from tokenizers import Tokenizer

    from chat import encode, render
    from env import make_env

    with open(envs) as f:
        spec = json.load(f)["envs"][0]
    env, tok = (
        make_env(spec["name"], **spec.get("kwargs", {})),
        Tokenizer.from_file(os.path.join(folder, "tokenizer.json")),
    )
    lengths = []
    with open(path, "w") as f:
        for task in env.sample_tasks("train", N_TRL_PROMPTS, seed):
            _, msgs = env.reset(task, seed=0)
            text = render(msgs, env.tools(), add_generation_prompt=True, chat_format="qwen2.5")
            ids = encode(tok, text)
            lengths.append(len(ids))
            f.write(
                json.dumps({"prompt": text, "answer": task.answer, "ids": ids, "messages": msgs})
                + "\n"
            )
    return sum(lengths) / len(lengths)


def run_child(cmd: list[str], threads: int, log_path: str, extra_env: dict | None = None) -> dict:
    """Run one side in its own process -> its JSON result, plus peak_rss_gib (os.wait4: the child's
    own ru_maxrss)."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "WANDB_MODE": "disabled",
        **(extra_env or {}),
    }
    result = log_path + ".json"
    with open(log_path, "w") as log:
        p = subprocess.Popen(
            cmd + ["--result", result], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        with open(log_path) as f:
            sys.exit(f"{' '.join(cmd[:4])} ... failed (exit {p.returncode}):\n{f.read()[-4000:]}")
    with open(result) as f:
        out = json.load(f)
    return {**out, "peak_rss_gib": usage.ru_maxrss / 2**20}  # Linux: KiB


def episode_budget(turns: int, max_tokens: int) -> int:
    """The tokens an episode may add after its prompt: M for one turn; K x M + (K - 1) x
    TOOL_RESULT_TOKENS for K."""
    return turns * max_tokens + (turns - 1) * TOOL_RESULT_TOKENS


# per episode, what a multi-turn child records per step
WORK = ("turns", "tool_calls", "ended", "after_end", "reward")


def summarize(run: dict) -> dict:
    """One run -> its medians over the steps (seconds per step, sampling, update, the rest: ours the
    weight-sync gate and logging, TRL none, its update being all but sampling) and its start-up,
    peak RSS and sampled tokens; and the means over the steps of the WORK a run records."""
    med = statistics.median
    return {
        "step": med(run["step_s"]),
        "sample": med(run["sample_s"]),
        "update": med(run["update_s"]),
        "other": med(s - a - b for s, a, b in zip(run["step_s"], run["sample_s"], run["update_s"])),
        "not_sample": med(s - a for s, a in zip(run["step_s"], run["sample_s"])),
        "startup": run["startup_s"],
        "rss": run["peak_rss_gib"],
        "tokens": statistics.mean(run["new_tokens"]),
        **{k: statistics.mean(run[k]) for k in WORK if k in run},
    }


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--trl-python",
        help="the python of a venv with trl installed (required unless --sides ours)",
    )
    ap.add_argument(
        "--sizes", default="default,10m", help="comma-separated: default, 10m, 10m-long, multiturn"
    )
    ap.add_argument(
        "--sides", default="ours,trl", help="ours,trl; or ours alone (a check that needs no TRL)"
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=8, help="P: prompts per step")
    ap.add_argument("--group", type=int, default=8, help="G: samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=64, help="M: new tokens per sample at most")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument(
        "--turns",
        type=int,
        default=3,
        help="K: assistant turns per episode at most (multiturn only)",
    )
    ap.add_argument(
        "--micro-batch",
        type=int,
        default=0,
        help="rows per forward/backward on both sides (0: P x G)",
    )
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument(
        "--pairs", type=int, default=3, help="timed interleaved pairs, after the warm-up pairs"
    )
    ap.add_argument(
        "--warmup-pairs", type=int, default=1, help="untimed pairs first (file caches, imports)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--cache-dir",
        default=os.path.join(ROOT, ".cache"),
        help="where the default model is cached",
    )
    ap.add_argument(
        "--base",
        default="",
        help="a model folder to use as `default` instead of the embedded default "
        "model (its tokenizer.json serves the 10m shape too)",
    )
    ap.add_argument("--keep", default="", help="keep the runs' logs and results in this folder")
    ap.add_argument("--worker", choices=["ours", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--envs", help=argparse.SUPPRESS)
    ap.add_argument("--override", action="append", default=[], help=argparse.SUPPRESS)
    ap.add_argument("--bf16", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return (ours_worker if args.worker == "ours" else trl_worker)(args)
    sides = args.sides.split(",")
    if any(s not in SIDES for s in sides):
        ap.error(f"--sides: each of {list(SIDES)}")
    if any(SIDES[s][0] == "trl" for s in sides) and not args.trl_python:
        ap.error("--trl-python is needed for a trl side (or --sides ours)")
    PG = args.prompts * args.group
    micro = args.micro_batch or PG
    if PG % micro:
        ap.error(f"--micro-batch {micro} must divide P x G = {PG}")
    if any(size not in SHAPES for size in args.sizes.split(",")):
        ap.error(f"--sizes: each of {list(SHAPES)}")
    if args.turns < 2:
        ap.error("--turns must be at least 2 (the single-turn sizes are the others)")

    work = args.keep or tempfile.mkdtemp(prefix="grpo_vs_trl_")
    os.makedirs(work, exist_ok=True)
    base = args.base or default_model(args.cache_dir)
    load = os.getloadavg()
    print(
        f"threads {args.threads}, sides {', '.join(sides)}, P={args.prompts} x G={args.group}, "
        f"M={args.max_tokens}, {args.steps} steps, micro-batch {micro}, lr {args.lr}; "
        f"{args.warmup_pairs} warm-up pair(s), then {args.pairs} interleaved pairs; "
        f"load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
        flush=True,
    )
    rows = []
    for size in args.sizes.split(","):
        folder = make_folder(size, base, os.path.join(work, f"model_{size}"))
        data, envs = os.path.join(work, f"prompts_{size}.jsonl"), env_config(size, work, args.seed)
        prompt_len = write_prompts(folder, data, args.seed, envs)
        turns = args.turns if size == "multiturn" else 1
        common = [
            "--folder",
            folder,
            "--data",
            data,
            "--envs",
            envs,
            "--threads",
            str(args.threads),
            "--prompts",
            str(args.prompts),
            "--turns",
            str(turns),
            "--group",
            str(args.group),
            "--max-tokens",
            str(args.max_tokens),
            "--steps",
            str(args.steps),
            "--micro-batch",
            str(micro),
            "--lr",
            str(args.lr),
            "--seed",
            str(args.seed),
        ]
        python = {"ours": sys.executable, "trl": args.trl_python}
        runs = {s: [] for s in sides}
        for r in range(args.warmup_pairs + args.pairs):  # the warm-up pairs first
            for side in sides:
                log = os.path.join(work, f"{size}_{side}_{r}.log")
                worker, extra, env = SIDES[side]
                cmd = [python[worker], os.path.abspath(__file__), "--worker", worker] + common
                cmd += ["--bf16"] if extra == ["--bf16"] else [f"--override={o}" for o in extra]
                out = summarize(run_child(cmd, args.threads, log, env))
                timed = r >= args.warmup_pairs
                print(
                    f"  {size} {side} "
                    f"{f'pair {r + 1 - args.warmup_pairs}' if timed else 'warm-up'}: "
                    f"{out['step']:.2f} s/step (sampling {out['sample']:.2f}, "
                    f"update {out['update']:.2f}, other {out['other']:.2f}), "
                    f"start-up {out['startup']:.1f} s, peak RSS {out['rss']:.2f} GiB, "
                    f"{out['tokens']:.1f} new tokens/sample"
                    + (
                        f", {out['turns']:.2f} turns and "
                        f"{out['tool_calls']:.2f} tool calls/sample, reward {out['reward']:.2f}"
                        if turns > 1
                        else ""
                    ),
                    flush=True,
                )
                if timed:
                    runs[side].append(out)
        rows.append((size, prompt_len, turns, runs))
    load = os.getloadavg()
    print(f"load average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n")
    print_table(rows, sides, args)


def print_table(rows, sides, args):
    med = statistics.median
    print(
        f"threads {args.threads}, P={args.prompts} x G={args.group}, M={args.max_tokens}, "
        f"{args.steps} steps, medians of {args.pairs} interleaved runs per side "
        "(each run: the median of its steps); ratios: A / B per pair of runs, then the median\n"
    )
    print(
        "| model | side | s/step | sampling s | update s | other s | all but sampling | start-up s "
        "| peak RSS GiB | new tokens/sample |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for size, prompt_len, _, runs in rows:
        for s in sides:
            f = {k: med(r[k] for r in runs[s]) for k in runs[s][0]}
            print(
                f"| {size} ({prompt_len:.0f}-token prompts) | {s} | {f['step']:.2f} "
                f"| {f['sample']:.2f} | {f['update']:.2f} | {f['other']:.2f} "
                f"| {f['not_sample'] / f['step']:.0%} | {f['startup']:.1f} | {f['rss']:.2f} "
                f"| {f['tokens']:.1f} |"
            )
    print(
        "\n| model | A / B | speed (B s/step / A) | sampling A/B | update A/B "
        "| all but sampling A/B | start-up A/B | peak RSS A/B |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for size, _, _, runs in rows:
        for a, b in RATIOS:
            if a not in sides or b not in sides:
                continue
            pairs = list(zip(runs[a], runs[b]))

            def ratio(key, invert=False):
                return med((y[key] / x[key]) if invert else (x[key] / y[key]) for x, y in pairs)

            print(
                f"| {size} | {a} / {b} | {ratio('step', invert=True):.2f}x | {ratio('sample'):.2f} "
                f"| {ratio('update'):.2f} | {ratio('not_sample'):.2f} | {ratio('startup'):.2f} "
                f"| {ratio('rss'):.2f} |"
            )
    multi = [(size, turns, runs) for size, _, turns, runs in rows if turns > 1]
    if not multi:
        return
    print(
        "\nWork per episode of the multi-turn sizes (means over a run's steps, "
        "then the median of the runs): new tokens sampled, assistant turns, "
        "tool calls parsed (finish included), the share of episodes our env ended "
        "(a finish call or a plain-text answer) within the turns sampled, "
        "the turns sampled after that (TRL only: ours stops there), the env's reward\n"
    )
    print(
        "| model | side | new tokens/sample | turns/sample | tool calls/sample | env-ended "
        "| turns after the end | reward |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for size, turns, runs in multi:
        for s in sides:
            f = {k: med(r[k] for r in runs[s]) for k in runs[s][0]}
            after = f"{f['after_end']:.2f}" if "after_end" in f else "-"
            print(
                f"| {size} (K={turns}) | {s} | {f['tokens']:.1f} | {f['turns']:.2f} "
                f"| {f['tool_calls']:.2f} | {f['ended']:.0%} | {after} | {f['reward']:.2f} |"
            )


# -----------------------------------------------------------------------------
# our side: train.main in this process


def ours_worker(args):
    import torch  # noqa: F401  (imported first, as train.py does, so its import time counts in the start-up)

    import train
    from config import load_config

    run_dir = tempfile.mkdtemp(prefix="grpo_vs_trl_ours_")
    max_prompt = max(len(json.loads(line)["ids"]) for line in open(args.data))
    overrides = [
        f"model.path={args.folder}",  # the envs: env_config's file
        f"steps={args.steps}",
        f"eval_every={args.steps + 1}",  # held-out eval: step 0 and the end only
        f"seed={args.seed}",
        f"threads={args.threads}",
        "wandb=false",
        f"out_dir={run_dir}",
        "run_name=bench",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.agent.n_samples={args.group}",
        f"rollout.max_tokens={args.max_tokens}",
        "rollout.temperature=1.0",
        "rollout.top_p=1.0",
        f"rollout.agent.max_turns={args.turns}",
        # the context window: prompt, C, one forced stop
        "rollout.agent.max_total_tokens="
        f"{max_prompt + episode_budget(args.turns, args.max_tokens) + 1}",
        f"learner.lr={args.lr}",
        f"learner.micro_batch_size={args.micro_batch}",
        "learner.policy_loss=ppo",
        "learner.loss.agg_mode=token-mean",
        "algo.name=grpo",
        "algo.skip_uniform_batches=false",
    ]
    cfg = load_config(args.envs, overrides + args.override)
    t_main = time.time()
    train.main(cfg)
    with open(os.path.join(run_dir, "bench", "metrics.jsonl")) as f:
        recs = [r for r in map(json.loads, f) if r.get("step", 0) >= 1 and "perf/step_seconds" in r]
    # seconds from main's start to each step end
    ends = [r["perf/elapsed_minutes"] * 60 for r in recs]
    step_s = [recs[0]["perf/step_seconds"]] + [b - a for a, b in zip(ends, ends[1:])]
    out = {
        "step_s": step_s,
        "sample_s": [r["perf/rollout_seconds"] for r in recs],
        "update_s": [r["perf/train_seconds"] for r in recs],
        "gate_s": [r["perf/sync_seconds"] for r in recs],
        "startup_s": t_main - T_PROCESS + ends[0] - recs[0]["perf/step_seconds"],
        "new_tokens": [r["rollout/response_tokens"] for r in recs],
        "reward": [r["rollout/reward"] for r in recs],
        "old_logprob_pass": [r["perf/old_logprob_pass"] for r in recs],
        "turns": [r["rollout/num_turns"] for r in recs],
        "tool_calls": [r["rollout/tool_calls"] for r in recs],
        # not cut by max_turns or a length limit
        "ended": [1 - r["rollout/truncated"] for r in recs],
    }
    shutil.rmtree(run_dir, ignore_errors=True)
    with open(args.result, "w") as f:
        json.dump(out, f)


# -----------------------------------------------------------------------------
# the TRL side: GRPOTrainer in this process
# (run with the TRL venv's python; trl is imported only here)

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number_reward(completions, answer, **kwargs):
    """1.0 if the last number in the completion equals the answer, else 0.0."""

    def right(text, want):
        found = NUMBER.findall(text or "")
        return bool(found) and abs(float(found[-1]) - float(want)) <= 1e-6

    return [float(right(c, a)) for c, a in zip(completions, answer)]


def import_ours():
    """env.py and chat.py from the repo (they need only the standard library), imported once TRL is
    loaded and with the repo on sys.path only while they load, so that no file of ours shadows a
    module of theirs -> (env, chat)."""
    sys.path.insert(0, ROOT)
    import chat
    import env

    sys.path.remove(ROOT)
    return env, chat


def env_tools(env, envs: str):
    """The multi-turn TRL side's tools and reward, done by our env (env_config's file `envs`; `env`
    the module)
    -> (tools, schemas, reward, work):
      tools    the functions TRL calls, one per toy_math tool: python_eval returns our env's
               run_tool text for the same call (the same sandbox); finish returns "" (our env ends
               the episode there and renders nothing);
      schemas  our env's schema of each tool, by name (what our prompts render);
      reward   TRL's reward function: each episode's assistant messages stepped through our env's
               step until the env ends the episode (a finish call, or a message without tool calls).
               Calls other than finish change nothing that toy_math grades, so they are not run a
               second time;
      work     filled by `reward` once per step: the means over the P x G episodes of WORK (turns,
               tool calls parsed, finish included, as our rollout/tool_calls counts them; ended;
               after_end, the turns TRL sampled after the env's end; reward)."""
    with open(envs) as f:
        spec = json.load(f)["envs"][0]
    toy = env.make_env(spec["name"], **spec.get("kwargs", {}))
    if toy.tool_names != ("python_eval", "finish"):
        sys.exit(
            "the multi-turn TRL side has functions for python_eval and finish, "
            f"not for {toy.tool_names}"
        )
    # python_eval reads none
    no_task = env.EnvState(task=env.Task(env=toy.name, id="bench", prompt="", answer=""))

    def python_eval(code: str):
        """Run Python code and return the result.

        Args:
            code: the code to run
        """
        return toy.run_tool(no_task, env.ToolCall("python_eval", {"code": code}))[1]

    def finish(answer: str):
        """Submit the final answer.

        Args:
            answer: the final answer
        """
        return ""

    work = {k: [] for k in WORK}

    def reward(completions, answer, **kwargs):
        """Our env's reward of each TRL episode (see above); the step's work goes to `work`."""
        rewards, totals = [], dict.fromkeys(("turns", "tool_calls", "ended", "after_end"), 0)
        for messages, want in zip(completions, answer):
            turns = [m for m in messages if m["role"] == "assistant"]
            state = env.EnvState(
                task=env.Task(env=toy.name, id="bench", prompt="", answer=str(want))
            )
            for k, m in enumerate(turns):
                calls = [c["function"] for c in m.get("tool_calls") or []]
                finish_calls = tuple(
                    env.ToolCall(c["name"], c["arguments"]) for c in calls if c["name"] == "finish"
                )
                if calls and not finish_calls:
                    continue  # python_eval only: the episode goes on
                state = toy.step(state, env.Action(m.get("content") or "", finish_calls))[0]
                if state.done:
                    totals["ended"] += 1
                    totals["after_end"] += len(turns) - k - 1
                    break
            rewards.append(state.reward)  # 0.0 unless the env ended the episode
            totals["turns"] += len(turns)
            totals["tool_calls"] += sum(len(m.get("tool_calls") or []) for m in turns)
        for key, total in totals.items():
            work[key].append(total / len(completions))
        work["reward"].append(sum(rewards) / len(completions))
        return rewards

    return [python_eval, finish], {t["function"]["name"]: t for t in toy.tools()}, reward, work


def trl_worker(args):
    # our files must not shadow a module of theirs
    here = (ROOT, os.path.dirname(os.path.abspath(__file__)))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") not in here]
    for k in (
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HF_DATASETS_OFFLINE",
        "HF_HUB_DISABLE_TELEMETRY",
    ):
        os.environ.setdefault(k, "1")  # local folders only
    import torch
    import transformers
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen2_5_chat_template

    torch.set_num_threads(args.threads)
    transformers.set_seed(args.seed)
    multi = args.turns > 1
    tokenizer_class, tools, reward_func = PreTrainedTokenizerFast, None, last_number_reward
    if multi:
        env, chat = import_ours()
        tools, schemas, reward_func, work = env_tools(env, args.envs)

        class EnvSchemaTokenizer(PreTrainedTokenizerFast):
            """Renders a tool function as our env's schema of that name (transformers would write
            one from the function's docstring, with a description per argument that ours has
            not)."""

            def apply_chat_template(self, conversation, tools=None, **kwargs):
                tools = tools and [schemas.get(getattr(t, "__name__", ""), t) for t in tools]
                return super().apply_chat_template(conversation, tools=tools, **kwargs)

        tokenizer_class = EnvSchemaTokenizer
    # tokenizer.json verbatim: transformers 5's AutoTokenizer rebuilds a qwen2 folder's
    # pre-tokenizer from its class
    tok = tokenizer_class(
        tokenizer_file=os.path.join(args.folder, "tokenizer.json"),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        truncation_side="left",
    )
    if multi:
        # TRL parses <tool_call> blocks only for a template it knows byte for byte;
        # the folder's is not one
        tok.chat_template = qwen2_5_chat_template
    model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id  # stop where ours stops
    model.generation_config.pad_token_id = tok.pad_token_id
    rows = [json.loads(line) for line in open(args.data)]
    if multi:  # the conversational prompts, rendered as GRPOTrainer renders them
        ids = [
            tok.apply_chat_template(
                r["messages"],
                tools=tools,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
            for r in rows
        ]
    else:
        ids = [tok(text=r["prompt"])["input_ids"] for r in rows]
    same = sum(i == r["ids"] for i, r in zip(ids, rows))
    if same != len(rows):
        sys.exit(f"TRL's prompt ids differ from ours on {len(rows) - same} of {len(rows)} prompts")

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_train_begin(self, a, s, c, **kw):
            self.ends.append(time.time())

        def on_step_end(self, a, s, c, **kw):
            self.ends.append(time.time())

    timer = StepTimer()
    PG = args.prompts * args.group
    # per model.generate call: (step, seconds, sampled tokens up to each row's first eos)
    calls = []
    plain_generate = model.generate

    def timed_generate(*a, **kw):
        t0 = time.time()
        out = plain_generate(*a, **kw)
        seconds = time.time() - t0
        prompt_len = (kw["input_ids"] if "input_ids" in kw else a[0]).shape[1]
        done = out[:, prompt_len:] == tok.eos_token_id  # (B, M) sampled tokens up to the first eos
        first = torch.where(done.any(1), done.int().argmax(1) + 1, done.shape[1])
        calls.append((len(timer.ends) - 1, seconds, float(first.sum())))
        return out

    model.generate = timed_generate

    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="grpo_vs_trl_trl_"),
        use_cpu=True,
        bf16=args.bf16,
        fp16=False,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=PG // args.micro_batch,
        num_generations=args.group,
        max_completion_length=episode_budget(args.turns, args.max_tokens),
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        num_iterations=1,
        use_vllm=False,
        gradient_checkpointing=False,
        seed=args.seed,
        data_seed=args.seed,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_completions=False,
        **({"max_tool_calling_iterations": args.turns - 1} if multi else {}),  # K generation rounds
    )
    prompt_key = "messages" if multi else "prompt"
    dataset = Dataset.from_list([{"prompt": r[prompt_key], "answer": r["answer"]} for r in rows])
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_func,
        args=cfg,
        train_dataset=dataset,
        processing_class=tok,
        callbacks=[timer],
        tools=tools,
    )
    trainer.remove_callback(PrinterCallback)
    # multi-turn: per step, the time in TRL's _generate (every round, tools and parsing)
    rollout_s = []
    if multi:
        # a tool result: TRL's ids against our agent's
        obs = [env.tool_message("python_eval", "42")]
        if (
            trainer._get_tool_suffix_ids(obs)
            != tok(text=chat.render_continuation(obs))["input_ids"]
        ):
            sys.exit("TRL's ids of a tool result differ from ours")
        plain_rollout = trainer._generate

        def timed_rollout(prompts):
            t0 = time.time()
            out = plain_rollout(prompts)
            rollout_s.append(time.time() - t0)
            return out

        trainer._generate = timed_rollout
    trainer.train()
    shutil.rmtree(cfg.output_dir, ignore_errors=True)
    step_s = [b - a for a, b in zip(timer.ends, timer.ends[1:])]
    gen_s = [sum(c[1] for c in calls if c[0] == i) for i in range(args.steps)]
    rounds = [sum(c[0] == i for c in calls) for i in range(args.steps)]  # generate calls per step
    rollouts = args.steps if multi else 0  # TRL's _generate calls timed
    if (
        len(step_s) != args.steps
        or any(not 1 <= r <= args.turns for r in rounds)
        or len(rollout_s) != rollouts
    ):
        sys.exit(
            f"expected {args.steps} steps of 1 to {args.turns} generate calls, "
            f"got {len(step_s)} steps and {rounds} calls"
        )
    sample_s = rollout_s if multi else gen_s
    out = {
        "step_s": step_s,
        "sample_s": sample_s,
        "update_s": [s - g for s, g in zip(step_s, sample_s)],
        "startup_s": timer.ends[0] - T_PROCESS,
        "new_tokens": [sum(c[2] for c in calls if c[0] == i) / PG for i in range(args.steps)],
        "loss_type": cfg.loss_type,
        "versions": {
            "trl": __import__("trl").__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
    }
    if multi:
        out.update(work, generate_s=gen_s, rounds=rounds)
    with open(args.result, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
