"""The operator console's screenshots in the documentation, taken during ``spanvisor demo``.

    python scripts/console_screenshots.py            # writes docs/images/console-*.png

It plays the demo's story (:mod:`supervisor.cli.demo`: a sidecar in this
process, two LangGraph agents, a fake provider with faults) and, at the moments
worth showing, logs in to the console at ``/ui`` in Chromium (the system's,
as the browser tests use it: ``tests/browser.py``) and saves the viewport
(1280x800) as a PNG:

* ``console-approvals.png``: billing-1's refund waiting for a person (taken
  before the demo's operator approves it);
* ``console-runs.png``: once four runs have begun, some still going;
* ``console-run.png`` (billing-1: killed, resumed, approved),
  ``console-incidents.png`` and ``console-breakers.png`` (``gpt-4o``'s
  opened, half-open, closed again): once the story is over.

The run page links each trace to a Jaeger at localhost (``ui_trace_url``).
Exits 1 when the story or a screenshot did not happen; prints the command
that made the images last.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python scripts/console_screenshots.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from playwright.sync_api import Browser, Page, sync_playwright
from playwright.sync_api import Error as PlaywrightError

from supervisor.cli.demo import Demo
from supervisor.cli.demo_agents import missing_modules
from supervisor.cli.demo_story import BILLING_PREFIX, MIN_RUNS
from supervisor.cli.demo_watch import Watcher
from supervisor.forward.downstream import Downstream
from tests.browser import VIEWPORT, chromium_path, login, missing_browser

ROOT = Path(__file__).resolve().parents[1]
#: Where the run page's trace link points: a Jaeger on this machine.
TRACE_URL = "http://localhost:16686/trace/{trace_id}"
#: Runs on the runs page's screenshot, some of them still going.
RUNS_SHOWN = 4
#: The most a screenshot may weigh in the repository.
MAX_BYTES = 200_000


class Camera:
    """One logged-in page of the console; saves what it shows."""

    def __init__(self, browser: Browser, out: Path) -> None:
        self.browser = browser
        self.out = out
        self.page: Page | None = None
        self.saved: dict[str, Path] = {}
        self.tried: set[str] = set()
        self.problems: list[str] = []

    def shoot(self, name: str, api: str, token: str, path: str) -> None:
        if name in self.tried:  # once: a page that failed is said once, not at every tick
            return
        self.tried.add(name)
        try:
            page = self._page(api, token)
            response = page.goto(f"{api}{path}")
            if response is None or response.status != 200:
                self.problems.append(f"{path}: {response.status if response else 'no answer'}")
                return
            target = self.out / f"console-{name}.png"
            page.screenshot(path=str(target))
        except PlaywrightError as exc:  # say which, and go on with the story
            self.problems.append(f"{path}: {exc}")
            return
        self.saved[name] = target
        size = target.stat().st_size
        if size > MAX_BYTES:
            self.problems.append(f"{target.name} weighs {size} bytes, more than {MAX_BYTES}")

    def _page(self, api: str, token: str) -> Page:
        if self.page is None:
            context = self.browser.new_context(viewport=VIEWPORT)
            context.set_default_timeout(10_000)
            self.page = context.new_page()
            login(self.page, api, token)
        return self.page


class ScreenshotDemo(Demo):
    """The demo, with a camera at its moments (see the module)."""

    def __init__(self, camera: Camera, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.camera = camera

    def _operate(self, watcher: Watcher) -> None:
        seen = watcher.seen
        if any(a.get("status") == "pending" for a in seen.approvals.values()):
            self.camera.shoot("approvals", self.api, self.token, "/ui/approvals")
        going = [r for r in seen.runs if r.get("status") != "ended"]
        if len(seen.runs) >= RUNS_SHOWN and going:
            self.camera.shoot("runs", self.api, self.token, "/ui/runs")
        super()._operate(watcher)

    def _summary(self, watcher: Watcher, outage: Any, downstream: Downstream | None) -> None:
        super()._summary(watcher, outage, downstream)
        for name, path in (
            ("runs", "/ui/runs"),  # when no moment had enough runs going
            ("run", f"/ui/runs/{BILLING_PREFIX}-1"),
            ("incidents", "/ui/incidents"),
            ("breakers", "/ui/breakers"),
        ):
            self.camera.shoot(name, self.api, self.token, path)


@contextmanager
def chromium() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), headless=True)
        try:
            yield browser
        finally:
            browser.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    args = parser.parse_args(argv)
    problem = missing_browser() or (
        f"the demo's agent needs {', '.join(missing_modules())}: pip install -e '.[demo]'"
        if missing_modules()
        else ""
    )
    if problem:
        print(f"console_screenshots: {problem}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["SPANVISOR_UI_TRACE_URL"] = TRACE_URL
    with chromium() as browser:
        camera = Camera(browser, args.out)
        demo = ScreenshotDemo(camera, runs=MIN_RUNS, seed=7, live=False, keep=False, out=sys.stdout)
        story = demo.run()
    wanted = ("runs", "run", "approvals", "incidents", "breakers")
    missing = [name for name in wanted if name not in camera.saved]
    for name, path in camera.saved.items():
        print(
            f"{name}: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}"
            f" ({path.stat().st_size} bytes)"
        )
    for each in camera.problems:
        print(f"console_screenshots: {each}", file=sys.stderr)
    if missing:
        print(f"console_screenshots: not taken: {', '.join(missing)}", file=sys.stderr)
    command = shlex.join(["python", "scripts/console_screenshots.py", *(argv or sys.argv[1:])])
    print(f"made by: {command}")
    return 0 if story == 0 and not missing and not camera.problems else 1


if __name__ == "__main__":
    sys.exit(main())
