"""The web console at `/`, driven in headless Chromium (Debian's `chromium` and
`chromium-driver`, through Selenium): seed 000's console steps, as a person
takes them. Every page is photographed into the test's temporary directory
(``dashboard-screens``), which the run prints.

The page must do all of it through cove's public API and show its changes
live (Socket.IO), so no step here reloads the page: each test puts a marker in
the page's window at the start and checks it is still there at the end.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest
import requests
from daytona import SessionExecuteRequest

from conftest import CoveServer, SandboxFactory, unique, vm_assets

try:
    from selenium import webdriver
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.remote.webelement import WebElement
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # pragma: no cover - the venv of scripts/setup has it
    webdriver = None

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
WAIT_S = 60
VM_WAIT_S = 240


class Console:
    """A browser on the console, with the waits the tests share."""

    def __init__(self, driver, base_url: str, screens: Path, downloads: Path):
        self.driver = driver
        self.base_url = base_url
        self.screens = screens
        self.downloads = downloads

    def wait(self, what: Callable[[], object], timeout: float = WAIT_S, message: str = ""):
        def attempt(_):
            try:
                return what()
            except (StaleElementReferenceException, WebDriverException):
                return False

        return WebDriverWait(self.driver, timeout, poll_frequency=0.1).until(attempt, message)

    def find(self, css: str, root=None) -> WebElement:
        return (root or self.driver).find_element(By.CSS_SELECTOR, css)

    def all(self, css: str, root=None) -> list[WebElement]:
        return (root or self.driver).find_elements(By.CSS_SELECTOR, css)

    def shown(self, css: str, timeout: float = WAIT_S) -> WebElement:
        return self.wait(lambda: next((e for e in self.all(css) if e.is_displayed()), None), timeout, f"{css} not shown")

    def click(self, css: str, timeout: float = WAIT_S) -> None:
        """Clicks the first shown, enabled `css`, again if the page replaced it meanwhile."""

        def attempt() -> bool:
            element = next((e for e in self.all(css) if e.is_displayed() and e.is_enabled()), None)
            if element is None:
                return False
            element.click()
            return True

        self.wait(attempt, timeout, f"{css} is not there to click")

    def attribute(self, css: str, name: str) -> str:
        return self.wait(lambda: self.find(css).get_attribute(name), message=f"{css} has no {name}")

    def text(self, css: str) -> str:
        return self.wait(lambda: self.find(css).text, message=f"{css} has no text")

    def type(self, css: str, text: str) -> None:
        element = self.shown(css)
        element.clear()
        element.send_keys(text)

    def photograph(self, name: str) -> None:
        self.driver.save_screenshot(str(self.screens / f"{name}.png"))

    def sign_in(self, key: str) -> None:
        self.driver.get(self.base_url + "/")
        self.type("#key", key)
        self.click("#sign-in")

    def mark(self) -> None:
        """A marker that lives as long as the page does (a reload drops it)."""
        self.driver.execute_script("window.__coveMarker = 'kept';")

    def still_marked(self) -> bool:
        return self.driver.execute_script("return window.__coveMarker") == "kept"

    def row(self, name: str) -> WebElement:
        return self.find(f'#sandboxes tr[data-name="{name}"]')

    def row_state(self, name: str) -> str:
        return self.find(".state", self.row(name)).text

    def wait_row_state(self, name: str, state: str, timeout: float = WAIT_S) -> None:
        self.wait(lambda: self.row_state(name) == state, timeout, f"{name} never showed {state}")

    def terminal_text(self) -> str:
        return self.driver.execute_script(
            "const rows = document.querySelector('#terminal .xterm-rows');"
            "return rows ? rows.textContent : '';"
        )


@pytest.fixture(scope="module")
def screens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dashboard-screens")
    print(f"\ndashboard screenshots: {path}")
    return path


@pytest.fixture
def console(request: pytest.FixtureRequest, cove: CoveServer, screens: Path, tmp_path: Path) -> Iterator[Console]:
    if webdriver is None:
        pytest.skip("selenium is not installed (scripts/setup --with-sdk installs it)")
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        pytest.skip("Debian's chromium and chromium-driver are not installed (scripts/setup --with-sdk)")
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1400,1000", "--no-first-run", "--disable-background-networking",
                     "--disable-component-update", "--disable-sync"):
        options.add_argument(argument)
    options.add_experimental_option("prefs", {
        "download.default_directory": str(downloads),
        "download.prompt_for_download": False,
        "safebrowsing.enabled": False,
    })
    # Selenium Manager would look for drivers on the internet: the driver is Debian's.
    os.environ["SE_OFFLINE"] = "true"
    # Chromium's profile and its singleton socket stay in a directory of the
    # test's, removed after it (short: a socket's path holds 107 bytes).
    scratch = Path(tempfile.mkdtemp(prefix="cr", dir="/tmp"))
    options.add_argument(f"--user-data-dir={scratch / 'profile'}")
    service = Service(CHROMEDRIVER, env={**os.environ, "TMPDIR": str(scratch)})
    driver = webdriver.Chrome(options=options, service=service)
    try:
        driver.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
        console = Console(driver, cove.base_url, screens, downloads)
        yield console
        # How the page looked when the test ended, passed or not.
        console.photograph(f"end-{request.node.name}")
    finally:
        try:
            driver.quit()
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def test_a_wrong_key_shows_the_apis_401_message(console: Console, cove: CoveServer) -> None:
    console.sign_in("cv-not-a-key-" + uuid.uuid4().hex)
    error = console.wait(lambda: console.find("#sign-in-error").text, message="no sign-in error shown")
    # The API's own words, as GET /api/api-keys/current answers a wrong key.
    answer = requests.get(f"{cove.api_url}/api-keys/current", headers={"Authorization": "Bearer cv-wrong"}, timeout=10)
    assert answer.status_code == 401
    assert error == f"401: {answer.json()['message']}"
    console.photograph("sign-in-refused")
    assert console.find("#nav").is_displayed() is False


def test_the_page_is_served_with_a_policy_that_runs_only_its_own_script(cove: CoveServer) -> None:
    page = requests.get(cove.base_url + "/", timeout=10)
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    # Named down to the path: `'self'` would allow a sandbox's /preview/... too.
    host = cove.base_url.removeprefix("http://")
    assert f"script-src {host}/dashboard/app.js {host}/dashboard/xterm.js;" in policy, policy
    assert "'self'" not in policy and "frame-ancestors 'none'" in policy, policy
    for asset in ("app.js", "app.css", "xterm.js", "xterm.css"):
        served = requests.get(f"{cove.base_url}/dashboard/{asset}", timeout=10)
        assert served.status_code == 200, f"{asset}: {served.text[:200]}"
    missing = requests.get(f"{cove.base_url}/dashboard/nothing.js", timeout=10)
    assert missing.status_code == 404 and "nothing.js" in missing.json()["message"]


def test_the_seeds_console_steps_on_a_container(
    console: Console, cove: CoveServer, sandboxes: SandboxFactory, tmp_path: Path
) -> None:
    console.sign_in(cove.api_key)
    console.wait(lambda: console.find("#live").text == "live", message="the live feed never connected")
    console.mark()
    console.photograph("sandboxes-empty")

    # Create, from the dialog: the row appears and turns `started` by itself.
    name = unique("dash")
    console.click("#create-open")
    console.type("#create-name", name)
    console.type("#create-labels", "suite=dashboard")
    console.type("#create-env", "GREETING=from-the-console")
    console.photograph("create-dialog")
    console.click("#create-submit")
    console.wait_row_state(name, "started")
    sandbox_id = console.attribute(f'#sandboxes tr[data-name="{name}"]', "data-id")
    sandboxes.track(sandbox_id)
    assert "suite=dashboard" in console.text(f'#sandboxes tr[data-name="{name}"] td.labels')
    console.photograph("sandboxes-started")

    # The label filter keeps it; another label hides it.
    console.type("#filter-label", "suite=other")
    console.wait(lambda: not console.all(f'#sandboxes tr[data-name="{name}"]'), message="filter did not hide it")
    console.type("#filter-label", "suite=dashboard")
    console.wait(lambda: console.all(f'#sandboxes tr[data-name="{name}"]'), message="filter did not show it")

    # Stop ⏹ and start ▶ from the row.
    console.click(f'#sandboxes tr[data-name="{name}"] button[data-action="stop"]')
    console.wait_row_state(name, "stopped")
    assert cove.request("GET", f"/sandbox/{sandbox_id}").json()["state"] == "stopped"
    console.click(f'#sandboxes tr[data-name="{name}"] button[data-action="start"]')
    console.wait_row_state(name, "started")

    # The sandbox's own page: a command typed in the web terminal, its output read back.
    console.click(f'#sandboxes tr[data-name="{name}"] a.name')
    console.shown("#sandbox-header h1")
    console.click("#terminal-open")
    console.wait(lambda: "$" in console.terminal_text() or "#" in console.terminal_text(), message="no prompt")
    console.find("#terminal .xterm-screen").click()
    ActionChains(console.driver).send_keys("echo \"$GREETING\" dash-$((6*7))" + Keys.ENTER).perform()
    console.wait(lambda: "from-the-console dash-42" in console.terminal_text(), message="the command's output never showed")
    console.photograph("sandbox-terminal")

    # Files: upload one, see it listed, and download it back.
    local = tmp_path / "hello-from-the-browser.txt"
    content = f"uploaded through the console {uuid.uuid4()}\n"
    local.write_text(content)
    console.click('button[data-tab="files"]')
    console.shown("#files")
    home = console.attribute("#files-path", "value")
    console.find("#upload-file").send_keys(str(local))
    console.click("#upload")
    console.shown(f'#files tr[data-name="{local.name}"]')
    in_sandbox = requests.get(
        f"{cove.base_url}/toolbox/{sandbox_id}/files/download",
        params={"path": f"{home}/{local.name}"},
        headers={"Authorization": f"Bearer {cove.api_key}"},
        timeout=30,
    )
    assert in_sandbox.status_code == 200 and in_sandbox.text == content
    console.click(f'#files tr[data-name="{local.name}"] button.download')
    fetched = console.downloads / local.name
    console.wait(lambda: fetched.exists() and fetched.read_text() == content, message="the download never arrived")
    console.photograph("sandbox-files")

    # Sessions and their logs.
    sdk_sandbox = cove.client().get(sandbox_id)
    sdk_sandbox.process.create_session("console-session")
    sdk_sandbox.process.execute_session_command("console-session", SessionExecuteRequest(command="echo logged-for-the-console"))
    console.click('button[data-tab="sessions"]')
    console.click('table[data-session="console-session"] button.logs')
    console.wait(lambda: "logged-for-the-console" in console.find("#session-logs").text, message="no session logs")
    console.photograph("sandbox-sessions")

    # Timers: set auto-stop from the page; the API reads it back.
    console.click('button[data-tab="timers"]')
    console.type('input[data-timer="autostop"]', "45")
    console.click('tr[data-timer="autostop"] button.set')
    console.wait(lambda: console.find('tr[data-timer="autostop"] td.now').text == "45", message="timer not shown")
    assert cove.request("GET", f"/sandbox/{sandbox_id}").json()["autoStopInterval"] == 45
    console.photograph("sandbox-timers")

    # Delete, from the list, after the page's own question.
    console.click('#nav a[data-nav="sandboxes"]')
    console.click(f'#sandboxes tr[data-name="{name}"] button[data-action="delete"]')
    console.click("#confirm-ok")
    console.wait(lambda: not console.all(f'#sandboxes tr[data-name="{name}"]'), message="the row stayed")
    assert cove.request("GET", f"/sandbox/{sandbox_id}").status_code == 404
    assert console.still_marked(), "the page was reloaded along the way"


def test_a_vm_forked_from_the_menu_shows_its_child_in_the_fork_tree(
    console: Console, cove: CoveServer, sandboxes: SandboxFactory
) -> None:
    if vm_assets() is None:
        pytest.skip("COVE_TEST_VM_ASSETS is not set (scripts/vm-assets)")
    console.sign_in(cove.api_key)
    console.wait(lambda: console.find("#live").text == "live", message="the live feed never connected")
    console.mark()
    name = unique("dash-vm")
    console.click("#create-open")
    console.type("#create-name", name)
    console.find("#create-class").send_keys("linux-vm")
    console.click("#create-submit")
    console.wait_row_state(name, "started", VM_WAIT_S)
    parent_id = console.attribute(f'#sandboxes tr[data-name="{name}"]', "data-id")
    sandboxes.track(parent_id)
    assert console.text(f'#sandboxes tr[data-name="{name}"] td.class') == "linux-vm"

    before = cove.sandbox_ids()
    console.click(f'#sandboxes tr[data-name="{name}"] button[data-action="menu"]')
    console.photograph("sandbox-menu")
    console.click('.menu button[data-menu="fork"]')
    child_id = console.wait(lambda: next(iter(cove.sandbox_ids() - before), None), VM_WAIT_S, "no child was made")
    sandboxes.track(child_id)
    # The child's row comes in over the live feed.
    console.wait(lambda: console.all(f'#sandboxes tr[data-id="{child_id}"]'), message="the child's row never showed")

    console.click(f'#sandboxes tr[data-name="{name}"] a.name')
    console.click('button[data-tab="forks"]')
    console.shown("#fork-tree")
    console.wait(lambda: console.all(f'#fork-tree li[data-id="{parent_id}"] li[data-id="{child_id}"]'),
                 VM_WAIT_S, "the child is not under its parent in the fork tree")
    assert console.attribute(f'#fork-tree li[data-id="{parent_id}"]', "class") == "current"
    console.photograph("sandbox-fork-tree")

    # The other pages: each loads from the API and shows what it holds.
    for page, element in (("snapshots", "table.list"), ("volumes", "table.list"),
                          ("registries", "table.list"), ("usage", "#bill-total")):
        console.click(f'#nav a[data-nav="{page}"]')
        console.shown(element)
        console.photograph(f"page-{page}")
    assert "Running sandboxes" in console.text("#usage")
    assert console.still_marked(), "the page was reloaded along the way"
    for sid in (child_id, parent_id):
        cove.request("DELETE", f"/sandbox/{sid}")
