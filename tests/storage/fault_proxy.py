"""An S3 proxy in front of SeaweedFS that fails a share of requests the way a bucket under load
does: 500 InternalError, 503 SlowDown, connection resets, replies slower than the client's timeout,
409 ConditionalRequestConflict on conditional PUTs, and conditional PUTs the server applied whose
reply is dropped. Requests are forwarded byte for byte with their Host header, so SigV4 signatures
still verify. Runs its own event loop in a thread; `counts` says what it did."""

from __future__ import annotations

import asyncio
import itertools
import random
import socket
import threading
from collections import Counter

from aiohttp import ClientSession, ClientTimeout, web

HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection", "content-length"}
KINDS = ("500", "503", "reset", "slow")
CONDITIONAL_KINDS = ("409", "lost-reply", "503", "reset")  # claims and renewals: twice the share, mostly their own faults


def _error(status: int, code: str) -> web.Response:
    body = f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>injected</Message></Error>'
    return web.Response(status=status, body=body.encode(), content_type="application/xml")


class FaultProxy:
    def __init__(self, upstream: str, share: float, seed: int = 0, slow_s: float = 2.5):
        self.upstream, self.share, self.slow_s = upstream.rstrip("/"), share, slow_s
        self.rng = random.Random(seed)  # whether a request faults
        # which fault goes round the kinds, so every kind shows up once a few requests faulted
        self._kinds = {False: itertools.cycle(KINDS), True: itertools.cycle(CONDITIONAL_KINDS)}
        self.counts: Counter[str] = Counter()
        self.log: list[tuple] = []  # (method, path, conditional headers, fault) of every request
        self.enabled = True
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="fault-proxy")
        self._thread.start()
        self._ready.wait(10)

    # -- faults ---------------------------------------------------------------------------------
    def _pick(self, conditional: bool) -> str | None:
        if not self.enabled or self.rng.random() >= self.share * (2 if conditional else 1):
            return None
        return next(self._kinds[conditional])

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        conditional = request.method == "PUT" and ("If-Match" in request.headers or "If-None-Match" in request.headers)
        self.counts["requests"] += 1
        self.counts["conditional"] += conditional
        fault = self._pick(conditional)
        if fault:
            self.counts[fault] += 1
        self.log.append((request.method, request.path_qs, dict((k, v) for k, v in request.headers.items() if k.lower().startswith("if-")), fault))
        if fault == "500":
            return _error(500, "InternalError")
        if fault == "503":
            return _error(503, "SlowDown")
        if fault == "409":
            return _error(409, "ConditionalRequestConflict")
        if fault == "reset":
            request.transport.close()
            return web.Response(status=500)  # never reaches the client
        if fault == "slow":
            await asyncio.sleep(self.slow_s)  # past the client's read timeout: it gives up and retries
            return _error(503, "SlowDown")
        status, headers, payload = await self._forward(request, body)
        if fault == "lost-reply":  # the server applied it; the client never hears so
            request.transport.close()
            return web.Response(status=500)
        if request.method == "HEAD":  # no body, but the object's Content-Length
            return web.Response(status=status, headers=headers)
        headers.pop("Content-Length", None)
        return web.Response(status=status, headers=headers, body=payload)

    async def _forward(self, request: web.Request, body: bytes) -> tuple[int, dict[str, str], bytes]:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        async with self._session.request(request.method, self.upstream + request.path_qs, headers=headers, data=body,
                                         allow_redirects=False, auto_decompress=False) as resp:
            payload = await resp.read()
            return resp.status, {k: v for k, v in resp.headers.items() if k.lower() not in HOP or k.lower() == "content-length"}, payload

    # -- the server -----------------------------------------------------------------------------
    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> None:
            self._session = ClientSession(timeout=ClientTimeout(total=60), auto_decompress=False)
            app = web.Application(client_max_size=1 << 30)
            app.router.add_route("*", "/{tail:.*}", self._handle)
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
            self._ready.set()

        self._loop.run_until_complete(start())
        self._loop.run_forever()

    def stop(self) -> None:
        async def down() -> None:
            await self._session.close()
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(down(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
