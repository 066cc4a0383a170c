"""Directories and files only our user can reach: created 0700 / 0600, checked before use.

A daemon opens files by name in directories: its socket's, its NVMe pool's, its manifest's.
If another user can write such a directory (or any directory above it that is not
sticky), they can put a symlink or their own socket where ours will be, and the daemon
then writes tensor bytes into their target or clients talk to their process. So every
directory a daemon uses is either created here (0700) or checked: a real directory,
owned by us, writable by nobody else; its ancestors owned by us or root and, unless
sticky (/tmp, /var/tmp, /dev/shm), writable by nobody else. Files inside are opened with
O_NOFOLLOW and checked to be our own regular files with one link.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
from pathlib import Path

from tierstack.errors import AlreadyRunningError, UnsafePathError

log = logging.getLogger(__name__)

_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


def _describe(st: os.stat_result) -> str:
    return f"owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"


def check_ancestors(path: Path, what: str, setting: str) -> None:
    """Every existing directory above `path` is owned by us or root and, unless sticky,
    writable by nobody else (else its owner could rename our directory away)."""
    uid = os.getuid()
    for parent in reversed(Path(os.path.abspath(path)).parents):
        try:
            st = os.stat(parent)  # system symlinks (/var/run -> /run) are root's: follow them
        except FileNotFoundError:
            return
        if st.st_uid not in (uid, 0):
            raise UnsafePathError(
                f"{what} {path} is under {parent} ({_describe(st)}), which another user owns and "
                f"could replace; use a directory of your own for {setting}")
        if st.st_mode & _WRITABLE_BY_OTHERS and not st.st_mode & stat.S_ISVTX:
            raise UnsafePathError(
                f"{what} {path} is under {parent} ({_describe(st)}), which other users can "
                f"write (and it is not sticky); use another directory for {setting} or "
                f"chmod go-w {parent}")


def ensure_private_dir(path: str | os.PathLike, what: str, setting: str) -> Path:
    """`path` as a directory only we can write: created 0700 (with its missing parents) or,
    if it exists, checked (a real directory, ours, not writable by group or others)."""
    path = Path(os.path.abspath(path))
    check_ancestors(path, what, setting)
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:
        raise UnsafePathError(f"{what} {path} exists and is not a directory; point {setting} "
                              f"at a directory") from None
    except NotADirectoryError:
        raise UnsafePathError(f"{what} {path}: a part of the path is a file, not a directory; "
                              f"fix {setting}") from None
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(f"{what} {path} is a symlink; point {setting} at the real "
                              f"directory (a link could be swapped by whoever owns it)")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"{what} {path} is not a directory; fix {setting}")
    if st.st_uid != os.getuid():
        raise UnsafePathError(
            f"{what} {path} belongs to another user ({_describe(st)}); they could swap what "
            f"we open there. Remove it or use another directory for {setting}")
    # Sticky (a fresh tmpfs mount's root is 1777): others may add names but not rename or
    # remove ours, and every file is opened with O_NOFOLLOW and checked to be ours.
    if st.st_mode & _WRITABLE_BY_OTHERS and not st.st_mode & stat.S_ISVTX:
        raise UnsafePathError(
            f"{what} {path} is writable by other users ({_describe(st)}); chmod 700 {path} "
            f"or use another directory for {setting}")
    return path


def open_private_file(path: str | os.PathLike, flags: int, what: str, mode: int = 0o600) -> int:
    """os.open with O_NOFOLLOW (created `mode`, 0600 by default), then checked: our own
    regular file with a single link. Returns the descriptor; raises UnsafePathError."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        # ELOOP from O_NOFOLLOW; or EACCES where the kernel refuses first (fs.protected_symlinks:
        # another user's link in a sticky directory)
        if e.errno in (errno.ELOOP, errno.EACCES) and os.path.islink(path):
            raise UnsafePathError(f"{what} {path} is a symlink; tierstack never follows one "
                                  f"there (remove it)") from None
        raise
    try:
        check_private_fd(fd, path, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_private_fd(fd: int, path: str | os.PathLike, what: str) -> None:
    """An open file is our own regular file with one link (a hard link to another file
    would let a write through it change that file)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePathError(f"{what} {path} is not a regular file; remove it")
    if st.st_uid != os.getuid():
        raise UnsafePathError(f"{what} {path} belongs to another user ({_describe(st)}); "
                              f"remove it")
    if st.st_nlink != 1:
        raise UnsafePathError(f"{what} {path} has {st.st_nlink} hard links; tierstack writes "
                              f"only files of its own (remove the extra links)")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.fchmod(fd, stat.S_IMODE(st.st_mode) & 0o700)
        log.warning("%s %s was readable by other users (mode %04o): made it private", what, path,
                    stat.S_IMODE(st.st_mode))


def hold_lock(path: str | os.PathLike, what: str, fix: str) -> int:
    """An exclusive flock on the file `path` (created 0600), held while the returned
    descriptor stays open; the holder's pid is written in it. AlreadyRunningError naming
    the other holder's pid if one holds it. The file is never removed: removing it would
    let two processes hold locks on two different files of one name."""
    fd = open_private_file(path, os.O_RDWR | os.O_CREAT, f"lock file of {what}")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise AlreadyRunningError(f"{what} is in use by another process (pid {holder}, lock "
                                  f"{path}); {fix}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
