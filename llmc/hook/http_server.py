"""The HTTP server of `llmc hook serve`: waitress, under the limits of the hook config's `server` section.

waitress is a production WSGI server in pure Python; its event loop reads each request whole (headers and body,
both capped in size) before one of its threads sees it, so slow or idle clients hold no thread. `HookServer` adds
what it lacks: a header and a whole-request timeout, and a connection limit that sheds the connection idle longest
rather than refusing new ones, so idle or slow clients cannot lock a registry's deliveries out.
"""

from __future__ import annotations

import time

from waitress.adjustments import Adjustments
from waitress.channel import HTTPChannel
from waitress.server import TcpWSGIServer

from llmc.hook.config import ServerSection
from llmc.telemetry.progress import log

SHED_LOG_INTERVAL_S = 10  # connections shed under load are logged at most this often


class _Channel(HTTPChannel):
    """waitress's connection, remembering when the request it is reading began (for the header/request timeouts)."""

    request_started = 0.0

    def received(self, data: bytes) -> bool:
        if self.request is None:
            self.request_started = time.time()
        return super().received(data)


class HookServer(TcpWSGIServer):
    """waitress's TCP server under the hook's limits. waitress alone stops accepting at its connection limit, so that
    many idle sockets hold every delivery off until its idle timeout closes them; this one always accepts and, past
    the limit, closes the connection that has been idle longest and is not being answered. Timeouts are enforced every second
    (in place of waitress's own idle timeout). It reads waitress's channel attributes (requests, request,
    last_activity): waitress is pinned in pyproject.toml."""

    channel_class = _Channel

    def __init__(self, app, limits: ServerSection, host: str, port: int) -> None:
        self.limits = limits
        self.shed = 0
        self.shed_logged = 0.0
        super().__init__(app, adj=Adjustments(
            host=host, port=port, threads=limits.threads, cleanup_interval=1,  # the timeouts' resolution
            max_request_header_size=limits.max_header_bytes,
            max_request_body_size=limits.max_body_bytes + 1,  # waitress refuses a body of exactly its limit
            asyncore_use_poll=True,  # select() fails on descriptors past 1,023
            expose_tracebacks=False, ident="llmc-hook", log_socket_errors=False))

    def readable(self) -> bool:
        now = time.time()
        if now >= self.next_channel_cleanup:
            self.next_channel_cleanup = now + self.adj.cleanup_interval
            self.maintenance(now)
        return self.accepting  # never paused by the connection limit: handle_accept sheds instead

    def handle_accept(self) -> None:
        super().handle_accept()
        if len(self.active_channels) > self.limits.connection_limit:
            idle = [c for c in self.active_channels.values() if not c.requests and not c.total_outbufs_len]
            min(idle, key=lambda c: c.last_activity).handle_close()  # the newest is idle: never empty
            self.shed += 1
            if time.time() - self.shed_logged > SHED_LOG_INTERVAL_S:
                log(f"hook: more than {self.limits.connection_limit} connections (server.connection_limit): "
                    f"{self.shed} closed so far, idle longest first")
                self.shed_logged = time.time()

    def maintenance(self, now: float) -> None:
        """Close connections idle past idle_timeout_s, or still sending a request's headers past header_timeout_s or
        the whole request past request_timeout_s; never one whose request is being answered."""
        for channel in list(self.active_channels.values()):
            if channel.requests:
                continue
            partial = channel.request
            if partial is None:
                expired = now - channel.last_activity > self.limits.idle_timeout_s
            else:
                limit = self.limits.request_timeout_s if partial.headers_finished else self.limits.header_timeout_s
                expired = now - channel.request_started > limit
            if expired:
                channel.will_close = True
