"""Bad input by the hundred: property-based tests (hypothesis) over the public surface.

Every drawn case must end in the right result or a named error (``ValueError``, ``TypeError``,
``CheckpointError``, ``NonFiniteError``), never another exception, a crash or a hang:

* the options of ``hvd_zoadam.DistributedOptimizer`` and ``hvd_zoadam.OnebitAdam``, valid and
  not, each drawn from numbers, strings, ``None`` and booleans;
* ``Schedule``: the knobs, and for a schedule that builds, the kinds it gives (VARIANCE at step
  1, only VARIANCE/COMPRESSED up to the freeze, only LOCAL/SYNC after it, a SYNC at least every
  ``local_step_clipper`` steps, the same answer when asked twice);
* ``compressed_allreduce`` on two thread ranks: shapes (0-element and non-contiguous views
  included), dtypes, NaN, Inf, subnormals, huge values, wrong buffers; a finite case equals the
  in-process oracle bit for bit, a non-finite one raises ``NonFiniteError`` on both ranks and
  leaves both buffers as they were;
* checkpoint files with bytes flipped, cut or appended: ``checkpoint.load`` raises
  ``CheckpointError`` or loads a state that trains on.

The case counts are the ``max_examples`` of each test (run with
``--hypothesis-show-statistics`` to see them drawn).
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hvd_zoadam
from conftest import run_threads
from hvd_zoadam import checkpoint
from hvd_zoadam.comm.protocol import NonFiniteError, compressed_allreduce
from hvd_zoadam.comm.thread import ThreadGroup
from hvd_zoadam.core.layout import padded_numel
from hvd_zoadam.core.schedule import Schedule, StepKind
from hvd_zoadam.oracle.simulate import simulate_compressed_allreduce

NAMED = (ValueError, TypeError)
ANY_VALUE = st.one_of(st.none(), st.booleans(), st.integers(-3, 70000), st.floats(allow_nan=True),
                      st.sampled_from(["", "steps", "lr", "auto", "x"]), st.just([1]))


def _transport():
    return ThreadGroup(1).transports()[0]


# -- options ----------------------------------------------------------------------------------

VALID = {  # values that should build; each option is drawn from these twice as often as from ANY_VALUE
    "var_freeze_step": st.integers(1, 5), "var_update_scaler": st.integers(1, 8),
    "local_step_scaler": st.integers(1, 64), "local_step_clipper": st.sampled_from([1, 2, 4, 8]),
    "local_step_policy": st.sampled_from(["steps", "lr"]), "bucket_cap_mb": st.floats(1e-5, 100),
    "scale_block_numel": st.sampled_from([0, 1, 8, 256, 2048]), "backward_passes_per_step": st.integers(1, 2),
    "bias_correction": st.booleans(), "overlap": st.booleans(), "hierarchical": st.sampled_from([False, True, "auto"]),
    "precondition_compression": st.booleans(), "auto_exp_avg_mask": st.booleans(),
}
OPTIONS = st.fixed_dictionaries({}, optional={k: st.one_of(v, v, ANY_VALUE) for k, v in VALID.items()})


def _train_a_few_steps(model, opt, passes: int = 1) -> None:
    """Eight steps (past a freeze at step <= 5: every kind), ``passes`` backward passes each
    (up to 2: a drawn count of thousands would only make the test slow)."""
    if passes > 2:
        return
    for t in range(8):
        opt.zero_grad()
        for _ in range(passes):
            model(torch.ones(4, 3) * (t + 1)).sum().backward()
        opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPTIONS)
def test_any_options_build_an_optimizer_that_steps_or_raise_a_named_error(options):
    model = torch.nn.Linear(3, 2)
    try:
        opt = hvd_zoadam.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                              named_parameters=model.named_parameters(), transport=_transport(),
                                              **options)
    except NAMED as exc:
        assert str(exc)  # a message that names what is wrong
        return
    _train_a_few_steps(model, opt, options.get("backward_passes_per_step", 1))


ONEBIT_OPTIONS = st.fixed_dictionaries({}, optional={
    "freeze_step": st.one_of(st.integers(1, 5), st.integers(1, 5), ANY_VALUE),
    **{k: st.one_of(VALID[k], VALID[k], ANY_VALUE) for k in ("bucket_cap_mb", "scale_block_numel", "overlap",
                                                              "backward_passes_per_step")}})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ONEBIT_OPTIONS)
def test_any_onebit_options_build_an_optimizer_that_steps_or_raise_a_named_error(options):
    model = torch.nn.Linear(3, 2)
    try:
        opt = hvd_zoadam.OnebitAdam(torch.optim.Adam(model.parameters(), lr=1e-2), model.named_parameters(),
                                    transport=_transport(), **options)
    except NAMED as exc:
        assert str(exc)
        return
    _train_a_few_steps(model, opt, options.get("backward_passes_per_step", 1))


# -- the schedule -------------------------------------------------------------------------------

@settings(max_examples=400, deadline=None)
@given(st.integers(-2, 40), st.integers(-1, 9), st.integers(-1, 70), st.integers(-1, 33),
       st.sampled_from(["steps", "lr", "bogus"]))
def test_a_schedule_builds_and_keeps_its_invariants_or_raises_a_named_error(t_f, kappa, alpha, h_max, policy):
    try:
        s = Schedule(var_freeze_step=t_f, var_update_scaler=kappa, local_step_scaler=alpha,
                     local_step_clipper=h_max, local_step_policy=policy)
    except NAMED as exc:
        assert str(exc)
        return
    kinds = [s.kind(t, lr=1e-3, freeze_lr=1e-3) for t in range(1, t_f + 3 * h_max + 8)]
    assert kinds == [s.kind(t, lr=1e-3, freeze_lr=1e-3) for t in range(1, len(kinds) + 1)]  # pure
    assert kinds[0] is StepKind.VARIANCE
    assert all(k in (StepKind.VARIANCE, StepKind.COMPRESSED) for k in kinds[:t_f])
    after = kinds[t_f:]
    assert all(k in (StepKind.LOCAL, StepKind.SYNC) for k in after)
    syncs = [i for i, k in enumerate(after) if k is StepKind.SYNC]
    assert syncs and syncs[0] < h_max and all(b - a <= h_max for a, b in zip(syncs, syncs[1:]))


# -- compressed_allreduce -----------------------------------------------------------------------

SPECIAL = st.sampled_from([0.0, -0.0, 1e-40, -1e-40, 3e38, -3e38, 1e-30, 1.0, math.nan, math.inf, -math.inf])


@st.composite
def exchange_cases(draw):
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=3)))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    xs = []
    for _ in range(2):
        x = torch.randn(shape, generator=gen) * draw(st.sampled_from([1e-3, 1.0, 1e3]))
        for _ in range(draw(st.integers(0, 2))):
            if x.numel():
                x.view(-1)[draw(st.integers(0, x.numel() - 1))] = draw(SPECIAL)
        xs.append(x.to(dtype) if dtype.is_floating_point else (x.nan_to_num() * 10).to(dtype))
    transposed = draw(st.booleans()) and len(shape) >= 2
    wrong_buffer = draw(st.sampled_from([None, None, None, "long", "float64"]))
    return xs, transposed, wrong_buffer


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(exchange_cases())
def test_compressed_allreduce_gives_the_oracle_or_a_named_error_on_both_ranks(case):
    xs, transposed, wrong_buffer = case
    n = xs[0].numel()
    big = padded_numel(n, 2)

    def body(rank, transport):
        x = xs[rank].transpose(0, -1) if transposed else xs[rank]  # a non-contiguous view
        we = torch.zeros(big + (wrong_buffer == "long"), dtype=torch.float64 if wrong_buffer == "float64"
                         else torch.float32)
        se = torch.zeros(big // 2)
        try:
            out = compressed_allreduce(x, we, se, transport=transport, name="prop")
        except (NonFiniteError, ValueError, TypeError) as exc:
            return type(exc).__name__, we.clone(), se.clone()
        return out, we, se

    got = run_threads(2, body, timeout_s=30)
    finite = all(torch.isfinite(x.float()).all() for x in xs)
    if wrong_buffer is not None or xs[0].dtype not in (torch.float32, torch.float16, torch.bfloat16):
        assert {g[0] for g in got} <= {"ValueError", "TypeError"} and got[0][0] == got[1][0]
        return
    if n == 0:
        assert all(g[0].numel() == 0 for g in got)
        return
    ys = [(x.transpose(0, -1) if transposed else x).reshape(-1).float() for x in xs]
    we, se = [torch.zeros(big) for _ in range(2)], [torch.zeros(big // 2) for _ in range(2)]
    want = simulate_compressed_allreduce(ys, we, se)
    if want is None:  # a non-finite scale: both ranks raise, no buffer changed
        assert [g[0] for g in got] == ["NonFiniteError"] * 2
        assert all(not g[1].any() and not g[2].any() for g in got)
        return
    assert finite  # a NaN or Inf always makes a non-finite scale
    for rank, (out, w, s) in enumerate(got):
        assert out.dtype == xs[rank].dtype and \
            out.shape == (xs[rank].transpose(0, -1) if transposed else xs[rank]).shape
        assert torch.equal(out.reshape(-1), want.to(out.dtype)), rank
        assert torch.equal(w, we[rank]) and torch.equal(s, se[rank]), rank


# -- checkpoint files ---------------------------------------------------------------------------

def _two_layers() -> torch.nn.Module:
    """The same small model on every thread rank (torch's global generator is shared by the threads)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    prefix = str(folder / "ckpt")

    def body(rank, transport):
        model = _two_layers()
        opt = hvd_zoadam.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                              named_parameters=model.named_parameters(), transport=transport,
                                              var_freeze_step=2, var_update_scaler=1, local_step_clipper=2)
        for _ in range(4):
            opt.zero_grad()
            model(torch.ones(2, 4) * (rank + 1)).sum().backward()
            opt.step()
        checkpoint.save(prefix, model, opt, step=4)
    run_threads(2, body)
    return prefix, (folder / "ckpt.pt").read_bytes()


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["flip", "cut", "append"]), st.integers(0, 2 ** 31 - 1), st.integers(1, 64))
def test_a_damaged_checkpoint_is_refused_by_name_or_loads_a_state_that_trains(saved_checkpoint, tmp_path, how,
                                                                             where, count):
    _, data = saved_checkpoint
    data = bytearray(data)
    if how == "flip":
        for k in range(count):
            i = (where + 7919 * k) % len(data)
            data[i] ^= 1 << (k % 8)
    elif how == "cut":
        data = data[:where % len(data)]
    else:
        data += bytes((where + k) % 256 for k in range(count))
    prefix = str(tmp_path / f"damaged{where}")
    with open(prefix + ".pt", "wb") as f:
        f.write(bytes(data))

    def body(rank, transport):
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        opt = hvd_zoadam.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                              named_parameters=model.named_parameters(), transport=transport,
                                              var_freeze_step=2, var_update_scaler=1, local_step_clipper=2)
        try:
            checkpoint.load(prefix, model, opt)
        except checkpoint.CheckpointError as exc:
            return "CheckpointError: " + str(exc)
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        return "loaded"

    got = run_threads(1, body)[0]
    assert got == "loaded" or (got.startswith("CheckpointError") and "damaged" in got), got
