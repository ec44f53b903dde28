"""The launch paths on CPU: a run resumed under torchrun repeats the uninterrupted one exactly, and
`ray job submit -- python train.py ... ray.learner_workers=2` (the learner's ranks as Ray actors)
trains exactly as `torchrun --nproc_per_node 2` does.

The reference is one 4-step run under torchrun (checkpoints every 2 steps), made once per module;
the other launch paths must reproduce its records. One real Ray cluster (`ray start --head`, 2 CPUs,
its own temp dir and ports) serves the module; it is stopped by killing its process group (`ray
stop` would stop every Ray on the machine, other people's included)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import need

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_distributed import ROOT, torchrun  # noqa: E402
from test_train import TINY, tiny  # noqa: E402,F401  (the session's tiny default model, built once)

# mini_batches=2: an RL step is two optimizer steps, so the resume below must go by the RL step
EXTRA = [
    "eval_every=100",
    "threads=1",
    "learner.micro_batch_size=3",
    "learner.entropy_coef=0.01",
    "learner.mini_batches=2",
]
RAY = os.path.join(os.path.dirname(sys.executable), "ray")  # the CLI next to this Python


def records(run_dir: str) -> dict[int, dict]:
    """metrics.jsonl by step, without the perf/* timings (they differ between any two runs)."""
    lines = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
    return {l["step"]: {k: v for k, v in l.items() if not k.startswith("perf/")} for l in lines}


def cli_args(cfg) -> list[str]:
    """The command-line arguments that make train.py build `cfg`'s tiny model in the same cache and
    folder."""
    return [
        "--config",
        "configs/toy_math.yaml",
        *TINY,
        f"model.cache_dir={cfg.model.cache_dir}",
        f"out_dir={cfg.out_dir}",
    ]


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture(scope="module")
def reference(tiny):
    """The uninterrupted run: 4 steps under torchrun, a checkpoint every 2. -> its run folder."""
    from sft import build_default_model

    cfg = tiny(*EXTRA, "run_name=launch_full")
    build_default_model(cfg)  # once (shared with test_train.py)
    torchrun(
        [
            "train.py",
            *cli_args(cfg),
            *EXTRA,
            "steps=4",
            "checkpoint_every=2",
            "run_name=launch_full",
        ],
        timeout=300,
    )
    return os.path.join(cfg.out_dir, "launch_full")


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """`ray start --head` in the repo root (a job's entrypoint runs where the head started) with
    this checkout on PYTHONPATH. -> (GCS address for ray.address, dashboard URL for `ray job
    submit`, environment for the CLI)."""
    need("ray.dashboard", "`ray job submit` talks to the dashboard's job server")
    gcs, dash, client = free_ports(3)
    env = {**os.environ, "PYTHONPATH": ROOT, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    # its own session: every daemon it starts (GCS, raylet, dashboard, workers) joins this process
    # group
    proc = subprocess.Popen(
        [
            RAY,
            "start",
            "--head",
            "--num-cpus",
            "2",
            "--temp-dir",
            str(tmp_path_factory.mktemp("ray")),
            "--port",
            str(gcs),
            "--dashboard-host",
            "127.0.0.1",
            "--dashboard-port",
            str(dash),
            "--ray-client-server-port",
            str(client),
            "--disable-usage-stats",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, out[-3000:]
        yield f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dash}", env
    finally:
        stop_group(proc.pid)


def stop_group(pgid: int, grace: float = 10.0):
    """SIGTERM to a process group, then SIGKILL to whatever is left after `grace` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.time() + grace
        while time.time() < deadline:
            try:
                os.killpg(pgid, 0)  # anyone left?
            except ProcessLookupError:
                return
            time.sleep(0.2)


def same_records(run_dir: str, reference: str, steps: list[int]):
    """Each step's record of run_dir holds the reference's (equal values); only held-out evals may
    be added (a shorter run evaluates at its own last step)."""
    ours, ref = records(run_dir), records(reference)
    assert sorted(ours) == steps
    for step in steps:
        assert {k: ours[step].get(k) for k in ref[step]} == ref[step], step
        assert all(k.startswith("eval/") for k in set(ours[step]) - set(ref[step])), step


@pytest.mark.slow
def test_ray_job_submit_with_learner_actors_matches_torchrun(tiny, reference, ray_head):
    """`ray job submit -- python train.py ... ray.learner_workers=2` on a `ray start --head`
    cluster: the job succeeds, and its two learner actors (ranks 0 and 1, gloo) log what torchrun's
    2 processes logged, step by
    step: rollouts, losses, gradient norms, the weight-sync gate."""
    _, dashboard, env = ray_head
    cfg = tiny(*EXTRA, "run_name=launch_job")
    cmd = [
        RAY,
        "job",
        "submit",
        "--address",
        dashboard,
        "--",
        sys.executable,
        "train.py",
        *cli_args(cfg),
        *EXTRA,
        "steps=2",
        "run_name=launch_job",
        "ray.learner_workers=2",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "succeeded" in out, out[-3000:]
    run_dir = os.path.join(cfg.out_dir, "launch_job")
    same_records(run_dir, reference, [0, 1, 2])
    assert records(run_dir)[1]["train/grad_norm"] > 0
    assert json.load(open(os.path.join(run_dir, "summary.json")))["final_accuracy"] is not None


@pytest.mark.slow
def test_a_failing_learner_actor_is_named(tiny, ray_head, tmp_path):
    """Joining the cluster at ray.address, every rank raises at once (resume= a folder that is no
    checkpoint, which main() refuses before anything else): the driver stops with the rank and the
    cause, and kills the other actors."""
    from train import main
    from wings.cluster import launch_on_ray

    gcs, _, _ = ray_head
    (tmp_path / "not_a_checkpoint").mkdir()
    with pytest.raises(
        RuntimeError, match=r"learner rank \d of 2 failed:(.|\n)*not_a_checkpoint: the folder"
    ):
        launch_on_ray(
            tiny(
                f"resume={tmp_path / 'not_a_checkpoint'}",
                f"ray.address={gcs}",
                "ray.learner_workers=2",
            ),
            main,
        )


@pytest.mark.slow
def test_bundles_the_cluster_cannot_place_are_a_clear_error(tiny, ray_head, monkeypatch):
    """A GPU per learner on a CPU-only cluster: the placement group never becomes ready, and the
    driver says why instead of waiting forever (PLACEMENT_TIMEOUT_S shortened from 300 s)."""
    from wings import cluster

    from train import main

    gcs, _, _ = ray_head
    monkeypatch.setattr(cluster, "PLACEMENT_TIMEOUT_S", 2)
    with pytest.raises(
        RuntimeError, match=r"could not place 2 learner bundles of \{'CPU': 1.0, 'GPU': 1.0\}"
    ):
        cluster.launch_on_ray(
            tiny(f"ray.address={gcs}", "ray.learner_workers=2", "ray.gpus_per_learner=1"), main
        )


def test_no_cluster_at_the_address_is_a_clear_error(tiny):
    from train import main
    from wings.cluster import launch_on_ray

    port = free_ports(1)[0]  # nothing listens there
    with pytest.raises(ConnectionError, match=f"no Ray cluster at '127.0.0.1:{port}'"):
        launch_on_ray(tiny(f"ray.address=127.0.0.1:{port}", "ray.learner_workers=2"), main)


def test_learner_workers_under_torchrun_is_refused(tiny, monkeypatch):
    from train import main
    from wings.cluster import launch_on_ray

    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="choose one launcher"):
        launch_on_ray(tiny("ray.learner_workers=2"), main)


@pytest.mark.slow
def test_resume_under_torchrun_is_exact(tiny, reference):
    """Resumed from checkpoints/step_2 under torchrun, steps 3-4 log what the uninterrupted run
    logged, and the final weights are bit-identical: the checkpoint holds everything a rank needs
    (weights, optimizer, RNG)."""
    cfg = tiny(*EXTRA, "run_name=launch_resumed")
    half = os.path.join(reference, "checkpoints", "step_2")
    torchrun(
        [
            "train.py",
            *cli_args(cfg),
            *EXTRA,
            "steps=4",
            "run_name=launch_resumed",
            f"resume={half}",
        ],
        timeout=300,
    )
    resumed_dir = os.path.join(cfg.out_dir, "launch_resumed")
    full, resumed = records(reference), records(resumed_dir)
    assert sorted(resumed) == [3, 4]  # no step-0 eval, no repeated steps
    for step in (3, 4):
        assert {k for k in full[step] if k.split("/")[0] in ("train", "rollout")} > {
            "train/pg_loss"
        }
        assert resumed[step] == full[step], step
    a = load_file(os.path.join(reference, "final", "model.safetensors"))
    b = load_file(os.path.join(resumed_dir, "final", "model.safetensors"))
    start = load_file(os.path.join(half, "model.safetensors"))
    assert any(not torch.equal(a[k], start[k]) for k in a)  # steps 3-4 did change the weights
    for k in a:
        assert torch.equal(a[k], b[k]), k
