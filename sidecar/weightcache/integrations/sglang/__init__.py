"""SGLang adapter: SGLang loads its weights from a weightcache daemon.

SGLang has no string-keyed loader registry, but its ``get_model_loader``
accepts a loader *class* as ``load_config.load_format``. Two ways select
:class:`~weightcache.integrations.sglang.loader.WeightcacheModelLoader`:

- the launcher, ``python -m weightcache.integrations.sglang.launch`` (or
  ``weightcache-sglang``): SGLang's own arguments plus ``--weightcache-*``;
- the ``sglang.srt.plugins`` entry point (:func:`register`, run by SGLang's
  ``load_plugins`` in every process of every SGLang that has weightcache
  installed): ``--model-loader-extra-config '{"weightcache": {...}}'`` on an
  unmodified ``sglang serve`` selects it.

:func:`register` never raises: on an SGLang release the adapter does not
support it logs one WARNING, and the extra config then selects a loader that
refuses, naming the supported releases; without it SGLang is untouched.

Configuration: the ``"weightcache"`` object of ``--model-loader-extra-config``
(keys of :class:`weightcache.integrations.settings.AdapterSettings`), then
``WEIGHTCACHE_*`` variables. KV sizing is SGLang's own: the loader's
``preloaded_weights_bytes`` feeds ``ModelRunner.account_preloaded_weights``,
which :mod:`.kv` makes add them rank-local, before the MIN across ranks.
Weight-mutating APIs are refused by :mod:`.mutations` while weightcache is
selected; LoRA adapters, which SGLang keeps in tensors of their own, load (:mod:`.lora`).
"""

from __future__ import annotations

import logging
import threading

# The key of --model-loader-extra-config that holds the adapter's settings.
CONFIG_KEY = "weightcache"
GET_MODEL_LOADER = "sglang.srt.model_loader.loader.get_model_loader"

log = logging.getLogger(__name__)
_registered = False
_lock = threading.Lock()
_unsupported: str | None = None  # why the installed SGLang is unsupported, once known


def register() -> None:
    """SGLang general plugin: route loads whose extra config has ``"weightcache"`` to us.

    Idempotent; never raises (SGLang runs it in every process whatever is served).
    """
    global _registered, _unsupported
    with _lock:
        if _registered:
            return
        _registered = True
        try:
            from weightcache.integrations.versions import detect

            support = detect("sglang")
            if not support.ok:
                _unsupported = support.problem
                log.warning(
                    "weightcache: the %r loader config is unavailable: %s", CONFIG_KEY,
                    support.problem,
                )  # fmt: skip
            from sglang.srt.plugins.hook_registry import HookRegistry, HookType

            HookRegistry.register(GET_MODEL_LOADER, select_loader, HookType.BEFORE)
            if support.ok:
                from weightcache.integrations.sglang import kv, lora, mutations

                # The daemon's bytes go in rank-local, before the MIN (kv.py says why).
                HookRegistry.register(kv.MEASURE, kv.measure_keeping_local, HookType.AROUND)
                HookRegistry.register(kv.ACCOUNT, kv.account_rank_local, HookType.AROUND)
                # Weight-mutating APIs refused at the server's front door (mutations.py).
                for target, hook in mutations.hooks().items():
                    HookRegistry.register(target, hook, HookType.AROUND)
                # LoRA adapters read their own files, not through our loader (lora.py).
                HookRegistry.register(
                    lora.ADAPTER_WEIGHTS, lora.read_adapter_files_by_default, HookType.AROUND
                )
        except Exception as exc:  # noqa: BLE001 - SGLang must start whatever happens here
            log.warning(
                "weightcache: could not register the SGLang plugin (%s: %s); SGLang's own "
                "loaders are unaffected",
                type(exc).__name__,
                exc,
            )


def select_loader(load_config, model_config=None):  # noqa: ANN001 - SGLang's signature
    """Before ``get_model_loader``: a ``"weightcache"`` extra config selects our loader class."""
    extra = load_config.model_loader_extra_config
    if isinstance(extra, dict) and CONFIG_KEY in extra:
        load_config.load_format = loader_class()
    return None


def loader_class() -> type:
    """Our loader class, or on an unsupported SGLang one that refuses when instantiated."""
    if _unsupported is not None:
        return _refusing_loader(_unsupported)
    from weightcache.integrations.sglang.loader import WeightcacheModelLoader

    return WeightcacheModelLoader


def _refusing_loader(problem: str) -> type:
    from weightcache.integrations.versions import UnsupportedEngineVersion

    class UnsupportedWeightcacheLoader:
        def __init__(self, load_config) -> None:  # noqa: ANN001 - SGLang's LoadConfig
            raise UnsupportedEngineVersion(problem)

    return UnsupportedWeightcacheLoader
