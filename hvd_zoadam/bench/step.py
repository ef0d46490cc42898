"""``python -m hvd_zoadam.bench step``: the optimizer step alone at P = 1 on the char LM's
parameters, each hvd_zoadam step kind against ``torch.optim.AdamW(foreach=True)`` and
``AdamW(fused=True)``; with
``--count``, what one step of each kind launches (:mod:`hvd_zoadam.bench.count`)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from hvd_zoadam.bench import breakdown as _breakdown_mod

if TYPE_CHECKING:
    import argparse


def cmd_step(args: argparse.Namespace) -> dict:
    """The optimizer step alone at P = 1: each hvd_zoadam step kind vs AdamW(foreach=True) and
    AdamW(fused=True).

    ``--device cuda`` puts the model on the GPU (times end with a device synchronisation).
    Without Horovod installed (a bare GPU machine) the optimizer gets a one-rank thread
    transport instead: at P = 1 nothing is sent either way.
    """
    import torch

    from hvd_zoadam import StepKind
    lm = __import__("hvd_zoadam.bench.lm", fromlist=["_train_lm"])._train_lm()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    transport, world = _transport()
    torch.set_num_threads(args.threads)

    def model():
        torch.manual_seed(0)
        m = lm.CharGPT(84, 128, args.n_layer, args.n_embd, 4).to(args.device)
        for p in m.parameters():
            p.grad = torch.randn_like(p) * 1e-2
        return m

    m = model()
    adamw = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True)
    fused = _fused_adamw(model())
    for _ in range(3):
        adamw.step()
        if fused is not None:
            fused.step()
    out = {"benchmark": "step", "world_size": world, "params": sum(p.numel() for p in m.parameters()),
           "device": args.device, "threads": args.threads, "kinds": {}}
    if args.device == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
    # One optimizer per kind, with a schedule that makes every timed step that kind.
    configs = {StepKind.VARIANCE: dict(var_freeze_step=10 ** 9, var_update_scaler=10 ** 9),
               StepKind.COMPRESSED: dict(var_freeze_step=10 ** 9, var_update_scaler=1),
               StepKind.LOCAL: dict(var_freeze_step=1, local_step_policy="steps", local_step_scaler=1,
                                    local_step_clipper=1 << 20),
               StepKind.SYNC: dict(var_freeze_step=1)}
    for kind, cfg in configs.items():
        out["kinds"][kind.value] = _time_kind(args, model(), transport, cfg, adamw, fused)
    out["adamw_foreach_ms"] = min(k["adamw_foreach_ms"] for k in out["kinds"].values())
    out["adamw_fused_ms"] = None if fused is None else min(k["adamw_fused_ms"] for k in out["kinds"].values())
    # LOCAL reads and writes fewer bytes than AdamW: at most foreach's time on the CPU, and on a
    # GPU, where both are bound by memory, at most fused's
    on_gpu = args.device == "cuda" and fused is not None
    local = out["kinds"]["local"]["vs_adamw_fused" if on_gpu else "vs_adamw_foreach"]
    out["target"] = ("each kind <= 1.3x AdamW(foreach=True) and LOCAL <= 1.0x AdamW("
                     + ("fused" if on_gpu else "foreach") + "=True), timed alternately with them")
    out["met"] = all(k["vs_adamw_foreach"] <= 1.3 for k in out["kinds"].values()) and local <= 1.0
    return out


def _fused_adamw(m):
    """``AdamW(fused=True)`` over ``m``'s parameters, or None where this torch has no fused
    AdamW for their device (the CPU's came with torch 2.4)."""
    import torch
    try:
        return torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
    except RuntimeError:
        return None


def _transport():
    """``(transport, world size)``: Horovod's when it is installed, else one thread rank (a bare
    GPU machine): at P = 1 nothing is sent either way."""
    try:
        import horovod.torch as hvd
        hvd.init()
        return "auto", hvd.size()
    except ImportError:
        from hvd_zoadam.comm.thread import ThreadGroup
        return ThreadGroup(1).transports()[0], 1


def _sync(device: str):
    """What ends a timed region: a device synchronisation on CUDA, nothing on the CPU."""
    import torch
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def _timed(step, n: int, sync) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    sync()
    return (time.perf_counter() - t0) / n


def _time_kind(args, m, transport, cfg: dict, adamw, fused) -> dict:
    """One step kind's optimizer on model ``m`` (knobs ``cfg``), timed alternately with ``adamw``
    (AdamW(foreach=True)) and ``fused`` (AdamW(fused=True)), best of ``--repeats`` each, and its
    breakdown."""
    import torch

    import hvd_zoadam
    sync = _sync(args.device)
    opt = hvd_zoadam.DistributedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3),
                                          named_parameters=m.named_parameters(), transport=transport, **cfg)
    for _ in range(4):
        opt.step()
    seen = opt._next_kind()[1]
    # AdamW and the kind alternate, so that a change in the machine's load hits both alike
    no_fused = lambda: None  # noqa: E731
    runs = [(_timed(adamw.step, args.iters, sync), _timed(fused.step if fused else no_fused, args.iters, sync),
             _timed(opt.step, args.iters, sync)) for _ in range(args.repeats)]
    base, base_fused, t = (min(r[i] for r in runs) for i in range(3))
    return {"ms": t * 1e3, "adamw_foreach_ms": base * 1e3, "vs_adamw_foreach": t / base,
            "adamw_fused_ms": base_fused * 1e3 if fused else None, "vs_adamw_fused": t / base_fused if fused else None,
            "measured_kind": seen.value, "breakdown_ms": _step_breakdown(opt, args.iters, sync)}


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


def add_parser(sub: argparse._SubParsersAction) -> None:
    st = sub.add_parser("step", help="the optimizer step alone at P = 1 vs AdamW(foreach=True) and "
                                     "AdamW(fused=True)")
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
    st.add_argument("--path", choices=["cpu", "cuda-sim", "cuda"], default="cpu",
                    help="with --count: the CPU path, the CUDA path under numba's CUDA simulator (on a layout 16 "
                         "times smaller than the others' 1024: the same 24 buckets, 6,231 parameters), or on a GPU")
    st.add_argument("--world-size", type=int, default=2, help="with --count: thread ranks")
    st.set_defaults(run=run)


def run(args: argparse.Namespace) -> dict:
    if args.count:
        from hvd_zoadam.bench import count
        return count.run(args)
    return cmd_step(args)
