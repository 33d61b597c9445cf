"""Reach a TCP server inside a network namespace from outside it: a Unix socket whose every
connection is relayed to HOST:PORT. Unix sockets are files, and the file system is shared by
all namespaces, so the relay runs inside the namespace and its socket is used from anywhere.

Run inside it: `python -m tests.uds_relay PATH HOST PORT`. It prints "ready" once it listens
and relays until it is killed; a connection HOST:PORT refuses is closed at once.
"""

from __future__ import annotations

import asyncio
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def serve(path: str, host: str, port: int) -> None:
    async def relay(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(_pipe(client_reader, writer), _pipe(reader, client_writer))

    server = await asyncio.start_unix_server(relay, path)
    print("ready", flush=True)
    await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], sys.argv[2], int(sys.argv[3])))
