"""The router feed's wire: pickled calls in length-prefixed frames, over one TCP connection per caller.

Engines report to the feed after nearly every step and every ingress follows it, so a call's fixed
cost multiplies by engines x steps. A Ray actor call costs its caller about 1.2 ms of CPU and the
actor about 1 ms (2 cores, Ray 2.60), whatever it carries; a frame on a connection held open costs
about 0.13-0.15 ms on each side (benchmarks/bench_feed_wire.py). So the router actor serves its feed
on a port of its node: a caller learns the address and a token through one actor call, and its first
frame must be that token. Each connection gets a thread of its own, so a long poll held on one never
holds up another's reports, and one caller's calls run in the order it sent them.
"""
import asyncio
import hmac
import pickle
import secrets
import socket
import struct
import threading
from typing import Any

_LENGTH = struct.Struct("!I")
_TOKEN_BYTES = 16
CONNECT_TIMEOUT_S = 10.0  # an address that does not answer (a node gone, a firewall) fails, and is looked up again


class FeedError(RuntimeError):
    """The served method raised: its repr, from the server."""


class FeedServer:
    """Serves the methods named in `methods` of `target` on host, to callers that present the token."""

    def __init__(self, target: object, methods: frozenset[str], host: str):
        self._target, self._methods = target, methods
        self.token = secrets.token_bytes(_TOKEN_BYTES)
        self._socket = socket.create_server((host, 0))
        self.address: tuple[str, int] = (host, self._socket.getsockname()[1])
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept_forever, name="feed-accept", daemon=True).start()

    def close(self) -> None:
        """Stops serving: no new connections, and those open are cut (as when the process dies)."""
        self._socket.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread, which close() alone would not
        self._socket.close()
        with self._lock:
            for connection in self._connections:
                connection.shutdown(socket.SHUT_RDWR)

    def _accept_forever(self) -> None:
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(connection,), name="feed-connection", daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        with self._lock:
            self._connections.add(connection)
        try:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not hmac.compare_digest(_read_frame(connection, max_bytes=_TOKEN_BYTES), self.token):
                return
            while True:
                method, args = pickle.loads(_read_frame(connection))
                connection.sendall(_frame(pickle.dumps(self._call(method, args), protocol=5)))
        except (EOFError, OSError):  # the caller went away, or close() cut it
            return
        finally:
            with self._lock:
                self._connections.discard(connection)
            connection.close()

    def _call(self, method: str, args: tuple) -> tuple[bool, Any]:
        if method not in self._methods:
            return False, f"no method {method!r} here"
        try:
            return True, getattr(self._target, method)(*args)
        except Exception as exc:  # the caller's to handle; the connection goes on
            return False, repr(exc)


class FeedConnection:
    """A caller's connection to a FeedServer, on the event loop that opened it. Any failure leaves it
    broken (a reply may be on its way): the caller opens another."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader, self._writer = reader, writer
        self._lock = asyncio.Lock()
        self._broken = False

    @classmethod
    async def open(cls, address: tuple[str, int], token: bytes) -> "FeedConnection":
        # asyncio sets TCP_NODELAY
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*address), CONNECT_TIMEOUT_S)
        writer.write(_frame(token))
        return cls(reader, writer)

    async def call(self, method: str, *args) -> Any:
        """The served method's result; ConnectionError if the connection is (or goes) down, FeedError
        if the method raised."""
        async with self._lock:
            if self._broken:
                raise ConnectionError("the feed connection broke earlier")
            try:
                self._writer.write(_frame(pickle.dumps((method, args), protocol=5)))
                (length,) = _LENGTH.unpack(await self._reader.readexactly(_LENGTH.size))
                ok, value = pickle.loads(await self._reader.readexactly(length))
            except BaseException as exc:
                self._broken = True
                if isinstance(exc, (EOFError, OSError)):
                    raise ConnectionError(f"the feed connection broke: {exc!r}") from exc
                raise
        if not ok:
            raise FeedError(value)
        return value

    def close(self) -> None:
        self._broken = True
        self._writer.close()


def _frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


def _read_frame(connection: socket.socket, max_bytes: int | None = None) -> bytes:
    (length,) = _LENGTH.unpack(_read_exactly(connection, _LENGTH.size))
    if max_bytes is not None and length > max_bytes:
        raise EOFError(f"a frame of {length} bytes where at most {max_bytes} may come")
    return _read_exactly(connection, length)


def _read_exactly(connection: socket.socket, size: int) -> bytes:
    data = bytearray(size)
    view, got = memoryview(data), 0
    while got < size:
        count = connection.recv_into(view[got:])
        if not count:
            raise EOFError("the caller closed the connection")
        got += count
    return bytes(data)
