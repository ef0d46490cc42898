"""Shared helpers: real multi-process jobs with a timeout, P thread-ranks in one process, and the
hypothesis cases of the CPU and CUDA kernel tests."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import strategies as st

from hvd_zoadam.comm.thread import ThreadGroup
from hvd_zoadam.core.layout import padded_numel

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
JOB_TIMEOUT_S = int(os.environ.get("HVD_ZOADAM_TEST_JOB_TIMEOUT", "240"))


def launch_cmd(launcher: str, np_: int, argv: list[str]) -> list[str]:
    """The command line that starts ``argv`` on ``np_`` ranks with ``launcher``.

    launcher: ``gloo`` (horovodrun --gloo), ``hvdmpi`` (horovodrun --mpi),
    ``mpi`` (plain mpirun), ``torchrun`` (torchrun --standalone, a free port of its own), or
    ``single`` (one process, no launcher).
    """
    py = [sys.executable, *argv]
    horovodrun = str(BIN / "horovodrun")
    if launcher == "gloo":
        return [horovodrun, "-np", str(np_), "-H", f"localhost:{np_}", "--gloo", *py]
    if launcher == "hvdmpi":
        return [horovodrun, "-np", str(np_), "-H", f"localhost:{np_}", "--mpi",
                "--mpi-args=--oversubscribe --allow-run-as-root", *py]
    if launcher == "mpi":
        return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(np_), "-x", "PATH", *py]
    if launcher == "torchrun":
        return [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(np_), *argv]
    if launcher == "single":
        return py
    raise ValueError(launcher)


def run_job(launcher: str, np_: int, argv: list[str], timeout_s: int = JOB_TIMEOUT_S, env=None,
            check: bool = True) -> subprocess.CompletedProcess:
    """Run a multi-process job; fail the test (not hang) past ``timeout_s`` seconds."""
    return run_cmd(launch_cmd(launcher, np_, argv), timeout_s, env, check)


def run_cmd(cmd: list[str], timeout_s: int = JOB_TIMEOUT_S, env=None,
            check: bool = True) -> subprocess.CompletedProcess:
    """Run a launcher command line in the repository root; fail the test (not hang) past ``timeout_s``.
    ``env``: variables to set on top of the test's defaults; a value None unsets one."""
    full_env = dict(os.environ, PATH=f"{BIN}:{os.environ.get('PATH', '')}", PYTHONUNBUFFERED="1",
                    OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    with subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as job:
        try:
            out, err = job.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # the launcher's process group: its ranks too
                os.killpg(job.pid, signal.SIGKILL)
            out, err = job.communicate()
            pytest.fail(f"job timed out after {timeout_s}s: {' '.join(cmd)}\n{out}\n{err}")
    proc = subprocess.CompletedProcess(cmd, job.returncode, out, err)
    if check and proc.returncode != 0:
        pytest.fail(f"job failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def load_ranks(out_dir: Path, np_: int) -> list[dict]:
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(np_)]


def run_threads(world_size: int, fn, timeout_s: float = 60.0, ranks_per_node: int | None = None,
                ordered: bool = False) -> list:
    """Run ``fn(rank, transport)`` on ``world_size`` thread-ranks; return their results in rank order.
    ``ranks_per_node``: the simulated nodes of the two-level exchange (default: one node).
    ``ordered``: collectives pair by their order, as under MPI and torch.distributed, and a
    mismatch raises :class:`~hvd_zoadam.comm.transport.CollectiveOrderError`.

    An exception on any rank is re-raised here (the others are released by the barrier timeout).
    """
    group = ThreadGroup(world_size, timeout_s=timeout_s, ranks_per_node=ranks_per_node, ordered=ordered)
    results, errors = [None] * world_size, [None] * world_size

    def body(rank, transport):
        try:
            results[rank] = fn(rank, transport)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors[rank] = exc
            group.abort()

    threads = [threading.Thread(target=body, args=(r, t), daemon=True) for r, t in enumerate(group.transports())]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 5)
        if t.is_alive():
            raise TimeoutError(f"a thread-rank did not finish within {timeout_s}s")
    # the failure itself, not the aborts it caused on the other ranks
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)
            and "was aborted (another rank failed)" not in str(e)]
    if real:
        raise real[0]
    if any(errors):
        raise next(e for e in errors if e is not None)
    return results


# -- hypothesis cases shared by the CPU kernel tests (test_native.py) and the CUDA ones (gpu/) --

# zeros of both signs, subnormals, values near float32's overflow, ordinary ones
SPECIALS = (0.0, -0.0, 1e-40, -1e-40, 3e38, -3e38, 1e-30, 1.0)


@st.composite
def bucket_cases(draw, max_seg_numel=700, max_segs=5, dtypes=(torch.float32,), specials=SPECIALS):
    """(numels, P, y, worker_error, generator): a bucket of 1..max_segs segments, y padded to
    padded_numel(n, P) with zeros, some special values planted, cast to a drawn dtype; the
    error random on the real elements, 0 on the padding."""
    numels = draw(st.lists(st.integers(1, max_seg_numel), min_size=1, max_size=max_segs))
    p = draw(st.integers(1, 8))
    dtype = draw(st.sampled_from(dtypes))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    n = sum(numels)
    big = padded_numel(n, p)
    y = torch.zeros(big)
    y[:n] = torch.randn(n, generator=gen) * draw(st.sampled_from([1e-6, 1.0, 1e4]))
    for idx, val in draw(st.lists(st.tuples(st.integers(0, n - 1), st.sampled_from(specials)), max_size=6)):
        y[idx] = val
    e = torch.zeros(big)
    e[:n] = torch.randn(n, generator=gen) * 0.1
    return numels, p, y.to(dtype), e, gen


def server_inputs(gen, numels, padded: int, p: int, rank: int):
    """(recv uint8[P, C/8], worker scales float32[P, nseg], server_error float32[C], real count) for
    rank ``rank``'s chunk C = padded / P: random bits and scales, the error random on the chunk's
    real elements and 0 on its padding."""
    chunk = padded // p
    recv = torch.randint(0, 256, (p, chunk // 8), generator=gen, dtype=torch.uint8)
    wscales = torch.rand(p, len(numels), generator=gen)
    se = torch.zeros(chunk)
    real = max(0, min(chunk, sum(numels) - rank * chunk))
    se[:real] = torch.randn(real, generator=gen) * 0.1
    return recv, wscales, se, real
