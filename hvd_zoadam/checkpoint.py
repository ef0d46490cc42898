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

When the saving ranks' own files are also there (all P of them, from the same save), a
resume from ``{prefix}.pt`` at P' ranks splits by groups what the means pool: new rank r'
takes the worker errors, and the spread of the parameters and the momentum about their means,
of its contiguous group of saving ranks, times P'/P (:func:`load`), which keeps the totals
and the means exactly, and at P' = P is each rank's own state. A rank reads only its
group's files; when any of them is missing or does not fit, every rank takes the means.

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
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hvd_zoadam.shell.optimizer import DistributedAdamOptimizer


class CheckpointError(ValueError):
    """A checkpoint file is unreadable, truncated, or was written for another model/optimizer."""


def atomic_save(obj: object, path: str) -> None:
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


def save(prefix: str, model: torch.nn.Module, optimizer: DistributedAdamOptimizer, **extra: object) -> None:
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


def load(prefix: str, model: torch.nn.Module, optimizer: DistributedAdamOptimizer, *, exact: bool = True,
         per_group: bool = True) -> dict:
    """Restore from :func:`save`'s files; returns the ``extra`` dict.

    When every rank has its own file from the same world size, each reads it (exact
    resume); otherwise every rank reads ``{prefix}.pt``, with the pooled error feedback (a
    save that a dead rank never finished thus still loads, consistently on all ranks).

    From ``{prefix}.pt``, the worker errors are split by groups of saving ranks when every
    saving rank's own file is there: with P saving ranks and P' ranks now, rank r' takes
    ``(P'/P)·Σ_{i∈G_r'} e_i`` over the worker errors e_i of its group G_r' of saving ranks
    (contiguous groups, as ``torch.tensor_split(torch.arange(P), P')``; see
    :func:`group_worker_error`), read from ``{prefix}.rank{i}.pt``. What
    the job owes is kept exactly as with the mean ē on every rank, and so is, group by group,
    which ranks owed it. Each rank reads only its group's files. When any rank's group cannot
    be read (a file missing, unreadable, from another world size or another step), or with the
    two-level exchange on either side (its worker errors are one per node), every rank takes
    the mean ē instead: the ranks agree on it in a second small allgather, so they never mix
    the two.

    Args:
        exact: False reads ``{prefix}.pt`` even when every rank has its own file (what
            ``bench resume`` compares with the exact resume).
        per_group: False gives every rank the mean worker error ē, without reading the
            saving ranks' files.

    **Collective**: call it on every rank, with the same arguments (one small allgather
    decides which files to read, and another agrees on the worker errors when it is
    ``{prefix}.pt``).

    Raises:
        CheckpointError: a file is unreadable or was written for another model or optimizer
            (the message names the file and the mismatch). An unreadable ``{prefix}.rank{r}.pt``
            with r below this world size (its world size cannot be told, so it is taken for
            rank r's own file), or a ``{prefix}.pt`` that a rank cannot read, raises on every
            rank, naming the rank. An unreadable file of a saving rank that no rank reads as
            its own only makes every rank take the means.
    """
    tag = f"zoadam.checkpoint.{os.path.basename(prefix)}"
    own = rank_path(prefix, optimizer.transport.rank)
    ckpt, path, problem = None, own, None
    if exact and os.path.exists(own):
        try:
            ckpt = read(own)
        except CheckpointError as exc:
            problem = str(exc)
        if ckpt is not None and ckpt.get("rank_state", {}).get("world_size") != optimizer.world_size:
            ckpt = None
    found = optimizer.transport.allgather_object((ckpt is not None, problem), tag)
    problems = [f"rank {r}: {msg}" for r, (_, msg) in enumerate(found) if msg]
    if problems:  # every rank raises, not only the one whose file is bad
        raise CheckpointError("; ".join(problems))
    worker = None
    if not all(ok for ok, _ in found):
        path = f"{prefix}.pt"
        params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        ckpt, worker = _read_common(prefix, optimizer, per_group, tag, params)
    try:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        if "rank_state" in ckpt:
            optimizer.load_rank_state_dict(ckpt["rank_state"])
        else:
            optimizer.load_error_feedback(ckpt.get("error_feedback"), worker)
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint file {path!r} does not fit this model and optimizer: {exc}") from exc
    return ckpt["extra"]


def old_ranks(old_world: int, new_world: int, rank: int) -> range:
    """The saving ranks whose worker errors rank ``rank`` of a job of ``new_world`` ranks takes
    over (:func:`group_worker_error`): group ``rank`` of
    ``range(old_world)`` cut into ``new_world`` contiguous groups, the first
    ``old_world % new_world`` one longer, as ``torch.tensor_split(torch.arange(old_world),
    new_world)[rank]`` (empty for ``rank >= old_world``), as a ``range``."""
    size, longer = divmod(old_world, new_world)
    start = rank * size + min(rank, longer)
    return range(start, start + size + (rank < longer))


def _read_common(prefix: str, optimizer, per_group: bool, tag: str, params: set) -> tuple[dict, dict | None]:
    """``{prefix}.pt``, with x and m split by groups in place when every rank can split them,
    and this rank's worker error split by groups (None: the mean). The ranks agree on both in
    one allgather. Raises CheckpointError on every rank when some rank cannot read
    ``{prefix}.pt``."""
    path, ckpt, problem, split, why_not = f"{prefix}.pt", None, None, None, "not asked"
    try:
        ckpt = read(path)
    except CheckpointError as exc:
        problem = str(exc)
    if ckpt is not None and per_group:
        split, why_not = _split_by_groups(prefix, ckpt, optimizer, params)
    agreed = optimizer.transport.allgather_object((problem, why_not is None), tag + ".common")
    if problem is not None:
        raise CheckpointError(problem)
    others = [f"rank {r}: {msg}" for r, (msg, _) in enumerate(agreed) if msg]
    if others:
        raise CheckpointError("; ".join(others))
    if not all(ok for _, ok in agreed):
        return ckpt, None
    ckpt["model"].update(split["model"])
    for pid, m in split["exp_avg"].items():
        ckpt["optimizer"]["state"][pid]["exp_avg"] = m
    return ckpt, split["worker_error"]


def _split_by_groups(prefix: str, common: dict, optimizer, params: set) -> tuple[dict | None, str | None]:
    """From this rank's group G of the saving ranks' own files (:func:`old_ranks`), with P
    saving ranks and P' now: ``({"worker_error": {pid: e'}, "model": {key: x'}, "exp_avg":
    {pid: m'}}, None)``, or ``(None, why not)``.

    e' is :func:`group_worker_error`'s. When P' < P, x' and m' are the common file's x̄ and m̄
    (the means over the saving ranks inside a window of local steps) moved by the group's part
    of the ranks' spread, x' = x̄ + (P'/P)·Σ_{i∈G}(x_i − x̄), in float64, for the model's
    parameters (``params``: their state-dict keys; buffers such as BatchNorm's running
    statistics keep the common file's) and every ``exp_avg``: the mean over the new ranks stays
    x̄ (the next sync owes what it did), and outside a window, where every rank holds x̄, nothing
    moves. At P' = P each rank takes its own x_i and m_i as saved. At P' > P x̄ and m̄ stay (the
    split would scale single ranks' deviations by P'/P). Memory: the parameters and the
    momentum once more in float64, and one saving rank's file at a time.
    """
    state = common.get("error_feedback")
    if not isinstance(state, dict) or not isinstance(state.get("world_size"), int) or state["world_size"] < 1:
        return None, f"{prefix}.pt holds no pooled error feedback"
    try:
        return _split(prefix, common, state, optimizer, params)
    except (KeyError, TypeError, AttributeError, ValueError, RuntimeError, IndexError) as exc:
        # a damaged file that still unpickles: the means, and the load says what does not fit
        return None, f"{prefix}.pt or a saving rank's file does not hold what the split needs: {exc!r}"


def _split(prefix: str, common: dict, state: dict, optimizer, params: set) -> tuple[dict | None, str | None]:
    old, new = state["world_size"], optimizer.world_size
    groups = common["optimizer"]["param_groups"]
    counters = groups[0].get("zoadam") if groups else None
    x_mean = {k: v for k, v in common["model"].items() if k in params and v.is_floating_point()} if new <= old else {}
    m_mean = {pid: st["exp_avg"] for pid, st in common["optimizer"]["state"].items() if "exp_avg" in st} \
        if new <= old else {}
    x_spread = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in x_mean.items()}
    m_spread = {pid: torch.zeros(v.shape, dtype=torch.float64) for pid, v in m_mean.items()}
    members = []
    for i in old_ranks(old, new, optimizer.transport.rank):
        path = rank_path(prefix, i)
        try:
            ckpt = read(path)
        except CheckpointError as exc:
            return None, str(exc)
        rank_state = ckpt.get("rank_state")
        if not isinstance(rank_state, dict) or rank_state.get("world_size") != old or rank_state.get("rank") != i:
            return None, f"{path!r} is not the file of rank {i} of {old}"
        saved_groups = ckpt["optimizer"].get("param_groups") if isinstance(ckpt["optimizer"], dict) else None
        if not saved_groups or saved_groups[0].get("zoadam") != counters:
            return None, f"{path!r} was saved at another step than {prefix}.pt"
        members.append(rank_state)
        try:
            for k, v in x_mean.items():
                x_spread[k] += ckpt["model"][k].double() - v.double()
            for pid, v in m_mean.items():
                m_spread[pid] += ckpt["optimizer"]["state"][pid]["exp_avg"].double() - v.double()
        except (KeyError, RuntimeError, AttributeError) as exc:
            return None, f"{path!r} does not hold what {prefix}.pt holds: {type(exc).__name__}: {exc}"
        own = ckpt
    try:
        worker = group_worker_error(optimizer, state, members)
    except (ValueError, KeyError, TypeError) as exc:
        return None, f"the worker errors cannot be split by groups: {exc}"
    if new == old:  # each rank's own x and m, not x̄ plus its spread rounded back
        return {"worker_error": worker, "model": {k: own["model"][k] for k in x_mean},
                "exp_avg": {pid: own["optimizer"]["state"][pid]["exp_avg"] for pid in m_mean}}, None
    return {"worker_error": worker,
            "model": {k: (v.double() + x_spread[k] * new / old).to(v.dtype) for k, v in x_mean.items()},
            "exp_avg": {pid: (v.double() + m_spread[pid] * new / old).to(v.dtype) for pid, v in m_mean.items()}}, None


def group_worker_error(optimizer: DistributedAdamOptimizer, state: dict, members: list) -> dict:
    """``optimizer``'s rank's worker error from the saving ranks' own states: of P saving ranks split
    into P' contiguous groups (:func:`old_ranks`, empty at P' > P),
    rank r' takes ``(P'/P)·Σ_{i∈G_r'} e_i`` (float64 sum in rank order, then float32). The
    owed total Σ e'/P' stays Σ e_i/P, as with the mean ē; at P' = P each rank takes its own.

    ``state``: the saving job's :meth:`ZeroOneAdamOptimizer.error_feedback_state`; ``members``: the
    :meth:`ZeroOneAdamOptimizer.rank_state_dict` of each saving rank of G_r', in rank order. Returns ``{pid:
    float32[numel]}`` on the CPU for :meth:`ZeroOneAdamOptimizer.load_error_feedback`. Collectives: none.

    Raises:
        ValueError (the caller then takes the mean): members of another world size or
            group, or not holding exactly ``state``'s parameters; the two-level exchange on
            either side (one worker error per node, in shards).
    """
    old, new = state["world_size"], optimizer.world_size
    if optimizer._engine.topology() is not None:
        raise ValueError("this optimizer uses the two-level exchange (one worker error per node)")
    expected = old_ranks(old, new, optimizer.transport.rank)
    if len(members) != len(expected) or [m.get("rank") for m in members] != list(expected):
        raise ValueError(f"the group of rank {optimizer.transport.rank} is the saving ranks {expected}, "
                         f"got the states of {[m.get('rank') for m in members]}")
    totals = _sum_worker_errors(state, members)
    return {pid: (total * new / old).float() for pid, total in totals.items()}


def _sum_worker_errors(state: dict, members: list) -> dict:
    """``{pid: float64[numel]}``: the sum, in rank order, of the saving ranks' worker errors in
    ``members`` (their :meth:`ZeroOneAdamOptimizer.rank_state_dict`), per parameter of ``state``
    (:meth:`ZeroOneAdamOptimizer.error_feedback_state`). Raises ValueError when a member is from
    another world size, from the two-level exchange, or does not hold exactly ``state``'s
    parameters."""
    old = state["world_size"]
    totals = {pid: torch.zeros(saved.numel(), dtype=torch.float64) for pid, saved in state["worker_error"].items()}
    for m in members:
        if m.get("world_size") != old:
            raise ValueError(f"the state of saving rank {m['rank']} is from world size {m.get('world_size')}, "
                             f"the pooled state from {old}")
        if m.get("hierarchical") is not None:
            raise ValueError("the saving job used the two-level exchange (one worker error per node)")
        covered = set()
        for bucket in m["buckets"]:
            if "params" not in bucket:
                raise ValueError(f"the state of saving rank {m['rank']} does not list its buckets' parameters")
            worker, at = bucket["worker_error"], 0
            for pid, name, numel in bucket["params"]:
                if pid not in totals or state["names"].get(pid) != name or totals[pid].numel() != numel:
                    raise ValueError(f"saving rank {m['rank']} holds parameter {name!r} of {numel} elements at "
                                     f"position {pid}, which the pooled state does not")
                if at + numel > worker.numel():
                    raise ValueError(f"the worker error of saving rank {m['rank']} is shorter than its parameters")
                totals[pid] += worker[at:at + numel].to(torch.float64)
                covered.add(pid)
                at += numel
        if covered != set(totals):
            raise ValueError(f"the state of saving rank {m['rank']} does not cover the parameters of the pooled state")
    return totals
