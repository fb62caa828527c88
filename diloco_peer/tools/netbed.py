"""Emulated networks on one machine, from network namespaces: slow links, and an internet of home routers.

``SlowNetwork``: each peer in its own namespace, all joined by a bridge, links shaped (benchmarks).
``EmulatedInternet``: a public network and homes behind NAT routers (NAT traversal tests, ``demo --nat``).

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

from ..lifecycle.reaper import remove_namespace

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


def _shape(dev: str, ns: str, mbit: float, burst_kb: int = 64) -> None:
    """Shape ``dev``'s egress in ``ns`` to ``mbit`` Mbit/s with tbf (0 = leave it unshaped)."""
    if mbit:
        _ip("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit", "burst", f"{burst_kb}kb",
            "latency", "50ms", ns=ns)


class _Namespaces:
    """Built on entry (the subclass's ``_build``), removed on exit (its ``close``), also when the build fails
    half-way."""

    def __enter__(self):
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SlowNetwork(_Namespaces):
    """``peers`` namespaces on a bridge, each link shaped to ``mbit`` Mbit/s in both directions (0 = unshaped).

    :param peers: how many namespaces (peer i has address ``10.77.0.{i+1}``)
    :param mbit: link rate of each peer, up and down
    :param burst_kb: tbf bucket size; small buckets keep the rate honest at sub-second scales
    """

    def __init__(self, peers: int, mbit: float, burst_kb: int = 64):
        self.peers = peers
        self.mbit = mbit
        self.burst_kb = burst_kb
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

    def _shape(self, dev: str, ns: str) -> None:
        _shape(dev, ns, self.mbit, self.burst_kb)

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
        _remove(self._made)


def _remove(namespaces: list[str]) -> None:
    """Kill what still runs inside each namespace, then delete it (its veths go with it), the last made first."""
    for ns in reversed(namespaces):
        remove_namespace(ns)
    namespaces.clear()


class EmulatedInternet(_Namespaces):
    """A "public" network and ``homes`` home networks, each behind its own NAT router, like volunteers' homes.

        with EmulatedInternet(homes=3) as net:
            net.run_public(["diloco-peer", "bootstrap", "--listen", f"/ip4/{net.public_address}/tcp/31337"])
            net.run_home(1, ["diloco-peer", "join", ...])     # behind router 1: no inbound connections

    Topology (``tag`` prefixes every name): namespace ``<tag>-pub`` holds bridge ``br0`` at ``10.78.0.1/24``
    (where public processes listen). Home ``i`` (1-based): router namespace ``<tag>-r<i>`` with its public side
    at ``10.78.0.<10+i>`` on the bridge and its home side at ``10.78.<i>.1``, IP forwarding on and iptables
    MASQUERADE out of the public side, as a home router does; host namespace ``<tag>-h<i>`` at
    ``10.78.<i>.2`` with its default route through the router. The public side has no route into a home: an
    inbound connection reaches a home host only through a port forward (``forward``). Links from the homes
    are shaped with tbf when ``mbit`` is set. Needs root and iptables; everything is removed on exit.
    """

    def __init__(self, homes: int, mbit: float = 0, tag: str = ""):
        self.homes = homes
        self.mbit = mbit
        self.tag = tag or f"dnat{os.getpid() % 100000}"
        self.public = f"{self.tag}-pub"
        self.public_address = "10.78.0.1"
        self._made: list[str] = []

    def router_address(self, i: int) -> str:
        """The public address of home ``i``'s router: where the world sees home ``i``'s connections come from."""
        return f"10.78.0.{10 + i}"

    def home_address(self, i: int) -> str:
        return f"10.78.{i}.2"

    def command(self, where: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", where, *argv]

    def home(self, i: int) -> str:
        return f"{self.tag}-h{i}"

    def router(self, i: int) -> str:
        return f"{self.tag}-r{i}"

    def namespaces(self) -> list[str]:
        """Every namespace this internet makes, in the order it makes them: known before they exist, so that a
        reaper can be told them beforehand (``demo --nat``)."""
        return [self.public, *(ns for i in range(1, self.homes + 1) for ns in (self.router(i), self.home(i)))]

    def run_public(self, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(self.public, argv), **kwargs)

    def run_home(self, i: int, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(self.home(i), argv), **kwargs)

    def forward(self, i: int, port: int) -> None:
        """Forward TCP ``port`` of router ``i``'s public address to home host ``i`` (a user's port forward)."""
        _ip("iptables", "-t", "nat", "-A", "PREROUTING", "-i", "pub0", "-p", "tcp", "--dport", str(port),
            "-j", "DNAT", "--to-destination", f"{self.home_address(i)}:{port}", ns=self.router(i))

    def __enter__(self) -> EmulatedInternet:
        if not shutil.which("iptables"):
            raise RuntimeError("iptables is not installed (Debian package iptables): it emulates the home routers")
        return super().__enter__()

    def _add(self, ns: str) -> str:
        _ip("ip", "netns", "add", ns)
        self._made.append(ns)
        _ip("ip", "link", "set", "lo", "up", ns=ns)
        return ns

    def _build(self) -> None:
        pub = self._add(self.public)
        _ip("ip", "link", "add", "br0", "type", "bridge", ns=pub)
        _ip("ip", "addr", "add", f"{self.public_address}/24", "dev", "br0", ns=pub)
        _ip("ip", "link", "set", "br0", "up", ns=pub)
        for i in range(1, self.homes + 1):
            router = self._add(self.router(i))
            host = self._add(self.home(i))
            _ip("ip", "link", "add", "pub0", "netns", router, "type", "veth", "peer", "name", f"port{i}", "netns", pub)
            _ip("ip", "link", "set", f"port{i}", "master", "br0", ns=pub)
            _ip("ip", "link", "set", f"port{i}", "up", ns=pub)
            _ip("ip", "link", "add", "lan0", "netns", router, "type", "veth", "peer", "name", "eth0", "netns", host)
            for ns, dev, addr in ((router, "pub0", f"{self.router_address(i)}/24"),
                                  (router, "lan0", f"10.78.{i}.1/24"), (host, "eth0", f"{self.home_address(i)}/24")):
                _ip("ip", "addr", "add", addr, "dev", dev, ns=ns)
                _ip("ip", "link", "set", dev, "up", ns=ns)
            _ip("ip", "route", "add", "default", "via", f"10.78.{i}.1", ns=host)
            _ip("sysctl", "-qw", "net.ipv4.ip_forward=1", ns=router)
            _ip("iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "pub0", "-j", "MASQUERADE", ns=router)
            for ns, dev in ((host, "eth0"), (router, "lan0")):  # the home's uplink and downlink
                _shape(dev, ns, self.mbit)

    def close(self) -> None:
        _remove(self._made)
