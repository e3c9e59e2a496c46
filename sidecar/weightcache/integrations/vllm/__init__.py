"""vLLM adapter: ``--load-format weightcache`` maps the weights from a weightcache daemon.

vLLM calls :func:`register` through the ``vllm.general_plugins`` entry point
in every process (API server, engine core, workers) of every vLLM that has
weightcache installed, whatever its load format, and does not catch what it
raises. So :func:`register` never raises: on a supported vLLM it registers
:class:`~weightcache.integrations.vllm.loader.WeightcacheModelLoader`; on any
other it logs one WARNING and registers a loader that refuses only when
``--load-format weightcache`` selects it, naming the supported releases.
Configuration comes from ``--model-loader-extra-config`` (keys of
:class:`weightcache.integrations.settings.AdapterSettings`) and
``WEIGHTCACHE_*`` environment variables. See docs/engines.md.
"""

from __future__ import annotations

import logging
import threading

LOAD_FORMAT = "weightcache"

log = logging.getLogger(__name__)
_registered = False
_lock = threading.Lock()


def register() -> None:
    """Register the ``weightcache`` load format with vLLM; idempotent, never raises."""
    global _registered
    with _lock:
        if _registered:
            return
        _registered = True
        try:
            _register()
        except Exception as exc:  # noqa: BLE001 - vLLM must start whatever happens here
            log.warning(
                "weightcache: could not register the %r load format (%s: %s); vLLM's own load "
                "formats are unaffected",
                LOAD_FORMAT,
                type(exc).__name__,
                exc,
            )


def _register() -> None:
    from vllm.model_executor.model_loader import register_model_loader

    from weightcache.integrations.logs import follow_engine_logging
    from weightcache.integrations.versions import detect

    follow_engine_logging("vllm")
    support = detect("vllm")
    if support.ok:
        from weightcache.integrations.vllm.loader import WeightcacheModelLoader

        register_model_loader(LOAD_FORMAT)(WeightcacheModelLoader)
        return
    log.warning("weightcache: --load-format %s is unavailable: %s", LOAD_FORMAT, support.problem)
    register_model_loader(LOAD_FORMAT)(_refusing_loader(support.problem))


def _refusing_loader(problem: str) -> type:
    """A loader class that refuses when vLLM instantiates it (only if selected)."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    from weightcache.integrations.versions import UnsupportedEngineVersion

    class UnsupportedWeightcacheLoader(BaseModelLoader):
        def __init__(self, load_config) -> None:  # noqa: ANN001 - vLLM's LoadConfig
            raise UnsupportedEngineVersion(problem)

        def download_model(self, model_config) -> None:  # noqa: ANN001
            raise UnsupportedEngineVersion(problem)

        def load_weights(self, model, model_config) -> None:  # noqa: ANN001
            raise UnsupportedEngineVersion(problem)

    return UnsupportedWeightcacheLoader
