"""``diloco-peer``: the command line. Parse, hand over to the command (``commands.py``); errors become one
line and an exit code.

    diloco-peer bootstrap --identity ./boot.key --listen /ip4/0.0.0.0/tcp/31337 [--config tiny-cpu] [--set ...]
    diloco-peer join /ip4/1.2.3.4/tcp/31337/p2p/Qm... [--set inner.batch_size=4 ...]   # the swarm's config
    diloco-peer demo --peers 3 --rounds 5 [--config tiny-cpu] [--summary-json out.json] [--churn kill:1@round2]
    diloco-peer simulate --replicas 4 --rounds 10 [--codec int8] [--overlap delayed]
    diloco-peer prepare corpus/ --out data/corpus [--train-tokenizer 8192]
    diloco-peer plan --config llama-150m [--link 100mbit] [--peers 4] [--device cpu|cuda] [--json]
    diloco-peer export checkpoints/alice/epoch-000010.pt --out llama-hf [--config tiny-cpu] [--sample "def "]

Exit codes (``EXIT_CODES``, also in ``--help`` and the README): 0 ok, 1 failed while running, 2 bad input
(command line, config, address, environment variable), 3 no bootstrap reachable, 130 interrupted. Every
error is one line on stderr, ``diloco-peer: error: ...``, naming the bad value and the fix.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import sys
from typing import NoReturn

from . import __version__
from .commands import COMMANDS, quote

# Distinct, so that a supervisor (systemd, docker) can restart on 1 and 3 but not loop on 2.
EXIT_OK = 0
EXIT_RUNTIME = 1  # started, then failed: a crash, a demo peer that failed, no clean leave within shutdown_grace
EXIT_USAGE = 2  # bad input: argparse's own code too; retrying the same command cannot help
EXIT_UNREACHABLE = 3  # no bootstrap peer answered (within swarm.join_timeout), or none sent its config: the swarm
EXIT_INTERRUPTED = 130  # 128 + SIGINT: a second Ctrl+C or signal, or Ctrl+C during demo
EXIT_CODES = f"""exit codes:
  {EXIT_OK}    success
  {EXIT_RUNTIME}    failed while running (a crash, a demo peer that failed, no clean leave within run.shutdown_grace)
  {EXIT_USAGE}    bad input: command line, config file, --set, address, environment variable, checkpoint, data files,
       a config that does not fit this machine's memory (join --no-fit-check joins anyway)
  {EXIT_UNREACHABLE}    no bootstrap peer reachable (within swarm.join_timeout), or none sent the swarm's config to a
       join without --config: check the address, or retry later
  {EXIT_INTERRUPTED}  interrupted (a second Ctrl+C or SIGTERM)"""


SECRET_FILE_HELP = "file with the swarm secret (diloco-peer keygen --secret FILE): a closed swarm, see SECURITY.md"


class _Parser(argparse.ArgumentParser):
    """argparse with errors as one line, like every other error (argparse prints the usage block first)."""

    def error(self, message: str) -> NoReturn:
        print(f"diloco-peer: error: {' '.join(message.splitlines())} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def _bounded(kind: type, low: float, *, above: bool = False, what: str):
    """An argparse type: a finite ``kind`` that is >= ``low`` (> with ``above``); nan and inf are refused."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value < low or (above and value == low):
            raise argparse.ArgumentTypeError(f"{quote(text)} is not {what}")
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
        raise argparse.ArgumentTypeError(f"{quote(text)} is not a name: use 1-64 letters, digits, '_', '.' or '-', "
                                         f"starting with a letter or digit")
    return text


def _add_config_args(parser: argparse.ArgumentParser, default: str = "default tiny-cpu") -> None:
    """``--config`` and ``--set``, for the commands that load a peer config; ``default``: what the help says a
    command without ``--config`` uses."""
    parser.add_argument("--config", default=None, metavar="FILE|NAME",
                        help=f"TOML config: a file or a shipped name (tiny-cpu, llama-150m, llama-1b); {default}")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config value, TOML syntax, e.g. --set inner.lr=3e-4 (repeatable)")


def _add_bootstrap(sub) -> None:
    """``bootstrap``: a bootstrap node's addresses, identity, run, secret, summaries and metrics."""
    boot = sub.add_parser("bootstrap", help="run a bootstrap node that peers dial first")
    boot.add_argument("--identity", default="", metavar="KEY_FILE",
                      help="private key file for a stable peer id, created if missing, e.g. ./boot.key")
    boot.add_argument("--listen", action="append", default=[], metavar="MULTIADDR",
                      help="listen address, e.g. /ip4/0.0.0.0/tcp/31337 (repeatable; default any port)")
    boot.add_argument("--announce", action="append", default=[], metavar="MULTIADDR",
                      help="address others should dial, e.g. /ip4/203.0.113.7/tcp/31337 (repeatable)")
    boot.add_argument("--initial-peer", action="append", default=[], metavar="MULTIADDR",
                      help="another bootstrap node to connect to (repeatable)")
    boot.add_argument("--config", default=None, metavar="FILE|NAME",
                      help="publish this config's swarm-wide keys, signed by this node, to every peer that joins "
                           "through it (join needs no --config then), e.g. tiny-cpu; default: none, each peer "
                           "brings its own")
    boot.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="with --config: override one of its values, e.g. --set outer.inner_steps=20 (repeatable)")
    boot.add_argument("--run-id", type=_name, default=None,
                      help="the run whose progress this node shows (default: the config's run.run_id, else "
                           "diloco-tiny)")
    boot.add_argument("--secret-file", default="", metavar="FILE", help=SECRET_FILE_HELP)
    boot.add_argument("--report-every", type=_SECONDS, default=30.0, metavar="SECONDS",
                      help="seconds between swarm summaries in the log (default 30)")
    boot.add_argument("--address-file", default="", metavar="PATH",
                      help="also write the join address to this file (for containers that start peers from it)")
    boot.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                      help="serve the swarm's Prometheus metrics and /healthz on this port (default 0: off)")
    boot.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                      help="interface for --metrics-port (default 127.0.0.1; 0.0.0.0 for a remote Prometheus)")


def _add_keygen(sub) -> None:
    """``keygen``: an identity key file, or with ``--secret`` a swarm secret."""
    keygen = sub.add_parser("keygen", help="create an identity key file (a stable peer id) and print its peer id, "
                                           "or with --secret a swarm secret")
    keygen.add_argument("path", nargs="?", metavar="KEY_FILE",
                        help="where to write the private key, e.g. ~/.diloco.key")
    keygen.add_argument("--secret", default="", metavar="SECRET_FILE",
                        help="instead, write a new random swarm secret (mode 0600) to share with the swarm's members")
    keygen.add_argument("--force", action="store_true", help="replace an existing file")


def _add_status(sub) -> None:
    """``status``: which swarm to look at, and how."""
    status = sub.add_parser("status", help="print the swarm's peers, states, losses and throughput")
    status.add_argument("bootstrap", nargs="+", metavar="BOOTSTRAP_MULTIADDR", help="a bootstrap node's address")
    status.add_argument("--run-id", type=_name, default="diloco-tiny", help="the run to show (default diloco-tiny)")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.add_argument("--secret-file", default="", metavar="FILE", help=SECRET_FILE_HELP)
    status.add_argument("--wait", type=_SECONDS_OR_ZERO, default=10.0, metavar="SECONDS",
                        help="how long to look for records before reporting an empty swarm (default 10)")


def _add_join(sub) -> None:
    """``join``: the bootstrap addresses, the config, and flags that set the config's swarm keys."""
    join = sub.add_parser("join", help="join a swarm and train")
    join.add_argument("bootstrap", nargs="+", metavar="BOOTSTRAP_MULTIADDR",
                      help="address printed by a bootstrap node, e.g. /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...; "
                           "the swarm's config comes from it (a bootstrap --config), --set keeps your own choices")
    # without --config a joiner takes the swarm's config from its owner (swarm/run_config.py)
    _add_config_args(join, default="default: the swarm's, from its owner (else tiny-cpu, if the owner publishes none)")
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
    join.add_argument("--no-fit-check", action="store_true",
                      help="join even if `diloco-peer plan` says the config does not fit this machine's free memory")


def _add_demo(sub) -> None:
    """``demo``: the local swarm's size and length, its outputs, churn, metrics ports, NAT and time limit."""
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


def _add_plot(sub) -> None:
    """``plot``: which event logs, and the PNG to draw them into."""
    plot = sub.add_parser("plot", help="plot loss and throughput from peers' event logs into a PNG")
    plot.add_argument("logs", nargs="+", metavar="LOG_OR_DIR", help="runs/<peer>.jsonl files, or directories of them")
    plot.add_argument("--out", default="plot.png", metavar="PNG", help="the PNG to write (default plot.png)")


def _add_simulate(sub) -> None:
    """``simulate``: K, the rounds, the codec and overlap under test, baselines, warm start and outputs."""
    sim = sub.add_parser("simulate", help="K DiLoCo replicas in one process (no network) against the baselines")
    _add_config_args(sim)
    sim.add_argument("--replicas", type=_COUNT, default=4, help="K, the number of DiLoCo replicas (default 4)")
    sim.add_argument("--rounds", type=_COUNT, default=10, help="outer rounds of H inner steps (default 10)")
    sim.add_argument("--codec", default="none", choices=["none", "fp16", "bf16", "int8", "int4", "topk"],
                     help="pseudo-gradient codec on the (simulated) wire (default none; topk: the config's "
                          "averaging.topk_density and topk_bits, always with error feedback)")
    sim.add_argument("--overlap", default="blocking", choices=["blocking", "eager", "delayed"],
                     help="blocking, eager or delayed: average round t while round t+1 trains (default blocking)")
    sim.add_argument("--error-feedback", action="store_true",
                     help="carry the codec's rounding error into the next round")
    sim.add_argument("--no-baselines", action="store_true", help="skip the single-replica and Kx-batch baselines")
    sim.add_argument("--pretrain", type=_STEPS, default=0, metavar="STEPS",
                     help="start every run from one replica trained this many steps, as the DiLoCo paper does "
                          "(default 0: from scratch)")
    sim.add_argument("--out", default="runs/simulate", metavar="DIR",
                     help="directory for simulate.json and eval_loss.png (default runs/simulate)")


def _add_prepare(sub) -> None:
    """``prepare``: inputs, output, tokenizer, shard and eval sizes, workers."""
    prep = sub.add_parser("prepare", help="turn text (.txt, .jsonl, .parquet, a Hugging Face dataset) into token "
                                          "shards that peers read in place (data.source=\"shards\")")
    prep.add_argument("inputs", nargs="*", metavar="INPUT",
                      help="text files or directories of them (.txt: one document each; .jsonl: one per line; "
                           ".parquet: one per row); with --hf-dataset json|parquet|text, its data files")
    prep.add_argument("--out", required=True, metavar="DIR",
                      help="output directory, e.g. data/corpus (an interrupted run there is resumed)")
    prep.add_argument("--tokenizer", default="bytes", metavar="NAME|PATH",
                      help="bytes (default), a tokenizer.json, or a Hugging Face tokenizer name (needs internet)")
    prep.add_argument("--train-tokenizer", type=_STEPS, default=0, metavar="VOCAB_SIZE",
                      help="first train a byte-level BPE with this many ids on the input, e.g. 8192 (offline)")
    prep.add_argument("--tokenizer-sample-bytes", type=_COUNT, default=100_000_000, metavar="N",
                      help="train the tokenizer on the first N characters of the input (default 100000000)")
    prep.add_argument("--text-field", default="text", metavar="NAME",
                      help="the text of a .jsonl line, a .parquet row or a dataset row (default text)")
    prep.add_argument("--hf-dataset", default="", metavar="NAME[:CONFIG]",
                      help="stream a Hugging Face dataset instead, e.g. allenai/c4:en (needs internet)")
    prep.add_argument("--hf-split", default="train", metavar="SPLIT", help="its split (default train)")
    prep.add_argument("--shard-tokens", type=_COUNT, default=100_000_000, metavar="N",
                      help="tokens per training file (default 100000000)")
    prep.add_argument("--eval-tokens", type=_COUNT, default=1_000_000, metavar="N",
                      help="tokens of the eval split, taken from the start of the input (default 1000000)")
    prep.add_argument("--max-tokens", type=_STEPS, default=0, metavar="N",
                      help="stop after N tokens in all (default 0: the whole input)")
    prep.add_argument("--workers", type=_COUNT, default=os.cpu_count() or 1, metavar="N",
                      help="tokenizer processes (default: one per CPU core)")


def _link(text: str) -> float:
    """An argparse type: a link speed as tc writes it (``100mbit``), in bits per second."""
    from .config import ConfigError
    from .tools.plan import parse_link

    try:
        return parse_link(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_plan(sub) -> None:
    """``plan``: the config, the link and group size of the rounds, the peer's device, the output format."""
    plan = sub.add_parser("plan", help="what a config needs on this machine (memory, bytes per round) and whether "
                                       "it fits, before joining")
    _add_config_args(plan)
    plan.add_argument("--link", type=_link, default="100mbit", metavar="RATE",
                      help="each peer's link, each way, in tc's units, e.g. 20mbit, 1gbit (default 100mbit)")
    plan.add_argument("--peers", type=_bounded(int, 2, what="a whole number >= 2"), default=4, metavar="K",
                      help="peers in an all-reduce group (default 4)")
    plan.add_argument("--device", choices=["cpu", "cuda"], default=None,
                      help="judge the fit for a peer training there (default: as inner.device picks)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON, every buffer with its owner")


def _add_export(sub) -> None:
    """``export``: the checkpoint, the config it was trained with, the output folder, an optional sample."""
    export = sub.add_parser("export", help="write a checkpoint's outer weights as a Hugging Face Llama "
                                           "(safetensors, config.json, tokenizer)")
    export.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint file, e.g. checkpoints/alice/"
                                                                 "epoch-000010.pt, or a peer's checkpoint folder")
    _add_config_args(export)
    export.add_argument("--out", required=True, metavar="DIR", help="the folder to write, e.g. llama-hf")
    export.add_argument("--sample", default=None, metavar="PROMPT",
                        help="then print a continuation of PROMPT by the exported weights, e.g. --sample 'def '")
    export.add_argument("--max-new-tokens", type=_COUNT, default=64, metavar="N",
                        help="tokens --sample generates (default 64)")
    export.add_argument("--temperature", type=_bounded(float, 0, what="a number >= 0"), default=0.0, metavar="T",
                        help="--sample's sampling temperature; 0 (default) is greedy")


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: global flags, then one sub-parser per command, in ``--help``'s order."""
    parser = _Parser(prog="diloco-peer", description="Peer-to-peer DiLoCo training on hivemind.", epilog=EXIT_CODES,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging (hivemind included)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_bootstrap, _add_keygen, _add_status, _add_join, _add_demo, _add_plot, _add_simulate,
                _add_prepare, _add_plan, _add_export):
        add(sub)
    return parser


def _setup_logging(verbose: bool) -> None:
    """Our INFO lines on stdout; hivemind's own level through the variable it reads when it is imported."""
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "DEBUG" if verbose else "WARNING")
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", stream=sys.stdout)


def _fail(error: Exception, code: int) -> int:
    """Print ``error`` as the one line every error is, and return the exit code ``code``."""
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
    from .config import DataError
    from .swarm.addresses import BootstrapUnreachable, SwarmError

    try:
        return COMMANDS[args.command](args)
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
