"""``python -m hvd_zoadam.info``: an environment report, in the spirit of ``horovodrun --check-build``.

Prints what hvd_zoadam will run on: which front ends this environment can run (torchrun,
Horovod, mpirun); Horovod's frameworks, controllers and tensor operations; the MPI library and
whether it is CUDA-aware; mpi4py and its thread level; Numba (CUDA) and the kernel threads each
rank will run, with a warning when they oversubscribe the cores; torch and its devices; and
which transport ``"auto"`` picks. Run it as the job runs (``torchrun --nproc-per-node 8 -m
hvd_zoadam.info``) or say the ranks per host (``--ranks-per-host 8``). ``--json`` prints the
same as one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os


def _horovod() -> dict:
    try:
        import horovod
        import horovod.torch as hvd
    except ImportError as exc:
        return {"installed": False, "error": str(exc)}
    return {"installed": True, "version": horovod.__version__,
            "controllers": {"mpi": hvd.mpi_built(), "gloo": hvd.gloo_built()},
            "tensor_operations": {"nccl": hvd.nccl_built() != 0, "ddl": hvd.ddl_built(), "ccl": hvd.ccl_built(),
                                  "mpi": hvd.mpi_built(), "gloo": hvd.gloo_built()},
            "cuda_built": hvd.cuda_built(), "rocm_built": hvd.rocm_built()}


def _mpi() -> dict:
    out = {}
    try:
        import mpi4py
        out["mpi4py"] = mpi4py.__version__
        mpi4py.rc.initialize = False  # report without starting MPI
        from mpi4py import MPI
        out["library"] = MPI.Get_library_version().strip().splitlines()[0]
        out["standard"] = "%d.%d" % MPI.Get_version()
        out["thread_level_requested"] = mpi4py.rc.thread_level
    except Exception as exc:  # noqa: BLE001 - a report, not a check
        out.setdefault("mpi4py", None)
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["cuda_aware"] = _cuda_aware_mpi()
    return out


def _cuda_aware_mpi():
    """Open MPI's MPIX_Query_cuda_support(), when the library has it; None when unknown."""
    from hvd_zoadam.comm.mpi import query_mpix_cuda_support
    return query_mpix_cuda_support()


def _numba() -> dict:
    try:
        import numba
        from numba import cuda
    except ImportError as exc:
        return {"installed": False, "error": str(exc)}
    try:
        cuda_ok = bool(cuda.is_available())
    except Exception:  # noqa: BLE001
        cuda_ok = False
    return {"installed": True, "version": numba.__version__, "threads": numba.config.NUMBA_NUM_THREADS,
            "threading_layer": numba.config.THREADING_LAYER, "cuda_available": cuda_ok,
            "cuda_simulator": os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"}


def _threads(ranks_per_host: int | None) -> dict:
    """The CPU kernels' threads per rank for ``ranks_per_host`` ranks (None: as the launcher's
    environment says, else 1), and whether the ranks together oversubscribe the cores."""
    from hvd_zoadam import native
    from hvd_zoadam.comm.select import launcher_ranks_on_this_host
    source = "--ranks-per-host"
    if ranks_per_host is None:
        ranks_per_host = launcher_ranks_on_this_host()
        source = "the launcher's environment"
    if ranks_per_host is None:
        ranks_per_host, source = 1, "not launched (pass --ranks-per-host N, or run under the launcher)"
    per_rank = native.threads_per_rank(ranks_per_host)
    cores = os.cpu_count() or 1
    return {"ranks_per_host": ranks_per_host, "ranks_per_host_from": source, "threads_per_rank": per_rank,
            "cores": cores, "user_set": "NUMBA_NUM_THREADS" in os.environ,
            "oversubscribed": per_rank * ranks_per_host > cores}


def _front_ends(horovod: dict, mpi: dict) -> dict:
    """Which front ends this environment can run, each with why not where it cannot."""
    import torch.distributed as dist
    out = {"hvd_zoadam.distributed (torchrun)": None if dist.is_available() else
           "this torch build has no torch.distributed"}
    out["hvd_zoadam.DistributedOptimizer (horovodrun)"] = None if horovod.get("installed") else \
        "Horovod is not installed (scripts/setup.sh builds it)"
    out["hvd_zoadam.mpi (mpirun, srun)"] = None if mpi.get("mpi4py") and "library" in mpi else \
        ("mpi4py is not installed: pip install 'hvd_zoadam[mpi]' (needs an MPI library)"
         if not mpi.get("mpi4py") else f"mpi4py cannot load MPI: {mpi.get('error')}")
    return out


def _torch() -> dict:
    import torch
    return {"version": torch.__version__, "cuda_available": torch.cuda.is_available(),
            "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            "cpu_threads": torch.get_num_threads()}


def _transport_choice(horovod: dict) -> str:
    """What transport="auto" resolves to (it depends on how the job is launched)."""
    alone = ("torch.distributed when a process group is initialised and Horovod is not (torchrun); mpi (mpi4py "
             "alone, no Horovod) where mpi4py has initialised MPI and neither is, and always under hvd_zoadam.mpi")
    if not horovod.get("installed"):
        return alone + "; Horovod is not installed here"
    return (alone + "; with Horovod: mpi (mpi4py) when Horovod runs the MPI controller with MPI_THREAD_MULTIPLE "
            "and mpi4py imports (mpirun, horovodrun --mpi, srun); gloo (a Gloo group of hvd_zoadam's beside "
            "Horovod's) under horovodrun --gloo outside elastic jobs, for CPU tensors; otherwise horovod "
            "(Horovod's alltoall/allgather)")


def _kernels(numba_info: dict, torch_info: dict) -> str:
    """Which compressor kernels the parameters' devices get here."""
    cpu = "CPU tensors: Numba CPU kernels"
    if numba_info.get("cuda_simulator"):
        return cpu + "; CUDA: numba's CUDA simulator is on (NUMBA_ENABLE_CUDASIM=1), for tests only"
    if torch_info["cuda_available"] and numba_info.get("cuda_available"):
        return cpu + "; CUDA tensors: numba.cuda kernels (never yet run on a GPU by this project's tests)"
    if torch_info["cuda_available"]:
        return cpu + "; CUDA tensors: unavailable, numba sees no CUDA device (install numba-cuda and the CUDA toolkit)"
    return cpu + "; CUDA tensors: no CUDA device here"


def report(ranks_per_host: int | None = None) -> dict:
    horovod = _horovod()
    import hvd_zoadam
    numba_info, torch_info, mpi = _numba(), _torch(), _mpi()
    return {"hvd_zoadam": hvd_zoadam.__version__, "front_ends": _front_ends(horovod, mpi), "horovod": horovod,
            "mpi": mpi, "numba": numba_info, "threads": _threads(ranks_per_host), "torch": torch_info,
            "auto_transport": _transport_choice(horovod), "kernels": _kernels(numba_info, torch_info)}


def _print(rep: dict) -> None:
    def mark(flag: bool):
        return "[X]" if flag else "[ ]"
    h = rep["horovod"]
    print(f"hvd_zoadam v{rep['hvd_zoadam']}\n\nFront ends:")
    for name, why_not in rep["front_ends"].items():
        print(f"    {mark(why_not is None)} {name}{'' if why_not is None else ': ' + why_not}")
    print()
    if h.get("installed"):
        print(f"Horovod v{h['version']}\n\nAvailable Controllers:")
        for k, v in h["controllers"].items():
            print(f"    {mark(v)} {k.upper() if k == 'mpi' else k.capitalize()}")
        print("\nAvailable Tensor Operations:")
        for k, v in h["tensor_operations"].items():
            print(f"    {mark(v)} {k.upper() if k != 'gloo' else 'Gloo'}")
    else:
        print(f"Horovod: not importable ({h.get('error')})")
    m = rep["mpi"]
    print(f"\nMPI: {m.get('library', 'not found')}")
    print(f"    mpi4py: {m.get('mpi4py') or 'not installed'}; thread level requested: "
          f"{m.get('thread_level_requested', '-')}")
    aware = {True: "yes", False: "no", None: "unknown"}[m.get("cuda_aware")]
    print(f"    CUDA-aware: {aware}")
    n = rep["numba"]
    print(f"\nNumba: {n.get('version', 'not installed')}; "
          f"CUDA {'available' if n.get('cuda_available') else 'not available'}"
          f"{' (simulator)' if n.get('cuda_simulator') else ''}")
    th = rep["threads"]
    print(f"kernel threads: {th['threads_per_rank']} per rank"
          f"{' (NUMBA_NUM_THREADS)' if th['user_set'] else ''}, {th['ranks_per_host']} rank(s) per host "
          f"({th['ranks_per_host_from']}), {th['cores']} cores")
    if th["oversubscribed"]:
        print(f"    WARNING: {th['threads_per_rank'] * th['ranks_per_host']} threads on {th['cores']} cores: the ranks "
              "will starve each other; unset NUMBA_NUM_THREADS or set it to "
              f"{max(1, th['cores'] // th['ranks_per_host'])}")
    t = rep["torch"]
    devices = ", ".join(t["cuda_devices"]) or "none"
    print(f"torch: {t['version']}; CUDA devices: {devices}; CPU threads {t['cpu_threads']}")
    print(f"\ntransport='auto' picks: {rep['auto_transport']}")
    print(f"kernels: {rep['kernels']}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m hvd_zoadam.info", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--ranks-per-host", type=int, default=None, metavar="N",
                    help="the ranks the job will run on each host (default: as the launcher's environment says)")
    args = ap.parse_args(argv)
    if args.ranks_per_host is not None and args.ranks_per_host < 1:
        ap.error(f"--ranks-per-host must be >= 1, got {args.ranks_per_host}")
    rep = report(args.ranks_per_host)
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        _print(rep)


if __name__ == "__main__":
    main()
