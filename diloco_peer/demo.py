"""``diloco-peer demo``: a whole swarm on this machine, as real processes, with a summary at the end.

    diloco-peer demo --peers 3 --rounds 5 --summary-json runs/demo/summary.json

It starts one bootstrap node and N peers, each exactly what ``diloco-peer bootstrap`` / ``join`` run,
talking over loopback. Peers get distinct data shards and leave by themselves after ``--rounds`` outer
rounds (``run.max_rounds``); the demo follows their event logs for live progress, then stops the
bootstrap, prints a per-round table, writes ``summary.json`` and ``loss.png`` into ``--out``.
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

from .config import load_config
from .events import EventFollower
from .report import format_table, plot_losses, summarize

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
    """A tqdm bar on a terminal; plain lines, one per finished round, when output goes to a file."""

    def __init__(self, peers: int, rounds: int):
        self.peers, self.rounds = peers, rounds
        self.bar = tqdm(total=peers * rounds, unit="round", desc="swarm", disable=not sys.stderr.isatty())
        self.seen: dict[int, list[dict]] = {}

    def update(self, new_rounds: list[dict]) -> None:
        for r in new_rounds:
            self.seen.setdefault(r["round"], []).append(r)
            self.bar.update(1)
            self.bar.set_postfix(round=r["round"], eval_loss=f"{r['eval_loss']:.3f}", group=r["group_size"])
            rows = self.seen[r["round"]]
            if self.bar.disable and len(rows) == self.peers:
                averaged = sum(x["outcome"] == "averaged" for x in rows)
                print(f"round {r['round']}/{self.rounds}: {averaged}/{self.peers} peers averaged, groups "
                      f"{sorted({x['group_size'] for x in rows})}, eval loss {r['eval_loss']:.4f}", flush=True)

    def close(self) -> None:
        self.bar.close()


def run_demo(args) -> int:
    if args.peers < 1 or args.rounds < 1:
        print(f"diloco-peer: error: --peers ({args.peers}) and --rounds ({args.rounds}) must be >= 1", file=sys.stderr)
        return 2
    cfg = load_config(args.config, args.overrides)
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
    logs = {f"peer-{i}": out / f"peer-{i}.jsonl" for i in range(args.peers)}
    print(f"demo: 1 bootstrap + {args.peers} peers, {args.rounds} outer rounds of H={cfg.outer.inner_steps} inner "
          f"steps, config {args.config or 'tiny-cpu'}; logs in {out}/", flush=True)
    with boot_log.open("w") as boot_out:
        bootstrap = subprocess.Popen(
            _python_cmd("bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--run-id", cfg.run.run_id,
                        "--report-every", "10"),
            stdout=boot_out, stderr=subprocess.STDOUT,
        )
    try:
        address = _wait_for_join_line(boot_log, bootstrap)
        print(f"demo: bootstrap node at {address}", flush=True)
        for i, name in enumerate(logs):
            # one shard per peer: each reads 1/N of the corpus rather than 1/64th of it
            sets = [f"data.num_shards={args.peers}", f"data.shard={i}", f"run.threads={threads}",
                    f"averaging.min_peers={args.peers}", *args.overrides,
                    f"run.max_rounds={args.rounds}", f"run.log_dir={json.dumps(str(out))}",
                    f"checkpoint.dir={json.dumps(str(out / 'checkpoints'))}"]
            cmd = _python_cmd("join", address, "--name", name, *(["--config", args.config] if args.config else []))
            for item in sets:
                cmd += ["--set", item]
            with (out / f"{name}.log").open("w") as peer_out:
                procs[name] = subprocess.Popen(cmd, stdout=peer_out, stderr=subprocess.STDOUT)
        progress = _Progress(args.peers, args.rounds)
        followers = [EventFollower(path) for path in logs.values()]
        while True:
            for follower in followers:
                progress.update([e for e in follower.new_events() if e["event"] == "round"])
            failed = {n: p.returncode for n, p in procs.items() if p.poll() not in (None, 0)}
            if failed:
                name, code = next(iter(failed.items()))
                progress.close()
                print(f"demo: {name} exited with code {code}; its last log lines:\n{_tail(out / f'{name}.log')}",
                      file=sys.stderr)
                return 1
            if all(p.poll() is not None for p in procs.values()):
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

    summary = summarize(logs, time.monotonic() - started, {n: p.returncode for n, p in procs.items()})
    summary["config"] = args.config or "tiny-cpu"
    summary_path = Path(args.summary_json) if args.summary_json else out / "summary.json"
    summary_path.parent.mkdir(parents=True, exist_ok=True)
    summary_path.write_text(json.dumps(summary, indent=2))
    png = plot_losses(logs, out / "loss.png")
    print(format_table(summary))
    print(f"demo: summary in {summary_path}, loss curves in {png}")
    return 0 if summary["rounds_completed"] == args.rounds else 1
