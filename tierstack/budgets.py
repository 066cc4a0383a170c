"""Budgets: how much of each tier a job may use. The one budget type of the project.

A user states budgets (or tierstack measures them from the machine); tierstack decides
placement within them, and the pools grow to what the placement needs, never beyond.

- `hbm`: device bytes for training state (parameters, gradients, optimizer state kept
  on the device, and the layers streamed through it), per device;
- `host`: host RAM for everything of ours on the node: the tier manager's CPU pool (its
  shared-memory arenas) plus the resident memory of the daemon and the workers;
- `nvme`: bytes on the NVMe pool's drives.

Machine defaults (`measure`): HBM is the device's memory minus a margin (the caller
takes the activation peak off once it is measured); host is a fraction of what the
machine can give: MemAvailable, or the memory cgroup's limit minus its usage, whichever
is smaller; NVMe is the free space at the pool's path minus a margin. A budget above
what the machine has is refused with one line naming both numbers.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from tierstack.errors import ConfigError

GiB = 1 << 30

HOST_FRACTION = 0.8
"""Share of the available host memory a job takes by default (the rest: the OS, page
cache for the NVMe files' metadata, other processes)."""
HOST_OVERHEAD = 1 * GiB
"""Resident memory of our processes that is not pool arenas: the daemon's and the
workers' interpreters, torch, gRPC threads, scratch. Taken off the host budget before
the CPU pool gets the rest."""
NVME_MARGIN_FRACTION = 0.05
"""Free space left on an NVMe drive by default: a full filesystem fails every writer."""
HBM_MARGIN = 2 * GiB
"""Device memory left for the CUDA context, the caching allocator's slack and kernels'
workspaces."""


@dataclass(frozen=True)
class Budgets:
    """Bytes a job may use in each tier."""

    hbm: int
    host: int
    nvme: int
    stated: frozenset[str] = frozenset()
    """The budgets the user stated (config, flags); the others were measured on the machine."""

    def __post_init__(self) -> None:
        for name in ("hbm", "host", "nvme"):
            if getattr(self, name) < 0:
                raise ConfigError(f"budgets.{name} cannot be negative, got {getattr(self, name)}")

    @property
    def cpu_pool(self) -> int:
        """What the host budget leaves the CPU pool: the budget minus our processes' own
        resident memory (HOST_OVERHEAD)."""
        return pool_share(self.host)

    def with_(self, **changes: int) -> "Budgets":
        return replace(self, **changes)

    def describe(self) -> str:
        """Each budget and where it came from: "hbm 139.0 GiB (measured), ..."."""
        return ", ".join(f"{name} {_gib(getattr(self, name))} "
                         f"({'stated' if name in self.stated else 'measured'})"
                         for name in ("hbm", "host", "nvme"))


@dataclass(frozen=True)
class MachineLimits:
    """What this machine can give a job now (the ceilings budgets are checked against)."""

    hbm: int
    host: int
    nvme: int

    def check(self, budgets: Budgets) -> None:
        """Refuse a budget above what the machine has, before anything is allocated."""
        for name, where in (("hbm", "the device's memory"),
                            ("host", "available host memory (MemAvailable / cgroup)"),
                            ("nvme", "free space at the NVMe path")):
            want, have = getattr(budgets, name), getattr(self, name)
            if want > have:
                raise ConfigError(
                    f"budgets.{name} is {_gib(want)} but {where} is {_gib(have)}; lower "
                    f"budgets.{name} to at most {_gib(have)} (or leave it 'auto')")


def measure(nvme_path: str | os.PathLike | list | None, device: str | None = None,
            nvme_held: int = 0) -> MachineLimits:
    """The machine's ceilings: the device's memory, available host memory, free NVMe space.

    `nvme_path` may list several drives: extents are striped evenly over them, so the
    pool can use the smallest one's free space on each. `nvme_held`: bytes our own
    files already hold there (a restarted daemon's data files), which count as ours."""
    paths = nvme_path if isinstance(nvme_path, (list, tuple)) else [nvme_path] if nvme_path else []
    nvme = len(paths) * min(free_space(p) for p in paths) + nvme_held if paths else 0
    return MachineLimits(hbm=device_memory(device), host=available_host_memory(), nvme=nvme)


@dataclass(frozen=True)
class PoolCaps:
    """The most bytes the tier manager's pools may ever hold: its CPU pool's arenas and
    its NVMe pool's files. The pools grow to what is stored, never beyond these."""

    cpu: int
    nvme: int


def pool_caps(cpu_size: int | str, nvme_size: int | str, limits: MachineLimits) -> PoolCaps:
    """The pools' caps from tier_manager.cpu_pool.size / nvme_pool.size: 'auto' takes the
    machine's default budgets (the host budget's pool share, the NVMe budget); a stated
    size above what the machine has is refused now, in one line, before anything is
    allocated (a pool that outgrows its memory cgroup is OOM-killed with no message)."""
    defaults = default_budgets(limits)
    cpu = defaults.cpu_pool if cpu_size == "auto" else int(cpu_size)
    nvme = defaults.nvme if nvme_size == "auto" else int(nvme_size)
    if cpu_size != "auto" and cpu > limits.host:
        raise ConfigError(
            f"tier_manager.cpu_pool.size is {_gib(cpu)} but available host memory (MemAvailable "
            f"/ memory cgroup) is {_gib(limits.host)}; lower tier_manager.cpu_pool.size to at "
            f"most {_gib(limits.host)} (or leave it 'auto')")
    if nvme_size != "auto" and nvme > limits.nvme:
        raise ConfigError(
            f"tier_manager.nvme_pool.size is {_gib(nvme)} but the NVMe paths have {_gib(limits.nvme)} "
            f"free; lower tier_manager.nvme_pool.size to at most {_gib(limits.nvme)} (or leave it "
            f"'auto'), or free space there")
    if cpu <= 0:
        raise ConfigError(
            f"the host budget leaves the CPU pool nothing: {_gib(limits.host)} of host memory is "
            f"available and {HOST_FRACTION:.0%} of it less {_gib(HOST_OVERHEAD)} for our processes "
            f"is {_gib(max(0, defaults.host - HOST_OVERHEAD))}; free host memory, raise the memory "
            f"cgroup's limit, or set tier_manager.cpu_pool.size")
    return PoolCaps(cpu=cpu, nvme=nvme)


def pool_share(host: int) -> int:
    """What a host budget of `host` bytes leaves the CPU pool (Budgets.cpu_pool)."""
    return max(0, host - HOST_OVERHEAD)


def default_budgets(limits: MachineLimits) -> Budgets:
    """Budgets for a job that states none: the machine's ceilings less the margins."""
    return Budgets(hbm=max(0, limits.hbm - HBM_MARGIN),
                   host=int(limits.host * HOST_FRACTION),
                   nvme=int(limits.nvme * (1 - NVME_MARGIN_FRACTION)))


# ---- the machine ----------------------------------------------------------------------------


def device_memory(device: str | None = None) -> int:
    """Total memory of the CUDA device (0 without one, or where `device` names another
    kind: the tier-manager daemon measures its machine with "cpu" and imports no torch,
    which would cost its start about 2 s)."""
    if device and not device.startswith("cuda"):
        return 0
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return 0
    if not torch.cuda.is_available():
        return 0
    index = torch.device(device).index if device and ":" in device else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).total_memory


def available_host_memory() -> int:
    """MemAvailable, capped by the memory cgroup's headroom (its limit minus its usage)."""
    available = _meminfo("MemAvailable")
    headroom = cgroup_headroom()
    return min(available, headroom) if headroom is not None else available


def cgroup_headroom() -> int | None:
    """Bytes this process's memory cgroup lets it grow by (None: no limit)."""
    limit, usage = _cgroup_memory()
    if limit is None:
        return None
    return max(0, limit - (usage or 0))


def free_space(path: str | os.PathLike) -> int:
    """Free bytes on the filesystem that holds `path` (or would: its nearest existing parent)."""
    p = Path(path).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def _meminfo(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == field:
            return int(value.split()[0]) * 1024
    raise RuntimeError(f"/proc/meminfo has no {field}")


def _cgroup_memory() -> tuple[int | None, int | None]:
    """(limit, usage) of this process's memory cgroup, v2 or v1; limit None when unlimited.

    The tightest limit on the path from the process's cgroup up to the root applies."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None, None
    best: tuple[int | None, int | None] = (None, None)
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            root, limit_file, usage_file = Path("/sys/fs/cgroup"), "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            root, limit_file, usage_file = (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes",
                                            "memory.usage_in_bytes")
        else:
            continue
        directory = root / path.lstrip("/")
        while True:
            limit = _read_int(directory / limit_file)
            if limit is not None and limit < (1 << 60) and (best[0] is None or limit < best[0]):
                best = (limit, _read_int(directory / usage_file))
            if directory == root or directory == directory.parent:
                break
            directory = directory.parent
    return best


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text == "max" else int(text)


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB / 10 or n == 0 else f"{math.ceil(n / (1 << 20))} MiB"
