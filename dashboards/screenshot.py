"""Open the dashboard in headless Chromium and save a screenshot once it shows traffic.

Uses the system's Chromium (Debian's /usr/bin/chromium, which the Makefile installs)
through the playwright package; playwright's own browser download is never needed.

    python -m tierstack.dashboards.screenshot http://127.0.0.1:8470/dashboard/ out.png
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

CHROMIUM = os.environ.get("TIERSTACK_CHROMIUM", "/usr/bin/chromium")
LINK_VALUE = "#link-{} .value"


def chromium_path() -> str | None:
    """The Chromium binary to drive, or None when there is none."""
    return CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium")


def launch(playwright):
    """Headless Chromium; --no-sandbox because CI runs as root, where its sandbox refuses."""
    path = chromium_path()
    if path is None:
        raise RuntimeError(f"no Chromium at {CHROMIUM}: `apt-get install chromium` (make test "
                           f"does) or set TIERSTACK_CHROMIUM")
    return playwright.chromium.launch(executable_path=path, headless=True,
                                      args=["--no-sandbox", "--disable-gpu"])


def link_rate(page, link: str) -> float:
    """The bytes per second the page shows for a link (e.g. 'nvme->cpu')."""
    value = page.get_attribute(LINK_VALUE.format(link.replace("->", "-")), "data-bytes-per-second")
    return float(value or 0)


def wait_for_traffic(page, timeout_s: float) -> None:
    """Wait until some link shows a non-zero rate."""
    page.wait_for_function(
        """() => [...document.querySelectorAll('.link .value')]
                   .some(e => Number(e.dataset.bytesPerSecond) > 0)""",
        timeout=timeout_s * 1000)


def capture(url: str, out: str, timeout_s: float = 60.0, width: int = 1500, height: int = 1100) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = launch(p)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.goto(url)
            wait_for_traffic(page, timeout_s)
            page.wait_for_timeout(1500)  # one more refresh, so that the charts have history
            page.screenshot(path=out, full_page=True)
        finally:
            browser.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url")
    parser.add_argument("out")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for traffic")
    args = parser.parse_args()
    capture(args.url, args.out, args.timeout)
    print(f"saved {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
