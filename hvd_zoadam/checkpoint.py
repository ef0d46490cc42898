"""Checkpoints that resume 0/1 Adam exactly (algorithm.md §6).

Two kinds of files, both written atomically (a temporary file in the same folder, then
``os.replace``), so a killed save never leaves a truncated checkpoint behind:

* ``{prefix}.pt``, written by rank 0: the model's and the optimizer's ``state_dict()``
  and the caller's extras. Any world size can resume from it.
* ``{prefix}.rank{r}.pt``, written by every rank: this rank's model and optimizer state
  (inside a local-step window they differ per rank) and its error buffers
  (:meth:`ZeroOneAdamOptimizer.rank_state_dict`). A resume with the same world size
  reads these and is bitwise identical to an uninterrupted run.

A resume with another world size reads ``{prefix}.pt`` on every rank (put it on a shared
file system), re-creates the error buffers at zero (their sizes depend on the world size),
and continues the open window from the loaded parameters and anchor. The step counters
and schedules are restored exactly either way.
"""
from __future__ import annotations

import os
import tempfile

import torch


def atomic_save(obj, path: str) -> None:
    """``torch.save(obj, path)`` through a temporary file and a rename."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def rank_path(prefix: str, rank: int) -> str:
    return f"{prefix}.rank{rank}.pt"


def save(prefix: str, model: torch.nn.Module, optimizer, **extra) -> None:
    """Write ``{prefix}.pt`` (rank 0) and ``{prefix}.rank{r}.pt`` (every rank).

    ``extra`` (e.g. ``scheduler=sched.state_dict(), epoch=3``) goes into both files.
    Call it on every rank of the optimizer's process set at the same step.
    """
    rank = optimizer.transport.rank
    common = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "extra": extra}
    if rank == 0:
        atomic_save(common, f"{prefix}.pt")
    atomic_save({**common, "rank_state": optimizer.rank_state_dict()}, rank_path(prefix, rank))


def load(prefix: str, model: torch.nn.Module, optimizer) -> dict:
    """Restore from :func:`save`'s files; returns the ``extra`` dict.

    Uses this rank's own file when it exists and was written with the same world size
    (exact resume); otherwise ``{prefix}.pt`` with fresh error buffers.
    """
    own = rank_path(prefix, optimizer.transport.rank)
    ckpt = None
    if os.path.exists(own):
        ckpt = torch.load(own, map_location="cpu", weights_only=False)
        if ckpt["rank_state"]["world_size"] != optimizer.world_size:
            ckpt = None
    if ckpt is None:
        ckpt = torch.load(f"{prefix}.pt", map_location="cpu", weights_only=False)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    optimizer.load_rank_state_dict(ckpt.get("rank_state"))
    return ckpt["extra"]
