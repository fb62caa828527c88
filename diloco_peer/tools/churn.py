"""A churn schedule for ``diloco-peer demo``: kill, stop and add peers at chosen rounds, then report the effect.

    diloco-peer demo --peers 5 --rounds 8 --churn "kill:2@round2,join:1@round3,term:1@round4"

Each item is ``ACTION:COUNT@roundR``:

- ``kill``: SIGKILL COUNT peers (a crash: no goodbye, no checkpoint, nothing withdrawn);
- ``term``: SIGTERM COUNT peers (a graceful leave: checkpoint, withdraw, exit 0);
- ``join``: start COUNT new peers; they download the swarm's state and train with it.

An item fires the moment the first peer begins the averaging of round R (its ``averaging`` event), so a
kill lands in the middle of that round's matchmaking and all-reduce. ``kill`` and ``term`` pick the
highest-numbered peers still running among those started at the beginning (joiners last). After the
run, each item's *effect* is read back from the event logs: how the survivors' round went, whether the
leavers exited cleanly, how fast a joiner synced and contributed, and whether everybody ended with the
same weights. A leave's survivors are the peers that had finished a round before it: a newcomer whose first round is
the leave's is reported as a joiner, not a survivor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..config import ConfigError

_ITEM = re.compile(r"^(kill|term|join):(\d+)@round(\d+)$")


@dataclass
class ChurnAction:
    """One item of a churn schedule (``kill:2@round2``): what to do to how many peers at which round."""

    spec: str
    action: str
    count: int
    round: int
    peers: list[str] = field(default_factory=list)
    """Who was killed, stopped or started, once fired."""
    fired_seconds: float | None = None
    """Seconds after the demo started."""


def parse_churn(text: str, peers: int, rounds: int) -> list[ChurnAction]:
    """``"kill:2@round2,join:1@round3"`` -> actions in firing order; a bad item is a one-line ConfigError."""
    actions = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        match = _ITEM.match(item)
        if not match:
            raise ConfigError(f"bad --churn item '{item}': expected ACTION:COUNT@roundR with ACTION kill, term or "
                              f"join, e.g. kill:2@round2")
        action = match.group(1)
        count = int(match.group(2))
        rnd = int(match.group(3))
        if count < 1 or not 1 <= rnd <= rounds:
            raise ConfigError(f"bad --churn item '{item}': COUNT must be >= 1 and R within 1..{rounds} (--rounds)")
        actions.append(ChurnAction(item, action, count, rnd))
    actions.sort(key=lambda a: a.round)
    alive = peers
    for a in actions:
        alive += a.count if a.action == "join" else -a.count
        if alive < 1:
            raise ConfigError(f"--churn '{text}' leaves no peer running after '{a.spec}': remove fewer peers")
    return actions


def due(actions: list[ChurnAction], averaging_epochs: set[int]) -> list[ChurnAction]:
    """Actions not fired yet whose round has begun averaging (epoch R-1 seen in an ``averaging`` event)."""
    return [a for a in actions if a.fired_seconds is None and (a.round - 1) in averaging_epochs]


def effects(actions: list[ChurnAction], events: dict[str, list[dict]], exit_codes: dict[str, int | None]) -> list:
    """What each action did, read back from the peers' event logs (the summary's ``churn`` list)."""
    final = {}
    for name, log in events.items():
        rounds = [e for e in log if e["event"] == "round"]
        if rounds:
            final[name] = rounds[-1]
    last_round = max((r["round"] for r in final.values()), default=0)
    end_hashes = {r["param_sha256"] for r in final.values() if r["round"] == last_round}
    out = []
    for a in actions:
        record = {"spec": a.spec, "action": a.action, "round": a.round, "peers": a.peers,
                  "fired_seconds": a.fired_seconds}
        if a.action in ("kill", "term"):
            # the survivors: peers that had finished a round in the leavers' swarm before, not a newcomer whose
            # first round this is (it synced into the middle of the round: its outcome says how it joined, not how
            # the swarm took the leave; the join's own record reports it)
            survivors = [n for n in events if n not in a.peers
                         and any(e["event"] == "round" and e["round"] < a.round for e in events[n])]
            same_round = [e for n in survivors for e in events[n] if e["event"] == "round" and e["round"] == a.round]
            record["exit_codes"] = {n: exit_codes.get(n) for n in a.peers}
            record["left_cleanly"] = all(exit_codes.get(n) == 0 and any(e["event"] == "stop" for e in events[n])
                                         for n in a.peers)
            record["survivors_round"] = {
                "outcomes": sorted(e["outcome"] for e in same_round),
                "group_sizes": sorted(e["group_size"] for e in same_round),
                "identical": len({e["param_sha256"] for e in same_round}) <= 1,
            }
        else:
            record["joiners"] = {}
            for n in a.peers:
                log = events.get(n, [])
                syncs = [e for e in log if e["event"] == "sync" and e["ok"]]
                first = next((e for e in log if e.get("first_contribution_seconds") is not None), None)
                record["joiners"][n] = {
                    "synced_epoch": syncs[0]["epoch"] if syncs else None,
                    "sync_seconds": syncs[0]["seconds"] if syncs else None,
                    "sync_bytes": syncs[0]["bytes"] if syncs else None,
                    "first_contribution_seconds": first["first_contribution_seconds"] if first else None,
                    "identical_at_end": n in final and final[n]["round"] == last_round
                    and len(end_hashes) == 1,
                }
        out.append(record)
    return out
