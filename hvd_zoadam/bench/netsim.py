"""Simulated hosts on one machine: network namespaces, veth links, HTB bandwidth shaping.

``python -m hvd_zoadam.bench.netsim --hosts 3 --rate 100mbit -- CMD ...`` makes one network
namespace per "host", joins them through a bridge, limits every host's link to ``--rate``
in both directions with HTB, runs CMD inside the first host's namespace with a launch
agent in place of ssh, and removes everything it made when CMD ends, fails or is
interrupted (Ctrl-C, SIGTERM).

What it makes, and nothing else (the root namespace is never touched):

* namespaces ``<tag>h1 .. <tag>hN`` (the hosts) and ``<tag>br`` (a bridge ``br0``),
  ``tag = "zo<pid>"`` unless ``--tag`` is given;
* in host k a veth ``zeth0`` with address ``10.<a>.<b>.k/24`` (a subnet picked from the
  tag), its peer ``h<k>`` on the bridge; loopback up;
* shaping (``--rate``): ``htb default 10 r2q 1000`` + ``class htb rate R ceil R`` +
  ``pfifo limit 1000`` on the egress of both ends of each link (HTB: TBF's bursts made
  64 MB collectives vary by 50%). **Latency cannot be added** where the kernel has no
  netem (as on the machine these benchmarks were measured on); the base RTT stays at about
  0.05 ms.

The launch agent (``<dir>/ssh``, also ``<dir>/nsssh``) takes ssh's command line
(``[-o opt] [-p port] ... host command...``) and runs the command through
``ip netns exec <namespace of host> sh -c``. The environment given to CMD:

* ``PATH`` with the agent's directory first (so ``horovodrun -H`` uses it as ``ssh``),
* ``ZO_HOSTS`` = ``"10.a.b.1,10.a.b.2,..."``, ``ZO_SUBNET`` = ``"10.a.b.0/24"``,
  ``ZO_AGENT`` = the agent's path, ``ZO_IFACE`` = ``"zeth0"``,
* ``ZO_MPIRUN_ARGS``: the Open MPI flags the links need: ``--mca plm_rsh_agent``,
  ``--mca btl tcp,self`` (shared memory would bypass the links), the TCP interface
  subnet for BTL and OOB, ``--oversubscribe`` and ``--mca mpi_yield_when_idle 1``
  (busy-polling ranks starve the links on 2 cores), ``--allow-run-as-root``, and
  ``--bind-to none`` (every simulated host is this machine; Open MPI's per-host default
  binding would pin every rank to core 0).

Requires root (``ip netns``). Exit status: CMD's.
"""
from __future__ import annotations

import argparse
import atexit
import hashlib
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import FrameType

IFACE = "zeth0"

AGENT = (r'''#!/bin/sh
# hvd_zoadam.bench.netsim launch agent: "ssh [options] host command..." -> ip netns exec <ns> sh -c command
# (OpenSSH also reads options after the host, as horovodrun's "ssh ... host -o ConnectTimeout=10 cmd")
map="$(dirname "$0")/hosts.map"
host=""
while [ $# -gt 0 ]; do
  case "$1" in
    -o|-p|-l|-i|-F|-E|-c|-m|-b|-J|-L|-R|-D|-S|-W|-w) shift 2 ;;
    -*) shift ;;
    *) if [ -n "$host" ]; then break; fi; host="$1"; shift ;;
  esac
done
host="${host#*@}"
ns=$(awk -v h="$host" '$1 == h { print $2 }' "$map")
if [ -z "$ns" ]; then echo "netsim agent: unknown host '$host' (known: $(awk '{print $1}' "$map" | tr '\n' ' '))" '''
         r'''>&2; exit 255; fi
# Own UTS namespace and hostname too: Open MPI then sees separate nodes and never uses shared memory.
export ZO_CMD="$*"
exec ip netns exec "$ns" unshare --uts sh -c 'hostname "$0" && exec sh -c "$ZO_CMD"' "$ns"
''')


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def _tc(ns, *args):
    subprocess.run(["ip", "netns", "exec", ns, "tc", *args], check=True, capture_output=True, text=True)


class Network:
    """The namespaces, links and agent of one simulation; :meth:`down` removes them all."""

    def __init__(self, hosts: int, rate: str | None, tag: str | None = None, sysctls: dict | None = None):
        if hosts < 1:
            raise ValueError(f"--hosts must be >= 1, got {hosts}")
        if os.geteuid() != 0:
            raise PermissionError("hvd_zoadam.bench.netsim needs root for ip netns (run as root, e.g. in CI)")
        self.hosts = hosts
        self.rate = rate
        self.tag = tag or f"zo{os.getpid()}"
        digest = hashlib.sha1(self.tag.encode()).digest()
        self.subnet_prefix = f"10.{200 + digest[0] % 50}.{digest[1]}"
        self.addresses = [f"{self.subnet_prefix}.{k}" for k in range(1, hosts + 1)]
        self.namespaces = [f"{self.tag}h{k}" for k in range(1, hosts + 1)]
        self.bridge_ns = f"{self.tag}br"
        self.dir = Path(tempfile.mkdtemp(prefix=f"{self.tag}-agent-"))
        self.made: list[str] = []
        self.sysctls = dict(sysctls or {})  # set in every host namespace, e.g. net.ipv4.tcp_slow_start_after_idle

    @property
    def subnet(self) -> str:
        return f"{self.subnet_prefix}.0/24"

    def up(self) -> "Network":
        try:
            self._up()
        except BaseException:
            self.down()
            raise
        return self

    def _shape(self, ns, dev):
        if not self.rate:
            return
        _tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10", "r2q", "1000")
        _tc(ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb",
            "rate", self.rate, "ceil", self.rate)
        _tc(ns, "qdisc", "add", "dev", dev, "parent", "1:10", "handle", "10:", "pfifo", "limit", "1000")

    def _up(self):
        _ip("netns", "add", self.bridge_ns)
        self.made.append(self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        for k, (ns, addr) in enumerate(zip(self.namespaces, self.addresses), start=1):
            _ip("netns", "add", ns)
            self.made.append(ns)
            # Create the pair inside the host namespace, then move the peer to the bridge.
            _ip("-n", ns, "link", "add", IFACE, "type", "veth", "peer", "name", f"h{k}")
            _ip("-n", ns, "link", "set", f"h{k}", "netns", self.bridge_ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", IFACE)
            _ip("-n", ns, "link", "set", IFACE, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", self.bridge_ns, "link", "set", f"h{k}", "master", "br0")
            _ip("-n", self.bridge_ns, "link", "set", f"h{k}", "up")
            self._shape(ns, IFACE)
            for key, value in self.sysctls.items():
                subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"{key}={value}"], check=True,
                               capture_output=True, text=True)
            self._shape(self.bridge_ns, f"h{k}")
        agent = self.dir / "ssh"
        agent.write_text(AGENT)
        agent.chmod(0o755)
        (self.dir / "nsssh").symlink_to(agent)
        (self.dir / "hosts.map").write_text(
            "".join(f"{a} {ns}\n" for a, ns in zip(self.addresses, self.namespaces)))

    def down(self) -> None:
        """Delete every namespace this object made (their links and qdiscs go with them)."""
        for ns in reversed(self.made):
            _ip("netns", "del", ns, check=False)
        self.made.clear()
        for f in ("ssh", "nsssh", "hosts.map"):
            try:
                (self.dir / f).unlink()
            except FileNotFoundError:
                pass
        try:
            self.dir.rmdir()
        except OSError:
            pass

    def mpirun_args(self) -> list[str]:
        """Open MPI flags for ranks on these hosts (see the module docstring)."""
        return ["--allow-run-as-root", "--oversubscribe", "--mca", "plm_rsh_agent", str(self.dir / "ssh"),
                "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", self.subnet,
                "--mca", "oob_tcp_if_include", self.subnet, "--mca", "mpi_yield_when_idle", "1",
                # Every simulated host is this machine: Open MPI's default binding (per host, to
                # its first core) put every rank on core 0, half a core each.
                "--bind-to", "none"]

    def env(self, base: dict | None = None) -> dict:
        env = dict(os.environ if base is None else base)
        env.update(PATH=f"{self.dir}:{env.get('PATH', '')}", ZO_HOSTS=",".join(self.addresses),
                   ZO_SUBNET=self.subnet, ZO_AGENT=str(self.dir / "ssh"), ZO_IFACE=IFACE,
                   ZO_MPIRUN_ARGS=" ".join(shlex.quote(a) for a in self.mpirun_args()),
                   # PMIx must accept connections from the other namespaces.
                   PMIX_MCA_ptl_tcp_remote_connections="1", PMIX_MCA_ptl_tcp_if_include=self.subnet)
        return env

    def run(self, cmd: list[str], timeout_s: float | None = None, **kwargs: object) -> subprocess.CompletedProcess:
        """Run ``cmd`` in the first host's namespace with :meth:`env`."""
        return subprocess.run(["ip", "netns", "exec", self.namespaces[0], *cmd], env=self.env(kwargs.pop("env", None)),
                              timeout=timeout_s, **kwargs)

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc):
        self.down()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hvd_zoadam.bench.netsim", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Example: python -m hvd_zoadam.bench.netsim --hosts 2 --rate 100mbit -- "
                                        "sh -c 'mpirun $ZO_MPIRUN_ARGS -H ${ZO_HOSTS%%,*}:1,... -np 2 python train.py'")
    ap.add_argument("--hosts", type=int, default=2, help="number of simulated hosts (namespaces)")
    ap.add_argument("--rate", default=None,
                    help="HTB rate per link and direction, e.g. 100mbit, 1gbit (default: unshaped)")
    ap.add_argument("--tag", default=None, help="name prefix of the namespaces (default: zo<pid>)")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command to run in host 1")
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("give a command after --")
    net = Network(args.hosts, args.rate, args.tag)
    atexit.register(net.down)

    def on_signal(signum: int, _frame: FrameType | None):
        net.down()
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        net.up()
        print(f"netsim: {args.hosts} hosts {', '.join(net.addresses)} (namespaces {', '.join(net.namespaces)}), "
              f"rate {args.rate or 'unshaped'} per link and direction; latency not shaped (no netem)",
              file=sys.stderr, flush=True)
        return net.run(cmd).returncode
    except KeyboardInterrupt:
        return 130
    finally:
        net.down()


if __name__ == "__main__":
    sys.exit(main())
