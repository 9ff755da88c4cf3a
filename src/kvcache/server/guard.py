"""uvicorn's HTTP/1.1 protocol with a deadline on request heads (a slowloris defence).

uvicorn calls the app only once a request's line and headers are complete, and times out only an
idle keep-alive connection, so a client that opens a connection and sends its headers a byte at a
time (or stops half-way) holds a socket and a protocol object for as long as it likes.
``GuardedH11`` closes a connection whose request head is not complete within ``HEAD_TIMEOUT_S``
of its first byte (or of the connection). A body that stalls once the head is in is the app's
to time out (server/intake.py: ``--body-timeout``).

Locking: none; everything here runs on the event loop.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_TIMEOUT_S = 10.0


class GuardedH11(H11Protocol):
    head_timeout_s = HEAD_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._between_requests():
            self._arm()  # a new head begins (after keep-alive idling): it must complete in time
        super().data_received(data)
        if not self._between_requests():
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_too_slow)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self._between_requests() and not self.transport.is_closing():
            self.transport.close()
