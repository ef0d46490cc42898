"""``python -m hvd_zoadam.bench resume``: what a resume keeps of the error feedback.

A job of P thread-ranks in one process trains to step ``--save-at`` (past the freeze; several
comma-separated steps give one job each, and a summary of the gains over them),
saves with :func:`hvd_zoadam.checkpoint.save`, and runs on for ``--after`` steps: the
uninterrupted run. Fresh jobs of P' ranks (``--to``) then load the checkpoint and run the
same ``--after`` steps, in three ways:

* ``rank-files``: each rank's own file (P' = P only): the exact resume;
* ``pooled``: ``{prefix}.pt`` alone, with the pooled error feedback (the mean worker error
  and every rank's server chunk, algorithm.md §6), what ``checkpoint.load`` does without the
  saving ranks' own files (``per_group=False``);
* ``grouped``: ``{prefix}.pt`` with the saving ranks' own files next to it, what
  ``checkpoint.load`` does when the world size changed: as ``pooled``, but rank r' of P' takes
  the worker errors of its group of saving ranks, (P'/P)·Σ_{i∈G_r'} e_i, instead of the mean;
* ``zeroed``: ``{prefix}.pt`` alone with the error buffers at zero (what a resume did
  before the error feedback was pooled, and what DeepSpeed does on every load).

The gain of a resumed run is its drop in validation loss over the ``--after`` steps,
divided by the uninterrupted run's drop. Prints (and with ``--json`` writes) one JSON object.

Cases (``--case``):

* ``regression``: a linear regression over 107 features held in four tensors of 37, 5, 1
  and 64 elements (so every world size pads), AdamW at a constant lr;
* ``window``: the same regression as 0/1 Adam's local steps see it (:class:`WindowCase`):
  a global batch split over the ranks, H = 2 then 4 after a freeze at step 6, so that
  ``--save-at 12`` falls inside a window of local steps;
* ``lm``: the main job, the char LM of examples/train_lm.py at ``--n-layer``/``--n-embd``
  (see :class:`LMCase`), e.g. ``--case lm --save-at 150 --after 50``.
"""
from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from typing import TYPE_CHECKING

import torch

from hvd_zoadam.bench import group_loss
from hvd_zoadam.bench.lm import add_model_arguments
from hvd_zoadam.comm.thread import run_ranks

if TYPE_CHECKING:
    import argparse
    from types import ModuleType

    from hvd_zoadam.comm.transport import Transport

SIZES = (37, 5, 1, 64)
MODES = ("rank-files", "pooled", "grouped", "zeroed")
_INIT_LOCK = threading.Lock()  # thread-ranks share torch's global RNG: one model init at a time


class Regression(torch.nn.Module):
    """y = Σ_k x_k · w_k over four weight tensors of 37, 5, 1 and 64 elements."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(n)) for n in SIZES)

    def forward(self, x: torch.Tensor):
        return x @ torch.cat(list(self.w))


def _teacher() -> torch.Tensor:
    return 0.1 * torch.randn(sum(SIZES), generator=torch.Generator().manual_seed(7))


def _regression_batch(step: int, rank: int, batch: int = 16):
    gen = torch.Generator().manual_seed(100_003 * step + rank)
    x = torch.randn(batch, sum(SIZES), generator=gen)
    return x, x @ _teacher() + 0.3 * torch.randn(batch, generator=gen)


class RegressionCase:
    """The regression job: AdamW at a constant lr, per-rank batches, a fixed validation set."""

    knobs = dict(var_freeze_step=8, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4)
    lr = 0.01

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.val = _regression_batch(-1, 0, batch=1024)

    def build(self, transport: Transport, steps: int):
        import hvd_zoadam
        model = Regression()
        opt = hvd_zoadam.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=self.lr),
                                              named_parameters=model.named_parameters(), transport=transport,
                                              **self.knobs)
        return model, opt, None

    def loss(self, model: torch.nn.Module, step: int, rank: int):
        x, y = _regression_batch(step, rank)
        return torch.nn.functional.mse_loss(model(x), y)

    def val_loss(self, model: torch.nn.Module) -> float:
        with torch.no_grad():
            return torch.nn.functional.mse_loss(model(self.val[0]), self.val[1]).item()


class WindowCase(RegressionCase):
    """The regression saved inside a window of local steps: ``var_freeze_step=6``, the
    ``"steps"`` policy with H = 2 then 4, a global batch of 24 rows per step split over the
    ranks (``torch.tensor_split``: uneven at P = 5), so that a job of any world size trains on
    the same data; AdamW at lr 0.01."""

    knobs = dict(var_freeze_step=6, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4,
                 local_step_policy="steps")

    def __init__(self, args: argparse.Namespace):
        super().__init__(args)
        self.world_size = None

    def build(self, transport: Transport, steps: int):
        self.world_size = transport.world_size
        return super().build(transport, steps)

    def loss(self, model: torch.nn.Module, step: int, rank: int):
        x, y = _regression_batch(step, 0, batch=24)
        x, y = torch.tensor_split(x, self.world_size)[rank], torch.tensor_split(y, self.world_size)[rank]
        return torch.nn.functional.mse_loss(model(x), y)


class LMCase:
    """The main job, examples/train_lm.py: its model, parameter groups, lr schedule (warm-up,
    cosine over the whole run) and 0/1 Adam defaults; rank r's batch at step t is drawn
    from a generator seeded by (t, r), so a resumed run sees the batches the uninterrupted
    one would."""

    def __init__(self, args: argparse.Namespace, train_lm: ModuleType):
        self.args, self.tl = args, train_lm
        text = train_lm.load_corpus()
        chars = sorted(set(text))
        stoi = {c: i for i, c in enumerate(chars)}
        data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
        split = int(0.9 * len(data))
        self.vocab, self.train, self.valid = len(chars), data[:split], data[split:]
        a = args
        self.knobs = dict(var_freeze_step=a.warmup, var_update_scaler=8, local_step_scaler=40, local_step_clipper=8,
                          local_step_policy="lr", scale_block_numel=256)
        self.lr = a.lr
        gen = torch.Generator().manual_seed(12345)
        self.val_batches = [train_lm.get_batch(self.valid, a.batch_size, a.block_size, gen)
                            for _ in range(a.eval_batches)]

    def build(self, transport: Transport, steps: int):
        import hvd_zoadam
        a = self.args
        self.world_size = transport.world_size
        with _INIT_LOCK:
            torch.manual_seed(a.seed)
            model = self.tl.CharGPT(self.vocab, a.block_size, a.n_layer, a.n_embd, a.n_head)
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        inner = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=a.lr, betas=(0.9, 0.98))
        opt = hvd_zoadam.DistributedOptimizer(inner, named_parameters=model.named_parameters(), transport=transport,
                                              **self.knobs)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, self.tl.lr_lambda(a.warmup, steps))

    def _batch(self, step, rank):
        a = self.args
        return self.tl.get_batch(self.train, a.batch_size, a.block_size,
                                 torch.Generator().manual_seed(1_000_003 * step + 1009 * a.seed + rank))

    def loss(self, model: torch.nn.Module, step: int, rank: int):
        """Rank ``rank``'s loss at ``step``. ``--lm-batches per-rank``: its own batch of
        ``--batch-size`` sequences, so a job of P' ranks sees P'/P of the saving job's data per
        step. ``global`` (the default): the saving job's P batches of every step split over the
        ranks by contiguous groups, the loss weighted by the group's share
        (:func:`hvd_zoadam.bench.group_loss`), so the ranks' average gradient is that of the
        same global batch at any P' (identical to ``per-rank`` at P' = P)."""
        data_ranks = self.world_size if self.args.lm_batches == "per-rank" else self.args.ranks
        return group_loss(model, lambda i: self._batch(step, i), _cross_entropy, data_ranks, self.world_size, rank)

    def val_loss(self, model: torch.nn.Module) -> float:
        with torch.no_grad():
            losses = [torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
                      for x, y in self.val_batches]
        return sum(losses) / len(losses)


def _cross_entropy(logits, y):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _job(case, world_size, first, last, *, save=None, load=None, mode=None):
    """Train steps first..last (of a run of ``last`` steps) on ``world_size`` thread-ranks;
    returns rank 0's validation loss at the end (``"end"``) and, with ``save=(prefix, s)``,
    after the checkpoint it saves at step s (``"at_save"``)."""
    from hvd_zoadam import checkpoint

    def body(rank: int, transport: Transport):
        torch.set_num_threads(1)
        # One Numba thread per thread-rank (the setting is per calling thread): with several,
        # kernels called from four threads at once split their reductions differently from
        # run to run, and the exact resume was no longer bitwise on the char LM.
        import numba
        numba.set_num_threads(1)
        model, opt, sched = case.build(transport, last)
        if load is not None:
            if mode == "rank-files":
                extra = checkpoint.load(load, model, opt)
            elif mode in ("pooled", "grouped"):
                extra = checkpoint.load(load, model, opt, exact=False, per_group=mode == "grouped")
            else:
                ckpt = checkpoint.read(load + ".pt")
                model.load_state_dict(ckpt["model"])
                opt.load_state_dict(ckpt["optimizer"])
                opt.load_error_feedback(None)
                extra = ckpt["extra"]
            if sched is not None:
                sched.load_state_dict(extra["scheduler"])
        out = {}
        for t in range(first, last + 1):
            opt.zero_grad()
            case.loss(model, t, rank).backward()
            opt.step()
            if sched is not None:
                sched.step()
            if save is not None and t == save[1]:
                checkpoint.save(save[0], model, opt, scheduler=sched.state_dict() if sched else None)
                out["at_save"] = case.val_loss(model)
        out["end"] = case.val_loss(model)
        return out
    return run_ranks(world_size, body)[0]


def run(args: argparse.Namespace, train_lm: ModuleType | None = None) -> dict:
    case = {"regression": RegressionCase, "window": WindowCase}[args.case](args) if args.case != "lm" \
        else LMCase(args, train_lm)
    p, k = args.ranks, args.after
    report = {"bench": "resume", "case": args.case, "ranks": p, "save_at": args.save_at, "after": k,
              "knobs": case.knobs, "lr": case.lr, "uninterrupted": [], "runs": []}
    for s in args.save_at:
        with tempfile.TemporaryDirectory() as tmp:
            prefix = os.path.join(tmp, "ckpt")
            t0 = time.perf_counter()
            full = _job(case, p, 1, s + k, save=(prefix, s))
            base, gain = full["at_save"], full["at_save"] - full["end"]
            report["uninterrupted"].append({"save_at": s, "val_at_save": base, "val_end": full["end"],
                                            "seconds": time.perf_counter() - t0})
            print(f"uninterrupted P={p}, saved at {s}: {base:.4f} -> {full['end']:.4f}", file=sys.stderr)
            for q in args.to:
                for mode in MODES:
                    if mode == "rank-files" and q != p:
                        continue
                    end = _job(case, q, s + 1, s + k, load=prefix, mode=mode)["end"]
                    row = {"save_at": s, "world_size": q, "mode": mode, "val_loss": end, "gain": (base - end) / gain,
                           "vs_uninterrupted": end / full["end"] - 1}
                    report["runs"].append(row)
                    print(f"  resume P={q} {mode}: {end:.4f} gain {row['gain']:.3f} "
                          f"({row['vs_uninterrupted']:+.3%} vs uninterrupted)", file=sys.stderr)
    report["summary"] = _summary(report["runs"])
    return report


def _summary(runs: list) -> list:
    """Per (world size, mode): the mean and the smallest gain over the save points."""
    keys = sorted({(r["world_size"], r["mode"]) for r in runs})
    out = []
    for q, mode in keys:
        gains = [r["gain"] for r in runs if (r["world_size"], r["mode"]) == (q, mode)]
        out.append({"world_size": q, "mode": mode, "mean_gain": sum(gains) / len(gains), "min_gain": min(gains),
                    "save_points": len(gains)})
        print(f"P'={q} {mode:>10}: mean gain {out[-1]['mean_gain']:.3f}, min {out[-1]['min_gain']:.3f} "
              f"over {len(gains)} save points", file=sys.stderr)
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    ap = sub.add_parser("resume", help="what a resume at another world size keeps of the error feedback")
    ap.add_argument("--case", choices=("regression", "window", "lm"), default="regression")
    ap.add_argument("--ranks", type=int, default=4, help="world size of the saving job")
    ap.add_argument("--save-at", type=lambda v: [int(x) for x in v.split(",")], default=[12],
                    help="steps after which the job saves (comma-separated: one uninterrupted run each)")
    ap.add_argument("--after", type=int, default=6, help="steps run after the save")
    ap.add_argument("--to", type=lambda s: [int(v) for v in s.split(",")], default=[4, 2, 3],
                    help="world sizes that resume (comma-separated)")
    ap.add_argument("--json", help="also write the report here")
    lm = ap.add_argument_group("lm case")
    lm.add_argument("--lm-batches", choices=("global", "per-rank"), default="global",
                    help="global: every world size trains on the saving job's P batches per step (the resume "
                         "alone is measured); per-rank: each rank its own batch (P'/P of the data per step)")
    add_model_arguments(lm, warmup_help="LR warm-up steps, also the variance freeze")
    ap.set_defaults(run=lambda args: run(args, _lm_case(args)))


def _lm_case(args):
    """The char LM of examples/train_lm.py for ``--case lm``, else None."""
    if args.case != "lm":
        return None
    from hvd_zoadam.bench.lm import _train_lm
    return _train_lm()
