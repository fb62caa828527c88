"""Benchmark 3: all-reduce throughput against raw TCP throughput on the same shaped links, in one run.

    sudo .venv/bin/python bench/allreduce_efficiency.py --quick   # one 4M-parameter config (~2 min)
    sudo .venv/bin/python bench/allreduce_efficiency.py           # fp32 and int8 (~3.5 min)

First one TCP stream between two peer namespaces measures what the link really carries (``tc tbf`` at
``--mbit``). Then a 3-peer swarm with a larger model (about 4M parameters, 17 MB of fp32 pseudo-gradient)
averages a few rounds over the same links, H small so that rounds are mostly transfer. hivemind's
butterfly all-reduce moves 4/3 of the vector through each peer's uplink (its parts to 2 reducers, its
share back to 2 senders) while the same amount comes down, so a peer's achieved rate is
``max(bytes sent, bytes received) / seconds of the all-reduce proper`` (after matchmaking; the daemon
times it in the averager). Efficiency = that rate / the raw TCP rate. Writes ``allreduce_efficiency``.

One stream is not what the all-reduce's traffic can reach on these links: there every peer sends to two
peers and receives from two at once, so TCP ACKs share each uplink, two senders converge on each shaped
downlink (queue overflow, retransmissions) and flows do not share fairly (one pair's flow finishes seconds
after the others while links idle). So the run also measures a **raw TCP full mesh**: every peer sends
``--mesh-mb`` to every other peer at once, plain sockets with the system's congestion control (BBR on the
machines these numbers come from), the all-reduce's pattern without hivemind; per peer, bytes sent / time
until its last flow in or out ended, mean of ``--mesh-reps`` repetitions. ``of_mesh`` = all-reduce rate /
that rate: hivemind's own overhead (framing, TLS, yamux, part pipelining), the traffic pattern factored out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import figure, save  # noqa: E402
from swarm_bench import raw_tcp_bytes_per_second, run_swarm  # noqa: E402

from diloco_peer.tools.netbed import SlowNetwork, available  # noqa: E402

MODEL = ["model.hidden_size=256", "model.num_layers=4", "model.ffn_hidden_size=1024", "inner.batch_size=2"]


MESH_PEER = """import json, socket, sys, threading, time
me, size, addrs = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
server = socket.socket(); server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((addrs[me], 46001)); server.listen(len(addrs)); print("ready", flush=True)
ends = []
def receive(conn):
    while conn.recv(1 << 20):
        pass
    ends.append(time.time()); conn.close()
def accept():
    threads = [threading.Thread(target=receive, args=(server.accept()[0],)) for _ in addrs[1:]]
    [t.start() for t in threads]; [t.join() for t in threads]
def send(peer):
    s = socket.create_connection((addrs[peer], 46001)); s.sendall(b"x" * size)
    s.shutdown(socket.SHUT_WR); s.recv(1); s.close(); ends.append(time.time())
acceptor = threading.Thread(target=accept); acceptor.start()
start_at = float(sys.stdin.readline())
time.sleep(max(0.0, start_at - time.time()))
senders = [threading.Thread(target=send, args=(p,)) for p in range(len(addrs)) if p != me]
[t.start() for t in senders]; [t.join() for t in senders]; acceptor.join()
print(json.dumps(max(ends)))
"""
"""One peer of the full mesh: says ``ready`` once it listens, reads the start time from stdin, then sends
``size`` bytes to every other peer while receiving from each; prints when its last flow (in or out; a send
ends when the receiver has read it all and closed) ended."""


def raw_tcp_mesh_bytes_per_second(net: SlowNetwork, megabytes: float = 4.0) -> float:
    """Every peer sends ``megabytes`` to every other peer at once: mean bytes/s per peer (sent / its time)."""
    size, addresses = int(megabytes * 1e6), ",".join(net.address(i) for i in range(net.peers))
    procs = [net.run(i, [sys.executable, "-c", MESH_PEER, str(i), str(size), addresses],
                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for i in range(net.peers)]
    try:
        for proc in procs:  # every listener is up before the first connection
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError("a peer of the raw TCP mesh did not start listening")
        start_at = time.time() + 0.2  # one clock: the namespaces share this machine's
        for proc in procs:
            proc.stdin.write(f"{start_at}\n")
            proc.stdin.flush()
        ends = [json.loads(proc.communicate(timeout=300)[0]) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return statistics.mean(size * (net.peers - 1) / (end - start_at) for end in ends)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fp32 only, 3 rounds")
    parser.add_argument("--mbit", type=float, default=20.0, help="link rate of every peer, up and down (default 20)")
    parser.add_argument("--mesh-mb", type=float, default=4.0, help="raw mesh: MB each peer sends to each other")
    parser.add_argument("--mesh-reps", type=int, default=3, help="raw mesh repetitions (it varies run to run)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    if why := available():
        print(f"error: this benchmark needs network namespaces: {why} (run it as root)", file=sys.stderr)
        return 2
    codecs = ["none"] if args.quick else ["none", "int8"]
    rounds = 3 if args.quick else 4
    common = [*MODEL, "outer.inner_steps=5", "averaging.allreduce_timeout=120.0", *args.overrides]
    figures = []
    with SlowNetwork(3, args.mbit) as net, tempfile.TemporaryDirectory() as tmp:
        raw = raw_tcp_bytes_per_second(net, 1, 2)
        print(f"raw TCP on a {args.mbit:g} Mbit/s tbf link: {raw * 8 / 1e6:.1f} Mbit/s", flush=True)
        meshes = [raw_tcp_mesh_bytes_per_second(net, args.mesh_mb) for _ in range(args.mesh_reps)]
        mesh = statistics.mean(meshes)
        print(f"raw TCP full mesh (every peer to every peer at once): {mesh * 8 / 1e6:.1f} Mbit/s per peer, "
              f"{mesh / raw:.2f} of one stream (repetitions {', '.join(f'{m / raw:.2f}' for m in meshes)})",
              flush=True)
        for codec in codecs:
            s = run_swarm(net, [*common, f"averaging.compression={codec}"], rounds, Path(tmp) / codec)
            rate = s["allreduce_bytes_per_second"]
            print(f"  {codec:5}: all-reduce {rate * 8 / 1e6:.1f} Mbit/s per peer ({s['parameters'] / 1e6:.1f}M params, "
                  f"{s['bytes_per_peer_round'] / 1e6:.1f} MB per peer and round): {rate / raw:.2f} of raw TCP, "
                  f"{rate / mesh:.2f} of the raw mesh", flush=True)
            figures.append(figure("allreduce_efficiency", round(rate, 1), round(raw, 1), codec=codec,
                                  mbit=args.mbit, peers=3, parameters=s["parameters"], rounds=rounds,
                                  quick=args.quick, averaged_fraction=round(s["averaged_fraction"], 3),
                                  mesh_bytes_per_second=round(mesh, 1), of_mesh=round(rate / mesh, 4)))
    save(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
