"""`tierstack doctor`: is this machine ready for a long offloaded run, and what to change.

One screen of checks, each "ok", "warn" or "fail" with what was found and, when it is
not ok, what to change: each NVMe path (its filesystem, whether O_DIRECT works, whether
it is durable at all: a tmpfs is not, free space against the NVMe pool), the CPU pool's
tmpfs, huge pages and transparent huge pages (the disk's staging buffers want them),
the locked-memory limit (`ulimit -l`: workers page-lock the CPU pool's arenas on a GPU
machine), the open-files limit (`ulimit -n`) and vm.max_map_count (each CPU-pool arena is
a mapping in the daemon and in every worker), the memory cgroup's memory.max and MemAvailable against the configured CPU
pool and budgets, the GPU and its PCIe link, and, unless `--quick`, the disk's and the
host<->device bandwidth measured next to what the link should give. The tier manager
logs the quick checks of its own config at start (`log_checks`).

A shared module: it reads /proc, /sys and the filesystem itself and imports no room.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import mmap
import os
import resource
import shutil
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tierstack.budgets import (GiB, PoolCaps, _cgroup_memory, _meminfo, available_host_memory,
                               default_budgets, pool_caps)
from tierstack.budgets import measure as measure_machine
from tierstack.config import AUTO_SIZE, MiB, TierManagerConfig, TierstackConfig, load_config
from tierstack.errors import ConfigError
from tierstack.run_index import dead_runs

log = logging.getLogger(__name__)

OK, WARN, FAIL = "ok", "warn", "fail"
ALIGN = 4096
NOT_DURABLE = {"tmpfs", "ramfs"}
"""Filesystems in memory: an NVMe pool there is lost at reboot and takes host memory."""
PCIE_GBPS_PER_LANE = {2.5: 0.25, 5.0: 0.5, 8.0: 0.985, 16.0: 1.969, 32.0: 3.938, 64.0: 7.563}
"""GT/s per lane -> GB/s per lane and direction after line coding (PCIe gen 1..6)."""
PCIE_GEN = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}
PINNED_SHARE = 0.85
"""Share of a PCIe link's raw rate that pinned copies reach in practice (55 of 63 GB/s
measured on the H200 machine's Gen5 x16)."""


@dataclass
class Check:
    """One finding: what was checked, how it stands, what was found, what to change."""

    name: str
    status: str
    found: str
    fix: str = ""


# ---- filesystems and disks --------------------------------------------------------------------


def _existing(path: Path) -> Path:
    path = path.resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def filesystem(path: str | os.PathLike) -> tuple[str, str]:
    """(filesystem type, mount point) of the filesystem holding `path` (or that would)."""
    target = str(_existing(Path(path)))
    best = ("unknown", "/")
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return best
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) >= len(best[1]):
            best = (parts[2], point)
    return best


def filesystem_room(path: str | os.PathLike) -> tuple[int, int] | None:
    """(bytes it can still give, bytes in all) of the filesystem holding `path`, as statvfs
    states them to an unprivileged writer; None where it states no size (a tmpfs or a
    hugetlbfs mounted without a size limit reports no blocks at all)."""
    st = os.statvfs(_existing(Path(path)))
    if st.f_blocks == 0:
        return None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def _size(nbytes: int) -> str:
    """Bytes in the unit a reader of a small tmpfs and of a large one can both use."""
    return f"{nbytes / GiB:.1f} GiB" if nbytes >= GiB else f"{nbytes / MiB:.1f} MiB"


def block_device(path: str | os.PathLike) -> str:
    """The block device (whole disk, e.g. nvme0n1, vda) holding `path`, or ''."""
    dev = os.stat(_existing(Path(path))).st_dev
    link = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    try:
        real = link.resolve(strict=True)
    except OSError:
        return ""
    return real.parent.name if (real / "partition").exists() else real.name


def pcie_link(sys_device: Path) -> tuple[int, int, float] | None:
    """(generation, width, GB/s per direction) of a PCIe device's current link, or None."""
    try:
        speed = float((sys_device / "current_link_speed").read_text().split()[0])
        width = int((sys_device / "current_link_width").read_text().strip())
    except (OSError, ValueError, IndexError):
        return None
    per_lane = PCIE_GBPS_PER_LANE.get(speed)
    if per_lane is None or width < 1:
        return None
    return PCIE_GEN[speed], width, per_lane * width


def _aligned_buffer(nbytes: int) -> mmap.mmap:
    """A page-aligned anonymous buffer, huge pages asked for: a 1 MiB request in 4 KiB pages
    spans 256 segments and is split in two by a virtio disk (DESIGN.md)."""
    buf = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return buf


def direct_io_works(directory: Path) -> bool:
    """Whether an aligned O_DIRECT write and read succeed in `directory`."""
    probe = directory / f".tierstack-doctor-{uuid.uuid4().hex[:8]}"
    buf = _aligned_buffer(ALIGN)
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        os.pwritev(fd, [buf], 0)
        os.preadv(fd, [buf], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)
        buf.close()


@contextlib.contextmanager
def _scratch(path: Path):
    """`path` as a directory for the body; what this made of it is removed afterwards."""
    top = path.absolute()  # the first directory made here
    while not top.parent.exists() and top.parent != top:
        top = top.parent
    created = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    try:
        yield path
    finally:
        if created:
            shutil.rmtree(top, ignore_errors=True)


def check_nvme_path(path: str, need: int) -> list[Check]:
    """The NVMe pool's directory: writable, durable, O_DIRECT, free space for `need` bytes
    (its share of the pool's cap)."""
    name = f"NVMe path {path}"
    p = Path(path)
    if p.exists() and not p.is_dir():
        return [Check(name, FAIL, "is a file", "give a directory (created if missing)")]
    try:
        with _scratch(p):
            fstype, mount = filesystem(p)
            device = block_device(p)
            free = shutil.disk_usage(p).free
            direct = direct_io_works(p)
            writable = os.access(p, os.W_OK)
    except OSError as e:
        return [Check(name, FAIL, f"cannot create it ({e.strerror})",
                      "give a writable directory on an NVMe drive")]
    where = f"{fstype} at {mount}" + (f" on {device}" if device else "")
    checks = []
    if not writable:
        checks.append(Check(name, FAIL, f"{where}: not writable by uid {os.getuid()}",
                            f"chown or chmod {path}, or give another directory"))
    elif fstype in NOT_DURABLE:
        checks.append(Check(name, WARN, f"{where}: a filesystem in memory, not durable and "
                                        f"not an NVMe drive (its bytes count against host memory)",
                            "put nvme_pool.paths on a disk (ext4/xfs on NVMe)"))
    elif not direct:
        checks.append(Check(name, WARN, f"{where}: O_DIRECT is refused, so IO goes through the "
                                        f"page cache (slower, and it takes host memory)",
                            "use ext4 or xfs for nvme_pool.paths"))
    else:
        checks.append(Check(name, OK, f"{where}, O_DIRECT works"))
    space = Check(f"{name} free space", OK, f"{free / GiB:.1f} GiB free, the pool may grow to "
                                            f"{need / GiB:.1f} GiB there")
    if free < need:
        space.status, space.fix = FAIL, (f"free {(need - free) / GiB:.1f} GiB there, or lower "
                                         f"tier_manager.nvme_pool.size / budgets.nvme")
    checks.append(space)
    return checks


def measure_disk(path: str, nbytes: int = 256 * MiB, block: int = MiB, threads: int = 4
                 ) -> tuple[float, float]:
    """(write, read) GB/s of O_DIRECT `block`-sized requests over one `nbytes` file in
    `path`, `threads` requests in flight (the tier manager's IO loop does the same)."""
    with _scratch(Path(path)) as p:
        return _measure_disk(p / f".tierstack-doctor-{uuid.uuid4().hex[:8]}", nbytes, block, threads)


def _measure_disk(file: Path, nbytes: int, block: int, threads: int) -> tuple[float, float]:
    blocks = nbytes // block
    fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    buffers = [_aligned_buffer(block) for _ in range(threads)]
    for b in buffers:
        b.write(os.urandom(block))  # incompressible, and the pages exist before timing
    try:
        def run(write: bool) -> float:
            counter = iter(range(blocks))
            lock = threading.Lock()

            def worker(buf: mmap.mmap) -> None:
                while True:
                    with lock:
                        i = next(counter, None)
                    if i is None:
                        return
                    (os.pwritev if write else os.preadv)(fd, [buf], i * block)

            start = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(worker, buffers))
            if write:
                os.fsync(fd)
            return nbytes / (time.perf_counter() - start) / 1e9

        return run(True), run(False)
    finally:
        os.close(fd)
        file.unlink(missing_ok=True)
        for b in buffers:
            b.close()


def disk_bandwidth_check(path: str) -> Check:
    """The disk measured next to what its link should give (NVMe: its PCIe link)."""
    device = block_device(path)
    try:
        write, read = measure_disk(path)
    except OSError as e:
        return Check(f"disk bandwidth at {path}", WARN, f"could not measure ({e.strerror})",
                     "run `tierstack doctor` on a filesystem with O_DIRECT (ext4, xfs)")
    found = f"O_DIRECT 1 MiB x 4 in flight: write {write:.2f} GB/s, read {read:.2f} GB/s"
    link = pcie_link(Path(f"/sys/block/{device}/device/device")) if device.startswith("nvme") else None
    if link is not None:
        gen, width, gbps = link
        found += f"; its PCIe Gen{gen} x{width} link carries at most {gbps:.1f} GB/s"
    else:
        found += f"; {device or 'the device'} is not an NVMe drive, so no link ceiling is known"
    return Check(f"disk bandwidth at {path}", OK, found)


# ---- memory ---------------------------------------------------------------------------------


def huge_pages_check() -> Check:
    """THP and reserved huge pages: the IO loop's staging buffers ask for huge pages."""
    def read(path: str) -> str:
        try:
            text = Path(path).read_text()
        except OSError:
            return "?"
        return text[text.find("[") + 1:text.find("]")] if "[" in text else text.strip()

    thp, shmem = (read("/sys/kernel/mm/transparent_hugepage/enabled"),
                  read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"))
    try:
        reserved, free = _meminfo("HugePages_Total"), _meminfo("HugePages_Free")
    except RuntimeError:
        reserved = free = 0
    found = (f"transparent huge pages {thp!r} (shared memory {shmem!r}); {reserved // 1024} "
             f"huge pages reserved, {free // 1024} free")
    if thp == "never":
        return Check("huge pages", WARN, found,
                     "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled: 1 MiB disk "
                     "requests in 4 KiB pages are split in two by virtio disks")
    return Check("huge pages", OK, found)


def memlock_check(cpu_pool: int, gpu: bool) -> Check:
    """`ulimit -l`: a worker on a GPU page-locks every CPU-pool arena it maps."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / MiB:.0f} MiB"
    found = f"locked-memory limit (ulimit -l) {limit}, CPU pool {cpu_pool / MiB:.0f} MiB"
    if not gpu:
        return Check("pinning", OK, found + "; no GPU here, so nothing is page-locked")
    if soft != resource.RLIM_INFINITY and soft < cpu_pool and os.geteuid() != 0:
        return Check("pinning", FAIL, found,
                     "raise it for the workers (ulimit -l unlimited, or memlock in "
                     "/etc/security/limits.conf), else cudaHostRegister of the arenas fails")
    return Check("pinning", OK, found)


OPEN_FILES_NEEDED = 512
"""Descriptors a tier manager needs: its server, NVMe files and manifest, and one per
client connection, for a few hundred clients. CPU-pool arenas hold none (the daemon maps
them without keeping one), so the count does not grow with the tensors."""
PROCESS_MAPS = 8192
"""Memory mappings a daemon or worker makes besides the CPU pool's arenas: its libraries
(torch's are ~1,000), thread stacks, the IO engine's staging buffers."""


def cpu_pool_arenas(capacity: int) -> int:
    """The most arenas a CPU pool of `capacity` bytes maps: buffers above 16 MiB (1/4 of a
    64 MiB shared arena) get an arena each, smaller ones share 64 MiB arenas, and a pool
    under 4 GiB holds at most 320 (services/tier_manager/cpu_pool.py: CpuPool.max_arenas,
    which the daemon checks at start)."""
    return capacity // (16 * MiB) + capacity // (64 * MiB) + 320


def raise_open_files_limit(need: int = OPEN_FILES_NEEDED) -> None:
    """Raise this process's soft `ulimit -n` towards its hard limit where it is below
    4 x `need` (a daemon's start: nobody else has to)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4 * need if hard == resource.RLIM_INFINITY else min(hard, 4 * need)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as e:
            log.debug("cannot raise the open-files limit to %d: %s", want, e)


def open_files_check(need: int = OPEN_FILES_NEEDED) -> Check:
    """`ulimit -n`: the tier manager's descriptors are its server's, its files' and one per
    client; its CPU-pool arenas take none, whatever the tensor count."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = -1
    limits = "/".join("unlimited" if v == resource.RLIM_INFINITY else str(v) for v in (soft, hard))
    found = f"open files (ulimit -n) {limits} soft/hard, {in_use} in use; a tier manager needs {need}"
    if soft != resource.RLIM_INFINITY and soft < need:
        return Check("open files", WARN, found,
                     f"raise it: ulimit -n {4 * need} (or LimitNOFILE={4 * need} in a systemd unit, "
                     f"nofile in /etc/security/limits.conf)")
    return Check("open files", OK, found)


def map_count_check(arenas: int) -> Check:
    """vm.max_map_count against the CPU pool's `arenas` plus a process's own mappings."""
    try:
        limit = int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return Check("memory maps", OK, "vm.max_map_count unknown (no /proc/sys/vm)")
    try:
        with open("/proc/self/maps", "rb") as f:
            in_use = sum(1 for _ in f)
    except OSError:
        in_use = -1
    need = arenas + PROCESS_MAPS
    found = (f"vm.max_map_count {limit}, {in_use} mappings in use; the CPU pool maps up to "
             f"{arenas} arenas, {need} in all")
    if limit < need:
        return Check("memory maps", WARN, found, f"raise it: sysctl -w vm.max_map_count={2 * need} "
                                                 f"(and in /etc/sysctl.d/ to keep it)")
    return Check("memory maps", OK, found)


def memory_check(config: TierstackConfig, pool: int) -> list[Check]:
    """The CPU pool (its cap: `pool` bytes) and the host budget against MemAvailable and
    the memory cgroup."""
    available = _meminfo("MemAvailable")
    limit, usage = _cgroup_memory()
    cgroup = (f"memory cgroup memory.max {limit / GiB:.1f} GiB ({(usage or 0) / GiB:.1f} used)"
              if limit is not None else "no memory cgroup limit")
    stated = config.tier_manager.cpu_pool.size
    can = available_host_memory()
    found = (f"MemAvailable {available / GiB:.1f} GiB, {cgroup}; CPU pool up to "
             f"{pool / GiB:.2f} GiB{' (auto: the host budget less our processes)' if stated == AUTO_SIZE else ''}")
    host = config.budgets.host
    if isinstance(host, int):
        found += f", budgets.host {host / GiB:.1f} GiB"
    checks = [Check("host memory", OK, found)]
    if isinstance(host, int) and host > can:  # a pool above the machine: "pool sizes" says so
        checks[0].status = FAIL
        checks[0].fix = f"lower budgets.host to at most {can / GiB:.1f} GiB (or 'auto')"
    checks.append(cpu_pool_room_check(config.tier_manager.cpu_pool.shm_dir, pool))
    return checks


def cpu_pool_room_check(shm_dir: str | os.PathLike, pool: int) -> Check:
    """The CPU pool's cap (`pool` bytes) against what the filesystem of its arenas can
    still give. The pool's room is the smaller of the two: it creates arenas as buffers
    need them, so past the filesystem's room it evicts to NVMe sooner than its cap says,
    and refuses (RESOURCE_EXHAUSTED) where nothing can go. The daemon logs this at start."""
    name = f"CPU pool directory {shm_dir}"
    try:
        fstype = filesystem(shm_dir)[0]
        room = filesystem_room(shm_dir)
    except OSError as e:
        return Check(name, FAIL, f"cannot read it ({e.strerror})",
                     "point tier_manager.cpu_pool.shm_dir at a tmpfs such as /dev/shm")
    if room is None:
        return Check(name, OK, f"{fstype} with no size limit, for a pool of up to {_size(pool)}")
    free, total = room
    found = f"{fstype}, {_size(free)} free of {_size(total)}, for a pool of up to {_size(pool)}"
    if free >= pool:
        return Check(name, OK, found)
    return Check(name, WARN, found + f": the pool can hold only {_size(free)} there (past it, "
                                     f"tensors go to NVMe sooner, or allocations are refused "
                                     f"where nothing can go)",
                 f"grow the tmpfs (mount -o remount,size=... {shm_dir}) or lower "
                 f"tier_manager.cpu_pool.size to at most {free} bytes")


# ---- the GPU --------------------------------------------------------------------------------


def left_by_dead_runs_check(now: float | None = None) -> Check:
    """What runs that were killed left on the disks (their NVMe pools): path, size, age."""
    dead = dead_runs()
    if not dead:
        return Check("runs left behind", OK, "no killed run left state behind")
    now = time.time() if now is None else now
    described = "; ".join(
        f"job {r.job} (pid {r.pid}, {_age(now - r.started)} ago): {', '.join(r.directories)}, "
        f"{r.nbytes() / GiB:.2f} GiB" for _, r in dead)
    return Check("runs left behind", WARN, f"{len(dead)} run(s) that ended without cleaning up "
                 f"left their NVMe state: {described}", "`tierstack jobs --clean` removes it")


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def gpu_checks(measure: bool) -> list[Check]:
    """Each CUDA device, its PCIe link, and (measuring) pinned copies next to the link."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return [Check("GPU", WARN, "torch is not installed", "pip install torch")]
    if not torch.cuda.is_available():
        return [Check("GPU", OK, f"none that torch {torch.__version__} can use: training runs on "
                                 f"the CPU (layers are views of the CPU pool, no copies)")]
    checks = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        link = pcie_link(Path(f"/sys/bus/pci/devices/{bus}"))
        found = f"{props.name}, {props.total_memory / GiB:.0f} GiB at {bus}"
        check = Check(f"GPU {i}", OK, found)
        if link is not None:
            gen, width, gbps = link
            check.found += f", PCIe Gen{gen} x{width} ({gbps:.1f} GB/s per direction)"
        if measure:
            h2d, d2h = _pinned_copies(torch, i)
            check.found += f"; pinned copies H2D {h2d:.1f} GB/s, D2H {d2h:.1f} GB/s"
            if link is not None and min(h2d, d2h) < 0.5 * PINNED_SHARE * link[2]:
                check.status = WARN
                check.fix = (f"pinned copies should reach ~{PINNED_SHARE * link[2]:.0f} GB/s on this "
                             f"link: check the slot (lspci -vv: LnkSta), NUMA placement, other traffic")
        checks.append(check)
    return checks


def _pinned_copies(torch, index: int, nbytes: int = 256 * MiB) -> tuple[float, float]:
    """H2D and D2H GB/s of one pinned buffer (best of 3)."""
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{index}")
    rates = []
    for src, dst in ((host, dev), (dev, host)):
        best = 0.0
        for _ in range(3):
            torch.cuda.synchronize(index)
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(index)
            best = max(best, nbytes / (time.perf_counter() - start) / 1e9)
        rates.append(best)
    return rates[0], rates[1]


# ---- all of it ------------------------------------------------------------------------------


def checks(config: TierstackConfig, measure: bool = True, gpu: bool = True) -> list[Check]:
    """Every check for this machine and `config` (measurements when `measure`)."""
    tm = config.tier_manager
    paths = tm.nvme_pool.paths
    found: list[Check] = []
    limits = measure_machine(paths, device="cpu")
    try:  # as the tier manager sizes its pools: 'auto' from the budgets, stated ones checked
        caps = pool_caps(tm.cpu_pool.size, tm.nvme_pool.size, limits)
    except ConfigError as e:
        found.append(Check("pool sizes", FAIL, str(e).split("; ")[0], "; ".join(str(e).split("; ")[1:])))
        defaults = default_budgets(limits)
        caps = PoolCaps(cpu=defaults.cpu_pool if tm.cpu_pool.size == AUTO_SIZE else tm.cpu_pool.size,
                        nvme=defaults.nvme if tm.nvme_pool.size == AUTO_SIZE else tm.nvme_pool.size)
    for path in paths:
        found += check_nvme_path(path, caps.nvme // max(1, len(paths)))
    found += memory_check(config, caps.cpu)
    found.append(huge_pages_check())
    has_gpu = False
    if gpu:
        gpu_found = gpu_checks(measure)
        has_gpu = any(c.name.startswith("GPU ") for c in gpu_found)
        found += gpu_found
    found.append(memlock_check(caps.cpu, has_gpu or not gpu))
    found.append(left_by_dead_runs_check())
    found.append(open_files_check())
    found.append(map_count_check(cpu_pool_arenas(caps.cpu)))
    if measure:
        for path in paths:
            if all(c.status != FAIL for c in found if c.name.startswith(f"NVMe path {path}")):
                found.append(disk_bandwidth_check(path))
    return found


def log_checks(tier_manager: TierManagerConfig) -> None:
    """The quick checks of a tier manager's config (no measurements, no GPU), logged: the
    daemon calls this at start, so its log says what is off before anything fails."""
    for c in checks(TierstackConfig(tier_manager=tier_manager), measure=False, gpu=False):
        level = logging.INFO if c.status == OK else logging.WARNING
        log.log(level, "doctor: %s: %s: %s%s", c.status, c.name, c.found,
                f"; fix: {c.fix}" if c.fix else "")


def report(found: list[Check]) -> str:
    width = max(len(c.name) for c in found)
    lines = []
    for c in found:
        lines.append(f"[{c.status:^4}] {c.name:<{width}}  {c.found}")
        if c.fix:
            lines.append(f"       {'':<{width}}  -> {c.fix}")
    failed = sum(c.status == FAIL for c in found)
    warned = sum(c.status == WARN for c in found)
    lines.append(f"{len(found)} checks: {failed} to fix, {warned} to look at" if failed or warned
                 else f"{len(found)} checks: all ok")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="tierstack or DeepSpeed JSON config whose pools and "
                                         "budgets to check (default: the defaults)")
    parser.add_argument("--nvme-path", action="append",
                        help="NVMe pool directory to check instead of the config's (repeatable)")
    parser.add_argument("--quick", action="store_true",
                        help="skip the measurements (disk and host<->device bandwidth)")


def run_cli(args: argparse.Namespace) -> int:
    """Print the checks; exit 1 when something must be fixed."""
    config = load_config(args.config)
    if args.nvme_path:
        config.tier_manager.nvme_pool.paths = args.nvme_path
    found = checks(config, measure=not args.quick)
    print(report(found))
    return 1 if any(c.status == FAIL for c in found) else 0
