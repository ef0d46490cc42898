"""Faults at random over a long run: ``python -m hvd_zoadam.bench chaos`` (needs root).

A small regression MLP (5,508 weights, a cosine learning rate, past the variance freeze into
windows of local steps) trains for ``--steps`` steps on ``--ranks`` ranks under ``mpirun`` on
:mod:`hvd_zoadam.bench.netsim`'s simulated hosts, one rank per host, checkpointing every
``--save-every`` steps with :func:`hvd_zoadam.checkpoint.save`. A supervisor restarts the job
from its latest complete checkpoint (every rank's file there) after each failure, while a
seeded fault injector (``--seed``: a run can be replayed) plans each attempt's faults at
random steps and ranks, until ``--faults`` have fired (link faults, which the job may survive,
until one that kills a rank or fails a save):

* ``kill-between``: SIGKILL of a rank between two steps;
* ``kill-exchange``: SIGKILL of a rank as it starts round 1 (``.signs``) or round 2
  (``.server``) of a 1-bit exchange;
* ``kill-save``: SIGKILL of a rank inside :func:`hvd_zoadam.checkpoint.save`, after the
  save's collectives and before its own file is written (it leaves a partial
  ``*.killed.tmp`` file behind, as a kill during the write would leave the temporary file);
* ``disk-full``: a rank's checkpoint write fails (``RLIMIT_FSIZE`` of 4 KiB, ``SIGXFSZ``
  ignored: ``OSError`` EFBIG, as ENOSPC from a full disk), so the job ends with that error;
* ``link-down``: one host's link taken down at the bridge for a random time (0.5 to 1.5× the
  collective deadline), then up again; shorter outages are survived;
* ``link-degraded``: one host's link cut to 2 Mbit/s with a 4-packet queue (tail drops,
  retransmissions, queueing delay) for 1 to 6 s. The kernel these runs were measured on has
  no ``netem``, ``gact`` or ``iptables``, so random loss and fixed added latency are not
  injected; a starved link is the nearest fault HTB and pfifo can make.

With ``--resize`` each attempt runs on ``--ranks`` or one rank fewer, drawn from the seed, and
resumes through :func:`hvd_zoadam.checkpoint.load` at the other world size where the
checkpoint's differs. The data of a step is the same global batch at any world size (the
``--ranks`` batches split over the ranks by contiguous groups, each loss weighted by its
share), so the end is compared with the uninterrupted run by its validation loss.

The collective deadline is ``--timeout`` (``HVD_ZOADAM_TIMEOUT_S``). Every rank calls
``set_iteration`` so ranks that went apart would be named. The report (JSON): faults fired
by kind, attempts, restarts, steps recomputed (the steps a failed attempt had done past the
checkpoint the next one resumed from), checkpoints that failed to load (must be 0), hangs (an
attempt with no progress for 2.5 × ``--timeout`` + 90 s, or a rank process left after
``mpirun`` ended; must be 0), temporary files left by killed saves, and the
final parameters of every rank against an uninterrupted run of the same seed (without
``--resize`` bitwise equal: every restart keeps the world size, and a resume from every rank's
own file is exact; Horovod's tensor fusion is off, see :func:`run_attempt`).
"""
from __future__ import annotations

import argparse
import os
import random
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from types import FrameType

    from hvd_zoadam.bench.netsim import Network

KINDS = {"kill-between": 0.2, "kill-exchange": 0.25, "kill-save": 0.15, "disk-full": 0.1,
         "link-down": 0.15, "link-degraded": 0.15}
LOAD_FAILED = 3  # the worker's exit status when a checkpoint does not load


# -- the worker: one rank --------------------------------------------------------------------

def _model() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 4))


def _batch(step: int, rank: int, n: int = 32):
    """Batch ``rank`` of step ``step``: a fixed teacher's targets plus noise."""
    teacher = torch.Generator().manual_seed(99)
    w = torch.randn(16, 4, generator=teacher)
    gen = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(n, 16, generator=gen)
    return x, torch.tanh(x @ w) + 0.05 * torch.randn(n, 4, generator=gen)


def _loss(model, step: int, rank: int, world_size: int, data_ranks: int) -> torch.Tensor:
    """Rank ``rank``'s loss on step ``step``'s ``data_ranks`` batches (the job's size when not
    resized), the same global batch at any world size (:func:`hvd_zoadam.bench.group_loss`)."""
    from hvd_zoadam.bench import group_loss
    return group_loss(model, lambda i: _batch(step, i), torch.nn.functional.mse_loss, data_ranks, world_size, rank)


def _die(what: str):
    print(f"chaos: fault {what}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _arm_exchange_kill(opt, step: int, phase: str):
    """Die as this rank starts ``phase`` (``signs``: round 1, ``server``: round 2) of the first
    1-bit exchange at or after ``step``."""
    start = opt.transport.start

    def start_or_die(op: str, tensor: torch.Tensor, name: str, count: bool = True):
        at = opt.schedule_state()["step"] + 1
        if at >= step and name.endswith("." + phase):
            _die(f"kill-exchange at step {at} ({name})")
        return start(op, tensor, name, count)
    opt.transport.start = start_or_die


def _arm_save_fault(kind: str, rank: int, step: int):
    """Make this rank's first checkpoint write at or after ``step`` die halfway (``kill-save``)
    or fail with EFBIG (``disk-full``)."""
    from hvd_zoadam import checkpoint
    save = checkpoint.atomic_save

    def faulty_save(obj: object, path: str):
        head = Path(path).name.split(".")[0]
        saved_at = int(head[1:]) if head[:1] == "s" and head[1:].isdigit() else -1
        if path.endswith(f".rank{rank}.pt") and saved_at >= step:
            if kind == "kill-save":
                with open(f"{path}.killed.tmp", "wb") as f:
                    f.write(b"PK\x03\x04 half a checkpoint")
                _die(f"kill-save at step {saved_at} ({Path(path).name})")
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
            print(f"chaos: fault disk-full at step {saved_at} ({Path(path).name})", flush=True)
        return save(obj, path)
    checkpoint.atomic_save = faulty_save


def _build(args):
    import horovod.torch as hvd

    import hvd_zoadam
    hvd.init()
    model = _model()
    opt = hvd_zoadam.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01),
                                          named_parameters=model.named_parameters(), var_freeze_step=args.freeze,
                                          var_update_scaler=4, local_step_scaler=args.freeze, local_step_clipper=8)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps, eta_min=3e-4)
    return hvd, model, opt, sched


def _resume(args, model, opt, sched) -> int:
    from hvd_zoadam import checkpoint
    if not args.resume:
        return 1
    try:
        extra = checkpoint.load(args.resume, model, opt)
    except checkpoint.CheckpointError as exc:
        print(f"chaos: load failed: {exc}", flush=True)
        sys.exit(LOAD_FAILED)
    sched.load_state_dict(extra["scheduler"])
    return extra["step"] + 1


def _arm(args, opt, rank: int) -> int | None:
    """Arm this rank's fault; returns the step to die before (``kill-between``), else None."""
    kind, step, victim, phase = args.fault.split(":") if args.fault else ("", "0", "-1", "")
    if int(victim) != rank:
        return None
    if kind == "kill-exchange":
        _arm_exchange_kill(opt, int(step), phase)
    elif kind in ("kill-save", "disk-full"):
        _arm_save_fault(kind, rank, int(step))
    return int(step) if kind == "kill-between" else None


def worker(args: argparse.Namespace) -> None:
    """One rank: resume if asked, train to ``--steps``, save every ``--save-every`` steps, and
    write ``final.rank{r}.pt`` (the parameters) at the end."""
    from hvd_zoadam import checkpoint
    torch.set_num_threads(1)
    hvd, model, opt, sched = _build(args)
    rank, ckpt = hvd.rank(), Path(args.dir) / "ckpt"
    first = _resume(args, model, opt, sched)
    die_before = _arm(args, opt, rank)
    for t in range(first, args.steps + 1):
        if t == die_before:
            _die(f"kill-between before step {t}")
        opt.set_iteration(t)
        opt.zero_grad()
        _loss(model, t, rank, hvd.size(), args.data_ranks).backward()
        opt.step()
        sched.step()
        if t % args.save_every == 0:
            checkpoint.save(str(ckpt / f"s{t:07d}"), model, opt, step=t, scheduler=sched.state_dict())
        if rank == 0:
            print(f"chaos: step {t}", flush=True)
    checkpoint.atomic_save([p.detach().clone() for p in model.parameters()],
                           str(Path(args.dir) / f"final.rank{rank}.pt"))
    if rank == 0:
        x, y = _batch(0, 10_000, n=2048)
        with torch.no_grad():
            print(f"chaos: done, validation loss {torch.nn.functional.mse_loss(model(x), y).item():.6f}", flush=True)


# -- the supervisor --------------------------------------------------------------------------

def plan_fault(rng: random.Random, start: int, args: argparse.Namespace, world_size: int) -> dict:
    """One fault: a kind (weighted by :data:`KINDS`), a step in ``start + 1 .. start +
    2·--mean-gap`` (at most ``--steps``), a rank (for a link fault: its host), and the kind's
    details. Pure given ``rng``'s state."""
    kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    step = min(args.steps, start + rng.randint(1, 2 * args.mean_gap))
    fault = {"kind": kind, "step": step, "rank": rng.randrange(world_size)}
    if kind == "kill-exchange":
        fault["phase"] = rng.choice(["signs", "server"])
    elif kind == "link-down":
        fault["seconds"] = round(rng.uniform(0.5, 1.5) * args.timeout, 2)
    elif kind == "link-degraded":
        fault["seconds"] = round(rng.uniform(1.0, 6.0), 2)
    return fault


def plan_attempt(rng: random.Random, start: int, budget: int, args: argparse.Namespace,
                 world_size: int) -> list[dict]:
    """An attempt's faults on ``world_size`` ranks, in step order: link faults (which the job
    may survive) until one that kills a rank or fails a save, at most ``budget`` and at most 4."""
    plan = []
    while len(plan) < min(budget, 4):
        fault = plan_fault(rng, plan[-1]["step"] if plan else start, args, world_size)
        plan.append(fault)
        if not fault["kind"].startswith("link") or fault["step"] >= args.steps:
            break
    return plan


def _saved_world_size(path: str) -> int | None:
    """The world size a per-rank checkpoint file was saved at (a data load), None if unreadable."""
    from hvd_zoadam import checkpoint
    try:
        return checkpoint.read(path).get("rank_state", {}).get("world_size")
    except checkpoint.CheckpointError:
        return None


def latest_complete(ckpt: Path, refused: set) -> tuple[int, str] | None:
    """The newest checkpoint for which the saving job's every rank file exists (each written
    atomically, so whole) and says the same world size as rank 0's, except prefixes in
    ``refused``: ``(step, prefix)``, or None. (A restart at another world size that saves at a
    step again overwrites the files of its ranks only.)"""
    steps = sorted({int(f.name[1:8]) for f in ckpt.glob("s*.rank0.pt")}, reverse=True) if ckpt.exists() else []
    for step in steps:
        prefix = str(ckpt / f"s{step:07d}")
        world = _saved_world_size(f"{prefix}.rank0.pt")
        if prefix not in refused and world and all(
                os.path.exists(f"{prefix}.rank{r}.pt") and _saved_world_size(f"{prefix}.rank{r}.pt") == world
                for r in range(1, world)):
            return step, prefix
    return None


def _worker_cmd(net, args, run_dir: Path, resume: str | None, plan: list, world_size: int) -> list[str]:
    hosts = ",".join(f"{a}:1" for a in net.addresses[:world_size])
    spec = [["--fault", f"{f['kind']}:{f['step']}:{f['rank']}:{f.get('phase', '')}"]
            for f in plan if not f["kind"].startswith("link")]
    return ["mpirun", *net.mpirun_args(), "-H", hosts, "-np", str(world_size),
            "-x", "PATH", "-x", "PYTHONPATH", "-x", "PYTHONUNBUFFERED", "-x", "HVD_ZOADAM_TIMEOUT_S",
            "-x", "NUMBA_NUM_THREADS", "-x", "OMP_NUM_THREADS",
            "-x", "HOROVOD_FUSION_THRESHOLD",
            sys.executable, "-m", "hvd_zoadam.bench.chaos", "--dir", str(run_dir), "--steps", str(args.steps),
            "--save-every", str(args.save_every), "--freeze", str(args.freeze), "--data-ranks", str(args.ranks),
            *(["--resume", resume] if resume else []), *(spec[0] if spec else [])]


def _link(net, fault: dict, down: bool) -> None:
    """Take host ``fault["rank"]``'s link down or up at the bridge (``link-down``), or cut it to
    2 Mbit/s with a 4-packet queue and restore it (``link-degraded``), on both of its ends."""
    k = fault["rank"] + 1
    if fault["kind"] == "link-down":
        subprocess.run(["ip", "-n", net.bridge_ns, "link", "set", f"h{k}", "down" if down else "up"], check=True)
        return
    rate, limit = ((["2mbit", "ceil", "2mbit", "quantum", "1514"], "4") if down
                   else ([net.rate, "ceil", net.rate], "1000"))
    for ns, dev in ((net.namespaces[k - 1], "zeth0"), (net.bridge_ns, f"h{k}")):
        tc = ["ip", "netns", "exec", ns, "tc"]
        subprocess.run([*tc, "class", "change", "dev", dev, "parent", "1:", "classid", "1:10", "htb",
                        "rate", *rate], check=True)
        subprocess.run([*tc, "qdisc", "change", "dev", dev, "parent", "1:10", "handle", "10:", "pfifo",
                        "limit", limit], check=True)


_EVENT = re.compile(r"chaos: (step (\d+)|fault (\S+)|load failed|done, validation loss ([-\d.e]+))")


def _read(proc, state: dict) -> None:
    """The attempt's output: progress, fired faults, a failed load, the end. The ranks' lines
    reach ``mpirun`` separately and may be joined, so events are found anywhere in a line."""
    for line in proc.stdout:
        state["tail"].append(line)
        for event in _EVENT.finditer(line):
            if event.group(2):
                state["step"], state["progress_at"] = int(event.group(2)), time.monotonic()
            elif event.group(3):
                state["fired"].append(event.group(3))
            elif event.group(4):
                state["val_loss"] = float(event.group(4))
            else:
                state["load_failed"] = True


def _inject_links(net, proc, state: dict, faults: list) -> None:
    """Each link fault once rank 0 reports its step, for its ``seconds``, then the link as it
    was (also when the job ends meanwhile). None once a rank's own fault has fired: the job
    is ending, and a fault then would count without doing anything."""
    for fault in faults:
        while proc.poll() is None and state["step"] < fault["step"]:
            time.sleep(0.05)
        if proc.poll() is not None or any(not kind.startswith("link") for kind in state["fired"]):
            return
        _link(net, fault, down=True)
        state["fired"].append(fault["kind"])
        try:
            deadline = time.monotonic() + fault["seconds"]
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            _link(net, fault, down=False)
            state["progress_at"] = time.monotonic()


def _leftovers(run_dir: Path) -> list[int]:
    """Processes of this run's ranks still alive (they carry ``--dir RUN_DIR``), killed."""
    found = subprocess.run(["pgrep", "-f", f"hvd_zoadam.bench.chaos --dir {run_dir} "], capture_output=True,
                           text=True).stdout.split()
    for pid in found:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    return [int(p) for p in found]


def run_attempt(net: Network, args: argparse.Namespace, run_dir: Path, resume: str | None, start: int, plan: list,
                world_size: int) -> dict:
    """One ``mpirun`` of the job from ``resume`` (None: from scratch) with the faults of ``plan``.
    A hang is no progress line for ``--timeout`` + the longest outage + 90 s (launch and JIT
    on a loaded machine), or a rank left alive after ``mpirun`` ended."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", HVD_ZOADAM_TIMEOUT_S=str(args.timeout),
               NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1",
               # Horovod's tensor fusion groups the VARIANCE steps' allreduces by timing, which
               # moves the last bits at P >= 3; one allreduce per tensor is reproducible.
               HOROVOD_FUSION_THRESHOLD="0")
    cmd = ["ip", "netns", "exec", net.namespaces[0], *_worker_cmd(net, args, run_dir, resume, plan, world_size)]
    proc = subprocess.Popen(cmd, env=net.env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    from collections import deque
    state = {"step": start, "progress_at": time.monotonic(), "fired": [], "tail": deque(maxlen=60),
             "load_failed": False, "val_loss": None}
    threads = [threading.Thread(target=_read, args=(proc, state), daemon=True)]
    links = [f for f in plan if f["kind"].startswith("link")]
    if links:
        threads.append(threading.Thread(target=_inject_links, args=(net, proc, state, links), daemon=True))
    for th in threads:
        th.start()
    stall_limit, hang = args.timeout * 2.5 + 90, False
    while proc.poll() is None:
        time.sleep(0.2)
        if time.monotonic() - state["progress_at"] > stall_limit:
            hang = True
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for th in threads:
        th.join(timeout=30)
    left = _leftovers(run_dir)
    return {"rc": proc.returncode, "reached": state["step"], "fired": state["fired"], "hang": hang or bool(left),
            "left": left, "load_failed": state["load_failed"], "val_loss": state["val_loss"],
            "tail": "".join(state["tail"])[-1500:]}


def _supervise(net, args, run_dir: Path, rng: random.Random | None) -> dict:
    """Attempts until the job ends, with faults while fewer than ``--faults`` fired (``rng``
    None: no faults, the uninterrupted run); with ``--resize`` each attempt runs on ``--ranks``
    or one rank fewer, drawn from ``rng``."""
    totals = {"attempts": 0, "restarts": 0, "steps_recomputed": 0, "checkpoints_failed_to_load": 0, "hangs": 0,
              "faults": {kind: 0 for kind in KINDS}, "resized_restarts": 0, "failed_attempts": []}
    refused, reached = set(), None
    while True:
        found = latest_complete(run_dir / "ckpt", refused)
        start, resume = found if found else (0, None)
        if reached is not None:
            totals["steps_recomputed"] += max(0, reached - start)
        world = rng.choice([args.ranks, args.ranks - 1]) if rng is not None and args.resize else args.ranks
        totals["resized_restarts"] += bool(resume) and _saved_world_size(f"{resume}.rank0.pt") != world
        budget = args.faults - sum(totals["faults"].values())
        plan = plan_attempt(rng, start, budget, args, world) if rng is not None and budget > 0 else []
        res = run_attempt(net, args, run_dir, resume, start, plan, world)
        totals["attempts"] += 1
        for kind in res["fired"]:
            totals["faults"][kind] += 1
        totals["hangs"] += res["hang"]
        if res["load_failed"]:
            totals["checkpoints_failed_to_load"] += 1
            refused.add(resume)
        if res["rc"] == 0 and not res["hang"]:
            totals.update(val_loss=res["val_loss"], final_world_size=world)
            return totals
        if rng is None:
            raise RuntimeError(f"chaos: the run without faults failed (rc {res['rc']}):\n{res['tail']}")
        totals["restarts"] += 1
        reached = res["reached"]
        print(f"chaos: attempt {totals['attempts']} from step {start} ended at step {reached} (rc {res['rc']}, "
              f"faults {res['fired'] or 'none'}); {sum(totals['faults'].values())} faults so far", file=sys.stderr)
        if not res["fired"] and not res["load_failed"]:
            totals["failed_attempts"].append({"from": start, "plan": plan, "rc": res["rc"], "tail": res["tail"]})
        if totals["attempts"] > args.faults * 3 + 10:
            raise RuntimeError(f"chaos: the job did not finish in {totals['attempts']} attempts; last output:\n"
                               f"{res['tail']}")


def _finals(run_dir: Path, ranks: int) -> list:
    """Every rank's final parameters (a list of tensors each), a data load."""
    return [torch.load(run_dir / f"final.rank{r}.pt", weights_only=True) for r in range(ranks)]


def run(args: argparse.Namespace) -> dict:
    """The chaos run and the uninterrupted run of the same seed, side by side (JSON)."""
    import tempfile

    from hvd_zoadam.bench.netsim import Network

    def on_term(signum: int, _frame: FrameType | None):  # unwind, so that `with Network(...)` removes its namespaces
        raise SystemExit(128 + signum)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_term)
    t0 = time.perf_counter()
    with Network(args.ranks, args.rate) as net, tempfile.TemporaryDirectory(prefix="zochaos-") as tmp:
        clean = _supervise(net, args, Path(tmp) / "clean", None)
        t1 = time.perf_counter()
        chaos = _supervise(net, args, Path(tmp) / "chaos", random.Random(args.seed))
        a = _finals(Path(tmp) / "chaos", chaos["final_world_size"])
        b = _finals(Path(tmp) / "clean", args.ranks)
        left_tmp = sorted(f.name for f in (Path(tmp) / "chaos" / "ckpt").glob("*.tmp"))
    diff = max(float((x - y).abs().max()) for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    equal = len(a) == len(b) and all(torch.equal(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    return {"bench": "chaos", "seed": args.seed, "ranks": args.ranks, "resize": args.resize, "steps": args.steps,
            "save_every": args.save_every, "rate": args.rate, "timeout_s": args.timeout,
            "faults_injected": sum(chaos["faults"].values()), **chaos,
            "temporary_files_left": len(left_tmp), "bitwise_equal": equal, "max_abs_diff": diff,
            "val_loss_uninterrupted": clean["val_loss"], "val_loss_vs_uninterrupted": chaos["val_loss"] / clean[
                "val_loss"] - 1, "seconds_uninterrupted": t1 - t0, "seconds_chaos": time.perf_counter() - t1}


def add_parser(sub: argparse._SubParsersAction) -> None:
    ap = sub.add_parser("chaos", help="faults at random over a long run, restarts from checkpoints (needs root)")
    ap.add_argument("--ranks", type=int, default=3, help="world size, one rank per simulated host")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--save-every", type=int, default=25, help="checkpoint interval, steps")
    ap.add_argument("--freeze", type=int, default=200, help="var_freeze_step (also local_step_scaler)")
    ap.add_argument("--faults", type=int, default=50, help="inject faults until this many have fired")
    ap.add_argument("--mean-gap", type=int, default=50,
                    help="a fault's step is 1 to 2x this many steps past the previous fault of its attempt "
                         "(the first: past the resume)")
    ap.add_argument("--seed", type=int, default=0, help="the fault injector's seed (replays a run)")
    ap.add_argument("--rate", default="1gbit", help="HTB rate of every link")
    ap.add_argument("--resize", action="store_true",
                    help="each attempt on --ranks or one rank fewer, at random (then the end is compared by its "
                         "validation loss, not bit for bit)")
    ap.add_argument("--timeout", type=float, default=8.0, help="HVD_ZOADAM_TIMEOUT_S, the collective deadline")
    ap.add_argument("--json", default=None)
    ap.set_defaults(run=run)


def main(argv: list[str] | None = None) -> None:
    """The worker's entry point (one rank under ``mpirun``; the supervisor starts it)."""
    ap = argparse.ArgumentParser(prog="python -m hvd_zoadam.bench.chaos")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--save-every", type=int, required=True)
    ap.add_argument("--freeze", type=int, required=True)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--fault", default=None, help="KIND:STEP:RANK:PHASE")
    ap.add_argument("--data-ranks", type=int, required=True, help="the world size the data is split for")
    worker(ap.parse_args(argv))


if __name__ == "__main__":
    main()
