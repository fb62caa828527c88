"""What each ``diloco-peer`` command does once its command line is parsed: check, then start.

``COMMANDS`` maps a command's name to its function, ``args -> exit code``; ``cli.main`` calls it and turns
the errors it raises (``ConfigError``, ``SwarmError``, ...) into one line and an exit code. Each function
first checks everything the command will dial, read and write (a bad address or path is one line, with
nothing to tear down), and imports torch, hivemind and the daemon only after that: a typo costs a fraction
of a second, not the seconds those imports take.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path


def quote(text: str) -> str:
    """A bad value as errors show it: quoted, and cut short if it is long."""
    return repr(text) if len(text) <= 60 else f"{text[:60]!r}... ({len(text)} characters)"


def _check_can_create(path: str, what: str, *, directory: bool) -> None:
    """Fail now, in one line, where writing ``path`` would fail later: after minutes of work, or once the
    peer is in the swarm. Creates the directory (for a file: its parent), as the command would anyway."""
    from .config import ConfigError

    if "\x00" in path:
        raise ConfigError(f"{what} {quote(path)} contains a NUL character: remove it")
    target = Path(path)
    try:
        if not directory and target.is_dir():
            raise ConfigError(f"{what} {quote(path)} is a directory: give a file name")
        folder = target if directory else target.parent
        folder.mkdir(parents=True, exist_ok=True)
        writable = os.access(folder, os.W_OK | os.X_OK)
    except OSError as e:
        raise ConfigError(f"{what} {quote(path)} cannot be created ({e.strerror}): choose another path") from None
    if not writable:
        raise ConfigError(f"{what} {quote(path)} is not writable: choose another path")


def _check_bootstrap_args(args: argparse.Namespace):
    """The bootstrap node's addresses, identity, address file and metrics endpoint, checked before the DHT
    starts; returns its ``MetricsConfig``."""
    from pydantic import ValidationError

    from .config import ConfigError, MetricsConfig
    from .swarm.addresses import check_identity, parse_multiaddr

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
        raise ConfigError(f"bad --metrics-host {quote(args.metrics_host)}: {reason}") from None
    if args.identity:
        check_identity(args.identity)
    if args.address_file:
        _check_can_create(args.address_file, "--address-file", directory=False)
    return metrics


def _run_config(args: argparse.Namespace) -> tuple[dict | None, str, str]:
    """``bootstrap``'s run: the swarm-wide part of its ``--config`` with its ``--set`` (None without ``--config``),
    the config's name and the run id it shows."""
    from .config import ConfigError, load_config
    from .config.swarm_wide import swarm_part

    if not args.config:
        if args.overrides:
            raise ConfigError("bootstrap --set needs --config NAME (the config the swarm runs), e.g. "
                              "--config tiny-cpu --set outer.inner_steps=20")
        return None, "", args.run_id or "diloco-tiny"
    cfg = load_config(args.config, args.overrides)
    if args.run_id and args.run_id != cfg.run.run_id:
        raise ConfigError(f"--run-id {args.run_id} disagrees with the config's run.run_id={cfg.run.run_id}: drop "
                          f"--run-id (the config names the run), or --set run.run_id={args.run_id}")
    return swarm_part(cfg), Path(args.config).stem, cfg.run.run_id


def bootstrap(args: argparse.Namespace) -> int:
    """``diloco-peer bootstrap``: run a bootstrap node until it is stopped; with ``--config``, it publishes the
    run's config to the peers that join through it (``swarm/run_config.py``)."""
    metrics = _check_bootstrap_args(args)
    config, name, run_id = _run_config(args)
    import uvloop

    from .bootstrap_node import run_bootstrap
    from .swarm.admission import load_admission

    load_admission(args.secret_file, [])
    return uvloop.run(run_bootstrap(args.listen or ["/ip4/0.0.0.0/tcp/0"], args.announce, args.identity,
                                    args.initial_peer, run_id, args.report_every, metrics,
                                    args.address_file, args.secret_file, config=config, config_name=name))


def keygen(args: argparse.Namespace) -> int:
    """``diloco-peer keygen``: write an identity key file and print its peer id, or write a swarm secret."""
    from .config import ConfigError

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


def status(args: argparse.Namespace) -> int:
    """``diloco-peer status``: print the swarm's peers as its progress records show them."""
    from .swarm.addresses import parse_multiaddr

    for addr in args.bootstrap:
        parse_multiaddr(addr, need_peer_id=True, what="bootstrap address")
    import uvloop

    from .bootstrap_node import run_status
    from .swarm.admission import load_admission

    load_admission(args.secret_file, [])
    return uvloop.run(run_status(args.bootstrap, args.run_id, args.json, args.wait, args.secret_file))


def _join_overrides(args: argparse.Namespace) -> list[str]:
    """``join``'s ``--set`` items, then its flags as the config keys they set (``--listen`` ->
    ``swarm.host_maddrs``, ...): a flag wins over a ``--set`` of the same key."""
    overrides = list(args.overrides)
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
    return overrides


def _check_peer(cfg) -> None:
    """What a peer dials, reads and writes, checked before it joins: the daemon would fail only once in the swarm."""
    from .config import DataError
    from .swarm.addresses import check_identity, parse_multiaddr

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
            raise DataError(f"data file {quote(raw)} does not exist: fix data.paths")
    if cfg.data.source == "shards":  # a missing or half-prepared directory: say so before the swarm sees us
        from .training.token_shards import load_manifest

        load_manifest(cfg.data.shards_dir)


def _check_config(cfg, name: str, fit_check: bool) -> None:
    """Whether config ``cfg`` (called ``name``) can run on this machine: what it reads and writes, and (unless
    ``--no-fit-check``) whether it fits the memory (``plan``'s check)."""
    _check_peer(cfg)
    if fit_check:  # before the swarm sees us: a peer that runs out of memory mid-round costs it a round
        from .tools.plan import check_fits

        check_fits(cfg, name)


def join(args: argparse.Namespace) -> int:
    """``diloco-peer join``: join a swarm and train until ``run.max_rounds``, a signal or a failure. The swarm-wide
    keys come from the config its owner publishes (``swarm/run_config.py``), checked against what the volunteer
    stated; the checks run before the DHT starts on the volunteer's own config, and again on the swarm's."""
    from functools import partial

    from .config import DEFAULT_CONFIG, load_config
    from .config.swarm_wide import stated_keys
    from .swarm.addresses import parse_multiaddr

    for addr in args.bootstrap:
        parse_multiaddr(addr, need_peer_id=True, what="bootstrap address")
    overrides = _join_overrides(args)
    cfg = load_config(args.config, overrides)
    check = partial(_check_config, fit_check=not args.no_fit_check)
    check(cfg, args.config or DEFAULT_CONFIG)
    import uvloop

    from .daemon import PeerDaemon
    from .swarm.admission import load_admission
    from .swarm.run_config import Joiner, adopt_swarm_config

    load_admission(cfg.swarm.secret_file, cfg.swarm.allowlist)
    joiner = Joiner(cfg, stated_keys(args.config, overrides), args.config, list(args.bootstrap), check)
    return uvloop.run(PeerDaemon(cfg, args.bootstrap, args.name or "", owns_process=True,
                                 adopt=partial(adopt_swarm_config, joiner=joiner)).run())


def demo(args: argparse.Namespace) -> int:
    """``diloco-peer demo``: a local swarm of subprocesses, then its summary (``tools/demo.py``)."""
    from .tools.demo import check_args, run_demo

    check_args(args)  # config, churn, ports: fail here rather than in N subprocesses
    _check_can_create(args.out, "--out", directory=True)
    if args.summary_json:
        _check_can_create(args.summary_json, "--summary-json", directory=False)
    return run_demo(args)


def simulate(args: argparse.Namespace) -> int:
    """``diloco-peer simulate``: K replicas in one process against the baselines (``tools/simulate.py``)."""
    from .config import load_config

    # --overlap is the simulated swarm's outer.overlap: the config resolves its defaults (the outer lr) with it
    cfg = load_config(args.config, [f"outer.overlap={args.overlap}", *args.overrides])
    _check_can_create(args.out, "--out", directory=True)
    from .tools.simulate import run_simulate

    return run_simulate(args, cfg)


def plot(args: argparse.Namespace) -> int:
    """``diloco-peer plot``: loss and throughput of peers' event logs, drawn into one PNG."""
    from .config import ConfigError
    from .observe.report import find_logs, plot_losses

    try:
        logs = find_logs(args.logs)
    except OSError as e:  # find_logs' own errors say what to give; others come from the file system
        raise ConfigError(str(e) if e.errno is None else f"cannot read {quote(str(e.filename))} ({e.strerror}): "
                          f"give event logs (runs/<peer>.jsonl) or their directory") from None
    _check_can_create(args.out, "--out", directory=False)
    try:
        png = plot_losses(logs, Path(args.out))
    except (ValueError, KeyError, TypeError) as e:  # a line that is no JSON, or JSON that is no event
        raise ConfigError(f"cannot plot {quote(' '.join(map(str, logs.values())))}: not diloco-peer event "
                          f"logs ({type(e).__name__}: {quote(str(e))}): give runs/<peer>.jsonl files") from None
    print(f"wrote {png} ({len(logs)} peers: {', '.join(logs)})")
    return 0


def prepare(args: argparse.Namespace) -> int:
    """``diloco-peer prepare``: text -> token shards + manifest in ``--out`` (``training/prepare.py``)."""
    from .config import ConfigError

    if not args.inputs and not args.hf_dataset:
        raise ConfigError("prepare needs INPUT files or directories, or --hf-dataset NAME, e.g. "
                          "diloco-peer prepare corpus/ --out data/corpus")
    _check_can_create(args.out, "--out", directory=True)
    from .training.prepare import PrepareJob
    from .training.prepare import prepare as run_prepare

    job = PrepareJob(inputs=tuple(args.inputs), out=args.out, tokenizer=args.tokenizer,
                     train_tokenizer=args.train_tokenizer, tokenizer_sample_bytes=args.tokenizer_sample_bytes,
                     text_field=args.text_field, hf_dataset=args.hf_dataset, hf_split=args.hf_split,
                     shard_tokens=args.shard_tokens, eval_tokens=args.eval_tokens, max_tokens=args.max_tokens,
                     workers=args.workers)
    try:
        manifest = run_prepare(job)
    except KeyboardInterrupt:
        print(f"prepare interrupted: the files listed in {args.out}/manifest.json are complete; the same "
              f"command again goes on from there", file=sys.stderr)
        raise
    train = sum(entry["tokens"] for entry in manifest["train"])
    print(f"{args.out}: {len(manifest['train'])} training files, {train:,} tokens ({manifest['dtype']}), eval "
          f"split {manifest['eval']['tokens']:,} tokens, tokenizer {manifest['tokenizer']} "
          f"({manifest['vocab_size']} ids)")
    print(f"train on it with: --set data.source=shards --set data.shards_dir={shlex.quote(args.out)} "
          f"--set model.vocab_size={manifest['vocab_size']}")
    return 0


def plan(args: argparse.Namespace) -> int:
    """``diloco-peer plan``: what the config needs on this machine, and whether it fits (``tools/plan.py``)."""
    from .config import load_config

    cfg = load_config(args.config, args.overrides)
    from .tools.plan import run_plan

    return run_plan(args, cfg)


def export(args: argparse.Namespace) -> int:
    """``diloco-peer export``: a checkpoint's outer weights as a Hugging Face Llama (``tools/export.py``)."""
    from .config import load_config

    cfg = load_config(args.config, args.overrides)
    _check_can_create(args.out, "--out", directory=True)
    from .tools.export import run_export

    return run_export(args, cfg)


COMMANDS = {"bootstrap": bootstrap, "keygen": keygen, "status": status, "join": join, "demo": demo,
            "simulate": simulate, "plot": plot, "prepare": prepare, "plan": plan, "export": export}
"""Each command's name (``cli.build_parser``'s sub-parsers) -> what runs it."""
