"""A slower volunteer on this machine: a cpu cgroup that holds a peer (and every process it forks) to a share of one
core, for the benchmarks and tests of unequal swarms.

    with cpu_quota("slowpeer", 0.15) as group:
        swarm.start_peer("slow", cgroup=group)      # tools/local_swarm.py

Linux only, as root: cgroup v1's cpu controller (``/sys/fs/cgroup/cpu``, ``cpu.cfs_quota_us``) or cgroup v2's
(``cpu.max``). The group is removed once its processes are gone, also when the caller fails; one left behind by a
killed run is reused (its limit written again).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 10_000
"""The quota's period: 10 ms (the kernel's default is 100 ms). A slower device is slower all the time; with 100 ms
periods a peer at 0.15 of a core ran 15 ms and then stood still 85 ms, and every message of its all-reduce waited
for its next period (BENCHMARKS.md, "Unequal volunteers"). The quota is 1 ms at least (the kernel's floor): a
period grows to keep the share where the share is below a tenth of a core."""
MIN_QUOTA_US = 1_000


def available() -> str:
    """Why a cpu cgroup cannot be made here ("" if it can)."""
    if os.geteuid() != 0:
        return "making a cpu cgroup needs root"
    if not (CGROUP_ROOT / "cpu" / "cpu.cfs_quota_us").exists() and not (CGROUP_ROOT / "cgroup.controllers").exists():
        return f"no cgroup cpu controller under {CGROUP_ROOT}"
    return ""


@contextlib.contextmanager
def cpu_quota(name: str, cores: float) -> Iterator[Path]:
    """A cpu cgroup ``name`` limited to ``cores`` (e.g. 0.15: 1.5 ms of every 10 ms, on one core); its directory,
    whose ``cgroup.procs`` a process writes its pid to (``LocalSwarm.start_peer(cgroup=...)``). Removed on exit."""
    if cores <= 0:
        raise ValueError(f"cores={cores}: give a positive share of a core, e.g. 0.15")
    why = available()
    if why:
        raise RuntimeError(why)
    v1 = (CGROUP_ROOT / "cpu" / "cpu.cfs_quota_us").exists()
    group = (CGROUP_ROOT / "cpu" / name) if v1 else (CGROUP_ROOT / name)
    group.mkdir(exist_ok=True)
    period = max(PERIOD_US, int(MIN_QUOTA_US / cores))
    quota = max(MIN_QUOTA_US, int(cores * period))
    if v1:
        (group / "cpu.cfs_quota_us").write_text("-1")  # (a period shorter than the quota in place is refused)
        (group / "cpu.cfs_period_us").write_text(str(period))
        (group / "cpu.cfs_quota_us").write_text(str(quota))
    else:
        (group / "cpu.max").write_text(f"{quota} {period}")
    try:
        yield group
    finally:
        _remove(group)


def _remove(group: Path, timeout: float = 15.0) -> None:
    """rmdir ``group`` once its processes have exited: the caller reaps them; what is still in it after ``timeout``
    seconds (a caller that failed before it could) is killed, the group being ours; ``OSError`` if the group is
    still busy ``timeout`` seconds after that."""
    deadline, killed = time.monotonic() + timeout, False
    while True:
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:  # busy: a process is still in it
            if time.monotonic() >= deadline:
                if killed:
                    raise
                _kill_members(group)
                deadline, killed = time.monotonic() + timeout, True
            time.sleep(0.2)


def _kill_members(group: Path) -> None:
    for pid in (group / "cgroup.procs").read_text().split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
