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


def test_the_plan_panel_shows_each_jobs_plan_with_its_predicted_and_measured_step(tmp_path):
    """`tierstack train` with its embedded scheduler: the node's dashboard shows the job's
    scheduler plan, the version its worker follows, the plan's predicted step and the
    step the worker measured."""
    import json
    import signal
    import subprocess
    import sys
    import threading
    import time
    import urllib.request

    from playwright.sync_api import sync_playwright

    proc = subprocess.Popen(
        [sys.executable, "-m", "tierstack.cli", "train", "--steps", "2000", "--layers", "3",
         "--dim", "64", "--heads", "4", "--seq-len", "32", "--batch-size", "2",
         "--cpu-pool-size", "2MiB", "--nvme-path", str(tmp_path / "nvme"), "--log-every", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    errors: list[str] = []
    try:
        deadline = time.monotonic() + 120
        url = ""
        while not url and time.monotonic() < deadline and proc.poll() is None:
            url = next((l.split()[1].removesuffix("/dashboard/") for l in list(lines)
                        if l.startswith("dashboard: ")), "")
            time.sleep(0.2)
        assert url, "".join(lines)[-3000:]

        def reported():
            with urllib.request.urlopen(url + "/api/v1/node", timeout=10) as r:
                node = json.loads(r.read())
            return node if node["plan"]["jobs"] and any(
                w["step_seconds"] > 0 and w["predicted_step_seconds"] > 0 and w["plan_version"] >= 1
                for w in node["workers"]) else None

        node = None
        while node is None and time.monotonic() < deadline:
            node = reported()
            time.sleep(0.5)
        assert node is not None, "".join(lines)[-3000:]
        job = node["plan"]["jobs"][0]["job"]
        with sync_playwright() as p:
            browser = screenshot.launch(p)
            try:
                page = browser.new_page(viewport={"width": 1500, "height": 1100})
                page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}")
                        if m.type == "error" else None)
                page.goto(url + "/dashboard/")
                page.wait_for_function("() => { const c = document.querySelector('#plan .job-plan "
                                       ".measured'); return c && c.textContent.includes('×'); }",
                                       timeout=30_000)
                cells = page.eval_on_selector_all("#plan .job-plan td", "tds => tds.map(t => t.textContent)")
            finally:
                browser.close()
        _, shown_job, version, _, _, _, follow, predicted, measured = (c.strip() for c in cells)
        assert shown_job == job and int(version) >= 1 and follow.startswith("v")
        assert float(predicted.removesuffix(" s")) > 0
        seconds, ratio = measured.split(" s (")
        assert float(seconds) > 0 and ratio.endswith("×)")
    finally:
        # SIGTERM, not SIGINT: a child of a process started in the background inherits
        # SIGINT ignored (POSIX), and then waited out the whole timeout below. The job ends
        # after the step in progress and stops its embedded daemons.
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert errors == []
