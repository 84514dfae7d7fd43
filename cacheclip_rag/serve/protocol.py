"""uvicorn's HTTP/1.1 protocol with a header timeout: uvicorn closes idle keep-alive connections, but a
client that sends a request's headers a byte at a time holds its connection (and a slot of
`limit_concurrency`) for as long as it likes. Here a connection whose request headers are not complete
within `header_timeout_s` of its opening, or of the previous response, is closed. And one address may
hold at most `per_client` connections (more are answered 503 and closed at once), so one client's held
connections cannot fill the server's `limit_concurrency` while others wait."""

from __future__ import annotations

import asyncio
from collections import Counter

from uvicorn.protocols.http.h11_impl import H11Protocol


_BODY = (b'{"error": {"message": "too many connections from this address", "type": "rate_limit_error", '
         b'"param": null, "code": "too_many_connections"}}')
_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(_BODY), _BODY))


class TimedH11Protocol(H11Protocol):
    header_timeout_s = 10.0
    per_client = 0  # connections one address may hold (0: no limit)
    open_by_address: Counter = Counter()  # one per server (`timed_protocol`), on its event loop alone

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._cycle_seen = None
        peer = transport.get_extra_info("peername")
        self._address = peer[0] if isinstance(peer, tuple) and peer else None
        if self.per_client and self._address is not None:
            if self.open_by_address[self._address] >= self.per_client:
                self._address = None  # not counted
                transport.write(_REFUSED)
                transport.close()
                return
            self.open_by_address[self._address] += 1
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
        self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.cycle is self._cycle_seen or self.cycle is None:  # no new request's headers arrived
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not None and self.cycle is not self._cycle_seen:  # a request's headers are complete
            self._cycle_seen = self.cycle
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request on this kept-alive connection gets the same time

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        address = getattr(self, "_address", None)
        if address is not None:
            self.open_by_address[address] -= 1
            if self.open_by_address[address] <= 0:
                del self.open_by_address[address]
        super().connection_lost(exc)


def timed_protocol(header_timeout_s: float, per_client: int = 0) -> type[TimedH11Protocol]:
    return type("TimedH11Protocol", (TimedH11Protocol,), {"header_timeout_s": header_timeout_s,
                                                         "per_client": per_client, "open_by_address": Counter()})
