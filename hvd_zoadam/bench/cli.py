"""Benchmarks; each prints JSON. ``python -m hvd_zoadam.bench {network,step,model} --help``.

* ``network``: the char LM of examples/train_lm.py (3.24 M parameters) on ``--ranks``
  simulated hosts (:mod:`hvd_zoadam.bench.netsim`: namespaces, HTB-shaped links, no added
  latency: this kernel has no netem), one rank per host, launched by ``mpirun`` from the
  first host with a launch agent in place of ssh and ``--mca btl tcp,self``. In one
  invocation it runs, with the same model, data, seeds and steps: (a) Horovod AdamW fp32,
  (b) the same with fp16 compression, (c) hvd_zoadam, and the same 0/1 Adam launched by
  ``torchrun`` (one agent per host, static rendezvous at host 1) through
  :mod:`hvd_zoadam.distributed` over a Gloo group (on request also through
  :mod:`hvd_zoadam.mpi` over mpi4py alone, ``zoadam-mpi``: no Horovod started), (d) DDP + PowerSGD over gloo,
  (e) DDP + post-local SGD (PeriodicModelAverager), (f) compute only (its slowest rank:
  no collective paces its ranks, and the slowest one paces a data-parallel job; on request
  also with Horovod started, ``compute-horovod``, the ceiling of a Horovod job, and held in
  step by an 8-byte allreduce after every step, ``compute-lockstep``, the ceiling of any
  synchronous job: each step waits for the slower rank). Ranks run
  unbound (``--bind-to none``), one torch/Numba thread each. Per run: steps/s
  (after the first ``--skip`` steps), bytes each rank put on its link (the veth's TX
  counter, so every system is measured alike, TCP/IP headers included), the run's own
  counted bytes and rounds where it has them, and the final train loss. A run that fails
  is reported with its error, not dropped. Needs root.
* ``step``: the optimizer step alone at P = 1 on the char LM's parameters: each
  hvd_zoadam step kind against ``torch.optim.AdamW(foreach=True)``.
* ``convergence``: 0/1 Adam's validation loss at P simulated workers with one factor
  switched off at a time, against AdamW (:mod:`hvd_zoadam.bench.convergence`).
* ``scaling``: Adam against 0/1 Adam, flat and two-level, at P = 2 … 128 simulated workers:
  validation losses, gaps and each rank's bytes by the transport's formulas.
* ``resume``: what a resume at another world size, or from rank 0's file alone, keeps of
  the error feedback (:mod:`hvd_zoadam.bench.resume`).
* ``chaos``: faults at random over a long run under ``mpirun`` on simulated hosts, a
  supervisor restarting from the latest complete checkpoint (:mod:`hvd_zoadam.bench.chaos`).
* ``load``: thousands of small tensors, or 100 M parameters, under ``horovodrun``: bytes
  against the formulas, step time against Horovod's AdamW, ``memory_bytes()`` against RSS
  (:mod:`hvd_zoadam.bench.load`).
* ``model``: an alpha-beta model of step time; validated against a ``network`` JSON
  when given, and projected to BERT-Large on 16–128 workers.
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

from hvd_zoadam.bench import breakdown as _breakdown_mod, chaos as _bench_chaos, convergence as _bench_convergence, \
    load as _bench_load, provenance, resume as _bench_resume, torchrun as _bench_torchrun, ROOT
from hvd_zoadam.bench.lm import COMPUTE_RUNS
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


# -- network ---------------------------------------------------------------------------------

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


def cmd_network(args) -> dict:
    from tqdm import tqdm

    from hvd_zoadam.bench.netsim import Network
    import signal

    def on_term(signum, _frame):  # unwind, so every `with Network(...)` removes its namespaces
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
    return {"runs": each[0]["runs"], "ratios": {**others, **{k: s["median"] for k, s in spread.items() if ":" not in k}},
            "time_to_quality": each[0]["time_to_quality"], "spread": spread, "repeats": each}


def _cores_text(cores: dict | None) -> str:
    """Rank 0's cores, training thread and the others (``cpu_cores`` of hvd_zoadam.bench.lm)."""
    if not cores:
        return ""
    return f", rank 0 used {cores['training_thread']:.2f} + {cores['other_threads']:.2f} cores (training + other threads)"


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

def cmd_step(args) -> dict:
    """The optimizer step alone at P = 1: each hvd_zoadam step kind vs AdamW(foreach=True).

    ``--device cuda`` puts the model on the GPU (times end with a device synchronisation).
    Without Horovod installed (a bare GPU machine) the optimizer gets a one-rank thread
    transport instead: at P = 1 nothing is sent either way.
    """
    import torch

    import hvd_zoadam
    from hvd_zoadam import StepKind
    from hvd_zoadam.comm.thread import ThreadGroup
    lm = __import__("hvd_zoadam.bench.lm", fromlist=["_train_lm"])._train_lm()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    try:
        import horovod.torch as hvd
        hvd.init()
        transport, world = "auto", hvd.size()
    except ImportError:
        transport, world = ThreadGroup(1).transports()[0], 1
    torch.set_num_threads(args.threads)

    def model():
        torch.manual_seed(0)
        m = lm.CharGPT(84, 128, args.n_layer, args.n_embd, 4).to(device)
        for p in m.parameters():
            p.grad = torch.randn_like(p) * 1e-2
        return m

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def timed(step, n):
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        sync()
        return (time.perf_counter() - t0) / n

    m = model()
    adamw = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True)
    for _ in range(3):
        adamw.step()
    bases = []
    out = {"benchmark": "step", "world_size": world, "params": sum(p.numel() for p in m.parameters()),
           "device": device, "threads": args.threads, "kinds": {}}
    if device == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
    # One optimizer per kind, with a schedule that makes every timed step that kind.
    configs = {StepKind.VARIANCE: dict(var_freeze_step=10 ** 9, var_update_scaler=10 ** 9),
               StepKind.COMPRESSED: dict(var_freeze_step=10 ** 9, var_update_scaler=1),
               StepKind.LOCAL: dict(var_freeze_step=1, local_step_policy="steps", local_step_scaler=1, local_step_clipper=1 << 20),
               StepKind.SYNC: dict(var_freeze_step=1)}
    for kind, cfg in configs.items():
        m = model()
        opt = hvd_zoadam.DistributedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3),
                                              named_parameters=m.named_parameters(), transport=transport, **cfg)
        for _ in range(4):
            opt.step()
        seen = opt._next_kind()[1]
        # AdamW and the kind alternate, so that a change in the machine's load hits both alike
        pairs = [(timed(adamw.step, args.iters), timed(opt.step, args.iters)) for _ in range(args.repeats)]
        base, t = min(b for b, _ in pairs), min(k for _, k in pairs)
        bases.append(base)
        out["kinds"][kind.value] = {"ms": t * 1e3, "adamw_foreach_ms": base * 1e3, "vs_adamw_foreach": t / base,
                                    "measured_kind": seen.value, "breakdown_ms": _step_breakdown(opt, args.iters, sync)}
    out["adamw_foreach_ms"] = min(bases) * 1e3
    out["target"] = "each kind <= 1.3x AdamW(foreach=True), timed alternately with it"
    out["met"] = all(k["vs_adamw_foreach"] <= 1.3 for k in out["kinds"].values())
    return out


def _step_breakdown(opt, iters: int, sync) -> dict:
    """ms per ``opt.step()`` in the optimizer's own work, the kernels, packing and the transport,
    over ``iters`` more steps timed with :class:`~hvd_zoadam.bench.breakdown.Breakdown` (after
    the alternating timing, so that its wrappers cost that timing nothing). On CUDA a kernel's
    time is its launch; ``sync()`` closes each step."""
    bd = _breakdown_mod.Breakdown().install(opt.transport)
    try:
        for i in range(iters):
            bd.begin_step(i + 1)
            with bd.region("optimizer"):
                opt.step()
                sync()
            bd.end_step("step")
    finally:
        bd.uninstall()
    parts = _breakdown_mod.table(_breakdown_mod.split_waits([bd.to_json()]), 1)["step"]
    return {label: 1e3 * parts[label] for label in ("wall", "optimizer", "kernels", "packing", "wire")}


# -- kernels ---------------------------------------------------------------------------------

KERNEL_TARGETS = {"cpu": {"worker_compress": 0.5, "decompress_momentum": 0.5},
                  "cuda": {k: 0.6 for k in ("worker_compress", "server_reduce", "decompress",
                                            "decompress_momentum", "decompress_sync")}}


def cmd_kernels(args) -> dict:
    """The compressor kernels at ``--numel`` elements against the copy bandwidth of the same run.

    GB/s counts each kernel's main input: the bytes of y for worker_compress (``--dtype``),
    of the chunk's float32 server error for server_reduce, of the float32 output / momentum
    for the unpacking kernels. ``traffic_vs_copy`` instead counts every byte a kernel must
    read and write (e.g. 20 per element for decompress_sync) against the copy's 8: 1.0 is
    memory speed, whatever the kernel's inputs. The reference is a ``copy_`` of the float32 buffer into a
    preallocated one (device to device on CUDA), timed alternately with each kernel; each
    ratio is best kernel time against best copy time over ``--repeats`` pairs after a
    warm-up. CUDA: events on the current stream; CPU: ``perf_counter``.
    The kernels' targets at 2^24 float32 elements: CPU (one thread) worker_compress and
    decompress_momentum >= 0.5x copy; GPU every kernel >= 0.6x.
    """
    import numba
    import torch

    from hvd_zoadam import native
    from hvd_zoadam.core.layout import padded_numel
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    if args.params < 1:
        raise SystemExit(f"--params must be at least 1, got {args.params}")
    if args.threads:
        numba.set_num_threads(args.threads)
    torch.set_num_threads(numba.get_num_threads())
    n, p = args.numel, args.world_size
    big = padded_numel(n, p)
    offsets = list(range(0, n, args.block)) + [n]
    plan = native.Plan(offsets, big, p, 0)
    nseg = len(offsets) - 1
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[args.dtype]
    gen = torch.Generator().manual_seed(0)
    z = lambda *shape: torch.zeros(*shape, device=device)  # noqa: E731
    y = torch.randn(big, generator=gen).to(device=device, dtype=dtype)
    y[n:] = 0
    err = z(big)
    scales = z(nseg)
    packed = torch.randint(0, 256, (big // 8,), generator=gen, dtype=torch.uint8).to(device)
    recv = torch.randint(0, 256, (p, big // p // 8), generator=gen, dtype=torch.uint8).to(device)
    wscales = torch.rand(p, nseg, generator=gen).to(device)
    serr = z(big // p)
    spacked = torch.zeros(big // p // 8, dtype=torch.uint8, device=device)
    sscales = z(nseg)
    out, m, anchor, param = z(n), z(n), z(n), z(n)
    denom = torch.rand(n, generator=gen).to(device) + 1e-3
    cuts = sorted({min(n, round(i * nseg / args.params) * args.block) for i in range(args.params + 1)})
    sizes = [b - a for a, b in zip(cuts, cuts[1:])]            # parameters start at scale-block boundaries
    params = list(z(n).split(sizes))
    src = torch.randn(big, generator=gen).to(device)
    dst = torch.empty_like(src)  # the bandwidth reference: src -> dst, float32, the bucket's size

    def timed(fn) -> float:
        if device == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            return start.elapsed_time(stop) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def copy():
        dst.copy_(src)

    # name: (call, bytes counted as its input, bytes it must read and write at least)
    c = big // p
    kernels = {
        "worker_compress": (lambda: native.worker_compress(y, err, plan, scales, packed), y.element_size() * big,
                            (y.element_size() + 8) * big + big // 8),         # y, e in; e out; bits
        "server_reduce": (lambda: native.server_reduce(recv, wscales, serr, plan, spacked, sscales), 4 * c,
                          p * c // 8 + 8 * c + c // 8),                       # P chunks of bits; e_s in/out; bits
        "decompress": (lambda: native.decompress(packed, wscales, plan, out), 4 * n, big // 8 + 4 * n),
        "decompress_momentum": (lambda: native.decompress_momentum(packed, wscales, plan, m, 0.9), 4 * n,
                                big // 8 + 8 * n),                            # bits; m in and out
        "decompress_sync": (lambda: native.decompress_sync(packed, wscales, plan, anchor=anchor, param=param,
                                                           exp_avg=m, denom=denom, factor=0.5), 4 * n,
                            big // 8 + 20 * n),                               # bits, x_a, s in; x, m, x_a out
        # a SYNC step's rebuild of --params parameters: straight into them (float32 on the CPU),
        # or into the flat x and then copied into them (the path of fp16 parameters and CUDA)
        "decompress_sync_params": (lambda: native.decompress_sync(packed, wscales, plan, anchor=anchor,
                                                                  param=params, exp_avg=m, denom=denom, factor=0.5),
                                   4 * n, big // 8 + 20 * n),
        # the same with the window's weight decay (AdamW): the anchor scaled inside the same pass
        # (the bytes the kernel needs; on CUDA the parameters go through a flat x, as in
        # decompress_sync_params)
        "decompress_sync_decay": (lambda: native.decompress_sync(packed, wscales, plan, anchor=anchor, param=params,
                                                                 exp_avg=m, denom=denom, factor=0.5,
                                                                 decay_product=0.9999),
                                  4 * n, big // 8 + 20 * n),
        "decompress_sync_scatter": (lambda: (native.decompress_sync(packed, wscales, plan, anchor=anchor, param=param,
                                                                    exp_avg=m, denom=denom, factor=0.5),
                                             torch._foreach_copy_(params, list(param.split(sizes)))),
                                    4 * n, big // 8 + 28 * n),                # and x read, the parameters written
    }
    res = {"benchmark": "kernels", "device": device, "numel": n, "dtype": args.dtype, "world_size": p,
           "scale_block_numel": args.block, "threads": numba.get_num_threads() if device == "cpu" else None,
           "kernels": {}}
    if device == "cuda":
        res["gpu"] = torch.cuda.get_device_name()
    targets = KERNEL_TARGETS[device]
    copies = []
    for name, (fn, nbytes, traffic) in kernels.items():
        # the copy and the kernel alternate, so that a change in the machine's load hits both alike
        copy(), fn()
        pairs = [(timed(copy), timed(fn)) for _ in range(args.repeats)]
        copy_gbs = 4 * big / min(c for c, _ in pairs) / 1e9
        t = min(k for _, k in pairs)
        copies.append(copy_gbs)
        ratio = nbytes / t / 1e9 / copy_gbs
        res["kernels"][name] = {"ms": t * 1e3, "GBps": nbytes / t / 1e9, "copy_GBps": copy_gbs, "vs_copy": ratio,
                                # memory speed: bytes read and written per second against the copy's 8 per element
                                "traffic_vs_copy": traffic / t / (2 * copy_gbs * 1e9)}
        if name in targets:
            res["kernels"][name].update(target_vs_copy=targets[name], met=ratio >= targets[name])
    res["copy_GBps"] = max(copies)
    res["note"] = ("worker_compress is the whole worker side (scales, signs, error; in one pass over memory, "
                   "on the CPU and on CUDA, when every scale block has at most 4096 elements, as here) with the scales left on "
                   "the device; targets hold at 2^24 float32 elements" + ("" if device == "cuda" else ", one thread"))
    return res


# -- model -----------------------------------------------------------------------------------

def exchange_node_bytes(system: str, *, n: float, p: int, ranks_per_node: int = 1,
                        scale_block_numel: int | None = None) -> float:
    """Bytes one node sends to other nodes in one 1-bit exchange of n elements (algorithm.md §3).

    ``"zoadam"`` (the flat exchange): each of the node's L ranks sends 2(P−1)/P of its
    n/8 + 4n/block bytes, of which (P−L)/(P−1) go to ranks of other nodes. ``"zoadam-2level"``:
    each local rank sends what one rank of a flat exchange at world size N = P/L sends, for its
    shard of n/L elements. ``"1bit-adam"``: the flat exchange with scales per tensor.
    """
    per_element = 1 / 8 + (4 / scale_block_numel if scale_block_numel and system != "1bit-adam" else 0.0)
    local = ranks_per_node
    if system == "zoadam-2level":
        nodes = p // local
        return local * 2 * (nodes - 1) / nodes * n / local * per_element
    return local * 2 * (p - local) / p * n * per_element


def step_time(system: str, *, n: float, p: int, bandwidth_bps: float, latency_s: float, compute_s: float,
              frac: dict | None = None, width_bytes: int = 4, scale_block_numel: int | None = None,
              ranks_per_node: int = 1, intra_bandwidth_bps: float = 1.2e12, intra_latency_s: float = 2e-6) -> float:
    """Alpha-beta step time in seconds for one training step averaged over a run.

    n: parameters; p: workers, ``ranks_per_node`` L per node; bandwidth_bps: each node's link
    to the others, bits/s per direction; latency_s: alpha per message round; compute_s:
    forward + backward + optimizer per step. Collectives use the bandwidth-optimal ring/pairwise
    forms, and a node's link carries what its ranks send to other nodes: an allreduce of B
    bytes (a ring through the nodes) costs 2(p−1)·alpha + 2(p−1)/p·B/beta; the flat 1-bit
    exchange (algorithm.md §3) costs 2 rounds and :func:`exchange_node_bytes` over beta,
    ~2(p−1)/p·n/8 bytes at L = 1 and L times that per node at large p; the two-level exchange
    (``"zoadam-2level"``, algorithm.md §3 "Two levels") 2(p/L − 1) rounds between nodes for
    about L times fewer bytes per node, plus 8(L−1)/L·n bytes of fp32 per rank inside the node
    at ``intra_bandwidth_bps`` (default 1.2 Tbit/s, NVLink-class) with 2(L − 1) rounds of
    ``intra_latency_s``. ``frac``: share of steps of each kind (variance, compressed, local,
    sync); systems: "adam" (fp32), "adam-fp16", "1bit-adam", "zoadam", "zoadam-2level" (no
    overlap of communication with compute is assumed).

    ``scale_block_numel`` (0/1 Adam): one float32 scale per block of that many elements; each
    scale travels only to the server of its chunk and back, 2(p−1)/p·4·n/scale_block_numel
    bytes per rank, 32/block of the bits at any p. None: scales per tensor, negligible (as
    for 1-bit Adam).
    """
    beta = bandwidth_bps / 8.0
    full = lambda w: 2 * (p - 1) * latency_s + 2 * (p - 1) / p * w * n / beta  # noqa: E731
    if p == 1:
        return compute_s
    if system == "adam":
        return compute_s + full(4)
    if system == "adam-fp16":
        return compute_s + full(2)
    frac = frac or {}
    kw = dict(n=n, p=p, ranks_per_node=ranks_per_node, scale_block_numel=scale_block_numel)
    if system == "1bit-adam":
        warm = frac.get("variance", 0.15)
        onebit = 2 * (p - 1) * latency_s + exchange_node_bytes("1bit-adam", **kw) / beta
        return compute_s + warm * full(4) + (1 - warm) * onebit
    if system == "zoadam":
        onebit = 2 * (p - 1) * latency_s + exchange_node_bytes("zoadam", **kw) / beta
    elif system == "zoadam-2level":
        local, nodes = ranks_per_node, p // ranks_per_node
        onebit = (2 * (nodes - 1) * latency_s + exchange_node_bytes("zoadam-2level", **kw) / beta
                  + 2 * (local - 1) * intra_latency_s + 8 * (local - 1) / local * n / (intra_bandwidth_bps / 8))
    else:
        raise ValueError(f"unknown system {system!r}")
    return compute_s + frac.get("variance", 0.0) * full(4) + (frac.get("compressed", 0.0)
                                                              + frac.get("sync", 0.0)) * onebit


def _node_bytes_per_step(system: str, frac: dict, *, n: float, p: int, ranks_per_node: int, block,
                         warm_1bit: float) -> float:
    """Bytes a node sends to other nodes per step, averaged over the run (fp16 for Adam)."""
    ring = lambda w: 2 * (p - 1) / p * w * n  # noqa: E731  (a ring's traffic through each node)
    kw = dict(n=n, p=p, ranks_per_node=ranks_per_node, scale_block_numel=block)
    if system == "adam-fp16":
        return ring(2)
    if system == "1bit-adam":
        return warm_1bit * ring(4) + (1 - warm_1bit) * exchange_node_bytes("1bit-adam", **kw)
    return frac["variance"] * ring(4) + (frac["compressed"] + frac["sync"]) * exchange_node_bytes(system, **kw)


def cmd_model(args) -> dict:
    out = {"benchmark": "model", "formula": step_time.__doc__.strip().split("\n\n")[1].strip()}
    if args.measured:
        rep = json.loads(Path(args.measured).read_text())
        checks = []
        for rate, block in rep["rates"].items():
            runs = {r["run"]: r for r in block["runs"] if r.get("ok")}
            if "compute" not in runs or rate == UNSHAPED:  # no link rate to model
                continue
            bps = _parse_rate(rate)
            n, p = runs["compute"]["params"], rep["ranks"]
            compute_s = 1.0 / runs["compute"]["steps_per_s"]
            for run, system in (("adam", "adam"), ("adam-fp16", "adam-fp16"), ("zoadam", "zoadam")):
                if run not in runs:
                    continue
                frac = None
                if run == "zoadam":
                    kinds = runs[run]["kinds"]
                    total = sum(kinds.values())
                    frac = {k: v / total for k, v in kinds.items()}
                pred = 1.0 / step_time(system, n=n, p=p, bandwidth_bps=bps, latency_s=args.latency,
                                       compute_s=compute_s, frac=frac, scale_block_numel=args.measured_scale_block)
                checks.append({"rate": rate, "run": run, "predicted_steps_per_s": pred,
                               "measured_steps_per_s": runs[run]["steps_per_s"],
                               "error": pred / runs[run]["steps_per_s"] - 1})
        out["validation"] = checks
    # BERT-Large projection (paper §5's setting, in this model's terms), L ranks per node.
    n, local = 340e6, args.ranks_per_node
    frac_zo = {"variance": args.zo_variance_frac, "compressed": args.zo_compressed_frac,
               "sync": args.zo_sync_frac, "local": 1 - args.zo_variance_frac - args.zo_compressed_frac - args.zo_sync_frac}
    proj = []
    for gbit in (10, 40, 100):
        for p in (16, 32, 64, 128, 256, 512, 1024):
            row = {"gbit_per_s": gbit, "workers": p, "nodes": p // local}
            for system in ("adam-fp16", "1bit-adam", "zoadam", "zoadam-2level"):
                row[system + "_s"] = step_time(system, n=n, p=p, bandwidth_bps=gbit * 1e9, latency_s=args.latency_bert,
                                               compute_s=args.bert_compute_s, frac=frac_zo, width_bytes=2,
                                               scale_block_numel=args.scale_block_numel, ranks_per_node=local,
                                               intra_bandwidth_bps=args.intra_gbit * 1e9)
                row[system + "_node_MB_per_step"] = _node_bytes_per_step(
                    system, frac_zo, n=n, p=p, ranks_per_node=local, block=args.scale_block_numel,
                    warm_1bit=0.15) / 1e6
            row["zoadam_speedup_vs_adam_fp16"] = row["adam-fp16_s"] / row["zoadam_s"]
            row["zoadam_speedup_vs_1bit_adam"] = row["1bit-adam_s"] / row["zoadam_s"]
            row["zoadam_2level_speedup_vs_flat"] = row["zoadam_s"] / row["zoadam-2level_s"]
            row["zoadam_2level_speedup_vs_adam_fp16"] = row["adam-fp16_s"] / row["zoadam-2level_s"]
            proj.append(row)
    out["bert_large"] = {"params": n, "compute_s_per_step": args.bert_compute_s, "latency_s": args.latency_bert,
                         "ranks_per_node": local, "intra_node_gbit_per_s": args.intra_gbit,
                         "zoadam_scale_block_numel": args.scale_block_numel,
                         "zoadam_step_fractions": frac_zo, "1bit_adam_warmup_fraction": 0.15, "rows": proj}
    return out


def _parse_rate(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, mult in units.items():
        if rate.lower().endswith(unit):
            return float(rate[:-len(unit)]) * mult
    raise ValueError(f"rate {rate!r}: use e.g. 100mbit or 1gbit")


# -- CLI -------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hvd_zoadam.bench", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
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
    net.add_argument("--runs", default=",".join(DEFAULT_RUNS), help=f"subset of {','.join(RUN_LABELS)} "
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
    st = sub.add_parser("step", help="the optimizer step alone at P = 1 vs AdamW(foreach=True)")
    st.add_argument("--n-layer", type=int, default=4)
    st.add_argument("--n-embd", type=int, default=256)
    st.add_argument("--threads", type=int, default=1)
    st.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    st.add_argument("--iters", type=int, default=10)
    st.add_argument("--repeats", type=int, default=5)
    st.add_argument("--json")
    st.add_argument("--count", action="store_true",
                    help="count, per step kind, the numba launches, torch ops, collectives, host syncs, allocations "
                         "and bytes moved per parameter of one step (hvd_zoadam.bench.count), instead of timing")
    st.add_argument("--path", choices=["cpu", "cuda-sim"], default="cpu",
                    help="with --count: the CPU path, or the CUDA path under numba's CUDA simulator")
    st.add_argument("--world-size", type=int, default=2, help="with --count: thread ranks")
    ke = sub.add_parser("kernels", help="the 1-bit compressor kernels against copy bandwidth")
    ke.add_argument("--numel", type=int, default=1 << 24)
    ke.add_argument("--threads", type=int, default=1)
    ke.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ke.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                    help="dtype of the compressor input y")
    ke.add_argument("--world-size", type=int, default=2)
    ke.add_argument("--block", type=int, default=2048, help="elements per scale")
    ke.add_argument("--repeats", type=int, default=5)
    ke.add_argument("--params", type=int, default=54,
                    help="parameters the SYNC rebuild writes into (decompress_sync_params / _scatter): the "
                         "bench network model's 54")
    ke.add_argument("--json")
    mo = sub.add_parser("model", help="alpha-beta step-time model: validation and BERT-Large projection")
    mo.add_argument("--measured", help="a `bench network` JSON to validate against")
    mo.add_argument("--latency", type=float, default=1e-4, help="alpha on the simulated links, seconds")
    mo.add_argument("--latency-bert", type=float, default=5e-6, help="alpha on the projected cluster, seconds")
    mo.add_argument("--bert-compute-s", type=float, default=0.15,
                    help="BERT-Large compute per step and GPU, seconds (assumption; see docs/performance.md)")
    mo.add_argument("--scale-block-numel", type=int, default=2048,
                    help="0/1 Adam's elements per 1-bit scale in the projection (0: per tensor)")
    mo.add_argument("--measured-scale-block", type=int, default=256,
                    help="the same for the measured run (the bench's zoadam run uses 256)")
    mo.add_argument("--zo-variance-frac", type=float, default=0.002)
    mo.add_argument("--zo-compressed-frac", type=float, default=0.01)
    mo.add_argument("--zo-sync-frac", type=float, default=0.10)
    mo.add_argument("--ranks-per-node", type=int, default=8, help="GPUs per node of the projected cluster")
    mo.add_argument("--intra-gbit", type=float, default=1200.0,
                    help="bandwidth per rank inside a node of the projected cluster, Gbit/s (NVLink-class)")
    mo.add_argument("--json")
    _bench_convergence.add_parser(sub)
    _bench_resume.add_parser(sub)
    _bench_load.add_parser(sub)
    _bench_chaos.add_parser(sub)
    _bench_torchrun.add_parser(sub)
    args = ap.parse_args(argv)
    if args.cmd == "network":
        args.rate = args.rate or ["100mbit", "1gbit"]
        report = cmd_network(args)
    elif args.cmd == "step" and args.count:
        from hvd_zoadam.bench import count as _bench_count
        report = _bench_count.run(args)
    elif args.cmd == "step":
        report = cmd_step(args)
    elif args.cmd == "kernels":
        report = cmd_kernels(args)
    elif args.cmd == "convergence":
        from hvd_zoadam.bench.lm import example_module
        try:
            report = _bench_convergence.run(args, example_module)
        except _bench_convergence.BaselineError as exc:
            print(f"{ap.prog} convergence: error: {exc}", file=sys.stderr)
            return 2
    elif args.cmd == "scaling":
        from hvd_zoadam.bench.lm import example_module
        report = _bench_convergence.run_scaling(args, example_module)
    elif args.cmd == "load":
        report = _bench_load.run(args)
        if report is None:  # not rank 0
            return 0
    elif args.cmd == "chaos":
        report = _bench_chaos.run(args)
    elif args.cmd == "torchrun":
        report = _bench_torchrun.run(args)
    elif args.cmd == "resume":
        from hvd_zoadam.bench.lm import _train_lm
        report = _bench_resume.run(args, _train_lm() if args.case == "lm" else None)
    else:
        report = cmd_model(args)
    text = json.dumps({**report, "provenance": provenance(argv)}, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
