"""hvd.DistributedOptimizer's contract under real ranks: Horovod's own optimizer test patterns with
hvd_zoadam in place of the wrapper, resuming from an Adam checkpoint, an optimizer built on one
rank only, sparse gradients densified, and the process-set refusal.

Usage: ``worker_contract.py OUT_DIR`` under 2 ranks. Every scenario records what it saw (or the
error it met) in ``OUT_DIR/rank{r}.pt``; the pytest side checks it.
"""
from __future__ import annotations

import copy
import os
import sys
import traceback
import warnings

import horovod.torch as hvd
import torch

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402
import hvd_zoadam  # noqa: E402

TRANSPORT = os.environ.get("HVD_ZOADAM_TEST_TRANSPORT", "auto")


def zoadam(model, opt_cls=torch.optim.Adam, lr=1e-2, **kw):
    return hvd_zoadam.DistributedOptimizer(opt_cls(model.parameters(), lr=lr),
                                           named_parameters=model.named_parameters(), transport=TRANSPORT, **kw)


def before_init():
    """Horovod's order: the arguments are checked before Horovod is (here: not initialised)."""
    model = torch.nn.Linear(3, 2)
    try:
        hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters()),
                                        named_parameters=[("a", model.weight), ("a", model.bias)])
        return "no error"
    except ValueError as exc:
        return str(exc)


def is_an_adam(out):
    model = torch.nn.Linear(4, 2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # hvd_zoadam refuses ranks that start apart
    opt = zoadam(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    sched.step()
    w = torch.nn.Linear(4, 2)
    opt_w = hvd_zoadam.DistributedOptimizer(torch.optim.AdamW(w.parameters()), named_parameters=w.named_parameters(),
                                            transport=TRANSPORT)
    out["isinstance"] = {"adam": isinstance(opt, torch.optim.Adam), "optimizer": isinstance(opt, torch.optim.Optimizer),
                         "zoadam": isinstance(opt, hvd_zoadam.DistributedAdamOptimizer),
                         "adamw": isinstance(opt_w, torch.optim.AdamW),
                         "adam_not_adamw": not isinstance(opt, torch.optim.AdamW),
                         "lr_after_scheduler": opt.param_groups[0]["lr"]}


def broadcast_state_no_grad(out):
    """Horovod's test_broadcast_state_no_grad, with Adam (hvd_zoadam wraps Adam/AdamW only)."""
    class ModelNoGrad(torch.nn.Module):
        def __init__(self, a, b):
            super().__init__()
            self.a = torch.nn.Parameter(a.int(), requires_grad=False)
            self.b = torch.nn.Parameter(b)

        def forward(self, x):
            return torch.index_select(self.b, 0, self.a.long()) * x

    a = torch.Tensor([1, 3])
    b = torch.rand(4)
    model = ModelNoGrad(a, b)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001, weight_decay=1e-6)
    optimizer = hvd_zoadam.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                                transport=TRANSPORT)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    # hvd_zoadam's state exists from construction: Horovod runs no dummy step, which would have
    # left the trainable parameter a zero gradient; both gradients stay None
    assert optimizer.param_groups[0]['params'][0].grad is None
    was_zero = optimizer.param_groups[0]['params'][1].grad is None
    # and training goes on from there
    model(torch.ones(2)).sum().backward()
    optimizer.step()
    out["broadcast_no_grad"] = {"no_dummy_step": was_zero, "b": model.b.detach().clone()}


def dynamic_requires_grad(out):
    """Horovod's test_dynamic_requires_grad, with Adam."""
    gen = torch.nn.Conv2d(1, 10, 1)
    disc = torch.nn.Conv2d(10, 1, 1)
    hvd.broadcast_parameters(gen.state_dict(), root_rank=0)
    hvd.broadcast_parameters(disc.state_dict(), root_rank=0)
    inp = torch.rand([1, 1, 100, 100])
    gen_opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(gen.parameters(), lr=0.1),
                                              named_parameters=gen.named_parameters(), transport=TRANSPORT)
    disc_opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(disc.parameters(), lr=0.1),
                                               named_parameters=disc.named_parameters(), transport=TRANSPORT)

    def train_step(train_generator=False, train_discriminator=False):
        for p in gen.parameters():
            p.requires_grad_(train_generator)
        for p in disc.parameters():
            p.requires_grad_(train_discriminator)
        gen_opt.zero_grad()
        disc_opt.zero_grad()
        loss = disc(gen(inp)).sum()
        loss.backward()
        for p in gen.parameters():
            assert train_generator == (p.grad is not None and p.grad.max().is_nonzero()), \
                'Gradient for generator is zero but it should be trained or vice versa.'
        for p in disc.parameters():
            assert train_discriminator == (p.grad is not None and p.grad.max().is_nonzero()), \
                'Gradient for discriminator is zero but it should be trained or vice versa.'
        if train_generator:
            gen_opt.step()
        if train_discriminator:
            disc_opt.step()

    for _ in range(10):
        train_step(train_discriminator=True)
        train_step(train_generator=True)
    common.assert_same_on_all_ranks(hvd, list(gen.parameters()) + list(disc.parameters()),
                                    "generator and discriminator after dynamic requires_grad")
    out["dynamic_requires_grad"] = gen_opt.schedule_state()["step"], disc_opt.schedule_state()["step"]


def synchronize_step_warning(out):
    """Horovod's test_synchronize_step_warning, with Adam (and the broadcast that Horovod's test
    leaves out: hvd_zoadam refuses ranks that start from different parameters)."""
    model = torch.nn.Linear(10, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = zoadam(model)
    x = torch.zeros(1, 10)
    model(x).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        opt.step()
    first = [str(w.message) for w in ws]
    opt.zero_grad()
    model(x).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        with opt.skip_synchronize():
            opt.step()
    out["step_warning"] = {"first": first, "second": [str(w.message) for w in ws]}


def zero_grad_between_backward_and_step(out):
    model = common.mlp()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = zoadam(model)
    res = {}
    for t in range(1, 4):  # from step 2 on the hooks start the exchange inside backward()
        opt.zero_grad()
        common.loss_fn(model, t, hvd.rank()).backward()
        try:
            opt.zero_grad()
            res[t] = "no error"
        except AssertionError as exc:
            res[t] = str(exc)
        opt.step()  # the step goes on as if zero_grad() had not been called
    opt.zero_grad()
    common.loss_fn(model, 4, hvd.rank()).backward()
    opt.synchronize()
    try:
        opt.zero_grad()
        res["after_synchronize"] = "no error"
    except AssertionError as exc:
        res["after_synchronize"] = str(exc)
    with opt.skip_synchronize():
        opt.step()
    opt.zero_grad()  # after step(): fine
    common.assert_same_on_all_ranks(hvd, list(model.parameters()), "parameters after the zero_grad() checks")
    out["zero_grad"] = res


def set_backward_passes(out):
    model = common.mlp()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = zoadam(model)
    opt.set_backward_passes_per_step(2)
    res = {"attr": opt.backward_passes_per_step}
    for t in range(2):
        common.loss_fn(model, t, hvd.rank()).backward()
    try:
        common.loss_fn(model, 2, hvd.rank()).backward()
        res["third_pass"] = "no error"
    except AssertionError as exc:
        res["third_pass"] = str(exc)
    opt.step()
    opt.zero_grad()
    common.loss_fn(model, 3, hvd.rank()).backward()
    opt.set_backward_passes_per_step(2)  # resets the count: two more passes fit
    common.loss_fn(model, 4, hvd.rank()).backward()
    common.loss_fn(model, 5, hvd.rank()).backward()
    opt.step()
    common.assert_same_on_all_ranks(hvd, list(model.parameters()), "parameters after set_backward_passes_per_step")
    res["steps"] = opt.schedule_state()["step"]
    out["set_backward_passes"] = res


def ema_on_one_rank(out):
    """Rank 0 also wraps an EMA copy of the model (same names and shapes) in an hvd_zoadam optimizer
    that it never steps, built before the main one: the main optimizers still pair up."""
    model = common.mlp()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    ema = None
    if hvd.rank() == 0:
        ema = copy.deepcopy(model)
        zoadam(ema)  # never stepped
    knobs = dict(var_freeze_step=6, var_update_scaler=2, local_step_scaler=1000, local_step_clipper=1)
    opt = zoadam(model, **knobs)
    kinds = []
    for t in range(1, 13):
        opt.zero_grad()
        common.loss_fn(model, t, hvd.rank()).backward()
        kinds.append(opt._next_kind()[1].value)
        opt.step()
        if ema is not None:
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters()):
                    e.lerp_(p, 0.1)
    common.assert_same_on_all_ranks(hvd, list(model.parameters()), "parameters after the EMA run")
    out["ema"] = {"kinds": kinds, "params": [p.detach().clone() for p in model.parameters()]}


def batch_step(model, opt, t):
    opt.zero_grad()
    common.loss_fn(model, t, hvd.rank()).backward()
    opt.step()


def adam_checkpoint(out, tmp):
    """Train hvd.DistributedOptimizer(Adam) for ``t0`` steps, save on rank 0, resume under
    hvd_zoadam (rank 0 loads, then broadcasts), go on; compare the first resumed step with
    Horovod's Adam taking the same step."""
    res = {}
    for case, t0, knobs, model_first in (
            ("before_freeze", 3, dict(var_freeze_step=8, var_update_scaler=2, local_step_scaler=1000,
                                      local_step_clipper=1), True),
            ("past_freeze", 10, dict(var_freeze_step=6, var_update_scaler=2, local_step_policy="constant",
                                     local_step_clipper=2), False)):
        model = common.mlp()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        adam = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=common.LR),
                                        named_parameters=model.named_parameters())
        for t in range(1, t0 + 1):
            batch_step(model, adam, t)
        path = os.path.join(tmp, f"adam_{case}.pt")
        if hvd.rank() == 0:
            torch.save({"model": model.state_dict(), "opt": adam.state_dict()}, path)
        hvd.barrier()
        with torch.no_grad():
            at_save = common.loss_fn(model, 1000, hvd.rank()).item()
        resumed = common.mlp(seed=99)  # other initial values: everything must come from the checkpoint
        opt = zoadam(resumed, lr=0.5, **knobs)
        if hvd.rank() == 0:
            ckpt = torch.load(path, weights_only=False)
            if model_first:
                resumed.load_state_dict(ckpt["model"])
                opt.load_state_dict(ckpt["opt"])
            else:  # the optimizer first: the anchor is set at the next step, from the parameters then
                opt.load_state_dict(ckpt["opt"])
                resumed.load_state_dict(ckpt["model"])
        hvd.broadcast_parameters(resumed.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        kinds, losses = [], []
        for t in range(t0 + 1, t0 + 11):
            kinds.append(opt._next_kind()[1].value)
            batch_step(resumed, opt, t)
            if t == t0 + 1:
                batch_step(model, adam, t)  # Horovod's Adam takes the same step
                first = {"zoadam": [p.detach().clone() for p in resumed.parameters()],
                         "adam": [p.detach().clone() for p in model.parameters()]}
            with torch.no_grad():
                losses.append(common.loss_fn(resumed, 1000, hvd.rank()).item())
            if kinds[-1] in ("variance", "compressed", "sync"):
                common.assert_same_on_all_ranks(hvd, list(resumed.parameters()),
                                                f"parameters after resumed {kinds[-1]} step {t} ({case})")
        res[case] = {"kinds": kinds, "first": first, "losses": losses, "at_save": at_save,
                     "lr": opt.param_groups[0]["lr"],
                     "schedule": opt.schedule_state(),
                     "params": [p.detach().clone() for p in resumed.parameters()]}
    out["adam_checkpoint"] = res


def sparse_as_dense(out):
    """An embedding with sparse gradients and sparse_as_dense=True costs what a dense one does."""
    res = {}
    for sparse in (False, True):
        with common._INIT_LOCK:
            torch.manual_seed(3)
            emb = torch.nn.Embedding(20, 4, sparse=sparse)
        opt = zoadam(emb, sparse_as_dense=True, var_freeze_step=100, var_update_scaler=10 ** 6)
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            for t in range(4):
                opt.zero_grad()
                idx = torch.tensor([(t + hvd.rank()) % 20, (3 * t + 1) % 20, 7])
                emb(idx).pow(2).sum().backward()
                opt.step()
        stats = opt.comm_stats()
        res[sparse] = {"variance": stats["variance"], "warnings": [str(w.message) for w in ws],
                       "weight": emb.weight.detach().clone()}
    out["sparse"] = res


def outside_process_set(out, ps0):
    model = torch.nn.Linear(3, 2)
    try:
        opt = zoadam(model, process_set=ps0)
        out["process_set"] = {"built": opt.comm_stats()["world_size"]}
    except ValueError as exc:
        out["process_set"] = {"error": str(exc)}


def main():
    out = {"before_init": before_init()}
    ps0 = hvd.ProcessSet([0])
    hvd.init(process_sets=[ps0])
    out["rank"] = hvd.rank()
    out["errors"] = {}
    scenarios = [(f.__name__, f) for f in (is_an_adam, broadcast_state_no_grad, dynamic_requires_grad,
                                           synchronize_step_warning, zero_grad_between_backward_and_step,
                                           set_backward_passes, ema_on_one_rank)]
    scenarios += [("adam_checkpoint", lambda o: adam_checkpoint(o, sys.argv[1])), ("sparse_as_dense", sparse_as_dense),
                  ("outside_process_set", lambda o: outside_process_set(o, ps0))]
    for name, scenario in scenarios:
        try:
            scenario(out)
        except Exception:  # noqa: BLE001 - recorded for the pytest side, which names it
            out["errors"][name] = traceback.format_exc()
            print(traceback.format_exc(), file=sys.stderr, flush=True)
    torch.save(out, os.path.join(sys.argv[1], f"rank{hvd.rank()}.pt"))
    hvd.barrier()


if __name__ == "__main__":
    main()
