"""Builders for the scale checks, shared by tests/test_torture_scale.py and bench/torture_scale.py."""

from __future__ import annotations

import json
import os
import shutil

import torch

import ckpt
from ckpt.format.manifest import seal
from ckpt.restoring.discovery import step_dir


def many_checkpoints(root: str, count: int) -> None:
    """``count`` committed checkpoints under ``root``: one real save, copied with each manifest's step rewritten
    (a real save per step would take minutes and measure the saver, not discovery)."""
    first = os.path.join(root, step_dir(1))
    ckpt.save(first, step=1, model={"w": torch.arange(16, dtype=torch.float32)}, rng=False)
    with open(os.path.join(first, "manifest.json")) as f:
        doc = json.load(f)
    for step in range(2, count + 1):
        dst = os.path.join(root, step_dir(step))
        shutil.copytree(first, dst)
        doc["step"] = step
        doc["progress"] = {"step": step}
        with open(os.path.join(dst, "manifest.json"), "w") as f:
            f.write(seal(doc))  # an edited manifest must be re-sealed, or it is refused as damaged


def many_tensors(count: int) -> dict[str, torch.Tensor]:
    """``count`` small tensors of a few shapes and dtypes (names like a deep model's)."""
    dtypes = (torch.float32, torch.bfloat16, torch.int64, torch.float16)
    return {
        f"layers.{i // 10}.block.{i % 10}.weight": torch.full((i % 7 + 1,), i % 251).to(dtypes[i % 4])
        for i in range(count)
    }
