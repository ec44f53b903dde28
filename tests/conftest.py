"""Shared test set-up: the repo root on sys.path, quiet offline side effects, two CPU threads at most."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.chdir(ROOT)
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

import torch  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))
