"""One stream on its own Noise-secured TCP connection (see the package docstring).

After py-libp2p's handshake, a message is Noise's transport framing, read and written
here directly: a 2-byte big-endian length, then the ChaCha20-Poly1305 ciphertext of at
most 65519 bytes (the same framing as py-libp2p's, with fewer layers per frame). Where the
swarm has no key, those bytes go straight to the TCP socket (`SocketPipe`); with a key,
through py-libp2p's pnet protector, which encrypts them once more.

States. Reading: one task at a time (the owner's), as on any stream. `close()` sends our
end of stream; the owner may go on reading. A closed stream nobody reads is drained by a
task of the host's nursery, which a later read takes the socket back from. The socket is
released once both ends have closed, on a reset, on a failure, or when a stream nobody
closed is collected.
"""

from __future__ import annotations

import os
import socket
import struct
import weakref
from typing import Callable, Protocol

import trio

from tessera.peer.base.errors import StreamClosed
from tessera.peer.base.quick import QuickLock

# After close(), how long a socket nobody reads waits for the remote to close its side, and
# how much of what the remote sends meanwhile it keeps for a later read (beyond either, the
# remote gets a reset).
LINGER = 10.0
DRAIN_LIMIT = 4 << 20
# Noise transport messages hold at most 65535 bytes, 16 of them the tag.
MAX_PLAINTEXT = 65535 - 16
_LENGTH = struct.Struct(">H")
# A reset: close with a zero linger time, so the kernel sends RST at once.
_ABORT = struct.pack("ii", 1, 0)


class Pipe(Protocol):
    """The byte pipe under Noise: a py-libp2p raw connection, or its pnet-protected wrapper."""

    async def read(self, n: int | None = None) -> bytes: ...

    async def write(self, data: bytes) -> None: ...


class SocketPipe:
    """The pipe after the handshake where the swarm has no key: the TCP socket itself.

    py-libp2p's RawConnection over its TrioTCPStream (what the handshake reads and writes
    through) adds a `trio.Lock` each way and wraps every error; each lock's acquire is a pass
    through trio's scheduler before the bytes go, two of them ahead of every frame a hop
    sends. A `DedicatedStream` already has one reader at a time and serialises its writes,
    so here the socket is read and written directly. Reads as py-libp2p's pipe reads: a
    socket closed under the reader (a reset released it) is an end of stream.
    """

    def __init__(self, socket_stream: trio.SocketStream) -> None:
        self._socket = socket_stream

    async def read(self, n: int | None = None) -> bytes:
        try:
            return await self._socket.receive_some(n)
        except trio.ClosedResourceError:
            return b""

    async def write(self, data: bytes) -> None:
        await self._socket.send_all(data)


class Cipher(Protocol):
    """The Noise session's cipher states after the handshake (noiseprotocol's NoiseConnection)."""

    def encrypt(self, data: bytes) -> bytes: ...

    def decrypt(self, data: bytes) -> bytes: ...


class DedicatedStream:
    """One stream on its own Noise-secured TCP connection (a `Stream`)."""

    via = "dedicated"

    def __init__(self, socket_stream: trio.SocketStream, pipe: Pipe, cipher: Cipher, remote: str,
                 nursery: trio.Nursery, on_release: Callable[[], None]) -> None:
        self.remote = remote
        self._socket = socket_stream
        self._pipe = pipe
        self._cipher = cipher
        self._nursery = nursery
        self._on_release = on_release
        self._in = bytearray()  # received bytes not yet parsed into a message
        self._ready = bytearray()  # decrypted bytes not yet read
        self._write_lock = QuickLock()  # taken without a turn through the scheduler when free
        self._reading = False  # the owner's read is on the socket
        self._drain: trio.CancelScope | None = None  # the drainer's, while one runs
        self._drained = trio.Event()  # set when the drainer stops
        self._eof = False  # the remote closed its side
        self._closed = False  # we closed ours
        self._aborted = False  # reset, by us or by a failure
        self._released = False
        # A stream dropped unclosed gives its socket and its count back when collected
        # (maybe on another thread: the count goes back through the trio loop).
        self._collected = weakref.finalize(self, _collected, socket_stream.socket, trio.lowlevel.current_trio_token(),
                                           on_release)

    # -- reading --------------------------------------------------------------------

    async def read(self, max_bytes: int) -> bytes:
        """Up to max_bytes; b"" at end of stream. Raises StreamClosed on a reset or failure."""
        while not self._ready:
            if self._aborted:
                raise StreamClosed(f"dedicated stream with {self.remote} was reset")
            if self._eof or self._released:
                return b""
            if self._drain is not None:  # the owner reads again: take the socket back from the drainer
                self._drain.cancel()
                await self._drained.wait()
                continue
            await self._receive()
        out = bytes(self._ready[:max_bytes])
        del self._ready[:max_bytes]
        return out

    async def _receive(self) -> None:
        """The owner's read of one message into `_ready` (or of the end of the stream)."""
        self._reading = True
        completed = False
        try:
            message = await self._next_message()
            completed = True
        finally:
            self._reading = False
            if self._closed and not completed:
                self._after_close()  # a reader that gave up on a closed stream leaves it to the drainer
        if message is None:
            self._eof = True
            if self._closed:
                self._after_close()
        else:
            self._ready += message

    def unread(self, data: bytes | bytearray) -> None:
        """Give back bytes a reader took but did not use (the next read returns them first)."""
        self._ready[:0] = data

    async def _next_message(self) -> bytes | None:
        """The next Noise transport message, decrypted; None at a clean end of stream."""
        while True:
            if len(self._in) >= 2:
                (size,) = _LENGTH.unpack_from(self._in)
                if len(self._in) >= 2 + size:
                    ciphertext = bytes(self._in[2 : 2 + size])
                    del self._in[: 2 + size]
                    try:
                        return self._cipher.decrypt(ciphertext)
                    except Exception as bad:  # noiseprotocol raises its own and cryptography's types
                        self._abort()
                        raise StreamClosed(f"dedicated stream from {self.remote}: a message does not decrypt "
                                           f"({type(bad).__name__})") from None
            try:
                data = await self._pipe.read(65536)
            except Exception as error:  # a reset: py-libp2p wraps socket errors in its own types
                self._abort()
                raise StreamClosed(f"dedicated stream from {self.remote} failed: {type(error).__name__} {error}") from None
            if not data:
                if self._aborted:  # py-libp2p reads a socket closed under it as an end of stream
                    raise StreamClosed(f"dedicated stream with {self.remote} was reset")
                if self._in:
                    self._abort()
                    raise StreamClosed(f"dedicated stream from {self.remote} ended inside a message")
                return None
            self._in += data

    # -- writing --------------------------------------------------------------------

    async def write(self, data: bytes) -> None:
        """Raises StreamClosed if this end closed or the connection is gone."""
        async with self._write_lock:
            if self._closed or self._released or self._aborted:
                raise StreamClosed(f"dedicated stream to {self.remote} is {'reset' if self._aborted else 'closed'}")
            try:
                view = memoryview(data)
                parts = []
                for start in range(0, len(view), MAX_PLAINTEXT):
                    ciphertext = self._cipher.encrypt(bytes(view[start : start + MAX_PLAINTEXT]))
                    parts += (_LENGTH.pack(len(ciphertext)), ciphertext)
                await self._pipe.write(b"".join(parts))
            except BaseException as error:
                # the cipher's nonces moved on and part of the frame may have gone: nothing
                # sent after it could be read, so the stream ends here (cancelled or failed)
                self._abort()
                if isinstance(error, Exception):
                    raise StreamClosed(f"dedicated stream to {self.remote} failed: {type(error).__name__} {error}") from None
                raise
            if self._aborted:  # reset while the write waited (py-libp2p returns quietly from a closed socket)
                raise StreamClosed(f"dedicated stream to {self.remote} was reset")

    # -- ending ---------------------------------------------------------------------

    async def close(self) -> None:
        """Half-close (see the module docstring); idempotent."""
        async with self._write_lock:
            if self._closed or self._released or self._aborted:
                return
            self._closed = True
            try:
                await self._socket.send_eof()
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass  # gone already: nothing to tell the remote
        self._after_close()

    async def finish(self, limit: int) -> None:
        """Close and wait for the remote's end of stream, dropping up to `limit` bytes it sends
        meanwhile; then release (a listener's refusal, whose answer the dialler must read)."""
        self._reading = True  # this task reads what comes: no drainer
        try:
            await self.close()
            dropped = 0
            while not self._eof and dropped <= limit:
                message = await self._next_message()
                if message is None:
                    self._eof = True
                else:
                    dropped += len(message)
        except StreamClosed:
            return  # reset: released already
        finally:
            self._reading = False
        if not self._eof:
            self._abort()
        await self._release()

    def _after_close(self) -> None:
        """Once closed: release the socket if the remote has closed too, else drain it — unless
        the owner is reading, or a drainer runs already."""
        if self._released or self._reading or self._drain is not None:
            return
        if self._eof or self._aborted:
            self._nursery.start_soon(self._release)
        else:
            self._drain = trio.CancelScope()
            self._drained = trio.Event()
            self._nursery.start_soon(self._run_drain, self._drain)

    async def _run_drain(self, scope: trio.CancelScope) -> None:
        """Read what the remote still sends (for a later read) until its end of stream, then
        release the socket; give up after LINGER or DRAIN_LIMIT bytes (a reset). A read by the
        owner cancels `scope` and takes the socket back."""
        try:
            with scope:
                with trio.move_on_after(LINGER):
                    while not self._eof and len(self._ready) <= DRAIN_LIMIT:
                        message = await self._next_message()
                        if message is None:
                            self._eof = True
                        else:
                            self._ready += message
                if not self._eof:
                    self._abort()  # the remote never closed, or kept sending: it gets a reset
        except StreamClosed:
            pass  # reset or broken: `_next_message` marked it
        finally:
            self._drain = None
            self._drained.set()
            if not scope.cancelled_caught:  # ended, not taken back by the owner
                with trio.CancelScope(shield=True):
                    await self._release()

    async def reset(self) -> None:
        """Abort the connection now: the remote's reads and writes fail."""
        self._aborted = True
        if self._released:
            return
        self._abort_socket()
        await self._release()

    def _abort(self) -> None:
        """The stream is broken, misbehaved or half-written: reset it (from any context)."""
        self._aborted = True
        if not self._released:
            self._abort_socket()
            self._nursery.start_soon(self._release)

    def _abort_socket(self) -> None:
        try:
            self._socket.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _ABORT)
        except OSError:
            pass  # already closed under us

    async def _release(self) -> None:
        if self._released:
            return
        self._released = True
        self._collected.detach()  # released here: nothing left for the collector
        self._on_release()
        with trio.CancelScope(shield=True):
            await trio.aclose_forcefully(self._socket)


def _collected(sock: trio.socket.SocketType, token: trio.lowlevel.TrioToken, on_release: Callable[[], None]) -> None:
    """A stream nobody closed was collected: close its socket (an RST if data was unread) and
    give its count back on the trio loop. Runs wherever the collector does, any thread."""
    fd = sock.detach()  # the stdlib socket forgets the descriptor; closing it is ours alone
    if fd >= 0:
        os.close(fd)
    try:
        token.run_sync_soon(on_release)
    except trio.RunFinishedError:
        pass  # the loop ended: so did its counts


__all__ = ["DRAIN_LIMIT", "LINGER", "MAX_PLAINTEXT", "Cipher", "DedicatedStream", "Pipe", "SocketPipe"]
