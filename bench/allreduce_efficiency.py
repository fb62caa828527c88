"""Benchmark 3: all-reduce throughput against raw TCP throughput on the same shaped link, in one run.

    sudo .venv/bin/python bench/allreduce_efficiency.py --quick   # one 4M-parameter config (~1.5 min)
    sudo .venv/bin/python bench/allreduce_efficiency.py           # fp32 and int8 (~3 min)

First one TCP stream between two peer namespaces measures what the link really carries (``tc tbf`` at
``--mbit``). Then a 3-peer swarm with a larger model (about 4M parameters, 17 MB of fp32 pseudo-gradient)
averages a few rounds over the same links, H small so that rounds are mostly transfer. hivemind's
butterfly all-reduce moves 4/3 of the vector through each peer's uplink (its parts to 2 reducers, its
share back to 2 senders) while the same amount comes down, so a peer's achieved rate is
``max(bytes sent, bytes received) / seconds of the all-reduce proper`` (after matchmaking; the daemon
times it in the averager). Efficiency = that rate / the raw TCP rate. Writes ``allreduce_efficiency``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import figure, save  # noqa: E402
from swarm_bench import raw_tcp_bytes_per_second, run_swarm  # noqa: E402

from diloco_peer.tools.netbed import SlowNetwork, available  # noqa: E402

MODEL = ["model.hidden_size=256", "model.num_layers=4", "model.ffn_hidden_size=1024", "inner.batch_size=2"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fp32 only, 3 rounds")
    parser.add_argument("--mbit", type=float, default=20.0, help="link rate of every peer, up and down (default 20)")
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
        for codec in codecs:
            s = run_swarm(net, [*common, f"averaging.compression={codec}"], rounds, Path(tmp) / codec)
            rate = s["allreduce_bytes_per_second"]
            print(f"  {codec:5}: all-reduce {rate * 8 / 1e6:.1f} Mbit/s per peer ({s['parameters'] / 1e6:.1f}M params, "
                  f"{s['bytes_per_peer_round'] / 1e6:.1f} MB per peer and round): {rate / raw:.2f} of raw TCP",
                  flush=True)
            figures.append(figure("allreduce_efficiency", round(rate, 1), round(raw, 1), codec=codec,
                                  mbit=args.mbit, peers=3, parameters=s["parameters"], rounds=rounds,
                                  quick=args.quick, averaged_fraction=round(s["averaged_fraction"], 3)))
    save(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
