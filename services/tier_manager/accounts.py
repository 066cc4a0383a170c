"""What each job holds on this node, and its quota: counted as versions come and go.

A job is the keys before their first '/' (jobs.py decides which jobs exist and sets their
quotas; the registry counts every current version here and asks before each write).
Every version counts its bytes once, whatever its tier.
"""

from __future__ import annotations

import threading

from tierstack.errors import QuotaExceededError


def job_of(key: str) -> str:
    """The job a key belongs to: its part before the first '/' ('' for none)."""
    job, slash, _ = key.partition("/")
    return job if slash else ""


class JobAccounts:
    """Per job: tensors and bytes of its current versions, and its quota (0: none)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._usage: dict[str, list[int]] = {}  # job -> [tensors, bytes]
        self._quotas: dict[str, int] = {}

    def count(self, key: str, nbytes: int, tensors: int) -> None:
        """Add a version's change to the usage of its key's job."""
        job = job_of(key)
        if not job:
            return
        with self._lock:
            usage = self._usage.setdefault(job, [0, 0])
            usage[0] += tensors
            usage[1] += nbytes
            if usage[0] == 0:
                del self._usage[job]

    def check(self, key: str, nbytes: int, replaced: int) -> None:
        """QuotaExceededError if `nbytes` as the new version of `key` (replacing a version of
        `replaced` bytes) puts its job over quota."""
        job = job_of(key)
        with self._lock:
            quota = self._quotas.get(job, 0) if job else 0
            if not quota:
                return
            after = self._usage.get(job, [0, 0])[1] - replaced + nbytes
        if after > quota:
            raise QuotaExceededError(
                f"job {job!r} would hold {after} bytes on this node with tensor {key!r} "
                f"({nbytes} bytes), over its quota of {quota}; delete its tensors it no longer "
                f"needs, or open the job with a larger quota (tier_manager.jobs.default_quota)")

    def set_quota(self, job: str, quota: int) -> None:
        with self._lock:
            if quota:
                self._quotas[job] = quota
            else:
                self._quotas.pop(job, None)

    def usage(self, job: str) -> tuple[int, int]:
        """(tensors, bytes) of the current versions of the job's keys."""
        with self._lock:
            tensors, nbytes = self._usage.get(job, (0, 0))
            return tensors, nbytes

    def jobs(self) -> list[str]:
        """Every job that holds a tensor now."""
        with self._lock:
            return list(self._usage)
