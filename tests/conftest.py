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


# -- the bitwise promises: `pytest -m bitwise`, and `make test-kernel-paths` under several CPU kernel paths --

# Tests that assert bit equality between two different computations: the product against its
# in-process oracle, a Numba or CUDA kernel against the torch ops it replaces, one code path of the
# optimizer against another (overlap or not, stacked oracle or per rank). In each, the two sides do
# the same float32 operations in the same order on inputs of the same layout (where a kernel cannot
# round as torch's ops do here, the library runs those ops), so the equality must hold under any of
# torch's CPU kernels (ATEN_CPU_CAPABILITY), MKL's code paths and thread counts, not only on the
# machine that wrote the test. A name marks every parametrization of the test; "name[id]" marks
# that one only (the real jobs of test_multiprocess.py: two of their eleven launches, to keep the
# marked run short).
BITWISE = {
    "gpu/test_cuda_kernels.py": (
        "test_worker_side_matches_the_cpu_kernels", "test_one_pass_worker_kernel_is_bitwise_the_two_passes",
        "test_server_side_matches_the_cpu_kernels", "test_one_pass_server_kernel_is_bitwise_the_two_passes",
        "test_unpacking_kernels_match_the_cpu_kernels",
        "test_the_local_step_kernel_is_bitwise_the_cpu_kernel_and_skips_on_the_device",
        "test_the_window_update_kernel_is_bitwise_the_cpu_kernel_and_skips_on_the_device"),
    "gpu/test_optimizer_cuda.py": ("test_optimizer_on_the_cuda_path_equals_the_simulation",
                                   "test_local_steps_on_the_cuda_path_are_bitwise_the_cpu_paths"),
    "test_defaults.py": ("test_ranks_decide_the_same_freeze_and_train_as_the_oracle_bitwise",),
    "test_faults.py": ("test_gradients_changed_after_backward_are_exchanged_as_they_are_at_step",
                       "test_a_sync_steps_exchange_starts_in_backward_and_a_late_change_is_exchanged_as_it_is"),
    "test_flat_storage.py": ("test_a_non_contiguous_parameter_keeps_its_strides_and_the_oracles_bits",),
    "test_horovod_contract.py": ("test_a_torch_adam_checkpoint_continues_as_adam_would",
                                 "test_sparse_gradients_with_sparse_as_dense_cost_what_dense_ones_cost"),
    "test_hierarchical.py": (
        "test_two_level_exchange_equals_the_oracle_bitwise_on_every_rank",
        "test_one_rank_per_node_is_the_flat_exchange",
        "test_one_node_averages_exactly", "test_a_non_finite_input_on_any_rank_skips_every_shard_on_every_rank",
        "test_training_runs_equal_the_two_level_simulation_bitwise"),
    "test_multiprocess.py": tuple(
        f"{name}[{job}]" for name in ("test_compressed_allreduce_matches_simulation_bitwise",
                                      "test_training_matches_simulation_and_syncs_are_bitwise",
                                      "test_overlap_with_backward_gives_the_same_parameters")
        for job in ("gloo-np2-auto", "mpi-np2-mpi")),
    "test_native.py": (
        "test_worker_kernels_match_the_reference", "test_server_kernels_match_the_reference",
        "test_server_reduce_into_a_second_buffer_equals_in_place_and_leaves_server_error_alone",
        "test_decompress_matches_the_reference", "test_kernels_do_not_depend_on_the_thread_count",
        "test_half_inputs_decode_exactly_for_every_bit_pattern", "test_kernels_past_one_block_and_one_task",
        "test_worker_compress_in_one_pass_is_bitwise_the_two_passes",
        "test_decompress_into_momentum_is_bitwise_the_reference", "test_decompress_sync_is_bitwise_the_optimizer_path",
        "test_decompress_sync_into_the_parameters_equals_the_flat_x",
        "test_the_cuda_kernels_arithmetic_decode_is_exact_for_every_bit_pattern",
        "test_clamp_by_is_bitwise_the_torch_ops",
        "test_clamp_finite_clamps_finite_input_and_lets_non_finite_reach_the_scales",
        "test_the_local_step_kernel_is_in_force_where_torch_fuses_multiply_adds",
        "test_local_step_is_bitwise_the_torch_ops",
        "test_local_window_update_is_bitwise_the_torch_ops_and_finds_non_finite_gradients",
        "test_local_window_update_selects_on_the_device_what_the_host_would_choose",
        "test_sync_prepare_and_rebuild_are_bitwise_the_torch_path",
        "test_precondition_clamp_is_bitwise_the_torch_ops_specials_included"),
    "test_onebit.py": ("test_onebit_adam_is_adam_then_the_oracle_bit_for_bit",),
    "test_optimizer.py": (
        "test_equals_the_simulation_bitwise", "test_many_buckets_at_p1_equal_the_simulation_bitwise",
        "test_local_updates_take_each_gradient_where_it_is_and_keep_the_simulations_bits",
        "test_a_sync_step_rebuilds_x_in_the_parameters_and_keeps_the_simulations_bits",
        "test_a_beta1_the_kernels_leave_to_torch_takes_the_gathered_path",
        "test_a_gradient_missing_on_one_rank_counts_as_zero",
        "test_a_gradient_missing_on_one_rank_with_several_buckets_pairs_by_order"),
    "test_oracle_stacked.py": (
        "test_the_stacked_exchange_is_bitwise_the_per_rank_exchange",
        "test_simulate_zoadam_stacked_is_bitwise_the_per_rank_oracle",
        "test_a_batched_gradient_function_gives_what_the_per_rank_one_gives",
        "test_the_benchs_vmap_chunks_give_the_same_gradients_and_losses_to_the_last_bit",
        "test_the_sync_momentum_average_ablation_starts_at_the_second_sync"),
    "test_properties.py": ("test_compressed_allreduce_gives_the_oracle_or_a_named_error_on_both_ranks",),
    "test_protocol.py": (
        "test_exchange_equals_simulation_bitwise_and_is_identical_on_all_ranks",
        "test_multi_segment_buckets_equal_simulation",
        "test_exchange_input_becomes_the_worker_error_and_a_skip_keeps_both"),
    "test_resume.py": ("test_the_first_exchange_after_a_pooled_load_matches_the_oracle",),
}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    """Mark the tests of :data:`BITWISE` ``bitwise``; a name there that its file does not define
    (a test renamed or removed) stops the run, so the list cannot silently shrink."""
    checked = set()
    for item in items:
        rel = Path(str(item.path)).relative_to(ROOT / "tests").as_posix()
        names = BITWISE.get(rel)
        if names is None:
            continue
        if rel not in checked:
            checked.add(rel)
            missing = [n for n in names if not hasattr(item.module, n.split("[")[0])]
            if missing:
                raise pytest.UsageError(f"tests/conftest.py BITWISE names tests that tests/{rel} lacks: {missing}")
        if item.originalname in names or item.name in names:
            item.add_marker(pytest.mark.bitwise)
