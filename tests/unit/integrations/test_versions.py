"""weightcache.integrations.versions: supported engine releases, loud refusal otherwise."""

from __future__ import annotations

import pytest

from weightcache.integrations.versions import (
    SUPPORTED,
    UnsupportedEngineVersion,
    check_version,
    installed_version,
    require_supported,
)


def test_the_pinned_releases_are_supported_including_local_build_tags() -> None:
    assert check_version("vllm", "0.33.0") == "0.33.0"
    assert check_version("vllm", "0.33.0+cu130") == "0.33.0+cu130"
    assert check_version("sglang", "0.5.23") == "0.5.23"


@pytest.mark.parametrize("engine", sorted(SUPPORTED))
def test_other_releases_are_refused_naming_supported_and_installed(engine: str) -> None:
    with pytest.raises(UnsupportedEngineVersion) as caught:
        check_version(engine, "0.1.0")
    message = str(caught.value)
    assert SUPPORTED[engine][0] in message and "0.1.0 is installed" in message
    assert f"weightcache[{engine}]" in message


def test_a_missing_engine_is_refused() -> None:
    with pytest.raises(UnsupportedEngineVersion, match="SGLang is not installed"):
        check_version("sglang", None)


def test_require_supported_reads_the_installed_distribution() -> None:
    # This interpreter (the project's venv) has neither engine: it must say so.
    assert installed_version("vllm") is None
    with pytest.raises(UnsupportedEngineVersion, match="vLLM is not installed"):
        require_supported("vllm")
