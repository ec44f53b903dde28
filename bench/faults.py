"""bench/faults.py: the fault-injection harness. Seeded faults at a set rate, one scenario per kind
of fault, and one
table: the faults injected, what the run counted, whether it went on, and the episodes lost without
a count.

    python bench/faults.py                     # every scenario, fault rate 0.25, 8 tasks x 4
    samples, seed 0 python bench/faults.py --rate 0.5 --tasks 16 --seed 3

Each scenario plays real episodes through the agent loop (agent.LocalRollouts, the env's own tool
dispatch env.Env.run_tool, chat.py's parser) with a scripted engine: every episode calls the tool
`flaky` once, then answers. The faults, each decided by a seeded draw per episode at the rate:
  tool raises / hangs past the env's tool_timeout / returns 1 MB / returns bytes    (the tool
  `flaky`) a malformed tool call (broken JSON) / a truncated one (cut before </tool_call>)   (the
  scripted engine's text) env.reset raises / env.step raises
  (the env) a NaN in the loss                                                                 (one
  advantage set to NaN)
What each must give: no exception out of the run; the counter that owns the fault equals the faults
injected (rollout/tool_errors, tool_timeouts and parse_failures summed over episodes; an observation
cut with its marker for 1 MB; rollout/failed_episodes; train/skipped_nonfinite); the episodes go on
(a tool fault is an observation, the next turn answers it); and the batch the learner trains on is
the one it should be. An episode whose env raised is dropped with its group (train.collect_rollouts,
which samples new prompts in its place for up to algo.max_refill_rounds=3 more rounds), never
half-trained: the update equals, torch.equal on every weight, the update on the batch built without
those groups; a NaN step leaves every weight as it was. "lost" counts episodes that vanished without
a counter: it must be 0.

Faults covered elsewhere, not here: an OpenAI-compatible server answering 500s or timing out is
retried, then reported
(tests/test_openai_engine.py::test_retries_server_errors_and_reports_client_errors); a Ray rollout
worker killed mid-batch (tests/test_ray.py); a run killed with SIGKILL (bench/kill_resume.py).
"""

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass, replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import env as env_module  # noqa: E402
from agent import LocalRollouts  # noqa: E402
from batch import to_batch  # noqa: E402
from chat import render  # noqa: E402
from config import Config, load_config  # noqa: E402
from env import Env, EnvState, Task, register_env  # noqa: E402
from learner import LearnerConfig, make_learner, train_step  # noqa: E402
from model import ModelConfig, init_model  # noqa: E402
from rollout import Generation  # noqa: E402
from sft import train_tokenizer  # noqa: E402
from tools import TOOLS, tool  # noqa: E402

TOOL_FAULTS = ("tool_raises", "tool_hangs", "tool_1mb", "tool_bytes")
CALL_FAULTS = ("malformed_call", "truncated_call")
ENV_FAULTS = ("reset_raises", "step_raises")
SCENARIOS = TOOL_FAULTS + CALL_FAULTS + ENV_FAULTS + ("nan_loss",)


def draws(seed: int, key: str, rate: float) -> bool:
    """The seeded fault draw for one episode (its task id and sample): the same on every run."""
    return random.Random(f"{seed}/{key}").random() < rate


# -----------------------------------------------------------------------------
# the faulty world: one tool, one number to report

if "flaky" not in TOOLS:

    @tool(
        "flaky",
        "Return the number n.",
        {
            "type": "object",
            "properties": {"n": {"type": "integer"}, "tag": {"type": "integer"}},
            "required": ["n", "tag"],
        },
    )
    def flaky(env, state, n, tag):
        """Answers str(n), or, for the call the engine tagged for one, its fault."""
        fault = env.tool_fault.get(tag)
        if fault == "tool_raises":
            raise RuntimeError("the flaky tool broke")
        if fault == "tool_hangs":
            time.sleep(env.tool_timeout * 3)
        if fault == "tool_1mb":
            return state, "x" * 2**20, None
        if fault == "tool_bytes":
            return state, bytes(range(256)), None
        return state, str(n), None


@dataclass(frozen=True)
class FaultState(EnvState):
    key: str = ""  # the episode's draw key


class FaultEnv(Env):
    """Reply 'ANSWER: n' for task n, after asking the tool. The faults of `scenario` strike episodes
    drawn at `rate`; `injected` counts them (the tool faults per call that reached the tool)."""

    tool_names = ("flaky",)
    tool_timeout = 0.2

    def __init__(self, scenario: str = "", rate: float = 0.0, seed: int = 0):
        self.scenario, self.rate, self.seed = scenario, rate, seed
        # a call's tag -> the fault it meets (the engine chooses)
        self.tool_fault: dict[int, str] = {}
        self.injected = 0

    def system_prompt(self) -> str:
        return "Ask the flaky tool for n, then reply ANSWER: n."

    def sample_tasks(self, split: str, n: int, seed: int) -> list[Task]:
        return [
            Task(
                env=self.name,
                id=f"{split}-{seed}-{i}",
                prompt=f"n is {1000 * (seed % 97) + i}.",
                answer=str(1000 * (seed % 97) + i),
            )
            for i in range(n)
        ]

    def score(self, task: Task, answer) -> float:
        return float(answer == task.answer)

    def reset(self, task: Task, seed: int):
        key = f"{task.id}/{seed}"
        if self.scenario == "reset_raises" and draws(self.seed, key, self.rate):
            self.injected += 1
            raise RuntimeError("the world would not start")
        state, msgs = super().reset(task, seed)
        return FaultState(**vars(state), key=key), msgs

    def step(self, state, action):
        if self.scenario == "step_raises" and draws(self.seed, state.key, self.rate):
            self.injected += 1
            raise RuntimeError("the world fell over")
        return super().step(state, action)


register_env("faults_calc")(FaultEnv) if "faults_calc" not in env_module.ENVS else None


class ScriptedAgent:
    """The engine: turn 0 calls flaky(n) (malformed or cut for the episodes the call faults strike),
    turn 1 answers with the number in the last tool reply. Log-probs are a known function of the
    token."""

    def __init__(self, tokenizer, scenario: str, rate: float, seed: int, env: FaultEnv):
        self.tok, self.scenario, self.rate, self.seed, self.env = (
            tokenizer,
            scenario,
            rate,
            seed,
            env,
        )
        self.injected, self.calls = 0, 0  # call faults written; tool calls written (their tags)

    def generate(self, prompts, params):
        out = []
        for k, p in enumerate(prompts):
            text = self.tok.decode(p, skip_special_tokens=False)
            n = int(text.split("n is ")[1].split(".")[0])
            if text.count("<|im_start|>assistant") > 1:
                # the tool answered (or an error did): the reply
                reply = f"ANSWER: {n}"
            else:
                self.calls += 1
                reply = (
                    '<tool_call>\n{"name": "flaky", "arguments": {"n": %d, "tag": %d}}\n'
                    "</tool_call>" % (n, self.calls)
                )
                strike = draws(self.seed, f"{self.calls}/{params.seed}/{k}", self.rate)
                if self.scenario in TOOL_FAULTS and strike:
                    self.env.tool_fault[self.calls] = self.scenario
                elif self.scenario == "malformed_call" and strike:
                    # not JSON
                    reply, self.injected = reply.replace('"n": ', '"n" '), self.injected + 1
                elif self.scenario == "truncated_call" and strike:
                    # no closing tag
                    reply, self.injected = reply[: -len("\n</tool_call>")], self.injected + 1
            ids = self.tok.encode(reply + "<|im_end|>", add_special_tokens=False).ids[
                : params.max_tokens
            ]
            out.append(
                Generation(
                    token_ids=ids, logprobs=[-(t % 13 + 1) / 10 for t in ids], finish_reason="stop"
                )
            )
        return out


# -----------------------------------------------------------------------------
# the scenarios


def setup(args) -> tuple:
    """A tokenizer for the world's conversations, a tiny policy over it, and the run's config."""
    env = FaultEnv()
    texts = [
        render(
            [
                {"role": "system", "content": env.system_prompt()},
                {"role": "user", "content": t.prompt},
                {
                    "role": "assistant",
                    "content": '<tool_call>\n{"name": "flaky", "arguments": {"n": 5, '
                    '"tag": 7}}\n</tool_call>',
                },
                {"role": "tool", "name": "flaky", "content": "5"},
                {"role": "assistant", "content": "ANSWER: 5"},
            ],
            env.tools(),
        )
        for t in env.sample_tasks("train", 50, 0)
    ]
    tok = train_tokenizer(texts, 400)
    model = init_model(
        ModelConfig(
            vocab_size=tok.get_vocab_size(),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=True,
        ),
        seed=args.seed,
    )
    cfg = load_config(
        None,
        [
            "envs=[{name: faults_calc}]",
            f"rollout.prompts_per_step={args.tasks}",
            f"rollout.agent.n_samples={args.samples}",
            "rollout.agent.max_turns=3",
            "rollout.max_tokens=64",
            "rollout.agent.max_total_tokens=8192",
            "algo.max_refill_rounds=3",
            f"seed={args.seed}",
            "algo.skip_uniform_batches=false",
        ],
    )
    return tok, model, cfg


def play(tok, cfg: Config, scenario: str, rate: float, seed: int, step: int = 1):
    """One step's rollouts through train.collect_rollouts -> (the trajectories kept, metrics, env,
    engine)."""
    import train

    world = FaultEnv(scenario, rate, seed)
    engine = ScriptedAgent(tok, scenario, rate, seed, world)
    rollouts = LocalRollouts(engine, {"faults_calc": world}, tok, cfg.rollout.agent)
    trajs, metrics = train.collect_rollouts(cfg, rollouts, {"faults_calc": world}, step)
    return trajs, metrics, world, engine


def update(model, tok, cfg: Config, trajs, nan: bool = False) -> torch.nn.Module:
    """One GRPO update of a copy of `model` on `trajs` -> the updated copy."""
    import copy
    import train

    policy = copy.deepcopy(model)
    lc = LearnerConfig(lr=1e-2, micro_batch_size=4)
    state = make_learner(policy, lc, seed=0)
    batch = to_batch(trajs, pad_id=tok.token_to_id("<|endoftext|>"))
    tb, _, _, _ = train.compute_advantages(replace(cfg, learner=lc), batch, state, None)
    if nan:
        tb = replace(
            tb, advantages=tb.advantages.clone().index_fill_(0, torch.tensor([0]), float("nan"))
        )
    state, metrics = train_step(state, tb, lc)
    policy.metrics = metrics
    return policy


def run_scenario(name: str, tok, model, cfg: Config, args) -> dict:
    row = {"fault": name, "injected": 0, "counted": 0, "survived": True, "lost": 0, "check": ""}
    if name == "nan_loss":
        trajs, _, _, _ = play(tok, cfg, "", 0.0, args.seed)
        after = update(model, tok, cfg, trajs, nan=True)
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), after.parameters()))
        row.update(
            injected=1,
            counted=int(after.metrics["train/skipped_nonfinite"]),
            check=f"weights unchanged: {same}",
        )
        row["survived"] = same
        return row
    trajs, metrics, world, engine = play(tok, cfg, name, args.rate, args.seed)
    n = len(trajs)
    if name in TOOL_FAULTS:
        row["injected"] = sum(
            1
            for t in trajs
            for m in t.messages
            if m["role"] == "assistant"
            and "tool_calls" in m
            and world.tool_fault.get(m["tool_calls"][0]["function"]["arguments"]["tag"]) == name
        )
        if name == "tool_1mb":
            row["counted"] = sum(
                "[truncated, 1048576 chars in all]" in m["content"]
                for t in trajs
                for m in t.messages
                if m["role"] == "tool"
            )
        else:
            key = "rollout/tool_timeouts" if name == "tool_hangs" else "rollout/tool_errors"
            row["counted"] = round(metrics[key] * n)
    elif name in CALL_FAULTS:
        row["injected"], row["counted"] = (
            engine.injected,
            round(metrics["rollout/parse_failures"] * n),
        )
    else:  # env faults: dropped with their groups, refilled
        row["injected"], row["counted"] = world.injected, metrics["rollout/failed_episodes"]
        G, want = cfg.rollout.agent.n_samples, cfg.rollout.prompts_per_step
        # the same rounds played again with every group kept, then the failed groups removed by hand
        # and the first `want` whole groups taken: the batch without them
        import train

        world2 = FaultEnv(name, args.rate, args.seed)
        engine2 = ScriptedAgent(tok, name, args.rate, args.seed, world2)
        whole, played = [], 0
        for r in range(int(metrics["rollout/rounds"])):
            tasks = train.sample_mixture(
                {"faults_calc": world2},
                [("faults_calc", 1.0)],
                "train",
                want,
                train.mix_seed(cfg.seed, 1, train.SEED_TASKS, r),
            )
            raw, _ = LocalRollouts(engine2, {"faults_calc": world2}, tok, cfg.rollout.agent).play(
                tasks,
                train.SamplingParams.of(cfg.rollout),
                train.mix_seed(cfg.seed, 1, train.SEED_EPISODES, r),
            )
            played += len(raw)
            groups = [raw[i : i + G] for i in range(0, len(raw), G)]
            whole += [g for g in groups if not any(t.finish_reason == "env_error" for t in g)]
        without = [t for g in whole[:want] for t in g]
        # every episode played is in the batch, in a dropped group (counted),
        # or in a whole group past the batch
        row["lost"] = (
            played - n - G * metrics["rollout/dropped_groups"] - G * max(0, len(whole) - want)
        )
        a, b = update(model, tok, cfg, trajs), update(model, tok, cfg, without)
        equal = all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
        row["check"] = (
            "update == update without the failed groups: "
            f"{equal} ({int(metrics['rollout/rounds'])} rounds)"
        )
        row["survived"] = equal and all(t.finish_reason != "env_error" for t in trajs)
    row["survived"] = row["survived"] and n > 0 and all(t.num_turns >= 1 for t in trajs)
    return row


def run_all(args) -> list[dict]:
    tok, model, cfg = setup(args)
    return [run_scenario(name, tok, model, cfg, args) for name in args.scenarios]


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rate", type=float, default=0.25, help="the share of episodes a fault strikes")
    p.add_argument("--tasks", type=int, default=8, help="tasks (groups) per scenario")
    p.add_argument("--samples", type=int, default=4, help="episodes per task")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    args = p.parse_args(argv)
    rows = run_all(args)
    print(
        f"# bench/faults.py: rate {args.rate}, {args.tasks} tasks x {args.samples} episodes, "
        f"seed {args.seed}\n"
    )
    print(
        "| fault | injected | counted | survived | episodes lost | check |\n"
        "|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['fault']} | {r['injected']} | {r['counted']} "
            f"| {'yes' if r['survived'] else 'NO'} | {r['lost']} | {r['check']} |"
        )
    bad = [
        r["fault"] for r in rows if r["counted"] != r["injected"] or not r["survived"] or r["lost"]
    ]
    if bad:
        raise SystemExit(f"faults not survived or not counted exactly: {bad}")
    return rows


if __name__ == "__main__":
    main()
