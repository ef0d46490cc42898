"""``python -m hvd_zoadam.bench step --count``: what one optimizer step launches, per step kind.

    python -m hvd_zoadam.bench step --count --path cpu|cuda-sim|cuda --world-size P --json OUT

For each step kind, one step of rank 0 (of P thread ranks in this process) is counted after
four steps of warm-up (step 5, of that kind): the numba kernel launches (counted where Python calls a kernel: a CPU
kernel's dispatcher, a CUDA kernel's launch; not the device functions a kernel calls), the torch
ops (every op that reaches torch's dispatcher, views included), the collectives (the
transport's ``start``, flags and set-up messages), the host synchronisations (ops of hvd_zoadam's
that read a tensor's value on the host: ``item``, ``bool()``, ``equal``, ``nonzero``; torch's
optimizers read their host-side step counters, which costs no synchronisation), the
allocations (tensors an op returns in new storage) and the bytes moved per parameter (each
non-view op's tensor inputs and outputs, and each kernel launch's array arguments, counted
once each, over the number of parameters). ``--path cuda-sim`` runs the optimizer's CUDA path
on CPU tensors under numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``; the command sets it
and runs itself again when it is not set); ``--path cuda`` on a GPU, where the host
synchronisations torch itself reports (``torch.cuda.set_sync_debug_mode``) are counted too,
as ``cuda_syncs``.

The model is the layout of ``bench step``'s GPT on the GPU (8 layers of width 1024, 102 tensors,
24 buckets at the default ``bucket_cap_mb``) with every tensor and the bucket cap 1024 times
smaller (:func:`scaled_model`): the same tensors in the same buckets, as the counts depend on the
tensors and buckets, not on their sizes (bytes are counted per parameter). Overlap is off,
so that all of a step's work happens inside ``step()``. Prints and writes
``{"buckets": B, "params": n, "kinds": {kind: {"numba_launches", "torch_ops", "collectives",
"host_syncs", "allocations", "transport_ops", "transport_allocations", "bytes_per_param"}}}``:
the ops and allocations that a transport's own collective calls (``start``, ``wait``, the flags)
make, here the thread transport's copies of each message, are ``transport_ops`` and
``transport_allocations``, and their bytes are not counted: another transport does other work
there (MPI reads the buffers it is given).
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from typing import TYPE_CHECKING

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

if TYPE_CHECKING:
    import argparse

    from hvd_zoadam.comm.transport import Transport

SYNC_OPS = {"_local_scalar_dense", "equal", "is_nonzero", "nonzero"}
DIVISOR = 1024  # the counted model is the reference layout this many times smaller
# ... and under the CUDA simulator 16 times smaller again (6,231 parameters in the same 24 buckets):
# the simulator runs a Python thread per element for each kernel launch
SIM_DIVISOR = 16384
KIND_CONFIGS = {"variance": dict(var_freeze_step=10 ** 9, var_update_scaler=10 ** 9),
                "compressed": dict(var_freeze_step=10 ** 9, var_update_scaler=1),
                "local": dict(var_freeze_step=1, local_step_policy="steps", local_step_scaler=1,
                              local_step_clipper=1 << 20),
                "sync": dict(var_freeze_step=1)}


class Counter(TorchDispatchMode):
    """Counts what reaches torch's dispatcher on the thread that entered it (modes are per thread)."""

    def __init__(self):
        super().__init__()
        self.torch_ops = self.host_syncs = self.allocations = self.cuda_syncs = 0
        self.transport_ops = self.transport_allocations = 0
        self.inside_transport = 0  # > 0 while a transport's collective call runs (see _count_calls)
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.inside_transport:  # the transport's own work (the thread transport's copies): apart, bytes unread
            self.transport_ops += 1
            self.transport_allocations += 0 if _is_view(func) else _new_storages(args, kwargs, out)
            return out
        self.torch_ops += 1
        name = func.overloadpacket.__name__
        if name in SYNC_OPS and _from_hvd_zoadam():
            self.host_syncs += 1
        if not _is_view(func):
            self.allocations += _new_storages(args, kwargs, out)
            ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            self.bytes += sum(t.numel() * t.element_size() for t in {id(t): t for t in ins + outs}.values())
        return out


def _is_view(func) -> bool:
    return any(r.alias_info is not None for r in func._schema.returns)


def _new_storages(args, kwargs, out) -> int:
    """How many of a non-view op's outputs live in storage none of its inputs had."""
    storages = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    return sum(1 for t in tree_leaves(out) if isinstance(t, torch.Tensor)
               and t.untyped_storage().data_ptr() not in storages)


def _from_hvd_zoadam() -> bool:
    """Whether hvd_zoadam's own code made the op: a sync torch's optimizers make reads a step
    counter that lives on the host (``capturable=False``), which costs nothing on a GPU."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("hvd_zoadam") and not name.startswith("hvd_zoadam.bench"):
            return True
        if name.startswith("torch.optim"):
            return False
        frame = frame.f_back
    return False


class Launches:
    """Counts numba kernel launches made from ``thread``: calls of the CPU kernels' dispatchers in
    :mod:`hvd_zoadam.native.cpu` and CUDA kernel launches (the simulator's or numba-cuda's), and the
    bytes of their array arguments. A context manager; restores what it patched."""

    def __init__(self, thread: threading.Thread):
        self.thread = thread
        self.launches = 0
        self.bytes = 0
        self._undo = []

    def _seen(self, args):
        if threading.current_thread() is not self.thread:
            return
        self.launches += 1
        self.bytes += sum(int(getattr(a, "nbytes", 0)) for a in args if hasattr(a, "shape"))

    def __enter__(self):
        from numba.core.registry import CPUDispatcher

        from hvd_zoadam.native import cpu
        for name, fn in vars(cpu).items():
            if isinstance(fn, CPUDispatcher):
                self._wrap(cpu, name, fn)
        try:
            from numba.cuda.simulator.kernel import FakeCUDAKernel
            self._wrap_call(FakeCUDAKernel, lambda k: not k._device)
        except ImportError:
            pass
        from numba import config
        if not config.ENABLE_CUDASIM:  # numba-cuda's dispatcher does not import under the simulator
            try:
                from numba.cuda.dispatcher import _LaunchConfiguration
                self._wrap_call(_LaunchConfiguration, lambda k: True)
            except ImportError:
                pass
        return self

    def _wrap(self, module, name, fn):
        def counted(*args: object, **kwargs: object):
            self._seen(args)
            return fn(*args, **kwargs)
        setattr(module, name, counted)
        self._undo.append(lambda: setattr(module, name, fn))

    def _wrap_call(self, cls, is_launch):
        original = cls.__call__

        def counted(kernel: object, *args: object, **kwargs: object):
            if is_launch(kernel):
                self._seen(args)
            return original(kernel, *args, **kwargs)
        cls.__call__ = counted
        self._undo.append(lambda: setattr(cls, "__call__", original))

    def __exit__(self, *exc):
        for undo in reversed(self._undo):
            undo()


def reference_layout() -> list[tuple[str, int]]:
    """``(name, numel)`` of the parameters of ``bench step``'s GPT on the GPU (CharGPT, 8 layers of
    width 1024: 102 tensors, 101 M parameters), read from a model on the meta device."""
    from hvd_zoadam.bench.lm import _train_lm
    with torch.device("meta"):
        model = _train_lm().CharGPT(84, 128, 8, 1024, 4)
    return [(name, p.numel()) for name, p in model.named_parameters()]


def scaled_model(divisor: int) -> tuple[torch.nn.Module, float]:
    """The reference layout with each tensor ``divisor`` times smaller (1-D, at least one element)
    and ``bucket_cap_mb`` as much smaller: the same tensors in the same 24 buckets (checked).
    Returns ``(model, bucket_cap_mb)``."""
    import math

    from hvd_zoadam.core.layout import make_buckets
    layout = reference_layout()
    cap = int(25 * 2 ** 20 / 4)
    small = [max(1, math.ceil(n / divisor)) for _, n in layout]
    if make_buckets(small, cap // divisor) != make_buckets([n for _, n in layout], cap):
        raise ValueError(f"the layout {divisor} times smaller is bucketed otherwise; use a smaller --divisor")
    model = torch.nn.Module()
    gen = torch.Generator().manual_seed(0)
    for (name, _), n in zip(layout, small):
        model.register_parameter(name.replace(".", "_"), torch.nn.Parameter(torch.randn(n, generator=gen) * 0.02))
    return model, (cap // divisor) * 4 / 2 ** 20


def count(path: str, world_size: int, divisor: int | None = None, kinds: tuple = tuple(KIND_CONFIGS)) -> dict:
    """The counts of one step of each of ``kinds`` (default all four), rank 0 of ``world_size``
    thread ranks (see the module docstring). ``path``: ``"cpu"``, ``"cuda-sim"`` (the CUDA
    simulator must be on) or ``"cuda"`` (a GPU). ``divisor``: how many times smaller than the
    reference layout each tensor is (default :data:`DIVISOR`, :data:`SIM_DIVISOR` under the
    simulator; every divisor keeps the 24 buckets, or raises ValueError)."""
    divisor = divisor or (SIM_DIVISOR if path == "cuda-sim" else DIVISOR)
    import hvd_zoadam
    from hvd_zoadam import native
    from hvd_zoadam.comm.thread import ThreadGroup
    if path == "cuda-sim":
        native.use_cuda_kernels_on_cpu()
    device = torch.device("cuda" if path == "cuda" else "cpu")
    cap = scaled_model(divisor)[1]
    report = {"path": path, "world_size": world_size, "divisor": divisor, "bucket_cap_mb": cap, "kinds": {}}

    def body(rank: int, transport: Transport, knobs: dict, out: dict):
        model = scaled_model(divisor)[0].to(device)
        gen = torch.Generator().manual_seed(1 + rank)
        opt = hvd_zoadam.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
                                              named_parameters=model.named_parameters(), transport=transport,
                                              bucket_cap_mb=cap, overlap=False, **knobs)
        for t in range(5):
            for p in model.parameters():
                p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(device)
            if t < 4 or rank != 0:  # the counting patches are global: one rank counts
                opt.step()
                continue
            calls = {"collectives": 0}
            mode, launches = Counter(), Launches(threading.current_thread())
            for name in ("start", "wait", "allgather_flag", "allgather_object"):
                _count_calls(transport, name, calls, mode, collective=name != "wait")
            with launches, mode, _counting_tolist(mode), _counting_cuda_syncs(mode, device):
                opt.step()
            out.update(buckets=len(opt._engine.buckets), params=sum(p.numel() for p in model.parameters()),
                       kind=opt.schedule.kind(5, lr=1e-3, freeze_lr=1e-3).value,
                       numba_launches=launches.launches, torch_ops=mode.torch_ops,
                       collectives=calls["collectives"], host_syncs=mode.host_syncs,
                       allocations=mode.allocations, bytes=mode.bytes + launches.bytes, cuda_syncs=mode.cuda_syncs,
                       transport_ops=mode.transport_ops, transport_allocations=mode.transport_allocations)

    for kind in kinds:
        knobs, out = KIND_CONFIGS[kind], {}
        group = ThreadGroup(world_size, timeout_s=600)
        threads = [threading.Thread(target=body, args=(r, t, knobs, out if r == 0 else {}))
                   for r, t in enumerate(group.transports())]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if out.get("kind") != kind:
            raise RuntimeError(f"bench step --count: the step counted as {kind} was {out.get('kind')}")
        report["buckets"], report["params"] = out["buckets"], out["params"]
        report["kinds"][kind] = {k: out[k] for k in ("numba_launches", "torch_ops", "collectives", "host_syncs",
                                                     "allocations", "transport_ops", "transport_allocations")}
        report["kinds"][kind]["bytes_per_param"] = round(out["bytes"] / out["params"], 1)
        if path == "cuda":
            report["kinds"][kind]["cuda_syncs"] = out["cuda_syncs"]
    report["adamw_foreach"] = _adamw_counts(divisor, device)
    return report


def _adamw_counts(divisor: int, device: torch.device) -> dict:
    """The same counts for ``torch.optim.AdamW(foreach=True)``'s step on the same model."""
    model = scaled_model(divisor)[0].to(device)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-2
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    for _ in range(3):
        opt.step()
    mode = Counter()
    with mode, _counting_cuda_syncs(mode, device):
        opt.step()
    n = sum(p.numel() for p in model.parameters())
    out = {"numba_launches": 0, "torch_ops": mode.torch_ops, "collectives": 0, "host_syncs": mode.host_syncs,
           "allocations": mode.allocations, "bytes_per_param": round(mode.bytes / n, 1)}
    return {**out, "cuda_syncs": mode.cuda_syncs} if device.type == "cuda" else out


@contextlib.contextmanager
def _counting_cuda_syncs(mode: Counter, device: torch.device):
    """On a GPU, the synchronisations ``torch.cuda.set_sync_debug_mode("warn")`` reports on
    ``mode``'s thread counted as its ``cuda_syncs`` (the debug mode is the process's: other
    threads' reports are dropped, uncounted); elsewhere nothing."""
    if device.type != "cuda":
        yield
        return
    import warnings
    thread = threading.current_thread()

    def show(message: Warning | str, category: type, *args: object, **kwargs: object):
        if "synchroniz" not in str(message).lower():
            return original(message, category, *args, **kwargs)
        if threading.current_thread() is thread:
            mode.cuda_syncs += 1
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        original, warnings.showwarning = warnings.showwarning, show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")


@contextlib.contextmanager
def _counting_tolist(mode: Counter):
    """``Tensor.tolist`` (which reads the values without an op a dispatch mode sees) counted as a
    host synchronisation of ``mode``'s thread when hvd_zoadam's code calls it."""
    original, thread = torch.Tensor.tolist, threading.current_thread()

    def tolist(t: torch.Tensor):
        if threading.current_thread() is thread and _from_hvd_zoadam():
            mode.host_syncs += 1
        return original(t)
    torch.Tensor.tolist = tolist
    try:
        yield
    finally:
        torch.Tensor.tolist = original


def _count_calls(obj, name: str, calls: dict, mode: Counter, collective: bool = True) -> None:
    """``obj.name`` wrapped: a ``collective`` call made outside any other of the transport's counts
    one (``allgather_flag`` runs ``start`` and ``wait`` inside: one collective), and the torch ops
    run inside count as ``mode``'s ``transport_ops``."""
    original = getattr(obj, name)

    def counted(*args: object, **kwargs: object):
        if collective and not mode.inside_transport:
            calls["collectives"] += 1
        mode.inside_transport += 1
        try:
            return original(*args, **kwargs)
        finally:
            mode.inside_transport -= 1
    setattr(obj, name, counted)


def run(args: argparse.Namespace) -> dict:
    """``bench step --count``; with ``--path cuda-sim`` and the simulator off, runs itself again
    with ``NUMBA_ENABLE_CUDASIM=1`` (numba reads it at import) and returns that run's report."""
    from numba import config
    if args.path == "cuda-sim" and not config.ENABLE_CUDASIM:
        proc = subprocess.run([sys.executable, "-m", "hvd_zoadam.bench", *sys.argv[1:]], capture_output=True,
                              text=True, env={**os.environ, "NUMBA_ENABLE_CUDASIM": "1"})
        if proc.returncode != 0:
            raise RuntimeError(f"bench step --count under the CUDA simulator failed:\n{proc.stderr[-3000:]}")
        import json
        return {k: v for k, v in json.loads(proc.stdout).items() if k != "provenance"}
    if args.path == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench step --count --path cuda: torch sees no CUDA device here (--path cuda-sim runs "
                         "the CUDA path under numba's simulator)")
    return count(args.path, args.world_size)
