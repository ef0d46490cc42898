"""What the engine derives from exp_avg_sq and keeps between steps (on the CPU the Adam
denominators sqrt(v̂) + eps, with ``auto_exp_avg_mask`` the mask of v == 0) follows every
write of exp_avg_sq: torch's in-place ops, ``load_state_dict``, a change of eps, and a write
through the tensors ``state_dict()`` handed out that torch's version counter does not see, as
Horovod's in-place broadcast (``hvd.broadcast_optimizer_state``) makes."""
from __future__ import annotations

import copy

import torch
from test_masks import KNOBS, TinyLM, common  # tokens 10..19 never occur: v stays 0 on those rows

import hvd_zoadam
from conftest import run_threads
from hvd_zoadam.core import step_math


def make(transport, **kw):
    with common._INIT_LOCK:  # the thread ranks share torch's global RNG: the same model on each
        torch.manual_seed(0)
        model = TinyLM()
    opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                          named_parameters=model.named_parameters(), transport=transport,
                                          **KNOBS, **kw)
    return model, opt


def train(model, opt, steps: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, 10, (32,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(idx), idx % 3).backward()
        opt.step()


def fresh_denoms(opt):
    c = opt._counters
    out = []
    for b in opt._buckets:
        h = opt._engine.hyper(b, c["step"], c["exp_avg_sq_steps"])
        out.append((opt._engine.denom(b, h).clone(), step_math.adam_denom(b.exp_avg_sq, h)))
    return out


def test_the_kept_denominators_follow_every_write_of_exp_avg_sq():
    def body(rank, transport):
        model, opt = make(transport)
        train(model, opt, 10)                       # past the freeze: v no longer changes by itself
        saved = copy.deepcopy(opt.state_dict())
        checks = [fresh_denoms(opt)]
        v = opt.state_dict()["state"][0]["exp_avg_sq"]
        v.data.mul_(4.0)                            # a write the version counter does not see
        checks.append(fresh_denoms(opt))
        opt.state[model.emb.weight]["exp_avg_sq"].mul_(0.5)  # torch's in-place op
        checks.append(fresh_denoms(opt))
        opt.param_groups[0]["eps"] = 1e-3
        checks.append(fresh_denoms(opt))
        opt.load_state_dict(saved)
        checks.append(fresh_denoms(opt))
        return checks
    (checks,) = run_threads(1, body)
    for pairs in checks:
        for kept, fresh in pairs:
            assert torch.equal(kept, fresh)
    assert not torch.equal(checks[0][0][0], checks[1][0][0])  # the writes did change s


def test_a_write_behind_the_version_counter_reaches_the_next_steps():
    """Two copies of one run; at step 10 the same new v (zeros on rows the data uses, so the
    automatic mask changes too) goes into one through torch's ops and into the other through
    a tensor of state_dict() written behind torch's back. The next steps agree to the last bit."""
    def body(rank, transport):
        ends = []
        for behind in (False, True):
            model, opt = make(transport, auto_exp_avg_mask=True)
            train(model, opt, 10)
            v = opt.state_dict()["state"][0]["exp_avg_sq"] if behind else opt.state[model.emb.weight]["exp_avg_sq"]
            target = v.data if behind else v
            target[:3].zero_()
            target[3:].mul_(2.0)
            train(model, opt, 8, seed=2)
            ends.append([p.detach().clone() for p in model.parameters()])
        return ends
    (ends,) = run_threads(1, body)
    assert all(torch.equal(a, b) for a, b in zip(*ends))


def test_after_the_freeze_the_denominators_are_computed_once(monkeypatch):
    calls = []
    real = step_math.adam_denom

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    def body(rank, transport):
        model, opt = make(transport)
        train(model, opt, 6)                        # the freeze is at step 4
        monkeypatch.setattr(step_math, "adam_denom", counted)
        train(model, opt, 12, seed=3)               # LOCAL and SYNC steps only
        return opt.comm_stats()
    stats = run_threads(2, body)[0]
    assert stats["local"]["steps"] > 0 and stats["sync"]["steps"] > 0
    assert calls == []
