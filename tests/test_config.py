"""The config tree: shipped configs parse, overrides are typed like TOML, every mistake is one clear line."""

import random
import string

import pytest

from diloco_peer.config import CONFIG_DIR, ConfigError, PeerConfig, load_config


def one_line(message: str) -> bool:
    return len(message.splitlines()) == 1


def config_error(*overrides: str, path=None) -> str:
    """The message of the ConfigError that loading must raise."""
    with pytest.raises(ConfigError) as err:
        load_config(path, list(overrides))
    message = str(err.value)
    assert one_line(message), repr(message)
    return message


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.toml")), ids=lambda p: p.stem)
def test_every_shipped_config_parses(path):
    assert isinstance(load_config(path), PeerConfig)


def test_the_shipped_configs_are_there():
    assert {"tiny-cpu", "llama-150m", "llama-1b"} <= {p.stem for p in CONFIG_DIR.glob("*.toml")}


@pytest.mark.parametrize("name, hidden, layers, heads, kv_heads, ffn", [
    ("llama-150m", 1024, 12, 16, 16, 2688),
    ("llama-1b", 2048, 22, 32, 4, 5632),
])
def test_llama_configs_match_opendiloco(name, hidden, layers, heads, kv_heads, ffn):
    cfg = load_config(name)
    model, inner, outer = cfg.model, cfg.inner, cfg.outer
    assert (model.hidden_size, model.num_layers, model.num_heads, model.num_kv_heads, model.ffn_hidden_size) == (
        hidden, layers, heads, kv_heads, ffn)
    assert (inner.lr, inner.weight_decay, inner.betas, inner.warmup_steps) == (4e-4, 0.1, [0.9, 0.95], 1000)
    assert (outer.inner_steps, outer.lr, outer.momentum, outer.nesterov) == (500, 0.7, 0.9, True)


def test_overrides_are_typed_like_toml():
    cfg = load_config(None, ["inner.lr=3e-4", "run.run_id=abc", "inner.betas=[0.8,0.9]", "outer.nesterov=false",
                             'data.source="files"', 'data.paths=["a.txt"]'])
    assert type(cfg.inner.lr) is float and cfg.inner.lr == 3e-4
    assert cfg.run.run_id == "abc"
    assert cfg.inner.betas == [0.8, 0.9]
    assert cfg.outer.nesterov is False
    assert cfg.data.source == "files" and cfg.data.paths == ["a.txt"]


def test_later_overrides_win():
    assert load_config(None, ["inner.lr=1e-3", "inner.lr=2e-3"]).inner.lr == 2e-3


@pytest.mark.parametrize("override, must_contain", [
    ("inner.lrr=1", ["inner.lrr"]),
    ('inner.lr="fast"', ["inner.lr", "fast"]),
    ("outer.nesterov=yes", ["outer.nesterov", "yes"]),
    ("outer.inner_steps=1.5", ["outer.inner_steps", "1.5"]),
    ("inner=3", ["inner", "section"]),
    ("inner.lr.x=1", ["inner.lr", "not a section"]),
    ("no-equals-sign", ["no-equals-sign", "section.key=value"]),
    ("inner..lr=1", ["inner..lr"]),
    ('run.run_id="has space"', ["run.run_id"]),
    ("model.num_kv_heads=3", ["num_kv_heads"]),
    ("outer.momentum=0", ["nesterov"]),
])
def test_bad_overrides_are_one_line_errors(override, must_contain):
    message = config_error(override)
    for part in must_contain:
        assert part in message


@pytest.mark.parametrize("overrides, must_contain", [
    (["averaging.request_timeout=5.0"], ["request_timeout", "matchmaking_time"]),
    (["averaging.request_timeout=3.0", "averaging.matchmaking_time=3.0"], ["request_timeout", "matchmaking_time"]),
    (["data.seq_len=256"], ["data.seq_len=256", "max_seq_len=128"]),
    (["model.hidden_size=66"], ["hidden_size=66", "num_heads=4"]),
    (["data.source=files"], ["data.paths"]),
])
def test_cross_field_checks(overrides, must_contain):
    message = config_error(*overrides)
    for part in must_contain:
        assert part in message


def test_unknown_key_in_a_file_lists_the_valid_keys(tmp_path):
    path = tmp_path / "typo.toml"
    path.write_text("[inner]\nlrr = 1\n")
    message = config_error(path=path)
    assert "inner.lrr" in message and "typo.toml" in message and "valid: lr" in message


def test_invalid_toml_file(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[inner\nlr = 1\n")
    message = config_error(path=path)
    assert "broken.toml" in message and "not valid TOML" in message


def test_non_utf8_file(tmp_path):
    path = tmp_path / "binary.toml"
    path.write_bytes(b"\xff\xfe[inner]")
    assert "not valid TOML" in config_error(path=path)


def test_section_written_as_a_value_in_a_file(tmp_path):
    path = tmp_path / "flat.toml"
    path.write_text("inner = 3\n")
    assert "bad value for 'inner'" in config_error(path=path)
    assert "'inner' must be a [section]" in config_error("inner.lr=1", path=path)


def test_unknown_config_name_lists_the_shipped_ones():
    message = config_error(path="no-such-config")
    assert "no-such-config" in message
    for name in ("tiny-cpu", "llama-150m", "llama-1b"):
        assert name in message


def test_fingerprint_covers_what_the_swarm_shares():
    base = load_config().fingerprint()
    assert load_config().fingerprint() == base
    assert load_config(None, ["inner.lr=1e-3"]).fingerprint() == base
    assert load_config(None, ["outer.inner_steps=7"]).fingerprint() == base
    assert load_config(None, ["run.seed=1"]).fingerprint() != base
    assert load_config(None, ["model.num_layers=4"]).fingerprint() != base
    assert load_config(None, ["model.hidden_size=128"]).fingerprint() != base


def junk_strings(count: int = 30) -> list[str]:
    rng = random.Random(0)
    return ["".join(rng.choice(string.printable) for _ in range(rng.randint(1, 24))) for _ in range(count)]


def load_or_error(item: str) -> PeerConfig | ConfigError:
    """The loaded config or the ConfigError; any other exception propagates and fails the test."""
    try:
        return load_config(None, [item])
    except ConfigError as e:
        return e


@pytest.mark.parametrize("template", ["{}", "inner.lr={}", "model.{}=1"])
def test_fuzzed_overrides_load_or_raise_config_error(template):
    for junk in junk_strings():
        assert isinstance(load_or_error(template.format(junk)), PeerConfig | ConfigError)


def test_fuzzed_values_give_one_line_errors():
    for junk in junk_strings():
        outcome = load_or_error(f"inner.lr={junk}")
        assert isinstance(outcome, ConfigError), junk
        assert one_line(str(outcome)), repr(str(outcome))


def test_fuzzed_items_give_one_line_errors():
    for junk in junk_strings():
        outcome = load_or_error(junk)
        if isinstance(outcome, ConfigError):
            assert one_line(str(outcome)), repr(str(outcome))


@pytest.mark.parametrize("item", ["a\nb=1", "no\nequals"])
def test_line_break_in_a_set_item_still_gives_one_line(item):
    config_error(item)


def test_deeply_nested_value_is_a_config_error():
    config_error("inner.betas=" + "[" * 2000 + "]" * 2000)
