"""Admission: how many of the server's threads may be inside long calls at once.

A sync gRPC server runs each call on one of its fixed threads until the call returns.
Calls that can take long on the daemon's own work (an optimizer step, reads and writes
of NVMe, evictions, a job's deletion) hold theirs meanwhile (streams have slots of their
own: StreamSlots in rpc.py); unbounded, a few
busy clients would take every thread, and the daemon would stop answering even GetNode
and the Release that ends somebody's wait. So a long call takes a slot first: at most
`limit` at once, and at most `per_client` for one client session. A call that finds none
is answered at once UNAVAILABLE with a retry hint (RetryLaterError), which the client face
sends again; a slot freeing ends it. Quick calls (GetNode, Describe, Release, GetStats,
ListJobs, ...) take no slot: the threads above `limit` are always theirs.

A client is its session (sessions.py), not its connection: over a unix socket gRPC tells
a server nothing that sets one connection apart from another (every peer is "unix:"),
and a session is what the daemon already watches to free a client's holds. Calls that
name no session therefore share one count of `per_client`; their refusal says how to get
slots of their own. TierManagerClient opens its session before its first long call, so
only raw gRPC clients (and clients on another host, which cannot reach the session
directory) share.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from typing import Iterator

from tierstack.errors import RetryLaterError

QUICK_RESERVE = 8
"""Server threads kept from long calls for quick ones."""
BUSY_RETRY_SECONDS = 0.01
"""The retry hint of a long call refused because every slot is taken."""
SESSIONLESS = (
    ", which share one count: open a client session to get slots of your own "
    "(TierManagerClient opens one itself; a raw gRPC client creates "
    "tierstack-client-<32 hex digits>.lock in the session_dir GetNode answers, holds an "
    "flock on it, and names the digits in the metadata x-tierstack-session)")
"""What a refused call without a session is told: how its client gets its own slots."""


class CallSlots:
    """Counts the long calls in progress, in all and per client session."""

    def __init__(self, threads: int) -> None:
        """`threads`: the server's threads that streams cannot take."""
        self.limit = max(1, threads - QUICK_RESERVE)
        # A worker keeps about four long calls going (its loads and writes, two steps).
        self.per_client = max(2, self.limit * 3 // 8)
        self._lock = threading.Lock()
        self._by_client: Counter[str] = Counter()
        self._in_use = 0

    @property
    def in_use(self) -> int:
        return self._in_use

    @contextlib.contextmanager
    def enter(self, session: str, method: str) -> Iterator[None]:
        """A slot for one long call of `session`, or RetryLaterError at once."""
        with self._lock:
            mine = self._by_client[session]
            if self._in_use >= self.limit or mine >= self.per_client:
                who = "this client" if session else f"calls that name no client session{SESSIONLESS}"
                raise RetryLaterError(
                    f"the tier manager is busy: {self._in_use} of its {self.limit} threads for "
                    f"long calls are in use ({mine} by {who}, at most {self.per_client} "
                    f"each); {method} was not started: send it again", BUSY_RETRY_SECONDS)
            self._by_client[session] += 1
            self._in_use += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_use -= 1
                self._by_client[session] -= 1
                if not self._by_client[session]:
                    del self._by_client[session]
