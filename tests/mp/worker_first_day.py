"""Multi-process worker: what a user's first day meets, under horovodrun (the Horovod front end) or
torchrun (``HVD_ZOADAM_TEST_FRONT_END=torch.distributed``: :mod:`hvd_zoadam.distributed`).

Usage: ``worker_first_day.py OUT_DIR``. Each scenario runs on every rank; rank r writes
``OUT_DIR/rank{r}.pt`` with what it saw (an exception's text where one was raised), and the
warnings of torch or Horovod that construction and the steps gave.
"""
from __future__ import annotations

import os
import sys
import traceback
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

hvd, FRONT_END, _ = common.front_end()


def model(seed: int) -> torch.nn.Module:
    with common._INIT_LOCK:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def build(net, lr=common.LR, **knobs):
    return FRONT_END(torch.optim.AdamW(net.parameters(), lr=lr), named_parameters=net.named_parameters(), **knobs)


def one_step(net, opt, t, backward=True):
    opt.zero_grad()
    if backward:
        common.loss_fn(net, t, hvd.rank()).backward()
    opt.step()


def threads(out):
    """The kernel threads of a rank once an optimizer is built (the launcher's ranks per host)."""
    import numba
    net = model(0)
    build(net)
    out["threads"] = {"in_use": numba.get_num_threads(), "pool": numba.config.NUMBA_NUM_THREADS,
                      "cores": os.cpu_count()}
    assert 1 <= out["threads"]["in_use"] <= out["threads"]["pool"], out["threads"]


def different_init(out):
    """Each rank initialises its own model and forgets the broadcast: the first step refuses on
    every rank, naming broadcast_parameters; with the broadcast the same model trains."""
    net = model(100 + hvd.rank())
    opt = build(net)
    common.loss_fn(net, 1, hvd.rank()).backward()
    try:
        opt.step()
        out["different_init"] = "no error"
    except ValueError as exc:
        out["different_init"] = str(exc)
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)  # the fix, then the same optimizer steps on
    for t in range(1, 4):
        one_step(net, opt, t)
    out["after_broadcast"] = common.digests_by_rank(hvd, list(net.parameters()))


def no_backward(out):
    """Rank 1 calls step() without backward() at step 4 (overlap armed): every rank raises, naming it."""
    net = model(0)
    opt = build(net)
    for t in range(1, 4):
        one_step(net, opt, t)
    try:
        one_step(net, opt, 4, backward=hvd.rank() != 1)
        out["no_backward"] = "no error"
    except RuntimeError as exc:
        out["no_backward"] = str(exc)


def freeze(out):
    """A layer frozen mid-training (requires_grad_(False)), before and after the variance freeze,
    then unfrozen: training goes on, the frozen layer and its state stay still, ranks stay equal."""
    net = model(0)
    opt = build(net, **common.TRAIN)
    frozen_steps = set(range(3, 6)) | set(range(10, 17))
    record = []
    for t in range(1, common.TRAIN_STEPS + 1):
        for p in net[0].parameters():
            p.requires_grad_(t not in frozen_steps)
        before = [p.detach().clone() for p in net[0].parameters()]
        state_before = [opt.state[p]["exp_avg"].clone() for p in net[0].parameters()]
        one_step(net, opt, t)
        still = all(torch.equal(a, p) for a, p in zip(before, net[0].parameters())) and \
            all(torch.equal(a, opt.state[p]["exp_avg"]) for a, p in zip(state_before, net[0].parameters()))
        record.append((t, t in frozen_steps, still, opt.schedule.kind(t).value,
                       common.digests_by_rank(hvd, list(net.parameters()))))
    kinds = {kind for _, frozen, _, kind, _ in record if frozen}
    assert kinds & {"variance", "compressed"} and kinds & {"local", "sync"}, \
        f"the frozen steps must span the variance freeze; their kinds: {sorted(kinds)}"
    out["freeze"] = record


def scheduler_on_inner(out):
    """An LR scheduler built on the AdamW before it is wrapped, the optimizer state broadcast: the
    scheduler still drives the step's learning rate, with no warning."""
    net = model(0)
    inner = torch.optim.AdamW(net.parameters(), lr=1.0, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    opt = FRONT_END(inner, named_parameters=net.named_parameters())
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for t in range(1, 4):
        one_step(net, opt, t)
        schedule.step()
    before = [p.detach().clone() for p in net.parameters()]
    one_step(net, opt, 4)
    moved = max((p.detach() - b).abs().max().item() for p, b in zip(net.parameters(), before))
    out["scheduler_on_inner"] = {"lr": opt.param_groups[0]["lr"],
                                 "shared": inner.param_groups[0] is opt.param_groups[0],
                                 "largest_move": moved, "inner_state": len(inner.state_dict()["state"])}


SCENARIOS = [threads, different_init, no_backward, freeze, scheduler_on_inner]


def main():
    out_dir = sys.argv[1]
    hvd.init()
    out = {"rank": hvd.rank(), "errors": {}}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for scenario in SCENARIOS:
            try:
                scenario(out)
            except Exception:  # noqa: BLE001 - reported to the test, which fails naming it
                out["errors"][scenario.__name__] = traceback.format_exc()
    out["warnings"] = [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in seen]
    torch.save(out, os.path.join(out_dir, f"rank{hvd.rank()}.pt"))
    hvd.shutdown()


if __name__ == "__main__":
    main()
