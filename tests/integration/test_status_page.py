"""The gateway's /status page in real headless Chromium, following a live request."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service as ChromeService
from selenium.webdriver.support.ui import WebDriverWait

from canteen.tools.up.state import ChildState, SuiteState
from canteen.v1 import inference_pb2
from tests.integration.conftest import NUM_KV_BLOCKS, TinySuite

REQUEST_ID = "status-page-probe"
ROW = f'tr.seq[data-request-id="{REQUEST_ID}"]'


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.fail("chromium and chromedriver are needed: `make system-deps` installs them")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1100,900",
    ):
        options.add_argument(flag)
    chrome = webdriver.Chrome(options=options, service=ChromeService(executable_path=driver))
    try:
        yield chrome
    finally:
        chrome.quit()


# Read in one script: the page rebuilds its DOM on every refresh, so elements found in one
# call may be gone in the next.
_SNAPSHOT = """
const row = document.querySelector(arguments[0]);
return {
  row: row ? [...row.querySelectorAll("td")].map(td => td.textContent) : null,
  blocks: document.querySelectorAll(".worker .map i").length,
  used: document.querySelectorAll(".worker .map i.U").length,
  running: (document.querySelector('.worker [data-figure="running"]') || {}).textContent,
};
"""


def _snapshot(browser: webdriver.Chrome) -> dict[str, Any]:
    return dict(browser.execute_script(_SNAPSHOT, ROW))


def _output_tokens(browser: webdriver.Chrome) -> int:
    row = _snapshot(browser)["row"]
    return int(row[3]) if row else -1


def test_status_page_shows_the_live_batch_and_block_map(
    suite: TinySuite, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    browser.get(f"{suite.gateway.http_url}/status?interval=100")
    wait = WebDriverWait(browser, 30, poll_frequency=0.05)
    wait.until(lambda b: _snapshot(b)["blocks"] > 0)
    assert _snapshot(browser)["blocks"] == NUM_KV_BLOCKS

    done = threading.Event()

    def run() -> None:
        request = inference_pb2.GenerateRequest(
            prompt="watch me on the status page", max_tokens=700, ignore_eos=True
        )
        list(suite.inference.Generate(request, metadata=(("x-request-id", REQUEST_ID),)))
        done.set()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        wait.until(lambda b: _output_tokens(b) >= 0)
        first_seen = _output_tokens(browser)
        wait.until(lambda b: _output_tokens(b) > first_seen or done.is_set())
        assert not done.is_set(), "the request ended before the page refreshed"
        snap = _snapshot(browser)
        request_id, phase, _prompt, _output, blocks = snap["row"]
        assert (request_id, phase) == (REQUEST_ID, "decode")
        assert snap["used"] >= int(blocks) > 0  # the map shows at least its blocks
        browser.save_screenshot(str(tmp_path / "status.png"))
    finally:
        thread.join(60)
    # Once it finished the row goes and its blocks are no longer in use.
    wait.until(lambda b: _snapshot(b)["row"] is None)
    wait.until(lambda b: _snapshot(b)["used"] == 0)
    assert _snapshot(browser)["running"] == "running: 0"


_SERVICES = """
return [...document.querySelectorAll("#services tr.child")].map(
  row => [...row.querySelectorAll("td")].map(td => td.textContent));
"""


def test_status_page_lists_the_suite_s_processes_and_their_restarts(
    suite: TinySuite, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    """Under canteen up the gateway reads the launcher's state file (--suite-state)."""
    state_file = tmp_path / "suite.json"
    state = SuiteState(pid=os.getpid(), base_port=1, http_port=7, host="127.0.0.1", insecure=True)
    state.children = [
        ChildState("scheduler", 5002, 5004, pid=41, state="ready"),
        ChildState("worker-0", 5010, 5074, state="backoff", restarts=2, last_exit="exit code 3"),
    ]
    state.write(state_file)
    gateway = suite.suite.start_gateway(
        suite.registry, suite.scheduler, "--suite-state", str(state_file), name="gateway-up"
    )
    try:
        browser.get(f"{gateway.http_url}/status?interval=100")
        wait = WebDriverWait(browser, 30, poll_frequency=0.05)
        wait.until(lambda b: len(b.execute_script(_SERVICES)) == 2)
        assert browser.execute_script(_SERVICES) == [
            ["scheduler", "ready", "41", "5002", "0", "-"],
            ["worker-0", "backoff", "-", "5010", "2", "exit code 3"],
        ]
        # The supervisor starts it again: the page follows the file.
        state.children[1].state, state.children[1].pid, state.children[1].restarts = (
            "ready",
            43,
            3,
        )
        state.write(state_file)
        wait.until(
            lambda b: b.execute_script(_SERVICES)[1][:5] == ["worker-0", "ready", "43", "5010", "3"]
        )
    finally:
        gateway.terminate()
