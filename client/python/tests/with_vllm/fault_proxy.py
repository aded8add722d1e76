"""A TCP proxy in front of a real kvq-server for fault tests, without touching the server:

* stall_after: once the server has sent that many bytes, everything is held back (the client
  sees a kvq that stopped answering mid-stream, as a SIGSTOPped or overloaded server looks):
  header-only replies (lookups) pass, a large GetBlocks stream (a load) stalls;
* delay_s (settable at any time): every chunk is forwarded that long after it arrived, both
  ways (added latency: a round trip grows by twice delay_s, the bandwidth stays);
* a server that is gone (killed): the client's connection is closed at once, as a refused
  connection would be.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Optional


class FaultProxy:
    def __init__(self, upstream: str, stall_after: Optional[int] = None, delay_s: float = 0.0) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.stall_after = stall_after
        self.delay_s = delay_s
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
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:  # the server is gone: the client learns it at once
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_writer, downstream=False),
                             self._pipe(up_reader, writer, downstream=True), return_exceptions=True)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, downstream: bool) -> None:
        # Read and write apart: a chunk is due delay_s after it arrived, so latency does not
        # cap the bandwidth.
        due: asyncio.Queue = asyncio.Queue()

        async def forward() -> None:
            while True:
                at, data = await due.get()
                if data is None:
                    dst.close()
                    return
                wait = at - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                dst.write(data)
                await dst.drain()

        writer = asyncio.ensure_future(forward())
        try:
            while True:
                data = await src.read(65536)
                if not data:
                    await due.put((0.0, None))
                    break
                if downstream:
                    if self.stall_after is not None and self.sent + len(data) > self.stall_after:
                        self.stalled.set()
                    if self.stalled.is_set():
                        continue  # held back: the client waits, the server is not told
                    self.sent += len(data)
                elif self.stalled.is_set():
                    continue
                await due.put((time.monotonic() + self.delay_s, data))
            await writer
        finally:
            writer.cancel()
            dst.close()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
