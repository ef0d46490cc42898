"""Momentum masks: exp_avg_mask and auto_exp_avg_mask."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import hvd_zoadam
from conftest import run_threads

sys.path.insert(0, str(Path(__file__).parent / "mp"))
import common  # noqa: E402

KNOBS = dict(var_freeze_step=4, var_update_scaler=1, local_step_scaler=3, local_step_clipper=2,
             local_step_policy="steps")


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 4)   # tokens 10..19 never occur
        self.out = torch.nn.Linear(4, 3)

    def forward(self, idx):
        return self.out(self.emb(idx))


def train(rank, transport, mask_kw=lambda model: {}):
    with common._INIT_LOCK:
        torch.manual_seed(0)
        model = TinyLM()
    start = model.emb.weight.detach().clone()
    opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                          named_parameters=model.named_parameters(), transport=transport,
                                          **KNOBS, **mask_kw(model))
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(24):
        idx = torch.randint(0, 10, (32,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(idx), idx % 3)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return start, model.emb.weight.detach().clone(), losses, opt


@pytest.mark.parametrize("how", ["explicit", "by_name", "auto"])
def test_masked_coordinates_never_move_and_the_rest_learns(how):
    mask = torch.ones(20, 4)
    mask[10:] = 0
    mask_kw = {"explicit": lambda m: dict(exp_avg_mask={m.emb.weight: mask}),
               "by_name": lambda m: dict(exp_avg_mask={"emb.weight": mask}),
               "auto": lambda m: dict(auto_exp_avg_mask=True)}[how]
    for start, end, losses, opt in run_threads(2, lambda r, t: train(r, t, mask_kw)):
        assert torch.equal(end[10:], start[10:])             # unused rows stay put, through every phase
        assert not torch.equal(end[:10], start[:10])         # used rows learn
        assert sum(losses[-4:]) < sum(losses[:4])
        assert set(opt.comm_stats()[k]["steps"] > 0 for k in ("variance", "compressed", "local", "sync")) == {True}
        for b in opt._buckets:
            assert torch.isfinite(b.exchange.worker_error).all()


@pytest.mark.parametrize("precondition", [True, False])
def test_without_a_mask_unused_rows_random_walk(precondition):
    """What the masks are for: with the automatic mask off, sign compression moves unused rows."""
    kw = dict(auto_exp_avg_mask=False, precondition_compression=precondition)
    for start, end, _, _ in run_threads(2, lambda r, t: train(r, t, lambda m: kw)):
        assert not torch.equal(end[10:], start[10:])


def test_the_automatic_mask_is_on_by_default():
    for start, end, _, opt in run_threads(2, lambda r, t: train(r, t)):
        assert opt.auto_exp_avg_mask and torch.equal(end[10:], start[10:])


def test_mask_arguments_are_checked():
    model = TinyLM()
    with pytest.raises(ValueError, match="shape"):
        hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters()), named_parameters=model.named_parameters(),
                                        exp_avg_mask={"emb.weight": torch.ones(3)},
                                        transport=hvd_zoadam.comm.thread.ThreadGroup(1).transports()[0])
    with pytest.raises(ValueError, match="not a parameter"):
        hvd_zoadam.DistributedOptimizer(torch.optim.Adam(TinyLM().parameters()),
                                        exp_avg_mask={"nope": torch.ones(3)},
                                        transport=hvd_zoadam.comm.thread.ThreadGroup(1).transports()[0])
