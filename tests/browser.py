"""Chromium, driven by Playwright, for the operator console's browser tests.

The browser is the system's Chromium (Debian: ``apt-get install chromium
chromium-driver``, at ``/usr/bin/chromium``; elsewhere name it with
``SPANVISOR_CHROMIUM``), never one Playwright downloads: ``.ci/run``
installs it. Without it the tests fail saying how to install it; they are
never skipped, since a console nobody looked at in a browser is untested.

Fixtures (import them into a test module): ``browser``, one Chromium per
module (starting one costs a second); ``console``, a fresh browser context
per test (its own cookies, so each test logs in) whose pages
(:meth:`Console.new_page`) are watched (:class:`Watched`) for dialogs,
console errors and CSP violations, and screenshotted into the test's
``tmp_path`` when the test fails (the report says where);
``console_without_js``, the same with JavaScript off.

:func:`login` and :data:`VIEWPORT` are also what ``scripts/console_screenshots.py``
uses.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ON_FAILURE

try:
    from playwright.sync_api import (
        Browser,
        BrowserContext,
        ConsoleMessage,
        Dialog,
        Page,
        ViewportSize,
        sync_playwright,
    )
    from playwright.sync_api import Error as PlaywrightError
except ImportError:  # pragma: no cover - said by the fixture, with the fix
    PLAYWRIGHT_MISSING = "Playwright for Python is missing: pip install -e '.[test]'"
else:
    PLAYWRIGHT_MISSING = ""

#: Where the browser is, unless ``SPANVISOR_CHROMIUM`` says elsewhere.
DEFAULT_CHROMIUM = "/usr/bin/chromium"
#: The size of every page: a laptop's screen, and the documentation's screenshots.
VIEWPORT: ViewportSize = {"width": 1280, "height": 800}
#: Most a browser action or expectation waits (ms): a page of the console renders in far less.
TIMEOUT_MS = 10_000

#: Reports each Content Security Policy violation to the test (:class:`Watched`),
#: whatever page it happens on; Playwright's init scripts are not subject to the CSP.
_CSP_LISTENER = """
document.addEventListener('securitypolicyviolation', (e) => {
  window.__spanvisorCsp({
    directive: e.violatedDirective,
    blocked: e.blockedURI,
    source: e.sourceFile,
    line: e.lineNumber,
    sample: e.sample,
    page: document.location.href,
  });
});
"""


def chromium_path() -> str:
    return os.environ.get("SPANVISOR_CHROMIUM") or DEFAULT_CHROMIUM


def missing_browser() -> str:
    """Why the browser tests cannot run here, with the fix; empty when they can."""
    if PLAYWRIGHT_MISSING:
        return PLAYWRIGHT_MISSING
    path = chromium_path()
    if not (os.path.isfile(path) and os.access(path, os.X_OK)) and not shutil.which(path):
        return (
            f"Chromium is not installed at {path}: the console's browser tests drive the"
            " system's Chromium, not one Playwright downloads. Install it with"
            " `sudo apt-get install -y --no-install-recommends chromium chromium-driver`"
            " (Debian/Ubuntu; .ci/run does), or set SPANVISOR_CHROMIUM to a Chromium binary."
        )
    return ""


@dataclass
class Watched:
    """What the pages of a context said besides their content."""

    dialogs: list[str] = field(default_factory=list)
    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    csp_violations: list[dict[str, Any]] = field(default_factory=list)

    def csp_violation(self, violation: dict[str, Any]) -> None:
        self.csp_violations.append(violation)

    def watch(self, page: Page) -> Page:
        def on_dialog(dialog: Dialog) -> None:
            self.dialogs.append(f"{dialog.type}: {dialog.message} on {page.url}")
            dialog.dismiss()

        def on_console(message: ConsoleMessage) -> None:
            if message.type == "error":
                where = message.location.get("url", "") if message.location else ""
                self.console_errors.append(f"{message.text} ({where or page.url})")

        page.on("dialog", on_dialog)
        page.on("console", on_console)
        page.on("pageerror", lambda error: self.page_errors.append(f"{error} on {page.url}"))
        return page


@dataclass
class Console:
    """A test's browser context and what its pages said."""

    context: BrowserContext
    watched: Watched

    def new_page(self) -> Page:
        return self.watched.watch(self.context.new_page())


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    problem = missing_browser()
    if problem:
        pytest.fail(problem, pytrace=False)
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium_path(), headless=True)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def console(browser: Browser, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Console]:
    with open_console(browser, request, tmp_path) as opened:
        yield opened


@pytest.fixture
def console_without_js(
    browser: Browser, request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[Console]:
    """A browser with JavaScript off: every page of the console works without it."""
    with open_console(browser, request, tmp_path, java_script_enabled=False) as opened:
        yield opened


@contextlib.contextmanager
def open_console(
    browser: Browser, request: pytest.FixtureRequest, tmp_path: Path, **options: Any
) -> Iterator[Console]:
    context = browser.new_context(viewport=VIEWPORT, **options)
    context.set_default_timeout(TIMEOUT_MS)
    watched = Watched()
    context.expose_function("__spanvisorCsp", watched.csp_violation)
    context.add_init_script(_CSP_LISTENER)
    request.node.stash.setdefault(ON_FAILURE, []).append(lambda: screenshot_all(context, tmp_path))
    try:
        yield Console(context, watched)
    finally:
        context.close()


def screenshot_all(context: BrowserContext, directory: Path) -> str:
    """Each open page as a PNG in ``directory``; says where, for the failure's report."""
    lines = []
    for number, each in enumerate(context.pages):
        path = directory / f"failure-page-{number}.png"
        try:
            each.screenshot(path=str(path), full_page=True)
        except PlaywrightError as exc:
            lines.append(f"could not screenshot {each.url}: {exc}")
        else:
            lines.append(f"{each.url}: {path}")
    return "\n".join(lines) or "no page was open"


def login(page: Page, api: str, token: str) -> None:
    """Log in to the console at ``api`` with the form, as a person does; ends on the runs page."""
    page.goto(f"{api}/ui/login")
    page.fill("#token", token)
    page.click("#login")
    page.wait_for_url(f"{api}/ui/runs")


@contextlib.contextmanager
def as_assertions() -> Iterator[None]:
    """A browser step that fails (a click that times out) as a failed expectation.

    So that a wrapper which explains failed assertions (the agent's and the
    sidecar's logs) explains these too.
    """
    try:
        yield
    except PlaywrightError as exc:
        raise AssertionError(f"in the browser: {exc}") from exc
