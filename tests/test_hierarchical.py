"""The two-level exchange (algorithm.md §3, "Two levels") over thread-ranks grouped into simulated
nodes, against the in-process oracle: results and both error buffers bitwise, on every rank; the
agreed skip and the step check across nodes; bytes per level against the documented formula."""
from __future__ import annotations

import pytest
import torch

from conftest import run_threads
from hvd_zoadam.comm.hierarchical import HierarchicalExchange
from hvd_zoadam.comm.protocol import Exchange, StepMismatchError
from hvd_zoadam.core.layout import node_shards, padded_numel, scale_segments, segment_offsets, shard_segments
from hvd_zoadam.oracle.simulate import simulate_hierarchical_allreduce

TOPOLOGIES = [(2, 1), (1, 2), (2, 2), (3, 2), (2, 3), (2, 4), (4, 2)]  # (nodes, ranks per node)


def _inputs(n, p, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) * (r + 1) for r in range(p)]


def _buffers(numels, p, local):
    """The oracle's per-rank error buffers: rank r's are those of its shard's exchange."""
    n, nodes = sum(numels), p // local
    shards = node_shards(n, local)
    we = [torch.zeros(padded_numel(shards[r % local][1] - shards[r % local][0], nodes)) for r in range(p)]
    se = [torch.zeros(w.numel() // nodes) for w in we]
    return we, se


def _run(numels, xs_per_call, nodes, local, steps=None):
    n, p = sum(numels), nodes * local

    def body(rank, transport):
        ex = HierarchicalExchange(numels, transport, transport.node_split("t"), "h")
        outs = []
        for c, xs in enumerate(xs_per_call):
            ex.step = c + 1 if steps is None else steps[c][rank]
            ex.input.zero_()
            ex.input[:n] = xs[rank]
            result = ex.gather(ex.serve(ex.start(ex.input)))
            if result is None:
                ex.rollback()
                outs.append(None)
            else:
                ex.commit()
                outs.append(result.clone())
        return outs, ex.worker_error.clone(), ex.server_error.clone()
    return run_threads(p, body, ranks_per_node=local)


@pytest.mark.parametrize("nodes, local", TOPOLOGIES)
@pytest.mark.parametrize("numels", [[5000], [300, 7, 4096, 1], [3]])
def test_two_level_exchange_equals_the_oracle_bitwise_on_every_rank(numels, nodes, local):
    """Three exchanges in a row (error feedback carried), blocks of 256 elements cut at the
    shard ends; [3] leaves shards empty at L = 4."""
    numels = scale_segments(numels, 256)
    p, n = nodes * local, sum(numels)
    calls = [_inputs(n, p, seed=c) for c in range(3)]
    got = _run(numels, calls, nodes, local)
    we, se = _buffers(numels, p, local)
    for c, xs in enumerate(calls):
        want = simulate_hierarchical_allreduce(xs, we, se, local, numels)
        for r in range(p):
            assert torch.equal(got[r][0][c], want), (c, r)
    for r in range(p):
        assert torch.equal(got[r][1], we[r]) and torch.equal(got[r][2], se[r])


def test_one_rank_per_node_is_the_flat_exchange():
    """L = 1: one shard, the node average is the rank's own y, so C_2 is the flat C bit for bit."""
    numels = scale_segments([1000, 37], 256)
    n, p = sum(numels), 3
    xs = _inputs(n, p, seed=5)
    two = _run(numels, [xs], p, 1)

    def flat(rank, transport):
        ex = Exchange(numels, transport, "f")
        ex.input[:n] = xs[rank]
        token = ex.prepare(ex.input)
        return ex.finish(None, token, torch.empty(n))
    got = run_threads(p, flat)
    for r in range(p):
        assert torch.equal(two[r][0][0], got[r])


def test_one_node_averages_exactly():
    """N = 1: no 1-bit level; every rank gets the float32 average in local-rank order."""
    n, p = 777, 3
    xs = _inputs(n, p, seed=6)
    got = _run([n], [xs], 1, p)
    want = (xs[0] + xs[1] + xs[2]) / 3
    for r in range(p):
        assert torch.equal(got[r][0][0], want)


@pytest.mark.parametrize("nodes, local, bad", [(2, 2, 3), (2, 2, 0), (3, 2, 4), (2, 3, 2)])
def test_a_non_finite_input_on_any_rank_skips_every_shard_on_every_rank(nodes, local, bad):
    """A NaN in one rank's y reaches only its shard's exchange; the flags of step 3 skip the
    exchange everywhere and leave every error buffer as the oracle, which skips it too."""
    numels = scale_segments([3000], 256)
    p, n = nodes * local, sum(numels)
    calls = [_inputs(n, p, seed=c) for c in range(3)]
    calls[1][bad][17] = float("nan")  # shard 0 only
    got = _run(numels, calls, nodes, local)
    we, se = _buffers(numels, p, local)
    for c, xs in enumerate(calls):
        want = simulate_hierarchical_allreduce(xs, we, se, local, numels)
        for r in range(p):
            if c == 1:
                assert want is None and got[r][0][c] is None
            else:
                assert torch.equal(got[r][0][c], want)
    for r in range(p):
        assert torch.equal(got[r][1], we[r]) and torch.equal(got[r][2], se[r])


@pytest.mark.parametrize("odd", [0, 1, 3])
def test_ranks_at_different_steps_fail_on_every_rank(odd):
    """One rank a step ahead, inside a node (odd = 1) or on another node: every rank raises,
    naming both steps."""
    numels, nodes, local = [1000], 2, 2
    xs = _inputs(1000, 4)
    steps = [[5 + (r == odd) for r in range(4)]]
    with pytest.raises(StepMismatchError, match="steps 5 and 6"):
        _run(numels, [xs], nodes, local, steps=steps)


def _words(b):
    return -(-b // 4) * 4


@pytest.mark.parametrize("nodes, local", [(1, 2), (3, 1), (2, 2), (1, 5), (3, 2), (7, 1), (2, 4), (4, 2)])
def test_bytes_per_level_follow_the_formula(nodes, local):
    """Inside a node (L−1)·(4 + 4m) + (L−1)·words(12 + 4m) bytes, m = ceil(n/L); between nodes
    the flat formula at world size N for the rank's shard: (N−1)·(words(4S + 4 + C/8) +
    words(12 + 4S + C/8)). The job's counter holds both."""
    numels = scale_segments([5000, 37, 3000], 256)
    n, p = sum(numels), nodes * local
    offsets = segment_offsets(numels)

    def body(rank, transport):
        intra, cross = transport.node_split("b")
        ex = HierarchicalExchange(numels, transport, (intra, cross), "b")
        ex.input[:n] = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        assert ex.gather(ex.serve(ex.start(ex.input))) is not None
        ex.commit()
        total = lambda c: sum(c.bytes_sent.values())  # noqa: E731
        return ex.inner.max_pieces, ex.inner.chunk_numel, total(intra.counter), total(cross.counter), \
            total(transport.counter)
    m = -(-n // local)
    for r, (s, chunk, inside, between, everything) in enumerate(run_threads(p, body, ranks_per_node=local)):
        assert inside == (local - 1) * (4 + 4 * m) + (local - 1) * _words(12 + 4 * m)
        assert between == (nodes - 1) * (_words(4 * s + 4 + chunk // 8) + _words(12 + 4 * s + chunk // 8))
        assert everything == inside + between
        lo, hi = node_shards(n, local)[r % local]
        assert chunk == padded_numel(hi - lo, nodes) // nodes
        assert s <= len(shard_segments(offsets, lo, hi))


def test_inter_node_bytes_per_node_drop_about_l_fold():
    """Per node and exchange, the bytes that cross nodes against the flat exchange's bytes to
    ranks of other nodes, 2 nodes × 4 ranks: at most 0.3 (ideal: 1/L = 0.25, plus scales)."""
    numels = scale_segments([1 << 16], 256)
    n, nodes, local = sum(numels), 2, 4
    p = nodes * local

    def two(rank, transport):
        intra, cross = transport.node_split("r")
        ex = HierarchicalExchange(numels, transport, (intra, cross), "r")
        ex.input[:n] = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        ex.gather(ex.serve(ex.start(ex.input)))
        return sum(cross.counter.bytes_sent.values())

    def flat(rank, transport):
        ex = Exchange(numels, transport, "r")
        ex.input[:n] = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        ex.prepare(ex.input)
        # each message goes to one rank; (P − L) of the P − 1 others are on other nodes
        return sum(transport.counter.bytes_sent.values()) * (p - local) / (p - 1)
    per_node_two = sum(run_threads(p, two, ranks_per_node=local)[:local])
    per_node_flat = sum(run_threads(p, flat)[:local])
    assert per_node_two / per_node_flat <= 0.3


# -- the optimizer with hierarchical=True -------------------------------------------------------------
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "mp"))
import common  # noqa: E402
import hvd_zoadam  # noqa: E402
from hvd_zoadam import Schedule  # noqa: E402
from hvd_zoadam.oracle.simulate import simulate_zoadam  # noqa: E402

KNOBS = dict(var_freeze_step=6, var_update_scaler=2, local_step_scaler=3, local_step_clipper=4,
             local_step_policy="steps")


def _train(p, local, steps=24, hierarchical=True, **kw):
    def body(rank, transport):
        model = common.mlp()
        opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=common.LR),
                                              named_parameters=model.named_parameters(), transport=transport,
                                              hierarchical=hierarchical, **KNOBS, **kw)
        for t in range(1, steps + 1):
            opt.zero_grad()
            common.loss_fn(model, t, rank).backward()
            opt.step()
        b = opt._buckets[0].exchange
        return [q.detach().clone() for q in model.parameters()], opt.comm_stats(), b.worker_error.clone(), \
            b.server_error.clone(), opt
    return run_threads(p, body, ranks_per_node=local)


@pytest.mark.parametrize("nodes, local", [(2, 2), (3, 2), (2, 3), (4, 2)])
def test_training_runs_equal_the_two_level_simulation_bitwise(nodes, local):
    """24 steps of every kind (VARIANCE, COMPRESSED, LOCAL, SYNC) with hierarchical=True on
    N × L thread-ranks: every rank's parameters equal the oracle's, which runs the same schedule
    over simulate_hierarchical_allreduce; different from the flat run's."""
    p = nodes * local
    got = _train(p, local)
    params0 = [q.detach().clone() for q in common.mlp().parameters()]
    want, _ = simulate_zoadam(params0, common.grads_at, world_size=p, steps=24, schedule=Schedule(**KNOBS),
                              lr_fn=lambda t: common.LR, ranks_per_node=local)
    flat, _ = simulate_zoadam(params0, common.grads_at, world_size=p, steps=24, schedule=Schedule(**KNOBS),
                              lr_fn=lambda t: common.LR)
    for r in range(p):
        assert all(torch.equal(a, b) for a, b in zip(got[r][0], want[r])), r
    assert not all(torch.equal(a, b) for a, b in zip(want[0], flat[0]))
    stats = got[0][1]["hierarchical"]
    assert stats["nodes"] == nodes and stats["ranks_per_node"] == local
    assert stats["intra_node_bytes"] > 0 and stats["inter_node_bytes"] > 0
    assert got[0][1]["bytes_sent_total"] >= stats["intra_node_bytes"] + stats["inter_node_bytes"]


def test_auto_is_flat_on_one_node_and_two_level_on_several():
    one = _train(4, 4, steps=8, hierarchical="auto")
    two = _train(4, 2, steps=8, hierarchical="auto")
    assert "hierarchical" not in one[0][1]
    assert two[0][1]["hierarchical"]["nodes"] == 2


def test_hierarchical_option_is_checked():
    model = common.mlp()
    with pytest.raises(ValueError, match="hierarchical must be False, True or 'auto'"):
        hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters()), transport=None, hierarchical="yes")


def test_uneven_nodes_are_refused_naming_both_counts():
    from hvd_zoadam.comm.thread import ThreadGroup
    group = ThreadGroup(6, ranks_per_node=4)
    with pytest.raises(ValueError, match="4 ranks per node do not divide the world size 6"):
        group.transports()[0].node_split("x")


def test_settings_check_names_a_topology_difference():
    """A rank that sees another topology than its peers fails the layout check on every rank."""
    def body(rank, transport):
        model = common.mlp()
        opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=common.LR),
                                              named_parameters=model.named_parameters(), transport=transport,
                                              hierarchical=rank != 1, **KNOBS)
        opt.zero_grad()
        common.loss_fn(model, 1, rank).backward()
        opt.step()
    with pytest.raises((ValueError, Exception), match="hierarchical"):
        run_threads(2, body, ranks_per_node=1, timeout_s=20)


# -- real jobs: mpirun, nodes simulated by HVD_ZOADAM_RANKS_PER_NODE -----------------------------------
from conftest import load_ranks, run_job  # noqa: E402

MPI_JOBS = [(2, 1), (2, 2), (3, 1), (4, 2)]  # (ranks, ranks per node)


@pytest.fixture(scope="module", params=MPI_JOBS, ids=[f"np{p}-L{l}" for p, l in MPI_JOBS])
def mpi_job(request, tmp_path_factory):
    p, local = request.param
    out = tmp_path_factory.mktemp(f"hier{p}{local}")
    run_job("mpi", p, ["tests/mp/worker_hier.py", str(out)], env={"HVD_ZOADAM_RANKS_PER_NODE": str(local)})
    return p, local, load_ranks(out, p)



def test_mpi_ranks_that_disagree_on_hierarchical_fail_at_construction_on_every_rank(mpi_job):
    """Rank 1 passes hierarchical=False, the others True: no rank hangs in a communicator split
    (which rank 1 would never join). The others' agreement at construction meets rank 1's
    first-step settings check, and every rank raises the settings mismatch naming the
    hierarchical values (None: rank 1's flat topology)."""
    p, _, ranks = mpi_job
    for r in ranks:
        err = r["mismatch"]["error"]
        assert err is not None and "settings or parameter layout differ across ranks" in err, (r["rank"], err)
        if r["rank"] == 1:
            assert "hierarchical: this rank (1) has None, rank 0 has True" in err, err
        else:
            assert f"hierarchical: this rank ({r['rank']}) has True, rank 1 has None" in err, err
        assert r["mismatch"]["seconds"] < 30

def test_mpi_two_level_exchange_equals_the_oracle_and_counts_the_formula(mpi_job):
    p, local, ranks = mpi_job
    from hvd_zoadam.comm.hierarchical import HierarchicalExchange  # noqa: F401
    numels = scale_segments([5000, 37, 3000], 256)
    n, nodes = sum(numels), p // local
    we, se = _buffers(numels, p, local)
    for call in range(3):
        want = simulate_hierarchical_allreduce([common.car_input(n, r, call) for r in range(p)], we, se, local, numels)
        for r in range(p):
            assert torch.equal(ranks[r]["exchange"]["outs"][call], want), (call, r)
    m = -(-n // local)
    for r in range(p):
        ex = ranks[r]["exchange"]
        assert (ex["nodes"], ex["local"], ex["node"], ex["local_rank"]) == (nodes, local, r // local, r % local)
        assert torch.equal(ex["we"], we[r]) and torch.equal(ex["se"], se[r])
        assert ex["intra"] == 3 * ((local - 1) * (4 + 4 * m) + (local - 1) * _words(12 + 4 * m))  # 3 exchanges
        s, chunk = ex["max_pieces"], ex["chunk"]
        assert ex["cross"] == 3 * (nodes - 1) * (_words(4 * s + 4 + chunk // 8) + _words(12 + 4 * s + chunk // 8))
        assert ex["all"] == ex["intra"] + ex["cross"]


def test_mpi_training_runs_equal_the_simulation_flat_and_two_level(mpi_job):
    p, local, ranks = mpi_job
    params0 = [q.detach().clone() for q in common.mlp().parameters()]
    for hierarchical, rpn in ((True, local), (False, None)):
        want, _ = simulate_zoadam(params0, common.grads_at, world_size=p, steps=common.TRAIN_STEPS,
                                  schedule=Schedule(**KNOBS), lr_fn=lambda t: common.LR, ranks_per_node=rpn)
        for r in range(p):
            got = ranks[r]["train"][hierarchical]["final"]
            # Horovod's allreduce of the VARIANCE steps sums in its own order at P = 3 (as in
            # test_multiprocess); the worker checked bitwise equality across ranks after every sync
            for a, b in zip(got, want[r]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=(hierarchical, r))
            if p == 2:  # an average of two terms has one rounding whatever the order: bit for bit
                assert all(torch.equal(a, b) for a, b in zip(got, want[r])), (hierarchical, r)
    if local == 1:
        for r in range(p):
            assert all(torch.equal(a, b) for a, b in zip(ranks[r]["train"][True]["final"],
                                                          ranks[r]["train"][False]["final"]))
    stats = ranks[0]["train"][True]["stats"]
    assert ("hierarchical" in stats) == (p > 1)
    owed = [r["train"][True]["owed"] for r in ranks]
    for o in owed[1:]:
        assert all(torch.equal(o["worker_error"][k], owed[0]["worker_error"][k]) for k in o["worker_error"])
        assert all(torch.equal(o["server_error"][k], owed[0]["server_error"][k]) for k in o["server_error"])


# -- checkpoints -------------------------------------------------------------------------------------
def test_pooled_error_feedback_of_a_two_level_run_keeps_what_the_job_owes():
    """After 16 steps at 2 nodes × 2 ranks: ``error_feedback_state()`` holds the mean over nodes of
    each node's worker error (its ranks' shards put together) and every server chunk in place.
    Loaded back into the two levels, each rank's server chunk is its own again and its worker
    error the mean's shard; loaded into a flat world of 2 every rank holds the mean."""
    nodes, local = 2, 2
    got = _train(4, local, steps=16)
    opts = [g[4] for g in got]
    n = opts[0]._buckets[0].numel
    shards = node_shards(n, local)

    def pooled(rank, transport):
        return opts[rank].error_feedback_state()
    states = run_threads(4, pooled, ranks_per_node=local)  # collective: the thread transports of _train
    state = states[0]
    flat = lambda d: torch.cat([d[k] for k in sorted(d)])  # noqa: E731  (pids in order = bucket order)
    worker, server = flat(state["worker_error"]), flat(state["server_error"])
    want_w = torch.zeros(n, dtype=torch.float64)
    want_s = torch.zeros(n)
    for r, o in enumerate(opts):
        ex = o._buckets[0].exchange
        lo, hi = shards[r % local]
        want_w[lo:hi] += ex.worker_error[:hi - lo].double()
        a = (r // local) * ex.inner.chunk_numel
        b = min(hi - lo, a + ex.inner.chunk_numel)
        want_s[lo + a:lo + b] = ex.server_error[:b - a]
    assert bool(worker.any()) and bool(server.any())
    assert torch.equal(worker, (want_w / nodes).float()) and torch.equal(server, want_s)
    assert all(torch.equal(flat(s["worker_error"]), worker) for s in states)
    for o in opts:
        ex = o._buckets[0].exchange
        before = ex.server_error.clone()
        o.load_error_feedback(state)
        lo, hi = ex.lo, ex.hi
        assert torch.equal(ex.server_error, before)
        assert torch.equal(ex.worker_error[:hi - lo], worker[lo:hi])

    def load_flat(rank, transport):
        model = common.mlp()
        opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=common.LR),
                                              named_parameters=model.named_parameters(), transport=transport, **KNOBS)
        opt.load_error_feedback(state)
        return opt._buckets[0].exchange.worker_error[:n].clone()
    assert all(torch.equal(w, worker) for w in run_threads(2, load_flat))


def test_rank_files_restore_only_into_the_same_topology():
    got = _train(4, 2, steps=10)
    saved = got[1][4].rank_state_dict()
    assert saved["hierarchical"] == [2, 2]
    ex = got[1][4]._buckets[0].exchange
    want = ex.worker_error.clone()
    assert got[1][4].load_rank_state_dict(saved) and torch.equal(ex.worker_error, want)
    assert not got[1][4].load_rank_state_dict(dict(saved, hierarchical=None))
    assert not bool(ex.worker_error.any())


def test_a_transport_that_cannot_split_refuses_true_and_stays_flat_under_auto():
    """Horovod's collectives (the base Transport's node_split): True is a ValueError that names
    the fix, "auto" is flat, False never asks; nothing is collective (a rank may build the
    optimizer alone, as in an elastic job's new worker)."""
    from hvd_zoadam.comm.hierarchical import node_levels
    from hvd_zoadam.comm.transport import Transport
    plain = Transport(0, 4)  # its allgather_object raises: not called
    with pytest.raises(ValueError, match="hierarchical=True needs transport='mpi'"):
        node_levels(plain, True, "x")
    assert node_levels(plain, "auto", "x") is None and node_levels(plain, False, "x") is None
