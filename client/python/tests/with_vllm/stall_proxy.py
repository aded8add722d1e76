"""A TCP proxy for fault tests: forwards a kvq connection both ways until the server has sent
`stall_after` bytes, then holds everything back (the client sees a kvq that stopped
answering mid-stream, as a SIGSTOPped or overloaded server looks), without touching the
server. Header-only replies (lookups) pass; a large GetBlocks stream (a load) stalls."""

from __future__ import annotations

import asyncio
import threading
from typing import Optional


class StallProxy:
    def __init__(self, upstream: str, stall_after: int) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.stall_after = stall_after
        self.sent = 0  # bytes forwarded from the server to clients
        self.stalled = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._server: Optional[asyncio.base_events.Server] = None
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait()

    @property
    def address(self) -> str:
        assert self._server is not None
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", 0))
        ready.set()
        self._loop.run_forever()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        await asyncio.gather(self._pipe(reader, up_writer, downstream=False),
                             self._pipe(up_reader, writer, downstream=True), return_exceptions=True)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, downstream: bool) -> None:
        while True:
            data = await src.read(65536)
            if not data:
                dst.close()
                return
            if downstream:
                if self.sent + len(data) > self.stall_after:
                    self.stalled.set()
                if self.stalled.is_set():
                    continue  # held back: the client waits, the server is not told
                self.sent += len(data)
            elif self.stalled.is_set():
                continue
            dst.write(data)
            await dst.drain()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
