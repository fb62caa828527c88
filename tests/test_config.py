"""The config tree: shipped configs parse, overrides are typed like TOML, every mistake is one clear line;
the environment variables we (and hivemind) read are checked; fault injection is one parsed, injected test
seam; nothing in the package loads with pickle."""

import ast
import json
import math
import os
import random
import signal
import string
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import diloco_peer
from diloco_peer.config import CONFIG_DIR, ConfigError, PeerConfig, load_config
from diloco_peer.config.environment import ENVIRONMENT, check_environment
from diloco_peer.config.faults import FAULT_ENV, GRAMMAR, KINDS, NO_FAULTS, Faults

# the fuzz tests of this file together take a few seconds; no example database is written to the checkout
FUZZ = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


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


def test_numbers_too_long_for_python_are_config_errors(tmp_path):
    assert "too long a number" in config_error("run.seed=" + "1" * 5000)
    path = tmp_path / "long.toml"
    path.write_text("[run]\nseed = " + "1" * 5000 + "\n")
    assert "long.toml" in config_error(path=path)
    path.write_text("[inner]\nbetas = " + "[" * 5000 + "]" * 5000 + "\n")
    assert "nested too deeply" in config_error(path=path)


@pytest.mark.parametrize("override, must_contain", [
    ("inner.lr=inf", ["inner.lr", "finite"]),
    ("averaging.allreduce_timeout=1e999", ["averaging.allreduce_timeout", "finite"]),
    ("inner.betas=[0.9, nan]", ["inner.betas", "finite"]),
    ("run.seed=18446744073709551616", ["run.seed", "64 bits"]),
    ("data.num_shards=-9223372036854775809", ["data.num_shards"]),
    ("run.threads=100000", ["run.threads"]),
    ('run.log_dir="a\\u0000b"', ["run.log_dir", "NUL"]),
    ('data.paths=["ok.txt", "\\u0000"]', ["data.paths", "NUL"]),
    ("inner.lr=" + "x" * 500, ["inner.lr", "characters)"]),
])
def test_values_that_would_only_fail_deep_in_the_run_are_refused(override, must_contain):
    message = config_error(override)
    for part in must_contain:
        assert part in message
    assert len(message) < 400, message  # a huge value is shown cut short


def test_a_config_path_too_long_for_the_file_system_is_a_config_error():
    assert "cannot be read" in config_error(path="x" * 5000)


# --- fuzzing: whatever the input, a valid PeerConfig or a one-line ConfigError, never another exception

def _config_keys() -> list[str]:
    return [f"{section}.{key}" for section, field in PeerConfig.model_fields.items()
            for key in field.annotation.model_fields]


CONFIG_KEYS = _config_keys()
SECTIONS = list(PeerConfig.model_fields)


def toml_value(value) -> str:
    """``value`` in TOML syntax (json.dumps writes a string the way TOML's basic strings read it)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)} = {toml_value(v)}" for k, v in value.items()) + "}"


SCALARS = st.one_of(
    st.booleans(),
    st.integers(min_value=-10, max_value=10_000),
    st.integers(),  # hypothesis' own edge cases: 0, -1, 2**63, 2**64, huge
    st.floats(),  # nan, inf, -0.0, subnormals, 1e308
    st.text(max_size=20),  # unicode, empty
    st.sampled_from(["cpu", "stdlib", "files", "bf16", "int4", "delayed", "robust", "/ip4/0.0.0.0/tcp/0"]),
)
TOML_VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=2), max_leaves=6)
RAW_VALUES = st.one_of(
    TOML_VALUES.map(toml_value),
    st.sampled_from(["", "nan", "+inf", "-inf", "1e999", "-0", "0x7fffffffffffffff", "1_000", "9" * 40, "[", "]",
                     "{", '"', "'", "[[]]", "{x=1}", "yes", "none", "1979-05-27", "'\\u0000'"]),
    st.text(max_size=30),  # a bare word, or garbage
    st.integers(4290, 4400).map(lambda digits: "9" * digits),  # around Python's int() limit of 4300 digits
    st.integers(1, 3000).map(lambda depth: "[" * depth + "]" * depth),
)
KEYS = st.one_of(
    st.sampled_from(CONFIG_KEYS),
    st.sampled_from(SECTIONS),
    st.builds(lambda key, tail: f"{key}.{tail}", st.sampled_from(CONFIG_KEYS), st.text(max_size=5)),
    st.text(max_size=20),
)
OVERRIDES = st.one_of(st.builds(lambda key, value: f"{key}={value}", KEYS, RAW_VALUES), st.text(max_size=30))


def load_all_or_error(path, overrides: list[str]) -> PeerConfig | ConfigError:
    """The loaded config or the ConfigError; any other exception propagates and fails the test."""
    try:
        return load_config(path, overrides)
    except ConfigError as e:
        return e


def leaves(tree):
    if isinstance(tree, dict):
        for value in tree.values():
            yield from leaves(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from leaves(value)
    else:
        yield tree


def assert_config_or_one_line_error(outcome) -> None:
    if isinstance(outcome, ConfigError):
        assert one_line(str(outcome)) and str(outcome).strip(), repr(str(outcome))
        return
    assert isinstance(outcome, PeerConfig)
    outcome.fingerprint()  # a config that loads is usable...
    for value in leaves(outcome.model_dump()):  # ...and holds nothing that fails only deep in the run
        assert not isinstance(value, float) or math.isfinite(value), outcome
        assert not isinstance(value, int) or -2**63 <= value < 2**63, outcome
        assert not isinstance(value, str) or "\x00" not in value, outcome


@FUZZ
@given(st.lists(OVERRIDES, max_size=4))
def test_fuzzed_set_overrides_load_or_give_one_line_errors(overrides):
    assert_config_or_one_line_error(load_all_or_error(None, overrides))


def toml_file(tree: dict) -> str:
    """A TOML document of ``tree``: top-level values first, then one [table] per dict."""
    lines = [f"{json.dumps(k, ensure_ascii=False)} = {toml_value(v)}" for k, v in tree.items()
             if not isinstance(v, dict)]
    for name, table in tree.items():
        if isinstance(table, dict):
            lines.append(f"[{json.dumps(name, ensure_ascii=False)}]")
            lines += [f"{json.dumps(k, ensure_ascii=False)} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


TABLES = st.dictionaries(st.one_of(st.sampled_from(SECTIONS), st.text(max_size=8)),
                         st.one_of(st.dictionaries(st.one_of(st.sampled_from([k.split(".")[1] for k in CONFIG_KEYS]),
                                                             st.text(max_size=8)), TOML_VALUES, max_size=4),
                                   SCALARS), max_size=4)
DOCUMENTS = st.one_of(
    TABLES.map(toml_file).map(str.encode),
    # a shipped config with a random cut, insertion or deletion (mostly valid TOML with one odd value)
    st.builds(lambda text, at, junk, cut: (text[:at] + junk + text[at + cut:]).encode(),
              st.just((CONFIG_DIR / "tiny-cpu.toml").read_text()), st.integers(0, 2000), st.text(max_size=10),
              st.integers(0, 20)),
    st.binary(max_size=200),
    st.integers(1, 3000).map(lambda depth: f"[inner]\nbetas = {'[' * depth}{']' * depth}\n".encode()),
)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")  # one for all examples: hypothesis calls the test many times


@FUZZ
@given(DOCUMENTS, st.lists(OVERRIDES, max_size=2))
def test_fuzzed_config_files_load_or_give_one_line_errors(fuzz_dir, document, overrides):
    path = fuzz_dir / "fuzzed.toml"
    path.write_bytes(document)
    assert_config_or_one_line_error(load_all_or_error(path, overrides))


# --- environment variables

@pytest.mark.parametrize("name, value", [
    ("DILOCO_PEER_FAULT", ""), ("DILOCO_PEER_FAULT", "crash_in_allreduce:3"), ("DILOCO_PEER_FAULT", "poison:1000"),
    ("DILOCO_PEER_FAULT", "poison:nan"), ("DILOCO_PEER_FAULT", "poison:signflip"),
    ("DILOCO_PEER_FAULT", "poison:shape"), ("DILOCO_PEER_FAULT", "lie_epoch:1000"),
    ("DILOCO_PEER_FAULT", "corrupt_state"), ("DILOCO_PEER_FAULT", "corrupt_state:nan"),
    ("HIVEMIND_LOGLEVEL", "WARNING"), ("HIVEMIND_LOGLEVEL", "DEBUG"),
    ("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_system"), ("HIVEMIND_DHT_NUM_WORKERS", "8"),
    ("HIVEMIND_SHM_BUFFER_SIZE", "16"), ("QUANTIZATION_THREADS", "4"), ("USE_LEGACY_BFLOAT16", "0"),
])
def test_good_environment_values_pass(name, value):
    check_environment({name: value})


@pytest.mark.parametrize("name, value", [
    ("DILOCO_PEER_FAULT", "crash_in_allreduce:x"), ("DILOCO_PEER_FAULT", "crash_in_allreduce:0"),
    ("DILOCO_PEER_FAULT", "crash:3"), ("DILOCO_PEER_FAULT", "poison:lots"), ("DILOCO_PEER_FAULT", "poison"),
    ("DILOCO_PEER_FAULT", "lie_epoch:soon"), ("DILOCO_PEER_FAULT", "corrupt_state:bits"),
    ("HIVEMIND_LOGLEVEL", "loud"), ("HIVEMIND_LOGLEVEL", "debug"), ("HIVEMIND_LOGLEVEL", ""),
    ("HIVEMIND_MEMORY_SHARING_STRATEGY", "shared"), ("HIVEMIND_DHT_NUM_WORKERS", "0"),
    ("HIVEMIND_DHT_NUM_WORKERS", "four"), ("HIVEMIND_SHM_BUFFER_SIZE", ""), ("QUANTIZATION_THREADS", "-1"),
    ("USE_LEGACY_BFLOAT16", "yes"),
])
def test_bad_environment_values_are_one_line_errors_naming_variable_and_value(name, value):
    with pytest.raises(ConfigError) as err:
        check_environment({"HOME": "/root", name: value})
    message = str(err.value)
    assert one_line(message) and f"{name}={value!r}" in message and f"unset {name}" in message


# --- fault injection: a test seam (config/faults.py), parsed once, a no-op by default

@pytest.mark.parametrize("text, plan", [
    ("", Faults()),
    ("crash_in_allreduce:3", Faults(crash_in_allreduce=3)), ("freeze_in_allreduce:2", Faults(freeze_in_allreduce=2)),
    ("poison:nan", Faults(poison_kind="nan")), ("poison:signflip", Faults(poison_kind="signflip")),
    ("poison:shape", Faults(poison_kind="shape")), ("poison:weight", Faults(poison_kind="weight")),
    ("poison:1000", Faults(poison_kind="scale", poison_scale=1000.0)),
    ("poison:-0.5", Faults(poison_kind="scale", poison_scale=-0.5)),
    ("lie_epoch:1000", Faults(lie_epoch=1000)), ("lie_epoch:0", Faults(lie_epoch=0)),
    ("corrupt_state", Faults(corrupt="noise")), ("corrupt_state:noise", Faults(corrupt="noise")),
    ("corrupt_state:nan", Faults(corrupt="nan")), ("slow_serve:12.5", Faults(serve_delay=12.5)),
    ("break_serve:5", Faults(serve_break_after=5)), ("stall_serve:0", Faults(serve_stall_after=0)),
])
def test_each_fault_parses_to_its_plan(text, plan):
    assert Faults.parse(text) == plan
    assert Faults.from_environment({"HOME": "/root", FAULT_ENV: text}) == plan
    check_environment({FAULT_ENV: text})  # the environment check is the same parser


@pytest.mark.parametrize("text", [
    "crash_in_allreduce:x", "crash_in_allreduce:0", "crash_in_allreduce", "crash:3", "freeze_in_allreduce:0",
    "freeze_in_allreduce", "poison:lots", "poison",
    "poison:", "lie_epoch:soon", "lie_epoch:-1", "lie_epoch", "corrupt_state:bits", "Poison:nan", " poison:nan",
    "slow_serve", "slow_serve:0", "slow_serve:-1", "slow_serve:soon", "slow_serve:1e9", "stall_serve",
    "stall_serve:-1", "stall_serve:x",
])
def test_a_bad_fault_is_a_one_line_error_naming_it_and_the_good_ones(text):
    with pytest.raises(ConfigError) as err:
        Faults.parse(text)
    message = str(err.value)
    assert one_line(message) and repr(text) in message and FAULT_ENV in message and GRAMMAR in message, message


def test_a_huge_bad_fault_is_shortened_in_the_error():
    with pytest.raises(ConfigError) as err:
        Faults.from_environment({FAULT_ENV: "poison:" + "9" * 5000 + "x"})
    assert one_line(str(err.value)) and len(str(err.value)) < 400 and "(5008 characters)" in str(err.value)


def test_no_fault_is_the_default_and_its_hooks_do_nothing():
    assert Faults.from_environment({"HOME": "/root"}) == NO_FAULTS == Faults()
    tensors = [torch.ones(2), torch.full((3,), 2.0)]
    NO_FAULTS.poison(tensors)
    assert [t.tolist() for t in tensors] == [[1.0, 1.0], [2.0, 2.0, 2.0]]
    assert NO_FAULTS.poisoned_weight(5.0) == 5.0 and not NO_FAULTS.truncates_parts and NO_FAULTS.lie_epoch is None
    assert NO_FAULTS.corrupt_state(tensors) is tensors
    NO_FAULTS.crash_now_if_due(0)  # returns: all-reduce 0 is "never", not a match
    Faults.parse("crash_in_allreduce:3").crash_now_if_due(2)


@pytest.mark.parametrize("text, sent", [
    ("poison:nan", [math.nan] * 3), ("poison:signflip", [-1.0, -2.0, -2.0]), ("poison:3", [3.0, 6.0, 6.0]),
    ("poison:shape", [1.0, 2.0, 2.0]), ("poison:weight", [1.0, 2.0, 2.0]),
])
def test_poison_hooks_change_what_a_peer_sends(text, sent):
    faults = Faults.parse(text)
    tensors = [torch.ones(1), torch.full((2,), 2.0)]
    faults.poison(tensors)
    torch.testing.assert_close(torch.cat(tensors), torch.tensor(sent), equal_nan=True)
    assert faults.poisoned_weight(5.0) == (1e12 if text == "poison:weight" else 5.0)
    assert faults.truncates_parts == (text == "poison:shape")


def test_corrupt_state_hooks_change_the_weights_served():
    noisy = Faults.parse("corrupt_state").corrupt_state([torch.zeros(2)])
    torch.testing.assert_close(torch.cat(noisy), torch.full((2,), 1e-3))
    assert bool(torch.cat(Faults.parse("corrupt_state:nan").corrupt_state([torch.zeros(2)])).isnan().all())


def test_crash_in_allreduce_kills_the_process_and_its_parent():
    # the averager process calls the hook: its parent is the daemon, and both must die at once (SIGKILL)
    script = ("import os, time\n"
              "from diloco_peer.config.faults import Faults\n"
              "if os.fork() == 0:\n"
              "    Faults.parse('crash_in_allreduce:3').crash_now_if_due(3)\n"
              "    os._exit(0)\n"
              "time.sleep(60)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=30)
    assert result.returncode == -signal.SIGKILL, result


def test_freeze_in_allreduce_stops_the_averager_process_alone():
    # the averager process calls the hook: it stops, silent, and its parent (the daemon) runs on
    pid = os.fork()
    if pid == 0:
        Faults.parse("freeze_in_allreduce:3").crash_now_if_due(2)  # not the planned all-reduce: goes on
        Faults.parse("freeze_in_allreduce:3").crash_now_if_due(3)
        os._exit(0)
    try:
        _, status = os.waitpid(pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status) and os.WSTOPSIG(status) == signal.SIGSTOP, status
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_only_the_fault_seam_reads_the_fault_variable():
    """No module but config/faults.py names the variable or tests a fault's name (environment.py validates the
    variable through Faults.parse); the daemon parses it once and passes the plan on."""
    package = Path(diloco_peer.__file__).parent
    for path in sorted(package.rglob("*.py")):
        if path == package / "config" / "faults.py":
            continue
        source, where = path.read_text(), path.relative_to(package)
        assert FAULT_ENV not in source, f"{where} names {FAULT_ENV}: take a Faults (config/faults.py) instead"
        if path != package / "config" / "environment.py":
            assert "FAULT_ENV" not in source, f"{where} reads FAULT_ENV: take a Faults (config/faults.py) instead"
        tree = ast.parse(source)
        docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
        strings = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
                   and isinstance(node.value, str) and id(node) not in docstrings]
        tested = [s for s in strings if any(s.startswith(kind) for kind in KINDS)]
        assert not tested, f"{where} tests a fault's name ({tested}): call a hook of config/faults.Faults instead"


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(ENVIRONMENT)), st.text(max_size=30)))
def test_fuzzed_environment_passes_or_gives_one_line_errors(environ):
    try:
        check_environment(environ)
    except ConfigError as e:
        assert one_line(str(e)) and "bad environment variable" in str(e)


# --- nothing loads with pickle

PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "shelve", "marshal", "joblib"}


def pickle_loaders(source: str) -> list[str]:
    """Ways ``source`` could run code hidden in data it reads: pickle-based modules, ``torch.load`` without
    ``weights_only=True``, ``allow_pickle=True``, ``yaml.load``/``unsafe_load``, ``read_pickle``, eval/exec."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"line {node.lineno}: import {n}" for n in names if n.split(".")[0] in PICKLE_MODULES]
        if not isinstance(node, ast.Call):
            continue
        func = ast.unparse(node.func)
        keywords = {k.arg: k.value for k in node.keywords}
        weights_only = keywords.get("weights_only")
        if func.endswith("torch.load") and not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
            found.append(f"line {node.lineno}: {func}(...) without weights_only=True")
        allow = keywords.get("allow_pickle")
        if allow is not None and not (isinstance(allow, ast.Constant) and allow.value is False):
            found.append(f"line {node.lineno}: {func}(..., allow_pickle=...)")
        if func.split(".")[-1] in ("unsafe_load", "full_load", "read_pickle") or func in ("eval", "exec") or (
                func.endswith("yaml.load") and "Loader" not in keywords):
            found.append(f"line {node.lineno}: {func}(...)")
    return found


@pytest.mark.parametrize("source", [
    "import pickle", "from cloudpickle import loads", "import torch\ntorch.load(f)",
    "torch.load(f, weights_only=False)", "import numpy as np\nnp.load(f, allow_pickle=True)",
    "import yaml\nyaml.load(text)", "eval(text)", "pd.read_pickle(f)",
])
def test_the_pickle_scan_finds_pickle_loaders(source):
    assert pickle_loaders(source), source


def test_nothing_in_the_package_loads_with_pickle():
    package = Path(diloco_peer.__file__).parent
    found = {str(path.relative_to(package)): pickle_loaders(path.read_text()) for path in sorted(package.rglob("*.py"))}
    assert len(found) > 30, "the scan must see every module of the package"
    assert {name: hits for name, hits in found.items() if hits} == {}
    loads = 'torch.load(path, map_location="cpu", weights_only=True'  # checkpoints load (memory-mapped) without pickle
    assert loads in (package / "state" / "checkpoint.py").read_text()


def test_msgpack_from_the_network_builds_no_objects_beyond_hivemind_s_own_two():
    """State-sync metadata and DHT records are msgpack (hivemind's MSGPackSerializer): plain data, tuples, and
    the ext types registered with it. A new registration (a pickle-backed one, say) must be a conscious choice."""
    import msgpack
    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.utils.serializer import MSGPackSerializer
    from hivemind.utils.tensor_descr import BatchTensorDescriptor

    import diloco_peer.daemon  # noqa: F401 (everything a peer imports registers its ext types now)

    assert set(MSGPackSerializer._ext_type_codes.values()) == {DictionaryDHTValue, BatchTensorDescriptor}
    unknown = msgpack.packb(msgpack.ExtType(0x42, b"\x80\x04c__main__\nEvil\n."))  # a pickle in an ext type
    assert MSGPackSerializer.loads(unknown) == b"\x80\x04c__main__\nEvil\n."  # left as bytes, not unpickled
