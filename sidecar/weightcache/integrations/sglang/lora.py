"""SGLang's LoRA adapters on a model whose weights are mapped from the daemon.

SGLang keeps a LoRA adapter in tensors of its own: its ``LoRAManager`` wraps
the target layers (``BaseLayerWithLoRA`` keeps ``base_layer`` and its
weight as they are) and copies each adapter's A and B into its LoRA memory
pool; added-token embeddings go to the pool as well. Nothing of an adapter is
written into a base weight, so LoRA is allowed with weightcache.

One thing stops it: SGLang reads an adapter's files with a
``DefaultModelLoader`` built from the *model's* load config
(``LoRAAdapter.initialize_weights``). With weightcache selected that config
names our loader class and carries our extra config, which
``DefaultModelLoader`` refuses by name, so no adapter could load (``Failed to
load LoRA adapter ...: Unexpected extra config keys ...``). The hook below
(registered by :func:`weightcache.integrations.sglang.register`) gives the
adapter the default-format config the disk fallback uses, to read the
adapter's own files; the base weights are not involved.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from weightcache.integrations.sglang.mutations import selects_weightcache

ADAPTER_WEIGHTS = "sglang.srt.lora.lora.LoRAAdapter.initialize_weights"


def read_adapter_files_by_default(
    original: Callable[..., Any], adapter: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND hook for ``LoRAAdapter.initialize_weights`` (reads the adapter's files)."""
    config = adapter.load_config
    if selects_weightcache(getattr(config, "model_loader_extra_config", None)):
        from weightcache.integrations.sglang.loader import default_load_config

        adapter.load_config = default_load_config(config)
    return original(adapter, *args, **kwargs)
