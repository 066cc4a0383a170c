"""Each rank of a partitioned job watches the others: a rank that dies ends the job on every rank.

Without it, a rank whose peer died waits in its next collective: gloo fails at once with
a page of socket errors, NCCL waits out the process group's timeout (minutes). Here every
rank beats a counter in the job's rendezvous store (torch's TCPStore at MASTER_ADDR:
MASTER_PORT, which every launcher sets up) twice a second and reads the others'. A peer
whose counter stands still for `timeout` seconds, without having said it ended, is
gone: the watch keeps one line saying so (`reason`) and calls `on_failure`, where the
partitioned store aborts the process group so that a collective waiting on the dead
peer returns with an error (NCCL; gloo fails by itself). The partitioned store turns the failed collective into a
`RankFailedError` carrying that line (worker/store/sharded_store.py). If the rank is still
alive `exit_after` seconds later (stuck outside any collective), the watch writes the
line to stderr and ends the process.

A rank that closes says so first (`ended/<rank>`), so the others stop watching its
beat; one that closed while another still waits for it in a collective for `timeout`
seconds has failed that one (it ended early, e.g. on an error of its own). The store
lives with rank 0 (or torchrun's agent): when it stops answering, rank 0 is gone or has
ended; that is a failure only while this rank waits in a collective (`busy_seconds`),
which would otherwise wait for it forever.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

log = logging.getLogger(__name__)

PREFIX = "tierstack/peers/"
BEAT_SECONDS = 0.5
TIMEOUT_ENV = "TIERSTACK_PEER_TIMEOUT"
DEFAULT_TIMEOUT = 10.0
"""Seconds a peer may give no sign of life (its watch thread beats; a rank busy in a long
kernel or RPC still beats, since those release the GIL)."""


def peer_timeout() -> float:
    """The timeout from $TIERSTACK_PEER_TIMEOUT (seconds), else DEFAULT_TIMEOUT."""
    text = os.environ.get(TIMEOUT_ENV)
    if not text:
        return DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if value <= 0:
        raise ValueError(f"${TIMEOUT_ENV} is {text!r}: give the seconds a rank may stay silent "
                         f"before its peers end the job, e.g. 5")
    return value


class PeerWatch:
    """One rank's watch over the other ranks of its job (a daemon thread)."""

    def __init__(self, rank: int, world: int, host: str, port: int, timeout: float | None = None,
                 busy_seconds: Callable[[], float] = lambda: 0.0,
                 on_failure: Callable[[str], None] | None = None,
                 exit_after: float = 10.0) -> None:
        self.rank, self.world = rank, world
        self.timeout = peer_timeout() if timeout is None else timeout
        self.reason: str | None = None  # one line, once a peer is known to be gone
        self._busy_seconds = busy_seconds
        self._on_failure = on_failure
        self._exit_after = exit_after
        self._stop = threading.Event()
        self._store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                    timeout=timedelta(seconds=max(1.0, self.timeout)))
        # A process group may see several partitioned stores one after the other (an engine
        # closed, a fresh one built): the n-th watch of every rank shares the n-th keys, so
        # the last one's `ended` marks are not read as this one's.
        self._generation = self._store.add(f"{PREFIX}generation/{rank}", 1)
        self._store.add(self._key("beat", rank), 1)
        self._thread = threading.Thread(target=self._run, name="tierstack-peer-watch", daemon=True)
        self._thread.start()

    def _key(self, what: str, rank: int) -> str:
        return f"{PREFIX}{self._generation}/{what}/{rank}"

    def _run(self) -> None:
        peers = [r for r in range(self.world) if r != self.rank]
        seen = {r: (-1, time.monotonic()) for r in peers}  # rank -> (count, when it last moved)
        ended: set[int] = set()
        lost_since: float | None = None
        while not self._stop.wait(BEAT_SECONDS):
            now = time.monotonic()
            try:
                self._store.add(self._key("beat", self.rank), 1)
                for r in peers:
                    if r in ended:
                        continue
                    if self._store.check([self._key("ended", r)]):
                        ended.add(r)
                        continue
                    count = self._store.add(self._key("beat", r), 0)
                    if count != seen[r][0] or count == 0:  # 0: its watch has not started yet
                        seen[r] = (count, now)
                    elif now - seen[r][1] > self.timeout:
                        self._fail(f"rank {r} of {self.world} stopped (no sign of life for "
                                   f"{now - seen[r][1]:.1f} s: its process died or hangs); rank "
                                   f"{self.rank} ends the job too; see rank {r}'s log for why")
                        return
                busy = self._busy_seconds()
                if ended and busy > self.timeout:
                    gone = min(ended)
                    self._fail(f"rank {gone} of {self.world} ended while rank {self.rank} waited "
                               f"{busy:.1f} s for it in a collective (it stopped early: see its "
                               f"log for why); rank {self.rank} ends the job too")
                    return
                lost_since = None
            except Exception as e:  # noqa: BLE001 - the store's host is gone (or ended)
                if self._stop.is_set():
                    return
                lost_since = lost_since or now
                if now - lost_since > self.timeout and self._busy_seconds() > self.timeout:
                    first = str(e).splitlines()[0] if str(e) else type(e).__name__
                    self._fail(f"the job's rendezvous store (rank 0's) stopped answering ({first}) "
                               f"while rank {self.rank} of {self.world} waited in a collective: "
                               f"rank 0 died; rank {self.rank} ends the job too")
                    return

    def _fail(self, reason: str) -> None:
        self.reason = reason
        log.error("%s", reason)
        if self._on_failure is not None:
            try:
                self._on_failure(reason)
            except Exception:  # noqa: BLE001 - the exit below still comes
                log.exception("ending the process group after a peer failed")
        if self._stop.wait(self._exit_after):
            return  # the rank ended (close) by itself
        print(f"tierstack: {reason}", file=sys.stderr, flush=True)
        os._exit(1)

    def close(self) -> None:
        """This rank ends normally: the others stop watching it."""
        self._stop.set()
        try:
            self._store.set(self._key("ended", self.rank), "1")
        except Exception:  # noqa: BLE001 - the store's host ended first
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * BEAT_SECONDS + self.timeout)


def abort_process_group() -> None:
    """End the default process group now, so that a collective waiting on a dead peer
    returns with an error: NCCL's abort. gloo needs none (a dead peer's sockets close,
    and its collectives fail at once)."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None and dist.is_initialized() and dist.get_backend() == "nccl":
        abort()
