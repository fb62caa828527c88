"""``diloco-peer``: the command line. Parse, validate, hand over; errors become one line and an exit code.

    diloco-peer bootstrap --identity ./boot.key --listen /ip4/0.0.0.0/tcp/31337
    diloco-peer join /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW... [--config tiny-cpu] [--set inner.lr=3e-4 ...]
    diloco-peer demo --peers 3 --rounds 5 [--config tiny-cpu] [--summary-json out.json] [--churn kill:1@round2]
    diloco-peer simulate --replicas 4 --rounds 10 [--codec int8] [--overlap delayed]

Exit codes (``EXIT_CODES``, also in ``--help`` and the README): 0 ok, 1 failed while running, 2 bad input
(command line, config, address, environment variable), 3 no bootstrap reachable, 130 interrupted. Every
error is one line on stderr, ``diloco-peer: error: ...``, naming the bad value and the fix.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
from pathlib import Path
from typing import NoReturn

from . import __version__

# Distinct, so that a supervisor (systemd, docker) can restart on 1 and 3 but not loop on 2.
EXIT_OK = 0
EXIT_RUNTIME = 1  # started, then failed: a crash, a demo peer that failed, no clean leave within shutdown_grace
EXIT_USAGE = 2  # bad input: argparse's own code too; retrying the same command cannot help
EXIT_UNREACHABLE = 3  # no bootstrap peer answered (within swarm.join_timeout): the swarm, maybe not the input
EXIT_INTERRUPTED = 130  # 128 + SIGINT: a second Ctrl+C or signal, or Ctrl+C during demo
EXIT_CODES = f"""exit codes:
  {EXIT_OK}    success
  {EXIT_RUNTIME}    failed while running (a crash, a demo peer that failed, no clean leave within run.shutdown_grace)
  {EXIT_USAGE}    bad input: command line, config file, --set, address, environment variable, checkpoint, data files
  {EXIT_UNREACHABLE}    no bootstrap peer reachable (within swarm.join_timeout): check the address, or retry later
  {EXIT_INTERRUPTED}  interrupted (a second Ctrl+C or SIGTERM)"""


SECRET_FILE_HELP = "file with the swarm secret (diloco-peer keygen --secret FILE): a closed swarm, see SECURITY.md"


class _Parser(argparse.ArgumentParser):
    """argparse with errors as one line, like every other error (argparse prints the usage block first)."""

    def error(self, message: str) -> NoReturn:
        print(f"diloco-peer: error: {' '.join(message.splitlines())} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def _quote(text: str) -> str:
    """A bad value as errors show it: quoted, and cut short if it is long."""
    return repr(text) if len(text) <= 60 else f"{text[:60]!r}... ({len(text)} characters)"


def _bounded(kind: type, low: float, *, above: bool = False, what: str):
    """An argparse type: a finite ``kind`` that is >= ``low`` (> with ``above``); nan and inf are refused."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value < low or (above and value == low):
            raise argparse.ArgumentTypeError(f"{_quote(text)} is not {what}")
        return value

    return parse


_COUNT = _bounded(int, 1, what="a whole number >= 1")
_STEPS = _bounded(int, 0, what="a whole number >= 0")
_SECONDS = _bounded(float, 0, above=True, what="a number of seconds > 0")
_SECONDS_OR_ZERO = _bounded(float, 0, what="a number of seconds >= 0")


def _name(text: str) -> str:
    """An argparse type for run ids and peer names: they become DHT keys and file names."""
    from .config import NAME_PATTERN

    if not re.fullmatch(NAME_PATTERN, text):
        raise argparse.ArgumentTypeError(f"{_quote(text)} is not a name: use 1-64 letters, digits, '_', '.' or '-', "
                                         f"starting with a letter or digit")
    return text


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, metavar="FILE|NAME",
                        help="TOML config: a file or a shipped name (tiny-cpu, llama-150m, llama-1b); default tiny-cpu")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config value, TOML syntax, e.g. --set inner.lr=3e-4 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="diloco-peer", description="Peer-to-peer DiLoCo training on hivemind.", epilog=EXIT_CODES,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging (hivemind included)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    boot = sub.add_parser("bootstrap", help="run a bootstrap node that peers dial first")
    boot.add_argument("--identity", default="", metavar="KEY_FILE",
                      help="private key file for a stable peer id, created if missing, e.g. ./boot.key")
    boot.add_argument("--listen", action="append", default=[], metavar="MULTIADDR",
                      help="listen address, e.g. /ip4/0.0.0.0/tcp/31337 (repeatable; default any port)")
    boot.add_argument("--announce", action="append", default=[], metavar="MULTIADDR",
                      help="address others should dial, e.g. /ip4/203.0.113.7/tcp/31337 (repeatable)")
    boot.add_argument("--initial-peer", action="append", default=[], metavar="MULTIADDR",
                      help="another bootstrap node to connect to (repeatable)")
    boot.add_argument("--run-id", type=_name, default="diloco-tiny", help="the run whose progress this node shows")
    boot.add_argument("--secret-file", default="", metavar="FILE", help=SECRET_FILE_HELP)
    boot.add_argument("--report-every", type=_SECONDS, default=30.0, metavar="SECONDS",
                      help="seconds between swarm summaries in the log (default 30)")

    boot.add_argument("--address-file", default="", metavar="PATH",
                      help="also write the join address to this file (for containers that start peers from it)")
    boot.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                      help="serve the swarm's Prometheus metrics and /healthz on this port (default 0: off)")
    boot.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                      help="interface for --metrics-port (default 127.0.0.1; 0.0.0.0 for a remote Prometheus)")

    keygen = sub.add_parser("keygen", help="create an identity key file (a stable peer id) and print its peer id, "
                                           "or with --secret a swarm secret")
    keygen.add_argument("path", nargs="?", metavar="KEY_FILE",
                        help="where to write the private key, e.g. ~/.diloco.key")
    keygen.add_argument("--secret", default="", metavar="SECRET_FILE",
                        help="instead, write a new random swarm secret (mode 0600) to share with the swarm's members")
    keygen.add_argument("--force", action="store_true", help="replace an existing file")

    status = sub.add_parser("status", help="print the swarm's peers, states, losses and throughput")
    status.add_argument("bootstrap", nargs="+", metavar="BOOTSTRAP_MULTIADDR", help="a bootstrap node's address")
    status.add_argument("--run-id", type=_name, default="diloco-tiny", help="the run to show (default diloco-tiny)")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.add_argument("--secret-file", default="", metavar="FILE", help=SECRET_FILE_HELP)
    status.add_argument("--wait", type=_SECONDS_OR_ZERO, default=10.0, metavar="SECONDS",
                        help="how long to look for records before reporting an empty swarm (default 10)")

    join = sub.add_parser("join", help="join a swarm and train")
    join.add_argument("bootstrap", nargs="+", metavar="BOOTSTRAP_MULTIADDR",
                      help="address printed by a bootstrap node, e.g. /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...")
    _add_config_args(join)
    join.add_argument("--identity", default=None, metavar="KEY_FILE",
                      help="private key file for a stable peer id (created if missing); sets swarm.identity_path")
    join.add_argument("--secret-file", default=None, metavar="FILE",
                      help="file with the swarm secret of a closed swarm; sets swarm.secret_file")
    join.add_argument("--name", type=_name, default=None,
                      help="name in logs and of the event file (default: from the peer id)")
    join.add_argument("--listen", action="append", default=None, metavar="MULTIADDR",
                      help="listen address, e.g. /ip4/0.0.0.0/tcp/40001 (repeatable); sets swarm.host_maddrs")
    join.add_argument("--announce", action="append", default=None, metavar="MULTIADDR",
                      help="address others should dial, e.g. your router's /ip4/203.0.113.7/tcp/40001 with that "
                           "port forwarded here (repeatable); sets swarm.announce_maddrs")
    join.add_argument("--reachability", choices=["auto", "direct", "relayed", "outbound-only"], default=None,
                      help="how others reach this peer (default auto: a bootstrap dials us back to find out)")
    join.add_argument("--relay", action="store_true",
                      help="when directly reachable, relay for peers behind NAT; sets swarm.relay_service")

    demo = sub.add_parser("demo", help="run a local swarm (bootstrap + N peers as subprocesses) and summarise it")
    _add_config_args(demo)
    demo.add_argument("--peers", type=_COUNT, default=3, help="number of peers (default 3)")
    demo.add_argument("--rounds", type=_COUNT, default=5, help="outer rounds each peer trains (default 5)")
    demo.add_argument("--out", default="runs/demo", metavar="DIR",
                      help="directory for logs, the summary and the loss plot (default runs/demo)")
    demo.add_argument("--summary-json", default=None, metavar="FILE", help="also write the summary JSON here")
    demo.add_argument("--churn", default="", metavar="SCHEDULE",
                      help='kill, stop and add peers during the run, e.g. "kill:2@round2,join:1@round3,term:1@round4" '
                           "(an item fires when round R begins averaging)")
    demo.add_argument("--metrics-port-base", type=int, default=0, metavar="P",
                      help="serve the bootstrap's metrics on port P and peer i's on P+1+i (default 0: none)")
    demo.add_argument("--nat", action="store_true",
                      help="run each peer behind its own emulated home router (NAT) and the bootstrap on an emulated "
                           "public network (needs root: network namespaces, iptables)")
    demo.add_argument("--timeout", type=_SECONDS, default=900.0, metavar="SECONDS",
                      help="give up if the swarm has not finished after this long (default 900)")
    plot = sub.add_parser("plot", help="plot loss and throughput from peers' event logs into a PNG")
    plot.add_argument("logs", nargs="+", metavar="LOG_OR_DIR", help="runs/<peer>.jsonl files, or directories of them")
    plot.add_argument("--out", default="plot.png", metavar="PNG", help="the PNG to write (default plot.png)")

    sim = sub.add_parser("simulate", help="K DiLoCo replicas in one process (no network) against the baselines")
    _add_config_args(sim)
    sim.add_argument("--replicas", type=_COUNT, default=4, help="K, the number of DiLoCo replicas (default 4)")
    sim.add_argument("--rounds", type=_COUNT, default=10, help="outer rounds of H inner steps (default 10)")
    sim.add_argument("--codec", default="none", choices=["none", "fp16", "bf16", "int8", "int4"],
                     help="pseudo-gradient codec on the (simulated) wire (default none)")
    sim.add_argument("--overlap", default="blocking", choices=["blocking", "delayed"],
                     help="blocking, or delayed: average round t while round t+1 trains (default blocking)")
    sim.add_argument("--error-feedback", action="store_true",
                     help="carry the codec's rounding error into the next round")
    sim.add_argument("--no-baselines", action="store_true", help="skip the single-replica and Kx-batch baselines")
    sim.add_argument("--pretrain", type=_STEPS, default=0, metavar="STEPS",
                     help="start every run from one replica trained this many steps, as the DiLoCo paper does "
                          "(default 0: from scratch)")
    sim.add_argument("--out", default="runs/simulate", metavar="DIR",
                     help="directory for simulate.json and eval_loss.png (default runs/simulate)")
    return parser


def _setup_logging(verbose: bool) -> None:
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "DEBUG" if verbose else "WARNING")
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", stream=sys.stdout)


def _check_can_create(path: str, what: str, *, directory: bool) -> None:
    """Fail now, in one line, where writing ``path`` would fail later: after minutes of work, or once the
    peer is in the swarm. Creates the directory (for a file: its parent), as the command would anyway."""
    from .config import ConfigError

    if "\x00" in path:
        raise ConfigError(f"{what} {_quote(path)} contains a NUL character: remove it")
    target = Path(path)
    try:
        if not directory and target.is_dir():
            raise ConfigError(f"{what} {_quote(path)} is a directory: give a file name")
        folder = target if directory else target.parent
        folder.mkdir(parents=True, exist_ok=True)
        writable = os.access(folder, os.W_OK | os.X_OK)
    except OSError as e:
        raise ConfigError(f"{what} {_quote(path)} cannot be created ({e.strerror}): choose another path") from None
    if not writable:
        raise ConfigError(f"{what} {_quote(path)} is not writable: choose another path")


def _check_peer(cfg) -> None:
    """What a peer dials, reads and writes, checked before it joins: the daemon would fail only once in the swarm."""
    from .swarm.addresses import check_identity, parse_multiaddr
    from .config import DataError

    for key in ("host_maddrs", "announce_maddrs", "relays"):
        for addr in getattr(cfg.swarm, key):
            parse_multiaddr(addr, need_peer_id=key == "relays", what=f"swarm.{key} address")
    if cfg.swarm.identity_path:
        check_identity(cfg.swarm.identity_path)
    _check_can_create(cfg.run.log_dir, "run.log_dir", directory=True)
    if cfg.checkpoint.dir:
        _check_can_create(cfg.checkpoint.dir, "checkpoint.dir", directory=True)
    for raw in cfg.data.paths if cfg.data.source == "files" else []:
        try:
            found = Path(raw).is_file()
        except OSError:  # e.g. a name too long for the file system
            found = False
        if not found:
            raise DataError(f"data file {_quote(raw)} does not exist: fix data.paths")


def _run(args: argparse.Namespace) -> int:
    # heavy imports (torch, hivemind) only once the command line is checked: a typo is a one-line error at once
    import uvloop
    from pydantic import ValidationError

    from .swarm.addresses import check_identity, parse_multiaddr
    from .config import ConfigError, MetricsConfig, load_config

    if args.command == "bootstrap":
        # all checked before the DHT starts: a bad address or path is one line, with nothing to tear down
        for flag, addrs in (("--listen", args.listen), ("--announce", args.announce)):
            for addr in addrs:
                parse_multiaddr(addr, need_peer_id=False, what=f"{flag} address")
        for addr in args.initial_peer:
            parse_multiaddr(addr, need_peer_id=True, what="--initial-peer address")
        if not 0 <= args.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port {args.metrics_port} is not a TCP port: use 1-65535, or 0 for none")
        try:
            metrics = MetricsConfig(port=args.metrics_port, host=args.metrics_host)
        except ValidationError as e:
            reason = e.errors()[0]["msg"].removeprefix("Value error, ")
            raise ConfigError(f"bad --metrics-host {_quote(args.metrics_host)}: {reason}") from None
        if args.identity:
            check_identity(args.identity)
        if args.address_file:
            _check_can_create(args.address_file, "--address-file", directory=False)
        from .swarm.admission import load_admission
        from .bootstrap_node import run_bootstrap

        load_admission(args.secret_file, [])
        return uvloop.run(run_bootstrap(args.listen or ["/ip4/0.0.0.0/tcp/0"], args.announce, args.identity,
                                        args.initial_peer, args.run_id, args.report_every, metrics,
                                        args.address_file, args.secret_file))
    if args.command == "plot":
        from .observe.report import find_logs, plot_losses

        try:
            logs = find_logs(args.logs)
        except OSError as e:  # find_logs' own errors say what to give; others come from the file system
            raise ConfigError(str(e) if e.errno is None else f"cannot read {_quote(str(e.filename))} ({e.strerror}): "
                              f"give event logs (runs/<peer>.jsonl) or their directory") from None
        _check_can_create(args.out, "--out", directory=False)
        try:
            png = plot_losses(logs, Path(args.out))
        except (ValueError, KeyError, TypeError) as e:  # a line that is no JSON, or JSON that is no event
            raise ConfigError(f"cannot plot {_quote(' '.join(map(str, logs.values())))}: not diloco-peer event "
                              f"logs ({type(e).__name__}: {_quote(str(e))}): give runs/<peer>.jsonl files") from None
        print(f"wrote {png} ({len(logs)} peers: {', '.join(logs)})")
        return 0
    if args.command == "keygen":
        if bool(args.path) == bool(args.secret):
            raise ConfigError("keygen needs exactly one of KEY_FILE (an identity) or --secret SECRET_FILE (a swarm "
                              "secret), e.g. diloco-peer keygen ~/.diloco.key")
        if args.secret:
            from .swarm.admission import write_secret

            write_secret(args.secret, args.force)
            print(f"wrote {args.secret} (mode 0600): a new swarm secret; share it with the swarm's members only")
            print(f"use it with: diloco-peer bootstrap ... --secret-file {args.secret}, and "
                  f"diloco-peer join <bootstrap> --secret-file {args.secret}")
            return 0
        from .swarm.addresses import generate_identity

        peer_id = generate_identity(args.path, args.force)
        print(f"wrote {args.path} (mode 0600); peer id {peer_id}")
        print(f"use it with: diloco-peer join <bootstrap> --identity {args.path}")
        return 0
    if args.command == "status":
        for addr in args.bootstrap:
            parse_multiaddr(addr, need_peer_id=True, what="bootstrap address")
        from .swarm.admission import load_admission
        from .bootstrap_node import run_status

        load_admission(args.secret_file, [])
        return uvloop.run(run_status(args.bootstrap, args.run_id, args.json, args.wait, args.secret_file))
    overrides = list(args.overrides)
    if args.command == "join":
        for addr in args.bootstrap:
            parse_multiaddr(addr, need_peer_id=True, what="bootstrap address")
        if args.identity is not None:
            overrides.append(f"swarm.identity_path={json.dumps(args.identity)}")
        if args.secret_file is not None:
            overrides.append(f"swarm.secret_file={json.dumps(args.secret_file)}")
        for flag, key in (("listen", "host_maddrs"), ("announce", "announce_maddrs")):
            if getattr(args, flag) is not None:
                overrides.append(f"swarm.{key}={json.dumps(getattr(args, flag))}")
        if args.reachability is not None:
            overrides.append(f"swarm.reachability={json.dumps(args.reachability)}")
        if args.relay:
            overrides.append("swarm.relay_service=true")
        cfg = load_config(args.config, overrides)
        _check_peer(cfg)
        from .swarm.admission import load_admission
        from .daemon import PeerDaemon

        load_admission(cfg.swarm.secret_file, cfg.swarm.allowlist)
        return uvloop.run(PeerDaemon(cfg, args.bootstrap, args.name or "").run())
    if args.command == "simulate":
        cfg = load_config(args.config, overrides)
        _check_can_create(args.out, "--out", directory=True)
        from .tools.simulate import run_simulate

        return run_simulate(args, cfg)
    if args.command == "demo":
        from .tools.demo import check_args, run_demo

        check_args(args)  # config, churn, ports: fail here rather than in N subprocesses
        _check_can_create(args.out, "--out", directory=True)
        if args.summary_json:
            _check_can_create(args.summary_json, "--summary-json", directory=False)
        return run_demo(args)
    raise AssertionError(args.command)


def _fail(error: Exception, code: int) -> int:
    print(f"diloco-peer: error: {' '.join(str(error).splitlines())}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    """The ``diloco-peer`` command; returns its exit code (see ``EXIT_CODES``)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help and --version (0), or a usage error, already printed as one line
        return int(e.code or 0)
    from .config import ConfigError
    from .config.environment import check_environment

    try:
        check_environment(os.environ)  # before hivemind is imported: it reads most of them then
    except ConfigError as e:
        return _fail(e, EXIT_USAGE)
    _setup_logging(args.verbose)
    from .swarm.addresses import BootstrapUnreachable, SwarmError
    from .config import DataError

    try:
        return _run(args)
    except (ConfigError, DataError) as e:
        return _fail(e, EXIT_USAGE)
    except BootstrapUnreachable as e:
        return _fail(e, EXIT_UNREACHABLE)
    except SwarmError as e:  # "bad ..." is an address or identity we were given; the rest happened at run time
        return _fail(e, EXIT_USAGE if str(e).startswith("bad ") else EXIT_RUNTIME)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
