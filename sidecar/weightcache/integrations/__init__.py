"""Engine adapters: vLLM and SGLang load their weights from a weightcache daemon.

``weightcache.integrations.vllm`` registers the ``weightcache`` load format
through vLLM's ``vllm.general_plugins`` entry point;
``weightcache.integrations.sglang`` is a loader class that SGLang's
``get_model_loader`` accepts as ``load_format``, selected by its launcher
(``python -m weightcache.integrations.sglang.launch``) or its
``sglang.srt.plugins`` entry point. Both are thin over the modules here:

- :mod:`.settings`: the adapter's configuration (engine config channel, then
  environment) and the per-rank socket path, pure;
- :mod:`.versions`: which engine releases are supported, failing loudly otherwise;
- :mod:`.trace` and :mod:`.layouts`: the zero-copy path both adapters take
  first (the engine's own loading traced into a load plan, the daemon's build
  of it mapped into every parameter, mapped/copied read from the storages);
- :mod:`.loading`: the checkpoint-layout path where no own layout can be had
  (expected ``CacheConfig``, one attach decision per process, zero-copy load of
  the tensors whose layout matches, the engine's loaders filling the rest).

Nothing here imports an engine; the engine modules import it lazily.
"""
