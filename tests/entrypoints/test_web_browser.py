"""The playground and the dashboard in a real browser: Debian's Chromium, headless, driven by
Playwright, against the real server of the demo model. scripts/browser.sh installs Chromium; in CI
its absence fails these tests, elsewhere they skip.

The engine is held at a gate where a test needs it mid-request: once the requests run, steps wait
until the test (or the request's abort) opens it, so what the page shows never depends on how fast
the machine is."""
from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from tests.entrypoints.live_server import live_server

DEMO = Path(__file__).resolve().parents[2] / "dabba" / "assets" / "demo"
API_KEY = "sk-browser"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
KEY_REFUSED = "the server responded with a status of 401"  # the console's line for the key dialog's cause


def chromium() -> str:
    path = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).exists():
        if os.environ.get("CI"):
            pytest.fail("Chromium is missing: scripts/browser.sh installs Debian's chromium")
        pytest.skip("no Chromium here (scripts/browser.sh installs it)")
    return path


class Gate:
    """Once hold(n) is called, the engine waits before a step while n requests are running (so
    after the step that scheduled them), until release() or an abort opens it."""

    def __init__(self, engine, async_engine) -> None:
        self.opened, self.running = threading.Event(), 0
        step, abort = engine.step_with_stats, async_engine.abort

        def gated_step():
            if self.running and len(engine.engine_core.scheduler.running) >= self.running:
                assert self.opened.wait(120), "the gate was never opened"
            return step()

        def abort_and_open(request_id: str) -> None:
            abort(request_id)
            self.opened.set()

        engine.step_with_stats, async_engine.abort = gated_step, abort_and_open

    def hold(self, running: int) -> None:
        self.opened.clear()
        self.running = running

    def release(self) -> None:
        self.running = 0
        self.opened.set()


@pytest.fixture(scope="module")
def server():
    state: dict = {}
    with live_server(str(DEMO), "demo", API_KEY, app_state=state) as (url, engine):
        yield SimpleNamespace(url=url, engine=engine, gate=Gate(engine, state["engine"]))


@pytest.fixture(scope="module")
def browser():
    path = chromium()
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, args=["--no-sandbox"])
        yield browser
        browser.close()


def open_page(browser, url: str):
    """A fresh page (no stored key) and the errors its console reports."""
    page = browser.new_context(viewport={"width": 1280, "height": 860}).new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    return page, errors


def give_key(page) -> None:
    page.wait_for_selector("#api-key-dialog[open]")
    page.fill("#api-key", API_KEY)
    page.click("#api-key-save")


def engine_stats(server) -> dict:
    return httpx.get(f"{server.url}/engine/stats", headers=AUTH, timeout=60).json()


def test_the_playground_streams_a_reply_and_stop_aborts_it(server, browser, tmp_path) -> None:
    page, errors = open_page(browser, server.url + "/")
    give_key(page)  # /v1/models answered 401: the page asks, then loads the model's name
    page.wait_for_function("document.getElementById('model').textContent === 'demo'")
    page.fill("#system", "You answer questions about Python.")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "24")
    page.fill("#input", "What does a list comprehension do?")
    page.click("#send")
    reply = page.wait_for_selector(".msg.assistant[data-done]")
    tokens = reply.query_selector_all(".tok")
    assert tokens and reply.query_selector(".content").inner_text().strip()
    stats = reply.query_selector(".stats").inner_text()
    assert "first token" in stats and "tok/s" in stats and "prefix cache" in stats, stats
    next(t for t in tokens if t.inner_text().strip()).hover()  # the token view: the top alternatives
    assert page.is_visible("#tooltip") and "%" in page.inner_text("#tooltip")
    page.screenshot(path=str(tmp_path / "playground.png"))

    server.gate.hold(1)  # a long reply, held after its first step until the stop aborts it
    page.fill("#max-tokens", "400")
    page.check("#ignore-eos")
    page.fill("#input", "Tell me about dictionaries.")
    page.click("#send")
    page.wait_for_selector(".msg.assistant:last-child .tok")
    page.click("#stop")
    stopped = page.wait_for_selector(".msg.assistant:last-child[data-done]")
    assert "stopped" in stopped.query_selector(".stats").inner_text()
    assert len(stopped.query_selector_all(".tok")) < 400
    assert server.gate.opened.wait(60)  # the abort reached the engine
    server.gate.release()
    stats = engine_stats(server)
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["kv"]["used"] == 0
    assert not page.is_visible("#stop") and page.is_visible("#send")
    assert [e for e in errors if KEY_REFUSED not in e] == []
    assert (tmp_path / "playground.png").stat().st_size > 20_000


def test_the_dashboard_moves_with_a_load_and_returns_to_zero(server, browser, tmp_path) -> None:
    page, errors = open_page(browser, server.url + "/dashboard")
    give_key(page)
    page.wait_for_function("document.getElementById('running').textContent === '0'")
    generated = int(page.inner_text("#generated"))
    server.gate.hold(4)  # the load stops once all 4 run, so the page sees them running
    prompts = ["The list type", "A dictionary maps", "Modules are", "The with statement"]
    load = threading.Thread(target=lambda: httpx.post(
        f"{server.url}/v1/completions", headers=AUTH, timeout=120,
        json={"model": "demo", "prompt": prompts, "max_tokens": 32, "ignore_eos": True}))
    load.start()
    page.wait_for_function("document.getElementById('running').textContent === '4'")
    assert int(page.inner_text("#step-tokens")) >= 4  # a prefill, beside decodes if the requests came apart
    assert int(page.inner_text("#generated")) >= generated + 4  # each prompt's first token at least
    assert int(page.inner_text("#kv-blocks").split()[0]) >= 4  # a block each at least (the grid may lag 250 ms)
    page.screenshot(path=str(tmp_path / "dashboard-load.png"))
    server.gate.release()
    load.join(timeout=120)
    page.wait_for_function(f"document.getElementById('generated').textContent === '{generated + 4 * 32}'")
    page.wait_for_function("document.getElementById('running').textContent === '0'"
                           " && document.getElementById('step-tokens').textContent === '0'")
    assert int(page.inner_text("#kv-used")) == 0 and int(page.inner_text("#kv-cached")) > 0  # prompts stay cached
    page.wait_for_function("document.getElementById('throughput').textContent === '0.0'", timeout=30_000)
    page.screenshot(path=str(tmp_path / "dashboard.png"))
    assert [e for e in errors if KEY_REFUSED not in e] == []
    assert (tmp_path / "dashboard-load.png").stat().st_size > 20_000


def test_the_dashboard_shows_each_data_parallel_replica(browser) -> None:
    with live_server(str(DEMO), "demo", API_KEY, data_parallel_size=2) as (url, engines):
        body = {"model": "demo", "prompt": "hello", "max_tokens": 3, "ignore_eos": True}
        assert httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60).status_code == 200
        page, errors = open_page(browser, url + "/dashboard")
        give_key(page)
        page.wait_for_function("document.getElementById('generated').textContent === '3'")  # the replicas' sum
        assert page.inner_text("#running-sub") == "replicas: 0 · 0"
        assert page.inner_text("#kv-blocks") == "replicas: 0.0% · 0.0%"
        blocks = sum(e.engine_core.kv_cache_manager.num_usable_blocks for e in engines)
        assert page.inner_text("#kv-total") == str(blocks)  # both replicas' grids, one after the other
        assert [e for e in errors if KEY_REFUSED not in e] == []
        page.context.close()  # its stats stream would hold the server's shutdown up to its 30 s bound


def test_the_playground_attaches_images_for_a_vision_language_model(browser, tmp_path) -> None:
    """The Image button's file goes out as an image_url part (a data: URL): the thumbnail shows
    in the user's message, the model's encoder reads it once, and a reply streams."""
    from tests.multimodal.test_gemma3_images import images, tiny_gemma3

    path = tiny_gemma3(tmp_path / "gemma3")
    images(1)[0].save(tmp_path / "picture.png")
    with live_server(str(path), "gemma3-tiny", None) as (url, engine):
        page, errors = open_page(browser, url + "/")
        page.wait_for_function("document.getElementById('model').textContent === 'gemma3-tiny'")
        page.fill("#temperature", "0")
        page.fill("#max-tokens", "4")
        page.set_input_files("#attach-file", str(tmp_path / "picture.png"))
        page.wait_for_selector("#attachments .thumb img")
        page.fill("#input", "What is in the picture?")
        page.click("#send")
        reply = page.wait_for_selector(".msg.assistant[data-done]")
        assert reply.query_selector_all(".tok") and not reply.query_selector(".error")
        assert page.query_selector(".msg.user .images img") is not None and not page.is_visible("#attachments")
        assert engine.get_stats().num_images_encoded == 1
        assert errors == []


def test_the_dashboard_and_playground_pick_among_several_models(browser, checkpoints) -> None:
    from dabba.config import EngineConfig
    from dabba.engine.model_router import ModelRouter, ModelSpec
    from dabba.entrypoints.openai.api_server import build_router_app
    from tests.entrypoints.live_server import serving

    options = dict(dtype="float32", kv_cache_memory=4 * 2**20)
    router = ModelRouter([ModelSpec("demo", EngineConfig.from_kwargs(model=str(DEMO), **options)),
                          ModelSpec("tiny", EngineConfig.from_kwargs(model=str(checkpoints["llama"].path), **options))],
                         2**30)
    loop = threading.Thread(target=router.run_loop, daemon=True)
    loop.start()
    try:
        with serving(build_router_app(router, api_key=API_KEY)) as url:
            body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 5, "ignore_eos": True}
            assert httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60).status_code == 200
            page, errors = open_page(browser, url + "/dashboard")
            give_key(page)
            page.wait_for_selector("#model select")
            assert page.eval_on_selector("#model select", "s => s.value") == "tiny"  # the loaded one
            assert page.eval_on_selector_all("#model option", "os => os.map(o => o.textContent)") == [
                "demo (unloaded)", "tiny (loaded)"]
            page.wait_for_function("document.getElementById('generated').textContent === '5'")  # tiny's engine
            page.select_option("#model select", "demo")  # not loaded: the page says so, and loads nothing
            page.wait_for_function("document.getElementById('status').textContent.includes('not loaded')")
            assert router.entries["demo"].state.value == "unloaded"
            page.context.close()
            page, errors2 = open_page(browser, url + "/?model=demo")
            give_key(page)
            page.wait_for_selector("#model select")
            assert page.eval_on_selector("#model select", "s => s.value") == "demo"
            page.context.close()
            assert [e for e in errors + errors2 if KEY_REFUSED not in e and "409" not in e] == []
    finally:
        router.shutdown()
        loop.join(timeout=30)
