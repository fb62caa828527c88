"""The config tree: shipped configs parse, overrides are typed, every mistake is one clear line."""

import random

import pytest

from diloco_peer.config import CONFIG_DIR, ConfigError, PeerConfig, load_config


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.toml")), ids=lambda p: p.stem)
def test_every_shipped_config_parses(path):
    assert isinstance(load_config(path), PeerConfig)


@pytest.mark.parametrize("name, hidden, layers, heads, kv_heads, ffn", [
    ("llama-150m", 1024, 12, 16, 16, 2688),
    ("llama-1b", 2048, 22, 32, 4, 5632),
])
def test_llama_configs_match_opendiloco(name, hidden, layers, heads, kv_heads, ffn):
    cfg = load_config(name)
    m = cfg.model
    assert (m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.ffn_hidden_size) == (hidden, layers, heads, kv_heads, ffn)
    assert (cfg.inner.lr, cfg.inner.weight_decay, cfg.inner.betas, cfg.inner.warmup_steps) == (4e-4, 0.1, [0.9, 0.95], 1000)
    assert (cfg.outer.inner_steps, cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov) == (500, 0.7, 0.9, True)
    assert cfg.inner.batch_size * cfg.inner.grad_accum == 512


def test_overrides_are_typed_like_toml():
    cfg = load_config(None, ["inner.lr=3e-4", "run.run_id=abc", "inner.betas=[0.8, 0.9]", "outer.nesterov=false",
                             "outer.momentum=0.5", "data.paths=[\"a.txt\"]", "data.source=files"])
    assert cfg.inner.lr == 3e-4 and cfg.run.run_id == "abc" and cfg.inner.betas == [0.8, 0.9]
    assert cfg.outer.nesterov is False and cfg.data.paths == ["a.txt"]


@pytest.mark.parametrize("overrides, must_contain", [
    (["inner.lrr=1"], "inner.lrr"),
    (['inner.lr="fast"'], "fast"),
    (["outer.nesterov=yes"], "outer.nesterov"),
    (["outer.inner_steps=1.5"], "outer.inner_steps"),
    (["inner=3"], "section"),
    (["inner.lr.x=1"], "not a section"),
    (["no-equals-sign"], "section.key=value"),
    (["averaging.request_timeout=5"], "matchmaking_time"),
    (["data.seq_len=4096"], "max_seq_len"),
    (["model.hidden_size=66"], "num_heads"),
    (["run.run_id=\"has space\""], "run.run_id"),
    (["data.source=files"], "data.paths"),
])
def test_bad_overrides_give_one_line_errors(overrides, must_contain):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert must_contain in str(err.value) and "\n" not in str(err.value)


def test_bad_files(tmp_path):
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[inner]\nlrr = 1\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'inner.lrr'.*valid: lr"):
        load_config(unknown)
    broken = tmp_path / "broken.toml"
    broken.write_text("[inner\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(broken)
    with pytest.raises(ConfigError, match="tiny-cpu"):
        load_config("no-such-config")
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe[inner]")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(binary)
    flat = tmp_path / "flat.toml"
    flat.write_text("inner = 3\n")
    with pytest.raises(ConfigError, match=r"'inner' must be a \[section\]"):
        load_config(flat, ["inner.lr=1"])
    with pytest.raises(ConfigError, match="bad value for 'inner'"):
        load_config(flat)


def test_fingerprint_covers_what_the_swarm_shares():
    base = load_config().fingerprint()
    assert load_config().fingerprint() == base
    assert load_config(None, ["inner.lr=1e-3", "inner.batch_size=2"]).fingerprint() == base
    assert load_config(None, ["run.seed=1"]).fingerprint() != base
    assert load_config(None, ["model.num_layers=4"]).fingerprint() != base


def test_fuzzed_overrides_never_crash_the_loader():
    rng = random.Random(0)
    alphabet = "abcxyz019.=[]{}\"' -_,:#\\"
    for _ in range(200):
        junk = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20)))
        for item in (junk, f"inner.lr={junk}", f"inner.{junk}=1", f"model.hidden_size={junk}"):
            try:
                load_config(None, [item])
            except ConfigError as e:
                assert "\n" not in str(e)
