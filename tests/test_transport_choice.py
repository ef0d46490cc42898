"""When transport="gloo" works, and what it says when it does not (in-process: Horovod's state
faked by monkeypatching; the real jobs are in test_multiprocess.py)."""
from __future__ import annotations

import pytest

hvd = pytest.importorskip("horovod.torch")

from hvd_zoadam.comm.gloo import GlooTransport, gloo_unavailable_reason, interface_address  # noqa: E402


@pytest.fixture
def gloo_controller(monkeypatch):
    """Horovod as under horovodrun --gloo -np 1: initialised, the Gloo controller, interface lo."""
    monkeypatch.setattr(hvd, "is_initialized", lambda: True)
    monkeypatch.setattr(hvd, "gloo_enabled", lambda: True)
    monkeypatch.setenv("HOROVOD_GLOO_IFACE", "lo")
    monkeypatch.delenv("HOROVOD_ELASTIC", raising=False)
    return monkeypatch


def test_the_loopback_interface_has_its_address():
    assert interface_address("lo") == "127.0.0.1"
    assert interface_address("no-such-if0") is None


def test_gloo_works_under_the_gloo_controller(gloo_controller):
    assert gloo_unavailable_reason() is None


@pytest.mark.parametrize("case, words", [
    ("not initialised", ["hvd.init()"]),
    ("mpi controller", ["Gloo controller", "transport='mpi'", "horovodrun --gloo"]),
    ("elastic", ["elastic", "HOROVOD_ELASTIC=1", "transport='horovod'"]),
    ("no interface", ["HOROVOD_GLOO_IFACE is not set", "transport='horovod'"]),
    ("no address", ["HOROVOD_GLOO_IFACE='no-such-if0' has no IPv4 address"]),
])
def test_each_reason_is_named_with_its_fix(gloo_controller, case, words):
    if case == "not initialised":
        gloo_controller.setattr(hvd, "is_initialized", lambda: False)
    elif case == "mpi controller":
        gloo_controller.setattr(hvd, "gloo_enabled", lambda: False)
    elif case == "elastic":
        gloo_controller.setenv("HOROVOD_ELASTIC", "1")
    elif case == "no interface":
        gloo_controller.delenv("HOROVOD_GLOO_IFACE")
    else:
        gloo_controller.setenv("HOROVOD_GLOO_IFACE", "no-such-if0")
    reason = gloo_unavailable_reason()
    assert reason is not None and all(w in reason for w in words), reason
    with pytest.raises(ValueError, match=r"^transport='gloo' cannot work here: ") as info:
        GlooTransport()
    assert reason in str(info.value)


class _TwoRanks:
    """A stand-in for Horovod's process set of a 2-rank job, seen from rank 0."""
    ranks = [0, 1]

    def rank(self):
        return 0

    def size(self):
        return 2

    def included(self):
        return True


def test_a_group_that_cannot_be_made_is_refused_naming_the_interface_and_the_fix(gloo_controller):
    import torch

    import hvd_zoadam.comm.gloo as gloo

    def refused(transport):
        raise RuntimeError("Connection refused")
    gloo_controller.setattr(gloo, "_process_set_group", refused)
    t = GlooTransport(_TwoRanks())
    with pytest.raises(RuntimeError, match=r"transport='gloo' could not make its Gloo group on "
                                           r"HOROVOD_GLOO_IFACE='lo' \(rank 0 of 2\): RuntimeError: Connection "
                                           r"refused; use transport='horovod'"):
        t.start("alltoall", torch.zeros(8), "x")


@pytest.mark.parametrize("device, want", [("cpu", "gloo"), (None, "gloo"), ("cuda", "horovod")])
def test_auto_picks_gloo_for_cpu_tensors_and_horovod_for_gpu_ones(gloo_controller, device, want):
    """Under the Gloo controller "auto" sends CPU tensors' rounds over the Gloo group; a GPU's
    stay on Horovod, whose GPU collectives need no trip through host memory."""
    import hvd_zoadam.comm.select as select
    gloo_controller.setattr(hvd, "local_size", lambda: 1)
    gloo_controller.setattr(select, "mpi_unavailable_reason", lambda: "the Gloo controller")
    assert select.make_transport("auto", _TwoRanks(), device).name == want
