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
            # Streaming through a CPU pool smaller than the model: NVMe reads show, with
            # their peak.
            page.wait_for_function(
                """() => Number(document.querySelector('#link-nvme-cpu .value')
                                .dataset.bytesPerSecond) > 0""", timeout=45_000)
            assert "GB/s" in page.inner_text("#link-nvme-cpu .value") or \
                "MB/s" in page.inner_text("#link-nvme-cpu .value")
            assert "peak" in page.inner_text("#link-nvme-cpu .peak")
            # This machine has no GPU: its worker reads the pool in place, and the page
            # draws no link to a device, in the cards or the node table.
            assert page.locator(".link").evaluate_all("cs => cs.map(c => c.id)") == \
                ["link-nvme-cpu", "link-cpu-nvme"]
            assert "device" not in page.inner_text("#nodes tr:first-child")
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
            page.wait_for_function("() => Number(document.querySelector('#link-nvme-cpu .value')"
                                   ".dataset.bytesPerSecond) > 0", timeout=10_000)
            assert page.locator("#link-cpu-device").count() == 0
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


def test_the_training_panel_shows_each_jobs_step_loss_pace_learning_rate_and_eta(
        metrics_daemon, traffic, tmp_path):
    """A worker's loop reports a step after each pass: the page shows its job first, with
    what the node's JSON says of it."""
    from playwright.sync_api import sync_playwright

    from tests.metrics.conftest import LEARNING_RATE, TOTAL_STEPS, get

    traffic.run_for(90, train=True)
    errors: list[str] = []
    with sync_playwright() as p:
        browser = screenshot.launch(p)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
            page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}")
                    if m.type == "error" else None)
            page.goto(metrics_daemon.url + "/dashboard/")
            card = '#training .job[data-job="metrics-test"]'
            # Three steps reported, the pace known (two steps) and a loss history to draw.
            page.wait_for_function(
                f"""() => {{ const c = document.querySelector('{card}');
                     return c && Number(c.querySelector('.step').dataset.value) >= 3 &&
                            c.querySelector('.eta').dataset.value !== '' &&
                            c.querySelector('.sparkline path') !== null; }}""", timeout=60_000)
            figures = page.eval_on_selector(
                card, """c => Object.fromEntries([...c.querySelectorAll('.figure')].map(f =>
                           [f.classList[1], [f.dataset.value, f.querySelector('.value').textContent]]))""")
            node = get(metrics_daemon.url, "/api/v1/node")
            assert page.is_hidden("#no-training")
            # The panel comes first, above the links.
            assert page.evaluate("""() => document.querySelector('#training').compareDocumentPosition(
                document.querySelector('#links')) & Node.DOCUMENT_POSITION_FOLLOWING""")
        finally:
            browser.close()
    assert errors == []
    [job] = node["training"]
    step = int(figures["step"][0])
    assert 3 <= step <= job["step"] and figures["step"][1] == f"{step} / {TOTAL_STEPS}"
    shown_loss = float(figures["loss"][1])
    assert float(figures["loss"][0]) == traffic.loss_at(step)
    assert shown_loss == pytest.approx(traffic.loss_at(step), rel=1e-3)  # 4 significant digits
    assert float(figures["tokens-per-second"][0]) > 0 and figures["tokens-per-second"][1] != "–"
    assert float(figures["learning-rate"][0]) == LEARNING_RATE and figures["learning-rate"][1] == "3.00e-4"
    eta = float(figures["eta"][0])
    assert eta > 0 and figures["eta"][1].endswith((" s", " min"))  # its arithmetic: test_training


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
