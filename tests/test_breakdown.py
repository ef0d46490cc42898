"""The step-time breakdown of the benchmarks: exclusive timers, the wait for the slowest rank
split out of the wire time by hand-computed cases, and a real 1-bit step's parts."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from hvd_zoadam import native
from hvd_zoadam.bench.breakdown import LABELS, Breakdown, split_waits, table
from hvd_zoadam.comm.protocol import Exchange
from hvd_zoadam.shell.driver import StepDriver


def _rank(steps, collectives):
    return {"steps": steps, "collectives": collectives}


def _row(step, kind, wire, wall=1.0):
    row = {"step": step, "kind": kind, "wall": wall, **{label: 0.0 for label in LABELS}}
    row["wire"] = wire
    row.pop("waiting_for_slowest")
    return row


def test_split_waits_moves_the_wait_for_the_last_starter_out_of_the_wire():
    # collective 0 (step 1): rank 0 starts at 10.0 and waits 10.0-10.5; rank 1 starts at 10.3
    # and waits 10.3-10.5. The data moves only after 10.3: rank 0 waited 0.3 for rank 1.
    # collective 1 (step 2): rank 1 is last (starts 20.2) but rank 0 begins its wait only at
    # 20.4, after it: no waiting. collective 2 (step 2): rank 0 starts at 30.0 (a blocking
    # start, 30.0-30.2), rank 1 at 31.0; rank 0 also waits 30.3-30.6: 0.2 + 0.3 before 31.0.
    r0 = _rank([_row(1, "sync", 0.5), _row(2, "local", 0.7)],
               [[1, "alltoall", "a", 10.0, [[10.0, 10.0], [10.0, 10.5]]],
                [2, "allgather", "b", 20.0, [[20.0, 20.0], [20.4, 20.5]]],
                [2, "alltoall", "c", 30.0, [[30.0, 30.2], [30.3, 30.6]]]])
    r1 = _rank([_row(1, "sync", 0.2), _row(2, "local", 0.1)],
               [[1, "alltoall", "a", 10.3, [[10.3, 10.3], [10.3, 10.5]]],
                [2, "allgather", "b", 20.2, [[20.2, 20.2], [20.2, 20.5]]],
                [2, "alltoall", "c", 31.0, [[31.0, 31.0], [31.0, 31.1]]]])
    rows = split_waits([r0, r1])
    by = {(i, row["step"]): row for i, row in enumerate(rows)}
    assert by[(0, 1)]["waiting_for_slowest"] == pytest.approx(0.3)
    assert by[(0, 1)]["wire"] == pytest.approx(0.2)
    assert by[(2, 1)]["waiting_for_slowest"] == 0.0 and by[(2, 1)]["wire"] == pytest.approx(0.2)
    assert by[(1, 2)]["waiting_for_slowest"] == pytest.approx(0.5)  # 0.0 (b) + 0.2 + 0.3 (c)
    assert by[(1, 2)]["wire"] == pytest.approx(0.2)
    assert by[(3, 2)]["waiting_for_slowest"] == 0.0
    # each collective's calls less its wait, by op: rank 0's alltoall 0.5 - 0.3 (step 1); its
    # allgather 0.1 and alltoall 0.2 + 0.3 - 0.5 (step 2)
    assert by[(0, 1)]["wire_by_op"] == {"alltoall": pytest.approx(0.2)}
    assert by[(1, 2)]["wire_by_op"] == {"allgather": pytest.approx(0.1), "alltoall": pytest.approx(0.0)}
    t = table(rows, 2)
    assert t["sync"]["steps"] == 1 and t["local"]["steps"] == 1
    assert t["sync"]["waiting_for_slowest"] == pytest.approx(0.15)  # mean of 0.3 and 0.0
    assert t["sync"]["wire"] == pytest.approx(0.2)
    assert t["sync"]["wire_by_op"] == {"alltoall": pytest.approx(0.2)}
    # step 2, mean of the ranks: allgather (0.1 + 0.3) / 2, alltoall (0.0 + 0.1) / 2
    assert t["local"]["wire_by_op"] == {"allgather": pytest.approx(0.2), "alltoall": pytest.approx(0.05)}


def test_split_waits_refuses_ranks_whose_collectives_do_not_pair():
    r0 = _rank([_row(1, "sync", 0.1)], [[1, "alltoall", "a", 0.0, [[0.0, 0.1]]]])
    r1 = _rank([_row(1, "sync", 0.1)], [])
    with pytest.raises(ValueError, match="pair by order"):
        split_waits([r0, r1])
    r1 = _rank([_row(1, "sync", 0.1)], [[1, "allgather", "a", 0.0, [[0.0, 0.1]]]])
    with pytest.raises(ValueError, match="differs across ranks"):
        split_waits([r0, r1])


def test_exclusive_time_goes_to_the_innermost_label():
    bd = Breakdown()
    bd.begin_step(1)
    with bd.region("optimizer"):
        time.sleep(0.05)
        with bd.region("kernels"):
            time.sleep(0.1)
    time.sleep(0.02)
    bd.end_step("sync")
    row = bd.steps[0]
    assert 0.1 <= row["kernels"] < 0.15
    assert 0.05 <= row["optimizer"] < 0.1  # the kernel's 0.1 s is not in it
    assert row["other"] >= 0.02
    assert row["wall"] == pytest.approx(row["kernels"] + row["optimizer"] + row["other"] + row["forward_backward"]
                                        + row["packing"] + row["wire"])
    assert row["kernels_by_name"] == {}  # a region is not a kernel function


def test_each_kernel_function_gets_its_own_exclusive_time():
    bd = Breakdown()
    inner = bd._timed(lambda: time.sleep(0.1), "kernels", "inner")
    outer = bd._timed(lambda: (time.sleep(0.05), inner()), "kernels", "outer")
    bd.begin_step(1)
    with bd.region("optimizer"):
        outer()
    bd.end_step("sync")
    row = bd.steps[0]
    assert 0.1 <= row["kernels_by_name"]["inner"] < 0.15 and 0.05 <= row["kernels_by_name"]["outer"] < 0.1
    assert sum(row["kernels_by_name"].values()) == pytest.approx(row["kernels"], abs=1e-12)
    bd.begin_step(2)  # each step starts from nothing
    bd.end_step("local")
    assert bd.steps[1]["kernels_by_name"] == {}


def test_install_times_a_real_exchange_and_uninstall_puts_everything_back():
    from hvd_zoadam.comm.thread import ThreadGroup
    originals = {name: getattr(native, name) for name in native.__all__}
    phases = {name: Exchange.__dict__[name] for name in ("start", "serve", "gather_status")}
    launch = StepDriver.__dict__["_launch"]
    native.warm_up()  # compiled first: a compiling rank would hold the other up in the kernels
    transports = ThreadGroup(2).transports()
    n = 4096
    out, flags, bds = [None, None], [None, None], [Breakdown().install(t) for t in transports]
    try:
        def work(r):
            ex = Exchange([n], transports[r], "b0")
            ex.step = 1
            bds[r].begin_step(1)
            with bds[r].region("optimizer"):
                y = torch.full((ex.padded_numel,), float(r + 1))
                if r == 1:
                    time.sleep(0.2)  # rank 1 starts late: rank 0 waits for it
                token = ex.prepare(y)
                out[r] = ex.finish(y, token, torch.empty(n))
                flags[r] = transports[r].allgather_flag(torch.tensor([r], dtype=torch.int32), "flag")
            bds[r].end_step("compressed")
        threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        for bd in reversed(bds):
            bd.uninstall()
    assert {name: getattr(native, name) for name in native.__all__} == originals
    assert {name: Exchange.__dict__[name] for name in phases} == phases
    assert StepDriver.__dict__["_launch"] is launch
    assert not {"start", "wait", "allgather_flag"} & set(vars(transports[0]))
    assert flags[0].tolist() == [0, 1]
    assert torch.allclose(out[0], torch.full((n,), 1.5))  # C of constant inputs is exact
    ranks = [bd.to_json() for bd in bds]
    # the flag is one record, not also the allgather that carries it
    assert [[c[1] for c in r["collectives"]] for r in ranks] == [["alltoall", "allgather", "flag"]] * 2
    rows = split_waits(ranks)
    assert rows[0]["kernels"] > 0 and rows[0]["packing"] > 0
    # the kernels by function, together exactly the label's time
    assert {"worker_compress", "server_reduce", "decompress"} <= set(rows[0]["kernels_by_name"])
    assert sum(rows[0]["kernels_by_name"].values()) == pytest.approx(rows[0]["kernels"], abs=1e-12)
    assert table(rows, 2)["compressed"]["kernels_by_name"] == pytest.approx(
        {k: (rows[0]["kernels_by_name"].get(k, 0) + rows[1]["kernels_by_name"].get(k, 0)) / 2
         for k in {*rows[0]["kernels_by_name"], *rows[1]["kernels_by_name"]}})
    assert rows[0]["waiting_for_slowest"] >= 0.15  # the 0.2 s rank 1 slept
    assert rows[1]["waiting_for_slowest"] < 0.05
