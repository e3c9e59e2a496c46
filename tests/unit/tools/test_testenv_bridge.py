import ipaddress
import socket
import threading

import pytest

from tools.testenv import bridge


def test_parse_connect_reads_host_and_port() -> None:
    assert bridge.parse_connect(b"CONNECT 10.250.0.1:10250 HTTP/1.1\r\nHost: x\r\n\r\n") == (
        "10.250.0.1", 10250)
    assert bridge.parse_connect(b"CONNECT [::1]:443 HTTP/1.1\r\n\r\n") == ("::1", 443)


@pytest.mark.parametrize("head", [
    b"GET / HTTP/1.1\r\n\r\n",
    b"CONNECT 10.250.0.1 HTTP/1.1\r\n\r\n",
    b"CONNECT 10.250.0.1:x HTTP/1.1\r\n\r\n",
    b"CONNECT 10.250.0.1:1\r\n\r\n",
])
def test_parse_connect_refuses_anything_else(head: bytes) -> None:
    with pytest.raises(ValueError):
        bridge.parse_connect(head)


def test_splice_copies_both_ways_and_lets_each_side_finish() -> None:
    client, near = socket.socketpair()
    far, server = socket.socketpair()
    threading.Thread(target=bridge.splice, args=(near, far), daemon=True).start()
    client.sendall(b"ping")
    client.shutdown(socket.SHUT_WR)
    received = b""
    while chunk := server.recv(10):
        received += chunk
    assert received == b"ping"  # EOF reached the server: half-close passed through
    server.sendall(b"pong")
    server.close()
    answer = b""
    while chunk := client.recv(10):
        answer += chunk
    assert answer == b"pong"


def test_egress_dials_only_literal_addresses_inside_the_node() -> None:
    allowed = [ipaddress.ip_network("10.250.0.1/32"), ipaddress.ip_network("10.245.0.0/24")]
    assert bridge.egress_allowed("10.250.0.1", allowed)
    assert bridge.egress_allowed("10.245.0.7", allowed)
    assert not bridge.egress_allowed("10.250.0.2", allowed)
    assert not bridge.egress_allowed("127.0.0.1", allowed)
    assert not bridge.egress_allowed("example.com", allowed)
