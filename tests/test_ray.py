"""Ray rollout workers on a real local cluster (2 CPUs, one per module): workers play the same
trajectories as run_episodes in this process with the same chunk seeds; the three dispatchers give
identical trajectories; async_batch_bounded keeps to max_in_flight; push_weights makes the workers
run the learner's weights; env steps on EnvWorkers equal in-process ones, errors included; train.py
runs with ray.rollout_workers=2; bad input is refused with a clear error."""

import json
import os
import sys
from dataclasses import replace

import pytest
import torch

from conftest import need, environ_restored

ray = need("ray", "a runtime dependency: bash setup.sh installs it")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_train import tiny  # noqa: E402,F401  (the session's tiny default model, built once)

from agent import AgentConfig, run_episodes  # noqa: E402
from env import ToyMathEnv, make_env, mix_seed  # noqa: E402
from rollout import SamplingParams, TorchEngine  # noqa: E402
from wings.cluster import (
    EnvPool,
    NumpyWeights,
    WorkerSpec,
    dispatch,
    make_placement_group,  # noqa: E402
    push_weights,
    start_env_workers,
    start_rollout_workers,
)

AGENT = AgentConfig(n_samples=2, max_turns=3, max_total_tokens=768)
PARAMS = SamplingParams(temperature=1.0, max_tokens=40)


@pytest.fixture(scope="module")
def cluster(tiny, tmp_path_factory):
    """One Ray cluster, 2 rollout workers (0.5 CPU each) and 2 env workers (0.25 CPU each) for the
    module."""
    from sft import build_default_model

    model_dir = build_default_model(tiny())
    with environ_restored():
        os.environ["RAY_AUTH_MODE"] = "disabled"
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            _temp_dir=str(tmp_path_factory.mktemp("ray")),
            log_to_driver=False,
        )
        spec = WorkerSpec(model_dir=model_dir, envs=[("toy_math", {})], agent=AGENT, threads=1)
        pg = make_placement_group(2, cpus=0.5)
        workers = start_rollout_workers(spec, 2, pg)
        env_workers = start_env_workers({"toy_math": make_env("toy_math")}, model_dir, 2, cpus=0.25)
        yield {"model_dir": model_dir, "workers": workers, "env_workers": env_workers}
        ray.shutdown()


def local_engine(model_dir):
    from model import load_model
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    return TorchEngine(load_model(model_dir).eval(), pad_id=tok.token_to_id("<|endoftext|>")), tok


def tasks(n, seed=0):
    return make_env("toy_math").sample_tasks("train", n, seed)


def same(a, b, exact=True):
    """Trajectory lists equal token for token (log-probs to float noise across processes unless
    exact)."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.task, x.group, x.sample) == (y.task, y.group, y.sample)
        assert (
            x.token_ids == y.token_ids and x.loss_mask == y.loss_mask and x.messages == y.messages
        )
        assert (x.reward, x.finish_reason, x.info) == (y.reward, y.finish_reason, y.info)
        if exact:
            assert x.logprobs == y.logprobs
        else:
            torch.testing.assert_close(
                torch.tensor(x.logprobs), torch.tensor(y.logprobs), rtol=0, atol=1e-5
            )


def in_process(model_dir, ts, seed, chunk_groups, agent=AGENT, step_many=None, envs=None):
    """The reference: run_episodes here, chunk by chunk with the dispatchers' seeds, groups
    renumbered."""
    engine, tok = local_engine(model_dir)
    envs = envs or {"toy_math": make_env("toy_math")}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers (same kernels, same sums)
    try:
        out = []
        for first in range(0, len(ts), chunk_groups):
            part = run_episodes(
                engine,
                envs,
                ts[first : first + chunk_groups],
                tok,
                agent,
                PARAMS,
                mix_seed(seed, first),
                step_many=step_many,
            )
            out += [replace(t, group=t.group + first) for t in part]
        return out
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_workers_play_what_run_episodes_plays(cluster):
    ts = tasks(4)
    trajs, stats = dispatch("async_batch", cluster["workers"], ts, PARAMS, seed=7, chunk_groups=2)
    assert [t.group for t in trajs] == [g for g in range(4) for _ in range(AGENT.n_samples)]
    assert sum(t.num_turns for t in trajs) > len(trajs)  # multi-turn: the tool loop ran on workers
    same(trajs, in_process(cluster["model_dir"], ts, 7, 2), exact=False)
    assert stats.chunks == 2 and stats.trajectories == 8 and stats.sampled_tokens > 0
    assert all(b > 0 for b in stats.busy_seconds) and 0 <= stats.idle_fraction < 1


@pytest.mark.slow
def test_dispatchers_give_identical_trajectories(cluster):
    ts, w, ew = tasks(5, seed=1), cluster["workers"], cluster["env_workers"]
    ref, s_all = dispatch("async_batch", w, ts, PARAMS, seed=3)
    bounded, s_bounded = dispatch("async_batch_bounded", w, ts, PARAMS, seed=3, max_in_flight=1)
    piped, s_piped = dispatch(
        "async_pipeline", w, ts, PARAMS, seed=3, agent=AGENT, env_workers=ew, max_in_flight=3
    )
    same(bounded, ref)
    same(piped, ref)
    assert s_all.max_in_flight == 5  # all at once
    assert s_bounded.max_in_flight == 1  # never more than asked
    assert 1 <= s_piped.max_in_flight <= 3
    two, s_two = dispatch("async_batch_bounded", w, ts, PARAMS, seed=3, max_in_flight=2)
    same(two, ref)
    assert s_two.max_in_flight == 2 and s_two.chunks == 5
    assert {k.split("/")[0] for k in s_piped.metrics()} == {"dispatch"}


@pytest.mark.slow
def test_push_weights_makes_workers_run_the_learners_weights(cluster):
    from model import load_model

    model_dir, w = cluster["model_dir"], cluster["workers"]
    engine, _ = local_engine(model_dir)
    base = {k: v.clone() for k, v in load_model(model_dir).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    moved = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    prompts = [[5, 6, 7, 8], [9, 10]]
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=11)
    before = ray.get(w[1].generate.remote(prompts, params))
    seconds = push_weights(w, moved)
    engine.update_weights(moved)
    after = [ray.get(x.generate.remote(prompts, params)) for x in w]
    expected = engine.generate(prompts, params)
    try:
        assert seconds > 0
        for gens in after:
            assert [x.token_ids for x in gens] == [x.token_ids for x in expected]
            for x, y in zip(gens, expected):
                torch.testing.assert_close(
                    torch.tensor(x.logprobs), torch.tensor(y.logprobs), rtol=0, atol=1e-4
                )
        # the push changed them
        assert [x.logprobs for x in after[1]] != [x.logprobs for x in before]
    finally:
        push_weights(w, base)  # the other tests use the base model


def test_numpy_weights_round_trip_bfloat16_too():
    """What push_weights puts in the object store gives back the same tensors, bfloat16 (no numpy
    dtype) included."""
    g = torch.Generator().manual_seed(0)
    sd = {"a": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g).to(torch.bfloat16)}
    out = NumpyWeights.from_torch(sd).to_torch()
    assert out.keys() == sd.keys()
    for k in sd:
        assert out[k].dtype == sd[k].dtype and torch.equal(out[k], sd[k]), k


@pytest.mark.slow
def test_env_pool_steps_equal_in_process_steps_errors_included(cluster):
    model_dir, ts = cluster["model_dir"], tasks(3, seed=2)
    bad_prompt = ts[1].prompt

    class Flaky(ToyMathEnv):
        """toy_math whose grader crashes on one task (defined in a function: Ray pickles it by
        value)."""

        def step(self, state, action):
            if state.task.prompt == bad_prompt:
                raise RuntimeError("the grader crashed")
            return super().step(state, action)

    here = in_process(model_dir, ts, 5, 3)
    same(in_process(model_dir, ts, 5, 3, step_many=EnvPool(cluster["env_workers"])), here)
    flaky_workers = start_env_workers({"toy_math": Flaky()}, model_dir, 1, cpus=0.0)
    try:
        here = in_process(model_dir, ts, 5, 3, envs={"toy_math": Flaky()})
        there = in_process(model_dir, ts, 5, 3, step_many=EnvPool(flaky_workers))
    finally:
        ray.kill(flaky_workers[0])
    same(there, here)
    errors = [t for t in there if t.finish_reason == "env_error"]
    # that task's episodes, and only those
    assert [t.group for t in errors] == [1] * AGENT.n_samples
    assert (
        errors[0].info == {"error": "RuntimeError: the grader crashed"} and errors[0].reward == 0.0
    )


@pytest.mark.slow
def test_train_py_with_ray_rollout_workers(cluster, tiny):
    """2 steps with 2 more rollout workers on the module's cluster (train.py joins a running
    Ray)."""
    from train import main

    cfg = tiny(
        "steps=2",
        "eval_every=100",
        "run_name=ray2",
        "ray.rollout_workers=2",
        "ray.cpus_per_worker=0.25",
        "ray.dispatcher=async_batch_bounded",
        "ray.chunk_groups=2",
        "learner.entropy_coef=0.01",
        # evals on the workers too
        "eval.n_samples=2",
        "eval.pass_k=[1,2]",
        "eval_temperature=1.0",
    )
    summary = main(cfg)
    lines = [json.loads(l) for l in open(os.path.join(summary["run_dir"], "metrics.jsonl"))]
    assert [l["step"] for l in lines] == [0, 1, 2]
    for l in lines[1:]:
        assert l["train/grad_norm"] > 0 and l["rollout/response_tokens"] > 0
        assert (
            l["dispatch/chunks"] == 2
            and l["dispatch/max_in_flight"] == 2
            and l["dispatch/tokens_per_s"] > 0
        )
        assert l["dispatch/push_seconds"] > 0
        assert l["sync/logprob_abs_diff"] < 1e-3  # worker 0 runs the learner's new weights
    assert "eval/accuracy" in lines[0] and "eval/accuracy" in lines[2]
    for l in (lines[0], lines[2]):  # pass@k from 2 samples of each held-out task
        # toy math's reward is 0/1
        assert l["eval/toy_math/pass@1"] == pytest.approx(l["eval/toy_math/mean@2"])
        assert l["eval/toy_math/pass@1"] <= l["eval/toy_math/pass@2"]
    samples = [
        json.loads(l)["sample"]
        for l in open(os.path.join(summary["run_dir"], "episodes_step2.jsonl"))
    ]
    assert samples == [0, 1] * 8
    assert os.path.exists(os.path.join(summary["run_dir"], "final", "model.safetensors"))


def test_bad_config_is_a_config_error():
    from train import cli

    for overrides, says in [
        (["ray.rollout_workers=2", "ray.dispatcher=async_bach"], "did you mean 'async_batch'"),
        (["ray.rollout_workers=2", "ray.dispatcher=async_pipeline"], "env_workers >= 1"),
        (["ray.env_workers=2"], "rollout_workers > 0"),
    ]:
        with pytest.raises(SystemExit, match=says):
            cli(["--config", "configs/toy_math.yaml", *overrides])
    with pytest.raises(ValueError, match="unknown dispatcher"):
        dispatch("async_batched", [object()], tasks(1), PARAMS, 0)


@pytest.mark.slow
def test_a_dead_worker_is_a_clear_error(cluster):
    """Last: it kills a worker of the module's cluster."""
    ray.kill(cluster["workers"][1])
    with pytest.raises(RuntimeError, match="RolloutWorker died"):
        dispatch("async_batch", cluster["workers"], tasks(2), PARAMS, seed=0)
