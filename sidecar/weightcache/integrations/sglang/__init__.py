"""SGLang adapter: SGLang loads its weights from a weightcache daemon.

SGLang has no string-keyed loader registry, but its ``get_model_loader``
accepts a loader *class* as ``load_config.load_format``. Two ways select
:class:`~weightcache.integrations.sglang.loader.WeightcacheModelLoader`:

- the launcher, ``python -m weightcache.integrations.sglang.launch`` (or
  ``weightcache-sglang``): SGLang's own arguments plus ``--weightcache-*``;
- the ``sglang.srt.plugins`` entry point (:func:`register`, run by SGLang's
  ``load_plugins`` in every process): ``--model-loader-extra-config
  '{"weightcache": {...}}'`` on an unmodified ``sglang serve`` selects it.

Configuration: the ``"weightcache"`` object of ``--model-loader-extra-config``
(keys of :class:`weightcache.integrations.settings.AdapterSettings`), then
``WEIGHTCACHE_*`` variables. KV sizing is SGLang's own: the loader's
``preloaded_weights_bytes`` feeds ``ModelRunner.account_preloaded_weights``
(so :mod:`weightcache.kv` is *not* applied as well; that would count twice).
"""

from __future__ import annotations

import threading

# The key of --model-loader-extra-config that holds the adapter's settings.
CONFIG_KEY = "weightcache"
GET_MODEL_LOADER = "sglang.srt.model_loader.loader.get_model_loader"

_registered = False
_lock = threading.Lock()


def register() -> None:
    """SGLang general plugin: route loads whose extra config has ``"weightcache"`` to us.

    Idempotent; checks the SGLang version first (raises on an unsupported one).
    """
    global _registered
    with _lock:
        if _registered:
            return
        from weightcache.integrations.versions import require_supported

        require_supported("sglang")
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(GET_MODEL_LOADER, select_loader, HookType.BEFORE)
        _registered = True


def select_loader(load_config, model_config=None):  # noqa: ANN001 - SGLang's signature
    """Before ``get_model_loader``: a ``"weightcache"`` extra config selects our loader class."""
    extra = load_config.model_loader_extra_config
    if isinstance(extra, dict) and CONFIG_KEY in extra:
        from weightcache.integrations.sglang.loader import WeightcacheModelLoader

        load_config.load_format = WeightcacheModelLoader
    return None
