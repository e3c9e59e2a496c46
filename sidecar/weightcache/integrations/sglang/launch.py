"""``python -m weightcache.integrations.sglang.launch <sglang serve args> --weightcache-...``

SGLang's own server, with its load format set to the weightcache loader
class. Every argument SGLang knows is passed to SGLang's parser unchanged;
the ``--weightcache-*`` flags below become the ``"weightcache"`` object of
``--model-loader-extra-config`` (flags win over keys already there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from weightcache.integrations.settings import AdapterSettings
from weightcache.integrations.sglang import CONFIG_KEY


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightcache-sglang",
        description="Run SGLang's server with its weights mapped from a weightcache daemon; "
        "every other argument goes to SGLang.",
        add_help=False,
    )
    parser.add_argument("--weightcache-socket", dest="socket")
    parser.add_argument("--weightcache-socket-dir", dest="socket_dir")
    parser.add_argument("--weightcache-cache", dest="cache", help="NAMESPACE.NAME")
    parser.add_argument("--weightcache-transports", dest="transports", help="comma-separated")
    parser.add_argument("--weightcache-wait-ready-s", dest="wait_ready_s")
    parser.add_argument("--weightcache-shard-plan", dest="shard_plan")
    parser.add_argument("--weightcache-draft-socket", dest="draft_socket")
    parser.add_argument("--weightcache-draft-cache", dest="draft_cache", help="NAMESPACE.NAME")
    parser.add_argument(
        "--weightcache-fallback", dest="fallback", action="store_const", const=True,
        help="load from disk when no usable daemon answers (default: fail)",
    )  # fmt: skip
    return parser


def split_argv(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """(our settings as extra-config keys, SGLang's arguments)."""
    ours, rest = build_parser().parse_known_args(argv)
    return {k: v for k, v in vars(ours).items() if v is not None}, rest


def configure(server_args: Any, settings: dict[str, Any], env: dict[str, str]) -> None:
    """Point SGLang's ``server_args`` at the weightcache loader; refuse what conflicts.

    Validates the settings as the loader will (so a typo fails before any
    process starts).
    """
    from weightcache.integrations.sglang.loader import WeightcacheModelLoader

    if server_args.weight_cache_mode != "off":
        raise SystemExit(
            f"weightcache-sglang: --weight-cache-mode {server_args.weight_cache_mode} selects "
            "SGLang's own IPC weight cache, which would replace weightcache's loader; "
            "leave it off"
        )
    extra = server_args.model_loader_extra_config or {}
    if isinstance(extra, str):
        extra = json.loads(extra) if extra.strip() else {}
    merged = {**dict(extra.get(CONFIG_KEY) or {}), **settings}
    AdapterSettings.from_sources(merged, env)
    server_args.model_loader_extra_config = json.dumps({**extra, CONFIG_KEY: merged})
    server_args.load_format = WeightcacheModelLoader


def main(argv: list[str] | None = None) -> None:
    from weightcache.integrations.versions import detect

    support = detect("sglang")
    if not support.ok:
        raise SystemExit(f"weightcache-sglang: {support.problem}")
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    settings, rest = split_argv(sys.argv[1:] if argv is None else argv)
    load_plugins()
    server_args = prepare_server_args(rest)
    configure(server_args, settings, dict(os.environ))
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
