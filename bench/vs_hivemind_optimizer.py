"""Against the incumbent: the same model, data and link driven by hivemind's own hivemind.Optimizer in
local-updates mode (the engine OpenDiLoCo builds on): time per round and utilization side by side.

    sudo .venv/bin/python bench/vs_hivemind_optimizer.py --quick   # H=30, 2 measured rounds each (~2.5 min)
    sudo .venv/bin/python bench/vs_hivemind_optimizer.py           # H=60, 5 measured rounds each (~6 min)
    sudo .venv/bin/python bench/vs_hivemind_optimizer.py --set model.hidden_size=192 --ours outer.overlap=blocking

Both sides: 3 peers, each a process in its own namespace of a ``SlowNetwork(3, --mbit)`` (50 Mbit/s up and
down by default), the project's model (``build_model``, same seed), its data (``Corpus``: peer i reads shard
i of 3) and its inner AdamW (decay/no-decay groups, betas, clipping, warmup + cosine), one torch thread each,
with swarm_bench's settings (``swarm_bench.BASE``) plus ``--set``; H inner steps of ``inner.batch_size`` per round.

hivemind side (this file, ``--peer i``): peer 0 starts a DHT on its namespace address, the others join it;
each wraps its AdamW in ``hivemind.Optimizer(use_local_updates=True, target_batch_size = peers x H x batch,
batch_size_per_step=batch)``: every ``.step()`` is a local AdamW step, and when the swarm has (by its
progress tracker's estimate) accumulated target_batch_size samples, the epoch ends and the parameters are
averaged (``matchmaking_time``, ``averaging_timeout`` and ``request_timeout`` as our [averaging] section;
``average_state_every=1``). Stock settings otherwise: the average runs in a background thread and is applied
with the delta rule (``delay_state_averaging=True``); ``--hivemind-blocking`` averages inside ``.step()``,
as OpenDiLoCo's pseudo-gradient all-reduce does. (Found here: with a synchronous inner step, the next
``.step()`` after an epoch's end waits for that "background" round, matchmaking included:
``TrainingStateAverager.step`` waits for pending updates whenever it runs an optimizer step under the
delta rule.) A round = one hivemind epoch; the local steps per epoch vary around H (the tracker ends an
epoch on its estimate of the swarm's samples) and are printed. Per peer, over the rounds after the first
``--skip`` (start-up: hivemind's first two epochs can be 1-3 local steps long), wall time per round and
utilization = compute / wall, where compute = batch sampling + forward + backward + clipping + the inner AdamW
step (timed by optimizer hooks, so hivemind's progress reports and averaging inside ``.step()`` count as not
computing), as our Trainer's timer counts.

our side: ``swarm_bench.run_swarm`` (diloco-peer join processes) with the same overrides plus ``--ours``;
utilization = compute_seconds / round_seconds of its round events (definitions in swarm_bench.py).
Figure ``vs_hivemind_optimizer``: value = our utilization, baseline = hivemind.Optimizer's.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from results import figure, save  # noqa: E402

from diloco_peer.tools.netbed import SlowNetwork, available  # noqa: E402

PEERS = 3


def peer_config(args: argparse.Namespace, index: int):
    from swarm_bench import BASE  # the settings of our side's peers, so both train the same thing

    from diloco_peer.config import load_config

    return load_config(None, [*BASE, f"outer.inner_steps={args.H}", *args.overrides,
                              f"data.num_shards={PEERS}", f"data.shard={index}"])


def net_bytes() -> int:
    """Bytes through eth0 of this process's namespace, both directions (DHT traffic included)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        if line.strip().startswith("eth0:"):
            fields = line.split(":")[1].split()
            return int(fields[0]) + int(fields[8])
    return 0


def wait_for(path: Path, seconds: float = 120) -> str:
    deadline = time.monotonic() + seconds
    while not (path.exists() and path.read_text().strip()):
        if time.monotonic() > deadline:
            sys.exit(f"vs_hivemind_optimizer: {path.name} did not appear within {seconds:.0f}s")
        time.sleep(0.1)
    return path.read_text().strip()


def hivemind_peer(args: argparse.Namespace) -> None:
    """One hivemind.Optimizer peer (runs inside its namespace); writes peer-<i>.json into the workdir."""
    import hivemind
    import torch

    from diloco_peer.training.data import Corpus
    from diloco_peer.training.model import build_model
    from diloco_peer.training.trainer import lr_factor

    i, work = args.peer, Path(args.workdir)
    cfg = peer_config(args, i)
    torch.set_num_threads(cfg.run.threads)
    inner, batch = cfg.inner, cfg.inner.batch_size * cfg.inner.grad_accum
    initial = [] if i == 0 else [wait_for(work / "peer-0.addr")]
    dht = hivemind.DHT(start=True, host_maddrs=[f"/ip4/{args.address}/tcp/0"], initial_peers=initial)
    if i == 0:
        (work / "peer-0.addr.tmp").write_text(str(dht.get_visible_maddrs()[0]))
        (work / "peer-0.addr.tmp").rename(work / "peer-0.addr")
    corpus = Corpus(cfg.data, i, cfg.model.vocab_size)
    model = build_model(cfg.model, cfg.run.seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    adamw = torch.optim.AdamW([{"params": decay, "weight_decay": inner.weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}], lr=inner.lr, betas=tuple(inner.betas))
    inner_step = {"started": 0.0, "seconds": 0.0}  # the AdamW step runs inside hivemind's .step(): time it there
    adamw.register_step_pre_hook(lambda *_: inner_step.update(started=time.perf_counter()))
    adamw.register_step_post_hook(lambda *_: inner_step.update(
        seconds=inner_step["seconds"] + time.perf_counter() - inner_step["started"]))
    opt = hivemind.Optimizer(
        dht=dht, run_id="bench-hivemind", optimizer=adamw, use_local_updates=True,
        target_batch_size=PEERS * cfg.outer.inner_steps * batch, batch_size_per_step=batch,
        matchmaking_time=cfg.averaging.matchmaking_time, averaging_timeout=cfg.averaging.allreduce_timeout,
        averager_opts={"request_timeout": cfg.averaging.request_timeout},
        tracker_opts={"max_refresh_period": 2},  # as OpenDiLoCo sets it
        delay_state_averaging=not args.hivemind_blocking, verbose=True)
    (work / f"ready-{i}").write_text("1")
    for j in range(PEERS):  # start together: nobody trains alone while the others still import torch
        wait_for(work / f"ready-{j}")

    compute, in_step, longest, steps, epoch, marks = 0.0, 0.0, 0.0, 0, opt.local_epoch, []
    deadline = time.monotonic() + args.timeout
    model.train()
    while opt.local_epoch < args.skip + args.rounds + 1 and time.monotonic() < deadline:
        started = time.perf_counter()
        for group in adamw.param_groups:
            group["lr"] = inner.lr * lr_factor(steps, inner)
        for _ in range(inner.grad_accum):
            tokens = corpus.train_batch(inner.batch_size)
            (model(tokens[:, :-1], tokens[:, 1:]) / inner.grad_accum).backward()
        if inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), inner.grad_clip)
        before = inner_step["seconds"]
        forward_backward = time.perf_counter() - started
        stepping = time.perf_counter()
        opt.step()  # AdamW step + progress report + (at an epoch's end) averaging
        hivemind_seconds = time.perf_counter() - stepping - (inner_step["seconds"] - before)
        in_step, longest = in_step + hivemind_seconds, max(longest, hivemind_seconds)
        model.zero_grad(set_to_none=True)
        compute += forward_backward + inner_step["seconds"] - before
        steps += 1
        if opt.local_epoch != epoch:
            epoch = opt.local_epoch
            marks.append({"epoch": epoch, "time": time.perf_counter(), "compute": compute, "in_step": in_step,
                          "longest": longest, "steps": steps,
                          "bytes": net_bytes()})
            longest = 0.0  # the longest hivemind part of one .step() call, per epoch
    (work / f"peer-{i}.json").write_text(json.dumps({"marks": marks, "parameters": sum(p.numel() for p in
                                                                                        model.parameters())}))
    opt.shutdown()
    dht.shutdown()


def run_hivemind(net: SlowNetwork, args: argparse.Namespace, work: Path) -> dict:
    work.mkdir(parents=True)
    procs = []
    try:
        for i in range(PEERS):
            argv = [sys.executable, __file__, "--peer", str(i), "--address", net.address(i), "--workdir", str(work),
                    "--H", str(args.H), "--rounds", str(args.rounds), "--skip", str(args.skip),
                    "--timeout", str(args.timeout),
                    *(["--hivemind-blocking"] if args.hivemind_blocking else []),
                    *[x for item in args.overrides for x in ("--set", item)]]
            log = open(work / f"peer-{i}.log", "w")
            procs.append(net.run(i, argv, stdout=log, stderr=log, cwd=ROOT))
        deadline = time.monotonic() + args.timeout + 120
        while True:  # fail as soon as any peer fails, not at the deadline
            failed = [i for i, proc in enumerate(procs) if proc.poll()]
            if failed or time.monotonic() > deadline:
                i = failed[0] if failed else 0
                tail = (work / f"peer-{i}.log").read_text()[-1500:]
                sys.exit(f"vs_hivemind_optimizer: hivemind peer {i} failed or hung (exit {procs[i].poll()}):\n{tail}")
            if all(proc.poll() == 0 for proc in procs):
                break
            time.sleep(0.5)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    per_peer = []
    for i in range(PEERS):
        result = json.loads((work / f"peer-{i}.json").read_text())
        marks = {m["epoch"]: m for m in result["marks"]}  # an epoch may be skipped by a state download
        if args.skip not in marks or args.skip + args.rounds not in marks:
            sys.exit(f"vs_hivemind_optimizer: hivemind peer {i} did not pass epochs {args.skip}.."
                     f"{args.skip + args.rounds} "
                     f"(passed {sorted(marks)}); see {work}/peer-{i}.log")
        first, last = marks[args.skip], marks[args.skip + args.rounds]
        wall = last["time"] - first["time"]
        log = (work / f"peer-{i}.log").read_text()
        epochs = sorted(marks)
        per_peer.append({
            "utilization": (last["compute"] - first["compute"]) / wall, "seconds_per_round": wall / args.rounds,
            "bytes_per_peer_round": (last["bytes"] - first["bytes"]) / args.rounds,
            "in_step": (last["in_step"] - first["in_step"]) / args.rounds,
            "longest": [round(marks[e]["longest"], 2) for e in epochs[1:]],
            "steps_per_round": [marks[b]["steps"] - marks[a]["steps"] for a, b in zip(epochs, epochs[1:])],
            "averaged": len(re.findall(r"Averaged parameters with (\d+) peers", log)),
            "groups": sorted({int(n) for n in re.findall(r"Averaged parameters with (\d+) peers", log)}),
            "failed": log.count("Averaging failed"), "parameters": result["parameters"]})
    return per_peer


def print_hivemind(hm: list[dict], args: argparse.Namespace) -> tuple[float, float, float]:
    """The hivemind side's per-peer table; returns its mean utilization, seconds and bytes per round."""
    print(f"{'hivemind peer':>13} {'s/round':>8} {'util':>6} {'in .step':>8} {'MB/round':>9} {'averaged':>8} "
          f"{'failed':>6}  "
          f"local steps per epoch (H={args.H})")
    for i, p in enumerate(hm):
        print(f"{i:>13} {p['seconds_per_round']:>8.2f} {p['utilization']:>6.3f} {p['in_step']:>8.2f} "
              f"{p['bytes_per_peer_round'] / 1e6:>9.2f} "
              f"{p['averaged']:>8} {p['failed']:>6}  {p['steps_per_round']} groups {p['groups']}, longest "
              f"pause in .step per epoch {p['longest']} s")
    hm_util = statistics.mean(p["utilization"] for p in hm)
    hm_spr = statistics.mean(p["seconds_per_round"] for p in hm)
    hm_bytes = statistics.mean(p["bytes_per_peer_round"] for p in hm)
    return hm_util, hm_spr, hm_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="H=30, 2 measured rounds per side (~2.5 min)")
    parser.add_argument("--mbit", type=float, default=50.0, help="link rate of every peer, up and down (default 50)")
    parser.add_argument("--H", type=int, default=None, help="inner steps per round (default 60; quick 30)")
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds after the first --skip (default "
                        "5; quick 2)")
    parser.add_argument("--skip", type=int, default=2, help="start-up rounds not measured, each side (default 2: "
                        "hivemind's first two epochs took 1-3 local steps each in two quick runs)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for both sides, e.g. --set model.hidden_size=192")
    parser.add_argument("--ours", action="append", default=None, metavar="KEY=VALUE",
                        help="override for our side only (default: outer.overlap=eager, as hivemind overlaps too)")
    parser.add_argument("--hivemind-blocking", action="store_true",
                        help="hivemind averages inside .step() (delay_state_averaging=False), like OpenDiLoCo")
    parser.add_argument("--hivemind-only", action="store_true", help="measure the hivemind side only (no figure)")
    parser.add_argument("--timeout", type=float, default=480.0, help="seconds a side may take (default 480)")
    for internal in ("--peer", "--address", "--workdir"):  # a hivemind peer process, started by main()
        parser.add_argument(internal, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.H = args.H or (30 if args.quick else 60)
    args.rounds = args.rounds or (2 if args.quick else 5)
    ours = args.ours if args.ours is not None else ["outer.overlap=eager"]
    if args.peer is not None:
        args.peer = int(args.peer)
        return hivemind_peer(args)
    # SIGTERM (a CI timeout) must unwind like Ctrl+C: the namespaces are removed on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("vs_hivemind_optimizer: terminated"))
    if why := available():
        sys.exit(f"vs_hivemind_optimizer: {why} (run as root)")
    from swarm_bench import run_swarm

    from diloco_peer.config import ConfigError

    try:
        cfg = peer_config(args, 0)
        peer_config(argparse.Namespace(H=args.H, overrides=[*args.overrides, *ours]), 0)
    except ConfigError as e:
        sys.exit(f"vs_hivemind_optimizer: {e}")
    hm_mode = "blocking" if args.hivemind_blocking else "background (delta rule)"
    print(f"{PEERS} peers on {args.mbit:g} Mbit/s links, H={args.H}, batch {cfg.inner.batch_size}x{cfg.data.seq_len}, "
          f"{args.rounds} measured rounds after the first {args.skip}; hivemind averaging {hm_mode}; ours {ours}; "
          f"overrides {args.overrides or 'none'}", flush=True)
    with tempfile.TemporaryDirectory(prefix="dlp-vs-hivemind-") as tmp:
        started = time.monotonic()
        with SlowNetwork(PEERS, args.mbit) as net:
            hm = run_hivemind(net, args, Path(tmp) / "hivemind")
        print(f"hivemind.Optimizer side done in {time.monotonic() - started:.0f}s", flush=True)
        started = time.monotonic()
        if args.hivemind_only:
            return print_hivemind(hm, args)
        with SlowNetwork(PEERS, args.mbit) as net:
            us = run_swarm(net, [f"outer.inner_steps={args.H}", *args.overrides, *ours], args.rounds + args.skip,
                           Path(tmp) / "ours", skip=args.skip)
        print(f"diloco-peer side done in {time.monotonic() - started:.0f}s\n", flush=True)
    hm_util, hm_spr, hm_bytes = print_hivemind(hm, args)
    print(f"\n{'':<22} {'s/round':>8} {'utilization':>11} {'MB/peer/round':>13}")
    print(f"{'hivemind.Optimizer':<22} {hm_spr:>8.2f} {hm_util:>11.3f} {hm_bytes / 1e6:>13.2f}  "
          f"(eth0 bytes, DHT incl.)")
    print(f"{'diloco-peer':<22} {us['seconds_per_round']:>8.2f} {us['utilization']:>11.3f} "
          f"{us['bytes_per_peer_round'] / 1e6:>13.2f}  (all-reduce payload), "
          f"averaged {us.get('averaged_fraction', 0):.0%}")
    print(f"ours / hivemind: utilization x{us['utilization'] / hm_util:.3f}, time per round "
          f"x{us['seconds_per_round'] / hm_spr:.3f}")
    codec = next((o.split("=", 1)[1] for o in [*args.overrides, *ours] if o.startswith("averaging.compression=")),
                 "none")
    overlap = next((o.split("=", 1)[1] for o in [*args.overrides, *ours] if o.startswith("outer.overlap=")),
                   "blocking")
    save([figure("vs_hivemind_optimizer", round(us["utilization"], 4), round(hm_util, 4), link_mbit=args.mbit,
                 model_params=hm[0]["parameters"], H=args.H, batch=f"{cfg.inner.batch_size}x{cfg.data.seq_len}",
                 codec=codec, overlap=overlap, hivemind_averaging=hm_mode, overrides=args.overrides,
                 rounds=args.rounds, skip=args.skip, mode="quick" if args.quick else "full",
                 seconds_per_round={"ours": round(us["seconds_per_round"], 3), "hivemind": round(hm_spr, 3)})])
    print("wrote figure vs_hivemind_optimizer to bench/results.json")


if __name__ == "__main__":
    main()
