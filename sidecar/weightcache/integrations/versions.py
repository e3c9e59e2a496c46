"""Which engine releases the adapters support; anything else fails loudly.

The adapters reach into engine internals whose shape changes between
releases (loader base classes, the KV-budget hooks), so each adapter names
the exact releases it was verified against (``tools/engine_venvs/*.txt`` pin
the same for the tests) and refuses to run on others.
"""

from __future__ import annotations

from importlib import metadata

SUPPORTED: dict[str, tuple[str, ...]] = {
    "vllm": ("0.33.0",),
    "sglang": ("0.5.23",),
}
_DISPLAY = {"vllm": "vLLM", "sglang": "SGLang"}


class UnsupportedEngineVersion(RuntimeError):
    """The installed engine is not a release this adapter supports."""


def check_version(engine: str, installed: str | None) -> str:
    """``installed`` if supported, else :class:`UnsupportedEngineVersion` naming both."""
    supported = SUPPORTED[engine]
    name = _DISPLAY[engine]
    if installed is None:
        raise UnsupportedEngineVersion(
            f"weightcache.integrations.{engine} needs {name} {' or '.join(supported)}, "
            f"but {name} is not installed; install weightcache[{engine}]"
        )
    # Local build tags (0.33.0+cu130) are the same release.
    if installed.split("+")[0] not in supported:
        raise UnsupportedEngineVersion(
            f"weightcache.integrations.{engine} supports {name} {' or '.join(supported)} "
            f"only; {installed} is installed. Install weightcache[{engine}] (it pins "
            f"{engine}=={supported[-1]}) or load without weightcache"
        )
    return installed


def installed_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def require_supported(engine: str) -> str:
    """Check the installed engine's distribution version (no engine import)."""
    return check_version(engine, installed_version(engine))
