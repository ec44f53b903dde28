"""Shared test set-up: the repo root on sys.path, quiet offline side effects, two CPU threads at
most, and `need`, the one way a test asks for an optional dependency."""

import contextlib
import importlib
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.chdir(ROOT)
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

import torch  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))

IN_CI = bool(os.environ.get("CI"))  # .ci/run sets CI=true: there every test dependency is installed


def need(module: str, why: str):
    """Import an optional test dependency. Outside CI a missing one skips the test, saying `why` and
    how to get it (`bash setup.sh test` installs them all); in CI it is an error, so nothing is ever
    skipped there."""
    if IN_CI:
        return importlib.import_module(module)
    return pytest.importorskip(
        module, reason=f"{module} is not installed ({why}); bash setup.sh test installs it"
    )


def process_state() -> dict:
    """What one test can change for every later test in this process: torch's thread count (and
    whether torch.set_num_threads is still torch's own: vLLM's CPU worker replaces it), default
    dtype, grad mode, matmul precision, deterministic mode, oneDNN, the environment variables that
    torch, OpenMP, vLLM and Ray read when an engine is built, a torch.distributed process group and
    a Ray cluster."""
    prefixes = ("VLLM_", "OMP_", "MKL_", "TORCH", "RAY_", "CUDA_", "NANO_SKYRL")
    # set once, in whichever test first gets there: by `import ray` itself, by `import vllm`
    # (Inductor's compile threads), and by Inductor the first time it looks for its cache
    imported = ("RAY_CLIENT_MODE", "TORCHINDUCTOR_COMPILE_THREADS", "TORCHINDUCTOR_CACHE_DIR")
    return {
        "threads": torch.get_num_threads(),
        "set_num_threads": torch.set_num_threads,
        "default_dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "mkldnn": torch.backends.mkldnn.enabled,
        "env": {
            k: v for k, v in os.environ.items() if k.startswith(prefixes) and k not in imported
        },
        # a process group left behind is the next one's (vLLM builds one in-process)
        "process_group": torch.distributed.is_available() and torch.distributed.is_initialized(),
        "ray": "ray" in sys.modules and sys.modules["ray"].is_initialized(),
    }


@contextlib.contextmanager
def environ_restored():
    """os.environ as it was before the block, after it: for a block that starts a Ray cluster
    (ray.init sets RAY_USAGE_STATS_ENABLED, and a test sets RAY_AUTH_MODE) or anything else that
    sets variables for its own lifetime."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
def own_environ():
    """The test's changes to os.environ undone after it (environ_restored)."""
    with environ_restored():
        yield


@pytest.fixture
def own_threads():
    """torch's thread count put back after the test: for a test that runs train.main in-process
    with another `threads` (main sets a process-wide count, as a program should)."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def state_changes(before: dict, after: dict) -> dict:
    """The entries of process_state that differ, each as (before, after); for the environment,
    the variables that differ."""
    changed = {k: (before[k], after[k]) for k in before if k != "env" and before[k] != after[k]}
    env = {
        k: (before["env"].get(k), after["env"].get(k))
        for k in set(before["env"]) | set(after["env"])
        if before["env"].get(k) != after["env"].get(k)
    }
    return {**changed, "env": env} if env else changed


@pytest.fixture(autouse=True, scope="module")
def a_module_leaves_the_process_as_it_found_it(request):
    """As below, for a test file with its fixtures (a module's engine, built once)."""
    before = process_state()
    yield
    changed = state_changes(before, process_state())
    assert not changed, f"{request.node.nodeid} (its fixtures) changed the process state: {changed}"


@pytest.fixture(autouse=True)
def leaves_the_process_as_it_found_it(request):
    """Every test leaves the process state it found (process_state): a test that changes it fails
    here, naming what it changed, so no test's result depends on which tests ran before it (issue
    44: `-k "vllm or fsdp or lora or invariance or ray"` failed in tests/test_vllm_engine.py after
    earlier tests, while that file alone passed)."""
    before = process_state()
    yield
    changed = state_changes(before, process_state())
    assert not changed, f"{request.node.nodeid} changed the process state: {changed}"
