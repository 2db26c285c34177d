"""A TCP proxy that cuts PostgreSQL connections on cue (cf. psycopg's ``tests/fix_proxy.py``).

Workers connect to the proxy instead of the server. :meth:`CuttingProxy.cut_after` arms a cut
that fires when a client sends a statement of a given kind (a fetch, an ack): the statement is
forwarded, so the server runs and commits it, but its reply is dropped and every connection
through the proxy is closed. That is the worst moment for a broker: the database changed state
and the client never learned of it. New connections are refused for ``down_for`` seconds, then
the proxy lets them through again.

To recognise a statement the proxy follows the client's side of the PostgreSQL protocol
(``Parse`` carries the text and the prepared statement's name, ``Bind`` names the statement,
``Query`` carries the text), so it works when psycopg prepares statements too.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

# Protocol codes of the untyped messages a client may send before its startup message.
_SSL_REQUEST = 80877103
_GSSENC_REQUEST = 80877104


def statement_kinds(sql: str) -> tuple[str, ...]:
    """What broker statement ``sql`` does: ``fetch``, ``ack``, both (``ack_fetch``, which
    writes the acks queued since the last fetch and fetches in one statement), or neither
    (see sql/consume.sql)."""
    kinds: tuple[str, ...] = ()
    if "SET status = 'running'" in sql:
        kinds += ("fetch",)
    if "SET status = 'completed'" in sql:
        kinds += ("ack",)
    return kinds


@dataclass
class _ClientStream:
    """Follows the client -> server half of one connection, message by message."""

    buf: bytearray = field(default_factory=bytearray)
    started: bool = False  # past the (untyped) startup phase
    statements: dict[bytes, tuple[str, ...]] = field(default_factory=dict)  # prepared name -> kinds

    def feed(self, data: bytes) -> list[str]:
        """Kinds of the statements whose execution ``data`` completes the request of."""
        self.buf += data
        kinds: list[str] = []
        while True:
            if not self.started:
                if len(self.buf) < 8:
                    return kinds
                (length,) = struct.unpack("!i", self.buf[:4])
                if len(self.buf) < length:
                    return kinds
                (code,) = struct.unpack("!i", self.buf[4:8])
                del self.buf[:length]
                if code not in (_SSL_REQUEST, _GSSENC_REQUEST):
                    self.started = True
                continue
            if len(self.buf) < 5:
                return kinds
            tag = self.buf[0:1]
            (length,) = struct.unpack("!i", self.buf[1:5])
            if len(self.buf) < 1 + length:
                return kinds
            body = bytes(self.buf[5 : 1 + length])
            del self.buf[: 1 + length]
            if tag == b"Q":
                kinds += statement_kinds(body.split(b"\0", 1)[0].decode(errors="replace"))
            elif tag == b"P":
                name, rest = body.split(b"\0", 1)
                self.statements[name] = statement_kinds(
                    rest.split(b"\0", 1)[0].decode(errors="replace")
                )
            elif tag == b"B":
                _portal, rest = body.split(b"\0", 1)
                kinds += self.statements.get(rest.split(b"\0", 1)[0], ())


class _Pipe:
    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client = client
        self.server = server
        self.stream = _ClientStream()
        self.mute_replies = False

    def close(self) -> None:
        for sock in (self.client, self.server):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()


class CuttingProxy:
    """Listens on 127.0.0.1:<port> and forwards to ``target``; cuts every connection on cue."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._pipes: set[_Pipe] = set()
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._armed: tuple[str, float] | None = None
        self.cuts: list[tuple[str, float, float]] = []  # (kind, cut at, restored at), wall clock
        self._cut_event = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="cutting-proxy", daemon=True)

    def __enter__(self) -> CuttingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join(5)
        for pipe in list(self._pipes):
            pipe.close()
        self._listener.close()
        self._sel.close()

    def url_for(self, url: str) -> str:
        """``url`` with its host and port replaced by the proxy's."""
        from urllib.parse import urlsplit, urlunsplit

        parts = urlsplit(url)
        netloc = parts.netloc.rsplit("@", 1)
        auth = netloc[0] + "@" if len(netloc) == 2 else ""
        return urlunsplit(parts._replace(netloc=f"{auth}127.0.0.1:{self.port}"))

    def cut_after(self, kind: str, down_for: float) -> None:
        """Arm a cut: the next ``kind`` statement is forwarded, its reply dropped, all cut."""
        self._cut_event.clear()
        with self._lock:
            self._armed = (kind, down_for)

    def wait_cut(self, timeout: float) -> tuple[str, float, float]:
        """Block until the armed cut fired; returns (kind, cut at, restored at), wall clock.

        Returns while connections are still refused: what the database holds then is what the
        clients left behind.
        """
        if not self._cut_event.wait(timeout):
            raise AssertionError(f"the armed cut did not fire within {timeout}s")
        return self.cuts[-1]

    # -- the forwarding loop --------------------------------------------------------------------

    def _run(self) -> None:
        self._listener.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ, self._accept)
        while not self._stop:
            for key, _ in self._sel.select(timeout=0.1):
                callback: Callable[[], None] = key.data
                callback()

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        if time.time() < self._down_until:
            client.close()  # the network is down: the client sees the connection fail
            return
        try:
            server = socket.create_connection(self.target, timeout=5)
        except OSError:
            client.close()
            return
        for sock in (client, server):
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pipe = _Pipe(client, server)
        self._pipes.add(pipe)
        self._sel.register(client, selectors.EVENT_READ, lambda: self._forward(pipe, True))
        self._sel.register(server, selectors.EVENT_READ, lambda: self._forward(pipe, False))

    def _forward(self, pipe: _Pipe, from_client: bool) -> None:
        src, dst = (pipe.client, pipe.server) if from_client else (pipe.server, pipe.client)
        try:
            data = src.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(pipe)
            return
        fire = False
        if from_client:
            kinds = pipe.stream.feed(data)
            with self._lock:
                if self._armed is not None and self._armed[0] in kinds:
                    fire = True
        elif pipe.mute_replies:
            return
        try:
            dst.setblocking(True)
            dst.sendall(data)
            dst.setblocking(False)
        except OSError:
            self._drop(pipe)
            return
        if fire:
            self._fire(pipe)

    def _fire(self, pipe: _Pipe) -> None:
        with self._lock:
            armed, self._armed = self._armed, None
        if armed is None:
            return
        kind, down_for = armed
        # Let the server run (and commit) the statement, but never deliver its reply.
        pipe.mute_replies = True
        deadline = time.monotonic() + 0.2
        while time.monotonic() < deadline:
            for key, _ in self._sel.select(timeout=0.02):
                if key.fileobj is pipe.server:
                    with contextlib.suppress(OSError):
                        pipe.server.recv(65536)  # the reply: read and dropped
        cut_at = time.time()
        self._down_until = cut_at + down_for
        for other in list(self._pipes):
            self._drop(other)
        self.cuts.append((kind, cut_at, self._down_until))
        self._cut_event.set()

    def _drop(self, pipe: _Pipe) -> None:
        if pipe not in self._pipes:
            return
        self._pipes.discard(pipe)
        for sock in (pipe.client, pipe.server):
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._sel.unregister(sock)
        pipe.close()
