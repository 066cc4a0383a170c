"""Follows one job's plans in the background: the current plan, and a callback per new one.

A WatchPlans stream is held open on a daemon thread; when it breaks (the scheduler
restarted, the network blinked) the watcher reconnects and asks for plans newer than
the last it saw, so no version is skipped and none is delivered twice. `on_reconnect`
runs before each reconnection (the worker re-reports its trace to a scheduler that
restarted and forgot the job).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from tierstack.errors import TierstackError
from tierstack.services.scheduler.client import SchedulerClient
from tierstack.services.scheduler.model import Plan

log = logging.getLogger(__name__)


class PlanWatcher:
    """The latest plan of `job`, kept current by a background stream."""

    def __init__(self, client: SchedulerClient, job: str,
                 on_plan: Callable[[Plan], None] | None = None,
                 on_reconnect: Callable[[], None] | None = None) -> None:
        self.client = client
        self.job = job
        self.on_plan = on_plan
        self.on_reconnect = on_reconnect
        self.plan: Plan | None = None
        self._lock = threading.Lock()
        self._new = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._call = None
        self._thread = threading.Thread(target=self._run, name=f"tierstack-plans-{job}", daemon=True)

    def start(self) -> "PlanWatcher":
        self._thread.start()
        return self

    @property
    def version(self) -> int:
        with self._lock:
            return self.plan.version if self.plan else 0

    def offer(self, plan: Plan) -> bool:
        """Take `plan` if it is newer than the current one (from the stream, or the answer
        to a trace the worker reported); whether it was. Each version is taken once, so its
        callback runs once, whichever way it came first."""
        with self._new:
            if self.plan is not None and plan.version <= self.plan.version:
                return False
            self.plan = plan
            self._new.notify_all()
            return True

    def restart_versions(self, plan: Plan) -> None:
        """Take `plan` as current although its version is lower (a restarted scheduler)."""
        with self._new:
            self.plan = plan
            self._new.notify_all()

    def wait_for_version(self, version: int, timeout: float) -> Plan | None:
        """The plan once its version is at least `version`; None on timeout."""
        with self._new:
            self._new.wait_for(lambda: self.plan is not None and self.plan.version >= version, timeout)
            return self.plan if self.plan is not None and self.plan.version >= version else None

    def _run(self) -> None:
        broken = False
        while not self._stop.is_set():
            if broken and self.on_reconnect is not None:
                try:
                    self.on_reconnect()
                except Exception as e:  # noqa: BLE001 - retried until it works or we stop
                    log.debug("reconnect hook of %s failed (%s); retrying", self.job, e)
                    self._stop.wait(1.0)
                    continue
            broken = False
            try:
                self._call = self.client.watch_plans(self.job, self.version)
                for plan in self._call:
                    if not self.offer(plan):
                        continue
                    if self.on_plan is not None:
                        try:
                            self.on_plan(plan)
                        except Exception:  # noqa: BLE001 - a bad callback must not stop the watch
                            log.exception("plan callback for %s failed", self.job)
            except TierstackError as e:
                if self._stop.is_set():
                    return
                log.debug("plan stream of %s broke (%s); reconnecting", self.job, e)
            broken = True
            self._stop.wait(0.5)

    def close(self) -> None:
        self._stop.set()
        if self._call is not None:
            self._call.cancel()
        self._thread.join(timeout=5)
