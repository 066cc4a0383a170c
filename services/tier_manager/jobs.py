"""Jobs on a node: who holds each, whether its state outlives it, its share of the pools.

A job is the tensors whose keys start with `<job>/` (a LayerStore's keys). A worker opens
its job when it starts (`OpenJob`, from its client session) and closes it when it ends;
a worker that dies closes it too (its session ends: sessions.py). When a job has no
holder left, its tensors are deleted after `jobs.grace_seconds` (a worker attaching
late, or one reconnecting, holds it again in time), unless it was opened with `keep`.
Jobs are recorded in the manifest, so after a daemon restart a job that no worker opens
again within `jobs.orphan_seconds` is deleted the same way. A daemon shared by many runs
so holds only what runs now, and what was asked to be kept.

Each job is one state machine, moved only under the table's lock:

    OPEN      held by at least one client session
    KEPT      no holder; opened with keep: its tensors stay
    ENDING    no holder; its tensors go at `delete_at` unless a worker opens it first
    DELETING  its ended state is being deleted

Opening a DELETING job is answered with a retry hint until the deletion is over, and
then opens a new job: a re-open never races a deletion. The deletion takes the (key,
version) of each tensor when it starts and deletes a key only at that version, so a
version written since (by any client) is never lost, and the job's record goes only from
DELETING, never from under a holder.

A job's quota bounds the bytes of its tensors (every version counted once, whatever its
tier): the registry refuses a write past it with RESOURCE_EXHAUSTED naming the job.
Keys outside any opened job (a tool writing `a/b` itself) are listed, never deleted here.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass, field

from tierstack.config import JobsConfig
from tierstack.errors import FailedPreconditionError, InvalidArgumentError, KeyNotFoundError
from tierstack.errors import RetryLaterError
from tierstack.services.tier_manager.manifest import Manifest
from tierstack.services.tier_manager.lifecycle import LifecycleError
from tierstack.services.tier_manager.registry import TierRegistry
from tierstack.services.tier_manager.types import JobInfo

log = logging.getLogger(__name__)

MAX_JOB_BYTES = 256
MAX_QUOTA = (1 << 63) - 1  # bytes: the largest the manifest (SQLite INTEGER) holds
DELETING_RETRY_SECONDS = 0.005
"""The retry hint of an OpenJob or DeleteJob that finds its job being deleted."""


def validate_job(job: str) -> str:
    """A job name: what a LayerStore accepts (non-empty, no '/'), no NUL, short."""
    if not job or "/" in job or "\x00" in job or len(job.encode()) > MAX_JOB_BYTES:
        raise InvalidArgumentError(
            f"job name {job!r:.80} must be 1..{MAX_JOB_BYTES} bytes without '/' or NUL (its "
            f"tensors are the keys under '<job>/')")
    return job


class JobPhase(enum.Enum):
    OPEN = "open"
    KEPT = "kept"
    ENDING = "ending"
    DELETING = "deleting"


@dataclass
class _Job:
    keep: bool
    quota: int
    phase: JobPhase = JobPhase.OPEN
    holders: dict[str, int] = field(default_factory=dict)  # session -> opens
    delete_at: float | None = None  # monotonic time its state goes (ENDING)

    def move(self, to: JobPhase, *allowed: JobPhase) -> None:
        if self.phase not in allowed:
            raise LifecycleError(f"a job {self.phase.value} cannot become {to.value}; only "
                                 f"{', '.join(p.value for p in allowed)} can")
        self.phase = to


class JobTable:
    """The node's jobs; the registry counts their bytes and enforces their quotas."""

    def __init__(self, registry: TierRegistry, manifest: Manifest, config: JobsConfig) -> None:
        self.registry = registry
        self.accounts = registry.accounts
        self.manifest = manifest
        self.config = config
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}
        orphaned_until = time.monotonic() + config.orphan_seconds
        for job, keep, quota in manifest.jobs():  # an earlier instance's: none holds them now
            self._jobs[job] = _Job(keep, quota, JobPhase.KEPT if keep else JobPhase.ENDING,
                                   delete_at=None if keep else orphaned_until)
            self.accounts.set_quota(job, quota)
        waiting = sum(1 for j in self._jobs.values() if j.phase is JobPhase.ENDING)
        if waiting:
            log.info("%d jobs from before the restart are deleted unless a worker opens them "
                     "within %.0f s", waiting, config.orphan_seconds)

    def open(self, job: str, session: str, keep: bool, quota: int) -> JobInfo:
        """`session` holds `job` (created if new); `keep` sticks once asked for; a quota of
        0 keeps the job's (or the node's default)."""
        validate_job(job)
        if quota > MAX_QUOTA:  # checked before anything changes: the manifest stores int64
            raise InvalidArgumentError(
                f"job {job!r}: quota_bytes {quota} is above the largest quota ({MAX_QUOTA} "
                f"bytes); give at most that, or 0 for the job's current quota or the node's default")
        if not session:
            raise InvalidArgumentError(
                "OpenJob needs the caller's client session (metadata x-tierstack-session, which "
                "TierManagerClient sends): a job is held by the sessions of its workers")
        with self._lock:
            record = self._jobs.get(job)
            if record is None:
                record = self._jobs[job] = _Job(keep, quota or self.config.default_quota)
            elif record.phase is JobPhase.DELETING:
                raise RetryLaterError(
                    f"job {job!r} ended and its state is being deleted; it opens as a new job once "
                    f"that is done: open it again", DELETING_RETRY_SECONDS)
            record.move(JobPhase.OPEN, JobPhase.OPEN, JobPhase.KEPT, JobPhase.ENDING)
            record.keep = record.keep or keep
            if quota:
                record.quota = quota
            record.holders[session] = record.holders.get(session, 0) + 1
            record.delete_at = None
            self.accounts.set_quota(job, record.quota)
            self.manifest.set_job(job, record.keep, record.quota)
        return self.info(job)

    def close(self, job: str, session: str) -> None:
        """`session` lets go of `job` (all its opens)."""
        validate_job(job)
        with self._lock:
            record = self._jobs.get(job)
            if record is None or session not in record.holders:
                raise KeyNotFoundError(f"job {job!r} is not open by this client; nothing to close")
            del record.holders[session]
            self._let_go(job, record)

    def sessions_ended(self, sessions: set[str]) -> None:
        """Clients that went away let go of every job they held."""
        with self._lock:
            for job, record in self._jobs.items():
                if sessions & record.holders.keys():
                    for session in sessions:
                        record.holders.pop(session, None)
                    self._let_go(job, record)

    def _let_go(self, job: str, record: _Job) -> None:
        """A holder went (lock held): the last one ends the job, or leaves it kept."""
        if record.holders:
            return
        if record.keep:
            record.move(JobPhase.KEPT, JobPhase.OPEN)
            return
        record.move(JobPhase.ENDING, JobPhase.OPEN)
        record.delete_at = time.monotonic() + self.config.grace_seconds
        log.info("job %s has no worker left: its state is deleted in %.0f s unless one opens "
                 "it", job, self.config.grace_seconds)

    def tick(self, now: float | None = None) -> None:
        """Delete the state of jobs whose time ran out (called by the reaper)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            due = [job for job, r in self._jobs.items()
                   if r.phase is JobPhase.ENDING and r.delete_at <= now]
        for job in due:
            try:
                count = self._delete(job, (JobPhase.ENDING,))
            except RetryLaterError:
                continue  # opened or deleted meanwhile
            except Exception as e:  # noqa: BLE001 - tried again at the next tick
                log.warning("deleting the state of ended job %s failed (%s); trying again", job, e)
                continue
            log.info("job %s ended: deleted its %d tensors", job, count)

    def delete(self, job: str, force: bool = False) -> int:
        """Delete a job's tensors now (`tierstack jobs delete`); refused while workers hold
        it unless `force`. Returns how many tensors went."""
        validate_job(job)
        with self._lock:
            record = self._jobs.get(job)
            if record is not None and record.holders and not force:
                raise FailedPreconditionError(
                    f"job {job!r} is open by {len(record.holders)} worker(s); stop them first, "
                    f"or delete with --force (their next calls then fail with NOT_FOUND)")
        if record is None:
            keys = self.registry.records.under(job + "/")
            if not keys:
                raise KeyNotFoundError(f"no job {job!r} on this node (`tierstack jobs` lists them)")
            return self._delete_versions(keys)  # keys under a prefix no worker opened
        return self._delete(job, (JobPhase.OPEN, JobPhase.KEPT, JobPhase.ENDING))

    def _delete(self, job: str, allowed: tuple[JobPhase, ...]) -> int:
        """Move `job` from one of `allowed` to DELETING, delete the versions it holds then,
        and forget it; back where it was if a deletion fails."""
        with self._lock:
            record = self._jobs.get(job)
            if record is None or record.phase not in allowed:
                raise RetryLaterError(f"job {job!r} is {record.phase.value if record else 'gone'} "
                                      f"now; ask again", DELETING_RETRY_SECONDS)
            before, delete_at = record.phase, record.delete_at
            record.move(JobPhase.DELETING, *allowed)
            record.holders.clear()  # a forced delete: its holders' calls now find nothing
            keys = self.registry.records.under(job + "/")
        try:
            count = self._delete_versions(keys)
        except BaseException:
            with self._lock:
                record.move(before, JobPhase.DELETING)
                record.delete_at = delete_at
            raise
        with self._lock:
            record.move(JobPhase.DELETING, JobPhase.DELETING)  # nothing moved it meanwhile
            del self._jobs[job]
            self.accounts.set_quota(job, 0)
            self.manifest.forget_job(job)
        return count

    def _delete_versions(self, keys: list[tuple[str, int]]) -> int:
        count = 0
        for key, version in keys:
            try:
                count += self.registry.delete(key, version)
            except KeyNotFoundError:
                pass  # deleted meanwhile
        return count

    def info(self, job: str) -> JobInfo:
        tensors, nbytes = self.accounts.usage(job)
        with self._lock:
            record = self._jobs.get(job)
            if record is None:
                return JobInfo(job, True, 0, tensors, nbytes, 0, False, 0.0)
            left = max(0.0, record.delete_at - time.monotonic()) if record.delete_at is not None else 0.0
            return JobInfo(job, record.keep, record.quota, tensors, nbytes, len(record.holders),
                           True, left)

    def list(self) -> list[JobInfo]:
        """Every opened job, and every other key prefix that holds tensors."""
        with self._lock:
            names = set(self._jobs)
        names |= set(self.accounts.jobs())
        return [self.info(job) for job in sorted(names)]
