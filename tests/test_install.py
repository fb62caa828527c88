"""What users install is what we test: a wheel built from a clean tree, installed into a fresh venv and run
from a directory that has nothing to do with the checkout (the README's `pip install .`, the Dockerfile's);
and the compose file's services run as local processes from that install (no Docker engine here: the
closest honest check of `docker compose up`)."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import FAST, LocalSwarm, orphaned_p2pd_pids, wait_for_line, wait_until
from helpers import free_port

ROOT = Path(__file__).resolve().parent.parent
PRESETS = ROOT / "configs"
CPU_PRESETS = {"tiny-cpu"}  # the shipped configs that train on a CPU; the others need a GPU and `.[hf]` data
EXIT_UNREACHABLE = 3  # cli.EXIT_UNREACHABLE: no bootstrap answered within swarm.join_timeout


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _dockerfile(instruction: str) -> list[str]:
    """A JSON-form instruction of the Dockerfile, e.g. ENTRYPOINT -> ["diloco-peer"]."""
    return json.loads(re.search(rf"^{instruction} (\[.*\])$", (ROOT / "Dockerfile").read_text(), re.M).group(1))


def test_image_and_compose_services_get_what_their_commands_need():
    """The Dockerfile copies only paths that exist and are not docker-ignored, installs non-editable (the
    sources are deleted after), and every compose service's `--config NAME` is a shipped config whose data
    its image can read: an `hf` config needs the `hf` extra (EXTRAS build arg), or the peer dies at its
    first batch."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line.strip()]
    for copy in re.findall(r"^COPY (.+)$", dockerfile, re.M):
        for source in copy.split()[:-1]:
            assert (ROOT / source).exists(), f"Dockerfile copies {source}, which does not exist"
            assert not any(fnmatch.fnmatch(source, pattern) for pattern in ignored), f"{source} is docker-ignored"
    installs = re.findall(r"pip install [^\n]*", dockerfile)
    assert installs and not any(re.search(r"\s(-e|--editable)\b", line) for line in installs), installs

    for name, service in _compose()["services"].items():
        build = service.get("build")
        extras = str((build.get("args") or {}).get("EXTRAS", "")) if isinstance(build, dict) else ""
        for config in re.findall(r"--config[ =](\S+)", " ".join(map(str, service.get("command") or []))):
            path = PRESETS / f"{config}.toml"
            assert path.is_file(), f"service {name}: --config {config} is not a shipped config"
            if tomllib.loads(path.read_text())["data"]["source"] == "hf":
                assert "hf" in extras.split(","), f"service {name} runs {config} (hf data) without EXTRAS=hf"


@dataclass
class Install:
    """The clean tree, the wheel built from it and the fresh venv it is installed in; ``env`` puts that venv
    first on PATH."""

    tree: Path
    wheel: Path
    venv: Path
    site_packages: Path
    env: dict

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)


def _clean_tree(dest: Path) -> Path:
    """The checkout as a fresh clone plus its new files would be: what git tracks and what it does not ignore
    (no .venv, no egg-info, no build leftovers, nothing generated)."""
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        if (ROOT / rel).is_file():  # a tracked file deleted in the working tree is listed too
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    return dest


def _site_packages(python: Path | str) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                         check=True, capture_output=True, text=True).stdout
    return Path(out.strip())


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Install:
    """Build the wheel (offline, no build isolation: setuptools comes from the dev venv) and install it alone
    into a fresh venv. torch, hivemind and the rest come from the dev venv through a .pth file: a path line
    there is only appended to sys.path, the .pth files inside that directory (the editable install's finder
    among them) are not run, so the checkout cannot be imported and diloco_peer can only come from the wheel."""
    base = tmp_path_factory.mktemp("install")
    tree = _clean_tree(base / "tree")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            "--wheel-dir", str(base / "dist"), str(tree)], cwd=tree, capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    [wheel] = (base / "dist").glob("diloco_peer-*.whl")

    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = subprocess.run([venv / "bin" / "python", "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                          "--disable-pip-version-check", str(wheel)], capture_output=True, text=True)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    site_packages = _site_packages(venv / "bin" / "python")
    dev_paths = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
    (site_packages / "dev-venv-dependencies.pth").write_text("".join(f"{p}\n" for p in dev_paths))
    env = {"PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "PYTHONPATH": "", "VIRTUAL_ENV": str(venv)}
    return Install(tree, wheel, venv, site_packages, env)


@pytest.mark.slow
def test_wheel_from_a_clean_tree_ships_every_module_and_config(installed, tmp_path):
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    sources = {p.relative_to(installed.tree).as_posix() for p in (installed.tree / "diloco_peer").rglob("*.py")}
    assert sources - names == set(), "modules missing from the wheel"
    presets = {f"diloco_peer/configs/{name}.toml" for name in ("tiny-cpu", "llama-150m", "llama-1b")}
    assert presets <= names and {f"diloco_peer/configs/{p.name}" for p in PRESETS.glob("*.toml")} <= names

    # run from elsewhere, the fresh venv's python imports the installed copy, never the checkout
    probe = subprocess.run([installed.bin("python"), "-c", "import json, sys, diloco_peer.config as c; "
                            "print(c.__file__); print(c.CONFIG_DIR); print(json.dumps(sys.path))"],
                           cwd=tmp_path, env={**os.environ, **installed.env}, capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr
    module, config_dir, path = probe.stdout.splitlines()
    assert Path(module).is_relative_to(installed.site_packages), module
    assert Path(config_dir).is_relative_to(installed.site_packages), config_dir
    assert str(ROOT) not in json.loads(path), path


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_installed_demo_three_peers_average_every_round_bit_identical_from_any_directory(installed,
                                                                                         local_swarm: LocalSwarm):
    """The README's first command as a user meets it: the installed ``diloco-peer demo``, run from a directory that
    is not the checkout. Every round averaged by all three peers, bit-identical replicas after each, the loss
    down, and every process the demo started gone afterwards, libp2p daemons included."""
    before = orphaned_p2pd_pids()  # (the in-process tests beside this one start daemons of their own)
    cmd = [installed.bin("diloco-peer"), "demo", "--peers", "3", "--rounds", "3", "--out", "demo", "--timeout", "300",
           "--summary-json", "summary.json"]
    for item in FAST:
        cmd += ["--set", item]
    demo = local_swarm.spawn_external(cmd, "demo.log", installed.env)
    demo.wait(timeout=360)
    output = (local_swarm.workdir / "demo.log").read_text()
    assert demo.returncode == 0, output[-3000:]
    table = [line.split()[:2] for line in output.splitlines() if line.split()]
    assert ["1", "3/3"] in table, output[-3000:]  # round 1: all three peers averaged
    assert "replicas identical: True" in output, output[-3000:]
    summary = json.loads((local_swarm.workdir / "summary.json").read_text())
    assert summary["rounds_completed"] == 3 and len(summary["peers"]) == 3
    assert all(p["exit_code"] == 0 for p in summary["peers"])
    assert len(summary["rounds"]) == 9
    for record in summary["rounds"]:
        assert record["outcome"] == "averaged" and record["group_size"] == 3, record
        assert record["bytes_sent"] > 0 and record["bytes_received"] > 0 and record["allreduce_seconds"] > 0
        assert record["values_not_averaged"] == 0
    for rnd in (1, 2, 3):
        hashes = {r["param_sha256"] for r in summary["rounds"] if r["round"] == rnd}
        assert len(hashes) == 1, f"replicas differ after round {rnd}"
    assert summary["replicas_identical"] is True and len(set(summary["param_sha256"].values())) == 1
    # 30 inner steps of a byte-level model: from ln(256) ~ 5.5 to well under 4
    assert summary["eval_loss_last"] < summary["eval_loss_first"] - 1.0
    batch, seq_len = (next(int(item.split("=")[1]) for item in FAST if item.startswith(key))
                      for key in ("inner.batch_size=", "data.seq_len="))
    assert summary["tokens_total"] == 3 * 3 * 10 * batch * seq_len  # peers, rounds, steps, sequences, tokens
    assert 0 < summary["compute_seconds"] and 0 < summary["wall_seconds"] < 300
    out = local_swarm.workdir / "demo"
    assert (out / "loss.png").stat().st_size > 10_000
    for p in range(3):  # every round whole: no warning of a part missing (hivemind logs one for a failed part)
        assert "received" not in (out / f"peer-{p}.log").read_text()
    pids = [json.loads(line)["pid"] for p in range(3) for line in (out / f"peer-{p}.jsonl").read_text().splitlines()
            if json.loads(line)["event"] == "start"]
    assert len(pids) == 3
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}"), f"peer process {pid} is still running"
    assert orphaned_p2pd_pids() <= before, "a p2pd daemon outlived its peer"


class ComposeOnLoopback:
    """The compose file's services as local processes: each named volume and the image's VOLUME become a
    temporary directory, every port the file publishes or probes becomes a free port on 127.0.0.1."""

    def __init__(self, root: Path):
        compose = _compose()
        self.services, self.root = compose["services"], root
        self.entrypoint = _dockerfile("ENTRYPOINT")
        self.image_volumes = _dockerfile("VOLUME")
        probed = re.findall(r"127\.0\.0\.1:(\d+)", json.dumps(compose))
        published = [str(p).split(":")[-1] for s in self.services.values() for p in s.get("ports", [])]
        self.ports = {port: str(free_port()) for port in {*probed, *published}}

    def volume(self, name: str) -> Path:
        path = self.root / "volumes" / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def localize(self, service: str, arg: str) -> str:
        """One argument as it would run in the service's container, moved to this machine."""
        mounts = {path: self.root / service / path.strip("/") for path in self.image_volumes}
        for spec in self.services[service].get("volumes", []):
            name, path = spec.split(":")[:2]
            if not name.startswith("."):  # named volumes; bind mounts (./deploy/...) are no peer's business
                mounts[path] = self.volume(name)
        for host in mounts.values():
            host.mkdir(parents=True, exist_ok=True)
        arg = re.sub(r"\b(\d+)\b", lambda m: self.ports.get(m.group(), m.group()), arg)
        paths = "|".join(re.escape(p) for p in sorted(mounts, key=len, reverse=True))
        arg = re.sub(rf"({paths})(?![\w.-])", lambda m: str(mounts[m.group()]), arg)
        return arg.replace("0.0.0.0", "127.0.0.1").replace("$$", "$")  # $$: compose's escape of a shell $

    def command(self, service: str) -> list[str]:
        svc = self.services[service]
        return [self.localize(service, a) for a in [*svc.get("entrypoint", self.entrypoint), *svc["command"]]]

    def healthy(self, service: str, env: dict) -> bool:
        kind, *cmd = self.services[service]["healthcheck"]["test"]
        assert kind == "CMD", kind
        cmd = [shutil.which(cmd[0], path=env["PATH"]), *(self.localize(service, a) for a in cmd[1:])]
        return subprocess.run(cmd, capture_output=True, env={**os.environ, **env}, timeout=30).returncode == 0


def _rounds(path: Path) -> list[dict]:
    if not path.exists():
        return []
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e for e in events if e["event"] == "round"]


def _stop(proc, log: Path) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_installed_cli_runs_every_shipped_config_and_the_compose_services(installed, local_swarm: LocalSwarm):
    work, env = local_swarm.workdir, installed.env
    compose = ComposeOnLoopback(work / "compose")
    bootstrap = local_swarm.spawn_external(compose.command("bootstrap"), "bootstrap.log", env)
    address = wait_for_line(work / "bootstrap.log", "diloco-peer join ", bootstrap).split()[2]
    assert (compose.volume("shared") / "bootstrap.addr").read_text().strip() == address
    wait_until(lambda: compose.healthy("bootstrap", env), "healthy bootstrap (its compose healthcheck)", 60)

    presets = sorted(p.stem for p in (installed.site_packages / "diloco_peer/configs").glob("*.toml"))
    assert presets == sorted(p.stem for p in PRESETS.glob("*.toml")) and CPU_PRESETS <= set(presets)
    # the configs that cannot train here: found and validated, then exit 3 from a bootstrap nobody answers
    # (a config that is not found or not valid exits 2 before any joining)
    nobody = re.sub(r"/tcp/\d+/", f"/tcp/{free_port()}/", address)
    joins = {}
    for name in presets:
        trains = name in CPU_PRESETS
        target, sets = (address, [*FAST, "run.max_rounds=1"]) if trains else (nobody, ["swarm.join_timeout=1"])
        # (--no-fit-check: llama-1b needs ~100 GB here and would be refused before joining, see test_plan.py)
        cmd = [installed.bin("diloco-peer"), "join", target, "--config", name, "--name", name,
               *([] if trains else ["--no-fit-check"])]
        for item in [*sets, f"run.log_dir={json.dumps(str(work / 'runs'))}"]:
            cmd += ["--set", item]
        joins[name] = local_swarm.spawn_external(cmd, f"{name}.log", env)

    # the compose peer (tiny-cpu too, so the tiny-cpu peer above averages with it), with the tests' speed knobs
    peer_cmd = compose.command("peer")
    peer_cmd[-1] += "".join(f" --set {shlex.quote(item)}" for item in FAST)
    peer = local_swarm.spawn_external(peer_cmd, "peer.log", env)

    for name, proc in joins.items():
        expected = 0 if name in CPU_PRESETS else EXIT_UNREACHABLE
        assert proc.wait(timeout=180) == expected, f"{name}: " + (work / f"{name}.log").read_text()[-3000:]
        if name in CPU_PRESETS:
            assert [r["outcome"] for r in _rounds(work / "runs" / f"{name}.jsonl")] == ["averaged"]
        else:
            assert "could not reach any bootstrap peer" in (work / f"{name}.log").read_text()
    peer_events = compose.root / "peer" / "data" / "runs"
    wait_until(lambda: any(r["outcome"] == "averaged" for p in peer_events.glob("*.jsonl") for r in _rounds(p)),
               "averaged round of the compose peer", 60)
    assert compose.healthy("peer", env), (work / "peer.log").read_text()[-3000:]
    _stop(peer, work / "peer.log")  # `docker compose stop`: SIGTERM, a checkpoint, a clean leave
    assert list(compose.volume("checkpoints").iterdir()), "the compose peer left no checkpoint in its volume"
    _stop(bootstrap, work / "bootstrap.log")
