"""The environment variables that change what diloco-peer does, checked before anything reads them.

hivemind reads most of its variables when it is imported, so a bad value there is a traceback from deep
inside it; ours (``faults.FAULT_ENV``, fault injection for the tests) would silently inject nothing on a
typo. ``check_environment`` runs first in the CLI and turns either into one line naming the variable.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from .faults import FAULT_ENV, GRAMMAR, Faults
from .errors import ConfigError, shortened


def _is_int_at_least(low: int):
    def check(value: str) -> bool:
        try:
            return int(value) >= low  # int(), as hivemind reads these
        except ValueError:
            return False
    return check


def _is_fault_plan(value: str) -> bool:
    # a typo there would inject no fault at all, silently, and a bad argument be a traceback mid-run
    try:
        Faults.parse(value)
        return True
    except ConfigError:
        return False


ENVIRONMENT = {
    # ours: fault injection for the tests (faults.py); empty is the same as unset
    FAULT_ENV: (_is_fault_plan, GRAMMAR),
    # hivemind's, read when it is imported: a bad value there is a traceback from deep inside hivemind
    "HIVEMIND_LOGLEVEL": (lambda v: v in logging.getLevelNamesMapping(), "DEBUG, INFO, WARNING, ERROR or CRITICAL"),
    "HIVEMIND_MEMORY_SHARING_STRATEGY": (lambda v: v in ("file_system", "file_descriptor"),
                                         "file_system or file_descriptor"),
    "HIVEMIND_DHT_NUM_WORKERS": (_is_int_at_least(1), "an integer >= 1"),
    "HIVEMIND_SHM_BUFFER_SIZE": (_is_int_at_least(1), "an integer >= 1"),
    "QUANTIZATION_THREADS": (_is_int_at_least(1), "an integer >= 1"),
    "USE_LEGACY_BFLOAT16": (lambda v: v in ("0", "1"), "0 or 1"),
}
"""The environment variables that change what diloco-peer does: name -> (check, what a good value is)."""


def check_environment(environ: Mapping[str, str]) -> None:
    """Raise a ConfigError naming the first environment variable of ``ENVIRONMENT`` with a bad value.

    Call it before hivemind is imported: hivemind reads most of these at import time."""
    for name, (is_good, expected) in ENVIRONMENT.items():
        value = environ.get(name)
        if value is not None and not is_good(value):
            raise ConfigError(f"bad environment variable {name}={shortened(repr(value))}: expected {expected}; "
                              f"fix it or unset it (unset {name})")
