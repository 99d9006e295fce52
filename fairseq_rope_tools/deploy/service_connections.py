"""fairseq-rope-serve's connections, as aiohttp's :class:`~aiohttp.web.RequestHandler` serves them,
with what a service facing any client needs on top:

- at most ``max_connections`` open at once: one more is answered 503 (one line of JSON) and
  closed, so that idle clients cannot use up the process' file descriptors;
- a request's head (its line and headers) must come within ``head_timeout`` seconds of the
  connection opening, else the connection is closed: a client that trickles bytes holds nothing
  for long (an idle connection after an answer is closed by aiohttp's ``keepalive_timeout``);
- aiohttp's own refusals of what is not HTTP (a malformed request line, a header too long, ...)
  are one line of JSON and one log line, not text and a traceback.

Each handler is made by :class:`ConnectionGuard` (the protocol factory given to
``loop.create_server``) over the application's aiohttp server (``AppRunner.server``).
"""

import json
import time
from typing import Callable, Dict, Optional

from aiohttp import web

from fairseq_rope_tools.deploy.service_requests import shown

#: the Server header of every answer: the service's name, no versions of what runs it
SERVER_NAME = "fairseq-rope-serve"


def json_error(status: int, message: str, retry_after: Optional[int] = None) -> web.Response:
    """The answer to a refused request: ``{"error": "..."}``, one line."""
    headers = {"Server": SERVER_NAME}
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    return web.json_response({"error": message}, status=status, headers=headers,
                             dumps=lambda value: json.dumps(value, ensure_ascii=False))


def _raw_answer(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP answer with a JSON error, for a connection refused before any request."""
    body = json.dumps({"error": message}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\nServer: {SERVER_NAME}\r\nContent-Type: application/json; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n").encode() + body


class GuardedRequestHandler(web.RequestHandler):
    """aiohttp's handler of one connection, within the guard's limits (module docstring)."""

    def __init__(self, manager, guard: "ConnectionGuard", **kwargs):
        super().__init__(manager, **kwargs)
        self.guard = guard
        self.head_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        guard = self.guard
        if guard.open >= guard.max_connections:
            guard.refused += 1
            guard.note("connections", f"refused a connection: {guard.open} are open, at most "
                                      f"{guard.max_connections} (--max-connections)")
            transport.write(_raw_answer(503, "Service Unavailable", f"the server has {guard.max_connections} "
                                        "connections open (--max-connections): retry later"))
            self.force_close()
            return
        guard.open += 1
        self.head_timer = self._loop.call_later(guard.head_timeout, self._head_too_late)

    def connection_lost(self, exc) -> None:
        if self.head_timer is not None:  # counted as open
            self.head_timer.cancel()
            self.guard.open -= 1
            self.head_timer = None
        super().connection_lost(exc)

    def request_started(self) -> None:
        """The request's head has come: the head timeout no longer applies to this connection."""
        if self.head_timer is not None:
            self.head_timer.cancel()

    def _head_too_late(self) -> None:
        self.guard.timed_out += 1
        late = f"no request within {self.guard.head_timeout:g} s (--head-timeout)"
        self.guard.note("head", f"closed a connection that sent {late}")
        if self.transport is not None:
            self.transport.write(_raw_answer(408, "Request Timeout", f"{late}: send the request at once"))
        self.force_close()

    def handle_error(self, request, status=500, exc=None, message=None):
        """aiohttp's refusal of a request it could not parse, as JSON in one line; the log gets one line."""
        if isinstance(exc, ConnectionError):  # the client went away: the access line said so
            response = json_error(status, "the client went away")
            response.force_close()
            return response
        reason = shown(str(getattr(exc, "message", None) or message or exc or "bad request"), 200)
        self.guard.note("parser", f'{request.remote} refused by the HTTP parser: {status} "{reason}"')
        if request.writer.output_size > 0:  # the answer has begun: nothing more can be said
            raise ConnectionError("the answer has begun; cannot send an error")
        response = json_error(status, f"not a valid HTTP request: {reason}")
        response.force_close()
        return response


class ConnectionGuard:
    """The protocol factory of the service's listening socket: a :class:`GuardedRequestHandler`
    per connection over aiohttp's ``server``, with these limits; ``say`` takes the log lines, at
    most one of a kind every :attr:`NOTE_EVERY` seconds (a flood of clients floods no log)."""

    NOTE_EVERY = 10.0

    def __init__(self, server, say: Callable[[str], None], max_connections: int, head_timeout: float,
                 **handler_options):
        self.server, self.say = server, say
        self.max_connections, self.head_timeout = max_connections, head_timeout
        self.handler_options = handler_options  # RequestHandler's keyword arguments: keepalive_timeout, ...
        self.open = self.refused = self.timed_out = 0
        self.loop = None
        self._noted: Dict[str, float] = {}
        self._unsaid: Dict[str, int] = {}

    def note(self, kind: str, message: str) -> None:
        """``message`` in the log, unless one of its ``kind`` was said within NOTE_EVERY seconds
        (then it is counted, and the next one says how many were not)."""
        now = time.monotonic()
        if now - self._noted.get(kind, -self.NOTE_EVERY) < self.NOTE_EVERY:
            self._unsaid[kind] = self._unsaid.get(kind, 0) + 1
            return
        unsaid = self._unsaid.pop(kind, 0)
        self._noted[kind] = now
        self.say(message + (f" (and {unsaid} more like it since the last such line)" if unsaid else ""))

    def __call__(self) -> GuardedRequestHandler:
        return GuardedRequestHandler(self.server, self, loop=self.loop, **self.handler_options)
