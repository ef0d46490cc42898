"""The torch.distributed front end under torchrun (Gloo): the same oracle tests as the Horovod jobs.

The jobs run ``tests/mp/worker.py`` with ``HVD_ZOADAM_TEST_FRONT_END=torch.distributed``: it
builds its optimizers with :mod:`hvd_zoadam.distributed` and imports no Horovod. Each test of
``test_multiprocess`` imported here runs again on these jobs: the 1-bit exchange's outputs and
both error buffers bitwise equal to the in-process oracle, every VARIANCE-only run equal to
data-parallel Adam, training equal to the oracle and bitwise identical across ranks after every
sync, the byte counts by the documented formulas, overlap with the same parameters.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import torch

from conftest import load_ranks, run_job

sys.path.insert(0, str(Path(__file__).parent / "mp"))

from test_multiprocess import (  # noqa: E402,F401
    test_a_parameter_without_a_gradient_on_one_rank_overlaps_in_lockstep,
    test_all_variance_steps_equal_horovod_adam,
    test_comm_stats_count_bytes_by_the_documented_formulas,
    test_compressed_allreduce_half_inputs_keep_dtype_and_agree,
    test_compressed_allreduce_matches_simulation_bitwise,
    test_non_finite_input_raises_on_every_rank_and_leaves_buffers,
    test_overlap_with_backward_gives_the_same_parameters,
    test_training_matches_simulation_and_syncs_are_bitwise,
)

import hvd_zoadam.distributed as zd  # noqa: E402
from hvd_zoadam.comm.torch_distributed import TorchDistributedTransport  # noqa: E402

FRONT_END = {"HVD_ZOADAM_TEST_FRONT_END": "torch.distributed"}


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"torchrun-np{n}")
def job(request, tmp_path_factory):
    np_ = request.param
    out = tmp_path_factory.mktemp(f"torchrun{np_}")
    run_job("torchrun", np_, ["tests/mp/worker.py", str(out)], env=FRONT_END)
    ranks = load_ranks(out, np_)
    assert [r["rank"] for r in ranks] == list(range(np_)) and all(r["size"] == np_ for r in ranks)
    for r in ranks:
        assert r["horovod_imported"] is False
        assert all(res["transport"] == "torch.distributed" for res in r["train"].values())
        assert r["train"]["Adam-0.0"]["stats"]["transport"] == "torch.distributed (gloo)"
    return np_, ranks


@pytest.fixture(scope="module", params=[(4, 2), (2, 1)], ids=["torchrun-np4-L2", "torchrun-np2-L1"])
def mpi_job(request, tmp_path_factory):
    """The two-level jobs of test_hierarchical under torchrun: nodes of ``L`` ranks
    (HVD_ZOADAM_RANKS_PER_NODE), the worker of the MPI two-level tests on the torch.distributed
    transport; the tests below are test_hierarchical's, run again on these jobs."""
    p, local = request.param
    out = tmp_path_factory.mktemp(f"torchrun-hier{p}{local}")
    run_job("torchrun", p, ["tests/mp/worker_hier.py", str(out)],
            env={**FRONT_END, "HVD_ZOADAM_RANKS_PER_NODE": str(local)})
    return p, local, load_ranks(out, p)


from test_hierarchical import (  # noqa: E402,F401
    test_mpi_ranks_that_disagree_on_hierarchical_fail_at_construction_on_every_rank,
    test_mpi_training_runs_equal_the_simulation_flat_and_two_level,
    test_mpi_two_level_exchange_equals_the_oracle_and_counts_the_formula,
)


def test_a_stalled_peer_raises_collective_timeout_naming_the_collective():
    proc = run_job("torchrun", 2, ["tests/mp/worker_tdist_fault.py"], check=False, timeout_s=120,
                   env={"HVD_ZOADAM_TIMEOUT_S": "3"})
    assert "CollectiveTimeoutError" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert "did not complete within 3 s" in proc.stdout + proc.stderr


def test_wrong_input_is_refused_by_name_on_every_rank(tmp_path):
    proc = run_job("torchrun", 2, ["tests/mp/worker_tdist_refusals.py", str(tmp_path)])
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt", weights_only=True)
        assert "DistributedDataParallel" in got["ddp"] and "drop the DDP wrapper" in got["ddp"]
        assert "cannot travel over the 'gloo' backend" in got["cuda_over_gloo"]
        assert "settings differ across ranks" in got["mismatch"] or "var_freeze_step" in got["mismatch"], got
    assert proc.returncode == 0


def test_an_uninitialised_process_group_is_refused_by_name():
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        zd.DistributedOptimizer(torch.optim.AdamW(model.parameters()), model.named_parameters())
    with pytest.raises(ValueError, match="init_process_group"):
        TorchDistributedTransport()


def test_torchrun_restarts_a_job_that_lost_a_worker_and_it_resumes_exactly(tmp_path):
    """``torchrun --max-restarts 1``: rank 1 is SIGKILLed at step 10 (inside a window of local
    steps, after the checkpoint of step 8); torchrun restarts both workers, which resume from that
    checkpoint's per-rank files and finish. The end equals the uninterrupted run bit for bit, so
    the steps after the resume gain all that the uninterrupted run gains."""
    clean = _restart_job(tmp_path / "clean", 0)
    killed = _restart_job(tmp_path / "killed", 10)
    for r in range(2):
        assert clean[r]["restarts"] == 0 and clean[r]["resumed"] == 0
        assert killed[r]["restarts"] == 1 and killed[r]["resumed"] == 8
        assert all(torch.equal(a, b) for a, b in zip(killed[r]["final"], clean[r]["final"])), r


def _restart_job(out: Path, kill_at: int, *, nproc: int = 2, stop_at: int = 24) -> list:
    from conftest import BIN, run_cmd
    out.mkdir(exist_ok=True)
    run_cmd([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "1",
             "tests/mp/worker_tdist_restart.py", str(out), str(kill_at), "rank1", str(stop_at)], timeout_s=240)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(nproc)]


def test_an_elastic_torchrun_job_that_loses_a_node_resumes_at_the_smaller_world_size(tmp_path):
    """Two torchrun agents of one elastic job (``--nnodes 1:2``, c10d rendezvous) run 2 and 1
    workers. At step 10, inside a window of local steps, the one-worker node is lost (its agent
    and worker SIGKILLed); the other agent restarts its workers, which rendezvous at world size
    2 and resume from the common file of the step-8 checkpoint, with the pooled error feedback.
    The end equals, bit for bit, a world-size-3 run stopped after step 8 and resumed at world
    size 2 from the same checkpoint by hand."""
    import socket
    import subprocess

    from conftest import BIN, ROOT
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "elastic"
    out.mkdir()
    env = dict(os.environ, PATH=f"{BIN}:{os.environ.get('PATH', '')}", OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")

    def agent(nproc, is_host):
        return subprocess.Popen(
            [str(BIN / "torchrun"), "--nnodes", "1:2", "--nproc-per-node", str(nproc), "--max-restarts", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test",
             "--rdzv-conf", f"is_host={int(is_host)},last_call_timeout=5,join_timeout=60",
             "--monitor-interval", "0.5", "tests/mp/worker_tdist_restart.py", str(out), "10", "node"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    host, lost = agent(2, True), agent(1, False)
    try:
        log, _ = host.communicate(timeout=240)
    finally:
        for proc in (host, lost):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert host.returncode == 0, log[-4000:]
    assert lost.wait(10) == -signal.SIGKILL
    elastic = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert not (out / "rank2.pt").exists()
    by_hand = tmp_path / "by_hand"
    first = _restart_job(by_hand, 0, nproc=3, stop_at=8)
    assert [r["world_size"] for r in first] == [3, 3, 3]
    second = _restart_job(by_hand, 0, nproc=2)
    for r in range(2):
        assert elastic[r]["restarts"] == 1 and elastic[r]["resumed"] == 8 and elastic[r]["world_size"] == 2
        assert second[r]["resumed"] == 8 and second[r]["world_size"] == 2
        assert all(torch.equal(a, b) for a, b in zip(elastic[r]["final"], second[r]["final"])), r


def test_auto_stays_flat_where_no_ranks_per_node_are_known(tmp_path, monkeypatch):
    """Outside torchrun (no LOCAL_WORLD_SIZE) and without HVD_ZOADAM_RANKS_PER_NODE the transport
    cannot know the nodes: hierarchical='auto' stays flat, True names the fix."""
    import torch.distributed as dist
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("HVD_ZOADAM_RANKS_PER_NODE", raising=False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        transport = TorchDistributedTransport()
        assert not transport.can_split()
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        assert transport.can_split()
        monkeypatch.delenv("LOCAL_WORLD_SIZE")
        with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
            transport.node_split("t")
    finally:
        dist.destroy_process_group()
