"""Real multi-process jobs (horovodrun --gloo, horovodrun --mpi, mpirun) against the in-process oracle."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from conftest import load_ranks, run_job

sys.path.insert(0, str(Path(__file__).parent / "mp"))
import common  # noqa: E402
from hvd_zoadam import Schedule, StepKind, padded_numel  # noqa: E402
from hvd_zoadam.comm.protocol import chunk_pieces  # noqa: E402
from hvd_zoadam.core.layout import segment_offsets  # noqa: E402
from hvd_zoadam.oracle.simulate import simulate_compressed_allreduce, simulate_zoadam  # noqa: E402

# (launcher, ranks, transport argument, the transport it must resolve to). Under MPI both
# transports run at P = 2, 3, 4, under Gloo both at P = 2; each must equal the in-process
# simulation bit for bit, so they equal each other.
JOBS = [("gloo", 2, "auto", "gloo"), ("gloo", 3, "auto", "gloo"), ("gloo", 2, "horovod", "horovod"),
        ("mpi", 2, "mpi", "mpi"), ("mpi", 3, "mpi", "mpi"), ("mpi", 4, "auto", "mpi"),
        ("mpi", 2, "horovod", "horovod"), ("mpi", 3, "horovod", "horovod"), ("mpi", 4, "horovod", "horovod"),
        ("hvdmpi", 2, "auto", "mpi"), ("single", 1, "auto", None)]  # one process: either, nothing is sent


@pytest.fixture(scope="module", params=JOBS, ids=[f"{l}-np{n}-{t}" for l, n, t, _ in JOBS])
def job(request, tmp_path_factory):
    launcher, np_, transport, resolved = request.param
    out = tmp_path_factory.mktemp(f"{launcher}{np_}{transport}")
    run_job(launcher, np_, ["tests/mp/worker.py", str(out)], env={"HVD_ZOADAM_TEST_TRANSPORT": transport})
    ranks = load_ranks(out, np_)
    assert [r["rank"] for r in ranks] == list(range(np_)) and all(r["size"] == np_ for r in ranks)
    for r in ranks if resolved else []:
        assert all(res["transport"] == resolved for res in r["train"].values()), (transport, resolved)
        assert r["train"]["Adam-0.0"]["stats"]["transport"].startswith(resolved)
    return np_, ranks


def test_compressed_allreduce_matches_simulation_bitwise(job):
    p, ranks = job
    for n in common.CAR_SIZES:
        we = [torch.zeros(padded_numel(n, p)) for _ in range(p)]
        se = [torch.zeros(padded_numel(n, p) // p) for _ in range(p)]
        for call in range(common.CAR_CALLS):
            want = simulate_compressed_allreduce([common.car_input(n, r, call) for r in range(p)], we, se) \
                if n else torch.empty(0)
            for r in range(p):
                got = ranks[r]["car"][n]["outs"][call]
                assert got.shape == (n,) and got.dtype == torch.float32
                assert torch.equal(got, want), (n, call, r)
        for r in range(p):
            assert torch.equal(ranks[r]["car"][n]["we"], we[r]), (n, r)
            assert torch.equal(ranks[r]["car"][n]["se"], se[r]), (n, r)


def test_compressed_allreduce_half_inputs_keep_dtype_and_agree(job):
    p, ranks = job
    for dtype in (torch.float16, torch.bfloat16):
        outs = [r["car"][str(dtype)] for r in ranks]
        assert all(o.dtype == dtype and o.shape == (37,) for o in outs)
        assert all(torch.equal(o, outs[0]) for o in outs)
        want = simulate_compressed_allreduce(
            [common.car_input(37, r, 0, dtype).float() for r in range(p)],
            [torch.zeros(padded_numel(37, p)) for _ in range(p)],
            [torch.zeros(padded_numel(37, p) // p) for _ in range(p)])
        torch.testing.assert_close(outs[0].float(), want, rtol=1e-2, atol=1e-2)


def test_non_finite_input_raises_on_every_rank_and_leaves_buffers(job):
    p, ranks = job
    for r in ranks:
        assert r["car"]["nan"] == "raised"
        assert r["car"]["nan_untouched"] is True


def test_all_variance_steps_equal_horovod_adam(job):
    """algorithm.md §2 oracle: with every step a VARIANCE step, 0/1 Adam is hvd.DistributedOptimizer(Adam)."""
    p, ranks = job
    for r in ranks:
        for key, res in r["adam_oracle"].items():
            for a, z in zip(res["adam"], res["zoadam"]):
                torch.testing.assert_close(z, a, rtol=1e-6, atol=1e-7, msg=key)
    # and the parameters agree across ranks
    for key in ranks[0]["adam_oracle"]:
        for r in ranks[1:]:
            assert all(torch.equal(a, b) for a, b in zip(r["adam_oracle"][key]["zoadam"],
                                                          ranks[0]["adam_oracle"][key]["zoadam"]))


def test_training_matches_simulation_and_syncs_are_bitwise(job):
    p, ranks = job
    sched = Schedule(**common.TRAIN)
    for key in ranks[0]["train"]:
        cls_name, wd = key.split("-")
        params0 = [p_.detach().clone() for p_ in common.mlp().parameters()]
        sim, kinds = simulate_zoadam(params0, common.grads_at, world_size=p, steps=common.TRAIN_STEPS,
                                     schedule=sched, lr_fn=lambda t: common.LR, weight_decay=float(wd),
                                     decoupled=cls_name == "AdamW")
        per_rank = [r["train"][key]["per_step"] for r in ranks]
        assert [s["kind"] for s in per_rank[0]] == [k.value for k in kinds]
        syncs = 0
        for t, kind in enumerate(kinds):
            if kind in (StepKind.SYNC, StepKind.VARIANCE, StepKind.COMPRESSED):
                syncs += kind is StepKind.SYNC
                for r in range(1, p):
                    assert all(torch.equal(a, b) for a, b in zip(per_rank[r][t]["params"], per_rank[0][t]["params"])), \
                        (key, t, r)
                    assert all(torch.equal(a, b)
                               for a, b in zip(per_rank[r][t]["exp_avg"], per_rank[0][t]["exp_avg"])), \
                        (key, t, r)
        assert syncs >= 4
        for r in range(p):
            for got, want in zip(ranks[r]["train"][key]["final"], sim[r]):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=(key, r))


def test_comm_stats_count_bytes_by_the_documented_formulas(job):
    p, ranks = job
    stats = ranks[0]["train"]["Adam-0.0"]["stats"]
    n = sum(q.numel() for q in common.mlp().parameters())
    assert stats["world_size"] == p
    assert stats["variance"]["steps"] + stats["compressed"]["steps"] + stats["local"]["steps"] \
        + stats["sync"]["steps"] == common.TRAIN_STEPS
    assert stats["local"]["rounds"] == 0 and stats["local"]["bytes_sent"] == 0
    if p == 1:
        assert stats["bytes_sent_total"] == 0 and stats["rounds_total"] == 0
        assert stats["adam_equivalent_bytes"] == 0
        return
    big_n = padded_numel(n, p)
    # the four tensors are four segments; each chunk gets the scales of the S segments it overlaps at most
    s = max(chunk_pieces(segment_offsets([96, 16, 48, 3]), big_n // p, p)[1])
    words = lambda nbytes: -(-nbytes // 4) * 4  # noqa: E731 - messages are whole 4-byte words
    per_exchange = (p - 1) * (words(4 * s + 4 + big_n // p // 8) + words(12 + 4 * s + big_n // p // 8))
    # from step 2 on, each VARIANCE, COMPRESSED and SYNC step also allgathers an int32 flag ("no
    # gradient here?", and "gradients changed after backward()?" where the hooks started the
    # exchange); step 1, a VARIANCE step, compares it in the settings check instead
    flags = stats["variance"]["steps"] - 1
    sync_flags = stats["sync"]["steps"]
    flag_bytes = (p - 1) * 4
    assert abs(stats["variance"]["bytes_sent"] - (stats["variance"]["steps"] * n * 2 * (p - 1) / p * 4
                                                  + flags * flag_bytes)) <= 1
    assert stats["variance"]["rounds"] == stats["variance"]["steps"] + flags
    assert stats["compressed"]["rounds"] == 3 * stats["compressed"]["steps"]
    assert abs(stats["compressed"]["bytes_sent"] - stats["compressed"]["steps"] * (per_exchange + flag_bytes)) <= 1
    assert abs(stats["sync"]["bytes_sent"] - (stats["sync"]["steps"] * per_exchange + sync_flags * flag_bytes)) <= 1
    assert stats["sync"]["rounds"] == 2 * stats["sync"]["steps"] + sync_flags
    assert abs(stats["adam_equivalent_bytes"] - common.TRAIN_STEPS * 2 * (p - 1) / p * 4 * n) <= 1
    assert stats["bytes_sent_total"] < stats["adam_equivalent_bytes"] / 3


def test_overlap_with_backward_gives_the_same_parameters(job):
    """The hooks start VARIANCE allreduces, COMPRESSED steps' worker side and round 1, and SYNC
    steps' local update, worker side and round 1 early, and the 1-bit exchanges pipeline the
    buckets; with several buckets the result equals overlap=False bit for bit, on every rank."""
    p, ranks = job
    for r in ranks:
        on, off = r["overlap"][True], r["overlap"][False]
        assert on["buckets"] >= 3
        if p <= 2:  # a sum of two is order-free: bit for bit
            assert all(torch.equal(a, b) for a, b in zip(on["params"], off["params"]))
        else:  # Horovod may fuse the early allreduces differently: the sum order of 3+ ranks moves the last bits
            for a, b in zip(on["params"], off["params"]):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        for kind in ("compressed", "sync"):
            on_k, off_k = on["stats"][kind], off["stats"][kind]
            # the same exchanges and the same 4-byte flag a step at P > 1 ("gradients changed?" and
            # "no gradient here?" after an early start, "no gradient here?" before the exchange)
            assert on_k["steps"] == off_k["steps"] > 1
            assert on_k["rounds"] == off_k["rounds"] and on_k["bytes_sent"] == off_k["bytes_sent"]


def test_a_parameter_without_a_gradient_on_one_rank_overlaps_in_lockstep(job):
    """The second layer's weight gets no gradient on the last rank, so that rank's hooks start
    fewer exchanges than the others' before synchronize() (several buckets). Every rank starts
    the rest before the "gradients changed?" flag, so the collectives pair up on transports that
    match them by order (MPI, torch.distributed): the job ends, with the parameters of
    overlap=False (the worker checks after each exchanging step that every rank holds the same)."""
    p, ranks = job
    for r in ranks:
        on, off = r["missing_grad"][True], r["missing_grad"][False]
        assert on["buckets"] >= 3
        # one flag per COMPRESSED step at P > 1, armed or not
        assert on["stats"]["compressed"]["rounds"] == off["stats"]["compressed"]["rounds"]
        if p <= 2:
            assert all(torch.equal(a, b) for a, b in zip(on["params"], off["params"]))
        else:  # as in the overlap test: Horovod may fuse the early allreduces differently
            for a, b in zip(on["params"], off["params"]):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    if p > 1:  # the last rank's missing gradient moved the result: the scenario is not the plain one
        assert not all(torch.equal(a, b) for a, b in zip(ranks[0]["missing_grad"][False]["params"],
                                                         ranks[0]["overlap"][False]["params"]))


@pytest.mark.parametrize("launcher", ["gloo", "mpi"])
def test_process_sets_train_separate_models_without_cross_talk(launcher, tmp_path):
    """Process sets {0,1} and {2,3} each train their own Linear(8,4); finishes well within the timeout."""
    proc = run_job(launcher, 4, ["tests/mp/worker_ps.py", str(tmp_path)], timeout_s=120)
    ranks = load_ranks(tmp_path, 4)
    assert ranks[0]["kinds"][-1] == "sync"
    same = lambda a, b: all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))  # noqa: E731
    assert same(ranks[0], ranks[1]) and same(ranks[2], ranks[3])
    assert not same(ranks[0], ranks[2])
    for r in ranks:
        assert r["stats"]["world_size"] == 2
    # per-set traffic equals a 2-rank job's: no collective spans the sets
    n = 8 * 4 + 4
    v = ranks[0]["stats"]["variance"]  # plus one 4-byte overlap flag per VARIANCE step after the first
    assert v["bytes_sent"] == round(v["steps"] * 4 * n + 4 * (v["steps"] - 1))
    assert proc.returncode == 0


@pytest.mark.parametrize("launcher", ["gloo", "mpi"])
def test_broadcast_optimizer_state_and_settings_check(launcher, tmp_path):
    """hvd.broadcast_optimizer_state with frozen parameters, before the first step, twice, and over corrupted
    non-tensor options and counters, and mid-run after rank 0 alone changed v; settings that differ across
    ranks raise on every rank; an explicit transport='mpi' or 'gloo' never falls back silently."""
    run_job(launcher, 2, ["tests/mp/worker_bcast.py", str(tmp_path)], timeout_s=120)
    r0, r1 = load_ranks(tmp_path, 2)
    for r in (r0, r1):  # an explicit transport='mpi' or 'gloo' never falls back silently
        if launcher == "gloo":
            assert "transport='mpi' cannot work here" in r["explicit_mpi"]["error"]
            assert "MPI controller" in r["explicit_mpi"]["error"]
            assert r["explicit_gloo"]["ok"].startswith("gloo (a Gloo group")
        else:
            assert r["explicit_mpi"]["ok"].startswith("mpi (mpi4py")
            assert "transport='gloo' cannot work here" in r["explicit_gloo"]["error"]
            assert "Gloo controller" in r["explicit_gloo"]["error"] and "transport='mpi'" in r["explicit_gloo"]["error"]
    same_state = lambda a, b: all(torch.equal(a[i][k], b[i][k]) for i in a for k in a[i])  # noqa: E731
    # frozen layer untouched and without state; broadcasting twice = once; state equal after each
    f0, f1 = r0["frozen"], r1["frozen"]
    assert f0["unchanged"] and f1["unchanged"] and not f0["frozen_in_state"]
    for snap in ("once", "twice", "after"):
        assert same_state(f0[snap]["state"], f1[snap]["state"]) and f0[snap]["groups"] == f1[snap]["groups"]
    assert same_state(f0["once"]["state"], f0["twice"]["state"])
    # per-rank error buffers are not replaced by rank 0's copies
    assert all(torch.equal(a, b) for a, b in zip(f1["before"]["errors"], f1["after"]["errors"]))
    assert not all(torch.equal(a, b) for a, b in zip(f0["after"]["errors"], f1["after"]["errors"]))
    assert all(torch.equal(a, b) for a, b in zip(f0["final"], f1["final"]))
    # rank 1's corrupted options and counters come back as rank 0's, with their Python types
    c0, c1 = r0["corrupt"], r1["corrupt"]
    assert c1["groups"] == c0["groups"]
    for g0, g1 in zip(c0["groups"], c1["groups"]):
        for key in g0:
            assert type(g0[key]) is type(g1[key]), key
    assert c1["groups"][0]["zoadam"]["step"] == 5 and c1["groups"][0]["lr"] == 1e-3
    # rank 0's new v, broadcast mid-run, is what every rank's next SYNC steps use
    assert all(torch.equal(a, b) for a, b in zip(r0["root_v"], r1["root_v"]))
    assert type(c1["groups"][0]["zoadam"]["freeze_lr"]) is float
    assert same_state(c0["state"], c1["state"])
    assert all(torch.equal(a, b) for a, b in zip(c0["after"], c1["after"]))
    # settings differ across ranks: every rank raises within seconds, naming the setting and both values
    for r in (r0, r1):
        m = r["mismatch"]
        assert "schedule.var_freeze_step" in m["freeze"]["error"] and "3" in m["freeze"]["error"] \
            and "5" in m["freeze"]["error"]
        assert "schedule.local_step_clipper" in m["clipper"]["error"] and "8" in m["clipper"]["error"]
        assert "torch.float64" in m["dtype"]["error"] and "torch.float32" in m["dtype"]["error"]
        assert "extra" in m["extra"]["error"]
        assert all(case["seconds"] < 30 for case in m.values())
