"""The swarm tells a joiner its job: which keys are swarm-wide (``config/swarm_wide.py``), how a joiner's own choices
meet the swarm's config, the owner's signed record (``swarm/run_config.py``, ``swarm/owner_key.py``) and what a
forged one gets; then one real swarm: ``bootstrap --config``, two ``join <address>`` with no config, one refused."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import time
from types import SimpleNamespace

import pytest
from conftest import FAST, diloco_cmd
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

from diloco_peer.config import ConfigError, PeerConfig, load_config
from diloco_peer.config.swarm_wide import SWARM_WIDE, VOLUNTEER, adopt, is_swarm_wide, schema_keys, stated_keys
from diloco_peer.config.swarm_wide import swarm_part
from diloco_peer.swarm import run_config
from diloco_peer.swarm.addresses import BootstrapUnreachable
from diloco_peer.swarm.owner_key import ED25519, RSA, OwnerKey, encode_key, peer_id_of
from diloco_peer.swarm.run_config import ForgedRecord, Joiner, check_record, sign_record

OWNER_SETS = ["outer.inner_steps=10", "averaging.heartbeat=1.0", "data.max_bytes=1_000_000"]


def owner_config(*sets: str) -> PeerConfig:
    return load_config("tiny-cpu", [*OWNER_SETS, *sets])


def joined(config: str | None, *sets: str, swarm: dict | None = None) -> PeerConfig:
    """What ``join <address> [--config config] --set sets...`` trains with in a swarm of ``swarm``."""
    local = load_config(config, list(sets))
    return adopt(local, stated_keys(config, list(sets)), swarm or swarm_part(owner_config()), "QmOwner")


# --- which keys are swarm-wide --------------------------------------------------------------------------------------

def test_every_key_of_the_schema_is_classified_exactly_once():
    """A key added to the schema must be put in SWARM_WIDE or VOLUNTEER (config/swarm_wide.py), never both."""
    keys = schema_keys()
    named = {key: [n for n in (*SWARM_WIDE, *VOLUNTEER) if key == n or key.startswith(f"{n}.")] for key in keys}
    unclassified = [key for key, names in named.items() if not names]
    twice = [f"{key} ({', '.join(names)})" for key, names in named.items() if len(names) > 1]
    assert not unclassified, f"classify these keys in config/swarm_wide.py (swarm-wide or volunteer): {unclassified}"
    assert not twice, f"keys classified twice: {twice}"
    stale = [n for n in (*SWARM_WIDE, *VOLUNTEER) if not any(k == n or k.startswith(f"{n}.") for k in keys)]
    assert not stale, f"config/swarm_wide.py names keys the schema does not have: {stale}"


def test_the_fingerprint_and_the_wire_are_swarm_wide_a_volunteers_machine_is_not():
    for key in ("run.run_id", "run.seed", "model.hidden_size", "outer.overlap", "outer.inner_steps",
                "averaging.compression", "data.seq_len", "data.tokenizer"):
        assert is_swarm_wide(key), key
    for key in ("inner.batch_size", "inner.device", "run.threads", "run.max_rounds", "swarm.host_maddrs",
                "swarm.identity_path", "checkpoint.dir", "metrics.port", "run.log_dir", "averaging.bandwidth"):
        assert not is_swarm_wide(key), key


def test_the_swarm_part_is_plain_json_of_the_swarm_wide_keys_only():
    part = swarm_part(owner_config("inner.batch_size=3"))
    assert json.loads(json.dumps(part)) == part
    assert part["outer"]["inner_steps"] == 10 and part["inner"]["betas"] == [0.9, 0.95]
    assert "batch_size" not in part["inner"] and "swarm" not in part and "max_rounds" not in part["run"]


# --- a joiner's own choices and the swarm's -------------------------------------------------------------------------

def test_a_joiner_without_config_takes_the_swarm_wide_keys_and_keeps_its_own():
    owner = owner_config("model.hidden_size=64", "averaging.compression=\"fp16\"")
    cfg = joined(None, "inner.batch_size=4", "run.max_rounds=3", "run.threads=1", swarm=swarm_part(owner))
    assert (cfg.outer.inner_steps, cfg.model.hidden_size, cfg.averaging.compression) == (10, 64, "fp16")
    assert (cfg.inner.batch_size, cfg.run.max_rounds, cfg.run.threads) == (4, 3, 1)
    assert cfg.fingerprint() == owner.fingerprint()
    assert swarm_part(cfg) == swarm_part(owner)


def test_a_set_that_disagrees_with_the_swarm_is_refused_in_one_line_naming_the_key_and_both_values():
    with pytest.raises(ConfigError) as refused:
        joined(None, "outer.inner_steps=7")
    assert str(refused.value) == ("outer.inner_steps=7 disagrees with the swarm's 10 (set by its owner QmOwner): "
                                  "drop the --set, or join another swarm")
    with pytest.raises(ConfigError, match=r'^data.source="files" disagrees with the swarm\'s "stdlib"'):
        joined(None, 'data.source="files"', 'data.paths=["a.txt"]')


def test_a_set_that_agrees_is_fine_and_an_unstated_default_takes_the_swarms_value():
    assert joined(None, "outer.inner_steps=10").outer.inner_steps == 10
    assert joined(None).outer.inner_steps == 10  # tiny-cpu's 50 was never the volunteer's word


def test_a_config_file_is_checked_on_the_keys_it_writes():
    assert joined("tiny-cpu", swarm=swarm_part(load_config("tiny-cpu"))) == load_config("tiny-cpu")
    with pytest.raises(ConfigError, match=r"^outer.inner_steps=50 disagrees with the swarm's 10 .* drop --config "
                                          r"tiny-cpu \(join takes the swarm's config\), or join another swarm$"):
        joined("tiny-cpu", swarm=swarm_part(load_config("tiny-cpu", ["outer.inner_steps=10"])))
    with pytest.raises(ConfigError, match=r"^run.run_id=\"diloco-llama-150m\" disagrees"):
        joined("llama-150m")


def test_a_swarm_key_this_version_does_not_know_asks_for_an_upgrade_and_a_volunteer_key_is_ignored():
    part = swarm_part(owner_config())
    with pytest.raises(ConfigError, match="sets outer.round_lenght, which this diloco-peer does not know: upgrade"):
        joined(None, swarm={**part, "outer": {**part["outer"], "round_lenght": 3.0}})
    assert joined(None, swarm={**part, "inner": {**part["inner"], "batch_size": 64}}).inner.batch_size == 8


def test_a_swarm_config_that_needs_a_volunteer_key_says_which():
    part = swarm_part(owner_config())
    files = {**part, "data": {**part["data"], "source": "files"}}
    with pytest.raises(ConfigError, match="needs data.paths"):
        joined(None, swarm=files)


# --- the owner's signed record --------------------------------------------------------------------------------------

def key_file(tmp_path, kind: int, name: str = "k") -> OwnerKey:
    """An identity file as ``keygen`` (RSA) or p2pd (Ed25519, seed + public key) takes it, loaded."""
    if kind == RSA:
        private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        data = private.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL,
                                     serialization.NoEncryption())
    else:
        private = ed25519.Ed25519PrivateKey.generate()
        data = private.private_bytes_raw() + private.public_key().public_bytes_raw()
    (tmp_path / name).write_bytes(encode_key(kind, data))
    return OwnerKey.load(tmp_path / name)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    return SimpleNamespace(owner=key_file(folder, RSA, "owner"), other=key_file(folder, RSA, "other"),
                           ed=key_file(folder, ED25519, "ed"))


def test_peer_ids_are_those_of_the_addresses(keys, tmp_path):
    from hivemind.p2p import P2P, PeerID

    P2P.generate_identity(str(tmp_path / "hivemind.key"))  # what keygen and --identity write
    assert OwnerKey.load(tmp_path / "hivemind.key").peer_id == PeerID.from_identity(
        (tmp_path / "hivemind.key").read_bytes()).to_base58()
    assert keys.owner.peer_id.startswith("Qm") and keys.ed.peer_id.startswith("12D3KooW")
    assert peer_id_of(keys.ed.public_key) == keys.ed.peer_id


@pytest.mark.parametrize("kind", ["owner", "ed"])
def test_a_record_signed_by_its_owner_is_taken(keys, kind):
    key = getattr(keys, kind)
    record = check_record(sign_record(key, {"outer": {"inner_steps": 10}}, "tiny-cpu", 1234.5), key.peer_id, 1234.5)
    assert (record.owner, record.config, record.name) == (key.peer_id, {"outer": {"inner_steps": 10}}, "tiny-cpu")


def forge(value: dict, **changes) -> dict:
    body = json.loads(value["body"])
    body.update(changes)
    return {**value, "body": json.dumps(body, sort_keys=True, separators=(",", ":"))}


def test_forged_unsigned_foreign_and_malformed_records_are_refused(keys):
    owner = keys.owner.peer_id
    good = sign_record(keys.owner, {"outer": {"inner_steps": 10}}, "tiny-cpu", 1000.0)
    cases = {
        "its signature does not verify": forge(good, config={"outer": {"inner_steps": 11}}),
        "unsigned": {k: v for k, v in good.items() if k != "signature"},
        "not the owner's": sign_record(keys.other, {"outer": {"inner_steps": 10}}, "tiny-cpu", 1000.0),
        "a replay": good,  # checked against another expiration below
        "not a config record": {**good, "v": 2},
    }
    for reason, value in cases.items():
        with pytest.raises(ForgedRecord, match=reason):
            check_record(value, owner, 2000.0 if reason == "a replay" else 1000.0)
    body = json.dumps({"owner": owner, "config": None, "name": "", "expires": 1000.0, "version": "0"})
    signed_by_other = {"v": 1, "body": body, "public_key": keys.other.public_key,
                       "signature": keys.other.sign(run_config.DOMAIN + body.encode())}
    with pytest.raises(ForgedRecord, match="names another owner"):  # a true signature, a body about someone else
        check_record(signed_by_other, keys.other.peer_id)
    for junk in (None, b"\x00", [1], {"v": 1, "body": 3, "public_key": b"", "signature": b""},
                 {"v": 1, "body": "{}", "public_key": b"\x08\x00\x12\x01x", "signature": b"s"}):
        with pytest.raises(ForgedRecord):
            check_record(junk, owner)


def test_a_record_for_another_address_is_not_taken(keys):
    """A valid record of another owner passes for nobody else: a joiner takes only its addresses' owners'."""
    with pytest.raises(ForgedRecord, match="not the owner's"):
        check_record(sign_record(keys.other, {"run": {"seed": 1}}, "", 1000.0), keys.owner.peer_id)


def test_the_dht_validator_refuses_forged_records_on_the_config_key_only(keys):
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer as msgpack

    validator = run_config.RunConfigValidator()
    good = sign_record(keys.owner, {"run": {"seed": 1}}, "x", 1000.0)

    def record(owner, value, expiration=1000.0, key=validator.key_id):
        return DHTRecord(key, msgpack.dumps(owner), msgpack.dumps(value), expiration)

    assert validator.validate(record(keys.owner.peer_id, good))
    assert not validator.validate(record(keys.other.peer_id, good))  # another owner's subkey
    assert not validator.validate(record(keys.owner.peer_id, good, 1500.0))  # a longer life than signed
    assert not validator.validate(record(keys.owner.peer_id, forge(good, config={"run": {"seed": 2}})))
    assert not validator.validate(record(None, good))  # a regular value under the config key
    assert not validator.validate(DHTRecord(validator.key_id, b"\xc1", b"\xc1", 1000.0))  # no msgpack
    assert validator.validate(record("anything", "anything", key=b"another key"))


class FakeDHT:
    """What ``fetch_run_configs`` and ``adopt_swarm_config`` use of a DHT: ``get`` of the config key."""

    def __init__(self, entries: dict[str, dict]):
        self.entries = entries

    def add_validators(self, validators) -> None:
        pass

    def get(self, key, latest=False):
        assert key == run_config.CONFIG_KEY and latest
        values = {owner: SimpleNamespace(value=value, expiration_time=1000.0) for owner, value in self.entries.items()}
        return SimpleNamespace(value=values) if values else None


def test_a_joiner_ignores_a_forged_record_and_says_so_once(keys, caplog, monkeypatch):
    monkeypatch.setattr(run_config, "_warned", set())  # (the validator's test above warned in this process)
    forged = forge(sign_record(keys.owner, {"run": {"seed": 1}}, "x", 1000.0), config={"run": {"seed": 2}})
    dht = FakeDHT({keys.owner.peer_id: forged, keys.other.peer_id: sign_record(keys.other, {}, "", 1000.0)})
    with caplog.at_level(logging.WARNING, logger="diloco_peer.swarm.run_config"):
        for _ in range(2):
            assert asyncio.run(run_config.fetch_run_configs(dht, [keys.owner.peer_id])) == []
    assert len([r for r in caplog.records if "signature does not verify" in r.message]) == 1


def adopted(dht: FakeDHT, owners: list[str], config: str | None = None, *sets: str, stop: bool = False):
    """What ``join owners... [--config config] --set sets...`` trains with, and the configs it checked for this
    machine (config, name), as ``adopt_swarm_config`` finds them in ``dht``."""
    checked = []
    local = load_config(config, list(sets))
    addresses = [f"/ip4/127.0.0.1/tcp/9/p2p/{owner}" for owner in owners]
    asked = Joiner(local, stated_keys(config, list(sets)), config, addresses, lambda *c: checked.append(c))
    return asyncio.run(run_config.adopt_swarm_config(dht, lambda: stop, asked)), local, checked


def test_adoption_takes_the_owners_config_and_checks_it_for_this_machine(keys):
    dht = FakeDHT({keys.owner.peer_id: sign_record(keys.owner, swarm_part(owner_config()), "tiny-cpu", 1000.0)})
    cfg, _, checked = adopted(dht, [keys.owner.peer_id], None, "inner.batch_size=2")
    assert (cfg.outer.inner_steps, cfg.inner.batch_size) == (10, 2)
    assert checked == [(cfg, "tiny-cpu")]


def test_a_joiner_whose_owner_restarted_joins_it_again_and_takes_its_config(keys, monkeypatch):
    """The joiner reached the owner's node, which then restarted (its relay check failed): our DHT knew nobody to
    read from until it joined the bootstrap addresses again (seen in a suite run: 30 s of empty reads, exit 3)."""
    record = sign_record(keys.owner, swarm_part(owner_config()), "tiny-cpu", 1000.0)
    dht = FakeDHT({})
    joins = []

    def join_again(node, addresses):
        joins.append(list(addresses))
        if len(joins) == 1:  # the owner's node is still starting again
            raise BootstrapUnreachable("none of the initial peers answered")
        node.entries[keys.owner.peer_id] = record  # reachable again: our reads find its record

    monkeypatch.setattr(run_config, "REJOIN_SECONDS", 0.05)
    monkeypatch.setattr(run_config, "join_dht_peers", join_again)
    address = f"/ip4/127.0.0.1/tcp/9/p2p/{keys.owner.peer_id}"
    asked = Joiner(load_config(None, []), {}, None, [address], lambda *c: None)
    cfg = asyncio.run(run_config.adopt_swarm_config(dht, lambda: False, asked))
    assert cfg.outer.inner_steps == 10 and joins == [[address], [address]]


def test_adoption_without_a_record_fails_and_with_a_no_config_record_keeps_its_own(keys, monkeypatch):
    monkeypatch.setattr(run_config, "WAIT", 0.3)
    monkeypatch.setattr(run_config, "WAIT_WITH_CONFIG", 0.3)
    owners = [keys.owner.peer_id]
    with pytest.raises(BootstrapUnreachable, match=r"no config from the swarm's owner \(Qm.*\) within 0.3s"):
        adopted(FakeDHT({}), owners)
    cfg, local, checked = adopted(FakeDHT({}), owners, "tiny-cpu", "outer.inner_steps=3")  # --config: its own
    assert cfg is local and not checked
    no_config = FakeDHT({keys.owner.peer_id: sign_record(keys.owner, None, "", 1000.0)})
    cfg, local, _ = adopted(no_config, owners, None, "outer.inner_steps=3")  # a bootstrap without --config
    assert cfg is local
    assert adopted(FakeDHT({}), owners, stop=True)[0] is None  # asked to leave while waiting


def test_two_owners_that_disagree_are_refused(keys):
    one, two = swarm_part(owner_config()), swarm_part(owner_config("outer.inner_steps=20"))
    dht = FakeDHT({keys.owner.peer_id: sign_record(keys.owner, one, "a", 1000.0),
                   keys.other.peer_id: sign_record(keys.other, two, "b", 1000.0)})
    with pytest.raises(ConfigError, match=r"owners disagree: .* publishes outer.inner_steps=10, .* 20"):
        adopted(dht, [keys.owner.peer_id, keys.other.peer_id])


# --- one real swarm -------------------------------------------------------------------------------------------------

def test_join_with_no_config_takes_the_swarms_and_a_conflicting_set_is_refused(local_swarm):
    """``bootstrap --config tiny-cpu --set ...``, then two ``join <address>`` with only their own choices: both
    average; a ``join --set outer.inner_steps=7`` is refused in one line, exit 2."""
    swarm_sets = [*FAST, "outer.inner_steps=5"]
    address = local_swarm.start_bootstrap("--config", "tiny-cpu", *[a for s in swarm_sets for a in ("--set", s)])
    local_swarm.sets = ["run.threads=1", 'checkpoint.dir=""']  # the volunteers' own choices only
    for name in ("a", "b"):
        local_swarm.start_peer(name, "run.max_rounds=2")
    started = time.monotonic()
    refused = subprocess.run(diloco_cmd("join", address, "--set", "outer.inner_steps=7", "--set", "run.threads=1",
                                        "--set", 'checkpoint.dir=""', "--set", f"run.log_dir={local_swarm.workdir}"),
                             capture_output=True, text=True, timeout=120, cwd=local_swarm.workdir)
    owner = address.rsplit("/", 1)[1]
    assert refused.returncode == 2, refused.stderr
    expected = (f"diloco-peer: error: outer.inner_steps=7 disagrees with the swarm's 5 (set by its owner {owner}): "
                f"drop the --set, or join another swarm")
    assert refused.stderr.strip().splitlines() == [expected]
    for name in ("a", "b"):
        local_swarm.wait_for(f"{name}'s 2 rounds", lambda n=name: len(local_swarm.events(n, "round")) >= 2,
                             timeout=150 - (time.monotonic() - started))
        rounds = local_swarm.events(name, "round")
        assert any(r["outcome"] == "averaged" for r in rounds), rounds
        assert "training with the swarm's config from its owner" in local_swarm.log(name).read_text()
        assert local_swarm.events(name, "start")[0]["fingerprint"] == load_config(
            "tiny-cpu", swarm_sets).fingerprint()
