"""``python -m hvd_zoadam.bench sweep``: 0/1 Adam with the library's defaults against Adam over
training set-ups drawn at random, each over several seeds.

Set-up i of a sweep is drawn from :data:`SPACE` by a generator seeded with (``--space-seed``,
i), so the first k set-ups of any sweep with the same space seed are the same: a sweep at
P = 32 over ``--setups 12`` reruns the first 12 of a P = 8 sweep. Each (set-up, seed) trains
Adam (AdamW on the exact average, or Adam with L2) and 0/1 Adam as ``DistributedOptimizer(opt,
named_parameters)`` with no knob decides it at P ranks (``bench convergence --library-defaults``)
on P simulated workers in one process (the batched oracle). The seed sets the model's
initialisation and every rank's batches (and, for ``digits``, the train/validation split, as
examples/train_digits.py); Adam and 0/1 Adam of one seed start from the same weights and draw
the same batches.

Resumable: with ``--json`` the report is rewritten after every run, and a sweep started again
with the same ``--json`` and the same space, seed count and P keeps the runs it finds there
and trains only the rest (it refuses a file whose settings differ, naming them). The report
holds every run's row (``runs``), a summary per set-up (``setups``) and the pass rate
(``summary``, see :func:`summarise`); ``--png`` draws the gap of each set-up with its seeds.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
from pathlib import Path

from hvd_zoadam.bench import convergence
from hvd_zoadam.bench.workloads import build

WORKLOADS = ("lm", "gru", "digits", "mlp")
BETA2 = (0.95, 0.98, 0.99, 0.995, 0.999)
LR_SCHEDULES = ("constant", "cosine", "step")
SPACE = {
    "workload": f"uniform over {WORKLOADS}",
    "lr": "log-uniform 3e-4 .. 1e-2 (the peak)",
    "beta2": f"uniform over {BETA2}",
    "steps": "log-uniform integer 150 .. 2000",
    "warmup": "uniform 0 .. 20 % of the steps (linear from lr/warmup)",
    "lr_schedule": f"uniform over {LR_SCHEDULES}: cosine to 0.1 of the peak at the last step; step: x0.3 at 1/2 "
                   "and again at 3/4 of the steps after the warm-up",
    "weight_decay": "uniform 0 .. 0.1",
    "weight_decay_style": "decoupled (AdamW's, matrices only) or l2 (Adam's, every parameter), even odds",
    "batch_size": "log-uniform integer 4 .. 64 per rank",
}
# Each workload's model, sized so that a P = 8 sweep of 24 set-ups x 3 seeds takes about two hours
# of a 2-core machine: the char LM (1 layer of 48, 4 heads, windows of 32), the char GRU (1 layer
# of 32, windows of 8), the digits CNN of examples/train_digits.py, the teacher MLP (width 64).
MODELS = {"lm": dict(n_layer=1, n_embd=48, n_head=4, block_size=32, eval_batches=4),
          "gru": dict(n_layer=1, n_embd=32, n_head=1, block_size=8, eval_batches=4),
          "digits": dict(n_layer=1, n_embd=0, n_head=1, block_size=1, eval_batches=1),
          "mlp": dict(n_layer=1, n_embd=64, n_head=1, block_size=1, eval_batches=1)}
VARIANTS = ("adam", "zoadam")
GOAL = {"gap": 0.01, "worst": 0.02, "bytes_long": 0.15, "long_steps": 1000, "pass_rate": 0.9}


class SweepError(ValueError):
    """A ``--json`` that is not this sweep's report (other settings), or bad arguments."""


def draw(space_seed: int, index: int) -> dict:
    """Set-up ``index`` of the sweep with ``space_seed``: a dict of the :data:`SPACE` keys
    (``warmup`` in steps). The same arguments give the same set-up on any machine."""
    rng = random.Random(f"{space_seed}/{index}")
    steps = int(round(math.exp(rng.uniform(math.log(150), math.log(2000)))))
    return {"workload": rng.choice(WORKLOADS),
            "lr": float(f"{math.exp(rng.uniform(math.log(3e-4), math.log(1e-2))):.3g}"),
            "beta2": rng.choice(BETA2),
            "steps": steps,
            "warmup": int(rng.uniform(0, 0.2) * steps),
            "lr_schedule": rng.choice(LR_SCHEDULES),
            "weight_decay": round(rng.uniform(0, 0.1), 3),
            "weight_decay_style": rng.choice(("decoupled", "l2")),
            "batch_size": int(round(math.exp(rng.uniform(math.log(4), math.log(64)))))}


def capped(setup: dict, max_steps: int | None) -> dict:
    """``setup`` with at most ``max_steps`` steps, its warm-up shortened in proportion (for a
    quick look or a test; None or 0: as drawn)."""
    if not max_steps or setup["steps"] <= max_steps:
        return setup
    return {**setup, "steps": max_steps, "warmup": setup["warmup"] * max_steps // setup["steps"]}


def lr_factor(schedule: str, warmup: int, steps: int):
    """``f(t)``: the learning rate of step t (1-based) over the peak. A linear warm-up
    (t/warmup for t <= warmup), then ``constant`` 1, ``cosine`` from 1 to 0.1 at the last step,
    or ``step`` 1, 0.3 from half the steps after the warm-up, 0.09 from three quarters.
    Raises ValueError for another ``schedule``."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule={schedule!r}: choose one of {LR_SCHEDULES}")

    def f(t: int) -> float:
        if t <= warmup:
            return t / warmup
        progress = min(1.0, (t - warmup) / max(1, steps - warmup))
        if schedule == "cosine":
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        if schedule == "step":
            return 1.0 if progress < 0.5 else 0.3 if progress < 0.75 else 0.09
        return 1.0
    return f


def run_args(setup: dict, seed: int, args: argparse.Namespace) -> argparse.Namespace:
    """The ``bench convergence`` arguments of one (set-up, seed) at ``args.ranks`` ranks, 0/1 Adam
    with the library's defaults."""
    return argparse.Namespace(
        **MODELS[setup["workload"]], workload=setup["workload"], steps=setup["steps"], lr=setup["lr"],
        beta2=setup["beta2"], warmup=setup["warmup"], weight_decay=setup["weight_decay"],
        weight_decay_style=setup["weight_decay_style"], batch_size=setup["batch_size"], seed=seed,
        ranks=args.ranks, library_defaults=True, oracle="batched", vmap_chunk_size=args.vmap_chunk_size,
        threads=args.threads, eval_every=0)


def freeze_without_floor(setup: dict) -> int:
    """T_f of the ``freeze-2w`` variant: what ``var_freeze_step="auto"`` decides on this set-up
    without its floor of 32 updates of v: max(2·warm-up, ⌈(1/4)/(1 − β2)⌉)."""
    return max(2 * setup["warmup"], math.ceil(0.25 / (1 - setup["beta2"])))


def check_variants(names: list) -> None:
    """Raise :class:`SweepError` for a name that is neither ``adam``, ``freeze-2w`` nor a
    ``bench convergence`` variant."""
    bad = [n for n in names if n not in ("adam", "freeze-2w", *convergence.VARIANTS) and _freeze_at(n) is None]
    if bad:
        raise SweepError(f"--variants: unknown {bad}; choose from adam, freeze-2w, freeze-at-N (N a step), "
                         f"{', '.join(convergence.VARIANTS)}")


def _freeze_at(name: str) -> int | None:
    """N of a variant named ``freeze-at-N`` (N >= 1), else None."""
    head, _, n = name.rpartition("-")
    return int(n) if head == "freeze-at" and n.isdigit() and int(n) >= 1 else None


def run_one(setup: dict, seed: int, variant: str, args: argparse.Namespace) -> dict:
    """One run's row (``bench convergence``'s: ``val_loss``, ``bytes_per_rank``, ``wall_s``, and for
    0/1 Adam ``kinds`` and ``frozen_at``): ``variant`` on the set-up with this seed: ``"adam"``,
    ``"zoadam"`` (the library's defaults), a ``bench convergence`` variant (one part switched off,
    on top of the defaults), ``"freeze-2w"`` (the defaults with T_f = :func:`freeze_without_floor`)
    or ``"freeze-at-N"`` (the defaults with T_f = N)."""
    one = run_args(setup, seed, args)
    work = build(setup["workload"], convergence._examples(), one)
    factor = lr_factor(setup["lr_schedule"], setup["warmup"], setup["steps"])
    work.lr_fn = lambda t: setup["lr"] * factor(t)
    init = [p.detach().clone() for p in work.model.parameters()]
    if variant == "freeze-2w":
        variant = f"freeze-at-{freeze_without_floor(setup)}"
    if _freeze_at(variant) is not None:
        convergence.VARIANTS.setdefault(variant, ({}, {"var_freeze_step": _freeze_at(variant)}))
    return convergence._variant_row(variant, work, init, one)


def _key(index: int, seed: int, variant: str) -> str:
    return f"{index}/{seed}/{variant}"


def _settings(args: argparse.Namespace) -> dict:
    return {"space_seed": args.space_seed, "ranks": args.ranks, "seeds": args.seeds, "space": SPACE,
            "models": MODELS, "max_steps": args.max_steps or None}


def load_report(path: str | None, settings: dict) -> dict:
    """The report to continue: the one at ``path`` if it exists (read as JSON, nothing else) and
    was made with ``settings``, else a new one. Raises :class:`SweepError` naming each setting
    that differs, or the file if it is no sweep report."""
    if not path or not Path(path).exists():
        return {"settings": settings, "runs": {}}
    try:
        report = json.loads(Path(path).read_text())
        old, runs = report["settings"], report["runs"]
        if not isinstance(runs, dict):
            raise TypeError("its runs are not an object")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SweepError(f"--json {path}: not a `bench sweep` report ({type(exc).__name__}: {exc}); "
                         "give another path, or remove the file to start again") from None
    differ = [f"{k}: {old.get(k)!r} there, {settings[k]!r} here" for k in settings if old.get(k) != settings[k]]
    if differ:
        raise SweepError(f"--json {path}: made by a sweep with other settings ({'; '.join(differ)}); "
                         "resume it with the same arguments, or give another path")
    return {"settings": settings, "runs": runs}


def _write(path: str | None, report: dict) -> None:
    """Rewrite ``path`` whole through a temporary file (a kill leaves the old file or the new)."""
    if path:
        tmp = f"{path}.tmp"
        Path(tmp).write_text(json.dumps(report, indent=1))
        os.replace(tmp, path)


def run(args: argparse.Namespace) -> dict:
    """The sweep (module docstring): trains every (set-up, seed, variant) not yet in the report,
    set-up by set-up, rewriting ``--json`` after each run; returns the report with its summary.
    Raises :class:`SweepError` for bad arguments or a ``--json`` of another sweep."""
    for name in ("setups", "seeds", "ranks", "jobs"):
        if getattr(args, name) < 1:
            raise SweepError(f"--{name} must be >= 1, got {getattr(args, name)}")
    report = load_report(args.json, _settings(args))
    import torch
    torch.set_num_threads(args.threads)
    variants = list(dict.fromkeys([*VARIANTS, *args.variants.split(",")]))
    check_variants(variants)
    setups = [capped(draw(args.space_seed, i), args.max_steps) for i in range(args.setups)]
    only = range(args.setups) if not args.only else [int(i) for i in args.only.split(",")]
    if any(not 0 <= i < args.setups for i in only):
        raise SweepError(f"--only {args.only}: set-ups are numbered 0 .. {args.setups - 1}")
    report["setups"] = {str(i): {"setup": s} for i, s in enumerate(setups)}
    todo = [(i, seed, variant) for i in only for seed in range(args.seeds) for variant in variants
            if _key(i, seed, variant) not in report["runs"]]
    for (i, seed, variant), row in _train(todo, setups, args):
        report["runs"][_key(i, seed, variant)] = row
        _write(args.json, report)
    summarise(report, setups)
    _write(args.json, report)
    if args.png:
        plot(report, args.png)
    if getattr(args, "markdown", None):
        Path(args.markdown).write_text(table(report))
    return report


def _init_job(threads: int) -> None:
    import torch
    torch.set_num_threads(threads)


def _train(todo: list, setups: list, args: argparse.Namespace):
    """Yields ``((set-up, seed, variant), row)`` for each run of ``todo``: in this process in
    order with ``--jobs 1``, else in ``--jobs`` processes as they finish. Each run seeds its own
    model and batches, so a row does not depend on which process trains it or in what order."""
    def say(i: int, seed: int, variant: str) -> None:  # before the run with --jobs 1, after it with more
        print(f"[sweep] set-up {i} {setups[i]} seed {seed} {variant}", file=sys.stderr, flush=True)
    if args.jobs == 1:
        for i, seed, variant in todo:
            say(i, seed, variant)
            yield (i, seed, variant), run_one(setups[i], seed, variant, args)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_init_job, initargs=(args.threads,)) as pool:
        futures = {pool.submit(run_one, setups[job[0]], job[1], job[2], args): job for job in todo}
        for future in as_completed(futures):
            say(*futures[future])
            yield futures[future], future.result()


def _spread(values: list) -> float:
    """max − min over the seeds, relative to their mean (0 for one seed)."""
    return (max(values) - min(values)) / statistics.fmean(values) if len(values) > 1 else 0.0


def summarise(report: dict, setups: list) -> None:
    """Per set-up (``report["setups"][i]``): each variant's mean validation loss and spread over
    the seeds, the gap of the means (0/1 Adam's over Adam's, minus 1), 0/1 Adam's bytes over
    Adam's (the mean over seeds), the gap per seed, and whether it passes :data:`GOAL`: the gap
    at most 1 %, or at most Adam's own spread where that is wider, and at most 2 % in any case;
    on set-ups of 1,000 steps or more, bytes at most 0.15 of Adam's. A diverged run fails its
    set-up. ``report["summary"]``: the set-ups complete, passed, the pass rate, the worst."""
    seeds = report["settings"]["seeds"]
    done = []
    for i, setup in enumerate(setups):
        rows = {v: [report["runs"].get(_key(i, s, v)) for s in range(seeds)] for v in VARIANTS}
        if any(r is None for v in VARIANTS for r in rows[v]):
            continue
        loss = {v: [r["val_loss"] for r in rows[v]] for v in VARIANTS}
        out = report["setups"][str(i)]
        if not all(math.isfinite(x) for v in VARIANTS for x in loss[v]):
            out.update(passed=False, diverged=True)
            done.append((i, math.inf, out))
            continue
        adam, zo = statistics.fmean(loss["adam"]), statistics.fmean(loss["zoadam"])
        gap = zo / adam - 1
        ratio = statistics.fmean(z["bytes_per_rank"] / a["bytes_per_rank"]
                                 for a, z in zip(rows["adam"], rows["zoadam"]))
        allowed = min(max(GOAL["gap"], _spread(loss["adam"])), GOAL["worst"])
        passed = gap <= allowed and (setup["steps"] < GOAL["long_steps"] or ratio <= GOAL["bytes_long"])
        out.update(adam_mean=adam, adam_spread=_spread(loss["adam"]), zoadam_mean=zo,
                   zoadam_spread=_spread(loss["zoadam"]), gap=gap, allowed_gap=allowed,
                   gap_per_seed=[z / a - 1 for a, z in zip(loss["adam"], loss["zoadam"])],
                   bytes_vs_adam=ratio, frozen_at=[r.get("frozen_at") for r in rows["zoadam"]], passed=passed)
        out["variants"] = _variant_gaps(report, i, seeds, adam)
        done.append((i, gap, out))
    passed = sum(1 for _, _, out in done if out["passed"])
    worst = sorted(done, key=lambda d: -d[1])[:3]
    report["summary"] = {"setups_done": len(done), "setups": len(setups), "passed": passed,
                         "pass_rate": passed / len(done) if done else None, "goal": GOAL,
                         "worst": [{"setup": i, "gap": out.get("gap"), **out["setup"]} for i, _, out in worst]}


def _variant_gaps(report: dict, index: int, seeds: int, adam: float) -> dict:
    """Set-up ``index``'s other variants (``--variants``) run over every seed: the gap of their
    mean to Adam's mean ``adam``."""
    names = {k.split("/")[2] for k in report["runs"] if k.startswith(f"{index}/")} - set(VARIANTS)
    out = {}
    for name in sorted(names):
        rows = [report["runs"].get(_key(index, s, name)) for s in range(seeds)]
        if all(r is not None for r in rows):
            out[name] = statistics.fmean(r["val_loss"] for r in rows) / adam - 1
    return out


def plot(report: dict, path: str) -> None:
    """The gap of each finished set-up (the mean's, a bar; each seed's, a dot), sorted, with the
    goal's 1 % and 2 % lines, as a PNG at ``path`` (matplotlib, Agg); the axis ends at ±10 %,
    a gap past it drawn at the edge with its value written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = sorted(((int(i), s) for i, s in report["setups"].items() if "gap" in s), key=lambda r: r[1]["gap"])
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(rows) + 2), 4))
    lim = 10.0  # percent: a gap past it is drawn at the edge and written out
    for x, (i, s) in enumerate(rows):
        gap = 100 * s["gap"]
        ax.bar(x, max(-lim, min(lim, gap)), color="tab:green" if s["passed"] else "tab:red", alpha=0.6)
        ax.plot([x] * len(s["gap_per_seed"]), [max(-lim, min(lim, 100 * g)) for g in s["gap_per_seed"]], "k.", ms=4)
        if abs(gap) > lim:
            ax.annotate(f"{gap:+.3g} %", (x, lim if gap > 0 else -lim), ha="center", va="bottom" if gap > 0 else "top",
                        fontsize=7)
    ax.set_ylim(-lim * 1.15, lim * 1.15)
    for y, style in ((1, "--"), (2, ":")):
        ax.axhline(y, color="grey", ls=style, lw=1)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(range(len(rows)), [f"{i}:{s['setup']['workload']}" for i, s in rows], rotation=90, fontsize=7)
    ax.set_ylabel("val. loss vs Adam (%)")
    summary = report.get("summary", {})
    ax.set_title(f"0/1 Adam, library defaults, P = {report['settings']['ranks']}: "
                 f"{summary.get('passed')}/{summary.get('setups_done')} set-ups pass")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _loss_cell(report: dict, index: int, variant: str) -> str:
    """A diverged set-up's cell for ``variant``: its mean ± spread where every seed ended finite,
    else how many seeds diverged."""
    seeds = report["settings"]["seeds"]
    losses = [report["runs"][_key(index, s, variant)]["val_loss"] for s in range(seeds)]
    bad = sum(not math.isfinite(x) for x in losses)
    if bad:
        return f"diverged ({bad} of {seeds} seeds)"
    return f"{statistics.fmean(losses):.4f} ± {100 * _spread(losses):.1f} %"


def table(report: dict) -> str:
    """The finished set-ups of ``report`` as a Markdown table, one row each in set-up order: the
    set-up (steps with the warm-up, schedule, peak lr, β2, weight decay and its style, batch per
    rank), Adam's and 0/1 Adam's mean validation loss ± their spread over the seeds (max − min
    over the mean), the gap of the means, 0/1 Adam's bytes over Adam's, T_f (the last step
    before v froze, the first seed's; "—": not frozen) and whether it passes."""
    lines = ["| # | model | steps (warm-up) | schedule | lr | β2 | decay | batch | Adam ± spread | "
             "0/1 Adam ± spread | gap | bytes | T_f | passes |", "|" + "---|" * 14]
    for i, out in sorted(((int(i), s) for i, s in report["setups"].items() if "passed" in s)):
        u = out["setup"]
        style = "AdamW" if u["weight_decay_style"] == "decoupled" else "L2"
        head = (f"| {i} | {u['workload']} | {u['steps']} ({u['warmup']}) | {u['lr_schedule']} | {u['lr']} | "
                f"{u['beta2']} | {u['weight_decay']} {style} | {u['batch_size']} | ")
        if out.get("diverged"):
            adam, zoadam = (_loss_cell(report, i, v) for v in VARIANTS)
            lines.append(f"{head}{adam} | {zoadam} | | | | **no** |")
            continue
        frozen = out["frozen_at"][0]
        lines.append(
            f"{head}{out['adam_mean']:.4f} ± {100 * out['adam_spread']:.1f} % | {out['zoadam_mean']:.4f} ± "
            f"{100 * out['zoadam_spread']:.1f} % | {100 * out['gap']:+.2f} % | {out['bytes_vs_adam']:.3f} | "
            f"{'—' if frozen is None else frozen - 1} | {'yes' if out['passed'] else '**no**'} |")
    return "\n".join(lines).replace("| -", "| −") + "\n"


def add_parser(sub: argparse._SubParsersAction) -> None:
    sw = sub.add_parser("sweep", help="0/1 Adam with the library's defaults against Adam over random training "
                                      "set-ups, several seeds each (resumable)")
    sw.add_argument("--setups", type=int, default=24, help="how many set-ups: the first N of the space seed's draws")
    sw.add_argument("--seeds", type=int, default=3, help="seeds per set-up (0 .. S-1)")
    sw.add_argument("--ranks", type=int, default=8, help="P, the simulated workers")
    sw.add_argument("--space-seed", type=int, default=0, help="which draws of the space")
    sw.add_argument("--variants", default="zoadam",
                    help="0/1 Adam variants to run besides Adam and the defaults (zoadam), to find which part "
                         "costs the quality: any of bench convergence's (e.g. exact-compressed, exact-sync, "
                         "no-local-steps), freeze-2w (the freeze without its floor of 32 updates of v) and "
                         "freeze-at-N (T_f = N); each "
                         "set-up's gaps in setups[i].variants")
    sw.add_argument("--only", help="comma-separated set-up numbers to run (default: all of --setups)")
    sw.add_argument("--max-steps", type=int, default=0,
                    help="cap every set-up's steps (its warm-up shortened in proportion): a quick look, not the "
                         "sweep (0: the steps as drawn)")
    sw.add_argument("--threads", type=int, default=1, help="torch threads (per job)")
    sw.add_argument("--jobs", type=int, default=1,
                    help="runs trained at once, each in its own process (the rows are the same as with 1)")
    sw.add_argument("--vmap-chunk-size", type=int, default=4, help="ranks per vmap'd call (0: all at once)")
    sw.add_argument("--png", help="the plot of the gaps")
    sw.add_argument("--markdown", help="the per-set-up table (Markdown) of the finished set-ups")
    sw.add_argument("--json", help="the report, rewritten after each run; an existing one is resumed")
    sw.set_defaults(run=run)
