"""An emulated slow network on one machine: each peer in its own network namespace, all joined by a bridge.

    with SlowNetwork(peers=3, mbit=50) as net:
        net.run(0, ["python", "-c", "..."])            # a process inside peer 0's namespace
        net.address(1)                                   # "10.77.0.2": where peer 1 listens

Topology: a hub namespace holds a Linux bridge; peer i's namespace holds ``eth0`` (10.77.0.{i+1}/24), the
other end of its veth pair is a port of the bridge. Both directions of every peer's link are shaped with
``tc tbf`` (peer egress on ``eth0``, peer ingress as the hub port's egress), so each peer has ``mbit`` up
and ``mbit`` down, like a home connection. Needs root (``ip netns``); ``available()`` says why not.
netem is not available on these machines, so there is no added latency: for multi-megabyte all-reduces
bandwidth dominates. Everything is removed on exit, also when the body raises.
"""

from __future__ import annotations

import os
import shutil
import subprocess

SUBNET = "10.77.0"


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def available() -> str:
    """"" if namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "iproute2 (ip, tc) is not installed"
    probe = f"dlp-probe-{os.getpid()}"
    try:
        _ip("ip", "netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"cannot create a network namespace: {getattr(e, 'stderr', e)}".strip()
    _ip("ip", "netns", "del", probe)
    return ""


class SlowNetwork:
    """``peers`` namespaces on a bridge, each link shaped to ``mbit`` Mbit/s in both directions (0 = unshaped).

    :param peers: how many namespaces (peer i has address ``10.77.0.{i+1}``)
    :param mbit: link rate of each peer, up and down
    :param burst_kb: tbf bucket size; small buckets keep the rate honest at sub-second scales
    """

    def __init__(self, peers: int, mbit: float, burst_kb: int = 64):
        self.peers, self.mbit, self.burst_kb = peers, mbit, burst_kb
        self.tag = f"dlp{os.getpid() % 100000}"
        self.hub = f"{self.tag}-hub"
        self.namespaces = [f"{self.tag}-p{i}" for i in range(peers)]
        self._made: list[str] = []

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def ns(self, i: int) -> str:
        return self.namespaces[i]

    def command(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` wrapped to run inside peer ``i``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[i], *argv]

    def run(self, i: int, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(i, argv), **kwargs)

    def __enter__(self) -> SlowNetwork:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _shape(self, dev: str, ns: str) -> None:
        if self.mbit:
            _ip("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{self.mbit}mbit",
                "burst", f"{self.burst_kb}kb", "latency", "50ms", ns=ns)

    def _build(self) -> None:
        _ip("ip", "netns", "add", self.hub)
        self._made.append(self.hub)
        _ip("ip", "link", "add", "br0", "type", "bridge", ns=self.hub)
        _ip("ip", "link", "set", "br0", "up", ns=self.hub)
        _ip("ip", "link", "set", "lo", "up", ns=self.hub)
        for i, ns in enumerate(self.namespaces):
            _ip("ip", "netns", "add", ns)
            self._made.append(ns)
            port = f"{self.tag}h{i}"
            _ip("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", self.hub)
            _ip("ip", "link", "set", port, "master", "br0", ns=self.hub)
            _ip("ip", "link", "set", port, "up", ns=self.hub)
            _ip("ip", "addr", "add", f"{self.address(i)}/24", "dev", "eth0", ns=ns)
            _ip("ip", "link", "set", "eth0", "up", ns=ns)
            _ip("ip", "link", "set", "lo", "up", ns=ns)
            self._shape("eth0", ns)
            self._shape(port, self.hub)

    def close(self) -> None:
        for ns in reversed(self._made):
            # kill what still runs inside, then delete the namespace (its veths go with it)
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()
