"""``python -m hvd_zoadam.bench kernels``: the 1-bit compressor kernels against the copy
bandwidth of the same run, on the CPU or a CUDA device."""
from __future__ import annotations

import time
from types import SimpleNamespace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

    import torch

KERNEL_TARGETS = {"cpu": {"worker_compress": 0.5, "decompress_momentum": 0.5},
                  "cuda": {k: 0.6 for k in ("worker_compress", "server_reduce", "decompress",
                                            "decompress_momentum", "decompress_sync")}}


def cmd_kernels(args: argparse.Namespace) -> dict:
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
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    if args.params < 1:
        raise SystemExit(f"--params must be at least 1, got {args.params}")
    if args.threads:
        numba.set_num_threads(args.threads)
    torch.set_num_threads(numba.get_num_threads())
    t = _inputs(args)
    res = {"benchmark": "kernels", "device": device, "numel": args.numel, "dtype": args.dtype,
           "world_size": args.world_size, "scale_block_numel": args.block,
           "threads": numba.get_num_threads() if device == "cpu" else None, "kernels": {}}
    if device == "cuda":
        res["gpu"] = torch.cuda.get_device_name()
    targets = KERNEL_TARGETS[device]
    copies = []
    for name, (fn, nbytes, traffic) in _kernels(t).items():
        # the copy and the kernel alternate, so that a change in the machine's load hits both alike
        t.copy(), fn()
        pairs = [(_timed(device, t.copy), _timed(device, fn)) for _ in range(args.repeats)]
        copy_gbs = 4 * t.big / min(c for c, _ in pairs) / 1e9
        seconds = min(k for _, k in pairs)
        copies.append(copy_gbs)
        ratio = nbytes / seconds / 1e9 / copy_gbs
        res["kernels"][name] = {"ms": seconds * 1e3, "GBps": nbytes / seconds / 1e9, "copy_GBps": copy_gbs,
                                "vs_copy": ratio,
                                # memory speed: bytes read and written per second against the copy's 8 per element
                                "traffic_vs_copy": traffic / seconds / (2 * copy_gbs * 1e9)}
        if name in targets:
            res["kernels"][name].update(target_vs_copy=targets[name], met=ratio >= targets[name])
    res["copy_GBps"] = max(copies)
    res["note"] = ("worker_compress is the whole worker side (scales, signs, error; in one pass over memory, "
                   "on the CPU and on CUDA, when every scale block has at most 4096 elements, as here) with the "
                   "scales left on the device; targets hold at 2^24 float32 elements"
                   + ("" if device == "cuda" else ", one thread"))
    return res


def _inputs(args) -> SimpleNamespace:
    """The kernels' buffers at ``--numel`` elements on ``--device``, a plan of ``--block`` elements
    per scale and ``--params`` parameters, and the float32 copy that is the bandwidth reference."""
    import torch

    from hvd_zoadam import native
    from hvd_zoadam.core.layout import padded_numel
    device, n, p = args.device, args.numel, args.world_size
    big = padded_numel(n, p)
    offsets = list(range(0, n, args.block)) + [n]
    nseg = len(offsets) - 1
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[args.dtype]
    gen = torch.Generator().manual_seed(0)
    z = lambda *shape: torch.zeros(*shape, device=device)  # noqa: E731
    t = SimpleNamespace(n=n, p=p, big=big, plan=native.Plan(offsets, big, p, 0), err=z(big), scales=z(nseg),
                        serr=z(big // p), sscales=z(nseg), out=z(n), m=z(n), anchor=z(n), param=z(n))
    t.y = torch.randn(big, generator=gen).to(device=device, dtype=dtype)
    t.y[n:] = 0
    t.packed = torch.randint(0, 256, (big // 8,), generator=gen, dtype=torch.uint8).to(device)
    t.recv = torch.randint(0, 256, (p, big // p // 8), generator=gen, dtype=torch.uint8).to(device)
    t.wscales = torch.rand(p, nseg, generator=gen).to(device)
    t.spacked = torch.zeros(big // p // 8, dtype=torch.uint8, device=device)
    t.denom = torch.rand(n, generator=gen).to(device) + 1e-3
    cuts = sorted({min(n, round(i * nseg / args.params) * args.block) for i in range(args.params + 1)})
    t.sizes = [b - a for a, b in zip(cuts, cuts[1:])]            # parameters start at scale-block boundaries
    t.params = list(z(n).split(t.sizes))
    src = torch.randn(big, generator=gen).to(device)
    dst = torch.empty_like(src)  # the bandwidth reference: src -> dst, float32, the bucket's size
    t.copy = lambda: dst.copy_(src)
    return t


def _timed(device: str, fn) -> float:
    """Seconds of one call of ``fn``: CUDA events on the current stream, else ``perf_counter``."""
    import torch
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


def _kernels(t: SimpleNamespace) -> dict:
    """name: (call, bytes counted as its input, bytes it must read and write at least)."""
    import torch

    from hvd_zoadam import native
    n, big, c = t.n, t.big, t.big // t.p

    def sync(param: torch.Tensor | list[torch.Tensor], **kw: float):
        return lambda: native.decompress_sync(t.packed, t.wscales, t.plan, anchor=t.anchor, param=param,
                                              exp_avg=t.m, denom=t.denom, factor=0.5, **kw)
    return {
        "worker_compress": (lambda: native.worker_compress(t.y, t.err, t.plan, t.scales, t.packed),
                            t.y.element_size() * big, (t.y.element_size() + 8) * big + big // 8),  # y, e in; e out
        "server_reduce": (lambda: native.server_reduce(t.recv, t.wscales, t.serr, t.plan, t.spacked, t.sscales),
                          4 * c, t.p * c // 8 + 8 * c + c // 8),          # P chunks of bits; e_s in/out; bits
        "decompress": (lambda: native.decompress(t.packed, t.wscales, t.plan, t.out), 4 * n, big // 8 + 4 * n),
        "decompress_momentum": (lambda: native.decompress_momentum(t.packed, t.wscales, t.plan, t.m, 0.9), 4 * n,
                                big // 8 + 8 * n),                        # bits; m in and out
        "decompress_sync": (sync(t.param), 4 * n, big // 8 + 20 * n),     # bits, x_a, s in; x, m, x_a out
        # a SYNC step's rebuild of --params parameters: straight into them (float32 on the CPU),
        # or into the flat x and then copied into them (the path of fp16 parameters and CUDA)
        "decompress_sync_params": (sync(t.params), 4 * n, big // 8 + 20 * n),
        # the same with the window's weight decay (AdamW): the anchor scaled inside the same pass
        "decompress_sync_decay": (sync(t.params, decay_product=0.9999), 4 * n, big // 8 + 20 * n),
        "decompress_sync_scatter": (lambda: (sync(t.param)(), torch._foreach_copy_(t.params,
                                                                                   list(t.param.split(t.sizes)))),
                                    4 * n, big // 8 + 28 * n),            # and x read, the parameters written
    }

def add_parser(sub: argparse._SubParsersAction) -> None:
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
    ke.set_defaults(run=cmd_kernels)
