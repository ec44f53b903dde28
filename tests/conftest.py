"""Shared test set-up: the repo root on sys.path, quiet offline side effects, two CPU threads at
most, and `need`, the one way a test asks for an optional dependency."""

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
