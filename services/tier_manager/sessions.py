"""What the daemon holds for its clients (leased buffers, fetch pins), and whether they live.

A client that dies between AllocateBuffer and Commit, or between Fetch and Release,
would hold its buffer or its pin forever. gRPC tells a server nothing about a client's
connection, so each client says who it is: `TierManagerClient` creates a lock file in
the CPU pool's directory (`tierstack-client-<id>.lock`, the directory every worker
already shares with the daemon to map arenas), holds an flock on it for its life, and
names `<id>` in every call's metadata. The daemon's reaper tries that flock about once a
second: when it can take it, the client is gone (crashed or closed), and everything it
held is freed at once. This survives PID reuse and needs no thread per client (a stream
per client would take one of the server's fixed threads each). Holds of calls that name
no session (raw gRPC clients) are freed after `lease_timeout` instead.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from tierstack.errors import InvalidArgumentError

log = logging.getLogger(__name__)

SESSION_METADATA = "x-tierstack-session"
SESSION_PREFIX = "tierstack-client-"
_SESSION_ID = re.compile(r"^[0-9a-f]{32}$")

B = TypeVar("B")  # what a lease holds: a CPU-pool buffer (None for an empty tensor)


def session_of(context) -> str:
    """The session a call names in its metadata ('' for none or a malformed one)."""
    for key, value in context.invocation_metadata() or ():
        if key == SESSION_METADATA:
            return value if isinstance(value, str) and _SESSION_ID.match(value) else ""
    return ""


def session_file(directory: Path, session: str) -> Path:
    return directory / f"{SESSION_PREFIX}{session}.lock"


class SessionWatcher:
    """Knows the clients' sessions and tells which ended (their lock file is free)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._live: set[str] = set()

    def admit(self, session: str) -> str:
        """`session` if its lock file exists and is held (the client made it before its
        first call), else '' (its holds then expire by time)."""
        if not session:
            return ""
        with self._lock:
            if session in self._live:
                return session
        if _alive(session_file(self.directory, session)) is not True:
            return ""
        with self._lock:
            self._live.add(session)
        return session

    def ended(self) -> list[str]:
        """Sessions whose client is gone since the last call; their lock files are removed."""
        with self._lock:
            live = list(self._live)
        gone = [s for s in live if _alive(session_file(self.directory, s)) is not True]
        for session in gone:
            try:
                os.unlink(session_file(self.directory, session))
            except FileNotFoundError:
                pass
        with self._lock:
            self._live.difference_update(gone)
        return gone

    @property
    def count(self) -> int:
        return len(self._live)


def _alive(path: Path) -> bool | None:
    """True if a process holds the flock of `path`, False if none does (or the file is
    gone), None if it is not a file a client of ours made (refused, never removed)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid not in (os.getuid(), 0):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        return False
    finally:
        os.close(fd)


def reclaim_stale_sessions(directory: Path) -> int:
    """Remove the lock files of clients that died while no daemon ran; returns how many."""
    removed = 0
    for path in directory.glob(f"{SESSION_PREFIX}*.lock"):
        try:
            if path.lstat().st_uid != os.getuid():
                continue
        except FileNotFoundError:
            continue
        if _alive(path) is False:
            try:
                os.unlink(path)
                removed += 1
            except FileNotFoundError:
                pass
    return removed


@dataclass
class _Lease(Generic[B]):
    buffer: B
    deadline: float
    session: str


@dataclass
class _Pin:
    deadline: float
    session: str


class ClientHolds(Generic[B]):
    """Leased buffers and fetch pins, each with its session and deadline.

    Returns what must be given back (`expire`, `end_sessions`); the caller frees buffers
    and releases pins in the registry, outside this lock."""

    def __init__(self, lease_timeout: float) -> None:
        self.lease_timeout = lease_timeout
        self._lock = threading.Lock()
        self._leases: dict[int, _Lease[B]] = {}
        self._expired: set[int] = set()
        self._pins: dict[tuple[str, int], list[_Pin]] = {}
        self._next_id = 1

    @property
    def leases(self) -> int:
        return len(self._leases)

    def lease(self, buffer: B, session: str) -> int:
        with self._lock:
            lease_id = self._next_id
            self._next_id += 1
            self._leases[lease_id] = _Lease(buffer, time.monotonic() + self.lease_timeout, session)
            return lease_id

    def take_lease(self, lease_id: int) -> tuple[B, str]:
        """The buffer (and session) of a lease, which ends here."""
        with self._lock:
            lease = self._find(lease_id)
            del self._leases[lease_id]
            return lease.buffer, lease.session

    def peek_lease(self, lease_id: int) -> B:
        """The buffer of a lease, which goes on (a commit's checks, before it takes it)."""
        with self._lock:
            return self._find(lease_id).buffer

    def _find(self, lease_id: int) -> _Lease[B]:
        """A live lease, or INVALID_ARGUMENT saying why there is none (lock held)."""
        if lease_id in self._expired:
            raise InvalidArgumentError(
                f"buffer lease {lease_id} expired: it was not committed within "
                f"{self.lease_timeout:.0f} s (or its client's session ended) and its buffer "
                f"was freed; allocate a new one")
        lease = self._leases.get(lease_id)
        if lease is None:
            raise InvalidArgumentError(
                f"buffer lease {lease_id} is unknown: it was committed or cancelled "
                f"already, or granted by a previous daemon instance; allocate a new buffer")
        return lease

    def restore_lease(self, lease_id: int, buffer: B, session: str) -> None:
        """Give a lease back after a failed commit (the client may fix it and commit again)."""
        with self._lock:
            self._leases[lease_id] = _Lease(buffer, time.monotonic() + self.lease_timeout, session)

    def pin(self, pins: list[tuple[str, int]], session: str) -> None:
        deadline = time.monotonic() + self.lease_timeout
        with self._lock:
            for pin in pins:
                self._pins.setdefault(pin, []).append(_Pin(deadline, session))

    def unpin(self, key: str, version: int, session: str) -> None:
        """End one pin of (key, version), the caller's own if it holds one."""
        with self._lock:
            pins = self._pins.get((key, version))
            if not pins:
                raise InvalidArgumentError(
                    f"tensor {key!r} version {version} is not fetched (or its pin expired "
                    f"after {self.lease_timeout:.0f} s, or its client's session ended); "
                    f"nothing to release")
            mine = next((i for i, p in enumerate(pins) if p.session == session), 0)
            pins.pop(mine)
            if not pins:
                del self._pins[(key, version)]

    def expire(self, now: float | None = None) -> tuple[list[B], list[tuple[str, int]]]:
        """Holds past their deadline: their buffers and pins, to give back."""
        now = time.monotonic() if now is None else now
        return self._take(lambda deadline, session: deadline <= now)

    def end_sessions(self, sessions: set[str]) -> tuple[list[B], list[tuple[str, int]]]:
        """Every hold of the sessions that ended: their buffers and pins, to give back."""
        return self._take(lambda deadline, session: session in sessions)

    def _take(self, ends) -> tuple[list[B], list[tuple[str, int]]]:
        with self._lock:
            gone = [i for i, lease in self._leases.items() if ends(lease.deadline, lease.session)]
            buffers = [self._leases.pop(i).buffer for i in gone]
            self._expired.update(gone)
            pins = []
            for pin, held in list(self._pins.items()):
                keep = [p for p in held if not ends(p.deadline, p.session)]
                pins += [pin] * (len(held) - len(keep))
                if keep:
                    self._pins[pin] = keep
                else:
                    del self._pins[pin]
        return buffers, pins
