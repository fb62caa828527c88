"""The environment variables that change what diloco-peer does, checked before anything reads them.

hivemind reads most of its variables when it is imported, so a bad value there is a traceback from deep
inside it; ours (``DILOCO_PEER_FAULT``, fault injection for the tests) would silently inject nothing on a
typo. ``check_environment`` runs first in the CLI and turns either into one line naming the variable.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

from .loading import _shorten
from .schema import ConfigError


def _is_int_at_least(low: int):
    def check(value: str) -> bool:
        try:
            return int(value) >= low  # int(), as hivemind reads these
        except ValueError:
            return False
    return check


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _is_int(text: str) -> bool:
    try:
        int(text)
        return True
    except ValueError:
        return False


FAULTS = {
    # kind -> (is its argument good, how the error shows it). The kinds that averaging_round.py, allreduce.py,
    # progress.py and state_sync.py read from FAULT_ENV: a new kind goes here too (test_config checks it)
    "crash_in_allreduce": (lambda arg: re.fullmatch(r"[1-9][0-9]*", arg) is not None, "crash_in_allreduce:N"),
    "poison": (lambda arg: arg in ("nan", "signflip", "shape", "weight") or _is_number(arg),
               "poison:nan|signflip|shape|weight|X"),
    "lie_epoch": (_is_int, "lie_epoch:N"),
    "corrupt_state": (lambda arg: arg in ("", "nan", "noise"), "corrupt_state[:nan]"),
}


def _is_fault(value: str) -> bool:
    """The grammar of averaging_round.FAULT_ENV: a typo there injects no fault at all, silently, and a bad
    argument is a traceback in the middle of the run."""
    kind, sep, arg = value.partition(":")
    return kind in FAULTS and (bool(sep) or kind == "corrupt_state") and FAULTS[kind][0](arg)


ENVIRONMENT = {
    # ours: fault injection for the tests (see averaging_round.py); empty is the same as unset
    "DILOCO_PEER_FAULT": (lambda v: v == "" or _is_fault(v), ", ".join(shown for _, shown in FAULTS.values())),
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
            raise ConfigError(f"bad environment variable {name}={_shorten(repr(value))}: expected {expected}; "
                              f"fix it or unset it (unset {name})")
