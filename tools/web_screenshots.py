"""Screenshots of the playground and the dashboard for the README: `dabba serve` of the demo model
on a free port, Debian's Chromium through Playwright (scripts/browser.sh installs it), a chat in
the playground with a token's alternatives on show, and the dashboard under a load.

    python -m tools.web_screenshots [--out docs] [--model dabba/assets/demo]
"""
from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

QUESTION = "What does a list comprehension do?"
# A shared opening (its blocks shared by the running requests, then left as cached prefix), then
# each prompt its own.
PREAMBLE = ("Python is a programming language that lets you work quickly and integrate systems more "
            "effectively. Its standard library covers files, text, numbers, dates and the network. ")
LOAD = [PREAMBLE + start for start in ("The list type", "A dictionary maps", "Modules are", "The with statement",
                                       "Exceptions are", "A generator", "The os module", "Strings are")] * 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"dabba serve exited with status {server.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("dabba serve did not become healthy in 300 s")


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
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "dabba.entrypoints.cli", "serve", args.model,
                               "--served-model-name", "demo", "--port", str(port),
                               "--kv-cache-memory", "40MiB"])  # a grid of a few hundred blocks
    try:
        wait_healthy(url, server)
        shoot(url, out, chromium)
    finally:
        server.terminate()
        server.wait(timeout=60)
    print(f"wrote {out / 'playground.png'} and {out / 'dashboard.png'}")


if __name__ == "__main__":
    main()
