"""``diloco-peer demo``: a whole swarm on this machine, as real processes, with a summary at the end.

    diloco-peer demo --peers 3 --rounds 5 --summary-json runs/demo/summary.json

It starts one bootstrap node and N peers, each exactly what ``diloco-peer bootstrap`` / ``join`` run,
talking over loopback. Peers get distinct data shards and leave by themselves after ``--rounds`` outer
rounds (``run.max_rounds``); the demo follows their event logs for live progress, then stops the
bootstrap, prints a per-round table, writes ``summary.json`` and ``loss.png`` into ``--out``.

With ``--nat`` (root: network namespaces) the machine becomes an emulated internet (``netbed.py``): the
bootstrap on a "public" network, each peer in its own home behind its own NAT router, so every peer finds
out it cannot be dialed and trains through the bootstrap as a relay (``reachability.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from .churn import ChurnAction, due, effects, parse_churn
from ..config import ConfigError, PeerConfig, load_config
from ..observe.events import EventFollower, read_events
from .netbed import EmulatedInternet, available
from ..observe.report import format_table, plot_losses, summarize

POLL_SECONDS = 0.5


def _python_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "diloco_peer", *args]


def _stop(proc: subprocess.Popen, grace: float = 15.0) -> int | None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def _wait_for_join_line(log: Path, proc: subprocess.Popen, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith("diloco-peer join "):
                return line.split()[2]
        if proc.poll() is not None:
            raise RuntimeError(f"the bootstrap node exited with code {proc.returncode}; see {log}")
        time.sleep(0.2)
    raise RuntimeError(f"the bootstrap node printed no join address within {timeout:.0f}s; see {log}")


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


class _Progress:
    """A tqdm bar on a terminal; plain lines, one per finished round, when output goes to a file.

    A round's line is printed once as many peers reported it as are running (with churn, a peer that
    joins or leaves mid-round may leave a round without its line; the final table has them all)."""

    def __init__(self, peers: int, rounds: int):
        self.peers, self.rounds = peers, rounds
        self.bar = tqdm(total=peers * rounds, unit="round", desc="swarm", disable=not sys.stderr.isatty())
        self.seen: dict[int, list[dict]] = {}

    def update(self, new_rounds: list[dict], live: int) -> None:
        for r in new_rounds:
            self.seen.setdefault(r["round"], []).append(r)
            self.bar.update(1)
            self.bar.set_postfix(round=r["round"], eval_loss=f"{r['eval_loss']:.3f}", group=r["group_size"])
            rows = self.seen[r["round"]]
            if self.bar.disable and len(rows) == max(live, 1):
                averaged = sum(x["outcome"] == "averaged" for x in rows)
                print(f"round {r['round']}/{self.rounds}: {averaged}/{len(rows)} peers averaged, groups "
                      f"{sorted({x['group_size'] for x in rows})}, eval loss {r['eval_loss']:.4f}", flush=True)

    def note(self, line: str) -> None:
        self.bar.write(line) if not self.bar.disable else print(line, flush=True)

    def close(self) -> None:
        self.bar.close()


def check_args(args) -> tuple[PeerConfig, list[ChurnAction]]:
    """The demo's config and churn schedule; a bad argument is a one-line ConfigError, before anything starts."""
    if args.peers < 1 or args.rounds < 1:
        raise ConfigError(f"--peers ({args.peers}) and --rounds ({args.rounds}) must be >= 1")
    cfg = load_config(args.config, args.overrides)
    actions = parse_churn(args.churn or "", args.peers, args.rounds)
    joiners = sum(a.count for a in actions if a.action == "join")
    last_port = args.metrics_port_base + args.peers + joiners
    if args.metrics_port_base and not 1024 <= args.metrics_port_base <= last_port <= 65535:
        raise ConfigError(f"--metrics-port-base {args.metrics_port_base} needs ports up to {last_port} "
                          f"(bootstrap + {args.peers + joiners} peers): pick a base from 1024 to "
                          f"{65535 - args.peers - joiners}")
    if args.nat:
        why = available() or ("" if shutil.which("iptables") else "iptables (Debian package iptables) is missing")
        if why:
            raise ConfigError(f"--nat cannot emulate home routers here: {why}; run the demo as root on Linux "
                              f"with iproute2 and iptables, or drop --nat")
        if args.metrics_port_base:
            raise ConfigError("--nat and --metrics-port-base do not go together: each peer's metrics port would "
                              "be inside its own network namespace; drop one of them")
    out = Path(args.out)
    # the demo empties --out of its old logs and keys: never a directory that some other program's files are in
    try:
        foreign = out.is_dir() and any(out.iterdir()) and not (out / "bootstrap.log").exists()
    except OSError as e:
        raise ConfigError(f"--out {out} cannot be used ({e.strerror}): choose another directory") from None
    if foreign:
        raise ConfigError(f"--out {out} holds files of something other than a demo (they would be deleted): "
                          f"give a new or empty directory")
    return cfg, actions


def run_demo(args) -> int:
    cfg, actions = check_args(args)
    out = Path(args.out)
    if out.exists():
        for old in [*out.glob("*.jsonl"), *out.glob("*.log"), *out.glob("*.key")]:
            old.unlink()
        shutil.rmtree(out / "checkpoints", ignore_errors=True)  # a demo starts from scratch
    out.mkdir(parents=True, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // args.peers)
    started = time.monotonic()
    boot_log = out / "bootstrap.log"
    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Path] = {}
    removed: set[str] = set()  # peers the churn schedule killed or stopped
    print(f"demo: 1 bootstrap + {args.peers} peers, {args.rounds} outer rounds of H={cfg.outer.inner_steps} inner "
          f"steps, config {args.config or 'tiny-cpu'}; logs in {out}/", flush=True)
    net = None
    if args.nat:  # one home per peer, joiners of the churn schedule included
        net = EmulatedInternet(args.peers + sum(a.count for a in actions if a.action == "join")).__enter__()
        print(f"demo: emulated internet: bootstrap on the public network at {net.public_address}, each peer "
              f"behind its own NAT router (no port forwarding)", flush=True)

    def where(i: int | None, cmd: list[str]) -> list[str]:  # peer i's home (None: the public network)
        return cmd if net is None else net.command(net.public if i is None else net.home(i + 1), cmd)

    listen = f"/ip4/{net.public_address}/tcp/31337" if net else "/ip4/127.0.0.1/tcp/0"
    with boot_log.open("w") as boot_out:
        bootstrap = subprocess.Popen(
            where(None, _python_cmd("bootstrap", "--listen", listen, "--run-id", cfg.run.run_id, "--report-every",
                                    "10", *(["--metrics-port", str(args.metrics_port_base)]
                                            if args.metrics_port_base else []))),
            stdout=boot_out, stderr=subprocess.STDOUT,
        )

    def start_peer(index: int) -> None:
        name = f"peer-{index}"
        # one shard per peer: each reads 1/N of the corpus rather than 1/64th of it
        sets = [f"data.num_shards={args.peers}", f"data.shard={index % args.peers}", f"run.threads={threads}",
                f"averaging.min_peers={args.peers}", *args.overrides,
                f"run.max_rounds={args.rounds}", f"run.log_dir={json.dumps(str(out))}",
                f"checkpoint.dir={json.dumps(str(out / 'checkpoints'))}"]
        if args.metrics_port_base:
            sets.append(f"metrics.port={args.metrics_port_base + 1 + index}")
        cmd = _python_cmd("join", address, "--name", name, *(["--config", args.config] if args.config else []))
        for item in sets:
            cmd += ["--set", item]
        with (out / f"{name}.log").open("w") as peer_out:
            procs[name] = subprocess.Popen(where(index, cmd), stdout=peer_out, stderr=subprocess.STDOUT)
        logs[name] = out / f"{name}.jsonl"
        followers.append(EventFollower(logs[name]))

    def fire(action: ChurnAction) -> None:
        action.fired_seconds = time.monotonic() - started
        if action.action == "join":
            for _ in range(action.count):
                start_peer(len(procs))
                action.peers.append(f"peer-{len(procs) - 1}")
        else:
            # the highest-numbered running peers of those started at the beginning and already training
            # (joiners only when no such peer is left: removing a newcomer shows nothing)
            running = [n for n in procs if n not in removed and procs[n].poll() is None]
            ranked = sorted(running, key=lambda n: (int(n.split("-")[1]) < args.peers, n in contributed,
                                                    int(n.split("-")[1])))
            action.peers = ranked[-action.count:]
            for name in action.peers:
                procs[name].send_signal(signal.SIGKILL if action.action == "kill" else signal.SIGTERM)
                removed.add(name)
        progress.note(f"churn {action.spec}: {action.action} {', '.join(action.peers)}")

    followers: list[EventFollower] = []
    averaging_epochs: set[int] = set()
    contributed: set[str] = set()
    try:
        address = _wait_for_join_line(boot_log, bootstrap)
        print(f"demo: bootstrap node at {address}", flush=True)
        if args.metrics_port_base:
            print(f"demo: metrics on http://127.0.0.1:{args.metrics_port_base}/metrics (swarm) and ports "
                  f"{args.metrics_port_base + 1}.. (peer i on {args.metrics_port_base}+1+i)", flush=True)
        for i in range(args.peers):
            start_peer(i)
        progress = _Progress(args.peers, args.rounds)
        while True:
            for follower in list(followers):
                new = follower.new_events()
                averaging_epochs.update(e["epoch"] for e in new if e["event"] == "averaging")
                contributed.update(e["peer"] for e in new if e["event"] == "round")
                progress.update([e for e in new if e["event"] == "round"],
                                live=sum(n not in removed and p.poll() is None for n, p in procs.items()))
            for action in due(actions, averaging_epochs):
                fire(action)
            failed = {n: p.returncode for n, p in procs.items() if p.poll() not in (None, 0) and n not in removed}
            if failed:
                name, code = next(iter(failed.items()))
                progress.close()
                print(f"demo: {name} exited with code {code}; its last log lines:\n{_tail(out / f'{name}.log')}",
                      file=sys.stderr)
                return 1
            if all(p.poll() is not None for p in procs.values()) and all(a.fired_seconds for a in actions):
                break
            if all(p.poll() is not None for p in procs.values()):
                missed = ", ".join(a.spec for a in actions if a.fired_seconds is None)
                print(f"demo: the swarm finished before churn items {missed} could fire", file=sys.stderr)
                break
            if time.monotonic() - started > args.timeout:
                progress.close()
                print(f"demo: the swarm did not finish within --timeout {args.timeout:.0f}s; logs in {out}/",
                      file=sys.stderr)
                return 1
            time.sleep(POLL_SECONDS)
        progress.close()
    except KeyboardInterrupt:
        print("demo: interrupted, stopping the swarm", file=sys.stderr)
        return 130
    finally:
        for proc in [*procs.values(), bootstrap]:
            _stop(proc)
        if net is not None:
            net.close()

    exit_codes = {n: p.returncode for n, p in procs.items()}
    finishers = [n for n in logs if n not in removed]
    summary = summarize(logs, time.monotonic() - started, exit_codes, finishers)
    summary["config"] = args.config or "tiny-cpu"
    summary["reachability"] = {n: [e["mode"] for e in read_events(p) if e["event"] == "reachability"]
                               for n, p in logs.items() if p.exists()}
    if actions:
        summary["churn"] = effects(actions, {n: list(read_events(p)) for n, p in logs.items()}, exit_codes)
    summary_path = Path(args.summary_json) if args.summary_json else out / "summary.json"
    summary_path.parent.mkdir(parents=True, exist_ok=True)
    summary_path.write_text(json.dumps(summary, indent=2))
    png = plot_losses(logs, out / "loss.png")
    print(format_table(summary))
    for record in summary.get("churn", []):
        print(f"churn {record['spec']}: {_describe(record)}")
    print("reachability: " + ", ".join(f"{n} {' -> '.join(modes) or '?'}"
                                       for n, modes in summary["reachability"].items()))
    print(f"demo: summary in {summary_path}, loss curves in {png}")
    return 0 if summary["rounds_completed"] == args.rounds else 1


def _describe(record: dict) -> str:
    if record["action"] == "join":
        parts = []
        for name, j in record["joiners"].items():
            synced = (f"synced epoch {j['synced_epoch']} in {j['sync_seconds']:.2f}s" if j["synced_epoch"] is not None
                      else "no state sync needed")
            first = j["first_contribution_seconds"]
            parts.append(f"{name} {synced}, first contribution {first:.1f}s after start" if first is not None
                         else f"{name} {synced}, never contributed")
            parts[-1] += ", identical at the end" if j["identical_at_end"] else ", NOT identical at the end"
        return "; ".join(parts)
    survivors = record["survivors_round"]
    how = "left cleanly" if record["left_cleanly"] else f"exit codes {record['exit_codes']}"
    return (f"{', '.join(record['peers'])} {how}; round {record['round']} for the others: "
            f"{survivors['outcomes']}, groups {survivors['group_sizes']}, "
            f"{'identical' if survivors['identical'] else 'NOT identical'}")
