"""Two hosts on one machine: two network namespaces joined by a veth pair shaped with ``tc`` (a token
bucket at ``rate`` on each end: ``tbf``, which every kernel has; ``netem``'s delay is a module many
sandboxes lack), a torchrun job across them with gloo (its c10d rendezvous on the
first host's address), measuring collectives against ``cfx.parallel.estimate``'s model of that link
and training a plan over ``data=2`` against one process.

    with Hosts(rate="1gbit") as hosts:
        out = hosts.run(["-m", "cfx.bench.twohost_worker", ...])   # rank 0's JSON

The namespaces and the veth pair are made for the run and removed however it ends (deleting a namespace
deletes its end of the pair); only the two namespaces' own addresses carry traffic. ``available()``
says why a machine cannot make them (not root, no ``ip`` / ``tc``, namespaces forbidden).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid

from cfx.bench.common import free_port

SUBNET = "10.213.{}.{}"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


def available() -> str | None:
    """None where two namespaces can be made here, else why not."""
    if os.name != "posix" or not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "making network namespaces needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not _torchrun():
        return "torchrun is not installed"
    name = f"cfxprobe{uuid.uuid4().hex[:6]}"
    made = _ip("netns", "add", name, check=False)
    if made.returncode:
        return f"ip netns add failed: {made.stderr.strip()[:100]}"
    _ip("netns", "del", name, check=False)
    return None


def _torchrun() -> list[str]:
    exe = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    return [exe] if exe else []


class Hosts:
    """Two namespaces ``a`` and ``b`` with addresses ``10.213.N.1`` / ``.2`` on a veth pair, each end's
    egress shaped by ``tc tbf`` to ``rate`` with a ``burst`` bucket (module doc): a bucket much smaller
    than TCP's window throttles a stream below the rate (64 KiB: about 0.6 of 1 Gbit/s), 512 KiB does not."""

    def __init__(self, rate: str = "1gbit", burst: str = "512kb"):
        tag = uuid.uuid4().hex[:6]
        self.names = (f"cfxa{tag}", f"cfxb{tag}")
        self.devs = (f"va{tag}", f"vb{tag}")
        net = int(tag[:2], 16) % 250 + 1
        self.addrs = (SUBNET.format(net, 1), SUBNET.format(net, 2))
        self.rate, self.burst = rate, burst

    def __enter__(self) -> "Hosts":
        try:
            for ns in self.names:
                _ip("netns", "add", ns)
            _ip("link", "add", self.devs[0], "type", "veth", "peer", "name", self.devs[1])
            for ns, dev, addr in zip(self.names, self.devs, self.addrs):
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                                "burst", self.burst, "latency", "100ms"], capture_output=True, text=True, timeout=20,
                               check=True)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for ns in self.names:
            _ip("netns", "del", ns, check=False)

    def run(self, args: list[str], *, timeout: float = 120, env: dict | None = None) -> dict:
        """``torchrun`` with one process in each namespace (node ranks 0 and 1, rendezvous on host a's
        address) running ``python args...``; the JSON rank 0 wrote to the file it is handed (``--out``)."""
        port = free_port()
        folder = tempfile.mkdtemp(prefix="cfx-twohost-")
        out = os.path.join(folder, "rank0.json")
        procs = []
        try:
            for rank, (ns, dev) in enumerate(zip(self.names, self.devs)):
                cmd = ["ip", "netns", "exec", ns, *_torchrun(), "--nnodes", "2", "--node-rank", str(rank),
                       "--nproc-per-node", "1", "--master-addr", self.addrs[0], "--master-port", str(port),
                       *args, "--out", out]
                e = dict(os.environ, GLOO_SOCKET_IFNAME=dev, OMP_NUM_THREADS="1", **(env or {}))
                procs.append(subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            logs = []
            for p in procs:
                try:
                    logs.append(p.communicate(timeout=timeout)[0])
                except subprocess.TimeoutExpired:
                    p.kill()
                    logs.append(p.communicate()[0])
            if any(p.returncode for p in procs) or not os.path.exists(out):
                tail = "\n".join(log[-1500:] for log in logs)
                raise RuntimeError(f"the two-host job failed (exit {[p.returncode for p in procs]}):\n{tail}")
            with open(out) as f:
                return json.load(f)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            shutil.rmtree(folder, ignore_errors=True)

