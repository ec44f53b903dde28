"""external_agent.py: training the user's own agent, one written against OpenAI's API, not against
our agent loop (a wing of train.py: the rollout source; turned on by
rollout.external_agent=path.py:function).

    python train.py --config configs/toy_math.yaml rollout.external_agent=examples/calc_agent.py:run

The user's callable is run once per episode, in a thread of this process (WORKERS at once: a step's
episodes all play together, so the server batches their requests as our agent loop batches
its turns):

    run(task: dict, base_url: str, session: str) -> float | str | list[float] | None

  task      {"id", "env", "prompt"}: the task as plain data. The reference answer is left out: the
            agent never sees it.
  base_url  a serve.Server over the run's engine (http://127.0.0.1:PORT/v1), which any OpenAI client
            can talk to (Anthropic's client: the same URL without /v1). It serves whatever model
            name the agent asks for: the policy being trained answers.
  session   the episode's id, to be sent with every request, as OpenAI's `user` field, Anthropic's
            metadata.user_id or the X-Session-Id header. A request that names no session, or one not
            running now, is refused (400).
  returns   a number: the episode's reward (the agent grades itself); a string: its final answer,
            graded here by the env's own grader (env.grade_answer(task, answer), as env.step grades
            a finish call: the reference stays with the trainer); a list of numbers: one reward per
            turn (per request of the session that is trained: a resent request counts once), their
            sum the episode's reward (algo.credit=turn uses them; otherwise the last turn's own
            credit). None, a NaN, a bool or anything else: no reward.

What the agent may not choose: the server samples with the run's settings (rollout.temperature,
top_p, top_k; at eval, eval_temperature), and a request that asks for other ones is refused (400)
rather than trained on as if it had been sampled otherwise; max_tokens is capped at
rollout.max_tokens and at the room left in the context window (rollout.agent.max_total_tokens; a
prompt that already fills it is refused: context_length_exceeded); the seed is the episode's own,
mix_seed(mix_seed(seed, group, sample), k) for the session's k-th request, and the server gives each
request the same tokens whatever shares its batch, so a run samples the same tokens whatever order
the threads reach the engine in (the log-probs agree to float rounding: wings/batcher.py's docstring
says why).

An episode counts as failed, and its group is dropped and refilled (train.collect_rollouts, exactly
as for an env that raised: finish_reason "env_error", counted in rollout/failed_episodes and
rollout/dropped_groups) when the agent raises (rollout/external_errors), runs past its timeout
(rollout/external_timeouts: a `timeout_s` attribute on the callable, else TIMEOUT_S; the thread
cannot be killed, so it is left to finish on its own, daemonic, and its session is closed: its later
requests are refused), returns no reward (rollout/external_no_reward), made no request, or asked for
n > 1 samples on a request that no later request continues, where it is not known which one it went
on with (rollout/external_multi_sample). Held-out evaluation plays through the same agent, and a
failed episode there scores 0.

A session is not always one token sequence (capture.py's docstring): a client that rewrote its
history (it dropped a think block, edited an earlier message: the prefix invariant broke) or made a
side call (a title, a summary) trains as several rows (agent.Trajectory.rows), one per chain of
requests, each the exact prompt ids the engine was given (mask 0) and what it sampled (mask 1):
nothing re-tokenized. Its rows share the episode's reward and advantage (the group baseline is over
episodes, not rows; train.py), each row's turns numbered within the episode for algo.credit=turn;
counted in rollout/external_branched. A request the client resent (it timed out) is trained once:
the first, orphaned, is dropped (rollout/external_orphans), and a request whose client left before
its answer was complete is never recorded (rollout/external_disconnects).

The trajectories are capture.session_trajectories' rows: exactly the ids the engine was given and
sampled, with its log-probs, kept-set sizes and weight versions, so group advantages, turn credit
and the off-policy corrections work unchanged. Weights go to the engine through the Server
(update_weights, between batches), and the weight-sync gate probes the engine through it (generate),
as for any rollout source. Docs: docs/external_agent.md.

Imports: env.py, agent.py, wings/capture.py, wings/serve.py, wings/serve_http.py (RequestError) (and
the standard library).
"""

import importlib.util
import math
import multiprocessing
import multiprocessing.connection
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace

from agent import AgentConfig, Trajectory, finish_episodes
from env import Env, Task, mix_seed
from wings.capture import session_trajectories
from wings.serve import Server, Stops
from wings.serve_http import RequestError

TIMEOUT_S = 600.0  # seconds an episode may run, unless the callable has a `timeout_s` attribute
# episodes running at once (threads): the server batches the calls they make together, so a step's
# episodes (the main config: 16 prompts x 8) should all run at once
WORKERS = 256


def check_config(cfg) -> list:
    """config.WING_CHECKS' hook: rollout.external_agent names a function in a Python file, played in
    this process, synchronously (its file is checked by runs.check_paths, its function when
    load_agent imports it)."""
    spec = cfg.rollout.external_agent
    path, _, name = spec.rpartition(":")
    if not path.endswith(".py") or not name.isidentifier():
        raise ValueError(
            f"rollout.external_agent={spec!r} must look like path/to/agent.py:function"
        )
    if cfg.rollout.async_rollouts or cfg.ray.rollout_workers:
        raise ValueError(
            "rollout.external_agent runs your agent in this process, one batch at a time: "
            "it cannot go with rollout.async_rollouts or ray.rollout_workers"
        )
    if cfg.rollout.engine == "openai":
        raise ValueError(
            "rollout.external_agent trains the engine it serves in this process: "
            "rollout.engine must be torch or vllm, not openai"
        )
    return []


def load_agent(spec: str):
    """ "path.py:function" -> that callable, the file imported now, under its file's name but not
    entered in sys.modules (a user's agent.py must not shadow ours). A missing file, an import that
    raises or a name that is not a callable is a ValueError naming rollout.external_agent."""
    path, _, name = spec.rpartition(":")
    if not path.endswith(".py") or not name.isidentifier():
        raise ValueError(
            f"rollout.external_agent={spec!r} must look like path/to/agent.py:function"
        )
    if not os.path.isfile(path):
        raise ValueError(f"rollout.external_agent: no file {path!r}")
    module_name = os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        raise ValueError(
            f"rollout.external_agent: importing {path} raised {type(e).__name__}: {e}"
        ) from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"rollout.external_agent: {path} defines no callable {name!r}")
    return fn


# -----------------------------------------------------------------------------
# the server: the run's sampling, the episodes' sessions and seeds


class RunServer(Server):
    """serve.Server for a training run: it samples with the run's settings, serves only the sessions
    of episodes running now (each with its own seed), and answers to any model name (the policy is
    the only model)."""

    def __init__(self, engine, tokenizer, chat_format: str, context: int):
        super().__init__(engine, tokenizer, "policy", chat_format, max_model_len=context, max_n=8)
        self.params = None  # the SamplingParams of the play() in progress
        # running session -> [its seed, its next call's index]
        self.seeds: dict[str, list[int]] = {}
        self.sessions_lock = threading.Lock()

    def open(self, session: str, seed: int):
        with self.sessions_lock:
            self.seeds[session] = [seed, 0]

    def close(self, session: str) -> list:
        """The session's calls, handed over; later requests naming it are refused."""
        with self.sessions_lock:
            self.seeds.pop(session, None)
        return self.capture.pop(session)

    # any name: whatever the agent calls its model, the policy answers
    def check_model(self, body: dict):
        if not isinstance(body.get("model", ""), str):
            raise RequestError(400, "model must be a string", "model")

    def session_body(self, body: dict, session: str | None) -> dict:
        """The request with the episode's seed in it, mix_seed(its seed, k) for the session's k-th
        request, or a 400 when the session is not an episode running now."""
        with self.sessions_lock:
            entry = self.seeds.get(session) if session is not None else None
            if entry is None:
                raise RequestError(
                    400,
                    f"session {session!r} is not an episode running now: send the session id "
                    "given to your run() as `user`, metadata.user_id or the X-Session-Id header",
                    "user",
                )
            k, entry[1] = entry[1], entry[1] + 1
        return {**body, "seed": mix_seed(entry[0], k)}

    def sampling(self, body: dict, prompt_len: int, stops: Stops):
        """The run's temperature, top_p and top_k (a request asking for others is refused),
        max_tokens capped at the run's and at the room left in the context window."""
        p = self.params
        for key, ours, default in (
            ("temperature", p.temperature, None),
            ("top_p", p.top_p, None),
            ("top_k", p.top_k, (0, -1)),
        ):
            theirs = body.get(key)
            if (
                theirs is not None
                and theirs != ours
                and not (default and theirs in default and ours == 0)
            ):
                raise RequestError(
                    400,
                    f"{key}={theirs!r}: this server samples with the training run's {key}="
                    f"{ours!r} (rollout.{key}; eval_temperature when evaluating): leave {key} "
                    "out of the request",
                    key,
                )
        key = (
            "max_completion_tokens"
            if body.get("max_completion_tokens") is not None
            else "max_tokens"
        )
        asked = body.get(key)
        room = self.max_model_len - prompt_len
        if (
            room < 1
            or asked is not None
            and (not isinstance(asked, int) or isinstance(asked, bool) or asked < 1)
        ):
            return super().sampling(body, prompt_len, stops)  # the parent's 400 says what is wrong
        body = {
            **body,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k,
            "max_tokens": min(asked or p.max_tokens, p.max_tokens, room),
            "max_completion_tokens": None,
        }
        return super().sampling(body, prompt_len, stops)


# -----------------------------------------------------------------------------
# running the user's callable


@dataclass
class Outcome:
    """What one run of the user's callable gave."""

    result: object = None  # what it returned
    error: str | None = None  # "ExceptionName: message" when it raised
    timed_out: bool = False  # still running at its deadline (its thread is abandoned)


def run_callables(
    fn, args: list[tuple], timeout_s: float, workers: int = WORKERS, on_timeout=lambda i: None
) -> list[Outcome]:
    """fn(*args[i]) for every i, at most `workers` at once, each in a daemon thread of its own ->
    one Outcome each, in order. An exception is caught into its Outcome; a call running past
    timeout_s (counted from its own start) is abandoned: on_timeout(i) is called (the session
    closed) and a new call takes its place."""
    out = [Outcome() for _ in args]
    changed = threading.Event()

    def call(i):
        outcome = out[i]  # after a timeout out[i] is another object: this one is dropped
        try:
            outcome.result = fn(*args[i])
        except BaseException as e:  # the user's code: anything it raises ends its episode only
            outcome.error = f"{type(e).__name__}: {e}"
        changed.set()

    pending, running = list(range(len(args)))[::-1], {}  # running: index -> (thread, start)
    while pending or running:
        while pending and len(running) < workers:
            i = pending.pop()
            thread = threading.Thread(
                target=call, args=(i,), daemon=True, name=f"external-agent-{i}"
            )
            running[i] = (thread, time.monotonic())
            thread.start()
        now = time.monotonic()
        for i, (thread, start) in list(running.items()):
            if not thread.is_alive():
                del running[i]
            elif now - start > timeout_s:
                out[i] = Outcome(timed_out=True)  # what the thread returns later is not looked at
                on_timeout(i)
                del running[i]
        if running:
            deadline = min(start for _, start in running.values()) + timeout_s
            changed.wait(timeout=max(0.001, min(0.5, deadline - time.monotonic())))
            changed.clear()
    return out


def _reward_like(result):
    """What a callable returned, as it can cross a process boundary: a possible reward as it is,
    anything else (it is no reward: grade() refuses it) as its repr in a dict."""
    scalar = (str, int, float, bool, type(None))
    if (
        isinstance(result, scalar)
        or isinstance(result, (list, tuple))
        and all(isinstance(x, scalar) for x in result)
    ):
        return result
    return {"not a reward": repr(result)[:200]}


def agent_process_main(spec: str, timeout_s: float, workers: int, fd: int):
    """The agents' process: the callable loaded from its file, each batch of episodes run as
    run_callables runs them (a timeout reported as it happens, so the trainer closes its session
    then), the outcomes sent back over the connection `fd`; it ends when the trainer says so or
    goes away."""
    conn = multiprocessing.connection.Connection(fd)
    fn = load_agent(spec)
    try:
        while (args := conn.recv()) is not None:
            out = run_callables(
                fn, args, timeout_s, workers, on_timeout=lambda i: conn.send(("timeout", i))
            )
            conn.send(("done", [replace(o, result=_reward_like(o.result)) for o in out]))
    except (EOFError, ConnectionError):  # the trainer is gone
        pass


class AgentProcess:
    """The user's callable in a process of its own, started once per run: its episodes run there, a
    thread each, so the agents' Python does not hold the trainer's GIL, which the engine thread and
    the server's event loop need. An OpenAI client spends ~3.5 ms of CPU per request (measured: the
    example agent's, against 0.3 ms for http.client), so in threads of the trainer's process 128
    agents serialise with the engine; here they run on another core. run(args, on_timeout) is
    run_callables' call. A fresh interpreter (`python -c`, not a fork of the trainer's threads, nor
    multiprocessing's spawn, which would import the trainer's own script again)."""

    def __init__(self, spec: str, timeout_s: float, workers: int = WORKERS):
        self.conn, theirs = multiprocessing.Pipe()
        # where `wings` is imported from
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        code = (
            f"from wings.external_agent import agent_process_main; "
            f"agent_process_main({spec!r}, {timeout_s!r}, {workers!r}, {theirs.fileno()})"
        )
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]).rstrip(
                os.pathsep
            ),
        }
        self.process = subprocess.Popen(
            [sys.executable, "-c", code], pass_fds=(theirs.fileno(),), env=env
        )
        theirs.close()

    def run(self, args: list[tuple], on_timeout) -> list[Outcome]:
        self.conn.send(args)
        while True:
            kind, value = self.conn.recv()
            if kind == "done":
                return value
            on_timeout(value)

    def close(self):
        if self.process.poll() is None:
            self.conn.send(None)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:  # an agent thread that never returns keeps it up
                self.process.terminate()
                self.process.wait(timeout=10)
        self.conn.close()


def grade(result, env: Env, task: Task, turns: int) -> tuple[float, list[float], dict] | None:
    """What the callable returned -> (reward, per-turn rewards, info), or None: no reward. A string
    is a final answer graded by the env (env.grade_answer); a number the reward, credited to the
    last turn; a list one per turn."""

    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    if isinstance(result, str):
        reward, extra = env.grade_answer(task, result)
        return float(reward), [0.0] * (turns - 1) + [float(reward)], {"answer": result, **extra}
    if number(result):
        return float(result), [0.0] * (turns - 1) + [float(result)], {}
    if (
        isinstance(result, (list, tuple))
        and len(result) == turns
        and all(number(x) for x in result)
    ):
        return float(sum(result)), [float(x) for x in result], {}
    return None


def failed(task: Task, group: int, sample: int, error: str) -> Trajectory:
    """An episode that ended in the agent's failure: empty, finish_reason env_error, which
    collect_rollouts drops with its group (and evaluation scores 0)."""
    return Trajectory(
        task=task,
        group=group,
        sample=sample,
        token_ids=[],
        loss_mask=[],
        logprobs=[],
        prompt_len=0,
        messages=[],
        env_errors=1,
        finish_reason="env_error",
        info={"error": error},
    )


def episode(
    calls: list, outcome: Outcome, env: Env, task: Task, group: int, sample: int, session: str
) -> tuple[Trajectory, str, dict]:
    """One episode's session and what its callable gave -> (its trajectory, its kind: ok | branched
    (trained as several rows) | error | timeout | no_reward | multi_sample,
    capture.session_trajectories' metrics)."""
    if outcome.timed_out:
        return (
            failed(task, group, sample, f"the agent ran past its timeout (session {session})"),
            "timeout",
            {},
        )
    if outcome.error is not None:
        return failed(task, group, sample, f"the agent raised {outcome.error}"), "error", {}
    if not calls:
        return (
            failed(task, group, sample, f"the agent made no request in session {session}"),
            "error",
            {},
        )
    rows, metrics = session_trajectories(calls, session)
    if metrics["serve/multi_sample_ends"]:
        where = (
            "its last call" if len(calls[-1].samples) > 1 else "a call that no later call continues"
        )
        return (
            failed(
                task,
                group,
                sample,
                f"session {session} asked for n > 1 samples on {where}: which one the "
                "agent went on with, and so what its reward is the outcome of, is not "
                "known",
            ),
            "multi_sample",
            metrics,
        )
    turns = sum(r.num_turns for r in rows)  # the requests trained: a resent one once
    graded = grade(outcome.result, env, task, turns)
    if graded is None:
        return (
            failed(task, group, sample, f"the agent returned no reward: {outcome.result!r:.200}"),
            "no_reward",
            metrics,
        )
    for row in rows:
        row.task, row.group, row.sample = task, group, sample
    traj = rows[-1]  # the episode: its last row, with the episode's counts
    branched = len(rows) > 1
    if branched:  # trained as several rows (agent.Trajectory.rows)
        traj = replace(
            traj,
            rows=rows,
            num_turns=turns,
            num_tool_calls=sum(r.num_tool_calls for r in rows),
            parse_failures=sum(r.parse_failures for r in rows),
            truncated_turns=sum(r.truncated_turns for r in rows),
        )
    traj.reward, traj.turn_rewards, traj.info = graded
    traj.done, traj.finish_reason = True, "done"  # the agent ended the episode
    return traj, "branched" if branched else "ok", metrics


# -----------------------------------------------------------------------------
# the rollout source


class ExternalRollouts:
    """The rollout source of rollout.external_agent: it answers as agent.LocalRollouts does (play,
    generate, update_weights, sleep, wake_up, shutdown), the episodes played by the user's callable
    against a RunServer over the run's engine."""

    def __init__(self, cfg, engine, envs: dict[str, Env], tokenizer, fn=None, judge=None):
        # loaded here too: a bad file fails at build
        self.fn = fn or load_agent(cfg.rollout.external_agent)
        self.judge = judge  # an LLM judge (judge.py) of finished episodes, or None
        self.timeout_s = float(getattr(self.fn, "timeout_s", TIMEOUT_S))
        self.envs, self.agent = envs, cfg.rollout.agent
        self.server = RunServer(
            engine, tokenizer, cfg.rollout.agent.chat_format, cfg.rollout.agent.max_total_tokens
        )
        self.url = self.server.start()
        # the callable named by the config runs in a process of its own; one passed in (a test's)
        # in threads here
        self.process = (
            AgentProcess(cfg.rollout.external_agent, self.timeout_s) if fn is None else None
        )

    def play(
        self,
        tasks: list[Task],
        params,
        seed: int,
        judge_weight: float = 0.0,
        agent: AgentConfig | None = None,
    ) -> tuple[list[Trajectory], dict[str, float]]:
        """n_samples runs of the callable per task -> (trajectories group-major, rollout/external_*
        counts). Session f"{seed}/{group}/{sample}"; its calls are seeded from mix_seed(seed, group,
        sample)."""
        G = (agent or self.agent).n_samples
        self.server.params = params
        jobs = [(g, s, f"{seed}/{g}/{s}") for g in range(len(tasks)) for s in range(G)]
        for g, s, session in jobs:
            self.server.open(session, mix_seed(seed, g, s))
        args = [
            ({"id": tasks[g].id, "env": tasks[g].env, "prompt": tasks[g].prompt}, self.url, session)
            for g, s, session in jobs
        ]
        disconnected = self.server.capture.disconnected
        close = lambda i: self.server.close(jobs[i][2])  # noqa: E731 (at its timeout: later requests refused)
        outcomes = (
            self.process.run(args, close)
            if self.process
            else run_callables(self.fn, args, self.timeout_s, on_timeout=close)
        )
        trajs, kinds, orphans = [], [], 0
        for (g, s, session), outcome in zip(jobs, outcomes):
            traj, kind, metrics = episode(
                self.server.close(session),
                outcome,
                self.envs[tasks[g].env],
                tasks[g],
                g,
                s,
                session,
            )
            trajs.append(traj)
            kinds.append(kind)
            orphans += metrics.get("serve/orphans", 0.0) if kind in ("ok", "branched") else 0.0
        # judge_weight > 0: the judge's score added
        finish_episodes(self.envs, trajs, judge_weight, self.judge)
        counted = {
            "error": "errors",
            "timeout": "timeouts",
            "no_reward": "no_reward",
            "branched": "branched",
            "multi_sample": "multi_sample",
        }
        return trajs, {
            **{
                f"rollout/external_{name}": float(kinds.count(kind))
                for kind, name in counted.items()
            },
            "rollout/external_orphans": orphans,
            "rollout/external_disconnects": float(self.server.capture.disconnected - disconnected),
        }

    def generate(self, prompts: list[list[int]], params) -> list:
        """The engine's generate, between the server's batches (the weight-sync gate's probe)."""
        return self.server.generate(prompts, params)

    def update_weights(self, state_dict: dict, version: int | None = None) -> dict[str, float]:
        self.server.update_weights(state_dict, version)
        return {}

    def sleep(self):
        self.server.sleep()

    def wake_up(self):
        self.server.wake_up()

    def shutdown(self):
        if self.process is not None:
            self.process.close()
        self.server.stop()
