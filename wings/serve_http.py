"""serve_http.py: the HTTP/1.1 transport of serve.py: one asyncio event loop, in a background
thread, reads every connection, and each answer is JSON or a stream of server-sent events (a wing
of serve.py's).

Why asyncio: a connection is a coroutine, not a thread, so 64 agents that each keep a connection
open cost no threads, and a request waiting for the engine holds nothing but its coroutine. What the
transport promises (each one a test in tests/test_serve.py):
  - a burst of connections is accepted: the listening socket's backlog is BACKLOG (the kernel caps
    it at net.core.somaxconn), not http.server's 5;
  - keep-alive (HTTP/1.1's default, and what OpenAI's and Anthropic's clients use); a request
    refused before its body was read (401, 404, 405) has its body read and dropped, so the next
    request on the connection is parsed from its first byte (a body over DRAIN_BYTES, or one without
    a Content-Length, closes the connection instead);
  - a body that stops arriving (a Content-Length longer than what is sent) is answered 408 and the
    connection closed after body_timeout_s without a byte; a connection idle between requests is
    closed after idle_timeout_s;
  - every error is a JSON body (RequestError.body: OpenAI's error object, or Anthropic's on its
    endpoint), never an HTML page; an exception in a handler is a 500 and the server goes on;
  - a streamed answer goes out with chunked encoding; a client that leaves mid-stream (a failed
    write, or the end of its side of the connection) stops the stream: the handler's generator is
    closed (GeneratorExit), and Request.gone() tells a waiting handler that its client left.
Only what OpenAI-style clients send is read: Content-Length bodies (a chunked request body is
refused with 411), `Expect: 100-continue` answered. No TLS: put the server behind a proxy to
expose it.

Imports: none of our files (asyncio, json and the standard library).
"""

import asyncio
import json
import threading
import urllib.parse
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import AsyncIterator, Awaitable, Callable

BACKLOG = 1024  # connections the kernel queues before accept (http.server: 5)
DRAIN_BYTES = 64 << 20  # a body refused before it was read is read and dropped up to this size
MAX_HEAD_BYTES = 64 << 10  # request line + headers
CHUNK = 1 << 16

# the error object's `code`: OpenAI puts a category string there (openai.BadRequestError.code),
# not the status
CODES = {
    400: "invalid_request",
    401: "invalid_api_key",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    411: "length_required",
    413: "request_too_large",
    431: "headers_too_large",
    500: "server_error",
}
# Anthropic's error types (https://docs.anthropic.com/en/api/errors), by status
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    500: "api_error",
}


async def within(awaitable, seconds: float):
    """await it, or asyncio.TimeoutError after `seconds`: asyncio.timeout (Python 3.11) only arms a
    timer, where wait_for also wraps the read in a task of its own, a cost paid on every request of
    every connection."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(seconds):
            return await awaitable
    return await asyncio.wait_for(awaitable, seconds)


class RequestError(Exception):
    """A bad request: answered with `status` and OpenAI's error object ({"error": {"message",
    "type", "param", "code"}}; code: a specific reason such as context_length_exceeded, else CODES'
    category), or Anthropic's ({"type": "error", "error": {"type", "message"}}) when `dialect` is
    "anthropic". close: the connection cannot go on (the body was not read)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
        close: bool = False,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.close = (
            status,
            message,
            param,
            kind,
            close,
        )
        self.code = code or CODES.get(status, "error")
        self.dialect = "openai"

    def body(self) -> dict:
        if self.dialect == "anthropic":
            kind = ANTHROPIC_TYPES.get(
                self.status, "invalid_request_error" if self.status < 500 else "api_error"
            )
            return {"type": "error", "error": {"type": kind, "message": self.message}}
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


class ClientGone(Exception):
    """The client closed its connection while its request was being served."""


@dataclass
class Stream:
    """A streamed answer: `events` yields the bytes of each server-sent event; `content_type` its
    media type."""

    events: AsyncIterator[bytes]
    content_type: str = "text/event-stream"


@dataclass(eq=False)
class Request:
    """One request: its head parsed; the body read on demand (body(), json())."""

    method: str
    path: str  # without the query string
    query: dict  # {name: [values]}
    version: str  # "HTTP/1.1"
    headers: dict  # lower-cased names
    reader: asyncio.StreamReader = field(repr=False)
    writer: asyncio.StreamWriter = field(repr=False)
    body_timeout_s: float = 5.0
    body_read: bool = False

    def header(self, name: str, default=None):
        return self.headers.get(name.lower(), default)

    @property
    def keep_alive(self) -> bool:
        connection = self.header("connection", "").lower()
        return (
            "close" not in connection if self.version == "HTTP/1.1" else "keep-alive" in connection
        )

    def gone(self) -> bool:
        """Whether the client has closed its side of the connection (nothing pipelined after
        the request)."""
        return self.reader.at_eof() or self.writer.is_closing()

    def _length(self) -> int:
        if self.header("transfer-encoding"):
            raise RequestError(
                411, "send the body with a Content-Length (chunked bodies are not read)", close=True
            )
        try:
            return int(self.header("content-length", ""))
        except ValueError:
            raise RequestError(411, "a Content-Length header is required", close=True) from None

    async def body(self, limit: int) -> bytes:
        """The body, at most `limit` bytes, or a RequestError: 411 (no Content-Length), 413 (too
        long: left unread, the transport drains it), 408 (it stopped arriving: the connection
        is closed)."""
        size = self._length()
        if size < 0 or size > limit:
            raise RequestError(413, f"the body has {size} bytes; at most {limit} are read")
        if self.header("expect", "").lower() == "100-continue":
            self.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        data = await self._read(size)
        self.body_read = True
        return data

    async def json(self, limit: int) -> dict:
        try:
            body = json.loads(await self.body(limit))
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            raise RequestError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise RequestError(400, "the body must be a JSON object")
        return body

    async def _read(self, size: int) -> bytes:
        parts, left = [], size
        while left > 0:
            try:
                chunk = await within(self.reader.read(min(left, CHUNK)), self.body_timeout_s)
            except asyncio.TimeoutError:
                self.body_read = True  # as far as it will be: the connection closes
                raise RequestError(
                    408,
                    f"the body stopped arriving: {size - left} of {size} bytes (Content-Length) "
                    f"came, then nothing for {self.body_timeout_s:g} s",
                    close=True,
                ) from None
            if not chunk:
                raise ClientGone()
            parts.append(chunk)
            left -= len(chunk)
        return b"".join(parts)

    async def discard(self) -> bool:
        """Read and drop a body that was not read (a refused request, even one whose connection
        closes: a client still sending would otherwise get a reset, not the answer) -> whether the
        connection can go on."""
        if (
            self.body_read
            or self.header("content-length") is None
            and self.header("transfer-encoding") is None
        ):
            return True  # read, or none sent
        try:
            size = self._length()
            if size < 0 or size > DRAIN_BYTES:
                return False
            await self._read(size)
        except (RequestError, ClientGone):
            return False
        self.body_read = True
        return True


Handler = Callable[[Request], Awaitable[dict | Stream]]


class HTTPServer:
    """Serve `handle` (an async function: Request -> a JSON-able dict, or a Stream; a RequestError
    for an error answer) on host:port from an event loop in a background thread. start() -> (host,
    port); stop()."""

    def __init__(
        self,
        handle: Handler,
        host: str = "127.0.0.1",
        port: int = 0,
        body_timeout_s: float = 5.0,
        idle_timeout_s: float = 600.0,
    ):
        self.handle, self.host, self.port = handle, host, port
        self.body_timeout_s, self.idle_timeout_s = body_timeout_s, idle_timeout_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self.connections: set[asyncio.Task] = set()

    def start(self) -> tuple[str, int]:
        self.loop = asyncio.new_event_loop()
        started: dict = {}
        ready = threading.Event()

        def run():
            asyncio.set_event_loop(self.loop)
            try:
                started["server"] = self.loop.run_until_complete(
                    asyncio.start_server(
                        self._connection,
                        self.host,
                        self.port,
                        backlog=BACKLOG,
                        limit=MAX_HEAD_BYTES,
                    )
                )
            except BaseException as e:  # the port is taken: raised in start()'s caller
                started["error"] = e
                ready.set()
                return
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, name="http", daemon=True)
        self.thread.start()
        ready.wait()
        if "error" in started:
            raise started["error"]
        self.server = started["server"]
        return self.server.sockets[0].getsockname()[:2]

    def stop(self):
        async def shutdown():
            self.server.close()
            for task in list(self.connections):
                task.cancel()
            await asyncio.gather(*self.connections, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()

    def run(self, fn, *args):
        """fn(*args) on the event loop's thread (thread-safe): how the engine thread hands
        results over."""
        self.loop.call_soon_threadsafe(fn, *args)

    # -- connections
    # ---------------------------------------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.connections.add(asyncio.current_task())
        try:
            while True:
                request = await self._head(reader, writer)
                if request is None or not await self._serve(request):
                    break
        except (ConnectionError, ClientGone, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the client left, or the server stops: nobody to answer
        finally:
            self.connections.discard(asyncio.current_task())
            writer.close()

    async def _head(self, reader, writer) -> Request | None:
        """The next request's line and headers, or None: the client closed the connection, was idle
        too long, or sent a malformed head (answered 400 or 431 first)."""
        try:
            head = await within(reader.readuntil(b"\r\n\r\n"), self.idle_timeout_s)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError):
            return None
        except asyncio.LimitOverrunError:
            await self._answer(
                writer, 431, RequestError(431, "the request head is too long").body(), close=True
            )
            return None
        lines = head.decode("latin-1").lstrip("\r\n").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            await self._answer(
                writer,
                400,
                RequestError(400, f"bad request line {lines[0][:100]!r}").body(),
                close=True,
            )
            return None
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        url = urllib.parse.urlsplit(parts[1])
        return Request(
            parts[0].upper(),
            url.path,
            urllib.parse.parse_qs(url.query),
            parts[2],
            headers,
            reader,
            writer,
            self.body_timeout_s,
        )

    async def _serve(self, request: Request) -> bool:
        """Answer one request -> whether the connection can go on."""
        close = not request.keep_alive
        try:
            payload, status = await self.handle(request), 200
        except RequestError as e:
            payload, status, close = e.body(), e.status, close or e.close
        except ClientGone:
            return False
        except Exception as e:  # a bug or an engine failure: say so, keep serving
            payload, status = (
                RequestError(500, f"{type(e).__name__}: {e}", kind="server_error").body(),
                500,
            )
        if isinstance(payload, Stream):
            return await self._stream(request.writer, payload, close) and not close
        if not await request.discard():  # a refused request's body: read and dropped, or close
            close = True
        # a HEAD request gets the head alone (Claude Code sends HEAD / to open a connection)
        head_only = request.method == "HEAD"
        await self._answer(request.writer, status, payload, close, head_only)
        return not close

    @staticmethod
    def _head_bytes(status: int, headers: dict) -> bytes:
        lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}"] + [
            f"{k}: {v}" for k, v in headers.items()
        ]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def _answer(self, writer, status: int, payload: dict, close: bool, head_only=False):
        data = json.dumps(payload).encode()
        headers = {"Content-Type": "application/json", "Content-Length": len(data)}
        if close:
            headers["Connection"] = "close"
        writer.write(self._head_bytes(status, headers) + (b"" if head_only else data))
        await writer.drain()

    async def _stream(self, writer, stream: Stream, close: bool) -> bool:
        """Write a stream with chunked encoding -> whether it was written to its end."""
        headers = {
            "Content-Type": stream.content_type,
            "Cache-Control": "no-cache",
            "Transfer-Encoding": "chunked",
        }
        if close:
            headers["Connection"] = "close"
        writer.write(self._head_bytes(200, headers))
        try:
            async for event in stream.events:
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return True
        except (ConnectionError, ClientGone):
            return False
        finally:
            await stream.events.aclose()  # the handler's generator: cancel what it waits for
