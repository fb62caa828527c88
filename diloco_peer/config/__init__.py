"""The configuration: one pydantic tree, validated once; each component is handed only its own section.

Owns: the config schema (the run's sections: ``schema.py``; the node's and the whole tree: ``peer.py``), reading
TOML files and ``--set`` overrides (``loading.py``), which keys a swarm agrees on and how a joiner's own meet them
(``swarm_wide.py``), the shipped configs (the top-level
``configs/*.toml``, which a wheel installs as ``diloco_peer/configs``), the environment variables we accept
(``environment.py``), the fault-injection test seam they can switch on (``faults.py``), and the errors a user
sees, one line each (``errors.py``).
Imports: nothing of diloco_peer (the bottom layer), and neither torch nor hivemind, so that the CLI can
check every command line before the heavy imports.
"""

from .errors import ConfigError, DataError
from .loading import CONFIG_DIR, DEFAULT_CONFIG, load_config, parse_override, resolve_config_path
from .peer import CheckpointConfig, MetricsConfig, PeerConfig, SwarmConfig
from .schema import NAME_PATTERN, AveragingConfig, DataConfig, InnerConfig, ModelConfig, OuterConfig, RunConfig

__all__ = [
    "CONFIG_DIR", "DEFAULT_CONFIG", "NAME_PATTERN", "AveragingConfig", "CheckpointConfig", "ConfigError",
    "DataConfig", "DataError", "InnerConfig", "MetricsConfig", "ModelConfig", "OuterConfig", "PeerConfig",
    "RunConfig", "SwarmConfig", "load_config", "parse_override", "resolve_config_path",
]
