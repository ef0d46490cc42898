"""``python -m hvd_zoadam.bench torchrun``: 0/1 Adam against DistributedDataParallel + AdamW under
``torchrun``, on an ordinary user's script (``examples/train_torchrun.py``), in one invocation::

    python -m hvd_zoadam.bench torchrun --nproc-per-node 2 --steps 400 --repeat 2

Runs the script with ``--optimizer ddp`` and ``--optimizer zoadam`` (the README's one-line
change, no knob set) in turn, ``--repeat`` times (A, B, A, B, ...: a shared machine's speed
drifts), each under ``torchrun --standalone`` with the environment as it is (no
``NUMBA_NUM_THREADS`` is set for it). Reports each run's JSON line, and per repetition 0/1
Adam's wall time and final validation loss against DDP's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from hvd_zoadam.bench import ROOT

if TYPE_CHECKING:
    import argparse

SCRIPT = ROOT / "examples" / "train_torchrun.py"


def add_parser(sub: argparse._SubParsersAction) -> None:
    ap = sub.add_parser("torchrun", help="0/1 Adam against DDP + AdamW under torchrun on a user's script")
    ap.add_argument("--nproc-per-node", type=int, default=2)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--repeat", type=int, default=1, help="run the pair this many times in turn")
    ap.add_argument("--run-timeout", type=int, default=1800, help="seconds per run")
    ap.add_argument("--script-args", nargs="*", default=[], help="more arguments for the script (must come last)")
    ap.add_argument("--json", help="also write the report here")
    ap.set_defaults(run=run)


def run_once(optimizer: str, args: argparse.Namespace) -> dict:
    """One torchrun job of the script; its rank 0's JSON line, with the job's own wall time."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(args.nproc_per_node), str(SCRIPT), "--optimizer", optimizer, "--steps", str(args.steps),
           *args.script_args]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.run_timeout,
                          env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
    return {**json.loads(line), "job_s": round(time.perf_counter() - start, 2)}


def run(args: argparse.Namespace) -> dict:
    if not SCRIPT.exists():
        raise FileNotFoundError(f"{SCRIPT} not found: bench torchrun runs the checkout's examples/train_torchrun.py")
    runs, ratios = [], []
    for _ in range(args.repeat):
        ddp, zoadam = run_once("ddp", args), run_once("zoadam", args)
        runs += [ddp, zoadam]
        ratios.append({"wall_vs_ddp": round(zoadam["wall_s"] / ddp["wall_s"], 3),
                       "val_loss_vs_ddp": f"{100 * (zoadam['final_val_loss'] / ddp['final_val_loss'] - 1):+.2f} %",
                       "bytes_vs_adam": zoadam.get("bytes_vs_adam")})
    return {"nproc_per_node": args.nproc_per_node, "steps": args.steps, "runs": runs, "ratios": ratios}
