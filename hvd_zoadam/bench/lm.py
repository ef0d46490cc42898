"""One rank of a ``python -m hvd_zoadam.bench network`` run: the char LM of examples/train_lm.py
trained by one of the compared systems. Launched by mpirun (one rank per simulated host).

Runs (``--run``):
  adam          hvd.DistributedOptimizer(torch.optim.AdamW), fp32 allreduce (Horovod, MPI controller)
  adam-fp16     the same with compression=hvd.Compression.fp16
  onebit        hvd_zoadam.OnebitAdam(torch.optim.AdamW), full-precision AdamW for --onebit-freeze-frac
                of the steps (default 0.2, the paper advises 15-25 %), then the 1-bit exchange of the
                momentum at every step, one scale per 256 elements as zoadam
  zoadam        hvd_zoadam.DistributedOptimizer(torch.optim.AdamW), freeze at --warmup, one scale per
                256 elements, buckets of --bucket-cap-mb (1.5) MiB, var_update_scaler 2 (README: short
                runs want 2-4; 8, the 400-step demo's, made 10 of the 12 warm-up steps full precision),
                H by the lr policy up to 8
  zoadam-torchrun
                the same 0/1 Adam through hvd_zoadam.distributed over a torch.distributed Gloo
                group, one rank per torchrun agent (launched by torchrun, not mpirun; no Horovod)
  zoadam-mpi    the same 0/1 Adam through hvd_zoadam.mpi over mpi4py alone (launched by mpirun;
                no Horovod, so no background thread beside the training)
  ddp-powersgd  torch DDP over gloo with the PowerSGD hook (rank --powersgd-rank, error feedback,
                warm start; plain allreduce for the first --warmup steps), bucket_cap_mb=1000
  ddp-localsgd  torch DDP over gloo with post-local SGD: allreduce for --warmup steps, then local
                steps with PeriodicModelAverager(period=--local-period)
  compute       the same training with no communication at all (the ceiling)
  compute-horovod
                the same as compute with Horovod started (hvd.init(): its background thread runs,
                no collective in the steps): the ceiling of a Horovod job on the same cores
  compute-lockstep
                the same as compute with the ranks held in step: an 8-byte MPI allreduce (mpi4py,
                no Horovod) after every step, so that each step lasts as long as its slowest
                rank's, as in any synchronous data-parallel job: the ceiling of one

Rank 0 writes ``--out`` (for the compute runs every rank also writes ``--out``.rank<r>, so that
the bench can take the slowest rank as the ceiling): steps/s over the steps after the first ``--skip`` (numba compiles
and DDP's bucket rebuild happen there), steps/s after ``--warmup`` (the steady state: 0/1
Adam frozen, PowerSGD and local SGD started), wall seconds, mean train loss of the last 10 steps
(averaged over ranks, except for ``compute``), and the run's own byte/round counts where it
has them (hvd_zoadam's ``comm_stats()``; Adam's allreduce by formula), and the cores its
threads used over the timed span (``cpu_cores``: the training thread's and the others'
together, e.g. Horovod's background thread; Linux only).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from hvd_zoadam.bench.breakdown import Breakdown

RUNS = ("adam", "adam-fp16", "zoadam", "zoadam-defaults", "zoadam-torchrun", "zoadam-mpi", "ddp-powersgd",
        "ddp-localsgd", "compute", "compute-horovod", "compute-lockstep", "onebit")
COMPUTE_RUNS = ("compute", "compute-horovod")  # no collective in the steps: each rank reports its own speed
ZOADAM_RUNS = ("zoadam", "zoadam-defaults", "zoadam-torchrun", "zoadam-mpi")


def example_module(name: str):
    """examples/{name}.py as a module (under ``$HVD_ZOADAM_ROOT`` when set, else this checkout)."""
    path = Path(os.environ.get("HVD_ZOADAM_ROOT", Path(__file__).resolve().parents[2])) / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _train_lm():
    """examples/train_lm.py as a module (model, corpus, batches, lr schedule)."""
    return example_module("train_lm")


def add_model_arguments(group: argparse.ArgumentParser | argparse._ArgumentGroup, *, n_layer: int = 2,
                        n_embd: int = 128, warmup: int = 60, warmup_help: str | None = None,
                        eval_batches: int = 8) -> None:
    """The char LM's size and training arguments shared by ``bench convergence``, ``bench
    resume`` and the ranks of ``bench network``: --n-layer, --n-embd, --n-head, --block-size,
    --batch-size, --lr, --warmup, --eval-batches, --seed (an argparse parser or argument group)."""
    group.add_argument("--n-layer", type=int, default=n_layer)
    group.add_argument("--n-embd", type=int, default=n_embd)
    group.add_argument("--n-head", type=int, default=4)
    group.add_argument("--block-size", type=int, default=128)
    group.add_argument("--batch-size", type=int, default=16)
    group.add_argument("--lr", type=float, default=2e-3)
    group.add_argument("--warmup", type=int, default=warmup, help=warmup_help)
    group.add_argument("--eval-batches", type=int, default=eval_batches)
    group.add_argument("--seed", type=int, default=1234)


def backward_on_batch(model: torch.nn.Module, opt: torch.optim.Optimizer, lm: ModuleType, data: torch.Tensor,
                      args: argparse.Namespace, gen: torch.Generator):
    """One step's data and gradients: the next batch from ``gen``, ``opt.zero_grad()``, the
    cross-entropy of ``model`` on it and its backward pass. Returns the loss (a 0-dim tensor)."""
    x, y = lm.get_batch(data, args.batch_size, args.block_size, gen)
    opt.zero_grad()
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    return loss


def thread_cpu_seconds(task_dir: str = "/proc/self/task") -> dict | None:
    """CPU seconds (user + system) of every thread of this process, ``{thread id: seconds}``,
    read from ``task_dir`` (Linux's procfs); None where it cannot be read."""
    out = {}
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        for tid in os.listdir(task_dir):
            with open(f"{task_dir}/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)", which may hold spaces
            out[int(tid)] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    except (AttributeError, OSError, ValueError, IndexError):  # no os.sysconf, no procfs
        return None
    return out


def cores_used(start: dict | None, end: dict | None, wall_s: float, training_thread: int | None = None) -> dict | None:
    """Cores each part of the process used between two :func:`thread_cpu_seconds` readings
    ``wall_s`` seconds apart: ``{"training_thread": c, "other_threads": c}`` (1.0 = one core
    busy all the time; a thread started in between counts from 0). ``training_thread``: its
    thread id, by default the calling thread's. None when either reading is missing."""
    if start is None or end is None or not wall_s > 0:
        return None
    tid = threading.get_native_id() if training_thread is None else training_thread
    used = {t: s - start.get(t, 0.0) for t, s in end.items()}
    own = used.pop(tid, 0.0)
    return {"training_thread": own / wall_s, "other_threads": sum(used.values()) / wall_s}


class StepClock:
    """The wall clock of a timed run: a stamp at the start of every step, the timed span from
    step ``skip + 1`` on, and the validations, whose seconds never count in the span.
    ``val_curve``: ``(step, wall seconds since step 1 less the validations so far, val loss)``.
    ``cpu``: :func:`thread_cpu_seconds` at the start and the end of the span."""

    def __init__(self, skip: int):
        self.skip, self.stamps, self.start, self.end = skip, {}, None, None
        self.eval_s, self.eval_timed, self.val_curve, self.eval_at = 0.0, 0.0, [], {}
        self.cpu = {"start": None, "end": None}

    def tick(self, step: int) -> None:
        self.stamps[step] = time.perf_counter()
        if step == self.skip + 1:
            self.start = self.stamps[step]
            self.cpu["start"] = thread_cpu_seconds()

    def validate(self, step: int, val_loss: Callable[[], float]) -> None:
        """Run ``val_loss()`` (a float) outside the timed span."""
        t0 = time.perf_counter()
        val = val_loss()
        self.val_curve.append((step, t0 - self.stamps[1] - self.eval_s, val))
        took = time.perf_counter() - t0
        self.eval_s += took
        self.eval_timed += took if self.start is not None else 0.0
        self.eval_at[step] = took

    def elapsed(self) -> float:
        """Seconds of the timed span, validations excluded (call once, after the last step)."""
        self.end = time.perf_counter()
        self.cpu["end"] = thread_cpu_seconds()
        return self.end - self.start - self.eval_timed

    def cores(self) -> dict | None:
        """:func:`cores_used` over the timed span, validations included (call after :meth:`elapsed`)."""
        return cores_used(self.cpu["start"], self.cpu["end"], self.end - self.start)


def parse(argv: list[str] | None = None):
    # "@FILE": one argument per line (torchrun takes --run and --master for its own options)
    ap = argparse.ArgumentParser(fromfile_prefix_chars="@")
    ap.add_argument("--run", choices=RUNS, required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--skip", type=int, default=3)
    add_model_arguments(ap, n_layer=4, n_embd=256, warmup=12, eval_batches=4)
    ap.add_argument("--powersgd-rank", type=int, default=4)
    ap.add_argument("--local-period", type=int, default=8)
    ap.add_argument("--master", default=os.environ.get("ZO_MASTER", "127.0.0.1"))
    ap.add_argument("--port", type=int, default=29533)
    ap.add_argument("--transport", default="auto", help="hvd_zoadam's transport for the zoadam run")
    ap.add_argument("--var-update-scaler", type=int, default=2, help="0/1 Adam's kappa (zoadam run)")
    ap.add_argument("--local-step-policy", default="lr", help="0/1 Adam's H policy (zoadam run)")
    ap.add_argument("--var-update-weighting", default="interval", choices=["interval", "paper"],
                    help="0/1 Adam's var_update_weighting (zoadam run)")
    ap.add_argument("--local-step-scaler", type=int, default=40, help="0/1 Adam's alpha (zoadam run)")
    ap.add_argument("--local-step-clipper", type=int, default=8, help="0/1 Adam's H_max (zoadam run)")
    ap.add_argument("--overlap", choices=("on", "off"), default="on",
                    help="0/1 Adam's overlap option (zoadam runs): start exchanges from the backward hooks")
    ap.add_argument("--compression", choices=("none", "fp16"), default="none",
                    help="hvd.Compression of the zoadam run's full-precision VARIANCE steps (Horovod's argument; "
                         "fp16 halves their bytes; the other runs ignore it)")
    ap.add_argument("--bucket-cap-mb", type=float, default=1.5,
                    help="bucket_cap_mb of the zoadam and onebit runs: 1.5 gives the main job 9 buckets, whose "
                         "SYNC exchanges pipeline (one bucket's rounds on the wire while the next one's kernels "
                         "run); at the default 25 the whole model is one bucket and nothing overlaps")
    ap.add_argument("--eval-every", type=int, default=0, help="validation loss every k steps (0: never)")
    ap.add_argument("--onebit-freeze-frac", type=float, default=0.2,
                    help="1-bit Adam's freeze_step as a fraction of --steps (onebit run)")
    ap.add_argument("--adamw", choices=("fused", "foreach", "for-loop"), default="fused",
                    help="torch AdamW's implementation in the runs that step with it (adam, adam-fp16, ddp-*, compute)")
    ap.add_argument("--breakdown", action="store_true",
                    help="time each step's parts (hvd_zoadam.bench.breakdown); "
                         "every rank writes --out.rank<r>.breakdown")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.compression != "none" and args.run in ("zoadam-torchrun", "zoadam-mpi"):
        ap.error(f"--compression is Horovod's argument and the {args.run} run has no Horovod; "
                 "leave it out of that run")
    return args


@torch.no_grad()
def _average(value: torch.Tensor, hvd, dist, comm, world, name: str) -> torch.Tensor:
    """``value`` averaged over the ranks by whichever collectives the run has (itself if none)."""
    if hvd is not None:
        return hvd.allreduce(value, op=hvd.Average, name=name)
    if dist is not None:
        dist.all_reduce(value)
        return value / world
    if comm is not None:  # float32, as Horovod sums
        from mpi4py import MPI
        total = value.reshape(1).to(torch.float32).clone()
        comm.Allreduce(MPI.IN_PLACE, [total.numpy(), MPI.FLOAT], op=MPI.SUM)
        return total[0] / world
    return value


def _val_loss(model, batches, hvd, dist, comm, world, step) -> float:
    """The validation loss on the fixed held-out batches, averaged over the ranks' models (they
    differ inside local-step windows); ``compute`` ranks report their own."""
    model.eval()
    val = torch.tensor(sum(F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item() for x, y in batches)
                       / len(batches))
    model.train()
    return float(_average(val, hvd, dist, comm, world, f"bench.val.{step}"))


def _adamw_impl(args, run=None) -> dict:
    """torch AdamW's implementation flag for the runs that step with it (Adam, fp16, DDP,
    compute only): ``fused`` by default, the fastest on the CPU (the for-loop default cost
    the compute-only ceiling about 28 ms a step that 0/1 Adam's fused kernels do not pay).
    1-bit Adam (``run="onebit"``) steps with its own kernels: its AdamW is left as it is."""
    if run == "onebit" or args.adamw == "for-loop":
        return {}
    return {args.adamw: True}


def _zoadam_knobs(args) -> dict:
    """The 0/1 Adam knobs a run passes: none for ``zoadam-defaults`` (the optimizer's own
    defaults); the tuned recipe of the other 0/1 Adam runs (the freeze at the warm-up's end,
    a scale per 256 elements, the rest from the worker's arguments)."""
    if args.run == "zoadam-defaults":
        return {}
    return {"var_freeze_step": args.warmup, "var_update_scaler": args.var_update_scaler,
            "local_step_scaler": args.local_step_scaler, "local_step_clipper": args.local_step_clipper,
            "local_step_policy": args.local_step_policy, "var_update_weighting": args.var_update_weighting,
            "scale_block_numel": 256}


def _onebit_freeze(args) -> int:
    return max(1, round(args.onebit_freeze_frac * args.steps))


def _init_world(args):
    """Start what the run's system needs: ``(hvd, dist, comm, rank, world)``, the others None."""
    hvd = dist = comm = None
    if args.run in ("adam", "adam-fp16", "zoadam", "zoadam-defaults", "onebit", "compute-horovod"):
        import horovod.torch as hvd
        hvd.init()
        return hvd, None, None, hvd.rank(), hvd.size()
    if args.run in ("zoadam-mpi", "compute-lockstep"):
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        return None, None, comm, comm.Get_rank(), comm.Get_size()
    if args.run == "zoadam-torchrun":  # torchrun's env:// (MASTER_ADDR, RANK, WORLD_SIZE, ...)
        import torch.distributed as dist
        dist.init_process_group("gloo")
        return None, dist, None, dist.get_rank(), dist.get_world_size()
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", 0)))
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    if args.run != "compute":
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=rank, world_size=world)
    return hvd, dist, comm, rank, world


def _data(lm, args):
    """``(training characters, fixed held-out batches, vocabulary size)`` of the corpus."""
    text = lm.load_corpus()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    encoded = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    data, held_out = encoded[:int(0.9 * len(text))], encoded[int(0.9 * len(text)):]
    val_gen = torch.Generator().manual_seed(12345)  # one fixed held-out set for every system
    val_batches = [lm.get_batch(held_out, args.batch_size, args.block_size, val_gen) for _ in range(args.eval_batches)]
    return data, val_batches, len(chars)


def _optimizer(args, model, groups, hvd):
    """The run's optimizer for the 0/1 Adam, Adam and 1-bit Adam runs."""
    if args.run in ZOADAM_RUNS:
        import hvd_zoadam
        import hvd_zoadam.distributed as zd
        import hvd_zoadam.mpi as zm
        factory = {"zoadam": hvd_zoadam.DistributedOptimizer, "zoadam-defaults": hvd_zoadam.DistributedOptimizer,
                   "zoadam-torchrun": zd.DistributedOptimizer, "zoadam-mpi": zm.DistributedOptimizer}[args.run]
        extra = {"compression": hvd.Compression.fp16} if args.compression == "fp16" else {}
        return factory(torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98)),
                       named_parameters=model.named_parameters(), **_zoadam_knobs(args), transport=args.transport,
                       bucket_cap_mb=args.bucket_cap_mb, overlap=args.overlap == "on", **extra)
    inner = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98), **_adamw_impl(args, args.run))
    if args.run == "onebit":
        import hvd_zoadam
        return hvd_zoadam.OnebitAdam(inner, model.named_parameters(), freeze_step=_onebit_freeze(args),
                                     scale_block_numel=256, transport=args.transport, bucket_cap_mb=args.bucket_cap_mb)
    comp = hvd.Compression.fp16 if args.run == "adam-fp16" else hvd.Compression.none
    return hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), compression=comp)


def _ddp(args, model, groups, dist):
    """``(net, opt, averager)`` of the DDP runs (PowerSGD, post-local SGD) and the compute-only ones."""
    net, averager = model, None
    if dist is not None:
        from torch.nn.parallel import DistributedDataParallel as DDP
        net = DDP(model, bucket_cap_mb=1000)
        if args.run == "ddp-powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
            state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                           start_powerSGD_iter=max(2, args.warmup), use_error_feedback=True,
                                           warm_start=True)
            net.register_comm_hook(state, powerSGD.powerSGD_hook)
        else:
            from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
                PostLocalSGDState,
                post_localSGD_hook,
            )
            from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
            subgroup, _ = dist.new_subgroups(group_size=1)  # local steps: no intra-node averaging (CPU)
            net.register_comm_hook(PostLocalSGDState(process_group=None, subgroup=subgroup,
                                                     start_localSGD_iter=args.warmup), post_localSGD_hook)
            averager = PeriodicModelAverager(period=args.local_period, warmup_steps=args.warmup)
    return net, torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98), **_adamw_impl(args)), averager


def _train(args, lm, world_state, model, net, opt, averager, data, val_batches):
    """The timed loop: ``(losses, clock, seconds per step kind, the breakdown timer)``."""
    hvd, dist, comm, rank, world = world_state
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lm.lr_lambda(args.warmup, args.steps))
    gen = torch.Generator().manual_seed(1234 * 1000 + rank)
    losses, clock, kind_s = [], StepClock(args.skip), {}  # kind_s: zoadam's seconds per step kind
    lockstep = np.zeros(1)  # compute-lockstep's 8 bytes
    timer = Breakdown()  # its regions only; the library is wrapped with --breakdown alone
    if args.breakdown:
        timer.install(getattr(opt, "transport", None))
    for step in range(1, args.steps + 1):
        clock.tick(step)
        timer.begin_step(step)
        with timer.region("forward_backward"):
            loss = backward_on_batch(net, opt, lm, data, args, gen)
        before = opt.comm_stats() if args.run in (*ZOADAM_RUNS, "onebit") else None
        with timer.region("optimizer"):
            opt.step()
            if averager is not None:
                averager.average_parameters(model.parameters())
        if args.run == "compute-lockstep":
            from mpi4py import MPI
            with timer.collective("allreduce", "bench.lockstep"):
                comm.Allreduce(MPI.IN_PLACE, lockstep, op=MPI.SUM)
        kind = "step" if before is None else _kind_taken(before, opt.comm_stats())
        if before is not None and step > args.skip:
            kind_s[kind] = kind_s.get(kind, 0.0) + time.perf_counter() - clock.stamps[step]
        sched.step()
        losses.append(loss.item())
        timer.end_step(kind)
        if args.eval_every and (step % args.eval_every == 0 or step == args.steps):
            clock.validate(step, lambda: _val_loss(model, val_batches, hvd, dist, comm, world, step))
    return losses, clock, kind_s, timer


def _kind_taken(before: dict, after: dict) -> str:
    return next(k for k in ("variance", "compressed", "local", "sync") if after[k]["steps"] > before[k]["steps"])


def _report(args, world_state, opt, n_params, losses, clock, kind_s) -> dict:
    """The run's JSON: speeds, the final loss (averaged over the ranks), curves, bytes and kinds."""
    hvd, dist, comm, rank, world = world_state
    elapsed = clock.elapsed()  # steps/s and wall times never include evaluations
    steady_from = max(args.warmup, args.skip) + 1   # after the freeze / PowerSGD and local-SGD start
    steady = ((args.steps - steady_from + 1) / (clock.end - clock.stamps[steady_from]
                                                - sum(d for t, d in clock.eval_at.items() if t >= steady_from))
              if steady_from <= args.steps else None)
    final = _average(torch.tensor(sum(losses[-10:]) / len(losses[-10:])), hvd, dist, comm, world, "bench.final")
    out = {"run": args.run, "world_size": world, "steps": args.steps, "timed_steps": args.steps - args.skip,
           "steps_per_s": (args.steps - args.skip) / elapsed, "timed_s": elapsed, "final_loss": final.item(),
           "steady_steps_per_s": steady, "steady_from_step": steady_from,
           "params": n_params, "val_curve": clock.val_curve, "eval_seconds": clock.eval_s, "cpu_cores": clock.cores()}
    if args.run == "onebit":
        stats = opt.comm_stats()
        out.update(bytes_sent_counted=stats["bytes_sent_total"], rounds=stats["rounds_total"],
                   transport=stats["transport"], kinds={k: stats[k]["steps"] for k in ("variance", "compressed")},
                   timed_seconds_by_kind=kind_s, config={"freeze_step": _onebit_freeze(args), "scale_block_numel": 256,
                                                         "bucket_cap_mb": args.bucket_cap_mb})
    if args.run in ZOADAM_RUNS:
        stats, kinds = opt.comm_stats(), ("variance", "compressed", "local", "sync")
        out.update(bytes_sent_counted=stats["bytes_sent_total"], rounds=stats["rounds_total"],
                   transport=stats["transport"], kinds={k: stats[k]["steps"] for k in kinds},
                   bytes_sent_by_kind={k: stats[k]["bytes_sent"] for k in kinds},
                   timed_seconds_by_kind=kind_s, var_freeze_step=opt.schedule_state()["var_freeze_step"],
                   config={**_zoadam_knobs(args), "bucket_cap_mb": args.bucket_cap_mb,
                           "compression": args.compression, "overlap": args.overlap == "on"})
    if not args.run.startswith(("zoadam", "onebit")):
        out["adamw"] = args.adamw
    if args.run.startswith("adam"):
        width = 2 if args.run == "adam-fp16" else 4
        out.update(bytes_sent_counted=args.steps * 2 * (world - 1) / world * width * n_params, rounds=args.steps)
    return out


def _finish(args, world_state, out: dict, timer) -> None:
    """Write the report (rank 0; every rank's for the compute-only runs and the breakdown), then
    an orderly end of the run's collectives."""
    hvd, dist, comm, rank, world = world_state
    if rank == 0:
        Path(args.out).write_text(json.dumps(out))
    if args.breakdown:
        timer.uninstall()
        Path(f"{args.out}.rank{rank}.breakdown").write_text(json.dumps(timer.to_json()))
    if args.run in COMPUTE_RUNS:
        # Nothing paces the ranks against each other here: each reports its own speed, and the
        # bench takes the slowest, which is what would pace a data-parallel job.
        Path(f"{args.out}.rank{rank}").write_text(json.dumps(out))
    if hvd is not None:
        hvd.barrier()
    elif dist is not None:
        dist.barrier()
        dist.destroy_process_group()
    elif comm is not None:
        comm.Barrier()


def main(argv: list[str] | None = None):
    args = parse(argv)
    lm = _train_lm()
    torch.set_num_threads(1)
    world_state = _init_world(args)
    data, val_batches, vocab = _data(lm, args)
    torch.manual_seed(1234)
    model = lm.CharGPT(vocab, args.block_size, args.n_layer, args.n_embd, args.n_head)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
    if args.run in (*ZOADAM_RUNS, "adam", "adam-fp16", "onebit"):
        net, opt, averager = model, _optimizer(args, model, groups, world_state[0]), None
    else:
        net, opt, averager = _ddp(args, model, groups, world_state[1])
    losses, clock, kind_s, timer = _train(args, lm, world_state, model, net, opt, averager, data, val_batches)
    out = _report(args, world_state, opt, sum(p.numel() for p in model.parameters()), losses, clock, kind_s)
    _finish(args, world_state, out, timer)

if __name__ == "__main__":
    sys.exit(main())
