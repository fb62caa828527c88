"""A churn soak: a real swarm under a seeded random schedule of crashes, leaves, restarts, joins and pauses.

    .venv/bin/python bench/soak.py --quick                  # ~5 minutes
    .venv/bin/python bench/soak.py --json runs/soak.json    # the full soak: 30 minutes, 5 peers, seed 0

One bootstrap node and N peers (``--peers``): real ``diloco-peer`` processes on loopback, the tiny config at
the tests' speed (H=10, one thread each, short timeouts), a checkpoint every round. Every 2-4 swarm rounds
(the highest round a peer finished) one event, each kind in turn in a seeded order (``--seed``): ``kill``
(SIGKILL of a peer's main process, as the OOM killer does), ``term`` (SIGTERM: a clean leave, exit 0 within
``run.shutdown_grace``), ``restart`` (a killed or stopped peer again, same ``--name`` and checkpoint dir: it
resumes and syncs), ``join`` (a new peer), ``pause`` (SIGSTOP of a peer's process group for 5-30 s, a frozen
machine, then SIGCONT); the live count stays within 2..N+2. At the end the swarm settles for up to two
rounds, then every peer is stopped with SIGTERM.

Results (printed; as JSON with ``--json PATH``; logs, event logs, checkpoints in ``--out``): ``rounds``: all
peers' round events, averaged / solo (nobody to average with) / failed (a group failed); ``survivor_crashes``:
a peer that exited non-zero or died without the schedule killing it; ``back_in_step``: per restart and join,
seconds from its start to its first round whose ``param_sha256`` equals the others' majority for that round
(null: never); ``stuck``: a peer running ``run.shutdown_grace`` + 10 s after its SIGTERM (then SIGKILLed), or
a running, unpaused peer with no event for 3 minutes; ``orphans``: processes of the soak (p2pd, DHT and
averager children, reapers: recorded by pid and start time while running) alive 5 s after everything
stopped; ``final``: the stopped peers' ``param_sha256`` at the last round all of them finished. ``passed``
(exit 0): no survivor crash, nothing stuck, no orphan, identical replicas at the end. Whatever happens
(Ctrl+C, SIGTERM, an exception), every process the soak started is killed on the way out.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from swarm_bench import FAST

from diloco_peer.observe.events import EventFollower
from diloco_peer.tools.local_swarm import LocalSwarm

SETTINGS = [*FAST, "averaging.allreduce_timeout=8.0", "averaging.ready_timeout=8.0", "averaging.sync_timeout=5.0",
            "checkpoint.every_rounds=1"]  # as tests/test_churn.py CHURN; every peer's, besides its dirs
GRACE = 20.0  # run.shutdown_grace of every peer
STOP_SLACK = 10.0  # a SIGTERMed peer still running GRACE + this later is stuck
SILENT_SECONDS = 180.0  # a running peer with no event for this long is stuck
PAUSE_SECONDS, EVERY_ROUNDS = (5.0, 30.0), (2, 4)  # a straggler's pause; swarm rounds between two events
SETTLE_ROUNDS, SETTLE_SECONDS = 2, 180.0


def _signal_tree(pid: int, sig: signal.Signals) -> None:
    """``sig`` to a peer and every process under it (its DHT and averager have process groups of their own)."""
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(sig)


@dataclass(eq=False)
class Instance:
    """One run of one peer process (a restarted name is a new instance) and what the soak did to it."""
    name: str
    cause: str  # initial, restart or join
    proc: subprocess.Popen
    started: float
    last_seen: float  # wall time of its last event, its start, or the end of its pause
    events: list[dict] = field(default_factory=list)
    stop: str = ""  # how the soak stopped it: kill, term, final (the end of the soak) or stuck (then SIGKILLed)
    stop_sent: float = 0.0
    paused_until: float = 0.0
    code: int | None = None

    def rounds(self) -> list[dict]:
        """Its ``round`` events."""
        return [e for e in self.events if e["event"] == "round"]


def _kind(info: dict, root: bool) -> str:
    """What a process of the soak is: main, p2pd, reaper, or the name of a forked Python (hivemind's DHT, averager)."""
    reaper = "diloco_peer.lifecycle.reaper" in " ".join(info.get("cmdline") or [])
    return "main" if root else "p2pd" if info["name"] == "p2pd" else "reaper" if reaper else info["name"] or "?"


class Soak:
    """The swarm, its schedule and what was observed; ``run()`` it, ``cleanup()`` in a finally, then ``result()``."""

    def __init__(self, args, out: Path):
        self.args, self.out = args, out
        self.rng, self.t0 = random.Random(args.seed), time.time()
        # a restart appends to the same logs; every peer's checkpoints in ``out/checkpoints/NAME``, resumed if there
        self.swarm = LocalSwarm(out, sets=[*SETTINGS, f"run.shutdown_grace={GRACE}",
                                           f"checkpoint.dir={json.dumps(str(out / 'checkpoints'))}"])
        self.current: dict[str, Instance] = {}  # name -> its latest instance; the bootstrap node's is "bootstrap"
        self.instances: list[Instance] = []  # every instance ever started
        self.followers: dict[str, EventFollower] = {}
        self.swarm_round = 0
        self.tree: dict[int, dict] = {}  # pid -> owner, kind, create_time: every process of the soak ever seen
        self.schedule, self.crashes, self.stuck, self.orphans = [], [], [], []
        self.bag: list[str] = []  # the kinds of event still due in this turn

    def _note(self, line: str) -> None:
        print(f"soak {time.time() - self.t0:6.0f}s round {self.swarm_round:3d}: {line}", flush=True)

    def start_bootstrap(self) -> None:
        """Start the bootstrap node and wait for the join address it prints."""
        self.swarm.start_bootstrap("--report-every", "10", timeout=120)
        # it writes no event log: never "silent"
        self.current["bootstrap"] = Instance("bootstrap", "bootstrap", self.swarm.bootstraps[0], time.time(),
                                             float("inf"))
        self.instances.append(self.current["bootstrap"])

    def start_peer(self, name: str, cause: str) -> Instance:
        """``diloco-peer join`` as ``name``: its checkpoints in ``out/checkpoints/name``, resumed if there."""
        if name in self.current:  # a restart: the old process is gone, so the rest of the log is the old one's
            self.current[name].events += self.followers[name].new_events()
        inst = Instance(name, cause, self.swarm.start_peer(name), time.time(), time.time())
        self.current[name] = inst
        self.instances.append(inst)
        self.followers.setdefault(name, EventFollower(self.out / f"{name}.jsonl"))
        return inst

    def live(self) -> list[Instance]:
        """Running peers the soak has not asked to stop (paused ones included)."""
        return [i for i in self.current.values() if i.code is None and not i.stop and i.cause != "bootstrap"]

    def run(self) -> None:
        """Start the swarm, fire the schedule until the time is up, then stop everything cleanly."""
        self.start_bootstrap()
        for i in range(self.args.peers):
            self.start_peer(f"peer-{i}", "initial")
        deadline, next_at, status_at = self.t0 + 60 * self.args.minutes, self.rng.randint(*EVERY_ROUNDS), 0.0
        while time.time() < deadline:
            self.poll()
            if self.swarm_round >= next_at:
                self.fire()
                next_at = self.swarm_round + self.rng.randint(*EVERY_ROUNDS)
            if time.time() > status_at:
                self._note(f"{len(self.live())} live peers; logs in {self.out}/")
                status_at = time.time() + 60
            time.sleep(1.0)
        self.finish()

    def poll(self) -> None:
        """Read new events, record the process trees, check exits, overdue stops, pauses and silence."""
        now = time.time()
        self._record_tree()
        for name, follower in self.followers.items():
            new = follower.new_events()
            if new:
                self.current[name].events += new
                self.current[name].last_seen = now
                self.swarm_round = max([self.swarm_round, *(e["round"] for e in new if e["event"] == "round")])
        for inst in self.current.values():
            self._check(inst, now)

    def _check(self, inst: Instance, now: float) -> None:
        if inst.code is None and inst.proc.poll() is not None:
            inst.code = inst.proc.returncode
            expected = -signal.SIGKILL if inst.stop in ("kill", "stuck") else 0
            if not inst.stop or inst.code != expected:
                self.crashes.append(self._record(inst, code=inst.code, stopped_by=inst.stop or None))
                self._note(f"CRASH {inst.name} (pid {inst.proc.pid}) exited {inst.code}")
        if inst.code is not None:
            return
        if inst.stop in ("term", "final") and now - inst.stop_sent > GRACE + STOP_SLACK:
            self._stuck(inst, f"still running {now - inst.stop_sent:.0f}s after SIGTERM (run.shutdown_grace {GRACE:g})")
            inst.stop = "stuck"
            os.killpg(inst.proc.pid, signal.SIGKILL)  # not reaped yet: the group is still ours
        if inst.paused_until and now >= inst.paused_until:
            _signal_tree(inst.proc.pid, signal.SIGCONT)
            inst.paused_until, inst.last_seen = 0.0, now
        if not (inst.stop or inst.paused_until) and now - inst.last_seen > SILENT_SECONDS:
            self._stuck(inst, f"no event for {now - inst.last_seen:.0f}s")
            inst.last_seen = float("inf")  # reported once (until its next event)

    def _record(self, inst: Instance, **what) -> dict:
        """A crash or a stuck process, for the report: which, when, its last event and log lines."""
        log = (self.out / f"{inst.name}.log").read_text(errors="replace").splitlines()  # created when it started
        return {"name": inst.name, "pid": inst.proc.pid, "at": round(time.time() - self.t0, 1), **what,
                "last_event": inst.events[-1] if inst.events else None, "log_tail": "\n".join(log[-20:])}

    def _stuck(self, inst: Instance, why: str) -> None:
        self.stuck.append(self._record(inst, why=why))
        self._note(f"STUCK {inst.name} (pid {inst.proc.pid}): {why}")

    def _record_tree(self) -> None:
        """Add every process now under one of ours to ``tree`` (a killed peer's children are re-parented later)."""
        roots = {i.proc.pid: i.name for i in self.instances if i.code is None}
        info, children = {}, {}
        for p in psutil.process_iter(["pid", "ppid", "name", "cmdline", "create_time"]):
            info[p.info["pid"]] = p.info
            children.setdefault(p.info["ppid"], []).append(p.info["pid"])
        for root, owner in roots.items():
            stack = [root]
            while stack:
                pid = stack.pop()
                if pid in info and pid not in self.tree:
                    self.tree[pid] = {"pid": pid, "owner": owner, "kind": _kind(info[pid], pid == root),
                                      "create_time": info[pid]["create_time"]}
                stack += children.get(pid, [])

    def _alive_tree(self) -> list[dict]:
        """The recorded processes still running (same pid and start time; zombies do not count)."""
        alive = []
        for entry in self.tree.values():
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(entry["pid"])
                if p.create_time() == entry["create_time"] and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(entry)
        return alive

    def fire(self) -> None:
        """One event of the schedule, among those that keep the live count within 2..N+2."""
        live = self.live()
        active = sorted(i.name for i in live if not i.paused_until)
        dead = sorted(n for n, i in self.current.items() if i.code is not None and n != "bootstrap")
        room = len(live) < self.args.peers + 2
        options = {"kill": active if len(live) > 2 else [], "term": active if len(live) > 2 else [],
                   "restart": dead if room else [], "join": [f"peer-{len(self.current) - 1}"] if room else [],
                   "pause": active if len(active) == len(live) else []}  # one straggler at a time
        # every kind in turn, in a seeded order (a short soak sees each); one that cannot fire now waits. Some kind
        # always can: a join while there is room, else a kill (N + 2 >= 4 peers, at most one of them paused)
        if not any(options[a] for a in self.bag):
            self.bag += self.rng.sample(list(options), len(options))
        action = next(a for a in self.bag if options[a])
        self.bag.remove(action)
        name = self.rng.choice(options[action])
        record = {"at": round(time.time() - self.t0, 1), "round": self.swarm_round, "action": action, "peer": name}
        if action in ("restart", "join"):
            record["pid"] = self.start_peer(name, action).proc.pid
        else:
            inst = self.current[name]
            record["pid"] = inst.proc.pid
            if action == "pause":
                record["seconds"] = round(self.rng.uniform(*PAUSE_SECONDS), 1)
                inst.paused_until = time.time() + record["seconds"]
                _signal_tree(inst.proc.pid, signal.SIGSTOP)  # a frozen machine: the peer and its children
            else:
                self._record_tree()  # its children, before a SIGKILL re-parents them
                inst.stop, inst.stop_sent = action, time.time()
                inst.proc.send_signal(signal.SIGKILL if action == "kill" else signal.SIGTERM)
        self.schedule.append(record)
        self._note(f"{action} {name} (pid {record['pid']})" + (f" for {record.get('seconds')}s" * (action == "pause")))

    def finish(self) -> None:
        """End the pauses, let the swarm settle a few rounds, SIGTERM every live peer, then the bootstrap."""
        for inst in (i for i in self.live() if i.paused_until):
            inst.paused_until = time.time()
        target, deadline = self.swarm_round + SETTLE_ROUNDS, time.time() + SETTLE_SECONDS
        self._note(f"time is up: settling until every live peer finished round {target}")
        while time.time() < deadline and any(max([0, *(e["round"] for e in i.rounds())]) < target
                                             for i in self.live()):
            self.poll()
            time.sleep(1.0)
        final = self.live()
        self._note(f"stopping {len(final)} peers with SIGTERM: {', '.join(i.name for i in final)}")
        for group in (final, [self.current["bootstrap"]]):
            for inst in group:
                if inst.code is None:
                    inst.stop, inst.stop_sent = "final", time.time()
                    inst.proc.send_signal(signal.SIGTERM)
            while any(i.code is None for i in self.current.values() if i.cause != "bootstrap" or i in group):
                self.poll()  # a stop that overruns is stuck, then SIGKILLed: this ends
                time.sleep(0.5)
        self.poll()  # the last events
        time.sleep(5.0)  # a killed peer's reaper checks twice a second; p2pd exits when its owner does
        self.orphans = self._alive_tree()

    def cleanup(self) -> None:
        """Kill whatever this soak started that still runs: the process trees and groups of the swarm's processes
        (``LocalSwarm.kill``, ``reap``), then the recorded pids (children of a peer killed earlier, re-parented)."""
        self.swarm.kill()
        for entry in self._alive_tree():
            with contextlib.suppress(psutil.Error):
                psutil.Process(entry["pid"]).kill()
        self.swarm.reap()

    def result(self) -> dict:
        """The soak's figures (see the module docstring)."""
        outcomes = Counter(e["outcome"] for i in self.instances for e in i.rounds())
        final = final_identity([i for i in self.instances if i.stop == "final" and i.cause != "bootstrap"])
        result = {"settings": {"peers": self.args.peers, "minutes": self.args.minutes, "seed": self.args.seed,
                               "quick": self.args.quick, "shutdown_grace": GRACE, "set": SETTINGS},
                  "seconds": round(time.time() - self.t0, 1), "last_round": self.swarm_round,
                  "events": dict(Counter(r["action"] for r in self.schedule)),
                  "rounds": {k: outcomes.get(k, 0) for k in ("averaged", "solo", "failed")},
                  "survivor_crashes": self.crashes, "back_in_step": back_in_step(self.instances), "stuck": self.stuck,
                  "orphans": self.orphans, "processes_recorded": len(self.tree), "final": final,
                  "schedule": self.schedule}
        # the bar of issue 15: no survivor crash, nothing stuck, no orphan, identical replicas at the end
        result["passed"] = not (self.crashes or self.stuck or self.orphans) and final["identical"]
        return result


def back_in_step(instances: list[Instance]) -> list[dict]:
    """For each restart and join: seconds from its start to its first round in step with the others' majority."""
    by_round: dict[int, list[tuple[str, str]]] = {}
    for inst in instances:
        for e in inst.rounds():
            by_round.setdefault(e["round"], []).append((inst.name, e["param_sha256"]))
    out = []
    for inst in (i for i in instances if i.cause in ("restart", "join")):
        record = {"peer": inst.name, "cause": inst.cause, "pid": inst.proc.pid, "seconds": None, "round": None,
                  "resumed_from": next((e.get("resumed_from") for e in inst.events if e["event"] == "start"), None),
                  "ended_by": inst.stop or None}
        for e in inst.rounds():
            others = Counter(h for name, h in by_round[e["round"]] if name != inst.name)
            if others and others.most_common(1)[0][0] == e["param_sha256"]:
                record["seconds"], record["round"] = round(e["time"] - inst.started, 1), e["round"]
                break
        out.append(record)
    return out


def final_identity(final: list[Instance]) -> dict:
    """The peers stopped at the end: their weights at the last round all of them finished."""
    hashes = {i.name: {e["round"]: e["param_sha256"] for e in i.rounds()} for i in final}
    common = set.intersection(*(set(h) for h in hashes.values())) if hashes else set()
    last = max(common, default=None)
    at_last = {name: h[last] for name, h in hashes.items()} if last is not None else {}
    return {"peers": sorted(hashes), "round": last, "last_rounds": {n: max(h, default=None) for n, h in hashes.items()},
            "param_sha256": at_last, "identical": bool(final) and len(set(at_last.values())) == 1}


def print_summary(result: dict) -> None:
    """The figures in a few lines."""
    s, r, final = result["settings"], result["rounds"], result["final"]
    print(f"\nsoak: {s['peers']} peers, {result['seconds'] / 60:.1f} min, seed {s['seed']}, {result['last_round']} "
          f"swarm rounds; events {result['events']}\nrounds of all peers: {r['averaged']} averaged "
          f"({r['averaged'] / (sum(r.values()) or 1):.0%}), {r['solo']} solo, {r['failed']} failed")
    for cause in ("restart", "join"):
        rows = [b for b in result["back_in_step"] if b["cause"] == cause]
        seconds = [b["seconds"] for b in rows if b["seconds"] is not None]
        never = [f"{b['peer']} (pid {b['pid']}, ended by {b['ended_by']})" for b in rows if b["seconds"] is None]
        print(f"back in step after a {cause}: {len(seconds)}/{len(rows)}"
              + (f", median {statistics.median(seconds):.1f}s, max {max(seconds):.1f}s" if seconds else "")
              + (f"; never: {', '.join(never)}" if never else ""))
    for label, items in (("survivor crashes", result["survivor_crashes"]), ("stuck", result["stuck"])):
        print(f"{label}: {len(items)}" + "".join(f"\n  {x['name']} pid {x['pid']}: {x.get('why', x.get('code'))}"
                                                 for x in items))
    print(f"orphans: {len(result['orphans'])} of {result['processes_recorded']} processes recorded"
          + "".join(f"\n  pid {o['pid']} {o['kind']} of {o['owner']}" for o in result["orphans"]))
    print(f"identical at the end: {'yes' if final['identical'] else 'NO'} ({len(final['peers'])} peers at round "
          f"{final['round']}; last rounds {final['last_rounds']})\nsoak: {'PASSED' if result['passed'] else 'FAILED'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=5, choices=range(2, 33), metavar="N", help="default 5")
    parser.add_argument("--minutes", type=float, default=None, help="how long the schedule runs (default 30)")
    parser.add_argument("--quick", action="store_true", help="5 minutes (unless --minutes says otherwise)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random schedule (default 0)")
    parser.add_argument("--out", default="runs/soak", help="logs, event logs and checkpoints (default runs/soak)")
    parser.add_argument("--json", default="", metavar="PATH", help="also write the figures there as JSON")
    args = parser.parse_args()
    args.minutes = args.minutes or (5.0 if args.quick else 30.0)
    out = Path(args.out).resolve()
    if out.is_dir() and any(out.iterdir()) and not (out / "bootstrap.log").exists():
        parser.error(f"--out {out} holds files of something other than a soak (they would be deleted): "
                     f"give a new or empty directory")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # stopped from outside: the finally below still cleans up
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    soak = Soak(args, out)
    try:
        soak.run()
    except KeyboardInterrupt:
        print("soak: interrupted; killing every process it started", file=sys.stderr)
        return 130
    finally:
        soak.cleanup()
    result = soak.result()
    print_summary(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
