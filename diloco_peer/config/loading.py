"""Loading a config: a TOML file (a path, or the name of one shipped in ``configs/``) plus ``--set`` overrides.

Values in ``--set`` use TOML syntax (``inner.lr=3e-4``, ``data.paths=["a.txt"]``, ``run.run_id="my-run"``;
a bare word is taken as a string). Every mistake becomes a :class:`ConfigError` with a one-line message
that names the bad key or value and says how to fix it.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from .errors import ConfigError, shortened
from .peer import PeerConfig

_PACKAGE = Path(__file__).resolve().parent.parent


def _shipped_configs() -> Path:
    # a wheel installs configs/ inside the package (setup.py); a checkout, installed editable or not, has it at
    # the top, beside the package
    installed = _PACKAGE / "configs"
    return installed if installed.is_dir() else _PACKAGE.parent / "configs"


CONFIG_DIR = _shipped_configs()
"""The shipped configs (tiny-cpu, llama-150m, llama-1b): the top-level ``configs/``, in a wheel install too."""
DEFAULT_CONFIG = "tiny-cpu"


def resolve_config_path(name_or_path: str) -> Path:
    """``tiny-cpu`` -> ``configs/tiny-cpu.toml``; any existing path is taken as it is."""
    path = Path(name_or_path)
    known = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.toml")))
    try:
        if path.is_file():
            return path
        shipped = CONFIG_DIR / f"{name_or_path.removesuffix('.toml')}.toml"
        if shipped.is_file():
            return shipped
    except OSError as e:  # e.g. a name too long for the file system
        raise ConfigError(f"config '{shortened(name_or_path)}' cannot be read ({e.strerror}): give a TOML file "
                          f"path or one of: {known}") from None
    raise ConfigError(f"config '{shortened(name_or_path)}' not found: give a TOML file path or one of: {known}")


def parse_override(item: str) -> tuple[list[str], Any]:
    """``inner.lr=3e-4`` -> (["inner", "lr"], 0.0003). Values use TOML syntax; a bare word is a string."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"bad --set '{item}': expected section.key=value, e.g. --set inner.lr=3e-4")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word such as cpu or my-run
    except RecursionError:
        raise ConfigError(f"bad --set value for '{key}': nested too deeply") from None
    except ValueError:  # Python's int() refuses numbers of more than 4300 digits
        raise ConfigError(f"bad --set value for '{key}': {shortened(raw)} is too long a number") from None
    return key.split("."), value


def _apply_override(tree: dict, path: list[str], value: Any) -> None:
    node = tree
    model = PeerConfig
    for depth, part in enumerate(path):
        fields = model.model_fields
        if part not in fields:
            where = ".".join(path[:depth]) or "top level"
            raise ConfigError(
                f"unknown config key '{'.'.join(path)}': '{part}' is not in [{where}] (valid: {', '.join(fields)})"
            )
        annotation = fields[part].annotation
        is_section = isinstance(annotation, type) and issubclass(annotation, BaseModel)
        if depth == len(path) - 1:
            if is_section:
                raise ConfigError(f"'{'.'.join(path)}' is a section: set one of its keys, e.g. {part}.<key>=value")
            node[part] = value
            return
        if not is_section:
            raise ConfigError(f"'{'.'.join(path[:depth + 1])}' is a value, not a section: drop the rest of the key")
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"'{'.'.join(path[:depth + 1])}' must be a [section] in the config file, not a value")
        model = annotation


def _format_error(err: ValidationError, source: str) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        section = ".".join(str(p) for p in first["loc"][:-1])
        model = PeerConfig
        for part in first["loc"][:-1]:
            model = model.model_fields[str(part)].annotation
        valid = ", ".join(model.model_fields)
        return f"unknown config key '{loc}' in {source}: not in [{section or 'top level'}] (valid: {valid})"
    if "input" in first and first["type"] not in ("value_error", "missing"):
        return f"bad value for '{loc}' in {source}: {shortened(repr(first['input']))}: {msg}"
    return f"bad config in {source}{' at ' + loc if loc else ''}: {msg.removeprefix('Value error, ')}"


def read_tree(config_path: Path) -> dict:
    """The TOML file ``config_path`` as it is written (not validated, no defaults filled in)."""
    try:
        tree = tomllib.loads(config_path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{config_path} is not valid TOML: {e}") from None
    except ValueError as e:  # a number of more than 4300 digits (Python's int() limit)
        raise ConfigError(f"{config_path} is not usable TOML: {shortened(str(e))}") from None
    except RecursionError:
        raise ConfigError(f"{config_path} is not usable TOML: arrays or tables nested too deeply") from None
    except OSError as e:
        raise ConfigError(f"cannot read config {config_path}: {e.strerror}") from None
    return tree


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> PeerConfig:
    """Read a TOML config (a path or a shipped name; default tiny-cpu), apply ``--set`` overrides, validate."""
    config_path = resolve_config_path(str(path) if path else DEFAULT_CONFIG)
    tree = read_tree(config_path)
    for item in overrides:
        _apply_override(tree, *parse_override(item))
    source = f"{config_path}" + (" + --set" if overrides else "")
    try:
        return PeerConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_error(e, source)) from None
