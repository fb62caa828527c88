"""The errors a user sees before anything runs: a bad config, bad data settings, and how they quote the input.

Each message is one line that names the bad key or value and says how to fix it; the CLI prints it as it is.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad config file, key or value. The message is one line, fit to print as it is."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).splitlines()))  # user input may carry line breaks


class DataError(ValueError):
    """Unusable data settings or files; the message says which and how to fix it (raised by
    ``training/data.py``, defined here so that the CLI can catch it without importing torch)."""


def shortened(text: str, limit: int = 80) -> str:
    """A bad value as an error message shows it: whole if short, its start and its length if not (a value
    pasted by mistake can be megabytes long, and the message must stay one readable line)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
