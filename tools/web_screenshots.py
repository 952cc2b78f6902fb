"""Screenshots of the playground and the dashboard for the README: `dabba serve` of the demo model
on a free port (tools/reliability's ServerProcess), Debian's Chromium through Playwright (scripts/browser.sh installs it), a chat in
the playground with a token's alternatives on show, and the dashboard under a load.

    python -m tools.web_screenshots [--out docs] [--model dabba/assets/demo]
"""
from __future__ import annotations

import argparse
import shutil
import threading
import time
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

from dabba.config import ServerConfig
from tools.reliability.server import ServerProcess

QUESTION = "What does a list comprehension do?"
# A shared opening (its blocks shared by the running requests, then left as cached prefix), then
# each prompt its own.
PREAMBLE = ("Python is a programming language that lets you work quickly and integrate systems more "
            "effectively. Its standard library covers files, text, numbers, dates and the network. ")
LOAD = [PREAMBLE + start for start in ("The list type", "A dictionary maps", "Modules are", "The with statement",
                                       "Exceptions are", "A generator", "The os module", "Strings are")] * 6


def shoot(url: str, out: Path, chromium: str) -> None:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_context(viewport={"width": 1280, "height": 820}).new_page()
        page.goto(url + "/")
        page.wait_for_function("document.getElementById('model').textContent === 'demo'")
        page.fill("#system", "You answer questions about Python in a sentence or two.")
        page.fill("#max-tokens", "80")
        page.fill("#seed", "7")
        page.fill("#input", QUESTION)
        page.click("#send")
        reply = page.wait_for_selector(".msg.assistant[data-done]", timeout=120_000)
        tokens = reply.query_selector_all(".tok")
        tokens[min(6, len(tokens) - 1)].hover()
        page.screenshot(path=str(out / "playground.png"))

        dashboard = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
        dashboard.goto(url + "/dashboard")
        dashboard.wait_for_function("document.getElementById('running').textContent === '0'")
        load = threading.Thread(target=lambda: httpx.post(
            f"{url}/v1/completions", timeout=600,
            json={"model": "demo", "prompt": LOAD, "max_tokens": 300, "ignore_eos": True}))
        load.start()
        dashboard.wait_for_function("Number(document.getElementById('running').textContent) >= 8")
        time.sleep(1.5)  # some throughput on the chart, the load still running
        dashboard.screenshot(path=str(out / "dashboard.png"))
        load.join()
        browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="docs", help="directory for playground.png and dashboard.png")
    parser.add_argument("--model", default="dabba/assets/demo")
    args = parser.parse_args()
    chromium = shutil.which("chromium")
    if chromium is None:
        raise SystemExit("no chromium on PATH: scripts/browser.sh installs Debian's")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # a KV cache of a few hundred blocks, for a grid whose cells show
    server = ServerProcess.start(args.model, ServerConfig(), None,
                                 ["--served-model-name", "demo", "--kv-cache-memory", "40MiB"])
    try:
        shoot(server.url, out, chromium)
    finally:
        server.stop(60)
    print(f"wrote {out / 'playground.png'} and {out / 'dashboard.png'}")


if __name__ == "__main__":
    main()
