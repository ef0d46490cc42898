"""``python -m hvd_zoadam.bench <command>``: the benchmarks, each a module that registers its
subcommand (``add_parser(sub)``, which sets ``run(args) -> report``) and prints one JSON report
with its provenance (``--json PATH`` also writes it).

* ``network`` (:mod:`.network`): the systems side by side on simulated hosts over shaped links.
* ``step`` (:mod:`.step`): the optimizer step alone at P = 1 against AdamW(foreach=True); with
  ``--count``, what each step kind launches (:mod:`.count`).
* ``kernels`` (:mod:`.kernels`): the compressor kernels against copy bandwidth.
* ``model`` (:mod:`.model`): an alpha-beta model of step time, validated and projected.
* ``convergence``, ``scaling`` (:mod:`.convergence`): quality at P simulated workers.
* ``sweep`` (:mod:`.sweep`): the library's defaults against Adam over random set-ups and seeds.
* ``resume`` (:mod:`.resume`), ``chaos`` (:mod:`.chaos`), ``load`` (:mod:`.load`),
  ``torchrun`` (:mod:`.torchrun`): resumes, faults, large layouts, a torchrun user's script.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hvd_zoadam.bench import (
    chaos,
    convergence,
    kernels,
    load,
    model,
    network,
    provenance,
    resume,
    step,
    sweep,
    torchrun,
)

COMMANDS = (network, step, kernels, model, convergence, sweep, resume, load, chaos, torchrun)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hvd_zoadam.bench", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    args = ap.parse_args(argv)
    try:
        report = args.run(args)
    except (convergence.BaselineError, sweep.SweepError) as exc:
        print(f"{ap.prog} {args.cmd}: error: {exc}", file=sys.stderr)
        return 2
    if report is None:  # a rank that does not report (bench load: only rank 0)
        return 0
    text = json.dumps({**report, "provenance": provenance(argv)}, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
