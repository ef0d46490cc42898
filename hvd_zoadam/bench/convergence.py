"""``python -m hvd_zoadam.bench convergence`` and ``scaling``: 0/1 Adam's quality at P workers.

``convergence`` trains a workload on P simulated workers in one process with the in-process
oracle :func:`hvd_zoadam.oracle.simulate.simulate_zoadam`, which can switch one factor off at a
time: the 1-bit exchange of the compressed steps or of the sync steps (replaced by the exact
average), the server side's recompression, the bound on |g|/s (``no-clip``;
``unscaled-bound``: without its factor sqrt(P); ``k-bound``: the earlier bound, tied to the
number k of variance updates), the compression domain, the automatic mask, local steps, the
freeze; or change the exchange (``two-level``: nodes of ``--ranks-per-node`` ranks) or the
local-step policy (``steps-policy``). The baseline is AdamW on the exact average of the P
gradients (what ``hvd.DistributedOptimizer`` does).

Workloads (``--workload``): ``lm``, the char LM of examples/train_lm.py (same model, data,
per-rank batches, learning-rate schedule and 0/1 Adam knobs as ``train_lm.py``'s defaults, except
the freeze: ``--var-freeze-step`` defaults to ``--warmup``, where train_lm's is twice it);
``digits``, the CNN of examples/train_digits.py; ``gru``, a char-level GRU on the Python
standard library's sources (:mod:`hvd_zoadam.bench.workloads`). Rank r draws its batches from its own
generator (seed·1000 + r). ``--oracle batched`` (the default) computes the P ranks' gradients
with ``torch.func.vmap``, ``--vmap-chunk-size`` ranks at a time (vmap's ``chunk_size``; the
gradients are the same to the last bit whatever the chunk, and on a 2-core CPU chunks of 4 ran
several times as fast as all ranks at once, for reasons not profiled), and exchanges through the
stacked oracle, which is what makes P = 128 possible on a CPU; ``per-rank`` runs one backward pass
per rank.

Prints (and with ``--json`` writes) one JSON object: the settings, and per variant the final
validation loss (the mean over ranks of each rank's model, on the same fixed batches), its gap
to Adam, the time it took, and the bytes each rank would send in the real job by the
transport's own formulas (:func:`_bytes`). With ``--eval-every k`` also the validation curve
(the same mean every k steps) and ``steps_to_target``, the first evaluated step at or below
``target_val_loss``: Adam's loss at its first evaluation at or after 2/3 of the steps. With
``--json`` the file is rewritten after each variant, so a run stopped midway keeps its finished
rows. ``--baseline-json`` takes Adam's row from an earlier report whose settings match in all
that decides Adam's path (:func:`baseline_row`), which halves a P = 128 run.

``scaling`` runs ``convergence`` at each P of ``--ranks`` (0/1 Adam flat, and two-level with
nodes of ``--ranks-per-node``) and reports the rows side by side (:func:`run_scaling`).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch

from hvd_zoadam.bench.lm import add_model_arguments
from hvd_zoadam.bench.workloads import Workload, build
from hvd_zoadam.comm.hierarchical import hierarchical_exchange_bytes
from hvd_zoadam.comm.protocol import exchange_bytes
from hvd_zoadam.core.layout import scale_segments
from hvd_zoadam.core.schedule import StepKind
from hvd_zoadam.oracle.simulate import simulate_zoadam

# name -> (simulate_zoadam keyword overrides, schedule overrides)
VARIANTS = {
    "zoadam": ({}, {}),
    "exact-compressed": ({"exact": ("compressed",)}, {}),
    "exact-sync": ({"exact": ("sync",)}, {}),
    "exact-both": ({"exact": ("compressed", "sync")}, {}),
    "server-exact": ({"server_exact": True}, {}),
    "no-clip": ({"clip_scale": math.inf}, {}),
    "unscaled-bound": ({"clip_scale": "1/sqrt_p"}, {}),
    "k-bound": ({"clip_scale": "k"}, {}),
    "two-level": ({"ranks_per_node": "L"}, {}),
    "paper-domain": ({"precondition": False}, {}),
    "paper-raw": ({"precondition": False, "auto_mask": False}, {}),
    "no-local-steps": ({}, {"local_step_clipper": 1}),
    "exact-both-no-local-steps": ({"exact": ("compressed", "sync")}, {"local_step_clipper": 1}),
    "exact-both-no-local-steps-late-freeze": ({"exact": ("compressed", "sync")},
                                              {"local_step_clipper": 1, "var_freeze_step": "2x"}),
    "exact-both-no-local-steps-no-clip": ({"exact": ("compressed", "sync"), "clip_scale": math.inf},
                                          {"local_step_clipper": 1}),
    "exact-both-no-local-steps-dense-v": ({"exact": ("compressed", "sync")},
                                          {"local_step_clipper": 1, "var_update_scaler": 10 ** 9}),
    "exact-both-no-local-steps-no-freeze": ({"exact": ("compressed", "sync")},
                                            {"local_step_clipper": 1, "var_freeze_step": "steps"}),
    "exact-sync-momentum": ({"exact": ("sync-momentum",)}, {}),
    "sync-momentum-average": ({"sync_momentum_average": 0.5}, {}),
    "sync-momentum-average-0.75": ({"sync_momentum_average": 0.75}, {}),
    "paper-v": ({}, {"var_update_weighting": "paper"}),
    "two-level-paper-v": ({"ranks_per_node": "L"}, {"var_update_weighting": "paper"}),
    "exact-both-no-local-steps-paper-v": ({"exact": ("compressed", "sync")},
                                          {"local_step_clipper": 1, "var_update_weighting": "paper"}),
    "steps-policy": ({}, {"local_step_policy": "steps"}),
    "late-freeze": ({}, {"var_freeze_step": "2x"}),
}


def _grad_fn(work: Workload, names, args, curve=None):
    """Rank r's gradient at its parameters, from its own batch stream (seed·1000 + r, as train_lm).

    ``curve`` (a dict, with ``args.eval_every`` k > 0): before the gradient of step t with
    t − 1 a multiple of k, rank r's validation loss is appended to ``curve[t − 1]``."""
    gens = [torch.Generator().manual_seed(args.seed * 1000 + r) for r in range(args.ranks)]
    model = work.model
    params = dict(model.named_parameters())
    every = getattr(args, "eval_every", 0)

    def grad_fn(step: int, rank: int, xs: list[torch.Tensor]):
        if curve is not None and every and step > 1 and (step - 1) % every == 0:
            curve.setdefault(step - 1, []).append(_val_loss(work, names, [xs]))
        with torch.no_grad():
            for name, x in zip(names, xs):
                params[name].copy_(x)
        model.zero_grad(set_to_none=True)
        x, y = work.batch(gens[rank])
        work.loss(model(x), y).backward()
        return [params[name].grad.detach().clone() for name in names]
    return grad_fn


def _batched_grad_fn(work: Workload, names, args, curve=None):
    """Every rank's gradient in one call (``simulate_zoadam``'s ``batched_grad_fn``): torch.func's
    ``vmap`` over the ranks of ``grad`` of the loss at each rank's parameters
    (``functional_call``), ``args.vmap_chunk_size`` ranks at a time (all at once when it is
    None or absent), each rank on the batch its own stream gives (as :func:`_grad_fn`).
    The same gradients as P separate backward passes, up to the batched kernels' summation order.

    ``curve``: as :func:`_grad_fn`, with the P validation losses from one batched pass."""
    gens = [torch.Generator().manual_seed(args.seed * 1000 + r) for r in range(args.ranks)]
    shapes = [p.shape for p in work.model.parameters()]
    every = getattr(args, "eval_every", 0)

    def loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor):
        return work.loss(torch.func.functional_call(work.model, params, (x,)), y)
    chunk = _chunk_size(args)
    grads = torch.func.vmap(torch.func.grad(loss), chunk_size=chunk)

    def grad_fn(step: int, xs: torch.Tensor):
        if curve is not None and every and step > 1 and (step - 1) % every == 0:
            same = xs.stride(0) == 0  # one x for every rank (Adam's): evaluate it once
            losses = _val_losses(work, names, xs[:1] if same else xs, chunk)
            curve.setdefault(step - 1, []).extend(losses * (xs.shape[0] if same else 1))
        batches = [work.batch(g) for g in gens]
        out = grads(_unflatten(names, shapes, xs), torch.stack([x for x, _ in batches]),
                    torch.stack([y for _, y in batches]))
        return torch.cat([out[name].reshape(xs.shape[0], -1) for name in names], dim=1)
    return grad_fn


def _chunk_size(args):
    """vmap's ``chunk_size`` from ``--vmap-chunk-size``: None (all ranks at once) for 0 or absent."""
    return getattr(args, "vmap_chunk_size", None) or None


def _unflatten(names, shapes, xs) -> dict:
    """float32[P, n] (bucket order) -> {name: float32[P, *shape]}, views of ``xs``."""
    rows = xs.shape[0]
    parts = xs.split([math.prod(s) for s in shapes], dim=1)
    return {name: part.reshape(rows, *shape) for name, part, shape in zip(names, parts, shapes)}


@torch.no_grad()
def _val_losses(work: Workload, names, xs, chunk_size=None) -> list:
    """Each rank's validation loss on the fixed batches, the P ranks (rows of ``xs``,
    float32[P, n]) in one batched forward pass per batch, ``chunk_size`` ranks at a time (all
    at once when None)."""
    params = _unflatten(names, [p.shape for p in work.model.parameters()], xs)
    forward = torch.func.vmap(lambda ps, x, y: work.loss(torch.func.functional_call(work.model, ps, (x,)), y),
                              in_dims=(0, None, None), chunk_size=chunk_size)
    total = sum(forward(params, x, y).double() for x, y in work.val_batches)
    return (total / len(work.val_batches)).tolist()


def _val_loss(work: Workload, names, ranks_params) -> float:
    """Mean over ranks of each rank's validation loss on the fixed batches."""
    params = dict(work.model.named_parameters())
    losses = []
    for xs in ranks_params:
        with torch.no_grad():
            for name, x in zip(names, xs):
                params[name].copy_(x)
            losses.append(sum(work.loss(work.model(x), y).item() for x, y in work.val_batches)
                          / len(work.val_batches))
    return sum(losses) / len(losses)


def _l2(args) -> bool:
    """Whether the run's weight decay is Adam's L2 (``--weight-decay-style l2``: ``torch.optim.Adam``'s
    ``weight_decay`` on every parameter) rather than AdamW's decoupled decay of the matrices."""
    return getattr(args, "weight_decay_style", "decoupled") == "l2"


def _adam(names, init, grad_fn, lr_fn, decay_of, args, batched=False) -> list:
    """AdamW on the exact average of the P gradients, every step (with ``--weight-decay-style
    l2``, Adam with L2 on every parameter); returns the final params. ``batched``: ``grad_fn``
    is :func:`_batched_grad_fn`'s."""
    xs = [x.clone() for x in init]
    if _l2(args):  # Adam's L2: one group, every parameter
        opt = torch.optim.Adam(xs, lr=args.lr, betas=(0.9, args.beta2), weight_decay=args.weight_decay)
    else:
        groups = [{"params": [x for x, n in zip(xs, names) if decay_of(n)], "weight_decay": args.weight_decay},
                  {"params": [x for x, n in zip(xs, names) if not decay_of(n)], "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, args.beta2))
    for t in range(1, args.steps + 1):
        if batched:  # float32[P, n] -> the ranks' gradients as lists of tensors
            flat = torch.cat([x.detach().reshape(-1) for x in xs]).expand(args.ranks, -1)
            grads = [[g.view_as(x) for g, x in zip(row.split([x.numel() for x in xs]), xs)]
                     for row in grad_fn(t, flat)]
        else:
            grads = [grad_fn(t, r, xs) for r in range(args.ranks)]
        for i, x in enumerate(xs):
            x.grad = sum((g[i] for g in grads[1:]), grads[0][i].clone()).div_(args.ranks)
        for group in opt.param_groups:
            group["lr"] = lr_fn(t)
        opt.step()
    return xs


# Settings that do not touch Adam's path: a baseline from a report that differs only in these
# can stand in for training Adam again (``--baseline-json``).
BASELINE_FREE = ("variants", "vmap_chunk_size", "baseline_json", "ranks_per_node", "scale_block_numel",
                 "var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper",
                 "local_step_policy", "var_update_weighting", "library_defaults")


class BaselineError(ValueError):
    """``--baseline-json`` names a file that is not a convergence report with an Adam row, or
    whose settings differ from this run's in one that decides Adam's path."""


def baseline_row(path: str, settings: dict) -> dict:
    """Adam's row of an earlier ``bench convergence`` report (its ``--json``), to stand in for
    training Adam again. Its settings must equal ``settings`` (this run's) in every key but
    :data:`BASELINE_FREE`. The file is read as JSON, nothing else.

    Raises :class:`BaselineError` naming the file and, for a mismatch, each setting with both
    values."""
    try:
        report = json.loads(Path(path).read_text())
        old, adam = report["settings"], report["variants"]["adam"]
        loss = float(adam["val_loss"])
        float(adam["bytes_per_rank"])  # the gaps in bytes divide by it
        if not isinstance(old, dict):
            raise TypeError(f"its settings are a {type(old).__name__}, not an object")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BaselineError(f"--baseline-json {path}: not a `bench convergence` report with an Adam row "
                            f"({type(exc).__name__}: {exc}); give the --json of an earlier convergence run") from None
    if not math.isfinite(loss):
        raise BaselineError(f"--baseline-json {path}: Adam's val_loss is {loss}; give a run that finished")
    keys = sorted(k for k in set(old) | set(settings) if k not in BASELINE_FREE)
    differ = [f"{k}: {old.get(k, '(absent)')!r} there, {settings.get(k, '(absent)')!r} here"
              for k in keys if old.get(k) != settings.get(k)]
    if differ:
        raise BaselineError(f"--baseline-json {path}: its Adam ran with other settings ({'; '.join(differ)}); "
                            "run with the same settings, or without --baseline-json")
    keep = ("val_loss", "wall_s", "bytes_per_rank", "curve")
    return {**{k: adam[k] for k in keep if k in adam}, "baseline_json": str(path)}


def run(args: argparse.Namespace, examples: Callable[[str], ModuleType]) -> dict:
    """The convergence report (see the module docstring). ``examples``: a function of the
    example's name (``"train_lm"``, ``"train_digits"``) that gives it as a module. With
    ``args.json`` the report so far is rewritten after each variant (a run stopped midway keeps
    its finished rows; the gaps to Adam come with the last write). Raises :class:`BaselineError`
    (before any training) for an unusable ``--baseline-json``."""
    torch.set_num_threads(args.threads)
    report = {"settings": {k: v for k, v in vars(args).items() if k not in ("json", "func", "run")}, "variants": {}}
    baseline = baseline_row(args.baseline_json, report["settings"]) if getattr(args, "baseline_json", None) else None
    work = build(args.workload, examples, args)
    # copied before any variant runs: the per-rank oracle writes each rank's x into the model
    init = [p.detach().clone() for p in work.model.parameters()]
    runs = args.variants.split(",")
    if "adam" not in runs:
        runs = ["adam"] + runs
    for name in runs:
        if name == "adam" and baseline:
            report["variants"][name] = baseline
            print(f"[convergence] P={args.ranks} adam: val loss {baseline['val_loss']:.4f} "
                  f"(from {baseline['baseline_json']})", file=sys.stderr, flush=True)
        else:
            report["variants"][name] = _variant_row(name, work, init, args)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
    _compare(report, args)
    return report


def _variant_row(name: str, work: Workload, init: list, args) -> dict:
    """One variant (``"adam"`` or a key of :data:`VARIANTS`) trained from ``init`` (the model's
    parameters before any training, in its order): its report row. A variant that diverges is a
    row saying so, not an error."""
    batched = args.oracle == "batched"
    model = work.model
    names = [n for n, _ in model.named_parameters()]
    start = time.perf_counter()
    curve = {}
    grad_fn = (_batched_grad_fn if batched else _grad_fn)(work, names, args, curve)
    if name == "adam":
        decay_of = dict((n, p.dim() >= 2) for n, p in model.named_parameters()).get
        final = [_adam(names, init, grad_fn, work.lr_fn, decay_of, args, batched)]
        trace, kinds = None, None
    else:
        weight_decay = args.weight_decay if _l2(args) else \
            torch.cat([torch.full((p.numel(),), args.weight_decay if p.dim() >= 2 else 0.0)
                       for p in model.parameters()])
        try:
            final, trace, kinds = _zoadam(name, init, grad_fn, args, work.lr_fn, weight_decay, batched)
        except FloatingPointError as exc:  # a diverged variant is a result, not a crash
            print(f"[convergence] P={args.ranks} {name}: diverged ({exc})", file=sys.stderr, flush=True)
            return {"val_loss": math.nan, "diverged": str(exc), "bytes_per_rank": math.nan,
                    "wall_s": round(time.perf_counter() - start, 1)}
    if batched:
        xs = torch.stack([torch.cat([x.reshape(-1) for x in rank]) for rank in final])
        losses = _val_losses(work, names, xs, _chunk_size(args))
        loss = sum(losses) / len(losses)
    else:
        loss = _val_loss(work, names, final)
    row = {"val_loss": loss, "wall_s": round(time.perf_counter() - start, 1),
           **_bytes(name, kinds, [p.numel() for p in init], args)}
    if kinds:  # the first step after the variance freeze
        row["frozen_at"] = next((t for t, k in enumerate(kinds, 1) if k in (StepKind.LOCAL, StepKind.SYNC)), None)
    if curve:
        row["curve"] = [[t, sum(v) / len(v)] for t, v in sorted(curve.items())] + [[args.steps, loss]]
    if trace:
        row["error_feedback"] = _summarise(trace)
    print(f"[convergence] P={args.ranks} {name}: val loss {loss:.4f} ({row['wall_s']} s)", file=sys.stderr, flush=True)
    return row


def _compare(report: dict, args) -> None:
    """Each row's gaps to Adam's loss and bytes; with ``--eval-every``, the steps each row takes
    to Adam's loss at 2/3 of the steps (``target_val_loss``, ``steps_to_target``)."""
    adam = report["variants"]["adam"]
    for row in report["variants"].values():
        row["vs_adam"] = row["val_loss"] / adam["val_loss"] - 1
        row["bytes_vs_adam"] = row["bytes_per_rank"] / adam["bytes_per_rank"] if adam["bytes_per_rank"] else None
        if "between_nodes_per_rank" in row and adam["bytes_per_rank"]:
            row["between_nodes_vs_adam"] = row["between_nodes_per_rank"] / adam["bytes_per_rank"]
    if "curve" in adam:
        target = next(v for t, v in adam["curve"] if t >= 2 * args.steps / 3)
        report["target_val_loss"] = target
        for row in report["variants"].values():
            row["steps_to_target"] = next((t for t, v in row.get("curve", []) if v <= target), None)


def _zoadam(name, init, grad_fn, args, lr_fn, weight_decay, batched=False):
    """One 0/1 Adam variant through the oracle: (final params per rank, trace, step kinds)."""
    overrides, sched_overrides = VARIANTS[name]
    overrides = dict(overrides)
    if overrides.get("clip_scale") == "1/sqrt_p":  # the bound without its factor sqrt(P)
        overrides["clip_scale"] = 1 / math.sqrt(args.ranks)
    schedule, auto_freeze, scale = _schedule(args, sched_overrides)
    if overrides.get("ranks_per_node") == "L":
        overrides["ranks_per_node"] = args.ranks_per_node
    trace = []
    fns = {"batched_grad_fn": grad_fn} if batched else {"grad_fn": grad_fn}
    final, kinds = simulate_zoadam(init, world_size=args.ranks, steps=args.steps, schedule=schedule, lr_fn=lr_fn,
                                   betas=(0.9, args.beta2), weight_decay=weight_decay, decoupled=not _l2(args),
                                   scale_block_numel=scale, trace=trace, stacked=batched,
                                   auto_freeze=auto_freeze, **fns, **overrides)
    return final, trace, kinds


def _schedule(args, sched_overrides: dict):
    """``(schedule, auto_freeze, scale_block_numel)`` of a 0/1 Adam variant: with
    ``--library-defaults`` the optimizer's own defaults as it decides them at ``args.ranks``
    ranks (:func:`~hvd_zoadam.shell.options.resolve_schedule`; the knob arguments are not read),
    else the knob arguments (``--var-freeze-step`` defaults to ``--warmup``); then the variant's
    overrides (a freeze of ``"2x"``: twice the freeze; ``"steps"``: never within the run; an int:
    that step)."""
    from hvd_zoadam.shell.options import resolve_schedule
    from hvd_zoadam.shell.torch_distributed import KNOBS
    names = ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper", "local_step_policy",
             "var_update_weighting", "scale_block_numel")
    if getattr(args, "library_defaults", False):
        knobs = {name: KNOBS[name] for name in names}
    else:
        knobs = {name: getattr(args, name) for name in names}
        knobs["var_freeze_step"] = args.var_freeze_step or args.warmup
    for key, value in sched_overrides.items():
        if key == "var_freeze_step" and isinstance(value, str):  # "2x": twice the freeze; "steps": never
            value = {"2x": 2 * knobs["var_freeze_step"], "steps": args.steps}[value]
        knobs[key] = value
    return resolve_schedule(args.ranks, args.beta2, **knobs)


def _bytes(name, kinds, numels, args) -> dict:
    """What each rank would send over the run in the real job, by the transport's counting
    (one bucket): AdamW's fp32 allreduce 2(P−1)/P·4n every step; 0/1 Adam's VARIANCE steps
    the same, COMPRESSED and SYNC steps :func:`~hvd_zoadam.comm.protocol.exchange_bytes` (flat)
    or :func:`~hvd_zoadam.comm.hierarchical.hierarchical_exchange_bytes` (two-level, the mean
    over local ranks; ``between_nodes_per_rank`` its cross-node part). Variants whose
    exchange is exact count as 0/1 Adam."""
    p, n = args.ranks, sum(numels)
    allreduce = 2 * (p - 1) / p * 4 * n
    if kinds is None:
        return {"bytes_per_rank": allreduce * args.steps}
    segments = scale_segments(numels, _schedule(args, VARIANTS[name][1])[2])
    local = VARIANTS[name][0].get("ranks_per_node")
    counts = {kind: sum(1 for k in kinds if k is kind) for kind in StepKind}
    onebit = counts[StepKind.COMPRESSED] + counts[StepKind.SYNC]
    out = {"rounds": 2 * onebit + counts[StepKind.VARIANCE], "kinds": {k.value: c for k, c in counts.items()}}
    if local is None:
        out["bytes_per_rank"] = counts[StepKind.VARIANCE] * allreduce + onebit * exchange_bytes(segments, p)
        return out
    levels = hierarchical_exchange_bytes(segments, p, args.ranks_per_node if local == "L" else local)
    inside, between = (sum(x) / len(levels) for x in zip(*levels))
    out["bytes_per_rank"] = counts[StepKind.VARIANCE] * allreduce + onebit * (inside + between)
    out["between_nodes_per_rank"] = counts[StepKind.VARIANCE] * allreduce + onebit * between
    return out


def _ratios(rows: list) -> dict:
    return {"steps": len(rows),
            "worker_error_vs_result": sum(r["worker_error"] / max(r["result"], 1e-30) for r in rows) / len(rows),
            "server_error_vs_result": sum(r["server_error"] / max(r["result"], 1e-30) for r in rows) / len(rows)}


def _summarise(trace: list, window: int = 100) -> dict:
    """Error feedback's size against the exchanged result's, per kind: the mean over its steps,
    and the same per ``window`` steps (``by_window``: first step of the window -> ratios), to
    show whether it grows over time."""
    out = {}
    for kind in ("compressed", "sync"):
        rows = [r for r in trace if r["kind"] == kind]
        if rows:
            out[kind] = _ratios(rows)
            starts = sorted({(r["step"] - 1) // window * window + 1 for r in rows})
            out[kind]["by_window"] = {str(s0): _ratios([r for r in rows if s0 <= r["step"] < s0 + window])
                                      for s0 in starts}
    return out


def _non_negative_int(text: str) -> int:
    """argparse type: an int >= 0 (``--vmap-chunk-size``)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (all ranks at once) or a positive number of ranks, got {value}")
    return value


def _add_knobs(parser) -> None:
    """The model, 0/1 Adam and oracle arguments shared by ``convergence`` and ``scaling``."""
    parser.add_argument("--workload", choices=["lm", "digits", "gru", "mlp"], default="lm",
                        help="lm: the char LM of examples/train_lm.py; digits: the CNN of examples/train_digits.py "
                             "(give it that example's settings: --beta2 0.999 --weight-decay 0 --batch-size 32 "
                             "--steps 300 --var-freeze-step 50 --var-update-scaler 4 --local-step-scaler 50 "
                             "--local-step-clipper 4 --local-step-policy steps); gru: a char-level GRU of "
                             "--n-layer layers of width --n-embd on the Python standard library's sources "
                             "(give it --beta2 0.999); mlp: an MLP of width --n-embd on a teacher network's "
                             "labels (data made by torch from --seed)")
    parser.add_argument("--steps", type=int, default=400)
    add_model_arguments(parser)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--weight-decay-style", choices=["decoupled", "l2"], default="decoupled",
                        help="decoupled: AdamW's, on the matrices only; l2: Adam's L2 (weight_decay of "
                             "torch.optim.Adam) on every parameter")
    parser.add_argument("--beta2", type=float, default=0.98)
    parser.add_argument("--var-freeze-step", type=int, default=None)
    parser.add_argument("--var-update-scaler", type=int, default=8)
    parser.add_argument("--local-step-scaler", type=int, default=40)
    parser.add_argument("--local-step-clipper", type=int, default=8)
    parser.add_argument("--local-step-policy", default="lr")
    parser.add_argument("--var-update-weighting", choices=["interval", "paper"], default="interval",
                        help="how much an update of v weighs (the optimizer's var_update_weighting)")
    parser.add_argument("--scale-block-numel", type=int, default=256)
    parser.add_argument("--library-defaults", action="store_true",
                        help="0/1 Adam with the optimizer's own defaults, as DistributedOptimizer(opt, "
                             "named_parameters) with no knob decides them at --ranks ranks (the freeze during "
                             "training from the learning rate); the knob arguments above are then not read")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--oracle", choices=["batched", "per-rank"], default="batched",
                        help="batched: the P ranks' gradients in one vmap'd call and the stacked exchange (fast at "
                             "large P); per-rank: one backward pass per rank and the exchange call by call")
    parser.add_argument("--vmap-chunk-size", type=_non_negative_int, default=4,
                        help="with --oracle batched: ranks per vmap'd call (vmap's chunk_size; 0: all at once). "
                             "The results do not depend on it; on a 2-core CPU 4 ran a step of the 0.43 M char LM "
                             "at P = 16 3.4x as fast as all 16 at once")
    parser.add_argument("--json")


def add_parser(sub: argparse._SubParsersAction) -> None:
    co = sub.add_parser("convergence", help="0/1 Adam's validation loss at P simulated workers, one factor "
                                            "switched off at a time, against AdamW on the exact average")
    co.add_argument("--ranks", type=int, default=8)
    co.add_argument("--variants", default="zoadam,exact-compressed,exact-sync,server-exact,no-clip,paper-domain",
                    help="comma-separated, from: " + ",".join(VARIANTS) + " (adam always runs)")
    co.add_argument("--ranks-per-node", type=int, default=2, help="L of the two-level variant (dividing --ranks)")
    co.add_argument("--eval-every", type=int, default=0,
                    help="validation loss every k steps, and the steps each variant needs to reach Adam's loss "
                         "at 2/3 of the steps (0: the final loss only)")
    co.add_argument("--baseline-json", metavar="PATH",
                    help="take Adam's row from this earlier convergence report (its --json) instead of training "
                         "Adam again; its settings must match this run's except the 0/1 Adam knobs, --variants "
                         "and --vmap-chunk-size (--threads too: it may change the last bits)")
    _add_knobs(co)
    co.set_defaults(run=lambda args: run(args, _examples()))
    sc = sub.add_parser("scaling", help="Adam against 0/1 Adam, flat and two-level, at several world sizes: "
                                        "validation loss, gap and bytes per rank")
    sc.add_argument("--ranks", default="2,4,8,16,32,64,128", help="comma-separated world sizes")
    sc.add_argument("--ranks-per-node", type=int, default=8,
                    help="L of the two-level rows (run where L divides P and P/L >= 2)")
    _add_knobs(sc)
    sc.set_defaults(run=lambda args: run_scaling(args, _examples()))


def _examples():
    """The example modules the workloads take (:func:`hvd_zoadam.bench.lm.example_module`)."""
    from hvd_zoadam.bench.lm import example_module
    return example_module


SCALING_KEYS = ("val_loss", "vs_adam", "bytes_per_rank", "bytes_vs_adam", "between_nodes_per_rank",
                "between_nodes_vs_adam", "rounds", "kinds", "diverged", "wall_s")


def run_scaling(args: argparse.Namespace, examples: Callable[[str], ModuleType]) -> dict:
    """``bench scaling``: :func:`run` at each P of ``--ranks`` with the variants ``zoadam`` and,
    where nodes of L = ``--ranks-per-node`` make at least two, ``two-level``; per P the
    rows' losses, gaps to Adam and bytes. With ``--json`` the file is rewritten after each P."""
    report = {"settings": {k: v for k, v in vars(args).items() if k not in ("json", "func", "run")}, "rows": {}}
    for p in [int(r) for r in args.ranks.split(",")]:
        local = args.ranks_per_node
        one = argparse.Namespace(**{**vars(args), "ranks": p, "eval_every": 0, "json": None,
                                    "variants": "zoadam" + (",two-level" if p % local == 0 and p // local >= 2
                                                            else "")})
        variants = run(one, examples)["variants"]
        report["rows"][str(p)] = {name: {k: row[k] for k in SCALING_KEYS if k in row} for name, row in variants.items()}
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
    return report
