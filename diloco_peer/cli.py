"""``diloco-peer``: the command line. Parse, validate, hand over; errors become one line and an exit code.

    diloco-peer bootstrap --identity ./boot.key --listen /ip4/0.0.0.0/tcp/31337
    diloco-peer join /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW... [--config tiny-cpu] [--set inner.lr=3e-4 ...]
    diloco-peer demo --peers 3 --rounds 5 [--config tiny-cpu] [--summary-json out.json] [--churn kill:1@round2]
    diloco-peer simulate --replicas 4 --rounds 10 [--codec int8] [--overlap delayed]

Exit codes: 0 ok, 1 runtime failure (e.g. no bootstrap reachable), 2 bad input (CLI, config, address).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from . import __version__

EXIT_RUNTIME, EXIT_USAGE = 1, 2


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, metavar="FILE|NAME",
                        help="TOML config: a file or a shipped name (tiny-cpu, llama-150m, llama-1b); default tiny-cpu")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config value, TOML syntax, e.g. --set inner.lr=3e-4 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diloco-peer", description="Peer-to-peer DiLoCo training on hivemind.")
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
    boot.add_argument("--run-id", default="diloco-tiny", help="the run whose progress this node shows")
    boot.add_argument("--report-every", type=float, default=30.0, metavar="SECONDS",
                      help="seconds between swarm summaries in the log (default 30)")

    boot.add_argument("--address-file", default="", metavar="PATH",
                      help="also write the join address to this file (for containers that start peers from it)")
    boot.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                      help="serve the swarm's Prometheus metrics and /healthz on this port (default 0: off)")
    boot.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                      help="interface for --metrics-port (default 127.0.0.1; 0.0.0.0 for a remote Prometheus)")

    keygen = sub.add_parser("keygen", help="create an identity key file (a stable peer id) and print its peer id")
    keygen.add_argument("path", metavar="KEY_FILE", help="where to write the private key, e.g. ~/.diloco.key")
    keygen.add_argument("--force", action="store_true", help="replace an existing key file")

    status = sub.add_parser("status", help="print the swarm's peers, states, losses and throughput")
    status.add_argument("bootstrap", nargs="+", metavar="BOOTSTRAP_MULTIADDR", help="a bootstrap node's address")
    status.add_argument("--run-id", default="diloco-tiny", help="the run to show (default diloco-tiny)")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.add_argument("--wait", type=float, default=10.0, metavar="SECONDS",
                        help="how long to look for records before reporting an empty swarm (default 10)")

    join = sub.add_parser("join", help="join a swarm and train")
    join.add_argument("bootstrap", nargs="+", metavar="BOOTSTRAP_MULTIADDR",
                      help="address printed by a bootstrap node, e.g. /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...")
    _add_config_args(join)
    join.add_argument("--identity", default=None, metavar="KEY_FILE",
                      help="private key file for a stable peer id (created if missing); sets swarm.identity_path")
    join.add_argument("--name", default="", help="name in logs and of the event file (default: from the peer id)")

    demo = sub.add_parser("demo", help="run a local swarm (bootstrap + N peers as subprocesses) and summarise it")
    _add_config_args(demo)
    demo.add_argument("--peers", type=int, default=3, help="number of peers (default 3)")
    demo.add_argument("--rounds", type=int, default=5, help="outer rounds each peer trains (default 5)")
    demo.add_argument("--out", default="runs/demo", metavar="DIR",
                      help="directory for logs, the summary and the loss plot (default runs/demo)")
    demo.add_argument("--summary-json", default=None, metavar="FILE", help="also write the summary JSON here")
    demo.add_argument("--churn", default="", metavar="SCHEDULE",
                      help='kill, stop and add peers during the run, e.g. "kill:2@round2,join:1@round3,term:1@round4" '
                           "(an item fires when round R begins averaging)")
    demo.add_argument("--metrics-port-base", type=int, default=0, metavar="P",
                      help="serve the bootstrap's metrics on port P and peer i's on P+1+i (default 0: none)")
    demo.add_argument("--timeout", type=float, default=900.0, metavar="SECONDS",
                      help="give up if the swarm has not finished after this long (default 900)")
    plot = sub.add_parser("plot", help="plot loss and throughput from peers' event logs into a PNG")
    plot.add_argument("logs", nargs="+", metavar="LOG_OR_DIR", help="runs/<peer>.jsonl files, or directories of them")
    plot.add_argument("--out", default="plot.png", metavar="PNG", help="the PNG to write (default plot.png)")

    sim = sub.add_parser("simulate", help="K DiLoCo replicas in one process (no network) against the baselines")
    _add_config_args(sim)
    sim.add_argument("--replicas", type=int, default=4, help="K, the number of DiLoCo replicas (default 4)")
    sim.add_argument("--rounds", type=int, default=10, help="outer rounds of H inner steps (default 10)")
    sim.add_argument("--codec", default="none", choices=["none", "fp16", "bf16", "int8", "int4"],
                     help="pseudo-gradient codec on the (simulated) wire (default none)")
    sim.add_argument("--overlap", default="blocking", choices=["blocking", "delayed"],
                     help="blocking, or delayed: average round t while round t+1 trains (default blocking)")
    sim.add_argument("--error-feedback", action="store_true",
                     help="carry the codec's rounding error into the next round")
    sim.add_argument("--no-baselines", action="store_true", help="skip the single-replica and Kx-batch baselines")
    sim.add_argument("--pretrain", type=int, default=0, metavar="STEPS",
                     help="start every run from one replica trained this many steps, as the DiLoCo paper does "
                          "(default 0: from scratch)")
    sim.add_argument("--out", default="runs/simulate", metavar="DIR",
                     help="directory for simulate.json and eval_loss.png (default runs/simulate)")
    return parser


def _setup_logging(verbose: bool) -> None:
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "DEBUG" if verbose else "WARNING")
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", stream=sys.stdout)


def _run(args: argparse.Namespace) -> int:
    # heavy imports (torch, hivemind) only once we know which command runs
    import uvloop

    from .config import ConfigError, MetricsConfig, load_config

    if args.command == "bootstrap":
        from .bootstrap_node import run_bootstrap

        if not 0 <= args.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port {args.metrics_port} is not a TCP port: use 1-65535, or 0 for none")
        metrics = MetricsConfig(port=args.metrics_port, host=args.metrics_host)
        return uvloop.run(run_bootstrap(args.listen or ["/ip4/0.0.0.0/tcp/0"], args.announce, args.identity,
                                        args.initial_peer, args.run_id, args.report_every, metrics,
                                        args.address_file))
    if args.command == "plot":
        from .report import find_logs, plot_losses

        try:
            logs = find_logs(args.logs)
        except FileNotFoundError as e:
            raise ConfigError(str(e)) from None
        print(f"wrote {plot_losses(logs, Path(args.out))} ({len(logs)} peers: {', '.join(logs)})")
        return 0
    if args.command == "keygen":
        from .swarm import generate_identity

        peer_id = generate_identity(args.path, args.force)
        print(f"wrote {args.path} (mode 0600); peer id {peer_id}")
        print(f"use it with: diloco-peer join <bootstrap> --identity {args.path}")
        return 0
    if args.command == "status":
        from .bootstrap_node import run_status
        from .swarm import parse_multiaddr

        for addr in args.bootstrap:
            parse_multiaddr(addr, need_peer_id=True, what="bootstrap address")
        return uvloop.run(run_status(args.bootstrap, args.run_id, args.json, args.wait))
    overrides = list(args.overrides)
    if args.command == "join":
        from .daemon import PeerDaemon
        from .swarm import parse_multiaddr

        for addr in args.bootstrap:
            parse_multiaddr(addr, need_peer_id=True, what="bootstrap address")
        if args.identity is not None:
            overrides.append(f"swarm.identity_path={json.dumps(args.identity)}")
        cfg = load_config(args.config, overrides)
        return uvloop.run(PeerDaemon(cfg, args.bootstrap, args.name).run())
    if args.command == "simulate":
        from .simulate import run_simulate

        return run_simulate(args, load_config(args.config, overrides))
    if args.command == "demo":
        from .demo import run_demo

        load_config(args.config, overrides)  # fail fast here rather than in N subprocesses
        return run_demo(args)
    raise AssertionError(args.command)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    from .config import ConfigError
    from .data import DataError
    from .swarm import SwarmError

    try:
        return _run(args)
    except (ConfigError, DataError) as e:
        print(f"diloco-peer: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except SwarmError as e:
        bad_input = str(e).startswith("bad ")
        print(f"diloco-peer: error: {e}", file=sys.stderr)
        return EXIT_USAGE if bad_input else EXIT_RUNTIME
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
