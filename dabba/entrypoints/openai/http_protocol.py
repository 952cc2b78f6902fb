"""The HTTP/1.1 connection of `dabba serve`: uvicorn's h11 protocol with the edges uvicorn lacks.
A client that sends its request head slowly holds a connection (and a file descriptor) for as
long as it likes, and connections are not counted at all, so a handful of slow clients could use
up the process's descriptors; and what uvicorn answers before the app sees a request is plain
text, where every other error of the server is OpenAI's JSON shape.

uvicorn hands a protocol its settings only through uvicorn.Config, so ``protocol_class`` binds
the ServerConfig into a subclass, and run_server.uvicorn_config passes that class as
Config(http=...): the choice never depends on which HTTP parsers are installed.
"""
from __future__ import annotations

import asyncio
import logging
import re
from typing import Any, ClassVar

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol
from uvicorn.server import ServerState

from dabba.config import ServerConfig
from dabba.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("dabba")

# How long a connection answered with an error keeps reading (and dropping) what its client still
# sends after our half-close: closing with unread bytes makes the kernel send a reset, which can
# destroy the answer before the client reads it.
LINGER_SECONDS = 2.0
# Descriptors the process needs besides its connections: the listening socket, model files, logs,
# engine workers' pipes.
FD_HEADROOM = 256

# h11 quotes the client's bytes after the words of some errors, as the repr of bytes or a bytearray.
_QUOTED_BYTES = re.compile(r":? (?:b|bytearray\(b)['\"].*", re.S)


class RecordingConnection(h11.Connection):
    """An h11 connection that keeps the client's last protocol error: uvicorn catches it and drops
    it, and its words are what the 400 tells the client."""

    error: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            return super().next_event()
        except h11.RemoteProtocolError as e:
            self.error = e
            raise


def error_body(message: str, type: str, code: str) -> bytes:
    """OpenAI's error shape, from the same models as the app's errors."""
    return ErrorResponse(error=ErrorInfo(message=message, type=type, param=None, code=code)).model_dump_json().encode()


class DabbaH11Protocol(H11Protocol):
    """One connection. The head deadline runs from the connection, and again from the first byte
    of each later request head, until h11 has the whole head; uvicorn's keep-alive timeout still
    covers the idle time between requests."""

    server_config: ClassVar[ServerConfig] = ServerConfig()

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        size = config.h11_max_incomplete_event_size
        self.max_head_bytes = DEFAULT_MAX_INCOMPLETE_EVENT_SIZE if size is None else size  # as uvicorn's
        self.conn = RecordingConnection(h11.SERVER, self.max_head_bytes)
        self.head_timer: asyncio.TimerHandle | None = None
        self.linger_timer: asyncio.TimerHandle | None = None
        self.refused = False  # answered with an error: what the client still sends is dropped

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        limit = self.server_config.max_connections
        if len(self.connections) > limit:
            self.connections.discard(self)  # not one of the connections the cap counts
            self.logger.warning("Refused a connection: %d are open, the server's --max-connections", limit)
            # Closed at once, not lingering: under this load a descriptor is what is short.
            self.refuse(503, f"the server has {limit} connections open, the most it allows "
                        "(its --max-connections); retry later", "server_error", "too_many_connections", linger=False)
            return
        self.arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        if self.head_timer is None and self.conn.their_state is h11.IDLE:  # a new request head begins
            self.arm_head_timer()
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self.refused:
            return
        if self.conn.their_state is not h11.IDLE:  # h11 has the whole head
            self.cancel_head_timer()
        elif self.head_timer is None and self.conn.trailing_data[0]:
            self.arm_head_timer()  # part of a pipelined head, waiting until the previous response ended

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 cannot parse (its ``msg`` is fixed text): ours gives
        h11's status hint (431 for a head past h11's size, 501 for a transfer coding other than
        chunked, else 400) and its reason, without the client's bytes it quotes."""
        error = self.conn.error
        status = error.error_status_hint if error is not None and 400 <= error.error_status_hint < 600 else 400
        if status == 431:
            message = f"the request line and headers are larger than {self.max_head_bytes} bytes"
        else:
            reason = _QUOTED_BYTES.sub("", str(error or "")).strip()
            if not reason or "state" in reason or "role=" in reason:  # h11's state machine: nothing for the client
                reason = "malformed request"
            message = f"invalid HTTP request: {reason}"
        self.refuse(status, message, "invalid_request_error", "invalid_http_request")

    def refuse(self, status: int, message: str, type: str, code: str, linger: bool = True) -> None:
        """Answer ``status`` in the error shape with ``connection: close`` (unless a response to
        this request has begun: then the connection can only be cut) and end the connection. The
        app's request, if one is running, sees a disconnect, and its writes go nowhere."""
        self.refused = True
        self.cancel_head_timer()
        self._unset_keepalive_if_required()
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):  # h11 allows a response before a request
            head = self.conn.our_state is h11.SEND_RESPONSE and self.scope["method"] == "HEAD"
            body = error_body(message, type, code)
            headers = [*self.server_state.default_headers, (b"content-type", b"application/json"),
                       (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
            output = self.conn.send(h11.Response(status_code=status, headers=headers, reason=STATUS_PHRASES[status]))
            output += self.conn.send(h11.Data(data=b"" if head else body))
            output += self.conn.send(h11.EndOfMessage())
            self.transport.write(output)
        if linger and self.transport.can_write_eof():
            self.flow.resume_reading()
            self.transport.write_eof()  # the client sees the end; its own end (eof_received) closes ours
            self.linger_timer = self.loop.call_later(LINGER_SECONDS, self.transport.close)
        else:
            self.transport.close()

    def arm_head_timer(self) -> None:
        self.cancel_head_timer()
        self.head_timer = self.loop.call_later(self.server_config.timeout_request_head, self.head_timed_out)

    def cancel_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def head_timed_out(self) -> None:
        self.head_timer = None
        if self.refused or self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        seconds = self.server_config.timeout_request_head
        self.logger.warning("A request head did not arrive in full within %g s: answered 408", seconds)
        self.refuse(408, f"the request line and headers did not arrive within {seconds:g} s "
                    "(the server's --timeout-request-head)", "invalid_request_error", "request_timeout")

    def shutdown(self) -> None:
        if self.refused:  # h11 has already ended its side
            self.transport.close()
            return
        super().shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
        self.cancel_head_timer()
        if self.linger_timer is not None:
            self.linger_timer.cancel()
            self.linger_timer = None
        super().connection_lost(exc)


def protocol_class(config: ServerConfig) -> type[DabbaH11Protocol]:
    """DabbaH11Protocol bound to ``config``, for uvicorn.Config(http=...)."""
    return type("DabbaH11Protocol", (DabbaH11Protocol,), {"server_config": config})


def raise_open_file_limit(max_connections: int) -> None:
    """Lift the soft RLIMIT_NOFILE towards the hard one, as vLLM's set_ulimit does: each connection
    holds a descriptor, and a soft limit left low refuses accepts long before --max-connections
    does (the OS refuses them with no answer at all). Warns if the connections still cannot fit."""
    try:
        import resource
    except ImportError:  # no such limit on this platform
        return
    wanted = max_connections + FD_HEADROOM
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinite = resource.RLIM_INFINITY
    if soft == infinite:
        return
    target = max(soft, wanted) if hard == infinite else hard  # "unlimited" is often refused as a soft limit
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            logger.debug("could not raise the open-file limit to %d: %s", target, e)
    if soft < wanted:
        logger.warning("--max-connections %d needs about %d open files, but this process may open only %d "
                       "(ulimit -n): connections past that are refused by the OS without an answer",
                       max_connections, wanted, soft)
