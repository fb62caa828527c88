"""The peer's event log: one JSON object per line, appended as things happen.

It is the peer's record of what it did (``start``, ``progress`` during inner steps, ``averaging`` when an
all-reduce begins, ``round`` after each outer round, ``sync`` when it downloaded the swarm's state,
``serve`` when a peer downloaded ours, ``checkpoint`` when one is on disk, ``stop``) and the interface
the demo, the tests and ``plot`` read. Every line is flushed at once, so a reader tailing the file sees
a round the moment it ends.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

logger = logging.getLogger(__name__)


class EventLog:
    """Appends events to ``path``; ``on_event(event)``, if given, sees each one too (the metrics do)."""

    def __init__(self, path: Path, on_event: Callable[[dict], None] | None = None):
        self.path = path
        self.on_event = on_event
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()  # state sync writes ``serve`` events from hivemind's thread

    def write(self, event: str, **fields) -> None:
        record = {"event": event, "time": time.time(), **fields}
        line = json.dumps(record) + "\n"
        with self._lock:
            if not self._file.closed:
                self._file.write(line)
                self._file.flush()
            if self.on_event is not None:
                try:
                    self.on_event(record)
                except Exception:  # an observer's bug must not stop training; the log line is written
                    logger.exception(f"event observer failed on a {event!r} event")

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_events(path: Path) -> Iterator[dict]:
    """All complete events of a log (a half-written last line, if any, is skipped)."""
    if not path.exists():
        return
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.endswith("\n"):
                yield json.loads(line)


class EventFollower:
    """Yields the events appended to a log since the last call (for live progress; the file may not exist yet)."""

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0
        self._partial = b""

    def new_events(self) -> list[dict]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = self._partial + f.read()
            self._offset = f.tell()
        *lines, self._partial = data.split(b"\n")
        return [json.loads(line) for line in lines if line]
