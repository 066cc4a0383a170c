"""The CPU pool's files in its directory: arenas, the pool's lock file, and what a crashed
pool left behind.

Liveness: a pool holds an exclusive flock on its lock file while it lives. A new pool
reclaims arenas left by a crashed one: arenas whose instance's lock file can be locked
(or is gone) have no living owner (this survives PID reuse, unlike a pid check). It also
reads the page size backing the directory: a huge-page filesystem makes arenas whole
huge pages.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from tierstack.config import parse_size

log = logging.getLogger(__name__)

ARENA_PREFIX = "tierstack-arena-"
LOCK_PREFIX = "tierstack-pool-"


def arena_path(shm_dir: Path, instance_id: str, arena_id: int) -> Path:
    return shm_dir / f"{ARENA_PREFIX}{instance_id}-{arena_id:06d}"


def lock_path(shm_dir: Path, instance_id: str) -> Path:
    return shm_dir / f"{LOCK_PREFIX}{instance_id}.lock"


def take_lock_file(shm_dir: Path, instance_id: str) -> int:
    """Create this pool's lock file already flocked: it is locked under a temporary name
    and renamed into place, so a reclaimer never sees it unlocked."""
    final = lock_path(shm_dir, instance_id)
    temporary = final.with_suffix(".new")
    fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.rename(temporary, final)
    return fd


def huge_page_size(directory: Path) -> int:
    """The page size backing files in `directory`: 4096, or the huge page size of a
    hugetlbfs mount (pagesize=, default 2 MiB) or a tmpfs mounted with huge=always."""
    target = os.path.realpath(directory)
    best, size = "", 4096
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return size
    for line in lines:
        head, _, tail = line.partition(" - ")
        fields, tail_fields = head.split(), tail.split()
        if len(fields) < 5 or len(tail_fields) < 3:
            continue
        mount_point = fields[4].replace("\\040", " ")
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if not inside or len(mount_point) < len(best):
            continue
        best = mount_point
        fstype, options = tail_fields[0], tail_fields[2].split(",")
        size = 4096
        if fstype == "hugetlbfs":
            size = 2 << 20
            for opt in options:
                if opt.startswith("pagesize="):
                    size = parse_size(opt.split("=", 1)[1] + ("iB" if opt[-1].isalpha() else ""))
        elif fstype == "tmpfs" and ("huge=always" in options or "huge=within_size" in options):
            size = 2 << 20
    return size


def _instance_of(name: str) -> str:
    """The pool instance an arena or lock file belongs to ("<pid>-<hex>")."""
    if name.startswith(LOCK_PREFIX):
        return name[len(LOCK_PREFIX):].split(".", 1)[0]
    return name[len(ARENA_PREFIX):].rsplit("-", 1)[0]


def _owner_alive(shm_dir: Path, instance: str) -> bool:
    """Whether the pool `instance` still holds its lock file."""
    try:
        fd = os.open(lock_path(shm_dir, instance), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def reclaim_stale_arenas(shm_dir: Path) -> list[str]:
    """Delete the arenas (and lock files) in `shm_dir` whose owning pool is gone; returns
    the arenas' paths."""
    reclaimed = []
    uid = os.getuid()
    alive: dict[str, bool] = {}
    for path in sorted(shm_dir.glob(f"{ARENA_PREFIX}*")) + sorted(shm_dir.glob(f"{LOCK_PREFIX}*.lock")):
        try:
            if path.lstat().st_uid != uid:
                continue
        except FileNotFoundError:
            continue
        instance = _instance_of(path.name)
        if instance not in alive:
            alive[instance] = _owner_alive(shm_dir, instance)
        if alive[instance]:
            continue
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        if path.name.startswith(ARENA_PREFIX):
            reclaimed.append(str(path))
    if reclaimed:
        log.warning("reclaimed %d stale CPU pool arenas left by a crashed daemon in %s",
                    len(reclaimed), shm_dir)
    return reclaimed
