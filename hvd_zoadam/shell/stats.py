"""What an optimizer reports: its communication counts and the per-step log.

No collectives and no step math: the shell (:mod:`hvd_zoadam.shell.horovod`) records each step
here after it ran.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

import torch

from hvd_zoadam.core.schedule import NEVER, StepKind, constant_rate_freeze_risk, low_beta2_risk

if TYPE_CHECKING:
    from hvd_zoadam.comm.transport import CommCounter

KIND_NAMES = [k.value for k in StepKind]


class CommStats:
    """Bytes and rounds this rank sent, per step kind, since the optimizer was built.

    Bytes follow the table in :mod:`hvd_zoadam.comm.transport`; the transport's counter is
    cumulative per kind, and :meth:`record` takes its totals after each step.
    """

    def __init__(self):
        self.per_kind = {k: {"steps": 0, "rounds": 0, "bytes_sent": 0} for k in KIND_NAMES}
        self.skipped_steps = 0
        self._adam_equivalent_bytes = 0.0  # fractional per step, rounded when reported

    def record(self, kind: StepKind, skip: bool, counter: CommCounter, world_size: int, numel: int) -> None:
        """One step of ``kind`` ran (``skip``: skipped on every rank). ``counter``: the transport's
        :class:`~hvd_zoadam.comm.transport.CommCounter`; ``numel``: trainable elements (for the fp32
        Adam allreduce the same step would have cost)."""
        s = self.per_kind[kind.value]
        s["steps"] += 1
        s["rounds"], s["bytes_sent"] = counter.rounds[kind.value], int(round(counter.bytes_sent[kind.value]))
        self.skipped_steps += int(skip)
        self._adam_equivalent_bytes += 2 * (world_size - 1) / world_size * 4 * numel

    def report(self, transport: str, world_size: int) -> dict:
        """The dict of ``comm_stats()`` (see :meth:`hvd_zoadam.shell.optimizer.DistributedAdamOptimizer.comm_stats`)."""
        out = {k: dict(v) for k, v in self.per_kind.items()}
        out["bytes_sent_total"] = sum(v["bytes_sent"] for v in self.per_kind.values())
        out["rounds_total"] = sum(v["rounds"] for v in self.per_kind.values())
        out.update(skipped_steps=self.skipped_steps, adam_equivalent_bytes=int(round(self._adam_equivalent_bytes)),
                   transport=transport, world_size=world_size)
        return out


class StepLog:
    """One JSON line per step appended to ``path``: step, kind, lr, loss, skipped, and the
    cumulative bytes sent and rounds."""

    def __init__(self, path: str):
        self.path = path
        self.loss = None  # the coming step's loss, from log_loss() or step(closure)

    def set_loss(self, loss: torch.Tensor | float) -> None:
        self.loss = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)

    def write(self, step: int, kind: StepKind, skip: bool, lr: float, stats: dict,
              loss: torch.Tensor | float | None = None) -> None:
        if loss is not None:
            self.set_loss(loss)
        record = {"step": step, "kind": kind.value, "lr": lr, "loss": self.loss, "skipped": skip,
                  "bytes_sent": stats["bytes_sent_total"], "rounds": stats["rounds_total"]}
        self.loss = None
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


class ReportsMixin:
    """What an optimizer reports: ``comm_stats()``, ``memory_bytes()``, ``schedule_state()``,
    and the loss for the per-step log."""

    def log_loss(self, loss: torch.Tensor | float) -> None:
        """Give the coming step's loss (a float or 0-dim tensor) to the per-step log."""
        if self._step_log:
            self._step_log.set_loss(loss)

    def comm_stats(self) -> dict:
        """What this rank communicated so far.

        Returns a dict: for each kind (``variance``, ``compressed``, ``local``, ``sync``) a dict
        of ``steps``, ``rounds`` (collective calls) and ``bytes_sent``; ``bytes_sent_total``,
        ``rounds_total``, ``skipped_steps``, ``adam_equivalent_bytes`` (what
        ``hvd.DistributedOptimizer(torch.optim.Adam)`` at fp32 would have sent over the same
        steps: an allreduce of every trainable fp32 gradient per step), ``transport`` and
        ``world_size``. Bytes follow the table in :mod:`hvd_zoadam.comm.transport`. With the
        two-level exchange, ``hierarchical`` adds ``nodes``, ``ranks_per_node`` and the 1-bit
        exchanges' bytes split into ``intra_node_bytes`` and ``inter_node_bytes`` (both also in
        the totals; the full-precision averages are Horovod's and not split).
        """
        out = self._stats.report(self.transport.describe(), self.world_size)
        levels = self._engine.levels
        if levels is not None:
            out["hierarchical"] = {"nodes": levels[1].world_size, "ranks_per_node": levels[0].world_size,
                                   "intra_node_bytes": levels[0].counter.total_bytes(),
                                   "inter_node_bytes": levels[1].counter.total_bytes()}
        return out

    def memory_bytes(self) -> dict:
        """Bytes this optimizer holds: ``state`` (exp_avg, exp_avg_sq, anchor, and float32 master
        weights for fp16/bf16 parameters), ``error_buffers``,
        ``scratch`` (reused every step) and ``total``."""
        return self._engine.memory_bytes()

    def schedule_state(self) -> dict:
        """The schedule after the last step: step, frozen, var_freeze_step (None while
        ``var_freeze_step="auto"`` has not decided it), var_interval, var_counter,
        exp_avg_sq_steps, local_step_interval, local_step_counter, freeze_lr, and ``risk``: None, or
        a sentence when the run is in a regime where the defaults were found to trail Adam, with
        what to set (:func:`~hvd_zoadam.core.schedule.constant_rate_freeze_risk`, then
        :func:`~hvd_zoadam.core.schedule.low_beta2_risk`; rank 0 also logs each once)."""
        c = self._counters
        schedule = self.schedule
        out = schedule.describe(c["step"], lr=float(self.param_groups[0]["lr"]), freeze_lr=c["freeze_lr"])
        out["var_freeze_step"] = None if schedule.var_freeze_step == NEVER else schedule.var_freeze_step
        out.update(exp_avg_sq_steps=c["exp_avg_sq_steps"], freeze_lr=c["freeze_lr"],
                   lr_sum=[g["lr_sum"] for g in self.param_groups],
                   risk=constant_rate_freeze_risk(getattr(self.algorithm, "auto_freeze", None), c["step"],
                                                  out["var_freeze_step"],
                                                  float(self.param_groups[0]["lr"]), c["freeze_lr"])
                   or low_beta2_risk(getattr(self.algorithm, "auto_freeze", None)))
        return out
