"""Where a step's time goes: exclusive timers that a benchmark wraps around one rank's optimizer.

Nothing in hvd_zoadam carries a timer: :meth:`Breakdown.install` wraps, from the outside and
for this process only, the Numba kernels (``hvd_zoadam.native``'s public functions), the
1-bit protocol's phases (:class:`~hvd_zoadam.comm.protocol.Exchange` ``start``, ``serve``,
``gather_status``, ``wait_gathered``, ``result_of``, ``commit``, ``rollback``), the start of
one bucket's exchange ahead of ``step()`` (:meth:`~hvd_zoadam.shell.driver.StepDriver._launch`)
and the transport's ``start``/``wait``. Without ``install`` nothing is wrapped: a run that does
not ask for a breakdown pays only the four clock reads per step of the benchmark's own regions.

Time is exclusive: a second belongs to the innermost wrapped call running then, so a kernel
inside ``Exchange.start`` counts as ``kernels``, not ``packing``. The labels:

* ``forward_backward``: the benchmark's data, forward and backward (less what the gradient
  hooks start inside it, which has its own labels);
* ``early_start``: the optimizer's work in starting a bucket's exchange ahead of ``step()``,
  from the gradient hooks during backward (or from ``synchronize()`` for the buckets the hooks
  did not start), outside the labels below: a SYNC step's local update on copies and its
  window's update, a COMPRESSED step's preconditioning, in torch ops. Only the calls on the
  thread of :meth:`Breakdown.begin_step` are timed: where autograd runs the hooks on threads
  of its own (CUDA), this time stays in ``forward_backward``;
* ``optimizer``: ``step()``'s Python and torch work outside the labels below (the step math
  in torch ops, gathering and scattering parameters, the driver);
* ``kernels``: inside a Numba kernel (``hvd_zoadam.native``'s public functions), also by
  function in ``kernels_by_name`` (exclusive too: a kernel function calling another counts
  only its own time);
* ``packing``: the protocol's own work around the kernels (message layout, copies, checks);
* ``wire``: inside the transport's ``start``/``wait``, less ``waiting_for_slowest``;
* ``waiting_for_slowest``: the part of a wait before the last rank had started the same
  collective (:func:`split_waits`, from every rank's records);
* ``other``: the rest of the step's wall time (zero_grad, the LR scheduler, the loss read).

:func:`split_waits` pairs the ranks' collectives by their order (every rank starts the same
collectives in the same order, as MPI requires) and reads their times on one clock:
``time.perf_counter`` is CLOCK_MONOTONIC, which every process of one machine shares, as the
simulated hosts of ``bench network`` do. Across real hosts the clocks differ and the split
does not hold.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from hvd_zoadam.comm.transport import Transport

LABELS = ("forward_backward", "early_start", "optimizer", "kernels", "packing", "wire", "waiting_for_slowest", "other")
_EXCHANGE_PHASES = ("start", "serve", "gather_status", "wait_gathered", "result_of", "commit", "rollback")


class Breakdown:
    """Exclusive seconds per label for each step of one rank, and its collectives' times.

    ``steps``: one dict per finished step: ``step``, ``kind``, ``wall`` (seconds from
    :meth:`begin_step` to :meth:`end_step`), the seconds of each label of :data:`LABELS`
    but ``waiting_for_slowest`` (filled in later by :func:`split_waits`) and
    ``kernels_by_name`` (``kernels`` by function).
    ``collectives``: ``[step, op, name, t_start, spans]`` per collective in start order (op
    ``"flag"`` for the transport's ``allgather_flag``, however it is carried), with
    ``spans`` the ``[begin, end]`` of its ``start`` and ``wait`` calls (perf_counter seconds).
    """

    def __init__(self):
        self.steps: list[dict] = []
        self.collectives: list[list] = []
        self._handles: dict[int, list] = {}
        self._stack: list[str] = []
        self._totals: dict[str, float] = {}
        self._kernels: dict[str, float] = {}  # this step's kernels seconds, by function name
        self._last = 0.0
        self._step = 0
        self._begin = 0.0
        self._undo: list = []
        self._thread = threading.get_ident()  # the thread whose steps are timed (begin_step's)
        self._recording = True  # False inside collective(): its calls are in its record

    # -- exclusive timing ---------------------------------------------------------------------
    def _charge(self, now: float) -> None:
        """Give the time since the last clock read to the innermost label (and kernel)."""
        label, kernel = self._stack[-1]
        self._totals[label] = self._totals.get(label, 0.0) + now - self._last
        if kernel is not None:
            self._kernels[kernel] = self._kernels.get(kernel, 0.0) + now - self._last

    def _enter(self, label: str, kernel: str | None = None) -> None:
        now = time.perf_counter()
        if self._stack:
            self._charge(now)
        self._stack.append((label, kernel))
        self._last = now

    def _exit(self) -> None:
        now = time.perf_counter()
        self._charge(now)
        self._stack.pop()
        self._last = now

    @contextlib.contextmanager
    def region(self, label: str):
        """A context manager timing its body as ``label`` (the benchmark's own regions)."""
        self._enter(label)
        try:
            yield
        finally:
            self._exit()

    @contextlib.contextmanager
    def collective(self, op: str, name: str):
        """A context manager timing its body as one blocking collective ``op`` named ``name``:
        ``wire``, and a record that :func:`split_waits` pairs across the ranks (so the wait for
        the last rank becomes ``waiting_for_slowest``). Collectives started inside it through
        an installed transport are not recorded again, nor is one nested in another
        collective's record. Every rank must enter the same ones in the same order."""
        self._enter("wire")
        record = [self._step, op, name, self._last, []]
        recording, self._recording = self._recording, False
        if recording:
            self.collectives.append(record)
        try:
            yield
        finally:
            self._recording = recording
            self._exit()
            record[4].append([record[3], self._last])

    def _timed(self, fn, label: str, kernel: str | None = None):
        @functools.wraps(fn)
        def wrapper(*args: object, **kwargs: object):
            if threading.get_ident() != self._thread:  # another thread-rank's call
                return fn(*args, **kwargs)
            self._enter(label, kernel)
            try:
                return fn(*args, **kwargs)
            finally:
                self._exit()
        return wrapper

    def _patch(self, owner, attr: str, new) -> None:
        had = attr in vars(owner)
        self._undo.append((owner, attr, vars(owner)[attr] if had else None, had))
        setattr(owner, attr, new)

    # -- installation -------------------------------------------------------------------------
    def install(self, transport: Transport | None = None) -> "Breakdown":
        """Wrap the kernels, the protocol phases and ``transport``'s collectives (an hvd_zoadam
        optimizer's ``transport``; None: only the benchmark's own regions are timed).
        :meth:`uninstall` puts everything back (uninstall several in the reverse order). Only the
        calls of the thread that runs :meth:`begin_step` are timed, so that in-process thread
        ranks can each have their own."""
        from hvd_zoadam import native
        from hvd_zoadam.comm.protocol import Exchange
        from hvd_zoadam.shell.driver import StepDriver
        for name in native.__all__:
            fn = getattr(native, name)
            if callable(fn) and not isinstance(fn, type) and name not in ("warm_up", "configure_threads",
                                                                          "use_cuda_kernels_on_cpu"):
                self._patch(native, name, self._timed(fn, "kernels", name))
        for name in _EXCHANGE_PHASES:
            self._patch(Exchange, name, self._timed(getattr(Exchange, name), "packing"))
        self._patch(StepDriver, "_launch", self._timed(StepDriver._launch, "early_start"))
        if transport is None:
            return self
        start, wait = transport.start, transport.wait

        def timed_start(op: str, tensor: torch.Tensor, name: str, count: bool = True):
            self._enter("wire")
            record = [self._step, op, name, self._last, []]
            if self._recording:
                self.collectives.append(record)
            try:
                handle = start(op, tensor, name, count)
            finally:
                self._exit()
                record[4].append([record[3], self._last])  # a blocking transport waits in start()
            if self._recording:
                self._handles[id(handle)] = record
            return handle

        flag = transport.allgather_flag

        def timed_flag(tensor: torch.Tensor, name: str):
            # one record for the flag, whatever start/wait calls the transport makes inside
            with self.collective("flag", name):
                return flag(tensor, name)

        def timed_wait(handle: object):
            record = self._handles.pop(id(handle), None)
            self._enter("wire")
            t0 = self._last
            try:
                return wait(handle)
            finally:
                self._exit()
                if record is not None:
                    record[4].append([t0, self._last])
        self._patch(transport, "start", timed_start)
        self._patch(transport, "wait", timed_wait)
        self._patch(transport, "allgather_flag", timed_flag)
        return self

    def uninstall(self) -> None:
        for owner, attr, old, had in reversed(self._undo):
            if had:
                setattr(owner, attr, old)
            else:
                delattr(owner, attr)
        self._undo.clear()

    # -- per step -----------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Start step ``step``'s wall clock (before its data, forward and backward)."""
        self._step, self._totals, self._kernels, self._thread = step, {}, {}, threading.get_ident()
        self._begin = self._last = time.perf_counter()

    def end_step(self, kind: str) -> None:
        """Close the step: its wall time, its labels, and ``other`` = wall less the labels."""
        wall = time.perf_counter() - self._begin
        row = {"step": self._step, "kind": kind, "wall": wall}
        row.update({label: self._totals.get(label, 0.0) for label in LABELS if label != "waiting_for_slowest"})
        row["other"] = max(0.0, wall - sum(self._totals.values()))
        row["kernels_by_name"] = dict(self._kernels)
        self.steps.append(row)

    def to_json(self) -> dict:
        return {"steps": self.steps, "collectives": self.collectives}


def split_waits(ranks: list[dict]) -> list[dict]:
    """Move each rank's wait for the last-arriving rank out of ``wire``.

    ``ranks``: every rank's :meth:`Breakdown.to_json`, in rank order. For the k-th collective,
    the data cannot move before the last rank has started it (t_last = the latest
    ``t_start``); the part of rank r's ``start`` and ``wait`` calls before t_last is
    ``waiting_for_slowest`` of the step that collective belongs to. Returns the ranks' step
    rows with that label added and ``wire`` reduced by as much, and ``wire_by_op``: the
    seconds of each recorded collective's calls less its wait, by op (``alltoall``: a 1-bit
    exchange's round 1, ``allgather``: its round 2, ``allreduce``: a full-precision average,
    ``flag``: the "gradients changed?" flag); together at most ``wire`` (a collective the
    breakdown does not record, such as a set-up message, is in ``wire`` alone).

    Raises:
        ValueError: when the ranks recorded different numbers or kinds of collectives (they
            cannot be paired by order).
    """
    counts = {len(r["collectives"]) for r in ranks}
    if len(counts) != 1:
        raise ValueError(f"split_waits: the ranks recorded {sorted(counts)} collectives; they pair by order")
    out = [[dict(row, waiting_for_slowest=0.0, wire_by_op={}) for row in r["steps"]] for r in ranks]
    index = [{row["step"]: row for row in rows} for rows in out]
    for k, records in enumerate(zip(*(r["collectives"] for r in ranks))):
        if len({(rec[1], rec[2]) for rec in records}) != 1:
            raise ValueError(f"split_waits: collective {k} differs across ranks: {[rec[1:3] for rec in records]}")
        t_last = max(rec[3] for rec in records)
        for r, rec in enumerate(records):
            row = index[r].get(rec[0])
            if row is None:
                continue
            waited = sum(max(0.0, min(t1, t_last) - t0) for t0, t1 in rec[4])
            row["waiting_for_slowest"] += waited
            row["wire"] -= waited
            ops = row["wire_by_op"]
            ops[rec[1]] = ops.get(rec[1], 0.0) + sum(t1 - t0 for t0, t1 in rec[4]) - waited
    return [row for rows in out for row in rows]


def table(rows: list[dict], world_size: int) -> dict:
    """Mean seconds per step of each label, per step kind, over the ranks' step rows
    (``rows`` from :func:`split_waits`): ``{kind: {"steps": n, "wall": s, label: s, ...,
    "wire_by_op": {op: s}, "kernels_by_name": {function: s}}}``, ``steps`` counted once per
    step (not per rank)."""
    out: dict = {}
    for row in rows:
        acc = out.setdefault(row["kind"], {"n": 0, "wall": 0.0, "wire_by_op": {}, "kernels_by_name": {},
                                           **{label: 0.0 for label in LABELS}})
        acc["n"] += 1
        acc["wall"] += row["wall"]
        for label in LABELS:
            acc[label] += row.get(label, 0.0)
        for key in ("wire_by_op", "kernels_by_name"):
            for name, seconds in row.get(key, {}).items():
                acc[key][name] = acc[key].get(name, 0.0) + seconds
    return {kind: {"steps": acc["n"] // world_size, "wall": acc["wall"] / acc["n"],
                   **{label: acc[label] / acc["n"] for label in LABELS},
                   **{key: {name: seconds / acc["n"] for name, seconds in sorted(acc[key].items())}
                      for key in ("wire_by_op", "kernels_by_name")}}
            for kind, acc in out.items()}
