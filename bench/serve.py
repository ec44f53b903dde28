"""bench/serve.py: serve.py's batching against the engine it serves, and the external agent's
training step against the native loop's, side by side in one run (issue 38's two targets).

    .venv/bin/python bench/serve.py                       # both parts, the embedded default model,
                                                          1 torch thread
    .venv/bin/python bench/serve.py --part batching --sessions 64 --repeats 5
    .venv/bin/python bench/serve.py --part training --steps 5

batching: `sessions` clients (threads of another process: they do not take the server's GIL) each
          send one chat request at the same instant (a barrier), over plain HTTP on connections
          opened beforehand, to a serve.Server over a TorchEngine of the default model; against it,
          the same prompts (rendered and encoded as the server does) in one engine.generate call,
          with the same sampling (T = 1, max_tokens, stopping at <|im_end|>). tokens/s is sampled
          tokens over wall time (the server's: from the barrier to the last answer, so the HTTP work
          is in it). The two take turns, `repeats` times each; medians. Target: server / engine >=
          0.8.
training: train.main on the main config (configs/toy_math.yaml) for `steps` steps, native
          (agent.LocalRollouts) and with rollout.external_agent=examples/calc_agent.py:run, taking
          turns `repeats` times; the median of perf/step_seconds (and perf/rollout_seconds) over the
          steps after the first. Target: external / native <= 1.25. Held-out evaluation is off
          (eval_every past the last step).
Both parts run in this process with the same torch threads (--threads, default 1: on the 2-core
machine the engine, the event loop and the clients or agents share the cores). The agents run in
their own process (external_agent.AgentProcess), as in training.
"""

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from chat import encode, render  # noqa: E402
from config import load_config  # noqa: E402
from env import make_env  # noqa: E402
from rollout import SamplingParams, make_engine  # noqa: E402
from sft import build_default_model  # noqa: E402
from wings.serve import Server  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def conversations(cfg, count: int) -> tuple[list[list[dict]], list[dict]]:
    """The first request of `count` toy-math training episodes: (their messages, the tools)."""
    env = make_env(cfg.envs[0].name, **cfg.envs[0].kwargs)
    tasks = env.sample_tasks("train", count, 1234)
    return [env.reset(task, seed=i)[1] for i, task in enumerate(tasks)], env.tools()


def _clients(address, requests: list[bytes], pipe):
    """In a process of its own (so that the clients' threads do not take the server's GIL): open a
    connection per request, wait for the go, send them all at once, read every answer -> (seconds to
    the last one, tokens)."""
    sockets = [socket.create_connection(address, timeout=600) for _ in requests]
    barrier, tokens = threading.Barrier(len(requests) + 1), []

    def client(sock, request):
        barrier.wait()
        sock.sendall(request)
        data = b""
        while True:
            head, _, body = data.partition(b"\r\n\r\n")
            length = [
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            ]
            if length and len(body) >= length[0]:
                break
            data += sock.recv(1 << 16)
        reply = json.loads(body[: length[0]])
        tokens.append(reply["usage"]["completion_tokens"] if "usage" in reply else -1)

    threads = [threading.Thread(target=client, args=(s, r)) for s, r in zip(sockets, requests)]
    for t in threads:
        t.start()
    pipe.recv()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    pipe.send((time.perf_counter() - t0, tokens))


def sessions_at_once(address, bodies: list[dict]) -> tuple[float, int]:
    """Every body sent by its own client at the same instant -> (seconds to the last answer, sampled
    tokens)."""
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n"
    )
    requests = [head % len(data) + data for data in (json.dumps(b).encode() for b in bodies)]
    ours, theirs = multiprocessing.Pipe()
    child = multiprocessing.get_context("spawn").Process(
        target=_clients, args=(address, requests, theirs)
    )
    child.start()
    time.sleep(2.0)  # its connections open, its threads waiting
    ours.send("go")
    seconds, tokens = ours.recv()
    child.join()
    if min(tokens) < 0:
        raise RuntimeError("a request failed")
    return seconds, sum(tokens)


def bench_batching(cfg, model_dir: str, args) -> float:
    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    engine = make_engine("torch", model_dir, pad_id=tokenizer.token_to_id("<|endoftext|>"))
    server = Server(engine, tokenizer, "policy", max_model_len=4096)
    server.start()
    convs, tools = conversations(cfg, args.sessions)
    prompts = [encode(tokenizer, render(m, tools, add_generation_prompt=True)) for m in convs]
    im_end = tokenizer.token_to_id("<|im_end|>")
    speed = {"engine.generate": [], "server": []}
    try:
        for r in range(args.repeats + 1):  # the first round warms both up and is not counted
            t0 = time.perf_counter()
            gens = engine.generate(
                prompts,
                SamplingParams(max_tokens=args.max_tokens, stop_token_ids=(im_end,), seed=r),
            )
            seconds, tokens = time.perf_counter() - t0, sum(len(g.token_ids) for g in gens)
            if r:
                speed["engine.generate"].append(tokens / seconds)
            bodies = [
                {
                    "model": "policy",
                    "messages": m,
                    "tools": tools,
                    "max_tokens": args.max_tokens,
                    "seed": 1000 * r + i,
                    "user": f"{r}/{i}",
                }
                for i, m in enumerate(convs)
            ]
            seconds, tokens = sessions_at_once(server.address, bodies)
            if r:
                speed["server"].append(tokens / seconds)
    finally:
        server.stop()
    print(
        f"\nbatching: {args.sessions} sessions x 1 chat request, "
        f"prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
        f"max_tokens {args.max_tokens}, T=1, {torch.get_num_threads()} threads, "
        f"median of {args.repeats}"
    )
    print("| | tokens/s (median) | each round |")
    print("|---|---|---|")
    for name, values in speed.items():
        print(
            f"| {name} | {statistics.median(values):,.0f} "
            f"| {', '.join(f'{v:,.0f}' for v in values)} |"
        )
    ratio = statistics.median(speed["server"]) / statistics.median(speed["engine.generate"])
    print(f"\nserver / engine.generate: {ratio:.2f}x (target >= 0.8)")
    return ratio


def step_times(
    config: str, steps: int, out_dir: str, extra: list[str]
) -> tuple[list[float], list[float]]:
    """train.main for `steps` steps -> (perf/step_seconds, perf/rollout_seconds) of the steps after
    the first."""
    from train import main

    cfg = load_config(
        config,
        [
            f"steps={steps}",
            f"eval_every={steps + 1}",
            f"out_dir={out_dir}",
            "wandb=false",
            f"threads={torch.get_num_threads()}",
            *extra,
        ],
    )
    run_dir = main(cfg)["run_dir"]
    lines = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    lines = [line for line in lines if "perf/step_seconds" in line][1:]
    return [line["perf/step_seconds"] for line in lines], [
        line["perf/rollout_seconds"] for line in lines
    ]


def bench_training(args) -> float:
    agent = f"rollout.external_agent={os.path.join(ROOT, 'examples', 'calc_agent.py')}:run"
    kinds = {"native": [], "external agent": []}
    times = {k: ([], []) for k in kinds}
    with tempfile.TemporaryDirectory(prefix="bench_serve_") as tmp:
        for r in range(args.repeats):
            for kind in kinds:
                extra = [f"run_name={kind.replace(' ', '_')}_{r}"] + (
                    [agent] if kind != "native" else []
                )
                step, rollout = step_times(args.config, args.steps, tmp, extra)
                times[kind][0].extend(step)
                times[kind][1].extend(rollout)
    print(
        f"\ntraining: {args.config}, {args.steps} steps x {args.repeats} runs each "
        f"(the first step of a run not counted), {torch.get_num_threads()} threads"
    )
    print("| rollout source | step seconds (median) | rollout seconds (median) |")
    print("|---|---|---|")
    for kind, (step, rollout) in times.items():
        print(f"| {kind} | {statistics.median(step):.2f} | {statistics.median(rollout):.2f} |")
    ratio = statistics.median(times["external agent"][0]) / statistics.median(times["native"][0])
    print(f"\nexternal agent / native step: {ratio:.2f}x (target <= 1.25)")
    return ratio


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--part", choices=["batching", "training", "both"], default="both")
    p.add_argument("--config", default="configs/toy_math.yaml")
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument(
        "--max-tokens", type=int, default=48, help="the main config's rollout.max_tokens"
    )
    p.add_argument("--steps", type=int, default=4, help="training steps per run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, ["wandb=false"])
    model_dir = build_default_model(cfg)
    if args.part in ("batching", "both"):
        bench_batching(cfg, model_dir, args)
    if args.part in ("training", "both"):
        bench_training(args)


if __name__ == "__main__":
    main()
