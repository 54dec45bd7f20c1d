"""The operator page in a real browser: Debian's headless Chromium driven by Playwright
(from PyPI, pointed at /usr/bin/chromium: no browser is downloaded), against a real
gateway process with basic-auth users and two real agents (two simulated GPUs each).

The fleet page lists both nodes; typing in the filter hides the other row; clicking a
column sorts; clicking a node opens its page with its two GPUs, its processes and the
charts of its recent values. Without credentials the page is refused. Screenshots of both
pages go to the test's tmp directory (docs/operator-page.png is one, committed by hand).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator
from pathlib import Path

import bcrypt
import httpx
import pytest

from harness.fleet import make_pki
from harness.services import AgentProc, GatewayProc, gateway_toml
from harness.waiting import wait_until

USER, PASSWORD = "operator", "correct horse battery"
NODES = ("edge-ui-a", "edge-ui-b")


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[GatewayProc]:
    """A gateway with a basic-auth user, and two agents whose data has arrived."""
    pki = make_pki(tmp_path)
    web = tmp_path / "web.yml"
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(10)).decode()
    web.write_text(f"basic_auth_users:\n  {USER}: '{hashed}'\n")
    gateway = GatewayProc(pki, tmp_path)
    cfg = gateway.config
    gateway.config = dataclasses.replace(
        cfg, http=dataclasses.replace(cfg.http, web_config_file=web)
    )
    (tmp_path / "gateway.toml").write_text(gateway_toml(gateway.config))
    agents = [
        AgentProc(pki, tmp_path, node, gateway, spool_dir=tmp_path / f"spool-{node}")
        for node in NODES
    ]
    procs = [gateway, *agents]
    try:
        gateway.start()
        wait_until(gateway.ready, 60, "gateway ready", alive=[gateway])
        for agent in agents:
            agent.start()
        auth = httpx.BasicAuth(USER, PASSWORD)

        def charts_drawn() -> bool:  # every node: both GPUs' charts, a few batches in
            for node in NODES:
                page = httpx.get(f"{gateway.url}/ui/nodes/{node}", auth=auth, timeout=10)
                seen = re.search(r"last (\d+) batches", page.text)
                if page.text.count('<svg class="spark') < 4 or not seen or int(seen[1]) < 3:
                    return False
            return True

        wait_until(charts_drawn, 90, "both nodes' charts", alive=procs)
        yield gateway
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_the_operator_page_in_chromium(
    fleet: GatewayProc, chromium_bin: Path, tmp_path: Path
) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    args = ["--disable-dev-shm-usage"]
    if os.geteuid() == 0:  # Chromium refuses to run as root inside its sandbox
        args.append("--no-sandbox")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(chromium_bin), headless=True, args=args)
        try:
            for credentials in (None, {"username": USER, "password": "wrong"}):
                refused = browser.new_context(http_credentials=credentials)
                tab = refused.new_page()
                try:  # no credentials: Chromium gives up; wrong ones: it shows the 401
                    shown = tab.goto(f"{fleet.url}/ui")
                except sync_api.Error as exc:
                    assert "ERR_INVALID_AUTH_CREDENTIALS" in str(exc)
                else:
                    assert shown is not None and shown.status == 401
                    assert "edge-ui" not in tab.content()
                answer = refused.request.get(f"{fleet.url}/ui/nodes/edge-ui-a")
                assert answer.status == 401 and "edge-ui-a" not in answer.text()
                assert "Basic" in answer.headers.get("www-authenticate", "")
                refused.close()

            context = browser.new_context(
                http_credentials={"username": USER, "password": PASSWORD},
                viewport={"width": 1500, "height": 700},
            )
            page = context.new_page()
            errors: list[str] = []
            page.on(
                "console",
                lambda m: (
                    errors.append(f"{m.text} ({m.location.get('url')})")
                    if m.type == "error"
                    else None
                ),
            )
            page.on("pageerror", lambda e: errors.append(str(e)))
            answer = page.goto(f"{fleet.url}/ui")
            assert answer is not None and answer.status == 200
            rows = page.locator("#fleet tbody tr")
            assert rows.count() == 2
            assert page.locator("#fleet tbody tr td:first-child a").all_inner_texts() == list(NODES)
            assert "online" in page.locator("#fleet").inner_text()
            page.screenshot(path=str(tmp_path / "operator-page.png"), full_page=True)

            page.fill("#q", "ui-b")  # the filter, in place
            sync_api.expect(page.locator('tr[data-node="edge-ui-a"]')).to_be_hidden()
            sync_api.expect(page.locator('tr[data-node="edge-ui-b"]')).to_be_visible()
            assert page.locator("#shown").inner_text() == "1"
            page.fill("#q", "")
            sync_api.expect(page.locator('tr[data-node="edge-ui-a"]')).to_be_visible()

            page.click('th a[data-col="name"]')  # sorted by name already: now descending
            names = page.locator("#fleet tbody tr td:first-child a").all_inner_texts()
            assert names == list(reversed(NODES))
            assert page.get_attribute('th:has(a[data-col="name"])', "aria-sort") == "descending"

            page.click('a:text-is("edge-ui-a")')
            page.wait_for_url("**/ui/nodes/edge-ui-a")
            assert page.locator("#gpus tbody tr").count() == 2
            assert page.locator("#processes tbody tr").count() >= 1
            assert page.locator("svg.spark polyline").count() >= 1
            assert page.locator("svg.spark").first.bounding_box() is not None
            page.screenshot(path=str(tmp_path / "operator-node-page.png"), full_page=True)
            page.wait_for_load_state("networkidle")
            # no CSP violation, no script error, no 404 (once in .ci/run, before the page
            # declared its icon: probably /favicon.ico, which Playwright does not report)
            assert errors == []
            context.close()
        finally:
            browser.close()
    assert (tmp_path / "operator-page.png").stat().st_size > 10_000
