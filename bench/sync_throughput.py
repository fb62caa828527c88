"""Benchmark: a joiner's state sync (the swarm's outer weights and momentum) against raw TCP on the same shaped link.

    sudo .venv/bin/python bench/sync_throughput.py --quick                       # 19M parameters: a 154 MB state
    sudo .venv/bin/python bench/sync_throughput.py --model llama-150m --mbit 200  # a 1.2 GB state (~2 min)

Two network namespaces joined by ``tc tbf`` links of ``--mbit`` each way (``tools/netbed.SlowNetwork``, as the
all-reduce benchmark). First one TCP stream from the donor's namespace to the joiner's measures what the link
carries. Then a donor (with the bootstrap node beside it) trains alone until it has stepped, and a joiner in the
other namespace starts: it downloads the donor's state, checks it and makes it its own. Rate = bytes of the
download (protobuf messages, as received) / seconds of the sync (from choosing the donor to holding the checked
state); efficiency = that / the TCP rate. The donor's rounds are long (``--inner-steps``), so that it rarely
steps while the joiner downloads (it would then serve the state the download started with, and the joiner
sync again for the next one: a second sync, not counted).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import figure, save  # noqa: E402
from scale import MODELS, SMALL  # noqa: E402
from swarm_bench import raw_tcp_bytes_per_second, slow_swarm, start_peer  # noqa: E402

from diloco_peer.tools.netbed import SlowNetwork, available  # noqa: E402


def measure_sync(net: SlowNetwork, args, workdir: Path) -> dict:
    """Donor in namespace 0, joiner in namespace 1: the joiner's first state sync, as its event log has it."""
    config, model_sets = MODELS[args.model]
    sets = [*SMALL, *model_sets, f"outer.inner_steps={args.inner_steps}", "averaging.min_peers=1", "checkpoint.dir=''",
            "averaging.sync_timeout=300.0"]
    with slow_swarm(net, workdir, sets, wrap=["nice", "-n", "5"]) as swarm:
        for i, name in enumerate(["donor", "joiner"]):
            if name == "joiner":  # once the donor holds a state to serve
                swarm.wait_for("round of the donor", lambda: swarm.events("donor", "round"), args.timeout)
            start_peer(net, swarm, i, name=name, args=["--config", config])
        swarm.wait_for("state sync of the joiner", lambda: [e for e in swarm.events("joiner", "sync") if e["ok"]],
                       args.timeout)
    sync = next(e for e in swarm.events("joiner", "sync") if e["ok"])
    parameters = swarm.events("joiner", "start")[0]["parameters"]
    return {"bytes": sync["bytes"], "seconds": sync["seconds"], "parameters": parameters}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=list(MODELS), default="mid", help="the state's model, e.g. llama-150m")
    parser.add_argument("--mbit", type=float, default=50.0, help="each link's rate each way, Mbit/s, e.g. 50")
    parser.add_argument("--inner-steps", type=int, default=200, help="H of the donor: long rounds, e.g. 200")
    parser.add_argument("--quick", action="store_true", help="--model mid --mbit 50")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds each wait may take, e.g. 900")
    parser.add_argument("--no-save", action="store_true", help="do not write bench/results.json")
    args = parser.parse_args()
    if args.quick:
        args.model, args.mbit = "mid", 50.0
    why = available()
    if why:
        print(f"cannot run: {why}")
        return 1
    workdir = Path(tempfile.mkdtemp(prefix="sync-throughput-"))
    with SlowNetwork(peers=2, mbit=args.mbit) as net:
        tcp = raw_tcp_bytes_per_second(net, 0, 1, megabytes=max(8.0, args.mbit / 8 * 4))
        sync = measure_sync(net, args, workdir)
    rate = sync["bytes"] / sync["seconds"]
    print(f"{args.model} ({sync['parameters'] / 1e6:.1f}M parameters) on {args.mbit:g} Mbit/s links: raw TCP "
          f"{tcp / 1e6:.2f} MB/s; state sync {sync['bytes'] / 1e6:.1f} MB in {sync['seconds']:.1f} s = "
          f"{rate / 1e6:.2f} MB/s, {rate / tcp:.2f} of TCP (logs: {workdir})")
    if not args.no_save:
        save([figure("state_sync_efficiency", round(rate / tcp, 3), 1.0, model=args.model, mbit=args.mbit)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
