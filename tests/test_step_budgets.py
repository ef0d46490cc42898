"""What one optimizer step launches, against the budgets it meets (``bench step --count``).

The counted model is ``bench step``'s GPT layout (102 tensors in 24 buckets), scaled down; the
counts do not depend on the tensors' sizes. Budgets per step, B buckets: a VARIANCE step makes
at most two numba launches (the check of the average, then the update: over the budget of one)
and three collectives per bucket, at most one host synchronisation (the 4-byte flag that every
exchange step after the first compares before its exchange: "no gradient here?") and moves at most
AdamW(foreach)'s 80 bytes per parameter; a LOCAL step one numba launch per
bucket (its finiteness check inside), at most 2·B + 10 torch ops, no collective, no host
synchronisation and no allocation, within the same 80 bytes; a COMPRESSED or SYNC step reads
every bucket's skip flags in one host synchronisation (a COMPRESSED step after a VARIANCE step
a second, for the buckets' masks of v = 0, derived again once v changed) besides the step's
flag, makes at most three
collectives per bucket and moves at most 100 (COMPRESSED) or 120 (SYNC) bytes per parameter; a
SYNC step at most four numba launches per bucket, a COMPRESSED step five (its torch ops and
allocations, in the exchange's framing, are over budget: docs/performance.md). The CUDA path
is counted under the simulator at P = 1, on a layout 16 times smaller (the 1-bit kernels of
P > 1, run by Python threads there, take many minutes): each step kind reads its finiteness
flags at once, a LOCAL step, one kernel launch per bucket that decides its skip on the device,
reads none, and VARIANCE and COMPRESSED steps update each bucket in one launch.
"""
import json
import os
import subprocess
import sys

import pytest

from hvd_zoadam.bench import count


@pytest.fixture(scope="module")
def counted():
    return count.count("cpu", 2, kinds=("variance", "local", "compressed", "sync"))


def test_a_variance_step_averages_one_bucket_per_collective_checks_it_and_steps_in_one_pass(counted):
    """A bucket's average is checked in one pass, then its Adam update is one more
    (native.variance_step): two kernel calls a bucket, over the budget of one (every bucket's
    check must come before any bucket's update, for the step's skip is agreed as a whole)."""
    b, v = counted["buckets"], counted["kinds"]["variance"]
    assert b == 24
    assert v["collectives"] <= 3 * b, v
    assert v["numba_launches"] <= 2 * b, v
    assert v["host_syncs"] <= 1, v
    assert v["bytes_per_param"] <= 80, v


def test_a_local_step_talks_to_no_one_stops_no_host_and_allocates_nothing(counted):
    v = counted["kinds"]["local"]
    assert v["collectives"] == 0 and v["host_syncs"] == 0 and v["allocations"] == 0, v
    assert v["bytes_per_param"] <= 80, v


def test_a_local_step_is_one_kernel_call_per_bucket_on_the_flat_storage(counted):
    """The parameters are views of their bucket's buffer: no gather, no scatter, no per-tensor
    views for the kernel's arguments; the finiteness check rides in the same call."""
    b, v = counted["buckets"], counted["kinds"]["local"]
    assert v["numba_launches"] <= b, v
    assert v["torch_ops"] <= 2 * b + 10, v


@pytest.mark.parametrize("kind", ["compressed", "sync"])
def test_a_compressed_or_sync_step_reads_every_buckets_flags_at_once(counted, kind):
    """The servers decide their flags on the device (steps announced alike, scales finite): the
    host reads every bucket's gathered flags at once, not each bucket's steps and scales apart.
    One more read is the step's 4-byte "no gradient here?" flag, compared before the exchange
    (every exchange step after the first; agreement.py)."""
    b, v = counted["buckets"], counted["kinds"][kind]
    assert v["host_syncs"] <= (3 if kind == "compressed" else 2), v   # counted after a VARIANCE step
    assert v["collectives"] <= 3 * b, v


@pytest.mark.parametrize("kind, launches, bytes_per_param", [("compressed", 5, 100), ("sync", 4, 120)])
def test_a_compressed_or_sync_step_calls_the_kernels_a_few_times_per_bucket(counted, kind, launches,
                                                                           bytes_per_param):
    """SYNC: the window's update on copies (one pass), the worker side, the server side and the
    rebuild; COMPRESSED: the preconditioned input, the worker side, the server side, the
    unpacking and the momentum step."""
    b, v = counted["buckets"], counted["kinds"][kind]
    assert v["numba_launches"] <= launches * b, v
    assert v["bytes_per_param"] <= bytes_per_param, v


@pytest.mark.parametrize("kind", ["compressed", "sync"])
def test_a_compressed_or_sync_step_reads_its_messages_into_buffers_it_keeps(counted, kind):
    """What rounds 1 and 2 bring is copied into the exchange's own buffers and the skip flag
    decided in them: what allocates is the thread transport (a copy of each message sent and
    the gathered result of each round, 4 per bucket), the stack of the heads' one read, the
    step's 4-byte flag and its gathered copy (2), and after a VARIANCE step the masks of v = 0
    derived again (2 per bucket and a stack)."""
    b, v = counted["buckets"], counted["kinds"][kind]
    assert v["allocations"] <= (6 if kind == "compressed" else 4) * b + 4, v


def test_a_variance_step_averages_in_place_in_the_flat_gradient_storage(counted):
    """Every p.grad is a view of its bucket's flat gradient storage, averaged there: no gather of
    the gradients, no write-back per tensor (was 686 ops and 96 allocations), the update one
    kernel call writing the kept denominator (was 410 ops: torch's nine a bucket), and the
    finiteness check of each average a kernel call on a numpy view (was two torch ops a
    bucket). Outside the transport: within 2·B + 10 torch ops (one a bucket: the fresh
    gradients copied into the storage, as after ``zero_grad()``), no allocation. What the thread
    transport does inside its collectives is counted apart (``transport_ops``)."""
    b, v = counted["buckets"], counted["kinds"]["variance"]
    assert v["torch_ops"] <= 2 * b + 10 and v["allocations"] == 0, v
    assert v["transport_ops"] > 0 and v["transport_allocations"] > 0, v


@pytest.mark.parametrize("kind, per_bucket", [("compressed", 48), ("sync", 36)])
def test_the_exchange_frames_its_messages_through_views_made_once(counted, kind, per_bucket):
    """Each round's messages are written and read through views of buffers the exchange keeps,
    made once: a step makes no slice or view of them (was 121 and 95 torch ops a bucket)."""
    b, v = counted["buckets"], counted["kinds"][kind]
    assert v["torch_ops"] <= per_bucket * b, v


@pytest.fixture(scope="module")
def counted_cuda_sim():
    """``count.count("cuda-sim", 1)`` in a process of its own (the simulator is chosen when numba
    is imported)."""
    code = "import json; from hvd_zoadam.bench import count; print(json.dumps(count.count('cuda-sim', 1)))"
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, NUMBA_ENABLE_CUDASIM="1"),
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.timeout(1800)  # the simulated kernels of the counted steps: minutes on a loaded machine
@pytest.mark.parametrize("kind", ["variance", "compressed", "local", "sync"])
def test_the_cuda_path_reads_a_steps_flags_at_once(counted_cuda_sim, kind):
    """On the CUDA path (under the simulator, P = 1) every bucket's finiteness is a flag on the
    device, read with the others in one host synchronisation (LOCAL reads none: see below): the
    gradients' (VARIANCE, COMPRESSED), the window updates' (SYNC: what a skipped local step gives
    is chosen on the device); a COMPRESSED step after a VARIANCE step reads the masks of v = 0
    once more.
    Was one read per bucket or more (24, 25, 24 and 72 over 24 buckets). Within the bytes'
    budgets (SYNC's below)."""
    b, v = counted_cuda_sim["buckets"], counted_cuda_sim["kinds"][kind]
    assert b == 24 and v["collectives"] == 0, v
    assert v["host_syncs"] <= (2 if kind == "compressed" else 1), v
    if kind != "sync":
        assert v["bytes_per_param"] <= (100 if kind == "compressed" else 80), v


@pytest.mark.timeout(1800)
def test_a_local_step_on_the_cuda_path_is_one_launch_per_bucket_that_skips_on_the_device(counted_cuda_sim):
    """A LOCAL step on the CUDA path (under the simulator, P = 1) as on the CPU path: one kernel
    launch per bucket checks the gradients and takes the step where they are finite, the skip
    decided on the device (native.local_step_on_device), on the kept denominators: no host
    synchronisation, no allocation, at most 2·B + 10 torch ops (was no kernel but torch's
    reference ops: 315 torch ops, 169 allocations, one host synchronisation)."""
    b, v = counted_cuda_sim["buckets"], counted_cuda_sim["kinds"]["local"]
    assert v["host_syncs"] == 0 and v["allocations"] == 0 and v["collectives"] == 0, v
    assert v["numba_launches"] <= b and v["torch_ops"] <= 2 * b + 10, v


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("kind, ops_per_bucket", [("variance", 7), ("compressed", 9)])
def test_a_variance_or_compressed_update_on_the_cuda_path_is_one_launch_per_bucket(counted_cuda_sim, kind,
                                                                                   ops_per_bucket):
    """The update of a VARIANCE step (cuda._variance_step, writing the kept denominator) and of a
    COMPRESSED step (cuda._momentum_step) on the CUDA path, under the simulator at P = 1: one
    kernel launch per bucket (was torch's reference ops: 0 launches, 365 and 342 torch ops;
    now 147 and 196, the rest the finiteness flags and the gradients' framing)."""
    b, v = counted_cuda_sim["buckets"], counted_cuda_sim["kinds"][kind]
    assert v["numba_launches"] <= b and v["torch_ops"] <= ops_per_bucket * b, v


@pytest.mark.timeout(1800)
def test_a_sync_step_on_the_cuda_path_updates_and_rebuilds_in_kernels(counted_cuda_sim):
    """A SYNC step on the CUDA path (under the simulator, P = 1): the window update on copies in
    one cooperative launch per bucket (filled twice at P = 1 with several buckets: the
    finiteness of every input first) and the rebuild in one launch per bucket, within SYNC's
    120 bytes per parameter (was torch's ops: 1,371 torch ops, 601 allocations, 162 bytes)."""
    b, v = counted_cuda_sim["buckets"], counted_cuda_sim["kinds"]["sync"]
    assert v["numba_launches"] <= 3 * b and v["bytes_per_param"] <= 120, v
    assert v["allocations"] <= 6 * b and v["torch_ops"] <= 24 * b, v
