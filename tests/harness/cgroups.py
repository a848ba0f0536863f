"""cgroup v1 groups that a server, a client or any command can be started in (through
`Node.wrapper` or a command prefix): CPU sets, CPU accounting, block-I/O throttling and
counting, memory limits. Used by the WAL cache benchmark and tests, and by the failover
benchmark, which gives every node a budget of its own (`NodeCgroups`). Creating them needs
root.

Every group gets a unique name (the caller's label, this process's pid and a serial number),
so that runs side by side never share one, and is created inside the group this process is
in for that controller, not beside it: the limits and the accounting of whoever started us
still hold for what we start. `remove()` moves any process still inside to the parent
group, then deletes the group.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_V1 = Path("/sys/fs/cgroup")
_serial = itertools.count()


def own_group(controller: str) -> str:
    """This process's group in the controller's hierarchy ("/" at the top)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return path
    return "/"


def unique_name(label: str) -> str:
    return f"{label}-{os.getpid()}-{next(_serial)}"


def enter_command(paths: list[Path]) -> list[str]:
    """A command prefix that moves itself into every group of `paths`, then execs the rest
    (`[*prefix, program, args...]`); the program's children stay in them."""
    moves = " && ".join(f"echo $$ > {path}/cgroup.procs" for path in paths)
    return ["sh", "-c", f'{moves} && exec "$@"', "in-cgroups"]


class Cgroup:
    """A cgroup v1 group of one controller, with `settings` written into its files (in order)."""

    def __init__(self, controller: str, name: str, settings: dict[str, str]):
        self.controller = controller
        self.parent = CGROUP_V1 / controller / own_group(controller).lstrip("/")
        self.path = self.parent / unique_name(name)
        self.path.mkdir()
        try:
            for file, value in settings.items():
                (self.path / file).write_text(value)
        except BaseException:
            self.remove()
            raise
        self.wrapper = enter_command([self.path])

    def pids(self) -> list[int]:
        try:
            return [int(pid) for pid in (self.path / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return []

    def remove(self) -> None:
        for _ in range(50):
            for pid in self.pids():  # leftovers (a zombie being reaped, a straggler) go up
                try:
                    (self.parent / "cgroup.procs").write_text(str(pid))
                except OSError:
                    pass
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


class MemoryCgroup(Cgroup):
    """A memory group with a limit."""

    def __init__(self, name: str, limit: str):
        super().__init__("memory", name, {"memory.limit_in_bytes": limit})

    def usage_mb(self) -> float:
        return int((self.path / "memory.usage_in_bytes").read_text()) / 2**20

    def stat(self) -> dict[str, int]:
        """memory.stat: the group's own counters (bytes, or pages for pgpgin/pgpgout)."""
        pairs = (line.partition(" ") for line in (self.path / "memory.stat").read_text().splitlines())
        return {key: int(value) for key, _, value in pairs if value.strip().isdigit()}

    def page_cache_mb(self) -> float:
        """The page cache charged to the group (memory.stat `cache`: files and shared memory)."""
        return self.stat().get("cache", 0) / 2**20


class BlkioThrottle(Cgroup):
    """Limits on reads (and, if given, writes) from one disk (`device` as major:minor):
    storage like a network volume's (a general-purpose cloud SSD volume's baseline is 3000
    IOPS and 125 MB/s) instead of a local disk. With no limit it only counts. In cgroup v1
    a buffered write is written back by the kernel's flusher threads, outside the group, so
    write limits hold only for direct and synchronous writes."""

    def __init__(self, name: str, device: str, iops: int = 0, mbps: int = 0, write_iops: int = 0, write_mbps: int = 0):
        self.device = device
        settings = {}
        for kind, per_second, bytes_per_second in (("read", iops, mbps), ("write", write_iops, write_mbps)):
            if per_second:
                settings[f"blkio.throttle.{kind}_iops_device"] = f"{device} {per_second}"
            if bytes_per_second:
                settings[f"blkio.throttle.{kind}_bps_device"] = f"{device} {bytes_per_second * 2**20}"
        super().__init__("blkio", name, settings)

    def _counter(self, file: str, op: str) -> int:
        for line in (self.path / file).read_text().splitlines():
            fields = line.split()
            if len(fields) == 3 and fields[0] == self.device and fields[1] == op:
                return int(fields[2])
        return 0

    def reads(self) -> tuple[int, int]:
        """(requests, bytes) the disk has served to the group's reads so far: what reached
        the device, after the page cache (a page-cache hit is not counted) and after the
        kernel's readahead merged or enlarged them."""
        return (self._counter("blkio.throttle.io_serviced_recursive", "Read"),
                self._counter("blkio.throttle.io_service_bytes_recursive", "Read"))

    def writes(self) -> tuple[int, int]:
        return (self._counter("blkio.throttle.io_serviced_recursive", "Write"),
                self._counter("blkio.throttle.io_service_bytes_recursive", "Write"))


class CpusetCgroup(Cgroup):
    """A CPU set: the group's processes run on these CPUs only ("0", "1", "0-1,3")."""

    def __init__(self, name: str, cpus: str):
        parent = CGROUP_V1 / "cpuset" / own_group("cpuset").lstrip("/")
        mems = (parent / "cpuset.mems").read_text().strip()
        super().__init__("cpuset", name, {"cpuset.cpus": cpus, "cpuset.mems": mems})


class CpuacctCgroup(Cgroup):
    """CPU accounting: the CPU time the group's processes used."""

    def __init__(self, name: str):
        super().__init__("cpuacct", name, {})

    def cpu_seconds(self) -> float:
        return int((self.path / "cpuacct.usage").read_text()) / 1e9


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


@dataclass(frozen=True)
class Budget:
    """What one node (or program) may use: CPUs (a CPU set; None: any), reads and writes
    per second from its data disk (0: no limit), memory (memory.limit_in_bytes; None: none,
    and no memory group)."""
    cpus: str | None = None
    read_iops: int = 0
    read_mbps: int = 0
    write_iops: int = 0
    write_mbps: int = 0
    memory: str | None = None


class NodeCgroups:
    """One node's own budget: a CPU set, a blkio group on its data disk (which also counts
    its reads when it limits nothing), CPU accounting and, with `budget.memory`, a memory
    group. `wrapper` starts a command inside all of them; a server started with it keeps its
    children (backends, I/O workers, the startup process) inside. Removed by `remove()`, or
    at the end of a `with` block."""

    CONTROLLERS = ("cpuset", "cpuacct", "blkio", "memory")

    def __init__(self, label: str, budget: Budget, device: str | None):
        self.label, self.budget = label, budget
        self.cpuset: CpusetCgroup | None = None
        self.cpuacct: CpuacctCgroup | None = None
        self.blkio: BlkioThrottle | None = None
        self.memory: MemoryCgroup | None = None
        try:
            if budget.cpus is not None:
                self.cpuset = CpusetCgroup(label, budget.cpus)
            self.cpuacct = CpuacctCgroup(label)
            if device is not None:
                self.blkio = BlkioThrottle(label, device, budget.read_iops, budget.read_mbps,
                                           budget.write_iops, budget.write_mbps)
            if budget.memory is not None:
                self.memory = MemoryCgroup(label, budget.memory)
        except BaseException:
            self.remove()
            raise
        self.wrapper = enter_command([group.path for group in self.groups()])

    @staticmethod
    def missing_controllers(budget: Budget) -> list[str]:
        """The controllers this budget needs that are not mounted here."""
        needed = ["cpuacct", "blkio"] + (["cpuset"] if budget.cpus is not None else []) + \
            (["memory"] if budget.memory is not None else [])
        return [name for name in needed if not controller_available(name)]

    def groups(self) -> list[Cgroup]:
        return [group for group in (self.cpuset, self.cpuacct, self.blkio, self.memory) if group is not None]

    def reads(self) -> tuple[int, int]:
        """(requests, bytes) read from the data disk so far (0, 0 without a blkio group)."""
        return self.blkio.reads() if self.blkio is not None else (0, 0)

    def cpu_seconds(self) -> float:
        return self.cpuacct.cpu_seconds() if self.cpuacct is not None else 0.0

    def remove(self) -> None:
        for group in self.groups():
            group.remove()

    def __enter__(self) -> "NodeCgroups":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
