"""Multi-host training on one machine: ranks in separate network namespaces over shaped veth links.

``python -m hvd_zoadam.bench.netsim`` makes the "hosts" (namespaces joined by a bridge, HTB-shaped),
runs the launcher in host 1 with a launch agent in place of ssh, and removes what it made.
The char LM of examples/train_lm.py trains a few steps across 3 hosts under mpirun and 2
hosts under ``horovodrun --mpi -H``. Needs root (CI runs as root).
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from conftest import BIN, ROOT, run_cmd

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="ip netns needs root")

TINY = ["--steps", "6", "--warmup", "2", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "32",
        "--batch-size", "4", "--eval-interval", "3", "--eval-batches", "1", "--var-freeze-step", "4",
        "--local-step-policy", "steps", "--local-step-scaler", "2", "--local-step-clipper", "2"]


def netsim(hosts: int, rate: str, tag: str, script: str, timeout_s: int = 240):
    return run_cmd([sys.executable, "-m", "hvd_zoadam.bench.netsim", "--hosts", str(hosts), "--rate", rate,
                    "--tag", tag, "--", "sh", "-c", script], timeout_s=timeout_s, check=False)


def leftover(tag: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.startswith(tag)]


def train_cmd(summary) -> str:
    return " ".join(shlex.quote(a) for a in [sys.executable, str(ROOT / "examples/train_lm.py"), *TINY,
                                              "--summary", str(summary)])


def check_summary(path, world):
    s = json.loads(path.read_text())
    assert s["world_size"] == world and s["steps"] == 6
    assert s["comm_stats"]["transport"].startswith("mpi")      # auto picked mpi4py under MPI
    assert s["comm_stats"]["bytes_sent_total"] > 0
    assert len({p["netns"] for p in s["placement"]}) == world  # one rank per namespace
    assert len({p["hostname"] for p in s["placement"]}) == world
    kinds = set(s["kinds"])
    assert {"variance", "sync"} <= kinds


def test_mpirun_three_hosts_over_shaped_links(tmp_path):
    tag = f"zt{os.getpid()}m"
    summary = tmp_path / "s.json"
    script = (f'cd {ROOT} && H="$(echo $ZO_HOSTS | sed "s/,/:1,/g"):1" && '
              f'mpirun $ZO_MPIRUN_ARGS -H "$H" -np 3 -x PATH -x PYTHONUNBUFFERED {train_cmd(summary)}')
    proc = netsim(3, "1gbit", tag, script)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_summary(summary, 3)
    assert leftover(tag) == []


def test_horovodrun_mpi_two_hosts(tmp_path):
    tag = f"zt{os.getpid()}h"
    summary = tmp_path / "s.json"
    script = (f'cd {ROOT} && H="$(echo $ZO_HOSTS | sed "s/,/:1,/g"):1" && '
              f'{BIN}/horovodrun -np 2 -H "$H" --mpi --network-interfaces $ZO_IFACE '
              f'--mpi-args="--allow-run-as-root --oversubscribe --mca mpi_yield_when_idle 1" {train_cmd(summary)}')
    proc = netsim(2, "100mbit", tag, script)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_summary(summary, 2)
    assert leftover(tag) == []


def test_netsim_cleans_up_after_a_failing_command():
    tag = f"zt{os.getpid()}f"
    proc = netsim(2, "100mbit", tag, f"ip netns list | grep -c {tag}; exit 3", timeout_s=60)
    assert proc.returncode == 3
    assert proc.stdout.strip() == "3"   # two hosts and the bridge existed while the command ran
    assert leftover(tag) == []


def test_a_host_link_down_mid_training_ends_the_job_and_a_restart_finishes(tmp_path):
    """2 hosts under mpirun; after step 10 the second host's link goes down (up again 25 s later).
    Both ranks raise CollectiveTimeoutError naming the collective within HVD_ZOADAM_TIMEOUT_S = 10 s
    plus a margin of the link going down, the job exits non-zero, and a restart from the last
    checkpoint written before the fault (step 8) trains to the end."""
    tag = f"zt{os.getpid()}d"
    worker = ROOT / "tests/mp/worker_linkdown.py"
    down = (f"ip netns exec {tag}h2 ip link set {'zeth0'} down && "
            f"(sleep 25; ip netns exec {tag}h2 ip link set zeth0 up) >/dev/null 2>&1 &")
    hosts = 'H="$(echo $ZO_HOSTS | sed "s/,/:1,/g"):1"'
    mpirun = 'mpirun $ZO_MPIRUN_ARGS -H "$H" -np 2 -x PATH -x PYTHONUNBUFFERED -x HVD_ZOADAM_TIMEOUT_S -x ZO_LINK_DOWN'
    script = (f"cd {ROOT} && {hosts} && export HVD_ZOADAM_TIMEOUT_S=10 ZO_LINK_DOWN={shlex.quote(down)} && "
              f"start=$(date +%s); {mpirun} {sys.executable} {worker} train {tmp_path} 400; "
              f"echo \"train rc=$? after $(( $(date +%s) - start )) s\"; sleep 26; "
              f"{mpirun} {sys.executable} {worker} resume {tmp_path} 8 30; echo \"resume rc=$?\"")
    proc = netsim(2, "1gbit", tag, script, timeout_s=300)
    out = proc.stdout + proc.stderr
    assert leftover(tag) == []
    train = next(line for line in proc.stdout.splitlines() if line.startswith("train rc="))
    assert not train.startswith("train rc=0 "), out[-3000:]
    assert int(train.split()[-2]) < 120, train  # the job ended; it did not wait for the link
    for r in range(2):
        rec = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert rec["type"] == "CollectiveTimeoutError" and "'zoadam." in rec["message"], rec
        assert rec["since_down"] < 10 + 15, rec
    assert "resume rc=0" in proc.stdout, out[-3000:]
    assert json.loads((tmp_path / "resumed.json").read_text()) == {"first": 9, "last": 30, "step": 30}


def test_two_level_exchange_halves_the_bytes_between_two_hosts_of_two_ranks(tmp_path):
    """2 hosts × 2 ranks under mpirun: over the same 24 steps after the freeze, each host's veth TX
    bytes with hierarchical=True are at most 0.55× those of the flat exchange (ideal: 1/2), the
    split is by host, and the parameters are bitwise equal on all four ranks after every sync."""
    from hvd_zoadam.bench.netsim import Network
    tag = f"zt{os.getpid()}2"
    sent = {}
    with Network(2, "1gbit", tag) as net:
        hosts = ",".join(f"{a}:2" for a in net.addresses)
        for mode in ("flat", "two-level"):
            out = tmp_path / mode
            out.mkdir()
            cmd = ["mpirun", *net.mpirun_args(), "-H", hosts, "-np", "4", "-x", "PATH", "-x", "PYTHONUNBUFFERED",
                   "-x", "OMP_NUM_THREADS", "-x", "NUMBA_NUM_THREADS", sys.executable,
                   str(ROOT / "tests/mp/worker_hier_net.py"), mode, str(out)]
            env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
                       PATH=f"{BIN}:{os.environ.get('PATH', '')}")
            proc = net.run(cmd, timeout_s=300, env=env, capture_output=True, text=True, cwd=ROOT)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
            assert len({r["host"] for r in ranks}) == 2 and all(r["syncs"] >= 4 for r in ranks)
            sent[mode] = {r["host"]: r["tx_bytes"] for r in ranks if r["local_rank"] == 0}
            if mode == "two-level":
                assert all(r["hierarchical"]["nodes"] == 2 and r["hierarchical"]["ranks_per_node"] == 2
                           for r in ranks)
    assert leftover(tag) == []
    for host, flat in sent["flat"].items():
        assert sent["two-level"][host] <= 0.55 * flat, (host, sent)
