"""Images by URL, for servers whose operator allows it (--allowed-media-domains): http(s) only, to
the named hosts only, within a byte bound and a time bound, with no redirect to another host (a
redirect could lead an allowed host's URL to the server's own network). Anything else is an
InvalidRequest naming the part."""
from __future__ import annotations

import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from dabba.errors import InvalidRequest

CHUNK = 64 * 2**10


@dataclass(frozen=True)
class UrlPolicy:
    """Where images may come from: ``allowed_domains`` (exact host names; empty: no URL at all),
    each fetched within ``timeout`` seconds in all."""

    allowed_domains: tuple[str, ...] = ()
    timeout: float = 10.0

    def check(self, url: str, field: str) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https"):
            raise InvalidRequest(field, f"{field}: images come as data: URLs, or http(s) URLs where the server "
                                        f"allows them, not {parsed.scheme or 'a relative'} URLs")
        host = (parsed.hostname or "").lower()
        if host not in self.allowed_domains:
            allowed = (f"this server takes image URLs from {', '.join(self.allowed_domains)} only"
                       if self.allowed_domains else "this server takes no image URLs (--allowed-media-domains)")
            raise InvalidRequest(field, f"{field}: {host or 'a URL without a host'}: {allowed}; send the image as "
                                        "a base64 data: URL")

    def fetch(self, url: str, field: str, max_bytes: int) -> bytes:
        self.check(url, field)
        opener = urllib.request.build_opener(_SameHostRedirects(url, field))
        deadline = time.monotonic() + self.timeout
        try:
            with opener.open(urllib.request.Request(url, headers={"User-Agent": "dabba"}), timeout=self.timeout) as r:
                declared = r.headers.get("Content-Length")
                if declared is not None and declared.isdigit() and int(declared) > max_bytes:
                    raise InvalidRequest(field, f"{field}: the image is {declared} bytes; at most {max_bytes}")
                data = bytearray()
                while chunk := r.read(CHUNK):
                    data += chunk
                    if len(data) > max_bytes:
                        raise InvalidRequest(field, f"{field}: the image is over {max_bytes} bytes")
                    if time.monotonic() > deadline:
                        raise InvalidRequest(field, f"{field}: fetching the image took over {self.timeout:g} s")
                return bytes(data)
        except InvalidRequest:
            raise
        except urllib.error.HTTPError as e:
            raise InvalidRequest(field, f"{field}: fetching the image failed: HTTP {e.code}") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            raise InvalidRequest(field, f"{field}: fetching the image failed: {reason}") from None


class _SameHostRedirects(urllib.request.HTTPRedirectHandler):
    def __init__(self, url: str, field: str) -> None:
        self.origin = urllib.parse.urlsplit(url)
        self.field = field

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 (urllib's signature)
        target = urllib.parse.urlsplit(urllib.parse.urljoin(req.full_url, newurl))
        if (target.scheme, target.hostname) != (self.origin.scheme, self.origin.hostname):
            raise InvalidRequest(self.field, f"{self.field}: the image URL redirects to another host "
                                             f"({target.hostname}); give its final URL")
        return super().redirect_request(req, fp, code, msg, headers, newurl)
