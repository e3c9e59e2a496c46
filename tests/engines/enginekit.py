"""Helpers for the engine adapter tests, which run inside each engine's own venv.

``make test-engines`` builds the pinned venvs (tools/engine_venvs) and runs
each engine's test module with that venv's interpreter and
``WEIGHTCACHE_ENGINE_TESTS=<engine>``. Anywhere else the engine is absent;
the module then skips, naming that absence. Under ``make test-engines`` an
absent engine is a broken venv, and fails.
"""

from __future__ import annotations

import importlib.util
import os

import pytest


def require_engine(engine: str) -> None:
    if importlib.util.find_spec(engine) is not None:
        return
    if os.environ.get("WEIGHTCACHE_ENGINE_TESTS") == engine:
        raise RuntimeError(f"{engine} is not importable in its own test venv; rebuild it")
    pytest.skip(
        f"{engine} is not installed in this interpreter; `make test-engines` runs these "
        f"tests in the pinned {engine} venv",
        allow_module_level=True,
    )


GiB = 1 << 30
