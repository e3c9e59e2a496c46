"""vLLM adapter: ``--load-format weightcache`` maps the weights from a weightcache daemon.

Installed with ``pip install weightcache[vllm]``; vLLM calls :func:`register`
through the ``vllm.general_plugins`` entry point in every process (API
server, engine core, workers). Configuration comes from
``--model-loader-extra-config`` (keys of
:class:`weightcache.integrations.settings.AdapterSettings`) and
``WEIGHTCACHE_*`` environment variables. See docs/engines.md.
"""

from __future__ import annotations

import threading

LOAD_FORMAT = "weightcache"

_registered = False
_lock = threading.Lock()


def register() -> None:
    """Register the ``weightcache`` load format with vLLM; idempotent, imports vLLM lazily.

    Raises :class:`~weightcache.integrations.versions.UnsupportedEngineVersion`
    on a vLLM release the adapter does not support.
    """
    global _registered
    with _lock:
        if _registered:
            return
        from weightcache.integrations.versions import require_supported

        require_supported("vllm")
        from vllm.model_executor.model_loader import register_model_loader

        from weightcache.integrations.vllm.loader import WeightcacheModelLoader

        register_model_loader(LOAD_FORMAT)(WeightcacheModelLoader)
        _registered = True
