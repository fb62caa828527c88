"""A closed swarm: only holders of its secret (or allowlisted peer ids) talk to its DHT and average with it."""

import asyncio
import os
import stat
import subprocess

import pytest
import torch
from conftest import diloco_cmd
from hivemind.proto import dht_pb2
from hivemind.utils import get_dht_time

from diloco_peer.averaging.averager import RoundAverager
from diloco_peer.config import AveragingConfig, SwarmConfig
from diloco_peer.swarm.addresses import BootstrapUnreachable
from diloco_peer.swarm.admission import Admission, AdmissionError, SwarmSecretAuthorizer, load_admission, write_secret
from diloco_peer.swarm.join import start_dht

SECRET = b"0123456789abcdef0123456789abcdef"
SHAPES = [torch.Size([200]), torch.Size([10, 10])]
CFG = AveragingConfig(matchmaking_time=2.0, request_timeout=1.0, allreduce_timeout=20.0, aggregation="mean")


def test_a_secret_proof_is_bound_to_the_peer_id_and_the_secret():
    swarm, other = Admission(SECRET), Admission(SECRET[::-1])
    assert swarm.refuses("peerA", swarm.proof("peerA")) == ""
    assert "secret" in swarm.refuses("peerA", swarm.proof("peerB"))  # someone else's proof
    assert "secret" in swarm.refuses("peerA", other.proof("peerA"))  # another swarm's secret
    assert "secret" in swarm.refuses("peerA", b"")
    listed = Admission(allowlist=frozenset({"peerA"}))
    assert listed.refuses("peerA", None) == "" and "allowlist" in listed.refuses("peerB", None)
    assert not Admission().closed and swarm.closed and listed.closed


def test_the_secret_file_and_allowlist_are_validated_with_one_line_errors(tmp_path):
    path = tmp_path / "swarm.secret"
    write_secret(str(path))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and len(path.read_text().strip()) == 64
    with pytest.raises(AdmissionError, match="exists"):
        write_secret(str(path))
    for bad, message in [(str(tmp_path), "is a directory"), ("a\x00b", "NUL character"),
                         ("/proc/nope/swarm.secret", "cannot write it"), ("x" * 300, "cannot write it")]:
        with pytest.raises(AdmissionError, match=message):
            write_secret(bad, force=True)
    admission = load_admission(str(path), ["12D3KooWGfoZeTxSgTg5dhQUKATGDjDLbbSSNDCBk6TRqS9nGX7H"])
    assert admission.secret == path.read_bytes().strip() and len(admission.allowlist) == 1
    for secret_file, allowlist, message in [
        (str(tmp_path / "missing"), [], "cannot read swarm.secret_file"),
        (str(tmp_path), [], "cannot read swarm.secret_file"),  # a directory
        ("a\x00b", [], "NUL character"),
        ("", ["not-a-peer-id"], "bad peer id 'not-a-peer-id' in swarm.allowlist"),
    ]:
        with pytest.raises(AdmissionError, match=message) as caught:
            load_admission(secret_file, allowlist)
        assert "\n" not in str(caught.value)
    short = tmp_path / "short.secret"
    short.write_text("hunter2\n")
    with pytest.raises(AdmissionError, match="fewer than 16"):
        load_admission(str(short), [])


def test_dht_messages_are_signed_and_checked():
    async def run():
        ours, theirs = SwarmSecretAuthorizer(SECRET), SwarmSecretAuthorizer(SECRET[::-1])
        request = dht_pb2.PingRequest(validate=True)
        await ours.sign_request(request, None)
        wire = request.SerializeToString()
        assert await ours.validate_request(dht_pb2.PingRequest.FromString(wire))
        assert not await ours.validate_request(dht_pb2.PingRequest.FromString(wire))  # a replay
        assert not await theirs.validate_request(dht_pb2.PingRequest.FromString(wire))  # another secret
        tampered = dht_pb2.PingRequest.FromString(wire)
        tampered.validate = False
        assert not await SwarmSecretAuthorizer(SECRET).validate_request(tampered)
        stale = dht_pb2.PingRequest(validate=True)
        await ours.sign_request(stale, None)
        stale.auth.time -= 3600
        stale.auth.signature = b""
        stale.auth.signature = ours._mac(b"request", stale)  # validly signed, but an hour old
        assert not await ours.validate_request(stale)
        unsigned = dht_pb2.PingRequest(validate=True)
        assert not await ours.validate_request(unsigned)

        response = dht_pb2.PingResponse(available=True)
        await ours.sign_response(response, request)
        assert await ours.validate_response(response, request)
        assert not await theirs.validate_response(response, request)
        response.available = False
        assert not await ours.validate_response(response, request)
        assert ours.refused >= 4

    asyncio.run(run())


def _swarm_config(tmp_path, name: str, secret: bytes | None) -> SwarmConfig:
    secret_file = ""
    if secret is not None:
        path = tmp_path / f"{name}.secret"
        path.write_bytes(secret)
        path.chmod(0o600)
        secret_file = str(path)
    return SwarmConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"], secret_file=secret_file, startup_timeout=10)


@pytest.mark.slow
@pytest.mark.light
def test_only_holders_of_the_secret_can_join_the_dht(tmp_path):
    boot = start_dht(_swarm_config(tmp_path, "boot", SECRET), [])
    started = [boot]
    try:
        address = [str(a) for a in boot.get_visible_maddrs()]
        member = start_dht(_swarm_config(tmp_path, "member", SECRET), address)
        started.append(member)
        assert member.store("greeting", "hello", expiration_time=get_dht_time() + 60)
        assert boot.get("greeting", latest=True).value == "hello"
        for name, secret in [("outsider", None), ("other-swarm", SECRET[::-1])]:
            with pytest.raises(BootstrapUnreachable, match="secret"):
                started.append(start_dht(_swarm_config(tmp_path, name, secret), address))
    finally:
        for dht in started:
            dht.shutdown()


async def _rounds(averagers, inputs, epoch):
    return await asyncio.wait_for(asyncio.gather(
        *(a.average(x, weight=100, epoch=epoch) for a, x in zip(averagers, inputs))), 60)


@pytest.mark.light
@pytest.mark.slow
@pytest.mark.parametrize("closed_by", ["secret", "allowlist"])
def test_an_unadmitted_peer_never_averages_with_the_swarm(dhts, closed_by):
    """The DHT is shared here (open), so the outsider finds the group: the averagers must refuse it."""
    nodes = dhts(3)
    ids = [n.peer_id.to_base58() for n in nodes]
    if closed_by == "secret":
        admissions = [Admission(SECRET), Admission(SECRET), Admission(SECRET[::-1])]
    else:
        members = frozenset(ids[:2])
        admissions = [Admission(allowlist=members), Admission(allowlist=members), Admission()]
    averagers = [RoundAverager(n, SHAPES, "closed-run", CFG, a) for n, a in zip(nodes, admissions)]
    inputs = [[torch.full(s, float(i + 1)) for s in SHAPES] for i in range(3)]
    offenses, member_groups = [], []
    try:
        for epoch in range(2):
            results = asyncio.run(_rounds(averagers, inputs, epoch))
            for own, result in enumerate(results[:2], start=1):
                offenses += result.offenses
                if result.ok:
                    member_groups.append(result.group_size)
                    # the members' average (1.5), never the outsider's 3; where a part failed under load (CI saw
                    # a reducer time out), our own values are kept and counted as not averaged
                    values = torch.cat([t.flatten() for t in result.averaged])
                    assert bool(((values == 1.5) | (values == own)).all()), values
                    assert int((values == own).sum()) == result.values_not_averaged < values.numel(), result
            assert not results[2].ok, results[2]  # the outsider averaged with nobody
    finally:
        for a in averagers:
            a.shutdown()
    assert member_groups and set(member_groups) == {2}, member_groups
    assert offenses and {o["offender"] for o in offenses} == {ids[2]}, offenses
    assert {o["kind"] for o in offenses} == {"unadmitted"}, offenses


@pytest.mark.slow
def test_a_closed_swarm_of_real_peers_trains_and_an_outsider_is_turned_away(local_swarm, tmp_path):
    secret = tmp_path / "swarm.secret"
    write_secret(str(secret))
    local_swarm.start_bootstrap("--secret-file", str(secret))
    members = [local_swarm.start_peer(f"p{i}", "run.max_rounds=2", f'swarm.secret_file="{secret}"') for i in range(2)]
    outsider = local_swarm.start_peer("outsider", "run.max_rounds=2", "swarm.join_timeout=0")
    assert outsider.wait(timeout=120) == 3  # no bootstrap peer reachable: it does not hold the secret
    last_line = (tmp_path / "outsider.log").read_text().strip().splitlines()[-1]
    assert last_line.startswith("diloco-peer: error: could not reach") and "swarm.secret_file" in last_line
    for proc in members:
        assert proc.wait(timeout=300) == 0
    ends = set()
    for name in ("p0", "p1"):
        rounds = [e for e in local_swarm.events(name) if e["event"] == "round"]
        # the members averaged with each other, every round (a round can be partial: a reducer's reply cut short,
        # seen once in 96 values of one member's round 1 and healed by its state sync; not understood yet)
        assert [r["group_size"] for r in rounds] == [2, 2], rounds
        assert all(r["outcome"] in ("averaged", "partial") for r in rounds) and rounds[-1]["outcome"] == "averaged"
        ends.add(rounds[-1]["param_sha256"])
    assert len(ends) == 1


def test_keygen_writes_a_swarm_secret_and_refuses_to_overwrite_it(tmp_path):
    path = tmp_path / "swarm.secret"
    done = subprocess.run(diloco_cmd("keygen", "--secret", str(path)), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--secret-file" in done.stdout, done
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and len(path.read_text().strip()) == 64
    again = subprocess.run(diloco_cmd("keygen", "--secret", str(path)), capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "--force" in again.stderr, again
