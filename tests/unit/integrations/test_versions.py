"""weightcache.integrations.versions: the supported range, as a verdict (never raised early)."""

from __future__ import annotations

import pytest

from weightcache.integrations.versions import (
    SUPPORTED,
    UnsupportedEngineVersion,
    check,
    detect,
    installed_version,
    release_series,
)


@pytest.mark.parametrize(
    ("engine", "version", "series"),
    [("vllm", "0.33.0", "0.33"), ("vllm", "0.32.1+cpu", "0.32"), ("vllm", "0.33.0+cu130", "0.33"),
     ("sglang", "0.5.23", "0.5.23"), ("sglang", "0.5.22.post1", "0.5.22"),
     ("sglang", "0.5", None), ("vllm", "dev", None)],
)  # fmt: skip
def test_release_series(engine: str, version: str, series: str | None) -> None:
    assert release_series(engine, version) == series


@pytest.mark.parametrize(
    ("engine", "version"),
    [("vllm", "0.32.0"), ("vllm", "0.33.0+cu130"), ("sglang", "0.5.22"), ("sglang", "0.5.23")],
)
def test_the_tested_range_with_every_hook_is_supported(engine: str, version: str) -> None:
    verdict = check(engine, version, missing=[])
    assert verdict.ok and verdict.problem is None
    verdict.require()  # no raise


@pytest.mark.parametrize(
    ("engine", "version"),
    [("vllm", "0.31.2"), ("vllm", "0.34.0"), ("sglang", "0.5.21"), ("sglang", "0.5.24")],
)
def test_other_releases_are_unsupported_naming_the_supported_ones(engine, version) -> None:
    verdict = check(engine, version, missing=[])
    assert not verdict.ok
    assert f"{version} is installed" in verdict.problem
    assert all(f"{series}.x" in verdict.problem for series in SUPPORTED[engine])
    assert "default" in verdict.problem  # what to do instead
    with pytest.raises(UnsupportedEngineVersion, match=version):
        verdict.require()


def test_a_release_in_range_lacking_a_hook_is_unsupported_naming_it() -> None:
    verdict = check("sglang", "0.5.23", missing=["sglang.srt.x.ModelRunner.account_preloaded"])
    assert not verdict.ok
    assert "lacks what the adapter uses: sglang.srt.x.ModelRunner.account_preloaded" in (
        verdict.problem
    )


def test_without_the_engine_the_verdict_says_so() -> None:
    # This interpreter (the project's venv) has neither engine.
    assert installed_version("vllm") is None
    verdict = detect("vllm")
    assert not verdict.ok and "vLLM is not installed" in verdict.problem
