"""What `docker compose up` deploys, tested with the real parts: the compose file against Debian's
docker-compose, the dashboards against a real Prometheus scraping a real local swarm (whose peers' own health and
metrics endpoints are checked in the same run)."""

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import diloco_cmd, require_tool
from helpers import free_port
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARDS = [GRAFANA / "dashboards" / name for name in ("peer.json", "swarm.json")]
"""Every dashboard we ship, named: a missing one fails the tests that read them, an unnamed one the first test."""


def test_the_dashboards_are_the_ones_named_and_provisioned_with_the_datasource_they_use():
    """What Grafana would load, checked without Grafana: compose mounts the provisioning and dashboard folders
    where the provisioning files expect them, and every panel, query and variable names the provisioned datasource."""
    assert sorted((GRAFANA / "dashboards").glob("*.json")) == sorted(DASHBOARDS)  # (a new one: name it above)
    grafana = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["grafana"]
    mounts = dict(volume.split(":")[:2] for volume in grafana["volumes"] if volume.startswith("./"))
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning", mounts
    mounted = mounts["./deploy/grafana/dashboards"]
    [provider] = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "diloco.yml").read_text())["providers"]
    assert provider["type"] == "file" and provider["options"]["path"] == mounted, (provider, mounted)
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert Path(home).parent == Path(mounted) and (GRAFANA / "dashboards" / Path(home).name).is_file(), home
    [source] = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090", source
    uids = []
    for dashboard in DASHBOARDS:
        board = json.loads(dashboard.read_text())
        uids.append(board["uid"])
        named = [(f"variable {v['name']}", v["datasource"]) for v in board["templating"]["list"] if "datasource" in v]
        for panel in board["panels"]:
            assert panel["targets"], f"{dashboard.name}: '{panel['title']}' has no query"
            named += [(f"'{panel['title']}'", panel["datasource"])]
            named += [(f"'{panel['title']}' {t['refId']}", t["datasource"])
                      for t in panel["targets"] if "datasource" in t]
        wrong = [f"{dashboard.name}: {what}: {ds}" for what, ds in named
                 if ds != {"type": "prometheus", "uid": source["uid"]}]
        assert not wrong, f"not the provisioned datasource (uid {source['uid']!r}):\n" + "\n".join(wrong)
    assert len(set(uids)) == len(uids), uids


@pytest.mark.slow
@pytest.mark.light
def test_compose_file_is_valid_and_deploys_the_whole_stack():
    require_tool("docker-compose", "docker-compose")
    for profile in ([], ["--profile", "gpu"]):
        result = subprocess.run(["docker-compose", *profile, "-f", str(ROOT / "docker-compose.yml"), "config"],
                                capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    assert {"bootstrap", "peer", "peer-gpu", "prometheus", "grafana"} <= set(services)
    peer = services["peer"]
    assert peer["depends_on"]["bootstrap"]["condition"] == "service_healthy"
    assert "healthcheck" in services["bootstrap"] and "healthcheck" in peer
    assert "container_name" not in peer and "ports" not in peer  # so that `--scale peer=N` works
    grace = peer["stop_grace_period"]
    assert grace.endswith("s") and int(grace[:-1]) > 30  # longer than the daemon's own run.shutdown_grace
    assert services["peer-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    mounts = " ".join(str(v) for v in peer["volumes"])
    assert "checkpoints" in mounts and "identity" in mounts
    for dashboard in DASHBOARDS:  # provisioned from the folder grafana mounts
        assert json.loads(dashboard.read_text())["panels"]


def _query(port: int, expr: str) -> list:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return body["data"]["result"]


def _prometheus_config(bootstrap_port: int, peer_ports: list[int]) -> dict:
    """The compose config with its targets moved to loopback: DNS discovery of the peers becomes a static list."""
    cfg = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    cfg["global"]["scrape_interval"] = cfg["global"]["evaluation_interval"] = "1s"
    jobs = {job["job_name"]: job for job in cfg["scrape_configs"]}
    jobs["diloco-bootstrap"]["static_configs"] = [{"targets": [f"127.0.0.1:{bootstrap_port}"]}]
    del jobs["diloco-peer"]["dns_sd_configs"]
    jobs["diloco-peer"]["static_configs"] = [{"targets": [f"127.0.0.1:{p}" for p in peer_ports]}]
    return cfg


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_a_real_swarm_serves_metrics_and_health_and_every_dashboard_panel_shows_its_data(local_swarm, tmp_path):
    """One swarm for both: a peer's own /healthz and /metrics after its second round (what test_metrics.py's
    in-process tests feed from events, served over HTTP by a running peer), then every dashboard panel's query on a
    real Prometheus scraping the bootstrap and both peers, and ``status``; the peers leave on SIGTERM and their
    metrics servers go with them."""
    boot_port, prom_port, peer_ports = free_port(), free_port(), [free_port(), free_port()]
    address = local_swarm.start_bootstrap("--metrics-port", str(boot_port))
    sets = ["averaging.min_peers=2", "outer.inner_steps=5", f"checkpoint.dir={json.dumps(str(tmp_path / 'ckpt'))}"]
    procs = [local_swarm.start_peer(f"p{i}", *sets, f"metrics.port={port}") for i, port in enumerate(peer_ports)]
    prometheus = None
    if shutil.which("prometheus"):  # (missing: the metrics are checked, the dashboards' part skips at its turn)
        config = tmp_path / "prometheus.yml"
        config.write_text(yaml.safe_dump(_prometheus_config(boot_port, peer_ports)))
        prometheus = local_swarm.spawn_external(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"], "prometheus.log")

    # a peer serves its health and metrics
    local_swarm.wait_for("p0's second round", lambda: len(local_swarm.events("p0", "round")) >= 2, timeout=180)
    base = f"http://127.0.0.1:{peer_ports[0]}"
    code, body = _get(f"{base}/healthz")
    assert code == 200 and json.loads(body)["status"] == "training", body
    code, text = _get(f"{base}/metrics")
    assert code == 200
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    averaged = sum(e["outcome"] == "averaged" for e in local_swarm.events("p0", "round"))
    assert samples[("diloco_outer_rounds_total", (("outcome", "averaged"),))] >= averaged >= 1
    assert samples[("diloco_outer_epoch", ())] >= 2 and samples[("diloco_tokens_total", ())] > 0
    assert samples[("diloco_sent_bytes_total", (("kind", "pseudo_gradient"),))] > 0
    assert samples[("diloco_phase_seconds_total", (("phase", "compute"),))] > 0
    assert samples[("diloco_last_outer_step_timestamp_seconds", ())] > time.time() - 120
    assert _get(f"{base}/nothing-here")[0] == 404

    # every dashboard panel shows data: enough history for rate() and increase(), several rounds scraped every second
    require_tool("prometheus", "prometheus")
    deadline = time.monotonic() + 240
    while True:
        assert time.monotonic() < deadline, (local_swarm.workdir / "prometheus.log").read_text()[-3000:]
        assert prometheus.poll() is None, (local_swarm.workdir / "prometheus.log").read_text()[-3000:]
        rounds = [e for e in local_swarm.events("p1") if e["event"] == "round"]
        try:
            up = _query(prom_port, "up == 1")
        except OSError:
            up = []
        if len(rounds) >= 4 and len(up) == 3 and len(_query(prom_port, "diloco_swarm_peers == 2")) == 1:
            break
        time.sleep(1)
    time.sleep(3)

    empty = []
    for dashboard in DASHBOARDS:
        panels = json.loads(dashboard.read_text())["panels"]
        for panel in panels:
            for target in panel["targets"]:
                expr = target["expr"].replace("$instance", ".*")
                if not _query(prom_port, expr):
                    empty.append(f"{dashboard.name}: '{panel['title']}': {expr}")
    assert not empty, "panels without data:\n" + "\n".join(empty)
    assert float(_query(prom_port, "diloco_swarm_epoch")[0]["value"][1]) >= 3

    # the same view for people without Grafana
    status = subprocess.run(diloco_cmd("status", address, "--wait", "20"), capture_output=True, text=True,
                            timeout=120)
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    assert "2 peers" in lines[0] and "epoch" in lines[0], status.stdout
    assert sorted(line.split()[0] for line in lines[2:]) == ["p0", "p1"], status.stdout

    for proc in procs:
        proc.terminate()
    assert all(proc.wait(timeout=60) == 0 for proc in procs)
    with pytest.raises(OSError):  # the server went away with the peer
        urllib.request.urlopen(f"{base}/healthz", timeout=2)
