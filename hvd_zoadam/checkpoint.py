"""Checkpoints that resume 0/1 Adam exactly (algorithm.md §6).

Two kinds of files, both written atomically (a temporary file in the same folder, then
``os.replace``), so a killed save never leaves a truncated checkpoint behind:

* ``{prefix}.pt``, written by rank 0: the model's and the optimizer's ``state_dict()``
  and the caller's extras. Any world size can resume from it.
* ``{prefix}.rank{r}.pt``, written by every rank: this rank's model and optimizer state
  (inside a local-step window they differ per rank) and its error buffers
  (:meth:`ZeroOneAdamOptimizer.rank_state_dict`). A resume with the same world size, when
  every rank finds its file, reads these and is bitwise identical to an uninterrupted run.

``{prefix}.pt`` also holds the error feedback pooled over ranks
(:meth:`ZeroOneAdamOptimizer.error_feedback_state`): the mean of the worker errors and
the server errors of all ranks in each parameter's own layout. A resume with another world
size, or without the per-rank files, reads ``{prefix}.pt`` on every rank (put it on a
shared file system): every rank takes the mean worker error and its own chunk of the
server errors, so what the job still owes in error feedback is kept exactly; only how it
was split among the ranks is lost. Saved inside a window of local steps, ``{prefix}.pt``
holds the means over the ranks of the parameters and the momentum
(:meth:`ZeroOneAdamOptimizer.window_mean_state_dicts`) with the window's anchor and sums, so
the next sync owes what every rank did since the anchor, not rank 0's progress alone. The
step counters and schedules are restored exactly either way.

A file that cannot be read, or that was written for another model or optimizer, raises
:class:`CheckpointError` naming the file and what does not match; nothing is loaded
silently.

A checkpoint file is data. :func:`read` loads it with ``torch.load(weights_only=True)``:
tensors, numbers, strings, ``None``, lists, tuples and dicts (what ``state_dict()`` of a
model, an optimizer or an LR scheduler holds). A file whose pickle names anything else (a
class, a function, ``os.system`` in a crafted ``__reduce__``) is refused with
:class:`CheckpointError` naming the file and the type, and nothing in it runs.
"""
from __future__ import annotations

import os
import pickle
import re
import tempfile

import torch


class CheckpointError(ValueError):
    """A checkpoint file is unreadable, truncated, or was written for another model/optimizer."""


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


def _unsupported_global(exc: pickle.UnpicklingError) -> str | None:
    """The type that torch's weights-only unpickler refused (``module.name``), from its
    message; None when the file failed for another reason (not a pickle at all)."""
    found = re.search(r"GLOBAL ([\w.]+)", str(exc))
    return found.group(1) if found else None


def rank_path(prefix: str, rank: int) -> str:
    return f"{prefix}.rank{rank}.pt"


def save(prefix: str, model: torch.nn.Module, optimizer, **extra) -> None:
    """Write ``{prefix}.pt`` (rank 0) and ``{prefix}.rank{r}.pt`` (every rank).

    ``extra`` (e.g. ``scheduler=sched.state_dict(), epoch=3``) goes into both files.
    **Collective**: call it on every rank of the optimizer's process set at the same step
    (it pools the error feedback, see :meth:`ZeroOneAdamOptimizer.error_feedback_state`).
    """
    rank = optimizer.transport.rank
    own = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "extra": extra}
    pooled = optimizer.error_feedback_state()
    mean = optimizer.window_mean_state_dicts(model)
    if rank == 0:
        common = own if mean is None else {"model": mean[0], "optimizer": mean[1], "extra": extra}
        atomic_save({**common, "error_feedback": pooled}, f"{prefix}.pt")
    atomic_save({**own, "rank_state": optimizer.rank_state_dict()}, rank_path(prefix, rank))


def read(path: str) -> dict:
    """A data load (``torch.load(weights_only=True)``) of one of :func:`save`'s files onto the CPU.

    Raises:
        CheckpointError: naming the file, when it is missing, truncated, corrupted, not a
            checkpoint, or when its pickle needs a type that is not data (the message names
            the type; nothing from the file is executed).
    """
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path!r} does not exist") from None
    except pickle.UnpicklingError as exc:
        refused = _unsupported_global(exc)
        if refused is None:
            raise CheckpointError(f"checkpoint file {path!r} cannot be read (truncated or corrupted?): "
                                  f"UnpicklingError: {str(exc).strip().splitlines()[-1]}") from None
        raise CheckpointError(f"checkpoint file {path!r} is refused: it needs a type that is not data "
                              f"({refused}); a checkpoint holds only tensors, numbers, strings, lists and "
                              "dicts, and nothing in this file was run") from None
    except Exception as exc:  # noqa: BLE001 - torch raises several kinds for a bad file
        raise CheckpointError(f"checkpoint file {path!r} cannot be read (truncated or corrupted?): "
                              f"{type(exc).__name__}: {exc}") from None
    if not isinstance(ckpt, dict) or not {"model", "optimizer", "extra"} <= set(ckpt):
        raise CheckpointError(f"{path!r} is not an hvd_zoadam checkpoint (no model/optimizer/extra entries)")
    return ckpt


def load(prefix: str, model: torch.nn.Module, optimizer) -> dict:
    """Restore from :func:`save`'s files; returns the ``extra`` dict.

    When every rank has its own file from the same world size, each reads it (exact
    resume); otherwise every rank reads ``{prefix}.pt``, with the pooled error feedback (a
    save that a dead rank never finished thus still loads, consistently on all ranks).
    **Collective**: call it on every rank (one small allgather decides which files to read).

    Raises:
        CheckpointError: a file is unreadable or was written for another model or optimizer
            (the message names the file and the mismatch). A bad per-rank file raises on
            every rank, naming the rank.
    """
    own = rank_path(prefix, optimizer.transport.rank)
    ckpt, path, problem = None, own, None
    if os.path.exists(own):
        try:
            ckpt = read(own)
        except CheckpointError as exc:
            problem = str(exc)
        if ckpt is not None and ckpt.get("rank_state", {}).get("world_size") != optimizer.world_size:
            ckpt = None
    found = optimizer.transport.allgather_object((ckpt is not None, problem),
                                                 f"zoadam.checkpoint.{os.path.basename(prefix)}")
    problems = [f"rank {r}: {msg}" for r, (_, msg) in enumerate(found) if msg]
    if problems:  # every rank raises, not only the one whose file is bad
        raise CheckpointError("; ".join(problems))
    if not all(ok for ok, _ in found):
        path, ckpt = f"{prefix}.pt", read(f"{prefix}.pt")
    try:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        if "rank_state" in ckpt:
            optimizer.load_rank_state_dict(ckpt["rank_state"])
        else:
            optimizer.load_error_feedback(ckpt.get("error_feedback"))
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint file {path!r} does not fit this model and optimizer: {exc}") from exc
    return ckpt["extra"]
