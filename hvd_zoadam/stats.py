"""What an optimizer reports: its communication counts and the per-step log.

No collectives and no step math: the shell (:mod:`hvd_zoadam.optimizer`) records each step
here after it ran.
"""
from __future__ import annotations

import json

import torch

from .schedule import StepKind

KIND_NAMES = [k.value for k in StepKind]


class CommStats:
    """Bytes and rounds this rank sent, per step kind, since the optimizer was built.

    Bytes follow the table in :mod:`hvd_zoadam.transport`; the transport's counter is
    cumulative per kind, and :meth:`record` takes its totals after each step.
    """

    def __init__(self):
        self.per_kind = {k: {"steps": 0, "rounds": 0, "bytes_sent": 0} for k in KIND_NAMES}
        self.skipped_steps = 0
        self._adam_equivalent_bytes = 0.0  # fractional per step, rounded when reported

    def record(self, kind: StepKind, skip: bool, counter, world_size: int, numel: int) -> None:
        """One step of ``kind`` ran (``skip``: skipped on every rank). ``counter``: the transport's
        :class:`~hvd_zoadam.transport.CommCounter`; ``numel``: trainable elements (for the fp32
        Adam allreduce the same step would have cost)."""
        s = self.per_kind[kind.value]
        s["steps"] += 1
        s["rounds"], s["bytes_sent"] = counter.rounds[kind.value], int(round(counter.bytes_sent[kind.value]))
        self.skipped_steps += int(skip)
        self._adam_equivalent_bytes += 2 * (world_size - 1) / world_size * 4 * numel

    def report(self, transport: str, world_size: int) -> dict:
        """The dict of ``comm_stats()`` (see :meth:`hvd_zoadam.optimizer.ZeroOneAdamOptimizer.comm_stats`)."""
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

    def set_loss(self, loss) -> None:
        self.loss = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)

    def write(self, step: int, kind: StepKind, skip: bool, lr: float, stats: dict, loss=None) -> None:
        if loss is not None:
            self.set_loss(loss)
        record = {"step": step, "kind": kind.value, "lr": lr, "loss": self.loss, "skipped": skip,
                  "bytes_sent": stats["bytes_sent_total"], "rounds": stats["rounds_total"]}
        self.loss = None
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
