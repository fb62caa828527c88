"""Sign flips by a forked client in a real local swarm: what each costs the honest peers, ``mean`` vs ``robust``.

    nice -n 5 .venv/bin/python bench/sign_flip.py                                  # ~25 min on 2 busy cores
    nice -n 5 .venv/bin/python bench/sign_flip.py --factors 9 --aggregations mean --rounds 6

Each run is a bootstrap node, three honest peers (``p0``..``p2``, data shards 0-2 of 4) and, unless the factor is
0 (the clean run), one attacker on shard 3: the normal client with ``RoundAverager.average`` replaced so that the
pseudo-gradient it sends is -K times its own (``tests/attacker.py sign_flip:K``; it trains honestly). tiny-cpu,
H=10, one thread per peer, the first round waits for every peer (``averaging.min_peers``). The clean run has the
three honest peers alone, the same shards and rounds: what they reach without the attacker.

Measured, from the honest peers' event logs: their eval loss (of the outer weights) after each round, each
round's outcome, whether their states are identical after each round (``param_sha256``: weights, momentum,
epoch, LR position), the offenses they logged against the attacker (kind) and the round in which each honest
peer banned it (an ``offense`` event with ``banned=true``). Prints a table per run and appends the runs to
``--out`` (a JSON list; BENCHMARKS.md's table comes from it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from results import append_runs  # noqa: E402
from swarm_bench import FAST  # noqa: E402

from diloco_peer.tools.local_swarm import LocalSwarm  # noqa: E402

HONEST = ("p0", "p1", "p2")
ATTACKER = "evil"
FORKED_CLIENT = [sys.executable, str(ROOT / "tests" / "attacker.py")]
"""The attacker's program (with its attack and ``--``): the forked client lives with the tests."""


def run_swarm(workdir: Path, aggregation: str, factor: float, rounds: int, extra: list[str],
              timeout: float) -> dict:
    """One run: the honest peers (and the attacker unless ``factor`` is 0) for ``rounds`` rounds; the figures."""
    started = time.monotonic()
    with LocalSwarm(workdir, sets=FAST) as swarm:
        swarm.start_bootstrap()
        members = len(HONEST) + (factor != 0)
        sets = [f"averaging.aggregation={aggregation}", f"run.max_rounds={rounds}", f"averaging.min_peers={members}",
                "data.num_shards=4", *extra]
        if factor:
            swarm.start_peer(ATTACKER, *sets, f"data.shard={len(HONEST)}",
                             program=[*FORKED_CLIENT, f"sign_flip:{factor:g}", "--"])
        procs = {name: swarm.start_peer(name, *sets, f"data.shard={i}") for i, name in enumerate(HONEST)}
        for name, proc in procs.items():
            code = proc.wait(timeout=max(1.0, timeout - (time.monotonic() - started)))
            if code != 0:
                raise RuntimeError(f"{name} exited with {code}: see {workdir / (name + '.log')}")
        return measure(swarm, aggregation, factor, rounds, time.monotonic() - started)


def measure(swarm: LocalSwarm, aggregation: str, factor: float, rounds: int, seconds: float) -> dict:
    """The honest peers' figures from their event logs (see the module docstring)."""
    names = {e["peer_id"]: name for name in (*HONEST, *([ATTACKER] if factor else []))
             for e in swarm.events(name) if e["event"] == "start"}
    by_round: dict[int, dict[str, dict]] = {}
    offenses: dict[str, list[str]] = {}
    honest_offenses: list[dict] = []  # an honest peer's contribution refused by another: what robust mode costs
    banned_in: dict[str, int | None] = {}
    for name in HONEST:
        offenses[name], banned_in[name] = [], None
        pending: list[dict] = []
        for e in swarm.events(name):
            if e["event"] == "offense":
                pending.append(e)
            elif e["event"] == "round":
                by_round.setdefault(e["round"], {})[name] = e
                for o in pending:  # written while the round concludes, before its record
                    offender = names.get(o["offender"], o["offender"])
                    if offender != ATTACKER:
                        honest_offenses.append({"round": e["round"], "peer": name, "offender": offender,
                                                "kind": o["kind"], "detail": o["detail"]})
                        continue
                    offenses[name].append(o["kind"])
                    if o["banned"] and banned_in[name] is None:
                        banned_in[name] = e["round"]
                pending = []
    table = []
    for rnd in sorted(by_round):
        rows = by_round[rnd]
        table.append({"round": rnd, "eval_loss": statistics.mean(r["eval_loss"] for r in rows.values()),
                      "eval_loss_max": max(r["eval_loss"] for r in rows.values()),
                      "outcomes": sorted(r["outcome"] for r in rows.values()),
                      "errors": sorted({r["error"] for r in rows.values() if r.get("error")}),
                      "identical": len(rows) == len(HONEST) and len({r["param_sha256"] for r in rows.values()}) == 1})
    return {"aggregation": aggregation, "factor": factor, "rounds": rounds, "seconds": round(seconds, 1),
            "per_round": table, "offenses": offenses, "banned_in_round": banned_in, "honest_offenses": honest_offenses,
            "final_eval_loss": table[-1]["eval_loss"] if table else float("nan"),
            "final_identical": bool(table) and table[-1]["identical"]}


def show(run: dict, clean: dict | None) -> None:
    reference = {r["round"]: r["eval_loss"] for r in clean["per_round"]} if clean else {}
    print(f"{run['aggregation']} sign_flip x{run['factor']:g}: banned in round {run['banned_in_round']}, offenses "
          f"{ {n: sorted(set(k)) for n, k in run['offenses'].items()} }, offenses against honest peers "
          f"{len(run['honest_offenses'])}, {run['seconds']:.0f}s", flush=True)
    for r in run["per_round"]:
        clean_loss = reference.get(r["round"])
        vs = f"{(r['eval_loss'] / clean_loss - 1) * 100:+7.1f}%" if clean_loss else ""
        print(f"  round {r['round']:>2} eval loss {r['eval_loss']:8.4f} (max {r['eval_loss_max']:8.4f}) {vs} "
              f"identical {r['identical']!s:5} {','.join(r['outcomes'])}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--factors", default="1,3,9,10",
                        help="comma-separated K of sign_flip:K (default 1,3,9,10; '' for the clean run only)")
    parser.add_argument("--aggregations", default="mean,robust", help="comma-separated (default mean,robust)")
    parser.add_argument("--rounds", type=int, default=8, help="outer rounds per run (default 8)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run (default 900)")
    parser.add_argument("--keep", default="", metavar="DIR", help="keep each run's logs under DIR (default: not)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "sign_flip.json"))
    args = parser.parse_args()
    runs = []
    for aggregation in args.aggregations.split(","):
        clean = None
        for factor in [0.0, *(float(k) for k in args.factors.split(",") if k)]:
            if args.keep:  # the event logs and peer logs stay, one directory per run
                workdir = Path(args.keep) / f"{aggregation}-x{factor:g}-{time.strftime('%H%M%S')}"
                workdir.mkdir(parents=True)
                run = run_swarm(workdir, aggregation, factor, args.rounds, args.overrides, args.timeout)
            else:
                with tempfile.TemporaryDirectory(prefix="sign_flip-") as tmp:
                    run = run_swarm(Path(tmp), aggregation, factor, args.rounds, args.overrides, args.timeout)
            run["overrides"] = args.overrides
            clean = clean or run
            show(run, None if run is clean else clean)
            runs.append(run)
    append_runs(runs, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
