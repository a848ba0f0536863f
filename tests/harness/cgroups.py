"""cgroup v1 groups that a server can be started in (through `Node.wrapper`): a memory limit,
and read throttling that makes the local disk behave like a network volume. Used by the WAL
cache benchmark and tests; creating them needs root."""

from __future__ import annotations

import os
import time
from pathlib import Path

CGROUP_V1 = Path("/sys/fs/cgroup")


class Cgroup:
    """A cgroup v1 group of one controller, with `settings` written into its files."""

    def __init__(self, controller: str, name: str, settings: dict[str, str]):
        self.path = CGROUP_V1 / controller / name
        self.path.mkdir(exist_ok=True)
        for file, value in settings.items():
            (self.path / file).write_text(value)
        self.wrapper = ["sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', f"in-{controller}-cgroup"]

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


class MemoryCgroup(Cgroup):
    """A memory group with a limit."""

    def __init__(self, name: str, limit: str):
        super().__init__("memory", name, {"memory.limit_in_bytes": limit})

    def usage_mb(self) -> float:
        return int((self.path / "memory.usage_in_bytes").read_text()) / 2**20


class BlkioThrottle(Cgroup):
    """Limits on reads from one disk (`device` as major:minor): storage like a network
    volume's (EBS gp3's baseline is 3000 IOPS and 125 MB/s) instead of a local disk."""

    def __init__(self, name: str, device: str, iops: int = 0, mbps: int = 0):
        settings = {}
        if iops:
            settings["blkio.throttle.read_iops_device"] = f"{device} {iops}"
        if mbps:
            settings["blkio.throttle.read_bps_device"] = f"{device} {mbps * 2**20}"
        super().__init__("blkio", name, settings)


def controller_available(controller: str) -> bool:
    return (CGROUP_V1 / controller).is_dir()


def data_device(path: Path) -> str | None:
    """major:minor of the block device holding `path` (the whole disk, not a partition);
    None when `path` is not on a block device."""
    device = os.stat(path).st_dev
    major, minor = os.major(device), os.minor(device)
    sys_dev = Path(f"/sys/dev/block/{major}:{minor}")
    if not sys_dev.exists():
        return None
    if (sys_dev / "partition").exists():
        return (sys_dev.resolve().parent / "dev").read_text().strip()
    return f"{major}:{minor}"
