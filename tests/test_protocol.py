"""The two-phase exchange over thread-ranks against the in-process simulation (algorithm.md §3): padding and
chunking, empty and tiny inputs, the sign of zero, fp32 residuals for half inputs."""
from __future__ import annotations

import pytest
import torch

import hvd_zoadam
import hvd_zoadam.comm.transport
from conftest import run_threads
from hvd_zoadam import NonFiniteError, compressed_allreduce, padded_numel
from hvd_zoadam.comm.protocol import Exchange
from hvd_zoadam.core.layout import segment_offsets
from hvd_zoadam.native import reference
from hvd_zoadam.oracle.simulate import simulate_compressed_allreduce


def _inputs(n, p, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) * (r + 1) for r in range(p)]


def _car_all(xs, calls=1, dtype=torch.float32):
    p, n = len(xs), xs[0].numel()

    def body(rank, transport):
        we = torch.zeros(padded_numel(n, p))
        se = torch.zeros(padded_numel(n, p) // p)
        outs = [compressed_allreduce(xs[rank].to(dtype), we, se, transport=transport, name=f"t{c}")
                for c in range(calls)]
        return outs, we, se
    return run_threads(p, body)


@pytest.mark.parametrize("n, p", [(19, 3), (22, 4), (72, 3), (5, 4), (8, 2), (16, 2), (2, 3), (1000, 5), (4099, 8)])
def test_exchange_equals_simulation_bitwise_and_is_identical_on_all_ranks(n, p):
    xs = _inputs(n, p)
    got = _car_all(xs, calls=3)
    we = [torch.zeros(padded_numel(n, p)) for _ in range(p)]
    se = [torch.zeros(padded_numel(n, p) // p) for _ in range(p)]
    for call in range(3):
        want = simulate_compressed_allreduce(xs, we, se)
        for r in range(p):
            assert got[r][0][call].shape == (n,)
            assert torch.equal(got[r][0][call], want)
    for r in range(p):
        assert torch.equal(got[r][1], we[r]) and torch.equal(got[r][2], se[r])


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_multi_segment_buckets_equal_simulation(p):
    numels = [5, 1, 300, 17]
    n = sum(numels)
    xs = _inputs(n, p, seed=3)
    for x in xs:
        x[5] *= 1000  # segments of very different magnitude keep their own scales

    def body(rank, transport):
        ex = Exchange(numels, transport, "seg")
        y = torch.zeros(ex.padded_numel)
        y[:n] = xs[rank]
        scales = ex.prepare(y)
        return ex.finish(y, scales, torch.empty(n)), ex.worker_error, ex.server_error
    got = run_threads(p, body)
    we = [torch.zeros(padded_numel(n, p)) for _ in range(p)]
    se = [torch.zeros(padded_numel(n, p) // p) for _ in range(p)]
    want = simulate_compressed_allreduce(xs, we, se, numels)
    for r in range(p):
        assert torch.equal(got[r][0], want) and torch.equal(got[r][1], we[r]) and torch.equal(got[r][2], se[r])
    if p == 1:
        assert torch.equal(want, xs[0])


@pytest.mark.parametrize("p", [2, 3])
def test_exchange_input_becomes_the_worker_error_and_a_skip_keeps_both(p):
    """y filled into ``Exchange.input``: the worker side writes the new error over it and the
    two buffers swap roles only when no rank's scales are non-finite. Four exchanges, the second
    skipped (NaN on the last rank): every result and error buffer equals the simulation that
    skips it, and a skipped exchange keeps the very tensor objects too."""
    numels = [300, 5000, 7, 4096]  # segments of one block, over one block, and tiny
    n = sum(numels)
    xs = [_inputs(n, p, seed=10 + c) for c in range(4)]
    xs[1][p - 1][123] = float("nan")

    def body(rank, transport):
        ex = Exchange(numels, transport, "swap")
        outs, kept = [], []
        for c in range(4):
            before = (ex.worker_error, ex.input, ex.worker_error.clone())
            ex.input[:n].copy_(xs[c][rank])
            scales = ex.prepare(ex.input)
            if scales is None:
                kept.append(ex.worker_error is before[0] and ex.input is before[1]
                            and torch.equal(ex.worker_error, before[2]))
                outs.append(None)
                continue
            outs.append(ex.finish(None, scales, torch.empty(n)))
            kept.append(ex.worker_error is before[1] and ex.input is before[0])
        return outs, kept, ex.worker_error, ex.server_error
    got = run_threads(p, body)
    we = [torch.zeros(padded_numel(n, p)) for _ in range(p)]
    se = [torch.zeros(padded_numel(n, p) // p) for _ in range(p)]
    for c in (0, 2, 3):
        want = simulate_compressed_allreduce(xs[c], we, se, numels)
        for r in range(p):
            assert torch.equal(got[r][0][c], want)
    for r in range(p):
        assert got[r][0][1] is None and got[r][1] == [True] * 4
        assert torch.equal(got[r][2], we[r]) and torch.equal(got[r][3], se[r])


def test_server_identity_holds():
    p, n = 3, 50
    xs = _inputs(n, p, seed=9)
    offsets = segment_offsets([n])
    big = padded_numel(n, p)
    we = [torch.zeros(big) for _ in range(p)]
    ys = [torch.cat([x, torch.zeros(big - n)]) for x in xs]
    scales = torch.stack([reference.worker_scales(y, e, offsets) for y, e in zip(ys, we)])
    packed = [reference.worker_pack(y, e, offsets, s) for y, e, s in zip(ys, we, scales)]
    chunk = big // p
    for r in range(p):
        se = torch.randn(chunk) * 0.01
        se[max(0, n - r * chunk):] = 0
        recv = torch.stack([pk[r * chunk // 8:(r + 1) * chunk // 8] for pk in packed])
        c = sum(reference._expand(scales[q], offsets, r * chunk, (r + 1) * chunk) * reference.unpack_signs(recv[q])
                for q in range(p)) / p + se
        pk, ss = reference.server_reduce(recv, scales, se, offsets, r * chunk)
        recon = reference._expand(ss, offsets, r * chunk, (r + 1) * chunk) * reference.unpack_signs(pk)
        torch.testing.assert_close(recon + se, c, rtol=1e-6, atol=1e-6)


def test_sign_of_zero_and_all_zero_input():
    """±0 share the bit +1 (no third level for zero); an all-zero input gives zero output and zero
    errors, no 0/0."""
    x = torch.tensor([0.0, -0.0, 2.0, -2.0, 0.0, 0.0, 0.0, 0.0, 1e-30, -1e-30])
    got = [(outs[0], we, se) for outs, we, se in _car_all([x, x])]
    for out, we, se in got:
        assert torch.equal(out, got[0][0]) and torch.isfinite(out).all()
        assert out[0] == out[1] > 0  # +0 and -0 decode alike, as +scale
        s = reference.worker_scales(torch.cat([x, torch.zeros(6)]), torch.zeros(16), [0, 10])
        # the worker identity s·σ + new e_w == y + old e_w: exact where float32 can hold it (0, ±2),
        # one float32 rounding of the scale otherwise (1e-30 - 0.894 rounds to -0.894)
        sigma = torch.where(x >= 0, 1.0, -1.0)
        recon = s * sigma + we[:10]
        assert torch.equal(recon[:8], x[:8])
        assert ((recon - x).abs() <= 2 ** -24 * s).all()
        assert out.numel() == 10
    zeros = _car_all([torch.zeros(9), torch.zeros(9)])
    for outs, we, se in zeros:
        assert torch.equal(outs[0], torch.zeros(9)) and we.eq(0).all() and se.eq(0).all()


def test_payload_is_one_bit_per_padded_element_plus_scales():
    n, p = 1000, 4
    counts = run_threads(p, lambda r, t: (compressed_allreduce(torch.randn(n), torch.zeros(padded_numel(n, p)),
                                                               torch.zeros(padded_numel(n, p) // p), transport=t),
                                          dict(t.counter.bytes_sent), dict(t.counter.rounds))[1:])
    big = padded_numel(n, p)
    # one segment: each chunk needs S = 1 scale. Round 1, to each of the P - 1 others: its scale,
    # the step, the chunk's signs; round 2, to each of them: flag and two steps, the server scale,
    # the packed chunk (both messages padded to whole 4-byte words)
    chunk_bytes = big // p // 8
    want = (p - 1) * (-(-(4 + 4 + chunk_bytes) // 4) * 4) + (p - 1) * (-(-(12 + 4 + chunk_bytes) // 4) * 4)
    for sent, rounds in counts:
        assert sum(sent.values()) == pytest.approx(want) and sum(rounds.values()) == 2


def test_non_finite_input_on_one_rank_raises_everywhere_and_keeps_buffers():
    n, p = 3, 2

    def body(rank, transport):
        we, se = torch.zeros(padded_numel(n, p)), torch.zeros(padded_numel(n, p) // p)
        compressed_allreduce(torch.tensor([1.0, 0.5, -1.0]), we, se, transport=transport, name="warm")
        before = we.clone(), se.clone()
        x = torch.tensor([1.0, float("nan"), -1.0]) if rank == 1 else torch.tensor([1.0, 2.0, -1.0])
        with pytest.raises(NonFiniteError):
            compressed_allreduce(x, we, se, transport=transport, name="nan")
        return torch.equal(we, before[0]) and torch.equal(se, before[1]) and torch.isfinite(we).all()
    assert run_threads(p, body) == [True, True]


def test_finite_inputs_whose_average_overflows_skip_like_a_nan_and_keep_buffers():
    """Two finite worker scales near float32's largest sum to infinity on the server: every rank
    raises NonFiniteError and both error buffers keep their values (no NaN enters the server
    error), as both oracles say."""
    from hvd_zoadam.oracle.simulate import simulate_compressed_allreduce
    from hvd_zoadam.oracle.stacked import compressed_allreduce_stacked
    p, big = 2, padded_numel(4, 2)
    x = torch.tensor([3e38, -3e38, 3e38, 3e38])

    def body(rank, transport):
        we, se = torch.zeros(big), torch.zeros(big // p)
        compressed_allreduce(torch.tensor([1.0, 0.5, -1.0, 2.0]), we, se, transport=transport, name="warm")
        before = we.clone(), se.clone()
        with pytest.raises(NonFiniteError):
            compressed_allreduce(x, we, se, transport=transport, name="overflow")
        return torch.equal(we, before[0]) and torch.equal(se, before[1])
    assert run_threads(p, body) == [True, True]
    we, se = [torch.zeros(big) for _ in range(p)], [torch.zeros(big // p) for _ in range(p)]
    assert simulate_compressed_allreduce([x, x], we, se) is None
    assert not any(e.any() for e in we + se)
    we, se = torch.zeros(p, big), torch.zeros(p, big // p)
    assert compressed_allreduce_stacked(torch.stack([x, x]), we, se) is None
    assert not we.any() and not se.any()


def test_empty_input_takes_part_in_no_collective():
    def body(rank, transport):
        out = compressed_allreduce(torch.empty(0), torch.zeros(0), torch.zeros(0), transport=transport)
        return out.shape, transport.counter.rounds
    for shape, rounds in run_threads(3, body):
        assert shape == (0,) and sum(rounds.values()) == 0


def test_tiny_fp16_values_survive_error_feedback():
    """Residuals stay in float32, so tiny fp16 inputs (some below the fp16 normal range) average out.

    With error feedback the mean of T outputs is x + (e_0 - e_T)/T, so its error is bounded by
    about 2·scale/T whatever x is: here scale ~ 5e-5 and T = 500 give ~2e-7, which is 5% of
    x only for |x| >= 4e-6 (5% at |x| = 1e-6 is below that bound for any 1-bit
    error-feedback scheme). We assert the bound for every element, 5% for |x| >= 1e-5, and
    that the error halves from T=500 to T=1000 (the residuals did not underflow)."""
    x = (1e-4 * torch.tensor([1, 0.3, -0.01, 0.002] * 4)).half()

    def body(rank, transport):
        we, se = torch.zeros(padded_numel(16, 2)), torch.zeros(padded_numel(16, 2) // 2)
        outs = torch.stack([compressed_allreduce(x, we, se, transport=transport, name="h").float()
                            for _ in range(1000)])
        return outs, we.dtype, we.clone()
    for outs, dtype, we in run_threads(2, body):
        assert dtype == torch.float32 and torch.isfinite(outs).all()
        xf = x.float()
        scale = xf.pow(2).mean().sqrt()
        err500 = (outs[:500].mean(0) - xf).abs()
        err1000 = (outs.mean(0) - xf).abs()
        assert (err500 <= 2 * scale / 500 + 1e-9).all()
        big = xf.abs() >= 1e-5
        assert (err500[big] <= 0.05 * xf[big].abs()).all()
        assert err1000.max() < 0.75 * err500.max()
        assert we[:16].abs().gt(0).all()  # tiny residuals kept, not flushed to zero


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_return_their_dtype_and_match_fp32(dtype):
    """fp16 / bf16 inputs: no 'not implemented for Half' anywhere; math in fp32, output in the input dtype."""
    for n in (1, 37, 1024):
        xs = [x.to(dtype) for x in _inputs(n, 2, seed=n)]
        got = _car_all(xs, dtype=dtype)
        want = _car_all([x.float() for x in xs])
        tol = 2e-3 if dtype is torch.float16 else 1e-2
        for (g, _, _), (w, _, _) in zip(got, want):
            g, w = g[0], w[0]
            assert g.dtype == dtype
            torch.testing.assert_close(g.float(), w.to(dtype).float(), rtol=tol, atol=tol)


def test_buffer_checks_name_the_fix():
    with pytest.raises(ValueError, match=r"worker_error must be contiguous with 24 elements"):
        run_threads(3, lambda r, t: compressed_allreduce(torch.zeros(19), torch.zeros(19), torch.zeros(8), transport=t))
    with pytest.raises(TypeError, match="worker_error must be a float32"):
        run_threads(1, lambda r, t: compressed_allreduce(torch.zeros(3), torch.zeros(8, dtype=torch.float64),
                                                         torch.zeros(8), transport=t))
    assert hvd_zoadam.padded_numel(19, 3) == 24


@pytest.mark.parametrize("which", ["worker_error", "server_error"])
def test_error_buffers_on_another_device_than_the_tensor_are_refused_by_name(which):
    t = hvd_zoadam.comm.thread.ThreadGroup(1).transports()[0]
    bufs = {"worker_error": torch.zeros(16), "server_error": torch.zeros(16)}
    bufs[which] = torch.zeros(16, device="meta")
    with pytest.raises(ValueError, match=f"{which} is on meta but the tensor is on cpu"):
        compressed_allreduce(torch.ones(10), bufs["worker_error"], bufs["server_error"], transport=t)


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_bytes_per_exchange_follow_the_formula_and_the_scales_do_not_grow_with_p(p):
    """Three tensors in blocks of 256 elements: what each rank sends per exchange is exactly
    (P−1)·(words(4S + 4 + C/8) + words(12 + 4S + C/8)), S the most pieces in a chunk; the scales,
    steps and flags stay within 2(P−1)/P·4·nseg + 8·(P−1)·(tensors + 1) + 22·(P−1) bytes."""
    from hvd_zoadam.core.layout import scale_segments
    numels = scale_segments([5000, 37, 3000], 256)
    n = sum(numels)
    big = padded_numel(n, p)
    chunk_bytes = big // p // 8

    def body(rank, transport):
        ex = Exchange(numels, transport, "b")
        y = ex.input
        y[:n] = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        assert ex.prepare(y) is not None
        return ex.max_pieces, sum(transport.counter.bytes_sent.values())  # a fresh transport: this exchange

    words = lambda b: -(-b // 4) * 4  # noqa: E731
    for s, sent in run_threads(p, body):
        assert sent == (p - 1) * (words(4 * s + 4 + chunk_bytes) + words(12 + 4 * s + chunk_bytes))
        signs = 2 * (p - 1) / p * big / 8
        assert sent - signs <= 2 * (p - 1) / p * 4 * len(numels) + 8 * (p - 1) * (3 + 1) + 22 * (p - 1)


def test_set_up_messages_unpickle_plain_data_only():
    """What allgather_object receives is unpickled without running anything: plain data comes
    back equal, a pickle that names a class or function is refused."""
    import pickle

    from hvd_zoadam.comm.transport import loads_plain
    plain = {"items": [("schedule.var_freeze_step", 6), ("dtype", "torch.float32")], "ok": (True, None, 1.5)}
    assert loads_plain(pickle.dumps(plain)) == plain

    class RunsCode:
        def __reduce__(self):
            return (print, ("ran",))
    with pytest.raises(pickle.UnpicklingError, match="plain data only, not builtins.print"):
        loads_plain(pickle.dumps(RunsCode()))
