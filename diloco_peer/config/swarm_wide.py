"""Which config keys a swarm agrees on, and how a joiner's own choices meet the swarm's config.

Every key of the config is either **swarm-wide** (``SWARM_WIDE``: what every peer of a swarm must agree on for
its rounds to work, or for the run to be the run its owner designed) or **the volunteer's** (``VOLUNTEER``:
what depends on the volunteer's machine, network and patience). ``diloco-peer bootstrap --config NAME``
publishes the swarm-wide part of its config (``swarm_part``); ``diloco-peer join <address>`` takes it and keeps
the volunteer's own choices (``adopt``). A key is named whole (``outer.inner_steps``) or by its section
(``model``: every key in it); ``tests/test_run_config.py`` checks that every key of the schema is named exactly
once, so a key added later cannot be forgotten here.

    swarm = swarm_part(owner_cfg)                      # {"run": {"run_id": ..., "seed": ...}, "model": {...}, ...}
    cfg = adopt(local_cfg, {"outer.inner_steps": "--set"}, swarm, owner="12D3KooW...")  # or ConfigError
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError

from .errors import ConfigError, shortened
from .loading import parse_override, read_tree, resolve_config_path
from .peer import PeerConfig

SWARM_WIDE = (
    # the run and its replica: a pseudo-gradient is only averaged with those of the same initial weights and shape
    "run.run_id", "run.seed", "model",
    # the data: one corpus, read and tokenized alike, dealt into the same shards; one eval split, measured alike
    "data.source", "data.text_field", "data.hf_dataset", "data.hf_split", "data.tokenizer", "data.max_bytes",
    "data.seq_len", "data.eval_fraction", "data.eval_tokens", "data.eval_batches", "data.num_shards", "data.seed",
    # the recipe: the inner optimizer and its schedule
    "inner.lr", "inner.weight_decay", "inner.betas", "inner.warmup_steps", "inner.total_steps", "inner.min_lr_ratio",
    "inner.grad_clip",
    # the round: its length, the outer step, the overlap mode, the gate, matchmaking and the wire format
    "outer.inner_steps", "outer.round_length", "outer.contribution", "outer.lr", "outer.momentum", "outer.nesterov",
    "outer.overlap",
    "averaging.compression", "averaging.topk_density", "averaging.topk_bits", "averaging.feedback_decay",
    "averaging.min_peers", "averaging.first_round_timeout", "averaging.ready_timeout",
    "averaging.matchmaking_time", "averaging.start_when_complete", "averaging.request_timeout",
    "averaging.allreduce_timeout", "averaging.heartbeat", "averaging.part_size_bytes", "averaging.hand_in_slower_than",
    # the defences every reducer applies to the parts it averages
    "averaging.max_update_ratio", "averaging.max_weight_ratio", "averaging.aggregation", "averaging.min_cosine",
    "averaging.ban_cosine", "averaging.ban_after", "averaging.ban_seconds",
)
"""Keys every peer of a swarm must agree on: a joiner takes them from the swarm; one it states otherwise is refused."""

VOLUNTEER = (
    # how long, how fast and where this peer runs: its machine and its patience
    "run.max_rounds", "run.log_dir", "run.threads", "run.shutdown_grace",
    "inner.batch_size", "inner.grad_accum", "inner.precision", "inner.device",  # tokens weight the average
    "outer.momentum_on", "outer.apply_on_arrival",  # where the momentum lives, when an average is applied: same bits
    # where its copy of the data is, which shard it reads, how much of a stream it holds
    "data.paths", "data.shards_dir", "data.shard", "data.buffer_tokens",
    # what it sends and keeps for others: its memory and its link
    "averaging.error_feedback", "averaging.exchange_share", "averaging.bandwidth", "averaging.sync_timeout",
    "averaging.sync_attempts", "averaging.log_rounds", "averaging.serve_copy_in_memory_mb",
    # its addresses, identity, secret and reachability; its checkpoints and metrics
    "swarm", "checkpoint", "metrics",
)
"""Keys that are each volunteer's own: never taken from the swarm, never compared with it."""


def schema_keys(model: type[BaseModel] = PeerConfig, prefix: str = "") -> list[str]:
    """Every leaf key of the config schema, dotted (``run.run_id``, ..., ``metrics.host``), in schema order."""
    keys = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys += schema_keys(annotation, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def _named_by(key: str, names: tuple[str, ...]) -> bool:
    return any(key == name or key.startswith(f"{name}.") for name in names)


def is_swarm_wide(key: str) -> bool:
    """Whether dotted ``key`` is one the swarm agrees on (``SWARM_WIDE`` names it or its section)."""
    return _named_by(key, SWARM_WIDE)


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """A nested config tree -> {dotted key: value}; a list is a value, not a section."""
    flat = {}
    for name, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def stated_keys(config: str | None, overrides: list[str]) -> dict[str, str]:
    """The keys a joiner stated itself -> where: every key written in its ``--config`` file (not the defaults it
    leaves out), then its ``--set`` items (the CLI's flags among them: ``--listen`` sets ``swarm.host_maddrs``)."""
    stated = {key: f"--config {config}" for key in flatten(read_tree(resolve_config_path(config)))} if config else {}
    for item in overrides:
        stated[".".join(parse_override(item)[0])] = "--set"
    return stated


def _value(cfg: PeerConfig, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def swarm_part(cfg: PeerConfig) -> dict:
    """The swarm-wide keys of ``cfg`` and their values, as a nested tree of JSON values (what the owner publishes)."""
    part: dict = {}
    for key in schema_keys():
        if is_swarm_wide(key):
            section, name = key.split(".", 1)
            part.setdefault(section, {})[name] = _value(cfg, key)
    return json.loads(json.dumps(part))  # plain JSON values: a tuple would not compare equal to a list


def shown(value: Any) -> str:
    """A config value as a ``--set`` writes it: ``10``, ``0.7``, ``true``, ``"stdlib"``, ``[0.9, 0.95]``."""
    return shortened(json.dumps(value))


def _merged(local: PeerConfig, swarm: dict, owner: str) -> dict:
    """``local``'s tree with the swarm's swarm-wide values in it; keys this version does not know are refused."""
    tree = local.model_dump()
    known = set(schema_keys())
    for key, value in flatten(swarm).items():
        if key not in known:
            raise ConfigError(f"the swarm's config (from its owner {owner}) sets {key}, which this diloco-peer does "
                              f"not know: upgrade diloco-peer to join this swarm")
        if is_swarm_wide(key):  # a key another version calls swarm-wide but we do not: the volunteer's
            section, name = key.split(".", 1)
            tree[section][name] = value
    return tree


def adopt(local: PeerConfig, stated: dict[str, str], swarm: dict, owner: str) -> PeerConfig:
    """The config a joiner runs: ``local`` (its own config) with the swarm's swarm-wide values.

    :param local: the joiner's validated config (its ``--config``, or the default, with its ``--set`` and flags)
    :param stated: the keys the joiner stated itself -> where (``"--set"``, ``"--config NAME"``); a swarm-wide one
      whose value differs from the swarm's is refused, one line naming the key and both values. Keys the joiner
      did not state (the default config's) take the swarm's values silently.
    :param swarm: the swarm-wide part of the owner's config (``swarm_part``); a swarm-wide key it lacks (an owner of
      an older version) keeps ``local``'s value
    :param owner: the owner's peer id, for the messages
    """
    try:
        cfg = PeerConfig.model_validate(_merged(local, swarm, owner))
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"the swarm's config (from its owner {owner}) with this peer's own settings is not valid"
                          f"{' at ' + where if where else ''}: {first['msg'].removeprefix('Value error, ')}") from None
    for key, source in stated.items():
        if is_swarm_wide(key) and _value(local, key) != _value(cfg, key):
            fix = "drop the --set" if source == "--set" else f"drop {source} (join takes the swarm's config)"
            raise ConfigError(f"{key}={shown(_value(local, key))} disagrees with the swarm's "
                              f"{shown(_value(cfg, key))} (set by its owner {owner}): {fix}, or join another swarm")
    return cfg
