"""A TCP relay on 127.0.0.1 that adds a fixed round-trip delay: each chunk is delivered half the delay after it
arrived, in order, in each direction (a link's latency, not its bandwidth). For issue 41's benchmark: llama.cpp's
RPC client talks to the relay, the relay to an rpc-server.

    python scripts/delay_relay.py --listen 50100 --to 127.0.0.1:50052 --rtt-ms 5
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import time


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Copy reader to writer, each chunk `delay` seconds after it was read (order kept)."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def read() -> None:
        while chunk := await reader.read(1 << 16):
            queue.put_nowait((time.perf_counter() + delay, chunk))
        queue.put_nowait((time.perf_counter() + delay, b""))

    task = asyncio.create_task(read())
    try:
        while True:
            due, chunk = await queue.get()
            wait = due - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            if not chunk:
                break
            writer.write(chunk)
            await writer.drain()
    finally:
        task.cancel()
        writer.close()


async def main(listen: int, host: str, port: int, rtt: float) -> None:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection(host, port)
        for w in (client_w, server_w):
            w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(pipe(client_r, server_w, rtt / 2), pipe(server_r, client_w, rtt / 2),
                             return_exceptions=True)

    server = await asyncio.start_server(handle, "127.0.0.1", listen)
    print(f"relay 127.0.0.1:{listen} -> {host}:{port}, round trip +{rtt * 1000:g} ms", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--listen", type=int, required=True)
    ap.add_argument("--to", required=True, help="HOST:PORT")
    ap.add_argument("--rtt-ms", type=float, default=0.0)
    a = ap.parse_args()
    to_host, _, to_port = a.to.rpartition(":")
    asyncio.run(main(a.listen, to_host, int(to_port), a.rtt_ms / 1000))
