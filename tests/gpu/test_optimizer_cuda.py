"""The optimizer and ``compressed_allreduce`` on the CUDA code path.

On a GPU (``native/device_check.sh``) the parameters are CUDA tensors: every buffer of the
optimizer and the exchange lives on the GPU and the compressor runs the numba.cuda kernels.
Under the CUDA simulator (CI: ``tests/test_cuda_simulator.py``) there is no CUDA tensor, so
:func:`hvd_zoadam.native.use_cuda_kernels_on_cpu` sends the CPU tensors down the CUDA path
instead: the numba.cuda kernels (simulated) and the torch ops that replace the CPU-only
Numba helpers. What the simulator cannot show: buffers placed on a GPU, streams, speed.

Oracle: :func:`hvd_zoadam.oracle.simulate.simulate_zoadam` (P workers in one loop, torch reference
compressor). Under the simulator every op runs on the CPU, so the parameters must match it
bit for bit, as the CPU kernels do in ``tests/test_optimizer.py``. On a GPU the forward and
backward passes and the Adam arithmetic are the GPU's, which may round differently from
the CPU's in the last bits; there the bound is a tolerance.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from numba import config, cuda

import hvd_zoadam
import hvd_zoadam.comm.transport
from conftest import run_threads
from hvd_zoadam import StepKind, native
from hvd_zoadam.oracle.simulate import simulate_compressed_allreduce

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "mp"))
import common  # noqa: E402

SIM = bool(config.ENABLE_CUDASIM)
pytestmark = pytest.mark.skipif(not (SIM or (cuda.is_available() and torch.cuda.is_available())),
                                reason="needs NUMBA_ENABLE_CUDASIM=1 or a CUDA GPU")
DEV = "cpu" if SIM else "cuda"
KNOBS = dict(var_freeze_step=6, var_update_scaler=2, local_step_scaler=3, local_step_clipper=4,
             local_step_policy="steps")


@pytest.fixture(autouse=True)
def cuda_path():
    if SIM:
        native.use_cuda_kernels_on_cpu(True)
    yield
    if SIM:
        native.use_cuda_kernels_on_cpu(False)


def assert_matches(got: torch.Tensor, want: torch.Tensor, what) -> None:
    assert got.device.type == DEV, (what, got.device)
    if SIM:
        assert torch.equal(got.cpu(), want), (what, (got.cpu() - want).abs().max())
    else:
        torch.testing.assert_close(got.cpu(), want, rtol=1e-3, atol=1e-5, msg=str(what))


def train(p, steps, cls, wd, **kw):
    def body(rank, transport):
        model = common.mlp().to(DEV)
        opt = hvd_zoadam.DistributedOptimizer(cls(model.parameters(), lr=common.LR, weight_decay=wd),
                                              named_parameters=model.named_parameters(), transport=transport,
                                              **KNOBS, **kw)
        for t in range(1, steps + 1):
            opt.zero_grad()
            x, y = common.batch(t, rank)
            torch.nn.functional.mse_loss(model(x.to(DEV)), y.to(DEV)).backward()
            opt.step()
        state = {k: v for k, v in opt.state[model[0].weight].items() if isinstance(v, torch.Tensor)}
        return [q.detach().clone() for q in model.parameters()], state, opt
    return run_threads(p, body, timeout_s=600)


ADAM, ADAMW_RAW = (torch.optim.Adam, 0.0, False), (torch.optim.AdamW, 0.05, True)


# The simulator takes ~0.3 s per kernel launch here (a Python thread per GPU thread, one
# kernel at a time), so the P = 3 case runs one configuration only.
@pytest.mark.parametrize("p, config", [(1, ADAM), (1, ADAMW_RAW), (2, ADAM), (2, ADAMW_RAW), (3, ADAM)],
                         ids=["1-adam-default", "1-adamw-paper-raw", "2-adam-default", "2-adamw-paper-raw",
                              "3-adam-default"])
def test_optimizer_on_the_cuda_path_equals_the_simulation(p, config):
    """14 steps through every step kind (V V C V C V S S S S L S L S) on P thread-ranks."""
    cls, wd, paper_raw = config
    steps = 14
    flags = dict(precondition_compression=False, auto_exp_avg_mask=False) if paper_raw else {}
    got = train(p, steps, cls, wd, **flags)
    want, kinds = common.simulate_mlp(p, steps, KNOBS, cls, wd, paper_raw)
    assert set(kinds) == set(StepKind) and kinds[-1] is StepKind.SYNC
    for r in range(1, p):  # after the last step, a SYNC, every rank holds the same bits, on any device
        assert all(torch.equal(a, b) for a, b in zip(got[r][0], got[0][0])), r
    for r in range(p):
        params, state, opt = got[r]
        for i, (a, b) in enumerate(zip(params, want[r])):
            assert_matches(a, b, (r, i))
        for key in ("exp_avg", "exp_avg_sq"):  # the optimizer's state lives with the parameters
            assert state[key].device.type == DEV, key
        for b in opt._buckets:
            ex = b.exchange
            assert {t.device.type for t in (ex.worker_error, ex.server_error, b.anchor)} == {DEV}
        if p > 1:
            assert opt.comm_stats()["compressed"]["rounds"] > 0


@pytest.mark.parametrize("p, dtype", [(2, torch.float32), (3, torch.float16)])
def test_compressed_allreduce_on_the_cuda_path_equals_the_reference(p, dtype):
    """Three calls of ``hvd_zoadam.compressed_allreduce`` carry the error buffers along: the
    results and both error buffers against the torch reference of algorithm.md §3."""
    n = 1000

    def body(rank, transport):
        from hvd_zoadam.core.layout import padded_numel
        big = padded_numel(n, p)
        we, se = torch.zeros(big, device=DEV), torch.zeros(big // p, device=DEV)
        outs = []
        for call in range(3):
            y = common.car_input(n, rank, call, dtype).to(DEV)
            out = hvd_zoadam.compressed_allreduce(y, we, se, transport=transport, name=f"car.{call}")
            assert out.device.type == DEV and out.dtype == dtype
            outs.append(out)
        return outs, we, se

    got = run_threads(p, body, timeout_s=600)
    from hvd_zoadam.core.layout import padded_numel
    big = padded_numel(n, p)
    we = [torch.zeros(big) for _ in range(p)]
    se = [torch.zeros(big // p) for _ in range(p)]
    for call in range(3):
        want = simulate_compressed_allreduce([common.car_input(n, r, call, dtype) for r in range(p)], we, se)
        for r in range(p):
            assert_matches(got[r][0][call], want.to(dtype), ("out", r, call))
    for r in range(p):
        assert_matches(got[r][1], we[r], ("worker_error", r))
        assert_matches(got[r][2], se[r], ("server_error", r))


@pytest.mark.skipif(SIM, reason="needs two devices: a GPU and the CPU")
def test_parameters_on_two_devices_are_refused_naming_both():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2).cuda(), torch.nn.Linear(2, 1))
    with pytest.raises(ValueError, match=r"parameter '1.weight' is on cpu but parameter '0.weight' is on cuda"):
        hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters()),
                                        named_parameters=model.named_parameters(),
                                        transport=hvd_zoadam.comm.thread.ThreadGroup(1).transports()[0])


LOCAL_KNOBS = dict(var_freeze_step=1, local_step_policy="steps", local_step_scaler=1, local_step_clipper=1 << 20)


def local_steps(dtype, cuda_kernels: bool, nan_step: int):
    """Parameters and momenta of a small model in several buckets after a VARIANCE step, two
    SYNC steps and six LOCAL steps (P = 1), the gradients drawn alike; at step ``nan_step`` a
    NaN in the third parameter's gradient. Returns (parameters after each step, exp_avg of
    each parameter, the device's skip counts after each LOCAL step: None where no flag table was
    made)."""
    native.use_cuda_kernels_on_cpu(cuda_kernels)
    gen = torch.Generator().manual_seed(5)
    model = torch.nn.Module()
    for i, n in enumerate((300, 257, 1000, 64, 700)):
        model.register_parameter(f"p{i}", torch.nn.Parameter((torch.randn(n, generator=gen) * 0.1).to(dtype)))

    def body(rank, transport):
        opt = hvd_zoadam.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01),
                                              named_parameters=model.named_parameters(), transport=transport,
                                              bucket_cap_mb=1000 * 4 / 2 ** 20, **LOCAL_KNOBS)
        seen, counts = [], []
        for t in range(1, 10):
            for i, p in enumerate(model.parameters()):
                p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(dtype)
                if t == nan_step and i == 2:
                    p.grad[7] = float("nan")
            opt.step()
            seen.append([p.detach().clone() for p in model.parameters()])
            flags = opt._engine.scratch.get("skip_flags")
            counts.append(None if flags is None else flags[:, 1].tolist())
        assert {opt.schedule.kind(t, lr=1e-2, freeze_lr=1e-2) for t in range(4, 10)} == {StepKind.LOCAL}
        assert len(opt._buckets) > 1
        return seen, [opt.state[p]["exp_avg"].clone() for p in model.parameters()], counts[3:]
    return run_threads(1, body, timeout_s=600)[0]


@pytest.mark.skipif(not SIM, reason="compares the CUDA path with the CPU path on the same CPU tensors")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_local_steps_on_the_cuda_path_are_bitwise_the_cpu_paths(dtype):
    """LOCAL steps on the CUDA path (a launch per bucket that decides the skip on the device,
    native.local_step_on_device) against the CPU path's (the CPU kernel, which checks g in its
    call) bit for bit, float16/bfloat16 parameters through their float32 master weights; at
    the step whose gradient holds a NaN its bucket stands still on both, the others step."""
    nan_step = 6
    got = local_steps(dtype, True, nan_step)
    want = local_steps(dtype, False, nan_step)
    native.use_cuda_kernels_on_cpu(True)
    for step, (a, b) in enumerate(zip(got[0], want[0]), start=1):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), step
    assert all(torch.equal(x, y) for x, y in zip(got[1], want[1]))
    before, after = got[0][nan_step - 2], got[0][nan_step - 1]
    assert torch.equal(before[2], after[2]) and not torch.equal(before[0], after[0])
    # the skip was the device's: one non-finite gradient counted in one bucket's row, at that step only
    third = [0] * len(got[2][0])
    third[next(i for i, c in enumerate(got[2][nan_step - 4]) if c)] = 1
    assert got[2] == [third if t == nan_step else [0] * len(third) for t in range(4, 10)], got[2]
    # the CPU path counts nothing on the device (its kernel checks g in its call); the flag table
    # may exist there, made by a SYNC step's window update, and stays zero
    assert all(c is None or not any(c) for c in want[2]), want[2]
