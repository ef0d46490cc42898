"""Benchmarks: ``python -m hvd_zoadam.bench {network,step,model,kernels,convergence,scaling,resume,
load,chaos}`` (:mod:`.cli`), each printing JSON, and the simulated hosts of :mod:`.netsim`.
Nothing in the library imports this package."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[2]  # the checkout, when the package runs from one


def provenance(argv: list[str] | None = None, root: str | Path | None = None,
               kernels: str | Path | None = None) -> dict:
    """Where a report's figures came from, for the JSON of every benchmark.

    ``commit``: the git commit of the hvd_zoadam checkout that ran, ``+changes`` appended when
    its tracked files differ from it, and ``+kernels from <folder>`` when the kernels
    (``hvd_zoadam.native``, by default the folder they were imported from; ``kernels``) are not
    that checkout's ``native/``: an editable install maps them to its own checkout, so a
    benchmark run from another one (a git worktree on ``PYTHONPATH``) times that checkout's
    kernels, as they are on disk then; None where the package is not a git checkout of its own
    (an installed wheel). ``command``: ``python -m hvd_zoadam.bench`` and ``argv`` (by default
    this process's arguments). ``cpu``: the processor's model name, family, model, stepping and
    cache size (None where /proc/cpuinfo has no model name); ``cores``; the ``torch`` and
    Python versions. Ratios between two reports compare only on one machine: ``cpu`` says
    whether they came from one. ``root``: the checkout to read (default: :data:`ROOT`)."""
    root = ROOT if root is None else Path(root).resolve()

    def git(*args: str):
        try:
            out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None
    commit = None
    top = git("rev-parse", "--show-toplevel")
    if top and Path(top).resolve() == root:
        commit = git("rev-parse", "HEAD")
        if commit and git("status", "--porcelain", "--untracked-files=no"):
            commit += "+changes"
        if kernels is None:
            from hvd_zoadam import native
            kernels = Path(native.__file__).parent
        if commit and Path(kernels).resolve() != root / "native":
            commit += f"+kernels from {Path(kernels).resolve()}"
    cpu = None
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
        info = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first)}
        if info.get("model name"):  # a virtual machine's name can be generic: its family and cache tell more
            cpu = (f"{info['model name']} (family {info.get('cpu family')}, model {info.get('model')}, "
                   f"stepping {info.get('stepping')}, cache {info.get('cache size')})")
    except OSError:
        pass
    argv = sys.argv[1:] if argv is None else list(argv)
    return {"commit": commit, "command": " ".join(["python -m hvd_zoadam.bench", *argv]), "cpu": cpu,
            "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()}


def group_loss(model: torch.nn.Module, batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
               loss_fn: Callable[..., torch.Tensor], data_ranks: int, world_size: int, rank: int):
    """Rank ``rank``'s loss on the same global batch at any world size, for benchmarks that
    resume at another one: of the ``data_ranks`` batches of a step (``batch(i)`` gives batch i
    as ``(x, y)``), its contiguous group's (:func:`hvd_zoadam.checkpoint.old_ranks`), weighted
    by the group's share |G|·P'/P, so that the ranks' average gradient is the global batch's.
    Its own batch alone when ``world_size == data_ranks``; a zero loss (zero gradient) for an
    empty group (more ranks than batches). ``loss_fn(model(x), y)`` is the mean loss."""
    from hvd_zoadam.checkpoint import old_ranks
    if world_size == data_ranks:
        x, y = batch(rank)
        return loss_fn(model(x), y)
    group = old_ranks(data_ranks, world_size, rank)
    if not group:
        return 0.0 * sum(p.sum() for p in model.parameters())
    x, y = (torch.cat(t) for t in zip(*(batch(i) for i in group)))
    return len(group) * world_size / data_ranks * loss_fn(model(x), y)
