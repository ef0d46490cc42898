"""The Numba CPU kernels against the torch reference and hand-computed bit layouts (algorithm.md §3)."""
from __future__ import annotations

import json
import sys
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ROOT, bucket_cases, run_cmd, server_inputs
from hvd_zoadam import native
from hvd_zoadam.core.layout import padded_numel, segment_offsets
from hvd_zoadam.native import reference


def test_bits_are_msb_first_and_both_zeros_are_plus_one():
    z = torch.tensor([1.0, -1.0, 0.0, -0.0, -2.0, -3.0, -1e-30, 5.0,   # 1 0 1 1 0 0 0 1
                      -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 1e-45])  # 0 ... 0 1
    assert reference.pack_signs(z).tolist() == [0b10110001, 0b00000001]
    assert np.array_equal(reference.pack_signs(z).numpy(), np.packbits(z.numpy() >= 0))
    assert torch.equal(reference.unpack_signs(reference.pack_signs(z)),
                       torch.tensor([1, -1, 1, 1, -1, -1, -1, 1, -1, -1, -1, -1, -1, -1, -1, 1.0]))


def test_worker_side_on_a_hand_example():
    # one segment of 6 real elements, padded to 8 for P = 1
    y = torch.tensor([3.0, -1.0, 0.0, -0.0, 1.0, -1.0, 0.0, 0.0])
    e = torch.zeros(8)
    plan = native.Plan([0, 6], 8, 1, 0)
    scales = native.worker_scales(y, e, plan, torch.zeros(1))
    assert scales.item() == pytest.approx(np.sqrt(12 / 6))
    packed = native.worker_pack(y, e, plan, scales, torch.zeros(1, dtype=torch.uint8))
    assert packed.tolist() == [0b10111011]  # padding packs as +1
    s = scales.item()
    assert torch.allclose(e, torch.tensor([3 - s, -1 + s, -s, -s, 1 - s, -1 + s, 0, 0]))
    assert e[6:].eq(0).all()  # padding error stays 0


cases = bucket_cases


@settings(max_examples=80, deadline=None)
@given(case=cases())
def test_worker_kernels_match_the_reference(case):
    numels, p, y, e, _ = case
    offsets = segment_offsets(numels)
    plan = native.Plan(offsets, y.numel(), p, 0)
    want_scales = reference.worker_scales(y, e, offsets)
    got_scales = native.worker_scales(y, e, plan, torch.zeros(len(numels)))
    torch.testing.assert_close(got_scales, want_scales, rtol=1e-6, atol=0)
    e_ref = e.clone()
    want_packed = reference.worker_pack(y, e_ref, offsets, want_scales)
    got_packed = native.worker_pack(y, e, plan, want_scales, torch.zeros(y.numel() // 8, dtype=torch.uint8))
    assert torch.equal(got_packed, want_packed)
    assert torch.equal(e, e_ref)  # bitwise, given the same scales
    assert torch.isfinite(e).all()
    assert e[sum(numels):].eq(0).all()


def _server_case(case, rank_seed):
    """A server side's inputs from a bucket case: (numels, offsets, chunk, rank, plan, recv,
    worker scales, server_error, its real elements)."""
    numels, p, y, _, gen = case
    offsets = segment_offsets(numels)
    big = y.numel()
    rank = rank_seed % p
    recv, wscales, se, real = server_inputs(gen, numels, big, p, rank)
    return numels, offsets, big // p, rank, native.Plan(offsets, big, p, rank), recv, wscales, se, real


@settings(max_examples=60, deadline=None)
@given(case=cases(), rank_seed=st.integers(0, 7))
def test_server_kernels_match_the_reference(case, rank_seed):
    numels, offsets, chunk, rank, plan, recv, wscales, se, real = _server_case(case, rank_seed)
    se_ref = se.clone()
    want_packed, want_scales = reference.server_reduce(recv, wscales, se_ref, offsets, rank * chunk)
    got_packed, got_scales = native.server_reduce(recv, wscales, se, plan, torch.zeros(chunk // 8, dtype=torch.uint8),
                                                  torch.zeros(len(numels)))
    torch.testing.assert_close(got_scales, want_scales, rtol=1e-6, atol=0)
    assert torch.equal(got_packed, want_packed)
    if torch.equal(got_scales, want_scales):
        assert torch.equal(se, se_ref)
    else:  # the float64 sums differ in order only
        torch.testing.assert_close(se, se_ref, rtol=1e-5, atol=1e-6)
    assert se[real:].eq(0).all()


@settings(max_examples=40, deadline=None)
@given(case=cases(), rank_seed=st.integers(0, 7))
def test_server_reduce_into_a_second_buffer_equals_in_place_and_leaves_server_error_alone(case, rank_seed):
    """``error_out``: the new server error goes there, bitwise the in-place result (padding
    included, whatever error_out held), and ``server_error`` is only read."""
    numels, _, chunk, _, plan, recv, wscales, se, _ = _server_case(case, rank_seed)
    in_place, before = se.clone(), se.clone()
    want = native.server_reduce(recv, wscales, in_place, plan, torch.zeros(chunk // 8, dtype=torch.uint8),
                                torch.zeros(len(numels)))
    out = torch.full_like(se, float("nan"))
    got = native.server_reduce(recv, wscales, se, plan, torch.zeros(chunk // 8, dtype=torch.uint8),
                               torch.zeros(len(numels)), error_out=out)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(out, in_place) and torch.equal(se, before)


@settings(max_examples=40, deadline=None)
@given(case=cases())
def test_decompress_matches_the_reference(case):
    numels, p, y, _, gen = case
    offsets = segment_offsets(numels)
    packed = torch.randint(0, 256, (y.numel() // 8,), generator=gen, dtype=torch.uint8)
    sscales = torch.rand(p, len(numels), generator=gen)
    n = sum(numels)
    want = reference.decompress(packed, sscales, offsets, n)
    got = native.decompress(packed, sscales, native.Plan(offsets, y.numel(), p, 0), torch.empty(n))
    assert torch.equal(got, want)


@settings(max_examples=40, deadline=None)
@given(case=cases())
def test_worker_and_server_identities(case):
    """s_w·σ + new e_w = y + old e_w, and s_s·σ_s + new e_s = c, per element (to float32 rounding)."""
    numels, p, y, e, gen = case
    offsets = segment_offsets(numels)
    plan = native.Plan(offsets, y.numel(), p, 0)
    z = (y + e).double()
    scales = native.worker_scales(y, e, plan, torch.zeros(len(numels)))
    packed = native.worker_pack(y, e, plan, scales, torch.zeros(y.numel() // 8, dtype=torch.uint8))
    recon = reference._expand(scales, offsets, 0, y.numel()).double() * reference.unpack_signs(packed).double()
    lhs = recon + e.double()
    # e_new = fl(z - s·σ): one float32 rounding, relative to the larger of |z| and s
    assert ((lhs - z).abs() <= 2 ** -24 * torch.maximum(z.abs(), recon.abs()) + 1e-45).all()
    assert (torch.sign(recon) * torch.where(z >= 0, 1.0, -1.0).double()).ge(0).all()


def test_kernels_do_not_depend_on_the_thread_count():
    import numba
    gen = torch.Generator().manual_seed(5)
    n = 300_000
    y = torch.randn(padded_numel(n, 2), generator=gen)
    y[n:] = 0
    outs = []
    for threads in (1, numba.config.NUMBA_NUM_THREADS):
        numba.set_num_threads(threads)
        e = torch.zeros_like(y)
        plan = native.Plan([0, 100_000, n], y.numel(), 2, 0)
        s = native.worker_scales(y, e, plan, torch.zeros(2))
        pk = native.worker_pack(y, e, plan, s, torch.zeros(y.numel() // 8, dtype=torch.uint8))
        outs.append((s, pk, e))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


# -- input dtypes, sizes past one block / task, unpadded inputs, fused consumers ------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_decode_exactly_for_every_bit_pattern(dtype):
    """All 65 536 fp16 / bf16 values: the kernels see exactly ``y.float()``."""
    y = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    n = y.numel()
    finite = torch.isfinite(y.float())
    y = torch.where(finite, y, torch.zeros((), dtype=dtype))  # NaN/Inf would (rightly) poison the scales
    offsets = list(range(0, n + 1, 64))
    plan = native.Plan(offsets, n, 1, 0)
    e = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 1e-3
    e_ref = e.clone()
    want_scales = reference.worker_scales(y.float(), e_ref, offsets)
    got_scales = native.worker_scales(y, e, plan, torch.zeros(len(offsets) - 1))
    torch.testing.assert_close(got_scales, want_scales, rtol=1e-6, atol=0)
    want_packed = reference.worker_pack(y.float(), e_ref, offsets, want_scales)
    got_packed = native.worker_pack(y, e, plan, want_scales, torch.zeros(n // 8, dtype=torch.uint8))
    assert torch.equal(got_packed, want_packed) and torch.equal(e, e_ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_specials_give_non_finite_scales(dtype):
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = torch.zeros(16, dtype=dtype)
        y[3] = bad
        s = native.worker_scales(y, torch.zeros(16), native.Plan([0, 8, 16], 16, 1, 0), torch.zeros(2))
        assert not torch.isfinite(s[0]) and s[1] == 0


@settings(max_examples=15, deadline=None)
@given(numels=st.lists(st.integers(1, 40_000), min_size=1, max_size=6), p=st.integers(1, 8),
       seed=st.integers(0, 2 ** 31 - 1), unpadded=st.booleans())
def test_kernels_past_one_block_and_one_task(numels, p, seed, unpadded):
    """Buckets of up to ~240K elements (many 4096-element blocks, 65 536-element tasks, odd
    segment boundaries): worker, server and decompress bitwise as the reference given the same
    scales; with ``unpadded`` the input holds only the n real elements."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(numels)
    big = padded_numel(n, p)
    offsets = segment_offsets(numels)
    y = torch.zeros(big)
    y[:n] = torch.randn(n, generator=gen)
    e = torch.zeros(big)
    e[:n] = torch.randn(n, generator=gen) * 0.1
    e_ref = e.clone()
    plan = native.Plan(offsets, big, p, seed % p)
    got_scales = native.worker_scales(y[:n] if unpadded else y, e, plan, torch.zeros(len(numels)))
    want_scales = reference.worker_scales(y, e, offsets)
    torch.testing.assert_close(got_scales, want_scales, rtol=1e-6, atol=0)
    got = native.worker_pack(y[:n] if unpadded else y, e, plan, want_scales, torch.zeros(big // 8, dtype=torch.uint8))
    assert torch.equal(got, reference.worker_pack(y, e_ref, offsets, want_scales))
    assert torch.equal(e, e_ref)
    chunk = big // p
    recv, wscales, se, _ = server_inputs(gen, numels, big, p, plan.rank)
    se_ref = se.clone()
    want_pk, want_sc = reference.server_reduce(recv, wscales, se_ref, offsets, plan.chunk_start)
    got_pk, got_sc = native.server_reduce(recv, wscales, se, plan, torch.zeros(chunk // 8, dtype=torch.uint8),
                                          torch.zeros(len(numels)))
    torch.testing.assert_close(got_sc, want_sc, rtol=1e-6, atol=0)
    assert torch.equal(got_pk, want_pk)
    if torch.equal(got_sc, want_sc):
        assert torch.equal(se, se_ref)
    sscales = torch.rand(p, len(numels), generator=gen)
    assert torch.equal(native.decompress(got, sscales, plan, torch.empty(n)),
                       reference.decompress(got, sscales, offsets, n))


@settings(max_examples=40, deadline=None)
@given(numels=st.lists(st.one_of(st.integers(1, 12), st.integers(1, 4096), st.integers(4097, 9000)),
                       min_size=1, max_size=9),
       p=st.integers(1, 8), seed=st.integers(0, 2 ** 31 - 1),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       unpadded=st.booleans(), target=st.sampled_from(["in_place", "second_buffer", "over_y"]),
       special=st.sampled_from([None, float("nan"), float("inf"), -0.0]))
def test_worker_compress_in_one_pass_is_bitwise_the_two_passes(numels, p, seed, dtype, unpadded, target, special):
    """worker_compress (one pass over memory when every segment has at most cpu.BLOCK elements,
    else two) gives the scales, bits and errors of worker_scales + worker_pack bit for bit; with
    a second buffer (or over y) as ``error_out`` the input error is left exactly as it was."""
    from hvd_zoadam.native import cpu
    gen = torch.Generator().manual_seed(seed)
    n = sum(numels)
    big = padded_numel(n, p)
    offsets = segment_offsets(numels)
    plan = native.Plan(offsets, big, p, seed % p)
    assert (plan.groups is None) == (max(numels) > cpu.BLOCK)
    y = torch.zeros(big)
    y[:n] = torch.randn(n, generator=gen) * 10.0 ** float(torch.randint(-4, 4, (1,), generator=gen))
    if special is not None:
        y[int(torch.randint(0, n, (1,), generator=gen))] = special
    y = y.to(dtype)
    e = torch.zeros(big)
    e[:n] = torch.randn(n, generator=gen) * 0.1
    y_in = y[:n] if unpadded else y
    want_e, want_s = e.clone(), torch.zeros(len(numels))
    want_pk = torch.zeros(big // 8, dtype=torch.uint8)
    native.worker_scales(y_in, want_e, plan, want_s)
    native.worker_pack(y_in, want_e, plan, want_s, want_pk)
    got_e, got_s = e.clone(), torch.full((len(numels),), 7.0)
    got_pk = torch.full((big // 8,), 0xA5, dtype=torch.uint8)
    if target == "over_y" and dtype == torch.float32 and not unpadded:
        out = y_in = y_in.clone()
    elif target == "in_place":
        out = got_e
    else:
        out = torch.full((big,), 3.0)
        out[n:] = 0
    native.worker_compress(y_in, got_e, plan, got_s, got_pk, error_out=out)
    same = lambda a, b: torch.equal(a.nan_to_num(1.5, 2.5, -2.5), b.nan_to_num(1.5, 2.5, -2.5))  # noqa: E731
    assert same(got_s, want_s) and torch.equal(got_pk, want_pk) and same(out[:n], want_e[:n])
    assert out[n:].eq(0).all()
    if out is not got_e:
        assert torch.equal(got_e, e)


@settings(max_examples=30, deadline=None)
@given(case=cases(), beta1=st.sampled_from([0.0, 0.9, 0.99]))
def test_decompress_into_momentum_is_bitwise_the_reference(case, beta1):
    numels, p, y, e, gen = case
    offsets = segment_offsets(numels)
    n = sum(numels)
    packed = torch.randint(0, 256, (y.numel() // 8,), generator=gen, dtype=torch.uint8)
    sscales = torch.rand(p, len(numels), generator=gen)
    m = e[:n].clone()
    want = reference.decompress_momentum(packed, sscales, offsets, m.clone(), beta1)
    got = native.decompress_momentum(packed, sscales, native.Plan(offsets, y.numel(), p, 0), m, beta1)
    assert torch.equal(got, want)
    g = reference.decompress(packed, sscales, offsets, n)  # and torch's lerp (an FMA) to rounding
    # the kernels round g - m before scaling it, so they part from lerp by float32's rounding of
    # |g| + |m|, which the scales alone do not bound when m is the larger (beta1 = 0, a small scale)
    atol = 1.2e-7 * (float(sscales.max()) + float(e[:n].abs().max()))
    torch.testing.assert_close(got, e[:n].clone().lerp_(g, 1 - beta1), rtol=1e-6, atol=atol)


@settings(max_examples=30, deadline=None)
@given(case=cases(), preconditioned=st.booleans(), decay=st.sampled_from([1.0, 0.999]),
       masked=st.sampled_from([None, torch.bool, torch.uint8]))
def test_decompress_sync_is_bitwise_the_optimizer_path(case, preconditioned, decay, masked):
    """The fused SYNC rebuild equals ``anchor.mul_(decay); step_math.sync_finish(...)`` bit for bit
    (zeros' signs included), the decay applied inside its one pass; masks of either dtype."""
    from hvd_zoadam.core import step_math
    numels, p, y, e, gen = case
    offsets = segment_offsets(numels)
    n = sum(numels)
    packed = torch.randint(0, 256, (y.numel() // 8,), generator=gen, dtype=torch.uint8)
    sscales = torch.rand(p, len(numels), generator=gen)
    anchor = y[:n].clone()
    denom = torch.rand(n, generator=gen) + 1e-3
    mask = (torch.rand(n, generator=gen) > 0.3).to(masked) if masked else None
    h = step_math.Hyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True,
                    bias_correction=True, step=50, exp_avg_sq_steps=10)
    lr_sum = 0.0173
    a1, x1, m1 = anchor.clone(), torch.empty(n), torch.empty(n)
    w = reference.decompress(packed, sscales, offsets, n)
    if decay != 1.0:
        a1.mul_(decay)
    step_math.sync_finish(x1, a1, m1, denom, w, lr_sum, h, mask, preconditioned)
    a2, x2, m2 = anchor.clone(), torch.empty(n), torch.empty(n)
    native.decompress_sync(packed, sscales, native.Plan(offsets, y.numel(), p, 0), anchor=a2, param=x2,
                           exp_avg=m2, denom=denom, factor=h.bias_correction1 / lr_sum, decay_product=decay,
                           mask=mask, preconditioned=preconditioned)
    bits = lambda t: t.view(torch.int32)  # noqa: E731
    assert torch.equal(bits(x2), bits(x1)) and torch.equal(bits(m2), bits(m1)) and torch.equal(bits(a2), bits(a1))


@settings(max_examples=30, deadline=None)
@given(case=cases(), preconditioned=st.booleans(), decay=st.sampled_from([1.0, 0.999]), masked=st.booleans(),
       group=st.integers(1, 3), strided=st.booleans())
def test_decompress_sync_into_the_parameters_equals_the_flat_x(case, preconditioned, decay, masked, group, strided):
    """``param`` as the bucket's parameters (each starting at a segment boundary): x goes into
    them in place, bitwise the flat x, with the same m and anchor; a parameter that is not
    contiguous takes the flat x and a copy, with the same bits."""
    numels, p, y, _, gen = case
    offsets = segment_offsets(numels)
    n = sum(numels)
    plan = native.Plan(offsets, y.numel(), p, 0)
    packed = torch.randint(0, 256, (y.numel() // 8,), generator=gen, dtype=torch.uint8)
    sscales = torch.rand(p, len(numels), generator=gen)
    denom = torch.rand(n, generator=gen) + 1e-3
    mask = torch.rand(n, generator=gen) > 0.3 if masked else None
    kw = dict(factor=0.37, decay_product=decay, mask=mask, preconditioned=preconditioned)
    a1, x1, m1 = y[:n].clone(), torch.empty(n), torch.empty(n)
    native.decompress_sync(packed, sscales, plan, anchor=a1, param=x1, exp_avg=m1, denom=denom, **kw)
    sizes = [sum(numels[i:i + group]) for i in range(0, len(numels), group)]
    params = [torch.full((k,), float("nan")) for k in sizes]
    if strided:
        params[0] = torch.full((sizes[0], 2), float("nan"))[:, 0]
    a2, m2 = y[:n].clone(), torch.empty(n)
    native.decompress_sync(packed, sscales, plan, anchor=a2, param=params, exp_avg=m2, denom=denom, **kw)
    bits = lambda t: t.view(torch.int32)  # noqa: E731
    assert torch.equal(bits(torch.cat([q.reshape(-1) for q in params])), bits(x1))
    assert torch.equal(bits(m2), bits(m1)) and torch.equal(bits(a2), bits(a1))


def test_decompress_sync_into_parameters_checks_their_layout():
    plan = native.Plan(segment_offsets([8, 8]), 16, 2, 0)
    kw = dict(anchor=torch.zeros(16), exp_avg=torch.zeros(16), denom=torch.ones(16), factor=1.0)
    packed, sscales = torch.zeros(2, dtype=torch.uint8), torch.ones(2, 2)
    with pytest.raises(ValueError, match="hold 8 elements, the plan 16"):
        native.decompress_sync(packed, sscales, plan, param=[torch.zeros(8)], **kw)
    with pytest.raises(ValueError, match="segment boundary"):
        native.decompress_sync(packed, sscales, plan, param=[torch.zeros(4), torch.zeros(12)], **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_cuda_kernels_arithmetic_decode_is_exact_for_every_bit_pattern(dtype):
    """The CUDA kernels decode half inputs arithmetically (cpu._f16_to_f32 / _bf16_to_f32); the
    CPU kernels use LLVM's conversions. Both must be torch's ``.float()`` on all 65 536 patterns."""
    from hvd_zoadam.native import cpu
    decode = cpu._f16_to_f32 if dtype == torch.float16 else cpu._bf16_to_f32
    want = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype).float()
    got = torch.tensor([decode(b) for b in range(1 << 16)], dtype=torch.float32)
    same = (got == want) & (torch.signbit(got) == torch.signbit(want))
    assert bool((same | (torch.isnan(got) & torch.isnan(want))).all())


@pytest.mark.parametrize("n", [0, 1, 7, 65_536, 200_003])
def test_all_finite_finds_each_nan_and_inf(n):
    t = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 1e30
    assert native.all_finite(t)
    for bad in (float("nan"), float("inf"), -float("inf")):
        for where in {0, n // 2, n - 1} if n else ():
            u = t.clone()
            u[where] = bad
            assert not native.all_finite(u), (bad, where)
    assert native.all_finite(torch.tensor([3.4e38, -3.4e38, 1e-45, -0.0]))
    assert not native.all_finite(torch.tensor([1.0], dtype=torch.float16) * float("inf"))  # torch path


@settings(max_examples=20, deadline=None)
@given(n=st.integers(0, 200_000), scale=st.sampled_from([1e-8, 1e-3, 1.0, 1e3]), seed=st.integers(0, 1000),
       c=st.floats(0.01, 50.0))
def test_clamp_by_is_bitwise_the_torch_ops(n, scale, seed, c):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, generator=gen) * scale
    g[::11] = -0.0
    d = torch.rand(n, generator=gen) * 1e-3 + 1e-8
    want = g.clone()
    bound = torch.mul(d, c)
    torch.minimum(want, bound, out=want)
    torch.maximum(want, bound.neg_(), out=want)
    got = native.clamp_by(g.clone(), d, c)
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())


@pytest.mark.parametrize("contiguous", [True, False], ids=["numba-check", "torch-no-sync"])
def test_clamp_finite_clamps_finite_input_and_lets_non_finite_reach_the_scales(contiguous):
    """A non-contiguous view takes the path of CUDA tensors (no host synchronisation); both
    paths give the same result, finite or not."""
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(2 * 1000, generator=gen) * 3
    view = (lambda t: t) if contiguous else (lambda t: t[::2])
    y = view(base.clone())
    assert torch.equal(native.clamp_finite_(y, 1.5), view(base).clamp(-1.5, 1.5))
    for bad in (float("nan"), float("inf"), -float("inf")):
        u = base.clone()
        u[10] = bad
        y = view(u)
        native.clamp_finite_(y, 1.5)
        at = 10 if contiguous else 5
        assert not bool(torch.isfinite(y[at])), bad   # what the scale of its block sees: not finite
        assert not native.all_finite(y.contiguous())
        # the same result on both paths (CPU check and device path): ±Inf become NaN, then the clamp
        want = view(u.masked_fill(torch.isinf(u), float("nan")).clamp(-1.5, 1.5))
        torch.testing.assert_close(y, want, rtol=0, atol=0, equal_nan=True)


def test_the_local_step_kernel_is_in_force_where_torch_fuses_multiply_adds():
    """torch's AVX2, AVX-512 and NEON kernels fuse lerp's multiply-add; where they run, the
    one-pass kernel must match them, or every LOCAL step silently takes the slower torch ops."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512", "SVE256", "NEON"):
        pytest.skip(f"torch runs its {torch.backends.cpu.get_cpu_capability()} kernels here")
    assert native._kernel_matches_torch()
    assert native.local_step_fused(torch.zeros(3), torch.zeros(3))
    assert not native.local_step_fused(torch.zeros(3, dtype=torch.float64))
    assert not native.local_step_fused(torch.zeros(3, 2).t())


def test_scalars_the_kernels_leave_to_torch():
    """A weight of 1 in float32 and an L2 factor that float32 rounds to 0 take the torch ops."""
    assert native.local_step_fuses(weight=0.1, step_size=-1e-3, l2=0.01, bound_factor=2.0)
    assert not native.local_step_fuses(weight=1.0)
    assert not native.local_step_fuses(weight=1 - 1e-9)      # β1 = 1e-9: 1 − β1 is 1 in float32
    assert not native.local_step_fuses(weight=0.1, l2=1e-46)  # torch still adds 0·x
    assert not native.local_step_fuses(weight=0.1, bound_factor=0.0)


def _local_case(n, seed, mask):
    gen = torch.Generator().manual_seed(seed)
    g, x, m, a = (torch.randn(n, generator=gen) * 2 for _ in range(4))
    g[::13], m[::7], x[::11] = -0.0, 0.0, -0.0
    s = torch.rand(n, generator=gen) * 1e-2 + 1e-8
    mk = None if mask is None else (torch.rand(n, generator=gen) > 0.3).to(getattr(torch, mask))
    return g, x, m, s, a, mk


def _same_bits(a, b) -> bool:
    return torch.equal(a, b) and torch.equal(a.signbit(), b.signbit())


LOCAL_CASES = dict(n=st.sampled_from([0, 1, 15, 17, 1000, 65_537, 140_001]), seed=st.integers(0, 1000),
                   weight=st.sampled_from([0.1, 0.5, 0.7, 0.0, 1.0]), step_size=st.sampled_from([-1e-3, -0.37, 0.0]),
                   decay=st.sampled_from([1.0, 0.99995]), l2=st.sampled_from([0.0, 0.05]),
                   bound_factor=st.sampled_from([None, 0.8, 11.2]), mask=st.sampled_from([None, "bool", "uint8"]))


@settings(max_examples=40, deadline=None)
@given(n=st.sampled_from([0, 1, 17, 1000, 65_537, 140_001]), seed=st.integers(0, 1000),
       mask=st.sampled_from([None, "bool", "uint8"]), weight=st.sampled_from([0.1, 0.5, 0.7]),
       step_size=st.sampled_from([-1e-3, -0.37, 0.0]), decay=st.sampled_from([1.0, 0.99995]),
       l2=st.sampled_from([0.0, 0.05]), beta2=st.sampled_from([0.999, 0.95, 0.98 ** 4]),
       bias_correction2=st.sampled_from([1.0, 0.3, 1 - 0.999 ** 3]), eps=st.sampled_from([1e-8, 1e-6]))
def test_variance_step_is_bitwise_the_torch_ops(n, seed, mask, **step):
    """native.variance_step (one Numba pass, in place) against reference.variance_step (torch's
    ops, torch.optim.Adam's order): x, m, v and the denominator bit for bit, signed zeros
    included; g only read. Where the kernels miss torch's rounding here the torch ops run."""
    if not (native._kernel_matches_torch() and native._variance_kernel_matches_torch()):
        pytest.skip(f"torch's {torch.backends.cpu.get_cpu_capability()} kernels round otherwise: the torch ops run")
    g, x, m, s, _, mk = _local_case(n, seed, mask)
    v = s * s
    v[::9] = 0.0
    runs = []
    for variance_step in (reference.variance_step, native.variance_step):
        out, g0 = [x.clone(), m.clone(), v.clone(), torch.empty(n)], g.clone()
        with mock.patch.object(native.cpu, "variance_step", wraps=native.cpu.variance_step) as kernel:
            variance_step(g0, *out, mask=mk, **step)
        assert torch.equal(g0, g)
        runs.append(out)
    assert kernel.call_count == 1  # the kernel ran
    assert all(_same_bits(a, b) for a, b in zip(*runs))


@settings(max_examples=40, deadline=None)
@given(**LOCAL_CASES)
def test_local_step_is_bitwise_the_torch_ops(n, seed, mask, **step):
    """native.local_step (one Numba pass, in place) against reference.local_step (torch's ops):
    x and m bit for bit, signed zeros included; g only read. Where torch's CPU kernels round lerp
    unfused (ATEN_CPU_CAPABILITY=default, a CPU without FMA) native.local_step runs the torch ops
    themselves, so there is no kernel to compare."""
    if not native._kernel_matches_torch():
        pytest.skip(f"torch's {torch.backends.cpu.get_cpu_capability()} kernels round lerp unfused: the torch ops run")
    g, x, m, s, _, mk = _local_case(n, seed, mask)
    runs = []
    for local_step in (reference.local_step, native.local_step):
        xs, ms, g0 = x.clone(), m.clone(), g.clone()
        local_step(g0, xs, ms, s, mask=mk, **step)
        assert torch.equal(g0, g)
        runs.append((xs, ms))
    assert native.local_step_fused(g, x, m, s)  # the kernel ran (but at weight 1, see native._fusable)
    assert all(_same_bits(a, b) for a, b in zip(*runs))


@settings(max_examples=40, deadline=None)
@given(**LOCAL_CASES, decay_product=st.sampled_from([1.0, 0.9993]), bad=st.sampled_from([None, "nan", "inf"]))
def test_local_window_update_is_bitwise_the_torch_ops_and_finds_non_finite_gradients(n, seed, mask, decay_product,
                                                                                     bad, **step):
    """native.local_window_update against the reference: the window's update u = x_a·Π − x' bit
    for bit, x, m and g untouched, and False exactly when g holds a NaN or an Inf."""
    g, x, m, s, a, mk = _local_case(n, seed, mask)
    if bad and n:
        g[n // 2] = float(bad)
    outs, flags = [], []
    for window in (reference.local_window_update, native.local_window_update):
        x0, m0, g0, out = x.clone(), m.clone(), g.clone(), torch.full((n,), 7.0)
        flags.append(window(g0, x0, m0, s, a, out, decay_product=decay_product, mask=mk, **step))
        assert torch.equal(g0.view(torch.int32), g.view(torch.int32))  # NaN included
        assert torch.equal(x0, x) and torch.equal(m0, m)
        outs.append(out)
    assert flags == [not (bad and n)] * 2
    if not (bad and n):
        assert _same_bits(*outs)


@settings(max_examples=20, deadline=None)
@given(**LOCAL_CASES, decay_product=st.sampled_from([1.0, 0.9993]), bad=st.sampled_from([None, "nan", "inf"]))
def test_local_window_update_selects_on_the_device_what_the_host_would_choose(n, seed, mask, decay_product,
                                                                            bad, **step):
    """The CUDA path's local_window_update (``select``: no host read) gives the u of the step
    taken where g is finite and, where it is not, the u of x as it is (the skipped step's,
    step_math.sync_prepare's), bit for bit, and says True either way."""
    from hvd_zoadam.core import step_math
    g, x, m, s, a, mk = _local_case(n, seed, mask)
    if bad and n:
        g[n // 2] = float(bad)
    taken, selected = torch.full((n,), 7.0), torch.full((n,), 7.0)
    finite = reference.local_window_update(g, x.clone(), m.clone(), s, a, taken, decay_product=decay_product,
                                           mask=mk, **step)
    if not finite:
        step_math.sync_prepare(x, a, s, decay_product, taken, True)
    assert reference.local_window_update(g, x.clone(), m.clone(), s, a, selected, decay_product=decay_product,
                                         mask=mk, select=True, **step) is True
    assert _same_bits(taken, selected)


@pytest.mark.parametrize("decay", [1.0, 0.9999876])
def test_sync_prepare_and_rebuild_are_bitwise_the_torch_path(decay):
    """native.sync_prepare / sync_rebuild (one pass each) against step_math.sync_prepare, then
    anchor.mul_(decay) and step_math.sync_finish (five torch passes), bit for bit."""
    from hvd_zoadam.core import step_math
    gen = torch.Generator().manual_seed(3)
    n = 150_001
    x, anchor = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    x.add_(torch.randn(n, generator=gen) * 1e-3)
    denom = torch.rand(n, generator=gen) * 1e-2 + 1e-8
    h = step_math.Hyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True,
                    bias_correction=True, step=40, exp_avg_sq_steps=9)
    w1, w2 = torch.empty(n), torch.full((n,), 7.0)
    step_math.sync_prepare(x, anchor, None, decay, w1, True)
    native.sync_prepare(x, anchor, decay, w2)
    assert torch.equal(w1, w2)
    a1, x1, m1 = anchor.clone(), torch.empty(n), torch.empty(n)
    if decay != 1.0:
        a1.mul_(decay)
    step_math.sync_finish(x1, a1, m1, denom, w1.clone(), 0.0123, h, None, True)
    a2, x2, m2 = anchor.clone(), torch.empty(n), torch.empty(n)
    native.sync_rebuild(w2, a2, x2, m2, denom, h.bias_correction1 / 0.0123, decay)
    assert torch.equal(x1, x2) and torch.equal(m1, m2) and torch.equal(a1, a2)


def test_warm_up_for_a_cuda_device_numba_cannot_see_says_what_to_install():
    """What a CUDA optimizer meets at construction where numba has no CUDA target (this machine)."""
    from numba import cuda
    if cuda.is_available():
        pytest.skip("numba sees a CUDA device here")
    with pytest.raises(RuntimeError, match="need numba's CUDA target.*install numba-cuda"):
        native.warm_up("cuda:0")


_WARM_UP_THEN_TRAIN = r'''
import json
import torch
import hvd_zoadam
from hvd_zoadam import native
from hvd_zoadam.native import cpu
from conftest import run_threads
native.warm_up()
kernels = {n: k for n, k in vars(cpu).items() if hasattr(k, "signatures") and hasattr(k, "py_func")}
before = {n: list(k.signatures) for n, k in kernels.items()}

import threading
LOCK = threading.Lock()  # the thread ranks share torch's global RNG: the same model on each

def body(rank, transport, explicit_mask):
    with LOCK:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(50, 40), torch.nn.Linear(40, 300), torch.nn.LayerNorm(300),
                                    torch.nn.Linear(300, 5))
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.01},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    opt = hvd_zoadam.DistributedOptimizer(torch.optim.AdamW(groups, lr=1e-3), named_parameters=model.named_parameters(),
                                          transport=transport, var_freeze_step=6, local_step_policy="steps",
                                          local_step_scaler=4, local_step_clipper=4, bucket_cap_mb=0.05,
                                          **({"exp_avg_mask": {model[0].weight: torch.ones_like(model[0].weight)},
                                              "auto_exp_avg_mask": False} if explicit_mask else {}))
    gen = torch.Generator().manual_seed(rank)  # not the global RNG: the other rank may be seeding it
    for t in range(40):
        opt.zero_grad()
        model(torch.randint(0, 10, (8,), generator=gen)).square().mean().backward()  # rows 10-49 never used: a mask
        opt.step()
    masked = any(opt._engine.mask_of(b) is not None for b in opt._engine.buckets)
    return {k: opt.comm_stats()[k]["steps"] for k in ("variance", "local", "sync")}, masked

runs = [run_threads(2, lambda r, t: body(r, t, explicit))[0] for explicit in (False, True)]
print(json.dumps({"runs": runs, "warmed": {n: len(before[n]) for n in ("local_step", "local_window_update")},
                  "compiled_later": {n: [str(s) for s in k.signatures if s not in before[n]]
                                     for n, k in kernels.items() if list(k.signatures) != before[n]}}))
'''


def test_warm_up_compiles_every_cpu_kernel_that_training_then_calls():
    """The optimizer's warm_up at construction leaves no kernel to compile later: VARIANCE, LOCAL
    and SYNC steps, AdamW's window decay and a masked bucket (the automatic bool mask, and a
    user's ``exp_avg_mask``, uint8) at P = 2 find every CPU kernel's signature already compiled
    (a fresh process; with a cold cache a first compile inside a step stalls it for seconds,
    on every rank)."""
    proc = run_cmd([sys.executable, "-c", _WARM_UP_THEN_TRAIN], env={"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"})
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for kinds, masked in got["runs"]:
        assert all(n > 0 for n in kinds.values()) and masked, got
    assert all(n > 0 for n in got["warmed"].values()), got  # the local kernels run on this machine
    assert got["compiled_later"] == {}


@settings(max_examples=20, deadline=None)
@given(n=st.integers(0, 200_000), scale=st.sampled_from([1e-8, 1e-3, 1.0, 1e3]), seed=st.integers(0, 1000),
       bound=st.floats(0.01, 50.0))
def test_precondition_clamp_is_bitwise_the_torch_ops_specials_included(n, scale, seed, bound):
    """A COMPRESSED step's exchange input in one pass: y/s clamped, ±Inf and NaN (from y, or
    from s = 0) made NaN, bitwise ``div_`` then :func:`native.clamp_finite_`'s torch ops."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(n, generator=gen) * scale
    y[::11] = -0.0
    s = torch.rand(n, generator=gen) * 1e-3 + 1e-8
    if n > 40:
        y[3], y[17], y[29] = float("nan"), float("inf"), -float("inf")
        s[23] = 0.0
    q = y.div(s)
    want = q.masked_fill_(torch.isinf(q), float("nan")).clamp_(-bound, bound)
    got = native.precondition_clamp_(y.clone(), s, bound)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(got.signbit(), want.signbit())
