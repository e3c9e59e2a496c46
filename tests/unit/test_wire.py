"""weightcache.wire: frames and their fds over real Unix stream sockets."""

from __future__ import annotations

import array
import os
import socket
import threading
import time

import pytest

from tests.unit.wc_harness import open_fd_count
from weightcache.protocol import DEFAULT_MAX_FRAME, PingRequest, ProtocolError, decode_request
from weightcache.wire import (
    MAX_FDS_PER_MESSAGE,
    PeerClosed,
    pack_frame_header,
    recv_frame,
    send_frame,
    send_message,
    unpack_frame_header,
)


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.settimeout(10)
    b.settimeout(10)
    yield a, b
    a.close()
    b.close()


def memfd_with(content: bytes) -> int:
    fd = os.memfd_create("wire-test", os.MFD_CLOEXEC)
    os.write(fd, content)
    return fd


def send_raw(sock: socket.socket, data: bytes, fds: list[int]) -> None:
    """Bytes with fds on them, bypassing send_frame's own checks."""
    sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])


def test_message_round_trip(pair) -> None:
    a, b = pair
    send_message(a, PingRequest(v=1))
    body, fds = recv_frame(b)
    assert decode_request(body) == PingRequest(v=1) and fds == []


def test_fds_arrive_and_refer_to_the_same_files(pair) -> None:
    a, b = pair
    sent = [memfd_with(b"first"), memfd_with(b"second")]
    try:
        send_frame(a, b"payload", sent)
        body, fds = recv_frame(b, max_fds=2)
        try:
            assert body == b"payload"
            assert len(fds) == 2 and not set(fds) & set(sent)
            for mine, theirs, content in zip(sent, fds, [b"first", b"second"], strict=True):
                assert os.fstat(mine).st_ino == os.fstat(theirs).st_ino
                assert os.pread(theirs, 16, 0) == content
        finally:
            for fd in fds:
                os.close(fd)
    finally:
        for fd in sent:
            os.close(fd)


def test_a_large_frame_in_many_pieces(pair) -> None:
    a, b = pair
    payload = os.urandom(3 * 1024 * 1024 + 7)
    sender = threading.Thread(target=send_frame, args=(a, payload))
    sender.start()
    body, _ = recv_frame(b)
    sender.join()
    assert body == payload


def test_clean_close_between_frames_is_peer_closed(pair) -> None:
    a, b = pair
    a.close()
    with pytest.raises(PeerClosed):
        recv_frame(b)


def test_truncated_header(pair) -> None:
    a, b = pair
    a.sendall(b"\x00\x00")
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(ProtocolError, match=r"truncated frame header \(2 of 4 bytes\)"):
        recv_frame(b)


def test_truncated_body(pair) -> None:
    a, b = pair
    a.sendall(b"\x00\x00\x00\x0aHELLO")
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(ProtocolError, match=r"truncated frame body \(5 of 10 bytes\)"):
        recv_frame(b)


def test_oversized_frame_is_refused_before_reading_its_body(pair) -> None:
    a, b = pair
    a.sendall(b"\x00\x00\x01\x00" + b"x" * 16)
    with pytest.raises(ProtocolError, match="frame of 256 bytes exceeds the 255-byte cap"):
        recv_frame(b, max_frame=255)


def test_sender_refuses_oversized_frames_and_too_many_fds(pair) -> None:
    a, _ = pair
    with pytest.raises(ProtocolError, match="exceeds the 8-byte cap"):
        send_frame(a, b"123456789", max_frame=8)
    with pytest.raises(ProtocolError, match=f"the limit is {MAX_FDS_PER_MESSAGE}"):
        send_frame(a, b"x", [0] * (MAX_FDS_PER_MESSAGE + 1))


def _leak_check(case, repeat: int = 50) -> None:
    """Run ``case`` (which must raise ProtocolError) until any leak would show."""
    case()  # first call may allocate lazily (e.g. the interpreter's own fds)
    before = open_fd_count()
    for _ in range(repeat):
        case()
    assert open_fd_count() == before


def test_fds_where_none_are_expected_are_refused_and_closed() -> None:
    def case() -> None:
        a, b = socket.socketpair()
        fd = memfd_with(b"x")
        with a, b:
            send_raw(a, b"\x00\x00\x00\x01x", [fd])
            os.close(fd)
            with pytest.raises(ProtocolError, match="sent 1 file descriptors; expected at most 0"):
                recv_frame(b, max_fds=0)

    _leak_check(case)


def test_more_fds_than_expected_are_refused_and_closed() -> None:
    def case() -> None:
        a, b = socket.socketpair()
        fds = [memfd_with(b"x") for _ in range(3)]
        with a, b:
            send_raw(a, b"\x00\x00\x00\x01x", fds[:2])
            with pytest.raises(ProtocolError, match="sent 2 file descriptors; expected at most 1"):
                recv_frame(b, max_fds=1)
        for fd in fds:
            os.close(fd)

    _leak_check(case)


def test_fds_cut_short_by_the_kernel_are_reported_and_closed() -> None:
    def case() -> None:
        a, b = socket.socketpair()
        fds = [memfd_with(b"x") for _ in range(8)]
        with a, b:
            send_raw(a, b"\x00\x00\x00\x01x", fds)
            with pytest.raises(ProtocolError, match="MSG_CTRUNC"):
                recv_frame(b, max_fds=0)
        for fd in fds:
            os.close(fd)

    _leak_check(case)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x00\x00", "truncated frame header"),
        (b"\x00\x00\x00\x10abc", "truncated frame body"),
        (b"\x7f\x00\x00\x00", "exceeds"),
    ],
)
def test_fds_received_with_a_bad_frame_are_closed(data: bytes, message: str) -> None:
    def case() -> None:
        a, b = socket.socketpair()
        fd = memfd_with(b"x")
        with a, b:
            send_raw(a, data, [fd])
            os.close(fd)
            a.shutdown(socket.SHUT_WR)
            with pytest.raises(ProtocolError, match=message):
                recv_frame(b, max_fds=1)

    _leak_check(case)


def test_fds_sent_with_the_body_instead_of_the_header_do_not_leak() -> None:
    def case() -> None:
        a, b = socket.socketpair()
        fd = memfd_with(b"x")
        with a, b:
            a.sendall(b"\x00\x00\x00\x04")
            send_raw(a, b"body", [fd])
            os.close(fd)
            assert recv_frame(b, max_fds=0) == (b"body", [])

    case()
    before = open_fd_count()
    for _ in range(50):
        case()
    assert open_fd_count() == before


def test_many_good_frames_with_fds_leak_nothing() -> None:
    a, b = socket.socketpair()
    fd = memfd_with(b"payload")
    with a, b:
        before = open_fd_count()
        for _ in range(200):
            send_frame(a, b"x", [fd])
            _, received = recv_frame(b, max_fds=1)
            os.close(received[0])
        assert open_fd_count() == before
    os.close(fd)


def test_a_deadline_bounds_the_whole_frame_not_each_read(pair) -> None:
    a, b = pair
    stop = threading.Event()

    def trickle() -> None:
        for byte in b"\x00\x00\x00\x10" + b"x" * 16:
            if stop.wait(0.1):
                return
            a.sendall(bytes([byte]))

    sender = threading.Thread(target=trickle)
    sender.start()
    try:
        # Each byte comes well within the socket's 10 s timeout; the frame as a whole cannot.
        with pytest.raises(TimeoutError):
            recv_frame(b, deadline=time.monotonic() + 0.5)
    finally:
        stop.set()
        sender.join()
    assert b.gettimeout() == 10


def test_a_frame_within_its_deadline_is_read_and_the_timeout_kept(pair) -> None:
    a, b = pair
    send_frame(a, b"on time")
    assert recv_frame(b, deadline=time.monotonic() + 30) == (b"on time", [])
    assert b.gettimeout() == 10


def test_frame_header_round_trips_big_endian() -> None:
    header = pack_frame_header(0x01020304)
    assert header == b"\x01\x02\x03\x04"
    assert unpack_frame_header(header) == 0x01020304


def test_frame_at_the_cap_passes_and_past_it_is_refused() -> None:
    assert unpack_frame_header(pack_frame_header(DEFAULT_MAX_FRAME)) == DEFAULT_MAX_FRAME
    with pytest.raises(ProtocolError, match="exceeds the 67108864-byte cap"):
        pack_frame_header(DEFAULT_MAX_FRAME + 1)
    with pytest.raises(ProtocolError, match="exceeds the 100-byte cap"):
        unpack_frame_header(b"\x00\x00\x00\x65", max_frame=100)
    with pytest.raises(ProtocolError, match="4294967295 bytes exceeds"):
        unpack_frame_header(b"\xff\xff\xff\xff")
