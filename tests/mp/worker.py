"""Multi-process worker: runs every scenario on this rank and saves what it saw.

Usage (launched by tests/conftest.py): ``worker.py OUT_DIR``. Rank r writes
``OUT_DIR/rank{r}.pt``; the pytest side compares against the in-process oracle.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402
import hvd_zoadam  # noqa: E402

hvd, FRONT_END, _ = common.front_end()  # Horovod, or torch.distributed under torchrun

TRANSPORT = os.environ.get("HVD_ZOADAM_TEST_TRANSPORT", "auto")


def scenario_car(out):
    p, r = hvd.size(), hvd.rank()
    res = {}
    for n in common.CAR_SIZES:
        we = torch.zeros(hvd_zoadam.padded_numel(n, p))
        se = torch.zeros(hvd_zoadam.padded_numel(n, p) // p)
        outs = []
        for call in range(common.CAR_CALLS):
            outs.append(hvd_zoadam.compressed_allreduce(common.car_input(n, r, call), we, se, transport=TRANSPORT))
        common.assert_same_on_all_ranks(hvd, outs, f"compressed_allreduce outputs, n={n}")
        res[n] = {"outs": outs, "we": we.clone(), "se": se.clone()}
    for dtype in (torch.float16, torch.bfloat16):
        n = 37
        we = torch.zeros(hvd_zoadam.padded_numel(n, p))
        se = torch.zeros(hvd_zoadam.padded_numel(n, p) // p)
        res[str(dtype)] = hvd_zoadam.compressed_allreduce(common.car_input(n, r, 0, dtype), we, se, transport=TRANSPORT)
    # A NaN on the last rank only: every rank raises, and no buffer changes.
    n = 19
    we = torch.zeros(hvd_zoadam.padded_numel(n, p))
    se = torch.zeros(hvd_zoadam.padded_numel(n, p) // p)
    hvd_zoadam.compressed_allreduce(common.car_input(n, r, 0), we, se, transport=TRANSPORT)
    before = (we.clone(), se.clone())
    x = common.car_input(n, r, 1)
    if r == p - 1:
        x[3] = float("nan")
    try:
        hvd_zoadam.compressed_allreduce(x, we, se, transport=TRANSPORT)
        res["nan"] = "no error"
    except hvd_zoadam.NonFiniteError:
        res["nan"] = "raised"
    res["nan_untouched"] = torch.equal(we, before[0]) and torch.equal(se, before[1])
    assert res["nan"] == "raised", "a NaN on the last rank must raise NonFiniteError on every rank"
    out["car"] = res


def train(make_opt, steps, record_sync=False, loss_fn=common.loss_fn):
    model = common.mlp()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = make_opt(model)
    per_step = []
    for t in range(1, steps + 1):
        opt.zero_grad()
        loss_fn(model, t, hvd.rank()).backward()
        kind = opt._next_kind()[1].value if isinstance(opt, hvd_zoadam.DistributedAdamOptimizer) else "adam"
        opt.step()
        if kind in ("sync", "variance", "compressed", "adam"):
            common.assert_same_on_all_ranks(hvd, list(model.parameters()), f"parameters after {kind} step {t}")
        if record_sync:
            per_step.append({"kind": kind,
                             "params": [p.detach().clone() for p in model.parameters()],
                             "exp_avg": [opt.state[p]["exp_avg"].clone() for p in model.parameters()]})
    return model, opt, per_step


def scenario_adam_oracle(out):
    res = {}
    for cls, wd in ((torch.optim.Adam, 0.0), (torch.optim.Adam, 0.01), (torch.optim.AdamW, 0.01)):
        key = f"{cls.__name__}-{wd}"
        base, _, _ = train(lambda m: hvd.DistributedOptimizer(cls(m.parameters(), lr=common.LR, weight_decay=wd),
                                                               named_parameters=m.named_parameters()), 12)
        zoa, _, _ = train(lambda m: FRONT_END(
            cls(m.parameters(), lr=common.LR, weight_decay=wd), named_parameters=m.named_parameters(),
            var_freeze_step=1000, var_update_scaler=10 ** 9), 12)
        res[key] = {"adam": [p.detach().clone() for p in base.parameters()],
                    "zoadam": [p.detach().clone() for p in zoa.parameters()]}
    out["adam_oracle"] = res


def scenario_train(out):
    res = {}
    for cls, wd in ((torch.optim.Adam, 0.0), (torch.optim.AdamW, 0.05)):
        model, opt, per_step = train(lambda m: FRONT_END(
            cls(m.parameters(), lr=common.LR, weight_decay=wd), named_parameters=m.named_parameters(),
            transport=TRANSPORT, **common.TRAIN), common.TRAIN_STEPS, record_sync=True)
        res[f"{cls.__name__}-{wd}"] = {"per_step": per_step, "stats": opt.comm_stats(), "transport": opt.transport.name,
                                       "final": [p.detach().clone() for p in model.parameters()]}
    out["train"] = res


def scenario_overlap(out):
    """Several buckets (bucket_cap_mb tiny), overlap on and off: the same parameters bit for bit."""
    res = {}
    for overlap in (True, False):
        model, opt, _ = train(lambda m: FRONT_END(
            torch.optim.AdamW(m.parameters(), lr=common.LR, weight_decay=0.01), named_parameters=m.named_parameters(),
            transport=TRANSPORT, bucket_cap_mb=40 * 4 / 2 ** 20, overlap=overlap, **common.TRAIN), common.TRAIN_STEPS)
        res[overlap] = {"params": [p.detach().clone() for p in model.parameters()], "buckets": len(opt._buckets),
                        "stats": opt.comm_stats()}
    out["overlap"] = res


def loss_without_a_gradient_on_the_last_rank(model, step, rank):
    """common.loss_fn, except that on the last rank the second layer's weight takes no part in
    the graph: it gets no gradient there and its hook never fires."""
    if rank < hvd.size() - 1:
        return common.loss_fn(model, step, rank)
    x, y = common.batch(step, rank)
    out = torch.nn.functional.linear(model[1](model[0](x)), model[2].weight.detach(), model[2].bias)
    return torch.nn.functional.mse_loss(out, y)


def scenario_missing_grad(out):
    """A parameter with no gradient on one rank, several buckets, overlap on and off: the hooks
    of that rank start fewer exchanges than the others'; the same parameters bit for bit."""
    res = {}
    for overlap in (True, False):
        model, opt, _ = train(lambda m: FRONT_END(
            torch.optim.AdamW(m.parameters(), lr=common.LR, weight_decay=0.01), named_parameters=m.named_parameters(),
            transport=TRANSPORT, bucket_cap_mb=40 * 4 / 2 ** 20, overlap=overlap, **common.TRAIN), common.TRAIN_STEPS,
            loss_fn=loss_without_a_gradient_on_the_last_rank)
        res[overlap] = {"params": [p.detach().clone() for p in model.parameters()], "buckets": len(opt._buckets),
                        "stats": opt.comm_stats()}
    out["missing_grad"] = res


def main():
    hvd.init()
    out = {"rank": hvd.rank(), "size": hvd.size(), "mpi_enabled": hvd.mpi_enabled()}
    out["horovod_imported"] = "horovod" in sys.modules
    for scenario in (scenario_car, scenario_adam_oracle, scenario_train, scenario_overlap, scenario_missing_grad):
        scenario(out)
    out["horovod_imported_after"] = "horovod" in sys.modules
    torch.save(out, os.path.join(sys.argv[1], f"rank{hvd.rank()}.pt"))
    hvd.shutdown()


if __name__ == "__main__":
    main()
