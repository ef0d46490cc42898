"""``python -m hvd_zoadam.bench load``: hvd_zoadam on a model of thousands of small tensors and
on one of about 100 M parameters, under a real launcher::

    horovodrun -np 2 -H localhost:2 --gloo python -m hvd_zoadam.bench load --model many-small
    horovodrun -np 2 -H localhost:2 --gloo python -m hvd_zoadam.bench load --model 100m
    torchrun --standalone --nproc-per-node 2 -m hvd_zoadam.bench load --model many-small

Under horovodrun it runs the Horovod front end against ``hvd.DistributedOptimizer``; under
torchrun (``TORCHELASTIC_RUN_ID`` set) the ``torch.distributed`` front end
(``hvd_zoadam.distributed``, gloo) against what DDP does for AdamW without a backward pass to
overlap with: its buckets (the same ``--bucket-cap-mb``) each gathered, allreduced and averaged,
written back into ``p.grad``, then ``AdamW(foreach=True)`` (:class:`BucketedAllreduceAdamW`).

Every rank holds the model with fixed gradients (no forward or backward pass: the optimizer
step alone is timed). Rank 0 prints one JSON object:

* ``memory``: the process's resident memory growth (RSS, psutil) over building the optimizer
  and its first three steps, against ``memory_bytes()``; measured first, on a fresh process.
* ``kinds``: per step kind, forced by the schedule as in ``bench step``: the bytes each step
  sends by ``comm_stats()`` against the transport's formulas over the optimizer's buckets
  (:func:`formula_bytes`; ``bytes_match``: equal but for the counter's rounding of fractional
  allreduce bytes to whole ones, under one byte a step), and the step time (``ms``) against the
  baseline's (``baseline_ms``, ``vs_baseline``; ``baseline`` names it) on the same gradients,
  the two timed alternately, best of ``--repeats``.
"""
from __future__ import annotations

import gc
import time
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from hvd_zoadam.comm.protocol import exchange_bytes
from hvd_zoadam.core.layout import make_buckets, scale_segments
from hvd_zoadam.core.schedule import StepKind

if TYPE_CHECKING:
    import argparse

# One optimizer per kind, with a schedule that makes every timed step that kind (as bench step).
KIND_CONFIGS = {StepKind.VARIANCE: dict(var_freeze_step=10 ** 9, var_update_scaler=10 ** 9),
                StepKind.COMPRESSED: dict(var_freeze_step=10 ** 9, var_update_scaler=1),
                StepKind.LOCAL: dict(var_freeze_step=1, local_step_policy="steps", local_step_scaler=1,
                                     local_step_clipper=1 << 20),
                StepKind.SYNC: dict(var_freeze_step=1)}


def make_model(name: str, blocks: int) -> nn.Module:
    """``many-small``: ``blocks`` blocks of LayerNorm(64), Linear(64, 64), LayerNorm(64) (six
    tensors each, LayerNorm-heavy like a deep transformer's); ``100m``: 24 Linear(2048, 2048)
    (100.7 M parameters in 48 tensors)."""
    torch.manual_seed(0)
    if name == "many-small":
        return nn.Sequential(*[m for _ in range(blocks)
                               for m in (nn.LayerNorm(64), nn.Linear(64, 64), nn.LayerNorm(64))])
    return nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(24)])


def formula_bytes(numels: list[int], world_size: int, *, bucket_cap_mb: float, scale_block_numel: int | None,
                  overlap: bool = True) -> dict:
    """Bytes one rank sends in one step of each kind, by the transport's formulas over the
    optimizer's buckets (``make_buckets`` at the cap, one dtype, one param group): VARIANCE,
    each bucket's fp32 allreduce, 2(P−1)/P·4·n_b; COMPRESSED and SYNC, each bucket's
    :func:`~hvd_zoadam.comm.protocol.exchange_bytes` (the scale slots' padding included);
    LOCAL, nothing; with ``overlap``, VARIANCE, COMPRESSED and SYNC steps add the allgather of
    a 4-byte flag of :func:`~hvd_zoadam.comm.protocol.step_flags`, (P−1)·4 (not the
    first step after the freeze, which starts nothing early)."""
    cap = max(1, int(bucket_cap_mb * 2 ** 20 / 4))
    buckets = [[numels[i] for i in idx] for idx in make_buckets(numels, cap)]
    p = world_size
    flag = (p - 1) * 4 if overlap else 0
    onebit = sum(exchange_bytes(scale_segments(b, scale_block_numel), p) for b in buckets)
    return {StepKind.VARIANCE: sum(2 * (p - 1) / p * 4 * sum(b) for b in buckets) + flag,
            StepKind.COMPRESSED: onebit + flag, StepKind.LOCAL: 0, StepKind.SYNC: onebit + flag,
            "buckets": len(buckets)}


def _rss() -> int:
    import psutil
    gc.collect()
    return psutil.Process().memory_info().rss


class BucketedAllreduceAdamW:
    """DDP's work for ``AdamW(foreach=True)`` where no backward pass hides it: the gradients in
    buckets of at most ``bucket_cap_mb`` (DDP's default 25), each gathered into one buffer,
    allreduced (``torch.distributed``, sum) and divided by the world size, written back into
    ``p.grad``; then the AdamW step. ``step()`` as an optimizer's."""

    def __init__(self, params: list[torch.Tensor], bucket_cap_mb: float):
        import torch.distributed as dist
        self.dist = dist
        self.params = params
        self.buckets = [[params[i] for i in idx]
                        for idx in make_buckets([p.numel() for p in params], int(bucket_cap_mb * 2 ** 20 / 4))]
        self.adamw = torch.optim.AdamW(params, lr=1e-4, foreach=True)

    def step(self) -> None:
        size = self.dist.get_world_size()
        for bucket in self.buckets:
            grads = [p.grad for p in bucket]
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.dist.all_reduce(flat)
            flat.div_(size)
            torch._foreach_copy_(grads, [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in grads]), grads)])
        self.adamw.step()


class _Launch:
    """What differs between the launchers: the ranks, the front end, the baseline."""

    def __init__(self):
        import os
        self.torchrun = "TORCHELASTIC_RUN_ID" in os.environ
        if self.torchrun:
            import torch.distributed as dist

            import hvd_zoadam.distributed as front_end
            dist.init_process_group("gloo")
            self.rank, self.size, self.front_end = dist.get_rank(), dist.get_world_size(), front_end
        else:
            import horovod.torch as hvd

            import hvd_zoadam as front_end
            hvd.init()
            self.rank, self.size, self.front_end, self.hvd = hvd.rank(), hvd.size(), front_end, hvd

    def baseline(self, model: nn.Module, bucket_cap_mb: float):
        """(name, optimizer) of the baseline over ``model``'s parameters."""
        if self.torchrun:
            return "ddp_adamw_foreach", BucketedAllreduceAdamW(list(model.parameters()), bucket_cap_mb)
        return "horovod_adamw_foreach", self.hvd.DistributedOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True), named_parameters=model.named_parameters())

    def optimizer(self, model: nn.Module, **knobs: object):
        return self.front_end.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4),
                                                   named_parameters=model.named_parameters(), **knobs)


def _warm_up(launch: _Launch) -> None:
    """Every step kind once on a small model, so that what stays after it (compiled kernels,
    the transport's set-up) is not counted as the measured optimizer's memory."""
    for kind in KIND_CONFIGS:
        small = nn.Linear(64, 64)
        for p in small.parameters():
            p.grad = torch.ones_like(p)
        opt = launch.optimizer(small, **KIND_CONFIGS[kind])
        for _ in range(3):
            opt.step()


def _timed(step, iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - t0) / iters


def run(args: argparse.Namespace) -> dict:
    """The report of the module docstring (every rank runs it; rank 0's is the one printed)."""
    launch = _Launch()
    torch.set_num_threads(args.threads)
    model = make_model(args.model, args.blocks)
    gen = torch.Generator().manual_seed(launch.rank)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 1e-2
    numels = [p.numel() for p in model.parameters()]

    def build(kind: StepKind):
        return launch.optimizer(model, bucket_cap_mb=args.bucket_cap_mb,
                                scale_block_numel=args.scale_block_numel or None, **KIND_CONFIGS[kind])
    out = {"benchmark": "load", "model": args.model, "launcher": "torchrun" if launch.torchrun else "horovodrun",
           "world_size": launch.size, "params": sum(numels), "tensors": len(numels), "threads": args.threads,
           "kinds": {}}
    out["baseline"], baseline = launch.baseline(model, args.bucket_cap_mb)
    baseline.step()  # the baseline's buffers, before the measurement
    _warm_up(launch)  # the kernels' compilation and the transport's set-up, likewise
    before = _rss()
    opt = build(StepKind.SYNC)
    for _ in range(3):
        opt.step()
    grown, held = _rss() - before, opt.memory_bytes()
    out["memory"] = {"rss_growth_bytes": grown, "memory_bytes": held, "growth_vs_memory_bytes": grown / held["total"]}
    del opt
    formula = formula_bytes(numels, launch.size, bucket_cap_mb=args.bucket_cap_mb,
                            scale_block_numel=args.scale_block_numel or None)
    out["buckets"] = formula["buckets"]
    for kind in KIND_CONFIGS:
        opt = build(kind)
        for _ in range(4):
            opt.step()
        sent = opt.comm_stats()[kind.value]["bytes_sent"]
        steps = opt.comm_stats()[kind.value]["steps"]
        pairs = [(_timed(baseline.step, args.iters), _timed(opt.step, args.iters)) for _ in range(args.repeats)]
        stats = opt.comm_stats()[kind.value]
        per_step = (stats["bytes_sent"] - sent) / max(1, stats["steps"] - steps)
        base, t = min(b for b, _ in pairs), min(k for _, k in pairs)
        out["kinds"][kind.value] = {"ms": t * 1e3, "baseline_ms": base * 1e3, "vs_baseline": t / base,
                                    "bytes_per_step": per_step, "formula_bytes": formula[kind],
                                    "bytes_match": abs(per_step - formula[kind]) < 1}  # the counter's rounding
        del opt
    return out if launch.rank == 0 else None


def add_parser(sub: argparse._SubParsersAction) -> None:
    lo = sub.add_parser("load", help="many small tensors, or 100 M parameters: bytes against the formulas, step "
                                     "time against Horovod's or DDP's AdamW, memory_bytes() against RSS (under "
                                     "horovodrun or torchrun)")
    lo.add_argument("--model", choices=["many-small", "100m"], default="many-small")
    lo.add_argument("--blocks", type=int, default=600, help="many-small: blocks of six tensors")
    lo.add_argument("--bucket-cap-mb", type=float, default=25.0)
    lo.add_argument("--scale-block-numel", type=int, default=2048)
    lo.add_argument("--iters", type=int, default=3)
    lo.add_argument("--repeats", type=int, default=3)
    lo.add_argument("--threads", type=int, default=1)
    lo.add_argument("--json")
    lo.set_defaults(run=run)
