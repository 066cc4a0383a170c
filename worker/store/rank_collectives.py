"""One rank's collectives with the other ranks of a partitioned job, in one order on every rank.

Collectives must be issued in the same order on every rank. They all run on one
communication thread per rank, in the order the caller asked for them: the caller's
program is the same on every rank, so the order is too. On CUDA they run on their own
stream (NCCL) and the caller's stream waits on an event; on CPU it is gloo.

A peer that dies ends this rank too, in one line (worker/node/peer_watch.py): a
collective that fails raises `RankFailedError` naming which rank is gone, once the watch
knows.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence, TypeVar

import torch
import torch.distributed as dist

from tierstack.errors import RankFailedError, TierstackError
from tierstack.worker.node.peer_watch import BEAT_SECONDS, PeerWatch, abort_process_group
from tierstack.worker.store.step_phases import NO_PHASES, NoPhases, PhaseClock

log = logging.getLogger(__name__)

T = TypeVar("T")

# torch 2.13 renamed the flat collectives (*_single); older releases (the GPU machine's
# 2.11) have only the *_tensor names. Same arguments, same semantics.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class RankCollectives:
    """This rank's collectives, queued on its communication thread, with what they moved."""

    def __init__(self, rank: int, world: int, group: dist.ProcessGroup | None,
                 device: torch.device) -> None:
        self.rank, self.world, self.group = rank, world, group
        self.device = device
        self.cuda = device.type == "cuda"
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tierstack-collective")
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        # The watch needs the time the communication thread has waited in its current op.
        self._busy_since: float | None = None
        self._failure: RankFailedError | None = None
        self.watch = self._watch_peers()
        self.bytes_gathered = 0   # bytes received from the other ranks by all-gathers
        self.bytes_reduced = 0    # gradient bytes this rank sent into reduce-scatters
        self.bytes_exchanged = 0  # bytes this rank sent to the others by all-to-alls
        # Seconds of each kind of collective and of waits for this rank's tiers, when a
        # ShardedEngine's time_phases() asks (worker/store/step_phases.py).
        self.phases: PhaseClock | NoPhases = NO_PHASES

    def time_phases(self, clock: PhaseClock) -> None:
        """Time every collective (and the tier waits the gathers do) on `clock` from now on."""
        self.phases = clock

    def submit(self, fn: Callable[[], T]) -> Future:
        """Queue `fn` on the communication thread (every collective goes through here).
        A collective that fails because a peer is gone raises `RankFailedError`."""
        def run() -> T:
            if self._failure is not None:
                raise self._failure
            self._busy_since = time.monotonic()
            try:
                if self.cuda:
                    with torch.cuda.stream(self.stream):
                        return fn()
                return fn()
            except TierstackError:
                raise  # the tier manager's own errors (a local load) say what they are
            except Exception as e:  # noqa: BLE001 - a collective's error: a peer is gone
                log.debug("collective failed on rank %d", self.rank, exc_info=True)
                raise self.peer_failure(e) from None  # one line: the backend's page is in the log
            finally:
                self._busy_since = None
        return self._thread.submit(run)

    def _watch_peers(self) -> PeerWatch | None:
        """This rank's watch over the others, through the job's rendezvous store."""
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if self.world == 1 or self.group is not None or not host or not port:
            return None  # one rank, a subgroup, or a launcher without torchrun's variables
        busy = lambda: 0.0 if self._busy_since is None else time.monotonic() - self._busy_since  # noqa: E731
        return PeerWatch(self.rank, self.world, host, int(port), busy_seconds=busy,
                         on_failure=lambda reason: abort_process_group())

    def peer_failure(self, error: BaseException) -> RankFailedError:
        """The one-line error for a collective that failed (`error`): the watch's account of
        which peer is gone, once it has one (it is waited for a beat past its timeout)."""
        if self._failure is None:
            watch = self.watch
            if watch is not None:
                deadline = time.monotonic() + watch.timeout + 4 * BEAT_SECONDS
                while watch.reason is None and time.monotonic() < deadline:
                    time.sleep(BEAT_SECONDS / 5)
            reason = watch.reason if watch is not None else None
            if reason is None:
                first = (str(error).strip().splitlines() or [type(error).__name__])[0]
                reason = (f"a collective of rank {self.rank} of {self.world} failed ({first[:200]}): "
                          f"another rank has died or ended early; see the other ranks' logs")
            self._failure = RankFailedError(reason)
        return self._failure

    # ---- streams: the caller's work before a collective, the collective's before the caller's --

    def after_caller(self) -> object | None:
        """An event after the caller's queued work, for the communication stream to wait on."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait_for(self, event) -> None:
        """On the communication thread: the stream waits for `event` (after_caller's)."""
        if event is not None:
            self.stream.wait_event(event)

    def _caller_waits(self) -> None:
        """Make the caller's stream wait for the communication stream's work so far."""
        if self.cuda:
            event = torch.cuda.Event()
            event.record(self.stream)
            torch.cuda.current_stream(self.device).wait_event(event)

    # ---- the collectives -----------------------------------------------------------------

    def all_gather_into(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        """On the communication thread: every rank's `shard` into `out`, in rank order."""
        with self.phases.device("all_gather"):
            _all_gather(out, shard, group=self.group)
        self.bytes_gathered += shard.numel() * shard.element_size() * (self.world - 1)

    def reduce_scatter_mean(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the mean of every rank's `full` (a collective)."""
        before = self.after_caller()

        def op() -> torch.Tensor:
            self.wait_for(before)
            if self.cuda:  # made on the caller's stream, read here: not reused before that
                full.record_stream(self.stream)
            out = torch.empty(full.numel() // self.world, dtype=full.dtype, device=full.device)
            with self.phases.device("reduce_scatter"):
                _reduce_scatter(out, full, group=self.group)
            out.div_(self.world)
            self.bytes_reduced += full.numel() * full.element_size()
            return out

        shard = self.submit(op).result()
        self._caller_waits()
        return shard

    def all_gather_to_cpu(self, shard: torch.Tensor, numel: int) -> torch.Tensor:
        """Every rank's `shard` (a CPU tensor) gathered into one CPU tensor of `numel`."""
        def op() -> torch.Tensor:
            local = shard.to(self.device)
            full = torch.empty(numel, dtype=shard.dtype, device=self.device)
            _all_gather(full, local, group=self.group)
            return full.cpu()

        return self.submit(op).result()

    def all_reduce_mean_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Average `tensors` over the ranks in place (persistent parameters' gradients)."""
        if not tensors:
            return
        before = self.after_caller()

        def op() -> None:
            self.wait_for(before)
            if self.cuda:
                for t in tensors:
                    t.record_stream(self.stream)
            flat = torch.cat([t.reshape(-1) for t in tensors])
            with self.phases.device("all_reduce"):
                dist.all_reduce(flat, group=self.group)
            flat.div_(self.world)
            offset = 0
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

        self.submit(op).result()
        self._caller_waits()

    def all_reduce_mean(self, value: float) -> float:
        """The mean of a number over the ranks (the global batch's loss)."""
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        self.all_reduce_mean_([t])
        return float(t.item())

    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's `values` (the same count on each), in rank order (a collective)."""
        def op() -> list[list[int]]:
            mine = torch.tensor(list(values), dtype=torch.int64, device=self.device)
            every = torch.empty(self.world * mine.numel(), dtype=torch.int64, device=self.device)
            _all_gather(every, mine, group=self.group)
            return every.view(self.world, -1).tolist()

        return self.submit(op).result()

    def all_to_all(self, data: torch.Tensor, sent: Sequence[int], received: Sequence[int]
                   ) -> torch.Tensor:
        """Send `data`'s consecutive pieces of `sent[s]` elements to each rank s; return the
        pieces of `received[r]` elements every rank r sent here, one after the other in rank
        order (a collective; 1-D tensors)."""
        before = self.after_caller()

        def op() -> torch.Tensor:
            self.wait_for(before)
            if self.cuda:
                data.record_stream(self.stream)
            out = torch.empty(sum(received), dtype=data.dtype, device=data.device)
            dist.all_to_all_single(out, data, list(received), list(sent), group=self.group)
            self.bytes_exchanged += (sum(sent) - sent[self.rank]) * data.element_size()
            return out

        out = self.submit(op).result()
        self._caller_waits()
        return out

    def broadcast_ints(self, values: Sequence[int]) -> list[int]:
        """Rank 0's `values` on every rank (a collective)."""
        def op() -> list[int]:
            t = torch.tensor(list(values), dtype=torch.int64, device=self.device)
            with self.phases.device("broadcast"):
                dist.broadcast(t, src=self._rank_0(), group=self.group)
            return t.tolist()

        return self.submit(op).result()

    def broadcast_object(self, value: T) -> T:
        """Rank 0's `value` on every rank (a collective; any picklable value)."""
        def op() -> T:
            box = [value]
            dist.broadcast_object_list(box, src=self._rank_0(), group=self.group,
                                       device=self.device if self.cuda else None)
            return box[0]

        return self.submit(op).result()

    def barrier(self) -> None:
        """Wait for every rank to get here (queued behind this rank's collectives)."""
        self.submit(lambda: dist.barrier(group=self.group)).result()

    def _rank_0(self) -> int:
        return 0 if self.group is None else dist.get_global_rank(self.group, 0)

    def close(self) -> None:
        try:
            self._thread.shutdown(wait=True)
        finally:
            if self.watch is not None:
                self.watch.close()
