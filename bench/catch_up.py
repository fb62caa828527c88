"""Benchmark: a joiner whose state download outlasts the swarm's rounds, with and without the round log.

    sudo .venv/bin/python bench/catch_up.py              # tiny model, 1 Mbit/s, fp16, H=1000: ~6 minutes
    sudo .venv/bin/python bench/catch_up.py --mbit 2 --inner-steps 500 --seconds 240

Two network namespaces joined by ``tc tbf`` links of ``--mbit`` each way (``tools/netbed.SlowNetwork``, as the
state-sync benchmark). Two donors (with the bootstrap node beside them) average together in the first, over its
loopback; once they have stepped, a joiner starts in the second, behind the slow link, and all run for
``--seconds``. The donors' rounds are shorter than the joiner's download of the state, longer than the download of
a round's update (fp16 on the wire: their averages are fp16 values, 2 bytes per parameter per round; the state is
8): without the log (``averaging.log_rounds=0``) the joiner arrives a few epochs late after each download and
downloads the state again; with it (the default) it downloads the missed rounds' updates instead
(``averaging/round_log.py``) and then averages with the donors. Both runs side by side,
each on fresh namespaces. Printed per run: the joiner's syncs (by state or by logged rounds, bytes, seconds), its
rounds averaged with the donors, and when it first contributed (seconds from its start); ``--json`` saves them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scale import SMALL  # noqa: E402
from swarm_bench import slow_swarm, start_peer  # noqa: E402

from diloco_peer.tools.netbed import SlowNetwork, available  # noqa: E402


def run(args, log_rounds: int, workdir: Path) -> dict:
    """One run: the donors in namespace 0, the joiner in namespace 1 for ``args.seconds``; the joiner's record."""
    sets = [*SMALL, f"outer.inner_steps={args.inner_steps}", "averaging.min_peers=2", "averaging.compression=fp16",
            f"averaging.log_rounds={log_rounds}", "checkpoint.dir=''", "averaging.sync_timeout=60.0"]
    with SlowNetwork(peers=2, mbit=args.mbit) as net, slow_swarm(net, workdir, sets) as swarm:
        for i, name in [(0, "donor"), (0, "donor-b"), (1, "joiner")]:
            if name == "joiner":
                swarm.wait_for("round of the donors", lambda: swarm.events("donor", "round"), 300)
            start_peer(net, swarm, i, name=name, args=["--config", "tiny-cpu"])
        started = time.monotonic()
        while time.monotonic() - started < args.seconds and all(p.poll() is None for p in swarm.procs):
            time.sleep(1.0)
    syncs = [{k: e.get(k) for k in ("ok", "epoch", "bytes", "seconds", "rounds")}
             for e in swarm.events("joiner", "sync")]
    averaged = [e for e in swarm.events("joiner", "round") if e["outcome"] == "averaged"]
    first = next((e["first_contribution_seconds"] for e in averaged if "first_contribution_seconds" in e), None)
    donor_rounds = swarm.events("donor", "round")
    return {"log_rounds": log_rounds, "syncs": syncs, "rounds_averaged": len(averaged),
            "first_contribution_seconds": first, "donor_rounds": len(donor_rounds),
            "donor_round_seconds": round(sum(e["round_seconds"] for e in donor_rounds[1:]) /
                                         max(1, len(donor_rounds) - 1), 2), "logs": str(workdir)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mbit", type=float, default=1.0, help="each link's rate each way, Mbit/s, e.g. 1")
    parser.add_argument("--inner-steps", type=int, default=1000, help="H: the donors' rounds, e.g. 1000")
    parser.add_argument("--seconds", type=float, default=150.0, help="how long the joiner runs, e.g. 150")
    parser.add_argument("--json", type=Path, help="write both runs' records there")
    args = parser.parse_args()
    why = available()
    if why:
        print(f"cannot run: {why}")
        return 1
    records = []
    for log_rounds in (0, 4):
        record = run(args, log_rounds, Path(tempfile.mkdtemp(prefix=f"catch-up-{log_rounds}-")))
        records.append(record)
        syncs = ", ".join(f"{'rounds' if s['rounds'] else 'state'}->{s['epoch']} {s['bytes'] / 1e6:.2f} MB "
                          f"{s['seconds']:.1f}s" + ("" if s["ok"] else " FAILED") for s in record["syncs"])
        print(f"averaging.log_rounds={log_rounds}: donor rounds of {record['donor_round_seconds']} s; joiner "
              f"syncs [{syncs}]; rounds averaged {record['rounds_averaged']}, first contribution at "
              f"{record['first_contribution_seconds']} s (logs: {record['logs']})", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "runs": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
