"""Moving protocol frames (and their file descriptors) over a Unix stream socket.

File descriptors travel as SCM_RIGHTS on the frame's first bytes. Every fd a
receive call gets is either returned to the caller or closed before raising,
so a bad peer can never make us leak descriptors.
"""

from __future__ import annotations

import array
import os
import socket
import struct
import time
from collections.abc import Callable

import msgspec

from weightcache.protocol import DEFAULT_MAX_FRAME, ProtocolError, encode

# Every frame: a 4-byte big-endian body length, then the MessagePack body.
FRAME_HEADER = struct.Struct(">I")

# The kernel refuses more than SCM_MAX_FD (253) descriptors in one message.
MAX_FDS_PER_MESSAGE = 253
# Bodies are read in pieces of at most this, so memory follows the bytes received.
_RECV_CHUNK = 1 << 20


def pack_frame_header(length: int, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    if length > max_frame:
        raise ProtocolError(f"frame of {length} bytes exceeds the {max_frame}-byte cap")
    return FRAME_HEADER.pack(length)


def unpack_frame_header(header: bytes, max_frame: int = DEFAULT_MAX_FRAME) -> int:
    (length,) = FRAME_HEADER.unpack(header)
    if length > max_frame:
        raise ProtocolError(f"frame of {length} bytes exceeds the {max_frame}-byte cap")
    return length


class PeerClosed(EOFError):
    """The peer closed the connection cleanly between frames."""


def send_message(
    sock: socket.socket,
    message: msgspec.Struct,
    fds: list[int] | tuple[int, ...] = (),
    max_frame: int = DEFAULT_MAX_FRAME,
) -> None:
    body = encode(message)
    send_frame(sock, body, fds, max_frame)


def send_frame(
    sock: socket.socket,
    body: bytes,
    fds: list[int] | tuple[int, ...] = (),
    max_frame: int = DEFAULT_MAX_FRAME,
) -> None:
    if len(fds) > MAX_FDS_PER_MESSAGE:
        raise ProtocolError(f"{len(fds)} fds in one frame; the limit is {MAX_FDS_PER_MESSAGE}")
    data = memoryview(pack_frame_header(len(body), max_frame) + body)
    if fds:
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        sent = sock.sendmsg([data], ancillary)
        data = data[sent:]
    if data:
        sock.sendall(data)


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _fds_from_ancillary(ancdata: list[tuple[int, int, bytes]], into: list[int]) -> None:
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % array.array("i").itemsize
            into.extend(array.array("i", data[:usable]))


def recv_frame(
    sock: socket.socket,
    max_frame: int = DEFAULT_MAX_FRAME,
    max_fds: int = 0,
    deadline: float | None = None,
    charge: Callable[[int], None] | None = None,
) -> tuple[bytes, list[int]]:
    """Read one frame; return its body and the fds that came with it.

    Raises PeerClosed on a clean close before a frame starts, ProtocolError on a
    truncated or oversized frame, on fds when none are expected, and on fds cut
    short by the kernel (MSG_CTRUNC). Received fds are closed on every error.
    ``deadline`` (a ``time.monotonic()`` value) bounds the whole frame, where
    the socket's timeout bounds each read: a peer trickling a byte at a time
    gets TimeoutError instead of holding the connection forever.
    ``charge`` is told each change in the body bytes held (a piece's size before
    it is read, minus what did not arrive), so the caller can bound the bytes
    all its connections hold together; it raises to refuse.
    """
    fds: list[int] = []
    timeout = sock.gettimeout()
    try:
        header = bytearray()
        # Room for one more fd than allowed, so a peer sending too many is detected.
        control_size = socket.CMSG_SPACE((max_fds + 1) * array.array("i").itemsize)
        while len(header) < FRAME_HEADER.size:
            _apply_deadline(sock, deadline, timeout)
            chunk, ancdata, flags, _ = sock.recvmsg(FRAME_HEADER.size - len(header), control_size)
            _fds_from_ancillary(ancdata, fds)
            if flags & socket.MSG_CTRUNC:
                raise ProtocolError("file descriptors were truncated in transit (MSG_CTRUNC)")
            if not chunk:
                if header:
                    raise ProtocolError(f"truncated frame header ({len(header)} of 4 bytes)")
                raise PeerClosed("peer closed the connection")
            header += chunk
        if len(fds) > max_fds:
            raise ProtocolError(
                f"peer sent {len(fds)} file descriptors; expected at most {max_fds}"
            )
        length = unpack_frame_header(bytes(header), max_frame)
        chunks: list[bytes] = []
        got = 0
        while got < length:
            _apply_deadline(sock, deadline, timeout)
            piece = min(length - got, _RECV_CHUNK)
            if charge is not None:
                charge(piece)
            chunk = sock.recv(piece)
            if charge is not None and len(chunk) < piece:
                charge(len(chunk) - piece)  # give back what did not arrive
            if not chunk:
                raise ProtocolError(f"truncated frame body ({got} of {length} bytes)")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks), fds
    except BaseException:
        close_fds(fds)
        raise
    finally:
        if deadline is not None:
            sock.settimeout(timeout)


def _apply_deadline(sock: socket.socket, deadline: float | None, timeout: float | None) -> None:
    if deadline is None:
        return
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("timed out waiting for a whole frame")
    sock.settimeout(remaining if timeout is None else min(timeout, remaining))
