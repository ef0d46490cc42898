"""Multi-process worker for the two-level exchange: ``worker_hier.py OUT_DIR`` under mpirun, with
``HVD_ZOADAM_RANKS_PER_NODE`` giving the simulated nodes. Rank r writes ``OUT_DIR/rank{r}.pt``:

* ``exchange``: three two-level exchanges of a multi-segment bucket (outputs, error buffers, and
  the bytes each level counted);
* ``train``: 24 steps of 0/1 Adam with ``hierarchical=True`` and with ``False`` (final
  parameters, ``comm_stats()``, the error feedback the job owes after the last step);
* ``mismatch``: the error (or None) of building the optimizer with ``hierarchical=False`` on
  rank 1 and ``True`` elsewhere and taking one step, and the seconds it took.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402
from hvd_zoadam.comm.hierarchical import HierarchicalExchange  # noqa: E402
from hvd_zoadam.core.layout import scale_segments  # noqa: E402

hvd, FRONT_END, TRANSPORT = common.front_end()  # mpirun: MPITransport; torchrun: torch.distributed

NUMELS = scale_segments([5000, 37, 3000], 256)


def scenario_exchange(out):
    transport = TRANSPORT()
    intra, cross = transport.node_split("w")
    ex = HierarchicalExchange(NUMELS, transport, (intra, cross), "w")
    n = sum(NUMELS)
    outs = []
    for call in range(3):
        ex.step = call + 1
        ex.input[:n] = common.car_input(n, hvd.rank(), call)
        result = ex.gather(ex.serve(ex.start(ex.input)))
        ex.commit()
        outs.append(result.clone())
    common.assert_same_on_all_ranks(hvd, outs, "two-level exchange outputs")
    total = lambda c: sum(c.bytes_sent.values())  # noqa: E731
    out["exchange"] = {"outs": outs, "we": ex.worker_error.clone(), "se": ex.server_error.clone(),
                       "intra": total(intra.counter), "cross": total(cross.counter), "all": total(transport.counter),
                       "nodes": cross.world_size, "local": intra.world_size, "node": cross.rank,
                       "local_rank": intra.rank, "max_pieces": ex.inner.max_pieces if ex.inner else 0,
                       "chunk": ex.inner.chunk_numel if ex.inner else 0}


def scenario_train(out):
    res = {}
    for hierarchical in (True, False):
        model = common.mlp()
        opt = FRONT_END(torch.optim.Adam(model.parameters(), lr=common.LR), named_parameters=model.named_parameters(),
                        transport=TRANSPORT(), hierarchical=hierarchical, **common.TRAIN)
        for t in range(1, common.TRAIN_STEPS + 1):
            opt.zero_grad()
            common.loss_fn(model, t, hvd.rank()).backward()
            opt.step()
            if opt.schedule.kind(t).value == "sync":
                common.assert_same_on_all_ranks(hvd, list(model.parameters()), f"parameters after sync {t}")
        res[hierarchical] = {"final": [p.detach().clone() for p in model.parameters()], "stats": opt.comm_stats(),
                             "owed": opt.error_feedback_state()}
    out["train"] = res


def scenario_mismatch(out):
    import time
    model = common.mlp()
    start = time.perf_counter()
    try:
        opt = FRONT_END(torch.optim.Adam(model.parameters(), lr=common.LR), named_parameters=model.named_parameters(),
                        transport=TRANSPORT(), hierarchical=hvd.rank() != 1, **common.TRAIN)
        opt.zero_grad()
        common.loss_fn(model, 1, hvd.rank()).backward()
        opt.step()
        out["mismatch"] = {"error": None}
    except ValueError as exc:
        out["mismatch"] = {"error": str(exc)}
    out["mismatch"]["seconds"] = time.perf_counter() - start


def main():
    hvd.init()
    out = {"rank": hvd.rank(), "size": hvd.size()}
    scenario_exchange(out)
    scenario_train(out)
    scenario_mismatch(out)
    torch.save(out, os.path.join(sys.argv[1], f"rank{hvd.rank()}.pt"))
    hvd.shutdown()


if __name__ == "__main__":
    main()
