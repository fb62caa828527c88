"""``diloco-peer demo``: a whole swarm on this machine, as real processes, with a summary at the end.

    diloco-peer demo --peers 3 --rounds 5 --summary-json runs/demo/summary.json

It starts one bootstrap node and N peers, each exactly what ``diloco-peer bootstrap`` / ``join`` run,
talking over loopback (forked from a zygote that imported torch and hivemind once: ``zygote.py``). Peers get
distinct data shards and leave by themselves after ``--rounds`` outer rounds (``run.max_rounds``); the demo
follows their event logs for live progress, then stops the bootstrap, prints a per-round table, writes
``summary.json`` and ``loss.png`` into ``--out``.

Nothing it starts outlives it. SIGTERM, SIGINT or SIGHUP: it stops the swarm (``_DemoSwarm.stop``), removes
the NAT namespaces and exits 130; a second signal kills everything at once. If the demo is SIGKILLed, its
reaper (``reaper.py``) kills its processes and deletes the namespaces; theirs take their DHT and p2pd along.

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

from ..config import DEFAULT_CONFIG, ConfigError, PeerConfig, load_config
from ..lifecycle.reaper import Reaper
from ..observe.events import EventFollower, read_events
from ..observe.report import format_table, plot_losses, summarize
from .churn import ChurnAction, due, effects, parse_churn
from .local_swarm import LocalSwarm, tail
from .netbed import EmulatedInternet, available
from .zygote import Zygote

POLL_SECONDS = 0.5
STOP_MARGIN = 15.0  # seconds past the peers' run.shutdown_grace that stopping the whole swarm may take
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
EXIT_INTERRUPTED = 130  # cli.EXIT_INTERRUPTED: the demo was stopped by a signal before it finished


class Interrupted(Exception):
    """A stop signal (its name) reached the demo; raised where it polls, so the swarm stops from a known state."""


class _Progress:
    """A tqdm bar on a terminal; plain lines, one per finished round, when output goes to a file.

    A round's line is printed once as many peers reported it as are running (with churn, a peer that
    joins or leaves mid-round may leave a round without its line; the final table has them all)."""

    def __init__(self, peers: int, rounds: int):
        self.peers, self.rounds = peers, rounds
        self.bar = tqdm(total=peers * rounds, unit="round", desc="swarm", disable=not sys.stderr.isatty())
        self.seen: dict[int, list[dict]] = {}

    def update(self, new_rounds: list[dict], live: int) -> None:
        """Count peers' new ``round`` events; ``live`` is how many peers run now."""
        for r in new_rounds:
            self.seen.setdefault(r["round"], []).append(r)
            self.bar.update(1)
            self.bar.set_postfix(round=r["round"], eval_loss=_loss([r], ".3f"), group=r["group_size"])
            rows = self.seen[r["round"]]
            if self.bar.disable and len(rows) == max(live, 1):
                averaged = sum(x["outcome"] == "averaged" for x in rows)
                print(f"round {r['round']}/{self.rounds}: {averaged}/{len(rows)} peers averaged, groups "
                      f"{sorted({x['group_size'] for x in rows})}, eval loss {_loss(rows, '.4f')}", flush=True)

    def note(self, line: str) -> None:
        """Print a line without breaking the bar."""
        self.bar.write(line) if not self.bar.disable else print(line, flush=True)

    def close(self) -> None:
        """Close the bar (before lines that follow it)."""
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


class _DemoSwarm:
    """The demo's processes (a ``LocalSwarm`` in ``--out``): one bootstrap node and peers ``peer-0``, ``peer-1``,
    ... (each in its own home behind a NAT router with ``--nat``), and what the churn schedule did to them. As a
    context manager it owns their lifetime: the stop signals and the reaper are set up on entry; on exit every
    process is stopped."""

    def __init__(self, args, cfg: PeerConfig, out: Path):
        self.args, self.cfg, self.out = args, cfg, out
        self.started = time.monotonic()
        self.threads = max(1, (os.cpu_count() or 1) // args.peers)
        self.net: EmulatedInternet | None = None
        # each process in its own session: a terminal's Ctrl+C reaches it once, through the demo (a second signal
        # would make a peer exit at once, without its checkpoint); each watched by the reaper
        self.swarm = LocalSwarm(out, on_spawn=lambda proc: self.reaper.watch([proc.pid]), check=self.check)
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.followers: list[EventFollower] = []
        self.removed: set[str] = set()  # peers the churn schedule killed or stopped
        self.contributed: set[str] = set()  # peers that finished a round: the churn schedule removes them first
        self.signalled: int | None = None
        """The stop signal that reached the demo, if one did."""
        self.reaper: Reaper | None = None
        self._handlers: dict = {}

    def __enter__(self) -> _DemoSwarm:
        self.reaper = Reaper()  # if the demo is SIGKILLed, its processes and namespaces go with it
        self._handlers = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        self.swarm.zygote = self._zygote()
        return self

    def _zygote(self) -> Zygote | None:
        """A zygote (``zygote.py``) to fork the processes from: they start without importing torch and hivemind
        each; it exits with the demo (its stdin closes). None if it could not start: then they start fresh."""
        try:
            zygote = Zygote.start()
        except (OSError, RuntimeError) as e:
            print(f"demo: processes start fresh ({e})", file=sys.stderr, flush=True)
            return None
        self.reaper.watch([zygote.proc.pid])
        return zygote

    def __exit__(self, exc_type, exc, tb) -> None:
        if isinstance(exc, Interrupted):
            print(f"demo: interrupted ({exc}), stopping the swarm (a second signal kills it at once)",
                  file=sys.stderr, flush=True)
        try:
            self.stop()
        finally:  # the handlers stay until here: a second signal while stopping still kills everything
            if self.swarm.zygote is not None:
                self.swarm.zygote.close()
            self.reaper.close()
            for sig, handler in self._handlers.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame) -> None:
        if self.signalled is None:
            self.signalled = signum  # acted on where the demo waits (``check``), not at an arbitrary bytecode
            return
        self.swarm.kill()
        os._exit(EXIT_INTERRUPTED)  # the reaper, still watching, deletes the namespaces

    def check(self) -> None:
        """Raise ``Interrupted`` once a stop signal has come; called wherever the demo waits."""
        if self.signalled is not None:
            raise Interrupted(signal.Signals(self.signalled).name)

    def start(self, homes: int) -> None:
        """Build the emulated internet (``--nat``: ``homes`` homes), then start the bootstrap node and the peers."""
        if self.args.nat:
            net = EmulatedInternet(homes)
            self.reaper.watch_namespaces(net.namespaces())  # before they exist: none is left if we die meanwhile
            self.net = net.__enter__()
            print(f"demo: emulated internet: bootstrap on the public network at {self.net.public_address}, each "
                  f"peer behind its own NAT router (no port forwarding)", flush=True)
        self.start_bootstrap()
        for i in range(self.args.peers):
            self.start_peer(i)

    def _where(self, i: int | None) -> str:
        """The network namespace of peer i's home (None: of the public network), or "" without ``--nat``."""
        net = self.net
        return "" if net is None else net.public if i is None else net.home(i + 1)

    def start_bootstrap(self) -> None:
        """Start the bootstrap node and wait for the join address it prints."""
        args = self.args
        listen = f"/ip4/{self.net.public_address}/tcp/31337" if self.net else "/ip4/127.0.0.1/tcp/0"
        metrics = ["--metrics-port", str(args.metrics_port_base)] if args.metrics_port_base else []
        address = self.swarm.start_bootstrap("--run-id", self.cfg.run.run_id, "--report-every", "10", *metrics,
                                             listen=listen, netns=self._where(None))
        print(f"demo: bootstrap node at {address}", flush=True)
        if args.metrics_port_base:
            print(f"demo: metrics on http://127.0.0.1:{args.metrics_port_base}/metrics (swarm) and ports "
                  f"{args.metrics_port_base + 1}.. (peer i on {args.metrics_port_base}+1+i)", flush=True)

    def start_peer(self, index: int) -> None:
        """Start ``peer-<index>``: ``diloco-peer join`` with its own data shard, logs and metrics port."""
        args, out, name = self.args, self.out, f"peer-{index}"
        # one shard per peer: each reads 1/N of the corpus rather than 1/64th of it
        sets = [f"data.num_shards={args.peers}", f"data.shard={index % args.peers}", f"run.threads={self.threads}",
                f"averaging.min_peers={args.peers}", *args.overrides,
                f"run.max_rounds={args.rounds}", f"checkpoint.dir={json.dumps(str(out / 'checkpoints'))}"]
        if args.metrics_port_base:
            sets.append(f"metrics.port={args.metrics_port_base + 1 + index}")
        # the demo's config, named: a peer then looks for its owner's config record for run_config.WAIT_WITH_CONFIG
        # and, finding none, trains with its own, instead of giving up after run_config.WAIT (many peers starting on
        # a loaded machine read the record later than that, and left: BENCHMARKS.md, "Many peers")
        self.procs[name] = self.swarm.start_peer(name, *sets, netns=self._where(index),
                                                 args=["--config", args.config or DEFAULT_CONFIG])
        self.logs[name] = out / f"{name}.jsonl"  # (run.log_dir: the swarm's directory, --out)
        self.followers.append(EventFollower(self.logs[name]))

    def fire(self, action: ChurnAction) -> None:
        """Carry out one churn item: start new peers, or kill or stop running ones."""
        action.fired_seconds = time.monotonic() - self.started
        if action.action == "join":
            for _ in range(action.count):
                self.start_peer(len(self.procs))
                action.peers.append(f"peer-{len(self.procs) - 1}")
            return
        # the highest-numbered running peers of those started at the beginning and already training
        # (joiners only when no such peer is left: removing a newcomer shows nothing)
        running = [n for n in self.procs if n not in self.removed and self.procs[n].poll() is None]
        ranked = sorted(running, key=lambda n: (int(n.split("-")[1]) < self.args.peers, n in self.contributed,
                                                int(n.split("-")[1])))
        action.peers = ranked[-action.count:]
        for name in action.peers:
            self.procs[name].send_signal(signal.SIGKILL if action.action == "kill" else signal.SIGTERM)
            self.removed.add(name)

    def live(self) -> int:
        """How many peers are running, not counting those the churn schedule removed."""
        return sum(n not in self.removed and p.poll() is None for n, p in self.procs.items())

    def failed(self) -> dict[str, int]:
        """Peers that exited with an error, other than those the churn schedule removed: name -> exit code."""
        return {n: p.returncode for n, p in self.procs.items() if p.poll() not in (None, 0) and n not in self.removed}

    def finished(self) -> bool:
        """Whether every peer has exited."""
        return all(p.poll() is not None for p in self.procs.values())

    def stop(self) -> None:
        """Stop every process that still runs, the peers first, then the bootstrap node (their leave uses its
        DHT), with the signal that stopped the demo (SIGHUP as SIGTERM) or SIGTERM; SIGKILL what is left after
        the peers' ``run.shutdown_grace`` plus ``STOP_MARGIN``; then take the emulated internet down."""
        signum = signal.SIGINT if self.signalled == signal.SIGINT else signal.SIGTERM
        try:
            self.swarm.reap(signum, grace=self.cfg.run.shutdown_grace + STOP_MARGIN, peers_first=True,
                            until_gone=True)
        finally:
            if self.net is not None:
                self.net.close()


def _clear(out: Path) -> None:
    """Empty ``--out`` of an earlier demo's logs, keys and checkpoints: a demo starts from scratch."""
    if out.exists():
        for old in [*out.glob("*.jsonl"), *out.glob("*.log"), *out.glob("*.key")]:
            old.unlink()
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)


def _follow(swarm: _DemoSwarm, actions: list[ChurnAction], progress: _Progress) -> int | None:
    """Follow the peers' event logs until every peer has exited, showing progress and firing churn items as
    their rounds begin averaging; 1 once a peer failed or ``--timeout`` passed, None when the swarm is done."""
    args = swarm.args
    averaging_epochs: set[int] = set()
    while True:
        if swarm.signalled is not None:
            progress.close()
            swarm.check()
        for follower in list(swarm.followers):
            new = follower.new_events()
            averaging_epochs.update(e["epoch"] for e in new if e["event"] == "averaging")
            swarm.contributed.update(e["peer"] for e in new if e["event"] == "round")
            progress.update([e for e in new if e["event"] == "round"], live=swarm.live())
        for action in due(actions, averaging_epochs):
            swarm.fire(action)
            progress.note(f"churn {action.spec}: {action.action} {', '.join(action.peers)}")
        failed = swarm.failed()
        if failed:
            name, code = next(iter(failed.items()))
            progress.close()
            print(f"demo: {name} exited with code {code}; its last log lines:\n{tail(swarm.swarm.log(name), 15)}",
                  file=sys.stderr)
            return 1
        if swarm.finished() and all(a.fired_seconds for a in actions):
            break
        if swarm.finished():
            missed = ", ".join(a.spec for a in actions if a.fired_seconds is None)
            print(f"demo: the swarm finished before churn items {missed} could fire", file=sys.stderr)
            break
        if time.monotonic() - swarm.started > args.timeout:
            progress.close()
            print(f"demo: the swarm did not finish within --timeout {args.timeout:.0f}s; logs in {swarm.out}/",
                  file=sys.stderr)
            return 1
        time.sleep(POLL_SECONDS)
    progress.close()
    return None


def _report(args, swarm: _DemoSwarm, actions: list[ChurnAction]) -> int:
    """Summarise the finished swarm: write the summary JSON and the loss plot, print the per-round table,
    the churn items' effects and each peer's reachability; 0 if the swarm completed every round."""
    logs = swarm.logs
    exit_codes = {n: p.returncode for n, p in swarm.procs.items()}
    finishers = [n for n in logs if n not in swarm.removed]
    summary = summarize(logs, time.monotonic() - swarm.started, exit_codes, finishers)
    summary["config"] = args.config or "tiny-cpu"
    summary["reachability"] = {n: [e["mode"] for e in read_events(p) if e["event"] == "reachability"]
                               for n, p in logs.items() if p.exists()}
    if actions:
        summary["churn"] = effects(actions, {n: list(read_events(p)) for n, p in logs.items()}, exit_codes)
    summary_path = Path(args.summary_json) if args.summary_json else swarm.out / "summary.json"
    summary_path.parent.mkdir(parents=True, exist_ok=True)
    summary_path.write_text(json.dumps(summary, indent=2))
    png = plot_losses(logs, swarm.out / "loss.png")
    print(format_table(summary))
    for record in summary.get("churn", []):
        print(f"churn {record['spec']}: {_describe(record)}")
    print("reachability: " + ", ".join(f"{n} {' -> '.join(modes) or '?'}"
                                       for n, modes in summary["reachability"].items()))
    print(f"demo: summary in {summary_path}, loss curves in {png}")
    return 0 if summary["rounds_completed"] == args.rounds else 1


def run_demo(args) -> int:
    """``diloco-peer demo``: start the swarm, follow it to the end, stop what is left, report; the exit code."""
    cfg, actions = check_args(args)
    out = Path(args.out)
    _clear(out)
    print(f"demo: 1 bootstrap + {args.peers} peers, {args.rounds} outer rounds of H={cfg.outer.inner_steps} inner "
          f"steps, config {args.config or 'tiny-cpu'}; logs in {out}/", flush=True)
    try:
        # absolute: the swarm's processes run inside --out (LocalSwarm), so a relative --out handed to them as their
        # log and checkpoint directories would be read inside itself (runs/demo/runs/demo/peer-0.jsonl)
        with _DemoSwarm(args, cfg, out.absolute()) as swarm:
            swarm.start(homes=args.peers + sum(a.count for a in actions if a.action == "join"))  # joiners too
            failed = _follow(swarm, actions, _Progress(args.peers, args.rounds))
    except Interrupted:
        return EXIT_INTERRUPTED
    if swarm.signalled is not None:  # it came while the finished swarm was being stopped
        return EXIT_INTERRUPTED
    return failed if failed is not None else _report(args, swarm, actions)


def _describe(record: dict) -> str:
    """One churn item's effect (a record of ``churn.effects``) in one line."""
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


def _loss(rounds: list[dict], spec: str) -> str:
    """The eval loss of the first of these ``round`` events that has one, formatted as ``spec`` says ("-": none
    has; a peer that handed in leaves the eval to its group)."""
    loss = next((r["eval_loss"] for r in rounds if r.get("eval_loss") is not None), None)
    return format(loss, spec) if loss is not None else "-"
