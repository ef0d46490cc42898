"""``python -m hvd_zoadam.bench network``: the systems side by side on simulated hosts over shaped links.

The char LM of examples/train_lm.py (3.24 M parameters) on ``--ranks`` simulated hosts
(:mod:`hvd_zoadam.bench.netsim`: namespaces, HTB-shaped links, no added latency: this kernel
has no netem), one rank per host, launched by ``mpirun`` from the first host with a launch
agent in place of ssh and ``--mca btl tcp,self``. In one invocation it runs, with the same
model, data, seeds and steps: (a) Horovod AdamW fp32, (b) the same with fp16 compression, (c)
hvd_zoadam with the tuned recipe (``zoadam``) or its defaults (``zoadam-defaults``), and the same
0/1 Adam launched by ``torchrun`` (one agent per host, static rendezvous at host 1) through
:mod:`hvd_zoadam.distributed` over a Gloo group (on request also through :mod:`hvd_zoadam.mpi`
over mpi4py alone, ``zoadam-mpi``: no Horovod started), (d) DDP + PowerSGD over gloo, (e) DDP +
post-local SGD (PeriodicModelAverager), (f) compute only (its slowest rank: no collective paces
its ranks, and the slowest one paces a data-parallel job; on request also with Horovod started,
``compute-horovod``, the ceiling of a Horovod job, and held in step by an 8-byte allreduce after
every step, ``compute-lockstep``, the ceiling of any synchronous job: each step waits for the
slower rank), (g) 1-bit Adam, (h) torchft DiLoCo. Ranks run unbound (``--bind-to none``), one
torch/Numba thread each. Per run: steps/s (after the first ``--skip`` steps), bytes each rank
put on its link (the veth's TX counter, so every system is measured alike, TCP/IP headers
included), the run's own counted bytes and rounds where it has them, and the final train
loss. A run that fails is reported with its error, not dropped. Needs root.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from hvd_zoadam.bench import ROOT
from hvd_zoadam.bench import breakdown as _breakdown_mod
from hvd_zoadam.bench.lm import COMPUTE_RUNS

if TYPE_CHECKING:
    from types import FrameType

RUN_LABELS = {
    "adam": "(a) Horovod AdamW fp32",
    "adam-fp16": "(b) Horovod AdamW fp16",
    "zoadam": "(c) hvd_zoadam 0/1 Adam",
    "zoadam-defaults": "(c) 0/1 Adam with its defaults, no knob set",
    "zoadam-torchrun": "(c) 0/1 Adam under torchrun",
    "zoadam-mpi": "(c) 0/1 Adam over mpi4py, no Horovod",
    "ddp-powersgd": "(d) DDP + PowerSGD",
    "ddp-localsgd": "(e) DDP + post-local SGD",
    "compute": "(f) compute only",
    "compute-horovod": "(f) compute only, Horovod started",
    "compute-lockstep": "(f) compute only, ranks in lockstep",
    "onebit": "(g) hvd_zoadam 1-bit Adam",
    "diloco-h8": "(h) torchft DiLoCo, H = 8",
    "diloco-h32": "(h) torchft DiLoCo, H = 32",
}
DEFAULT_RUNS = [run for run in RUN_LABELS if run not in ("compute-horovod", "compute-lockstep", "zoadam-mpi",
                                                         "zoadam-defaults")]


def _tx_bytes(ns: str) -> int:
    out = subprocess.run(["ip", "-n", ns, "-j", "-s", "link", "show", "zeth0"], check=True,
                         capture_output=True, text=True).stdout
    return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])


def _torchrun_on_each_host(net, worker: list, args, env: dict) -> tuple:
    """``torchrun --nnodes N --nproc-per-node 1 --node-rank k`` in each simulated host's
    namespace (static rendezvous at host 1, as ``srun torchrun`` on a cluster). Returns
    ``(exit status, output tail)``: the first non-zero status, or ``"timeout"``."""
    n = len(net.addresses)
    env = net.env(env)
    # The worker's arguments in a file: torchrun's parser would take --run and --master as
    # abbreviations of its own --run-path and --master-addr.
    argfile = Path(worker[worker.index("--out") + 1] + ".args")
    argfile.write_text("\n".join(worker[3:]) + "\n")
    procs = [subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", "--nnodes", str(n),
         "--nproc-per-node", "1", "--node-rank", str(k), "--master-addr", net.addresses[0],
         "--master-port", "29534", "--max-restarts", "0", *worker[1:3], f"@{argfile}"],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for k, ns in enumerate(net.namespaces)]
    deadline, rc, tail = time.monotonic() + args.run_timeout, 0, ""
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            return "timeout", f"no result within {args.run_timeout} s"
        tail += out[-1000:]
        rc = rc or proc.returncode
    return rc, tail


def _network_run(net, run: str, args, workdir: Path) -> dict:
    out = workdir / f"{run}.json"
    hosts = ",".join(f"{a}:1" for a in net.addresses)
    module = "hvd_zoadam.bench.diloco" if run.startswith("diloco") else "hvd_zoadam.bench.lm"
    worker = [sys.executable, "-m", module, "--run", run, "--steps", str(args.steps),
              "--warmup", str(args.warmup), "--skip", str(args.skip), "--master", net.addresses[0],
              "--out", str(out), "--eval-every", str(args.eval_every),
              *(["--breakdown"] if _breaks_down(run, args) else []), *args.model_args]
    # Open MPI's default allreduce choice runs 40% below the line rate at 100 Mbit: pin
    # recursive doubling, so Horovod's baseline is not handicapped.
    cmd = ["mpirun", *net.mpirun_args(), "--mca", "coll_tuned_use_dynamic_rules", "1",
           "--mca", "coll_tuned_allreduce_algorithm", "3", "-H", hosts, "-np", str(len(net.addresses)),
           "-x", "PATH", "-x", "PYTHONPATH", "-x", "HVD_ZOADAM_ROOT", "-x", "PYTHONUNBUFFERED",
           "-x", "GLOO_SOCKET_IFNAME", "-x", "NUMBA_NUM_THREADS", "-x", "OMP_NUM_THREADS",
           *_horovod_env_flags(os.environ), *worker]
    before = [_tx_bytes(ns) for ns in net.namespaces]
    env = dict(os.environ, HVD_ZOADAM_ROOT=str(ROOT), PYTHONPATH=os.environ.get("PYTHONPATH", ""),
               PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="zeth0",  # DDP's gloo: the link, not the hostname
               # One core per rank for every system (torch uses 1 thread): each simulated host has
               # one rank, so hvd_zoadam would otherwise give Numba all cores per rank.
               NUMBA_NUM_THREADS=os.environ.get("NUMBA_NUM_THREADS", "1"), OMP_NUM_THREADS="1")
    start = time.perf_counter()
    if run.endswith("-torchrun"):
        rc, tail = _torchrun_on_each_host(net, worker, args, env)
    else:
        try:
            proc = net.run(cmd, timeout_s=args.run_timeout, env=env, capture_output=True, text=True, cwd=ROOT)
            rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-2000:]
        except subprocess.TimeoutExpired as exc:
            rc, tail = "timeout", f"no result within {args.run_timeout} s: {str(exc.stderr or '')[-1500:]}"
    wall = time.perf_counter() - start
    sent = [_tx_bytes(ns) - b for ns, b in zip(net.namespaces, before)]
    result = {"run": run, "label": RUN_LABELS[run], "wall_s": wall,
              "wire_bytes_sent_per_rank": sum(sent) / len(sent)}
    if rc == 0 and out.exists():
        result.update(json.loads(out.read_text()), ok=True)
        if run in COMPUTE_RUNS:  # the ceiling of a data-parallel job is its slowest rank's speed
            ranks = [json.loads(f.read_text()) for f in sorted(workdir.glob(f"{run}.json.rank*"))
                     if f.suffix[len(".rank"):].isdigit()]
            if ranks:
                result["steps_per_s_by_rank"] = [r["steps_per_s"] for r in ranks]
                for key in ("steps_per_s", "steady_steps_per_s"):
                    if all(r.get(key) for r in ranks):
                        result[key] = min(r[key] for r in ranks)
        if _breaks_down(run, args):
            result["breakdown"] = _breakdown(workdir, run, result.get("world_size", len(net.addresses)), args.skip)
    else:
        result.update(ok=False, error=f"exit {rc}: {tail}")
    return result


def _horovod_env(environ) -> dict:
    """The ``HOROVOD_*`` variables of ``environ`` (e.g. ``HOROVOD_CYCLE_TIME``), by name."""
    return {name: environ[name] for name in sorted(environ) if name.startswith("HOROVOD_")}


def _horovod_env_flags(environ) -> list:
    """``-x NAME`` for each of :func:`_horovod_env`, so that the ranks see them as under
    ``horovodrun``: the simulated hosts' launcher passes no environment."""
    return [flag for name in _horovod_env(environ) for flag in ("-x", name)]


def _breaks_down(run: str, args) -> bool:
    """Whether ``run`` reports a step-time breakdown: with ``--breakdown``, every run of
    :mod:`hvd_zoadam.bench.lm` (DiLoCo's torchft loop has none)."""
    return args.breakdown and not run.startswith("diloco")


def _breakdown(workdir: Path, run: str, world_size: int, skip: int) -> dict:
    """Mean seconds per step of each part, per step kind, over every rank's timed steps (after
    the first ``skip``), with each rank's wait for the last one split out of the wire time
    (:mod:`hvd_zoadam.bench.breakdown`)."""
    ranks = [json.loads((workdir / f"{run}.json.rank{r}.breakdown").read_text()) for r in range(world_size)]
    rows = [row for row in _breakdown_mod.split_waits(ranks) if row["step"] > skip]
    return _breakdown_mod.table(rows, world_size)


CEILINGS = ("compute", "compute-horovod", "compute-lockstep")


def _speed_ratios(out: dict, prefix: str, run: dict, by: dict, others) -> None:
    """``out[f"{prefix}_steps_per_s_vs_{other}"]`` (and ``_steady_``) of ``run`` against each of
    ``others`` that ran."""
    for other in others:
        if other in by:
            out[f"{prefix}_steps_per_s_vs_{other}"] = run["steps_per_s"] / by[other]["steps_per_s"]
            if run.get("steady_steps_per_s") and by[other].get("steady_steps_per_s"):
                out[f"{prefix}_steady_steps_per_s_vs_{other}"] = \
                    run["steady_steps_per_s"] / by[other]["steady_steps_per_s"]


def _ratios(results: list) -> dict:
    by = {r["run"]: r for r in results if r.get("ok")}
    z, m = by.get("zoadam"), by.get("zoadam-mpi")
    out = {}
    if "compute" in by:  # what each ceiling's own cost takes from the bare compute
        for other in CEILINGS[1:]:
            if other in by:
                out[f"{other.replace('-', '_')}_steps_per_s_vs_compute"] = \
                    by[other]["steps_per_s"] / by["compute"]["steps_per_s"]
    if m:  # the same optimizer over mpi4py alone: no Horovod started
        _speed_ratios(out, "zoadam_mpi", m, by, CEILINGS)
    if z:
        _speed_ratios(out, "zoadam", z, by, ("adam", "adam-fp16", "ddp-powersgd", "ddp-localsgd", *CEILINGS))
        if "adam" in by:
            out["zoadam_wire_bytes_vs_adam"] = z["wire_bytes_sent_per_rank"] / by["adam"]["wire_bytes_sent_per_rank"]
        t = by.get("zoadam-torchrun")
        if t:  # the same optimizer over torch.distributed (Gloo) instead of the mpi4py transport
            out["zoadam_torchrun_steps_per_s_vs_zoadam"] = t["steps_per_s"] / z["steps_per_s"]
            out["zoadam_torchrun_wire_bytes_vs_zoadam"] = t["wire_bytes_sent_per_rank"] / z["wire_bytes_sent_per_rank"]
            out["zoadam_torchrun_final_loss_minus_zoadam"] = t["final_loss"] - z["final_loss"]
            out["zoadam_torchrun_val_curve_equal_to_zoadam"] = \
                [v for _, _, v in t["val_curve"]] == [v for _, _, v in z["val_curve"]]
            if "compute" in by:  # no Horovod in either: the ceiling of a torchrun job
                out["zoadam_torchrun_steps_per_s_vs_compute"] = t["steps_per_s"] / by["compute"]["steps_per_s"]
        if m:
            out["zoadam_mpi_steps_per_s_vs_zoadam"] = m["steps_per_s"] / z["steps_per_s"]
            out["zoadam_mpi_val_curve_equal_to_zoadam"] = \
                [v for _, _, v in m["val_curve"]] == [v for _, _, v in z["val_curve"]]
            out["zoadam_mpi_final_loss_equal_to_zoadam"] = m["final_loss"] == z["final_loss"]
        if "onebit" in by:  # the paper's own comparison, over the same steps
            o = by["onebit"]
            out["zoadam_wire_bytes_vs_onebit"] = z["wire_bytes_sent_per_rank"] / o["wire_bytes_sent_per_rank"]
            out["zoadam_rounds_vs_onebit"] = z["rounds"] / o["rounds"]
            out["zoadam_steps_per_s_vs_onebit"] = z["steps_per_s"] / o["steps_per_s"]
    return out


UNSHAPED = "unshaped"  # --rate: the simulated hosts' links with no shaping

TARGETS = [  # (rate, ratio key, target, text)
    ("100mbit", "zoadam_steps_per_s_vs_adam", 2.5, ">= 2.5x (a)'s steps/s"),
    ("100mbit", "zoadam_steps_per_s_vs_adam-fp16", 1.5, ">= 1.5x (b)'s steps/s"),
    ("100mbit", "zoadam_steps_per_s_vs_compute", 0.8, ">= 0.8x the compute-only ceiling"),
    ("1gbit", "zoadam_steps_per_s_vs_compute", 0.9, ">= 0.9x the compute-only ceiling"),
    ("100mbit", "zoadam_wire_bytes_vs_adam", 1 / 20, "<= 1/20 of (a)'s bytes per rank"),
]


def cmd_network(args: argparse.Namespace) -> dict:
    import signal

    from tqdm import tqdm

    from hvd_zoadam.bench.netsim import Network

    def on_term(signum: int, _frame: FrameType | None):  # unwind, so every `with Network(...)` removes its namespaces
        raise SystemExit(128 + signum)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_term)
    runs = args.runs.split(",")
    unknown = [r for r in runs if r not in RUN_LABELS]
    if unknown:
        raise SystemExit(f"--runs: unknown {unknown}; choose from {','.join(RUN_LABELS)}")
    if args.repeat < 1:
        raise SystemExit(f"--repeat: {args.repeat} repetitions; give 1 or more")
    report = {"benchmark": "network", "ranks": args.ranks, "steps": args.steps, "warmup": args.warmup,
              "repeat": args.repeat,
              "skip": args.skip, "model_args": args.model_args, "sysctl": args.sysctl,
              "horovod_env": _horovod_env(os.environ),
              "note": "bandwidth shaped with HTB on both ends of each link (not at all for --rate unshaped); latency "
                      "NOT shaped (no netem in this kernel; base RTT about 0.05 ms). steps/s are over the steps after "
                      "the first --skip.",
              "rates": {}}
    bar = tqdm(total=len(args.rate) * len(runs) * args.repeat, desc="bench network", unit="run", file=sys.stderr)
    for rate in args.rate:
        repeats = []
        sysctls = dict(kv.split("=", 1) for kv in args.sysctl)
        shaped = None if rate == UNSHAPED else rate
        with Network(args.ranks, shaped, sysctls=sysctls) as net, tempfile.TemporaryDirectory() as tmp:
            for i in range(args.repeat):  # A, B, A, B ...: each repetition's runs side by side in time
                workdir = Path(tmp) / f"repeat{i}"
                workdir.mkdir()
                results = []
                for run in runs:
                    bar.set_postfix(rate=rate, run=run, repeat=i + 1)
                    results.append(_network_run(net, run, args, workdir))
                    _write_run(bar, rate, results[-1], f"[{i + 1}/{args.repeat}] " if args.repeat > 1 else "")
                    bar.update()
                repeats.append(results)
        report["rates"][rate] = _rate_report(repeats)
        for key, s in report["rates"][rate].get("spread", {}).items():
            bar.write(f"{rate:>8} {key}: median {s['median']:.3f} (min {s['min']:.3f}, max {s['max']:.3f}, "
                      f"{len(s['values'])} repetitions)", file=sys.stderr)
    bar.close()
    report["targets"] = [
        {"rate": rate, "metric": key, "target": target, "text": text,
         "measured": report["rates"].get(rate, {}).get("ratios", {}).get(key),
         "met": (lambda m: None if m is None else (m <= target if "bytes" in key else m >= target))(
             report["rates"].get(rate, {}).get("ratios", {}).get(key))}
        for rate, key, target, text in TARGETS]
    if args.png:
        _network_png(report, args.png)
        if any(r["time_to_quality"] for r in report["rates"].values()):
            _quality_png(report, str(Path(args.png).with_suffix("")) + ".quality.png")
    return report


def _write_run(bar, rate: str, res: dict, prefix: str) -> None:
    """One run's line (and its breakdown's, if any) on stderr."""
    bar.write(f"{rate:>8} {prefix}{res['label']:<28} " + (
        f"{res['steps_per_s']:.3f} steps/s ({res['steady_steps_per_s'] or 0:.3f} after warm-up), "
        f"{res['wire_bytes_sent_per_rank'] / 2 ** 20:.1f} MiB/rank on "
        f"the wire, loss {res['final_loss']:.3f}" + _cores_text(res.get("cpu_cores"))
        if res["ok"] else f"FAILED: {res['error'][-300:]}"), file=sys.stderr)
    for kind, parts in (res.get("breakdown") or {}).items():
        bar.write(f"{'':>8}   {kind:<10} {parts['steps']:>4} steps, ms/step: " + ", ".join(
            f"{label} {1000 * parts[label]:.1f}" for label in ("wall", *_breakdown_mod.LABELS)) + "".join(
            f"; wire of {op} {1000 * seconds:.1f}" for op, seconds in parts.get("wire_by_op", {}).items()) + "".join(
            f"; {name} {1000 * seconds:.1f}" for name, seconds in parts.get("kernels_by_name", {}).items()
            if seconds >= 5e-5), file=sys.stderr)


def _spread(values: list) -> dict:
    """Median, min, max and the values themselves, in repetition order."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def _rate_report(repeats: list) -> dict:
    """One rate's entry of the report from the results of each repetition (a list of run
    results per repetition, the runs in the same order in each).

    One repetition: ``runs``, ``ratios`` and ``time_to_quality`` of those runs. Several:
    the numeric ``ratios`` are the medians over the repetitions of each repetition's own ratios
    (each paired within its repetition, so a drift of the machine between repetitions cancels;
    the others, e.g. whether two curves are equal, are kept where every repetition agrees),
    ``spread`` gives the median, min, max and values of each ratio, of each run's steps/s
    (``steps_per_s:<run>``) and of its time to quality against Adam's
    (``ttq_speedup_vs_adam:<run>``), ``repeats`` every repetition's ``runs``, ``ratios`` and
    ``time_to_quality``; ``runs`` and ``time_to_quality`` are the first repetition's."""
    each = [{"runs": results, "ratios": _ratios(results), "time_to_quality": _time_to_quality(results)}
            for results in repeats]
    if len(each) == 1:
        return each[0]
    keys = [k for k, v in each[0]["ratios"].items()
            if isinstance(v, float) and all(isinstance(r["ratios"].get(k), float) for r in each)]
    spread = {k: _spread([r["ratios"][k] for r in each]) for k in keys}
    for run in [r["run"] for r in repeats[0]]:
        steps = [res["steps_per_s"] for results in repeats for res in results if res["run"] == run and res["ok"]]
        ttq = [r["time_to_quality"].get("systems", {}).get(run, {}).get("ttq_speedup_vs_adam") for r in each]
        for key, values in ((f"steps_per_s:{run}", steps), (f"ttq_speedup_vs_adam:{run}", ttq)):
            if len(values) == len(each) and all(isinstance(v, float) for v in values):
                spread[key] = _spread(values)
    others = {k: each[0]["ratios"][k] for k in each[0]["ratios"]
              if k not in spread and all(r["ratios"].get(k) == each[0]["ratios"][k] for r in each)}
    return {"runs": each[0]["runs"],
            "ratios": {**others, **{k: s["median"] for k, s in spread.items() if ":" not in k}},
            "time_to_quality": each[0]["time_to_quality"], "spread": spread, "repeats": each}


def _cores_text(cores: dict | None) -> str:
    """Rank 0's cores, training thread and the others (``cpu_cores`` of hvd_zoadam.bench.lm)."""
    if not cores:
        return ""
    return (f", rank 0 used {cores['training_thread']:.2f} + {cores['other_threads']:.2f} cores "
            "(training + other threads)")


def _time_to_quality(results: list) -> dict:
    """Time to quality per system (needs --eval-every and the ``adam`` run): the target L* is the
    validation loss Adam fp32 reaches at its first evaluation at or after 2/3 of the steps; a
    system's TTQ is the wall time (evaluations excluded) of its first evaluation at or below L*."""
    by = {r["run"]: r for r in results if r.get("ok") and r.get("val_curve")}
    if "adam" not in by:
        return {}
    curve = by["adam"]["val_curve"]
    horizon = by["adam"]["steps"]
    target = next(v for step, _, v in curve if step >= 2 * horizon / 3)
    rows = {}
    for run, r in by.items():
        hit = next(((step, wall) for step, wall, v in r["val_curve"] if v <= target), None)
        rows[run] = {"label": r["label"], "ttq_s": hit[1] if hit else None, "ttq_step": hit[0] if hit else None,
                     "reached": hit is not None, "best_val": min(v for _, _, v in r["val_curve"]),
                     "final_val": r["val_curve"][-1][2], "wire_bytes_sent_per_rank": r["wire_bytes_sent_per_rank"],
                     "rounds": r.get("rounds")}
    adam_ttq = rows["adam"]["ttq_s"]
    for row in rows.values():
        row["ttq_speedup_vs_adam"] = adam_ttq / row["ttq_s"] if row["ttq_s"] and adam_ttq else None
    ranking = sorted((run for run in rows if rows[run]["reached"]), key=lambda run: rows[run]["ttq_s"])
    return {"target_val": target, "systems": rows, "ranking": ranking}


def _quality_png(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rates = [rate for rate, block in report["rates"].items() if block["time_to_quality"]]
    fig, axes = plt.subplots(1, len(rates), figsize=(6.5 * len(rates), 4.5), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        block = report["rates"][rate]
        for r in block["runs"]:
            if r.get("ok") and r.get("val_curve"):
                ax.plot([w for _, w, _ in r["val_curve"]], [v for _, _, v in r["val_curve"]], label=r["label"],
                        lw=2.2 if r["run"] == "zoadam" else 1.2)
        ax.axhline(block["time_to_quality"]["target_val"], color="k", ls=":", lw=1, label="L* (Adam at 2/3 T)")
        ax.set_xlabel("wall time, s (evaluations excluded)")
        ax.set_ylabel("validation loss")
        ax.set_title(f"{report['ranks']} ranks, {rate} links")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _network_png(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rates = list(report["rates"])
    fig, axes = plt.subplots(1, len(rates), figsize=(6 * len(rates), 4.5), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        runs = report["rates"][rate]["runs"]
        labels = [r["label"] for r in runs]
        values = [r.get("steps_per_s", 0.0) if r["ok"] else 0.0 for r in runs]
        bars = ax.barh(labels, values, color=["tab:red" if r["run"] == "zoadam" else "tab:gray" for r in runs])
        for b, r in zip(bars, runs):
            text = (f"{r['wire_bytes_sent_per_rank'] / 2 ** 20:.0f} MiB" if r["ok"] else "failed")
            ax.text(b.get_width(), b.get_y() + b.get_height() / 2, " " + text, va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("steps/s (higher is better); label: MiB sent per rank")
        ax.set_title(f"{report['ranks']} ranks, {rate} links, {report['steps']} steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- step ------------------------------------------------------------------------------------


def _parse_rate(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, mult in units.items():
        if rate.lower().endswith(unit):
            return float(rate[:-len(unit)]) * mult
    raise ValueError(f"rate {rate!r}: use e.g. 100mbit or 1gbit")


def add_parser(sub: argparse._SubParsersAction) -> None:
    net = sub.add_parser("network", help="the char LM over shaped links, the systems side by side (needs root)")
    net.add_argument("--rate", action="append", default=None,
                     help="link rate, e.g. 100mbit or 1gbit, or unshaped (the same simulated hosts with no "
                          "limit: what the runs cost without a link rate); repeat for several (default: 100mbit "
                          "and 1gbit)")
    net.add_argument("--ranks", type=int, default=2)
    net.add_argument("--steps", type=int, default=300,
                     help="training steps per system (300: about 55 minutes for both default rates; the "
                          "12-step warm-up's full-precision steps weigh on shorter runs, see the README)")
    net.add_argument("--warmup", type=int, default=12, help="LR warm-up steps; also 0/1 Adam's freeze, PowerSGD's "
                                                            "and post-local SGD's start")
    net.add_argument("--skip", type=int, default=3, help="untimed first steps")
    net.add_argument("--eval-every", type=int, default=0,
                     help="validation loss on one fixed held-out set every k steps (0: never); with the adam "
                          "run the report gives each system's time to Adam's quality at 2/3 of the steps")
    net.add_argument("--runs", default=",".join(DEFAULT_RUNS),
                     help=f"subset of {','.join(RUN_LABELS)} "
                          f"(default: all but compute-horovod, compute-lockstep and zoadam-mpi)")
    net.add_argument("--run-timeout", type=int, default=1200, help="seconds per run")
    net.add_argument("--model-args", nargs=argparse.REMAINDER, default=[],
                     help="extra worker flags, e.g. --n-layer 1 --n-embd 64, or 0/1 Adam's --var-update-scaler 8 "
                          "--local-step-policy steps --local-step-scaler 40 --local-step-clipper 8 (must come last)")
    net.add_argument("--sysctl", action="append", default=[], metavar="KEY=VALUE",
                     help="a sysctl set in every simulated host, e.g. net.ipv4.tcp_slow_start_after_idle=0")
    net.add_argument("--breakdown", action="store_true",
                     help="per step kind, the seconds in forward/backward, the optimizer, the kernels, packing, "
                          "the wire and waiting for the slowest rank (hvd_zoadam.bench.breakdown)")
    net.add_argument("--repeat", type=int, default=1,
                     help="run the systems this many times in turn (A, B, A, B ...) and report each ratio's "
                          "median, min and max over the repetitions (a shared or virtual machine's speed can "
                          "drift by more than the differences measured)")
    net.add_argument("--json", help="also write the report here")
    net.add_argument("--png", help="bar chart of steps/s per system and rate")
    net.set_defaults(run=run)


def run(args: argparse.Namespace) -> dict:
    args.rate = args.rate or ["100mbit", "1gbit"]
    return cmd_network(args)
