"""Images over HTTP on a tiny random Gemma 3: image_url parts in chat completions, input_image in
Responses and image blocks in Messages give LLM.chat's tokens (which equal transformers', see
tests/multimodal/test_gemma3_images.py); URLs only from allowed hosts, no redirect elsewhere;
every bad image a 400 naming its part, and the server goes on serving."""
from __future__ import annotations

import base64
import contextlib
import http.server
import io
import threading
from types import SimpleNamespace
from typing import Iterator

import httpx
import pytest
from PIL import Image

from dabba import LLM, SamplingParams
from dabba.config import ServerConfig
from tests.entrypoints.live_server import live_server
from tests.multimodal.test_gemma3_images import CHAT_TEXTS, data_url, images, tiny_gemma3

MODEL = "gemma3-tiny"
CONFIG = ServerConfig(allowed_media_domains="127.0.0.1", max_image_pixels=200 * 200, media_fetch_timeout=5)


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


@contextlib.contextmanager
def image_host(routes: dict[str, tuple[int, dict[str, str], bytes]]) -> Iterator[str]:
    """A loopback HTTP server answering each path with (status, headers, body)."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            status, headers, body = routes.get(self.path, (404, {}, b""))
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tiny_gemma3(tmp_path_factory.mktemp("gemma3_api"))
    first, second = images(2)
    parts = [{"type": "text", "text": CHAT_TEXTS[0]}, {"type": "image_pil", "image_pil": first},
             {"type": "text", "text": CHAT_TEXTS[1]}, {"type": "image_pil", "image_pil": second},
             {"type": "text", "text": CHAT_TEXTS[2]}]
    (expected,) = LLM(str(path), dtype="float32").chat([{"role": "user", "content": parts}],
                                                       SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                                                       use_tqdm=False)
    with live_server(str(path), MODEL, None, config=CONFIG, limit_mm_per_prompt={"image": 2}) as (url, engine):
        with httpx.Client(base_url=url, timeout=60) as client:
            yield SimpleNamespace(client=client, engine=engine, expected=expected, first=first, second=second)


def chat_parts(first_url: str, second_url: str) -> list[dict]:
    return [{"type": "text", "text": CHAT_TEXTS[0]}, {"type": "image_url", "image_url": {"url": first_url}},
            {"type": "text", "text": CHAT_TEXTS[1]}, {"type": "image_url", "image_url": {"url": second_url}},
            {"type": "text", "text": CHAT_TEXTS[2]}]


def chat(served, content, **extra) -> httpx.Response:
    return served.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
        **extra})


def test_chat_responses_and_messages_take_images(served) -> None:
    expected = served.expected
    r = chat(served, chat_parts(data_url(served.first), data_url(served.second)))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == expected.outputs[0].text
    assert body["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)

    r = served.client.post("/v1/responses", json={"input": [{"role": "user", "content": [
        {"type": "input_text", "text": CHAT_TEXTS[0]}, {"type": "input_image", "image_url": data_url(served.first)},
        {"type": "input_text", "text": CHAT_TEXTS[1]}, {"type": "input_image", "image_url": data_url(served.second)},
        {"type": "input_text", "text": CHAT_TEXTS[2]}]}], "max_output_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["output"][-1]["content"][0]["text"] == expected.outputs[0].text

    def block(image: Image.Image) -> dict:
        return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": base64.b64encode(png(image)).decode()}}

    r = served.client.post("/v1/messages", json={"model": MODEL, "max_tokens": 6, "temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "text", "text": CHAT_TEXTS[0]}, block(served.first),
                                     {"type": "text", "text": CHAT_TEXTS[1]}, block(served.second),
                                     {"type": "text", "text": CHAT_TEXTS[2]}]}]})
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["text"] == expected.outputs[0].text


def test_image_urls_from_an_allowed_host_only(served) -> None:
    """127.0.0.1 is allowed: its images are fetched (the same tokens as data: URLs); a redirect to
    another host name, a 404, a host not allowed and file:// are 400s naming the part."""
    routes = {"/a.png": (200, {"Content-Type": "image/png"}, png(served.first)),
              "/b.png": (200, {"Content-Type": "image/png"}, png(served.second))}
    with image_host(routes) as base:
        routes["/elsewhere"] = (302, {"Location": base.replace("127.0.0.1", "localhost") + "/a.png"}, b"")
        routes["/same-host"] = (302, {"Location": "/b.png"}, b"")
        r = chat(served, chat_parts(f"{base}/a.png", f"{base}/same-host"))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == served.expected.outputs[0].text
        for url, message in ((f"{base}/elsewhere", "redirects to another host"), (f"{base}/missing.png", "HTTP 404"),
                             (base.replace("127.0.0.1", "localhost") + "/a.png", "takes image URLs from 127.0.0.1"),
                             ("file:///etc/passwd", "not file URLs")):
            r = chat(served, chat_parts(url, data_url(served.second)))
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "messages.0.content.1.image_url" and message in error["message"], error


TRUNCATED = "data:image/png;base64," + base64.b64encode(png(images(1)[0])[:80]).decode()  # its header, then cut


@pytest.mark.parametrize("content, param, message", [
    (chat_parts(TRUNCATED, TRUNCATED), "messages.0.content.1.image_url", "corrupt"),
    (chat_parts("data:text/plain;base64,aGk=", "data:image/png;base64,aGk="), "messages.0.content.1.image_url",
     "not an image"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!"}}], "messages.0.content.0.image_url",
     "base64"),
    ([{"type": "audio_url", "audio_url": {"url": "x"}}], "messages", "text or image_url"),
])
def test_bad_images_are_400s_naming_the_part(served, content, param, message) -> None:
    r = chat(served, content)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert chat(served, "still there?").status_code == 200


def test_limits_on_pixels_and_images_per_prompt(served) -> None:
    big = Image.new("RGB", (300, 300), (10, 20, 30))
    r = chat(served, chat_parts(data_url(big), data_url(served.second)))
    assert r.status_code == 400 and "at most 40000 pixels" in r.json()["error"]["message"]
    three = chat_parts(data_url(served.first), data_url(served.second)) + [
        {"type": "image_url", "image_url": {"url": data_url(served.first)}}]
    r = chat(served, three)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages" and "at most 2" in r.json()["error"]["message"]
    r = served.client.post("/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/tiff",
                                                                  "data": "AAAA"}}]}]})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert chat(served, "still there?").status_code == 200


def test_qwen2_5_vl_over_http(tmp_path) -> None:
    """Qwen2.5-VL's images (each its own number of tokens) in chat completions give LLM.chat's
    tokens; an image its processor refuses (a 201:1 strip) is a 400 naming the part."""
    from tests.multimodal.test_qwen2_5_vl import tiny_qwen2_5_vl

    path = tiny_qwen2_5_vl(tmp_path / "qwen")
    first, second = images(2)
    parts = [{"type": "image_pil", "image_pil": first}, {"type": "image_pil", "image_pil": second},
             {"type": "text", "text": "Which is brighter?"}]
    (expected,) = LLM(str(path), dtype="float32").chat([{"role": "user", "content": parts}],
                                                       SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                                                       use_tqdm=False)
    with live_server(str(path), MODEL, None, config=CONFIG) as (url, _), httpx.Client(base_url=url, timeout=60) as client:
        served = SimpleNamespace(client=client)
        r = chat(served, [{"type": "image_url", "image_url": {"url": data_url(first)}},
                          {"type": "image_url", "image_url": {"url": data_url(second)}},
                          {"type": "text", "text": "Which is brighter?"}])
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == expected.outputs[0].text
        assert r.json()["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
        r = chat(served, [{"type": "image_url", "image_url": {"url": data_url(Image.new("RGB", (2010, 10)))}}])
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content.0.image_url", r.text
        assert "aspect ratio" in r.json()["error"]["message"]
