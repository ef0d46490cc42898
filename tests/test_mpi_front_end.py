"""The mpi4py front end (:mod:`hvd_zoadam.mpi`) under mpirun, with no Horovod: the same oracle
tests as the Horovod jobs, and its own refusals, broadcasts and sub-communicators.

The jobs run ``tests/mp/worker.py`` with ``HVD_ZOADAM_TEST_FRONT_END=mpi``: it builds its
optimizers with :mod:`hvd_zoadam.mpi` and imports no Horovod. Each test of
``test_multiprocess`` imported here runs again on these jobs: the 1-bit exchange's outputs and
both error buffers bitwise equal to the in-process oracle, every VARIANCE-only run equal to
data-parallel Adam, training equal to the oracle and bitwise identical across ranks after every
sync, the byte counts by the documented formulas, overlap with the same parameters.
"""
from __future__ import annotations

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

import common  # noqa: E402
from hvd_zoadam import Schedule, padded_numel  # noqa: E402
from hvd_zoadam.oracle.simulate import simulate_compressed_allreduce, simulate_zoadam  # noqa: E402

FRONT_END = {"HVD_ZOADAM_TEST_FRONT_END": "mpi"}


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"mpi-alone-np{n}")
def job(request, tmp_path_factory):
    np_ = request.param
    out = tmp_path_factory.mktemp(f"mpialone{np_}")
    run_job("mpi", np_, ["tests/mp/worker.py", str(out)], env=FRONT_END)
    ranks = load_ranks(out, np_)
    assert [r["rank"] for r in ranks] == list(range(np_)) and all(r["size"] == np_ for r in ranks)
    for r in ranks:
        assert r["horovod_imported"] is False and r["horovod_imported_after"] is False
        assert all(res["transport"] == "mpi" for res in r["train"].values())
        assert r["train"]["Adam-0.0"]["stats"]["transport"] == "mpi (mpi4py)"
    return np_, ranks


@pytest.fixture(scope="module", params=[(4, 2), (2, 1)], ids=["mpi-alone-np4-L2", "mpi-alone-np2-L1"])
def mpi_job(request, tmp_path_factory):
    """The two-level jobs of test_hierarchical on the mpi4py front end: nodes of ``L`` ranks
    (HVD_ZOADAM_RANKS_PER_NODE); the tests below are test_hierarchical's, run again on these jobs."""
    p, local = request.param
    out = tmp_path_factory.mktemp(f"mpialone-hier{p}{local}")
    run_job("mpi", p, ["tests/mp/worker_hier.py", str(out)],
            env={**FRONT_END, "HVD_ZOADAM_RANKS_PER_NODE": str(local)})
    return p, local, load_ranks(out, p)


from test_hierarchical import (  # noqa: E402,F401
    test_mpi_ranks_that_disagree_on_hierarchical_fail_at_construction_on_every_rank,
    test_mpi_training_runs_equal_the_simulation_flat_and_two_level,
    test_mpi_two_level_exchange_equals_the_oracle_and_counts_the_formula,
)


@pytest.fixture(scope="module")
def mpi_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("mpialone-own")
    run_job("mpi", 3, ["tests/mp/worker_mpi.py", str(out)])
    ranks = load_ranks(out, 3)
    assert not any(r["horovod_imported"] for r in ranks)
    return ranks


def test_wrong_input_is_refused_by_name_on_every_rank(mpi_ranks):
    for r in mpi_ranks:
        assert r["unknown_option"].startswith("TypeError") and "'compression'" in r["unknown_option"]
        assert r["transport"].startswith("ValueError") and "'gloo'" in r["transport"]
        assert r["comm_type"].startswith("TypeError") and "mpi4py intracommunicator" in r["comm_type"]
        assert r["comm_null"].startswith("ValueError") and "COMM_NULL" in r["comm_null"]
        assert r["root_rank"].startswith("ValueError") and "root_rank" in r["root_rank"]
        assert r["int_average"].startswith("TypeError") and "floating-point" in r["int_average"]
        assert r["mismatch"].startswith("ValueError") and "var_freeze_step" in r["mismatch"], r["mismatch"]
        assert r["bcast_comm"].startswith("TypeError") and "mpi4py intracommunicator" in r["bcast_comm"]
        assert r["bcast_null"].startswith("ValueError") and "COMM_NULL" in r["bcast_null"]
        assert r["comm_and_transport"].startswith("ValueError") and "not both" in r["comm_and_transport"]
        assert r["state_mismatch"].startswith("ValueError") and "different state tensors" in r["state_mismatch"]
        assert r["ranks_on_host_env"] == r["ranks_on_host_split"] == 3  # one host


def test_broadcasts_make_every_rank_the_roots(mpi_ranks):
    root = mpi_ranks[1]
    want = list(common.mlp(seed=101).parameters())
    for r in mpi_ranks:
        assert all(torch.equal(a, b) for a, b in zip(r["params"], want))
        assert r["lr"] == 1.5
        assert r["state"].keys() == root["state_before"].keys()
        assert all(torch.equal(r["state"][k], root["state_before"][k]) for k in r["state"])
    assert not torch.equal(mpi_ranks[0]["state_before"]["step"], root["state_before"]["step"])  # it changed


def test_a_sub_communicator_trains_alone_and_equals_the_simulation(mpi_ranks):
    """Ranks 0 and 2 (the even ranks' ``comm.Split``) train while rank 1 idles: the result is
    the simulation at P = 2, on both ranks; ``compressed_allreduce(process_set=comm)`` is the
    simulated exchange bit for bit, and refuses Horovod's transport on a communicator."""
    sim, _ = simulate_zoadam([p.detach().clone() for p in common.mlp().parameters()], common.grads_at,
                             world_size=2, steps=common.TRAIN_STEPS, schedule=Schedule(**common.TRAIN),
                             lr_fn=lambda t: common.LR, weight_decay=0.01, decoupled=True)
    n = 1000
    we, se = ([torch.zeros(padded_numel(n, 2)) for _ in range(2)],
              [torch.zeros(padded_numel(n, 2) // 2) for _ in range(2)])
    car = simulate_compressed_allreduce([common.car_input(n, r, 0) for r in range(2)], we, se)
    assert mpi_ranks[1]["sub"] is None
    for r in (0, 2):
        sub = mpi_ranks[r]["sub"]
        assert sub["size"] == 2 and sub["transport"] == "mpi (mpi4py)"
        for got, want in zip(sub["final"], sim[r // 2]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        # compressed_allreduce with the communicator as its process set
        got, got_we, got_se = sub["car"]
        assert torch.equal(got, car) and torch.equal(got_we, we[r // 2]) and torch.equal(got_se, se[r // 2])
        assert sub["car_horovod"].startswith("ValueError") and "mpi4py communicator" in sub["car_horovod"]


def test_averages_sum_in_rank_order_then_divide_on_every_rank(mpi_ranks):
    """The reduce-scatter + allgather average: each element is the sum of the ranks' values in
    rank order, divided by P, in the tensor's own dtype and in place, bit for bit on every
    rank (the empty tensor included); 2(P-1)/P of the bytes counted."""
    p = len(mpi_ranks)
    for key, x in mpi_ranks[0]["average_inputs"].items():
        want = mpi_ranks[0]["average_inputs"][key].clone()
        for r in range(1, p):
            want += mpi_ranks[r]["average_inputs"][key]
        want /= p
        for r in mpi_ranks:
            assert r["averages"][key] is True  # wait() returned the tensor it averaged in place
            assert torch.equal(r["average_outputs"][key], want), key
    nbytes = sum(x.numel() * x.element_size() for x in mpi_ranks[0]["average_inputs"].values())
    assert all(r["average_bytes"] == pytest.approx(2 * (p - 1) / p * nbytes) for r in mpi_ranks)


def test_a_checkpoint_saved_inside_a_window_resumes_bit_for_bit(mpi_ranks):
    """hvd_zoadam.checkpoint over mpi4py alone (its window averages are the transport's): a save
    between local steps, loaded into a fresh model and optimizer, gives the uninterrupted run."""
    for r in mpi_ranks:
        assert r["ckpt_kind_after"] == "local"  # saved inside a window
        assert r["ckpt_equal"] is True
