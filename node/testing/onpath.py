"""An attacker on the network path, for tests: a TCP proxy that records what passes both
ways and can flip one bit of the server's bytes. Nothing here is used by a node."""

from __future__ import annotations

import asyncio


class Proxy:
    """Listens on 127.0.0.1 and forwards each connection to `target` (a port; may be set
    after start). Records both directions in `seen["up"]` and `seen["down"]`; once
    `flip_after` bytes went down (server to client) on one connection, flips the lowest
    bit of the next one (on every connection)."""

    def __init__(self, target: int = 0, flip_after: int | None = None):
        self.target, self.flip_after = target, flip_after
        self.seen = {"up": bytearray(), "down": bytearray()}
        self.flipped = 0
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _conn(self, creader, cwriter) -> None:
        try:
            sreader, swriter = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            cwriter.transport.abort()
            return
        await asyncio.gather(self._pipe(creader, swriter, "up"),
                             self._pipe(sreader, cwriter, "down"))

    async def _pipe(self, reader, writer, way: str) -> None:
        passed = 0
        try:
            while data := await reader.read(1 << 16):
                if way == "down" and self.flip_after is not None \
                        and passed <= self.flip_after < passed + len(data):
                    i = self.flip_after - passed
                    data = data[:i] + bytes([data[i] ^ 1]) + data[i + 1:]
                    self.flipped += 1
                passed += len(data)
                self.seen[way] += data
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.transport.abort()
