"""``diloco-peer plan`` and ``join``'s fit check: the memory table holds to what the code allocates.

The activation formula is compared with the tensors autograd really saves, the codec sizes with what the
codecs really encode, the parameter count with a built model; ``plan`` answers for every shipped config;
``join`` refuses a config that cannot fit, in one line naming what is short (RAM, GPU memory or /dev/shm).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from diloco_peer import cli
from diloco_peer.config import CONFIG_DIR, ConfigError, load_config
from diloco_peer.tools import memory_plan as mp
from diloco_peer.tools.memory_plan import CODECS, CPU, GPU, GPU_HOST, ModelShape, activation_bytes, buffers, peaks
from diloco_peer.tools.plan import Machine, parse_link, shortfall
from diloco_peer.training.model import build_model, num_parameters

PEER_ID = "12D3KooWHQEFuYFG1pGNfSsfDsM5nCiACFRgDLDg5faqtUaKTuzT"
PRESETS = sorted(path.stem for path in CONFIG_DIR.glob("*.toml"))
SMALL = ["model.vocab_size=300", "model.hidden_size=64", "model.num_layers=2", "model.num_heads=4",
         "model.ffn_hidden_size=160", "model.max_seq_len=64", "data.seq_len=24", "inner.batch_size=3"]


def saved_bytes(cfg, autocast: bool) -> int:
    """Bytes of the distinct tensors autograd saves in one forward of a micro-batch (parameters excluded)."""
    model = build_model(cfg.model, 0)
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in own:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.inner.batch_size, cfg.data.seq_len + 1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(tokens[:, :-1], tokens[:, 1:])
    return sum(saved.values())


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", [[], ["model.num_kv_heads=2", "model.tie_embeddings=false"]], ids=["mha", "gqa"])
def test_activation_formula_is_what_autograd_saves(autocast, variant):
    cfg = load_config("tiny-cpu", [*SMALL, *variant])
    shape = ModelShape.from_config(cfg.model)
    tokens = cfg.inner.batch_size * cfg.data.seq_len
    expected = activation_bytes(cfg, autocast) - tokens * mp.LOSS_TRANSIENT_PER_VOCAB * cfg.model.vocab_size
    if autocast:  # autocast's bf16 copies of the linear weights are saved too (their own row of the table)
        expected += 2 * shape.linear_weights
    # off by a few bytes: the token ids are a slice of the batch (its storage is counted whole), the loss a scalar
    assert abs(saved_bytes(cfg, autocast) - expected) <= 64


def test_model_shape_counts_what_a_built_model_has():
    for overrides in ([], ["model.tie_embeddings=false", "model.num_kv_heads=2"]):
        cfg = load_config("tiny-cpu", overrides)
        model = build_model(cfg.model, 0)
        shape = ModelShape.from_config(cfg.model)
        assert shape.parameters == num_parameters(model)
        numels = [numel for numel, count in shape.tensors for _ in range(count)]
        assert sorted(numels) == sorted(p.numel() for p in model.parameters())
    big = load_config("llama-1b").model  # on the meta device: nothing allocated
    per_layer = 2 * 2048 * 2048 + 2 * 2048 * 256 + 3 * 2048 * 5632 + 2 * 2048
    assert ModelShape.from_config(big).parameters == 22 * per_layer + 2 * 32000 * 2048 + 2048


def test_codec_sizes_are_what_the_codecs_encode():
    from diloco_peer.averaging.compression import get_codec

    shapes = [(7,), (1024,), (1025, 3), (33, 64)]
    for name in CODECS:
        encoded = sum(get_codec(name).encode(torch.randn(shape)).nbytes for shape in shapes)
        assert mp.codec_bytes(name, [(torch.Size(s).numel(), 1) for s in shapes]) == encoded, name


def test_the_peak_counts_phases_that_can_be_live_together_once():
    sets = ["model.hidden_size=512", "model.num_layers=4", "model.num_heads=8"]
    cfg = load_config("tiny-cpu", sets)
    shape = ModelShape.from_config(cfg.model)
    table = buffers(cfg, shape)
    blocking = peaks(table, overlapped=False)
    named = {phase for together in mp.concurrent(True) + mp.concurrent(False) for phase in together}
    assert {row.phase for row in table} | named <= set(mp.PHASES)

    def held(process: str, *phases: str) -> int:
        return sum(row.bytes.get(CPU, 0) for row in table if row.process == process and row.phase in phases)

    # the peer process's worst moment: training while a checkpoint is written and a peer downloads our state, or
    # the outer step of a round during such a download; the averager process keeps its high-water mark meanwhile
    # (a round while serving, or a state download)
    averager = held(mp.AVERAGER, "resident") + max(held(mp.AVERAGER, "allreduce", "serve"), held(mp.AVERAGER, "sync"))
    peer = max(held(mp.PEER, "step", "checkpoint", "serve"), held(mp.PEER, "allreduce", "serve", "serve_change"))
    assert blocking[CPU] == held(mp.PEER, "resident") + peer + averager
    assert blocking[CPU] < sum(row.bytes.get(CPU, 0) for row in table)
    overlapped = load_config("tiny-cpu", [*sets, "outer.overlap=eager"])
    assert peaks(buffers(overlapped, shape), overlapped=True)[CPU] > blocking[CPU]
    # a GPU peer keeps the replica and its optimizer on the GPU: the host holds the outer side only (and the CUDA
    # runtime's fixed share, more than this tiny model's whole state)
    assert blocking[GPU_HOST] - mp.CUDA_HOST_RUNTIME_BYTES < blocking[CPU] and blocking[GPU] > 16 * shape.parameters


def test_the_replica_is_lent_to_the_round_only_where_it_is_free_during_it():
    """Blocking rounds on a CPU compute the pseudo-gradient in the replica's memory (the daemon and the memory
    table ask the same ``PeerConfig.lends_replica``): not overlapped (the replica trains on during the round),
    not with error feedback (the corrected pseudo-gradient differs from the one a solo step applies), not on a
    GPU (the replica is not in host memory)."""
    assert load_config("tiny-cpu").lends_replica("cpu")
    assert not load_config("tiny-cpu").lends_replica("cuda")
    for change in ("outer.overlap=eager", "outer.overlap=delayed", "averaging.error_feedback=true"):
        cfg = load_config("tiny-cpu", [change])
        assert not cfg.lends_replica("cpu"), change
        shape = ModelShape.from_config(cfg.model)
        lent = load_config("tiny-cpu")
        row = "round: pseudo-gradient sent (averager's input buffer)"
        sizes = [next(r.bytes.get(CPU, 0) for r in buffers(c, shape) if r.name == row) for c in (lent, cfg)]
        assert sizes == [0, 4 * shape.parameters], change


def test_shortfall_names_what_is_short():
    need = {CPU: 10 * 10**9, GPU_HOST: 3 * 10**9, GPU: 20 * 10**9}
    roomy = Machine(ram_available=16 * 10**9, ram_total=32 * 10**9, gpu_name="RTX 4090", gpu_free=23 * 10**9,
                    gpu_total=24 * 10**9)
    assert shortfall(need, roomy, "cpu") == "" and shortfall(need, roomy, "cuda") == ""
    small = Machine(ram_available=8 * 10**9, ram_total=16 * 10**9)
    assert shortfall(need, small, "cpu") == "a CPU peer needs 10.00 GB of RAM, 8.00 GB is available"
    assert "has none" in shortfall(need, small, "cuda")
    # shared memory: a container's /dev/shm is 64 MB unless given more
    need["shared"] = {CPU: 4 * 10**9, GPU_HOST: 2 * 10**9}
    container = Machine(ram_available=16 * 10**9, ram_total=32 * 10**9, gpu_name="RTX 4090", gpu_free=23 * 10**9,
                        gpu_total=24 * 10**9, shm_free=64 * 2**20)
    assert shortfall(need, container, "cpu").startswith("a CPU peer needs 4.00 GB of shared memory, 67.11 MB is "
                                                         "free in /dev/shm")
    assert "2.00 GB of shared memory" in shortfall(need, container, "cuda") and "--shm-size" in shortfall(
        need, container, "cuda")
    assert shortfall(need, roomy, "cpu") == ""  # (no /dev/shm read: not checked)


def test_link_speeds_are_read_as_tc_writes_them():
    assert parse_link("100mbit") == 1e8 and parse_link("1.5Gbit") == 1.5e9 and parse_link("64kbit") == 64e3
    for bad in ("fast", "100", "100mbps", "0mbit", "-1mbit"):
        with pytest.raises(ConfigError, match="is not a link speed"):
            parse_link(bad)


@pytest.mark.parametrize("preset", PRESETS)
def test_plan_answers_for_every_shipped_config(preset, capsys):
    assert cli.main(["plan", "--config", preset, "--json", "--link", "20mbit", "--peers", "3"]) == 0
    plan = json.loads(capsys.readouterr().out)
    shape = ModelShape.from_config(load_config(preset).model)
    assert plan["parameters"] == shape.parameters
    assert all(plan["peak"][column] > 4 * shape.parameters for column in (CPU, GPU_HOST, GPU))
    assert [r["codec"] for r in plan["rounds"]] == list(CODECS)
    fp32 = plan["rounds"][0]  # each peer sends and receives 2 (K-1) / K of the pseudo-gradient
    assert fp32["sent_bytes"] == round(4 / 3 * 4 * shape.parameters)
    assert fp32["seconds"] == pytest.approx(fp32["sent_bytes"] * 8 / 20e6)
    assert plan["short"] == "" or "needs" in plan["short"]
    assert cli.main(["plan", "--config", preset, "--device", "cpu"]) == 0  # and as text
    text = capsys.readouterr().out
    assert "bytes per parameter at the peak" in text and "(configured)" in text and "a CPU peer: " in text
    assert "of the peak, in shared memory (/dev/shm)" in text and "free in /dev/shm" in text
    assert 0 < plan["peak"]["shared"][CPU] < plan["peak"][CPU] and 0 < plan["peak"]["shared"][GPU_HOST]


def test_plan_refuses_a_bad_link_in_one_line(capsys):
    assert cli.main(["plan", "--link", "fast"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'fast' is not a link speed" in err


def test_join_refuses_a_config_that_cannot_fit_in_one_line(tmp_path, capsys):
    # ~380 billion parameters: no machine this runs on has the terabytes a CPU peer of it needs
    huge = ["model.num_layers=100", "model.hidden_size=16384", "model.num_heads=128", "model.num_kv_heads=8",
            "model.ffn_hidden_size=65536", "inner.device=cpu"]
    args = ["join", f"/ip4/127.0.0.1/tcp/9/p2p/{PEER_ID}", "--config", "llama-1b",
            "--set", f"run.log_dir={json.dumps(str(tmp_path / 'runs'))}",
            "--set", f"checkpoint.dir={json.dumps(str(tmp_path / 'checkpoints'))}"]
    for item in huge:
        args += ["--set", item]
    assert cli.main(args) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not fit this machine: a CPU peer needs" in err
    assert "GB of RAM" in err and "is available" in err and "--no-fit-check" in err


def test_join_refuses_when_dev_shm_is_too_small_in_one_line(tmp_path):
    """In a container /dev/shm is 64 MB unless given more; the outer state and the round's buffers live there, and
    torch failed at start-up with "unable to allocate shared memory ... No space left on device". ``join`` now
    refuses first, naming the fix. Run as a new process in a mount namespace with a 64 MB /dev/shm of its own."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        if os.environ.get("CI"):
            pytest.fail("this test must run in CI: it needs root and unshare (a /dev/shm of its own)")
        pytest.skip("needs root and unshare (a /dev/shm of its own)")
    model = ["model.hidden_size=512", "model.num_layers=4", "model.num_heads=8", "model.num_kv_heads=8",
             "model.ffn_hidden_size=1408"]  # ~13M parameters: ~0.25 GB of shared memory, under 1 GB of RAM
    sets = [a for item in [*model, f"run.log_dir={json.dumps(str(tmp_path / 'runs'))}"] for a in ("--set", item)]
    join = " ".join([sys.executable, "-m", "diloco_peer", "join", f"/ip4/127.0.0.1/tcp/9/p2p/{PEER_ID}",
                     "--config", "tiny-cpu", *(f"'{a}'" for a in sets)])
    proc = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64m tmpfs /dev/shm && exec {join}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == cli.EXIT_USAGE, proc.stderr[-2000:]
    err = proc.stderr.strip()
    assert err.count("\n") == 0 and "does not fit this machine: a CPU peer needs" in err, err
    assert "of shared memory, 67.11 MB is free in /dev/shm" in err and "--shm-size" in err, err
