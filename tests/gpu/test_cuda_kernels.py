"""The numba.cuda kernels against the CPU kernels and the torch reference.

These run where the CUDA kernels can run: under the CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``, CPU tensors, small sizes: ~0.3 ms per simulated
thread; ``tests/test_cuda_simulator.py`` starts them so in CI) or on a real GPU
(``native/device_check.sh``, CUDA tensors, sizes up to ``HVD_ZOADAM_CUDA_TEST_NUMEL``).
Elsewhere they skip. The kernels use no warp intrinsics, so the simulator runs the code
paths the GPU runs, but as Python: it does not compile them (``native/ptx_check.py`` does,
``tests/test_cuda_compile.py``), and it cannot show speed or real concurrency.

What must hold ("two targets, one semantics"): bits and errors bitwise the
CPU kernels' for the same scales; scales equal up to float64 summation order.
"""
from __future__ import annotations

import contextlib
import os
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from numba import config, cuda

from conftest import bucket_cases, server_inputs
from hvd_zoadam import native
from hvd_zoadam.core.layout import segment_offsets
from hvd_zoadam.native import cpu, reference

SIM = bool(config.ENABLE_CUDASIM)
pytestmark = pytest.mark.skipif(not (SIM or (cuda.is_available() and torch.cuda.is_available())),
                                reason="needs NUMBA_ENABLE_CUDASIM=1 or a CUDA GPU")
DEV = "cpu" if SIM else "cuda"
MAX_NUMEL = int(os.environ.get("HVD_ZOADAM_CUDA_TEST_NUMEL", "3000" if SIM else "3000000"))
EXAMPLES = int(os.environ.get("HVD_ZOADAM_CUDA_TEST_EXAMPLES", "8" if SIM else "40"))

if SIM or DEV == "cuda":
    from hvd_zoadam.native import cuda as kcuda


def dev(t):
    return t.to(DEV)


def cases():
    """Buckets of up to ~MAX_NUMEL elements, float32/float16/bfloat16 inputs; no ±3e38 (Inf in fp16)."""
    return bucket_cases(max_seg_numel=max(1, MAX_NUMEL // 5), dtypes=(torch.float32, torch.float16, torch.bfloat16),
                        specials=(0.0, -0.0, 1e-40, -1e-40, 1e-30, 1.0))


@settings(max_examples=EXAMPLES, deadline=None)
@given(case=cases(), unpadded=st.booleans())
def test_worker_side_matches_the_cpu_kernels(case, unpadded):
    numels, p, y, e, _ = case
    n, big = sum(numels), y.numel()
    offsets = segment_offsets(numels)
    plan = native.Plan(offsets, big, p, 0)
    y_in = y[:n] if unpadded else y
    cpu_scales = native.worker_scales(y_in, e.clone(), plan, torch.zeros(len(numels)))
    want = reference.worker_scales(y.float(), e, offsets)
    ge = dev(e.clone())
    got_scales = kcuda.worker_scales(dev(y_in), ge, plan, dev(torch.zeros(len(numels))))
    torch.testing.assert_close(got_scales.cpu(), want, rtol=1e-6, atol=0)
    torch.testing.assert_close(got_scales.cpu(), cpu_scales, rtol=1e-6, atol=0)
    # bits and errors: bitwise the CPU kernel's, given the same scales
    ce = e.clone()
    cpu_packed = native.worker_pack(y_in, ce, plan, cpu_scales, torch.zeros(big // 8, dtype=torch.uint8))
    gpk = dev(torch.zeros(big // 8, dtype=torch.uint8))
    kcuda.pack_update(dev(y_in), ge, 0, plan, dev(cpu_scales), gpk)
    assert torch.equal(gpk.cpu(), cpu_packed)
    assert torch.equal(ge.cpu(), ce)
    assert torch.equal(cpu_packed, reference.worker_pack(y.float(), e.clone(), offsets, cpu_scales))
    # the new error into a second buffer (the exchange's staging): the same values, input error kept
    ge2, gout = dev(e.clone()), dev(torch.zeros(big))
    kcuda.pack_update(dev(y_in), ge2, 0, plan, dev(cpu_scales), gpk, e_out=gout)
    assert torch.equal(gout.cpu()[:n], ce[:n]) and torch.equal(ge2.cpu(), e)


def many_small_segments():
    """Up to 30 segments of 1-40 elements: many groups, and many of their edges inside bytes."""
    return bucket_cases(max_seg_numel=40, max_segs=30, dtypes=(torch.float32, torch.float16, torch.bfloat16),
                        specials=(0.0, -0.0, 1e-40, 1.0))


@settings(max_examples=EXAMPLES, deadline=None)
@given(case=st.one_of(cases(), many_small_segments()), unpadded=st.booleans(),
       block=st.sampled_from([1, 8, 13, 64, 4096]), separate_out=st.booleans())
def test_one_pass_worker_kernel_is_bitwise_the_two_passes(case, unpadded, block, separate_out):
    """cuda.compress_fused (one block per group of segments, shared bytes merged by a second
    kernel) against the two CUDA passes: scales, bits and errors bit for bit. Groups of at most
    ``block`` elements (at least the largest segment) put group edges inside bytes, several
    tiny groups into one byte, and the padding's byte after an odd edge."""
    numels, p, y, e, _ = case
    n, big = sum(numels), y.numel()
    offsets = segment_offsets(numels)
    plan = native.Plan(offsets, big, p, 0)
    plan.groups = cpu.make_groups(plan.offsets, min(cpu.BLOCK, max([block, *numels])))  # None past BLOCK
    kcuda.forget_plan_arrays(plan)
    assume(plan.groups is not None and len(plan.groups))
    y_in = dev(y[:n] if unpadded else y)
    ge, two_scales, two_packed = (dev(e.clone()), dev(torch.zeros(len(numels))),
                                  dev(torch.zeros(big // 8, dtype=torch.uint8)))
    kcuda.worker_scales(y_in, ge, plan, two_scales)
    kcuda.pack_update(y_in, ge, 0, plan, two_scales, two_packed)
    fe = dev(e.clone())
    out = dev(torch.full((big,), 7.0)) if separate_out else None
    scales, packed = dev(torch.full((len(numels),), -1.0)), dev(torch.full((big // 8,), 0xA5, dtype=torch.uint8))
    kcuda.compress_fused(y_in, fe, plan, scales, packed, e_out=out)
    assert torch.equal(scales.cpu(), two_scales.cpu())
    assert torch.equal(packed.cpu(), two_packed.cpu())
    if separate_out:  # the new error in the second buffer, its padding untouched, the input error kept
        assert torch.equal(out.cpu()[:n], ge.cpu()[:n]) and bool((out.cpu()[n:] == 7.0).all())
        assert torch.equal(fe.cpu(), e)
    else:
        assert torch.equal(fe.cpu(), ge.cpu())


def test_one_pass_kernels_refuse_a_group_past_their_shared_memory():
    """Groups of more than BLOCK elements (the one-pass kernels' shared buffers) are refused before
    any launch: on a GPU they would write past shared memory (an illegal address, or worse)."""
    numels = [3000, 3000]
    plan = native.Plan(segment_offsets(numels), 6000, 1, 0)
    plan.groups = cpu.make_groups(plan.offsets, 6000)
    assert len(plan.groups) == 1
    kcuda.forget_plan_arrays(plan)
    with pytest.raises(ValueError, match=r"plan.groups has a group of 6000 elements.*BLOCK = 4096"):
        kcuda.compress_fused(dev(torch.ones(6000)), dev(torch.zeros(6000)), plan, dev(torch.zeros(2)),
                             dev(torch.zeros(750, dtype=torch.uint8)))
    plan = native.Plan(segment_offsets(numels), 6000, 1, 0)
    tasks = plan.server_tasks
    plan.server_groups = cpu.make_groups(np.concatenate([tasks[:1, 1], tasks[:, 2]]), 6000)
    kcuda.forget_plan_arrays(plan)
    with pytest.raises(ValueError, match=r"plan.server_groups has a group of 6000 elements"):
        kcuda.server_reduce(dev(torch.zeros(1, 750, dtype=torch.uint8)), dev(torch.ones(1, 2)), dev(torch.zeros(6000)),
                            plan, dev(torch.zeros(750, dtype=torch.uint8)), dev(torch.zeros(2)))


def server_case(case, rank_seed):
    """(numels, chunk, plan, recv, worker scales, server_error, real count) for a drawn bucket and rank."""
    numels, p, y, _, gen = case
    big = y.numel()
    rank = rank_seed % p
    plan = native.Plan(segment_offsets(numels), big, p, rank)
    return (numels, big // p, plan, *server_inputs(gen, numels, big, p, rank))


@settings(max_examples=EXAMPLES, deadline=None)
@given(case=cases(), rank_seed=st.integers(0, 7))
def test_server_side_matches_the_cpu_kernels(case, rank_seed):
    numels, chunk, plan, recv, wscales, se, real = server_case(case, rank_seed)
    cse, gse = se.clone(), dev(se.clone())
    cpk, csc = native.server_reduce(recv, wscales, cse, plan, torch.zeros(chunk // 8, dtype=torch.uint8),
                                    torch.zeros(len(numels)))
    gpk, gsc = kcuda.server_reduce(dev(recv), dev(wscales), gse, plan, dev(torch.zeros(chunk // 8, dtype=torch.uint8)),
                                   dev(torch.zeros(len(numels))))
    torch.testing.assert_close(gsc.cpu(), csc, rtol=1e-6, atol=0)
    assert torch.equal(gpk.cpu(), cpk)
    if torch.equal(gsc.cpu(), csc):  # same scales: bitwise the same errors
        assert torch.equal(gse.cpu(), cse)
    else:
        torch.testing.assert_close(gse.cpu(), cse, rtol=1e-5, atol=1e-6)
    assert gse.cpu()[real:].eq(0).all()


@settings(max_examples=EXAMPLES, deadline=None)
@given(case=st.one_of(cases(), many_small_segments()), rank_seed=st.integers(0, 7),
       block=st.sampled_from([1, 8, 13, 64, 4096]))
def test_one_pass_server_kernel_is_bitwise_the_two_passes(case, rank_seed, block):
    """cuda.server_reduce in one pass (a thread block per group of the chunk's tasks) against its
    three-kernel form: scales (0 for segments outside the chunk), bits and the new server error
    bit for bit, with group edges inside bytes and the chunk's padding after an odd edge."""
    numels, chunk, plan, recv, wscales, se, real = server_case(case, rank_seed)
    tasks = plan.server_tasks
    assume(len(tasks))
    sizes = (tasks[:, 2] - tasks[:, 1]).tolist()
    plan.server_groups = cpu.make_groups(np.concatenate([tasks[:1, 1], tasks[:, 2]]),
                                         min(cpu.BLOCK, max([block, *sizes])))
    kcuda.forget_plan_arrays(plan)
    assume(plan.server_groups is not None)
    two_se, one_se = dev(se.clone()), dev(se.clone())
    two_pk, two_sc = kcuda.server_reduce_two_pass(dev(recv), dev(wscales), two_se, plan,
                                                  dev(torch.zeros(chunk // 8, dtype=torch.uint8)),
                                                  dev(torch.zeros(len(numels))))
    one_pk, one_sc = kcuda.server_reduce(dev(recv), dev(wscales), one_se, plan,
                                         dev(torch.full((chunk // 8,), 0xA5, dtype=torch.uint8)),
                                         dev(torch.full((len(numels),), -1.0)))
    assert torch.equal(one_sc.cpu(), two_sc.cpu())
    assert torch.equal(one_pk.cpu(), two_pk.cpu())
    assert torch.equal(one_se.cpu(), two_se.cpu())


@settings(max_examples=EXAMPLES, deadline=None)
@given(case=cases(), beta1=st.sampled_from([0.0, 0.9]), preconditioned=st.booleans(), masked=st.booleans(),
       decay_product=st.sampled_from([1.0, 0.999]))
def test_unpacking_kernels_match_the_cpu_kernels(case, beta1, preconditioned, masked, decay_product):
    numels, p, y, e, gen = case
    n, big = sum(numels), y.numel()
    offsets = segment_offsets(numels)
    plan = native.Plan(offsets, big, p, 0)
    packed = torch.randint(0, 256, (big // 8,), generator=gen, dtype=torch.uint8)
    sscales = torch.rand(p, len(numels), generator=gen)
    out = dev(torch.empty(n))
    kcuda.decompress(dev(packed), dev(sscales), plan, out)
    assert torch.equal(out.cpu(), reference.decompress(packed, sscales, offsets, n))
    m = e[:n].clone()
    gm = dev(m.clone())
    kcuda.decompress_momentum(dev(packed), dev(sscales), plan, gm, beta1)
    assert torch.equal(gm.cpu(), native.decompress_momentum(packed, sscales, plan, m, beta1))
    anchor = y[:n].float()
    denom = torch.rand(n, generator=gen) + 1e-3
    mask = torch.rand(n, generator=gen) > 0.3 if masked else None
    kw = dict(factor=0.37, decay_product=decay_product, preconditioned=preconditioned)
    a1, x1, m1 = anchor.clone(), torch.empty(n), torch.empty(n)
    native.decompress_sync(packed, sscales, plan, anchor=a1, param=x1, exp_avg=m1, denom=denom, mask=mask, **kw)
    a2, x2, m2 = dev(anchor.clone()), dev(torch.empty(n)), dev(torch.empty(n))
    kcuda.decompress_sync(dev(packed), dev(sscales), plan, a2, x2, m2, dev(denom), kw["factor"], kw["decay_product"],
                          None if mask is None else dev(mask), preconditioned)
    assert torch.equal(x2.cpu(), x1) and torch.equal(m2.cpu(), m1) and torch.equal(a2.cpu(), a1)


def test_bits_are_msb_first_on_a_hand_example():
    y = torch.tensor([1.0, -1.0, 0.0, -0.0, -2.0, -3.0, -1e-30, 5.0,   # 1 0 1 1 0 0 0 1
                      -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 1e-45])  # 0 ... 0 1
    plan = native.Plan([0, 16], 16, 1, 0)
    e = dev(torch.zeros(16))
    pk = dev(torch.zeros(2, dtype=torch.uint8))
    kcuda.pack_update(dev(y), e, 0, plan, dev(torch.ones(1)), pk)
    assert pk.cpu().tolist() == [0b10110001, 0b00000001]


def test_dispatch_follows_the_device():
    """native.* send CUDA tensors to these kernels (on a GPU) and refuse mixed devices."""
    y = torch.randn(64)
    plan = native.Plan([0, 64], 64, 1, 0)
    if DEV == "cuda":
        s = native.worker_scales(y.cuda(), torch.zeros(64, device="cuda"), plan, torch.zeros(1, device="cuda"))
        assert s.is_cuda
        torch.testing.assert_close(s.cpu(), reference.worker_scales(y, torch.zeros(64), [0, 64]))
        with pytest.raises(ValueError, match="all on one CUDA device"):
            native.worker_scales(y, torch.zeros(64, device="cuda"), plan, torch.zeros(1))
    else:
        s = native.worker_scales(y, torch.zeros(64), plan, torch.zeros(1))
        torch.testing.assert_close(s, reference.worker_scales(y, torch.zeros(64), [0, 64]))


@st.composite
def local_cases(draw):
    """(g, x, m, s, mask, step) of one bucket for a LOCAL step: up to MAX_NUMEL elements (an
    empty bucket too), gradients with NaN/±Inf at a few places or none, a bool or uint8 mask
    or none, and the scalars of both lerp formulas, with and without the clamp, AdamW's decay
    and Adam's L2 term."""
    n = draw(st.integers(0, MAX_NUMEL))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    g, x, m = (torch.randn(n, generator=gen) * draw(st.sampled_from([1e-3, 1.0, 1e3])) for _ in range(3))
    s = torch.rand(n, generator=gen) * 1e-2 + draw(st.sampled_from([1e-8, 1e-3]))
    for idx, val in draw(st.lists(st.tuples(st.integers(0, max(n - 1, 0)), st.sampled_from(
            [float("nan"), float("inf"), -float("inf"), 0.0, -0.0])), max_size=3 if n else 0)):
        g[idx] = val
    mask = draw(st.sampled_from([None, torch.bool, torch.uint8]))
    if mask is not None:
        mask = (torch.rand(n, generator=gen) > 0.3).to(mask)
    step = dict(weight=draw(st.sampled_from([0.1, 0.5, 0.7])), step_size=draw(st.sampled_from([-0.3, -1e-3])),
                decay=draw(st.sampled_from([1.0, 0.999])), l2=draw(st.sampled_from([0.0, 0.01])),
                bound_factor=draw(st.sampled_from([None, 1.5])))
    return g, x, m, s, mask, step


@settings(max_examples=EXAMPLES, deadline=None)
@given(case=local_cases(), row=st.integers(0, 2))
def test_the_local_step_kernel_is_bitwise_the_cpu_kernel_and_skips_on_the_device(case, row):
    """native.local_step_on_device (one cooperative launch: the finiteness check, a grid-wide
    barrier, the step) against the torch reference on CPU copies, which the CPU kernel
    (cpu.local_step_if_finite) gives bit for bit: x and m bitwise, or untouched where a
    gradient is not finite; the count of non-finite gradients in its row of the flags, column
    0 left at 0 for the next launch, the other rows untouched. Where torch's CPU kernels round
    lerp unfused (ATEN_CPU_CAPABILITY=default) the launch declines and the torch ops run."""
    if not native._kernel_matches_torch():
        pytest.skip(f"torch's {torch.backends.cpu.get_cpu_capability()} kernels round lerp unfused: the torch ops run")
    g, x, m, s, mask, step = case
    finite = bool(torch.isfinite(g).all())
    want_x, want_m = x.clone(), m.clone()
    if finite:
        reference.local_step(g, want_x, want_m, s, mask=mask, **step)
    cx, cm = x.clone(), m.clone()
    assert native.local_step_if_finite(g, cx, cm, s, mask=mask, **step) == finite
    assert torch.equal(cx, want_x) and torch.equal(cm, want_m)  # the CPU kernel, the oracle's bits
    got_x, got_m, flags = dev(x.clone()), dev(m.clone()), dev(torch.full((3, 2), 7, dtype=torch.int32))
    flags[row, 0] = 0
    with cuda_path():
        assert native.local_step_on_device(dev(g), got_x, got_m, dev(s), flags, row,
                                           mask=None if mask is None else dev(mask), **step)
    assert torch.equal(got_x.cpu(), want_x), (got_x.cpu() - want_x).abs().max()
    assert torch.equal(got_m.cpu(), want_m), (got_m.cpu() - want_m).abs().max()
    want_flags = torch.full((3, 2), 7, dtype=torch.int32)
    want_flags[row] = torch.tensor([0, int((~torch.isfinite(g)).sum())])
    assert torch.equal(flags.cpu(), want_flags)


@settings(max_examples=EXAMPLES, deadline=None)
@given(case=local_cases(), row=st.integers(0, 2), dp=st.sampled_from([1.0, 0.999]))
def test_the_window_update_kernel_is_bitwise_the_cpu_kernel_and_skips_on_the_device(case, row, dp):
    """native.local_window_update with flags (one cooperative launch: the check, a grid-wide
    barrier, out = a·dp − x' with x' the local step's x on copies, or x itself where a gradient
    is not finite) against the torch reference's choice on the device (``select``), which the
    CPU kernel gives bit for bit where g is finite: ``out`` bitwise, x and m untouched, the count
    of non-finite gradients in its row of the flags, column 0 left at 0."""
    g, x, m, s, mask, step = case
    gen = torch.Generator().manual_seed(len(g))
    anchor = x + torch.randn(len(g), generator=gen) * 1e-2
    want = torch.empty(len(g))
    reference.local_window_update(g, x.clone(), m.clone(), s, anchor, want, decay_product=dp, select=True, mask=mask,
                                  **step)
    finite = bool(torch.isfinite(g).all())
    cpu_out = torch.empty(len(g))
    assert native.local_window_update(g, x, m, s, anchor, cpu_out, decay_product=dp, mask=mask, **step) == finite
    assert not finite or torch.equal(cpu_out, want)  # the CPU kernel, the oracle's bits
    got, gx, gm = dev(torch.full((len(g),), 5.0)), dev(x.clone()), dev(m.clone())
    flags = dev(torch.full((3, 2), 7, dtype=torch.int32))
    flags[row, 0] = 0
    with cuda_path():
        assert native.local_window_update(dev(g), gx, gm, dev(s), dev(anchor), got, decay_product=dp,
                                          mask=None if mask is None else dev(mask), flags=flags, row=row, **step)
    assert torch.equal(got.cpu(), want), (got.cpu() - want).abs().max()
    assert torch.equal(gx.cpu(), x) and torch.equal(gm.cpu(), m)
    want_flags = torch.full((3, 2), 7, dtype=torch.int32)
    want_flags[row] = torch.tensor([0, int((~torch.isfinite(g)).sum())])
    assert torch.equal(flags.cpu(), want_flags)


@settings(max_examples=EXAMPLES, deadline=None)
@given(n=st.integers(0, MAX_NUMEL), seed=st.integers(0, 2 ** 31 - 1), decay=st.sampled_from([1.0, 0.999, 0.5]),
       factor=st.sampled_from([0.37, 1e3]), special=st.sampled_from([None, float("nan"), float("inf"), -0.0]))
def test_the_rebuild_kernel_is_bitwise_the_reference(n, seed, decay, factor, special):
    """native.sync_rebuild on the CUDA path (one launch of cuda._sync_rebuild) against the torch
    reference (anchor·decay, x = a − w, m = (w·s)·f, anchor = x), which the CPU kernel gives bit
    for bit: param, exp_avg and anchor bitwise, a NaN/Inf/−0 in w carried through alike."""
    gen = torch.Generator().manual_seed(seed)
    w, anchor, x, m = (torch.randn(n, generator=gen) for _ in range(4))
    s = torch.rand(n, generator=gen) * 1e-2 + 1e-8
    if n and special is not None:
        w[n // 2] = special
    want = [anchor.clone(), x.clone(), m.clone()]
    reference.sync_rebuild(w.clone(), *want, s, factor, decay)
    on_cpu = [anchor.clone(), x.clone(), m.clone()]
    native.sync_rebuild(w, *on_cpu, s, factor, decay)
    bits = lambda t: t.cpu().view(torch.int32)  # noqa: E731  (NaN included)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(on_cpu, want))  # the CPU kernel, the oracle's bits
    got = [dev(anchor.clone()), dev(x.clone()), dev(m.clone())]
    with cuda_path(), mock.patch.object(kcuda, "sync_rebuild", wraps=kcuda.sync_rebuild) as kernel:
        native.sync_rebuild(dev(w), *got, dev(s), factor, decay)
    assert kernel.call_count == 1  # the kernel, not torch's ops
    for name, a, b in zip(("anchor", "param", "exp_avg"), got, want):
        assert torch.equal(bits(a), bits(b)), (name, (a.cpu() - b).abs().max())


@settings(max_examples=EXAMPLES, deadline=None)
@given(case=local_cases())
def test_the_compressed_update_kernel_is_bitwise_the_reference(case):
    """native.local_step on the CUDA path (a COMPRESSED step's update: one launch of
    cuda._momentum_step, no check, the step's skip agreed before) against the torch reference,
    which the CPU kernel gives bit for bit: x and m bitwise, signed zeros included."""
    if not native._kernel_matches_torch():
        pytest.skip(f"torch's {torch.backends.cpu.get_cpu_capability()} kernels round lerp unfused: the torch ops run")
    g, x, m, s, mask, step = case
    g = torch.nan_to_num(g, nan=0.5, posinf=1.0, neginf=-1.0)  # a COMPRESSED step's ĝ is finite
    want_x, want_m = x.clone(), m.clone()
    reference.local_step(g, want_x, want_m, s, mask=mask, **step)
    got_x, got_m = dev(x.clone()), dev(m.clone())
    with cuda_path(), mock.patch.object(kcuda, "momentum_step", wraps=kcuda.momentum_step) as kernel:
        native.local_step(dev(g), got_x, got_m, dev(s), mask=None if mask is None else dev(mask), **step)
    assert kernel.call_count == 1  # the kernel, not torch's ops
    bits = lambda t: t.cpu().view(torch.int32)  # noqa: E731
    assert torch.equal(bits(got_x), bits(want_x)), (got_x.cpu() - want_x).abs().max()
    assert torch.equal(bits(got_m), bits(want_m)), (got_m.cpu() - want_m).abs().max()


@st.composite
def variance_cases(draw):
    """(g, x, m, v, mask, step) of one bucket for a VARIANCE step: :func:`local_cases`'s tensors
    and scalars (no clamp: a VARIANCE step has none), v >= 0 with zeros, and β2^I, the bias
    correction 1 − β2^K and eps drawn; NaN/±Inf in g carried through as torch carries them."""
    g, x, m, s, mask, step = draw(local_cases())
    del step["bound_factor"]
    v = s * s * draw(st.sampled_from([1.0, 1e4]))
    v[::9] = 0.0
    step.update(beta2=draw(st.sampled_from([0.999, 0.95, 0.98 ** 4])),
                bias_correction2=draw(st.sampled_from([1.0, 0.3, 1 - 0.999 ** 3])),
                eps=draw(st.sampled_from([1e-8, 1e-6])))
    return g, x, m, v, mask, step


def _same_or_both_nan(a, b) -> bool:
    a, b = a.cpu(), b.cpu()
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


@settings(max_examples=EXAMPLES, deadline=None)
@given(case=variance_cases())
def test_the_variance_kernel_is_bitwise_the_reference(case):
    """native.variance_step on the CUDA path (one launch of cuda._variance_step) against the torch
    reference (x·decay, L2, lerp, mask, v·β + ((1 − β)·g)·g, s = sqrt(v)/c + eps, x + (γ'·m)/s),
    which the CPU kernel gives bit for bit: x, m, v and s bitwise (signed zeros included), NaN
    where torch has NaN."""
    if not native._variance_kernel_matches_torch():
        pytest.skip(f"torch's {torch.backends.cpu.get_cpu_capability()} kernels round otherwise: the torch ops run")
    g, x, m, v, mask, step = case
    want = [x.clone(), m.clone(), v.clone(), torch.empty(len(g))]
    reference.variance_step(g, *want, mask=mask, **step)
    on_cpu = [x.clone(), m.clone(), v.clone(), torch.empty(len(g))]
    native.variance_step(g, *on_cpu, mask=mask, **step)
    assert all(_same_or_both_nan(a, b) for a, b in zip(on_cpu, want))  # the CPU kernel, the oracle's bits
    got = [dev(x.clone()), dev(m.clone()), dev(v.clone()), dev(torch.empty(len(g)))]
    with cuda_path(), mock.patch.object(kcuda, "variance_step", wraps=kcuda.variance_step) as kernel:
        native.variance_step(dev(g), *got, mask=None if mask is None else dev(mask), **step)
    assert kernel.call_count == 1  # the kernel, not torch's ops
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq", "denom"), got, want):
        assert _same_or_both_nan(a, b), (name, (a.cpu() - b).abs().max())


def test_the_local_step_kernel_leaves_to_torch_what_it_does_not_take():
    """native.local_step_on_device launches nothing, returning False, for float16 tensors,
    scalars local_step_fuses leaves to torch's ops (weight 1) and CPU tensors off the CUDA path."""
    n = 16
    flags = dev(torch.zeros(1, 2, dtype=torch.int32))
    t = [dev(torch.ones(n)) for _ in range(4)]
    with cuda_path():
        assert not native.local_step_on_device(*t[:3], t[3].half(), flags, 0, weight=0.1, step_size=-0.1)
        assert not native.local_step_on_device(*t, flags, 0, weight=1.0, step_size=-0.1)
    if SIM:  # off the CUDA path: CPU tensors go to the CPU kernels
        assert not native.local_step_on_device(*t, flags, 0, weight=0.1, step_size=-0.1)
    assert torch.equal(t[1].cpu(), torch.ones(n))


@contextlib.contextmanager
def cuda_path():
    """native.* send CPU tensors to the CUDA kernels under the simulator (on a GPU: nothing to do)."""
    if SIM:
        native.use_cuda_kernels_on_cpu(True)
    try:
        yield
    finally:
        if SIM:
            native.use_cuda_kernels_on_cpu(False)
