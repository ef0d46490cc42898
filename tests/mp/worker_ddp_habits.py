"""Multi-process worker: Horovod's habits under horovodrun. ``hvd.broadcast_optimizer_state``,
then a step() with no gradient on any rank (and more such steps later), with overlap on (the
exchange starts in backward()) and off; the same training without them as the reference.

Usage: ``worker_ddp_habits.py OUT_DIR``. Rank r writes ``OUT_DIR/rank{r}.pt``: each p.grad after
the broadcast (None, or its sum), whether each no-gradient step left parameters, state and
counters as they were (overlap on, then off), the kinds of the steps taken and digests of the
parameters of the three runs from every rank; ``errors`` holds a scenario's traceback.
"""
from __future__ import annotations

import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

hvd, FRONT_END, _ = common.front_end()
NOOP_AT = (4, 5, 12, 16)  # VARIANCE, COMPRESSED, SYNC (overlap armed at each), LOCAL under common.TRAIN


def snapshot(net, opt) -> list:
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in net.parameters()]
    groups = repr([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    return [[p.detach().clone() for p in net.parameters()], state, groups]


def same(a, b) -> bool:
    return (all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and a[2] == b[2]
            and all(all(torch.equal(s[k], t[k]) for k in s) for s, t in zip(a[1], b[1])))


def train(out, noops: bool, overlap: bool = True):
    net = common.mlp(seed=1234 + hvd.rank())  # ranks differ until broadcast
    opt = FRONT_END(torch.optim.AdamW(net.parameters(), lr=common.LR), named_parameters=net.named_parameters(),
                    overlap=overlap, **common.TRAIN)
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    unchanged, kinds = [], []
    if noops:
        out["grads_after_broadcast"] = [None if p.grad is None else float(p.grad.sum()) for p in net.parameters()]
        before = snapshot(net, opt)
        opt.step()  # the habit: a step before training, no backward() on any rank
        unchanged.append(same(before, snapshot(net, opt)))
    for t in range(1, common.TRAIN_STEPS + 1):
        if noops and t in NOOP_AT:
            before = snapshot(net, opt)
            opt.zero_grad()
            opt.step()
            unchanged.append(same(before, snapshot(net, opt)))
        opt.zero_grad()
        common.loss_fn(net, t, hvd.rank()).backward()
        opt.step()
        kinds.append(opt.schedule.kind(t).value)
    if noops:
        out["unchanged"] = out.get("unchanged", []) + unchanged
        out["kinds"] = kinds
    return common.digests_by_rank(hvd, list(net.parameters()))


def main():
    out_dir = sys.argv[1]
    hvd.init()
    out = {"rank": hvd.rank(), "errors": {}}
    try:
        out["reference_digests"] = train(out, noops=False)
        out["digests"] = train(out, noops=True)
        out["digests_overlap_off"] = train(out, noops=True, overlap=False)
    except Exception:  # noqa: BLE001 - reported to the test, which fails naming it
        out["errors"]["train"] = traceback.format_exc()
    torch.save(out, os.path.join(out_dir, f"rank{hvd.rank()}.pt"))
    hvd.shutdown()


if __name__ == "__main__":
    main()
