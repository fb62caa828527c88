"""What one slow peer's DHT node costs every other peer's DHT calls (the progress records: stores and latest reads).

    sudo .venv/bin/python bench/slow_dht_node.py

A hivemind DHT of a root and four nodes on loopback, as a swarm of four peers has; node 0 stores its record and reads
everyone's (``latest=True``, as the round gate does), 20 times each, timed: with every node at full speed, then with
node 3 (its DHT process and its p2p daemon) in a cpu cgroup at ``--share`` of a core, idle there, then beside a busy
loop in the same cgroup (a slow volunteer's training, which takes its whole share), then at full speed again. A store
and a latest read both walk the DHT and wait for the answers of the nodes they ask: the slow node among them.
Records go to ``bench/results.json`` (``slow_dht_node``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hivemind.dht import DHT  # noqa: E402
from hivemind.utils import get_dht_time  # noqa: E402
from results import figure, save  # noqa: E402

from diloco_peer.tools.cpu_quota import available, cpu_quota  # noqa: E402

CALLS = 20


def descendants(pid: int) -> list[int]:
    """``pid`` and every process under it (a DHT process and its p2p daemon)."""
    children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    return [pid] + [p for child in children for p in descendants(int(child))]


def timed(node: DHT) -> tuple[float, float]:
    """Seconds per store of our record and per latest read of every record, from ``node``."""
    started = time.perf_counter()
    for i in range(CALLS):
        node.store("progress", {"peer": 0, "i": i, "pad": "x" * 1500}, get_dht_time() + 600, subkey="p0")
    stored = time.perf_counter()
    for _ in range(CALLS):
        assert len(node.get("progress", latest=True).value) == 4
    return (stored - started) / CALLS, (time.perf_counter() - stored) / CALLS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--share", type=float, default=0.15, help="the slow node's share of one core")
    args = parser.parse_args()
    why = available()
    if why:
        print(f"bench/slow_dht_node.py: {why}", file=sys.stderr)
        return 2
    root = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    nodes = [DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[str(a) for a in
                                                                                   root.get_visible_maddrs()])
             for _ in range(4)]
    try:
        for i, node in enumerate(nodes):
            node.store("progress", {"peer": i, "pad": "x" * 1500}, get_dht_time() + 600, subkey=f"p{i}")
        measured = {"full speed": timed(nodes[0])}
        with cpu_quota("slow-dht-node", args.share) as group:
            for pid in descendants(nodes[3].pid):
                (group / "cgroup.procs").write_text(str(pid))
            measured[f"one node at {args.share:g} of a core, idle"] = timed(nodes[0])
            busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            try:
                (group / "cgroup.procs").write_text(str(busy.pid))
                measured[f"one node at {args.share:g} of a core, beside a busy loop"] = timed(nodes[0])
            finally:
                busy.kill()
                busy.wait()
                for pid in descendants(nodes[3].pid):  # out again, so that the group can go
                    Path(group.parent / "cgroup.procs").write_text(str(pid))
        measured["full speed again"] = timed(nodes[0])
    finally:
        for node in nodes + [root]:
            node.shutdown()
    base_store, base_read = measured["full speed"]
    figures = []
    for case, (store, read) in measured.items():
        print(f"{case:>45}: store {store * 1e3:5.0f} ms ({store / base_store:.1f}x), latest read "
              f"{read * 1e3:5.0f} ms ({read / base_read:.1f}x)")
        figures.append(figure("slow_dht_node", store, base_store, case=case, call="store"))
        figures.append(figure("slow_dht_node", read, base_read, case=case, call="latest read"))
    save(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
