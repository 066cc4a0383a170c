"""The web dashboard in real headless Chromium, against a real daemon moving bytes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tierstack.dashboards import screenshot

pytest.importorskip("playwright.sync_api", reason="the playwright package is a test extra")
if screenshot.chromium_path() is None:
    if os.environ.get("CI") == "true":  # CI installs it (make test): missing there is a bug
        raise RuntimeError("no Chromium in CI: the Makefile's system-packages step failed")
    pytest.skip("no Chromium: `apt-get install chromium` (make test installs it as root)",
                allow_module_level=True)


def test_dashboard_shows_live_nonzero_bandwidth_and_keeps_updating(metrics_daemon, traffic, tmp_path):
    from playwright.sync_api import sync_playwright

    traffic.run_for(60)
    errors: list[str] = []
    with sync_playwright() as p:
        browser = screenshot.launch(p)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            # Any error the browser reports fails the test: uncaught exceptions, console
            # errors (a resource that 404s shows there), failed or erroring requests.
            page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
            page.on("console", lambda m: errors.append(f"console {m.type}: {m.text} {m.location}")
                    if m.type == "error" else None)
            page.on("requestfailed", lambda r: errors.append(f"request failed: {r.url} {r.failure}"))
            page.on("response", lambda r: errors.append(f"HTTP {r.status}: {r.url}")
                    if r.status >= 400 else None)
            page.goto(metrics_daemon.url + "/dashboard/")
            screenshot.wait_for_traffic(page, timeout_s=45)
            # Streaming through a CPU pool smaller than the model: NVMe reads and device
            # copies both show, with their peaks.
            page.wait_for_function(
                """() => ['nvme-cpu', 'cpu-device'].every(l =>
                     Number(document.querySelector(`#link-${l} .value`).dataset.bytesPerSecond) > 0)""",
                timeout=45_000)
            assert "GB/s" in page.inner_text("#link-cpu-device .value") or \
                "MB/s" in page.inner_text("#link-cpu-device .value")
            assert "peak" in page.inner_text("#link-nvme-cpu .peak")
            first_updates = int(page.get_attribute("#status", "data-updates"))
            first_path = page.get_attribute("#link-nvme-cpu svg path.line", "d")
            page.wait_for_function(f"() => Number(document.querySelector('#status').dataset.updates) "
                                   f">= {first_updates + 2}", timeout=10_000)
            assert page.get_attribute("#link-nvme-cpu svg path.line", "d") != first_path  # it moves
            # Occupancy, stall, the plan and the node table are filled in.
            assert "of 16.0 MiB" in page.inner_text("#tier-cpu")
            assert "s in total" in page.inner_text("#stall-value")
            assert "test-node" in page.inner_text("#plan")
            assert "test-node" in page.inner_text("#nodes")
            # The node's own view draws the same figures.
            page.select_option("#view", "test-node")
            page.wait_for_function("() => Number(document.querySelector('#link-cpu-device .value')"
                                   ".dataset.bytesPerSecond) > 0", timeout=10_000)
            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 20_000
            artifacts = os.environ.get("TIERSTACK_TEST_ARTIFACTS")
            if artifacts:
                Path(artifacts).mkdir(parents=True, exist_ok=True)
                shutil.copy(shot, Path(artifacts) / "dashboard.png")
        finally:
            browser.close()
    assert errors == []
