"""The committed load-plan fixtures (tools/plan_fixtures.py): intact, valid, complete."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import msgspec
import pytest

from tools.engine_venvs import HERE as PINS
from tools.plan_fixtures import (
    MODELS,
    RECORDERS,
    Fixture,
    fixture_paths,
    fixtures_by_plan,
    read_fixture,
    write_fixture,
)
from weightcache.plan import check_plan, numel

FIXTURES = fixture_paths()


@functools.cache
def fixture(path: Path) -> Fixture:
    return read_fixture(path)  # its plan hashes to the recorded hash


def test_every_engine_and_model_has_a_committed_fixture() -> None:
    expected = [f"{engine}-{m.name}" for engine in RECORDERS for m in MODELS]
    assert sorted(p.stem for p in FIXTURES) == sorted(expected)


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_a_fixture_was_recorded_by_its_engines_pinned_release(path: Path) -> None:
    engine = path.stem.split("-")[0]
    (release,) = re.findall(rf"^{engine}==(\S+)$", (PINS / f"{engine}.txt").read_text(), re.M)
    assert fixture(path).engine == f"{engine} {release}"


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_a_fixture_is_a_valid_plan_that_writes_every_parameter_byte(path: Path) -> None:
    recorded = fixture(path)
    model = next(m for m in MODELS if m.name == recorded.model)
    sources = recorded.sources()
    # The checkpoint table is the tool's, in its order: the GPU replay writes exactly it.
    assert list(sources) == list(model.checkpoint()) and sources == model.checkpoint()
    summary = check_plan(recorded.plan, sources)
    # The tracer planned every parameter it saw written, and all of each.
    assert summary.incomplete == recorded.incomplete == []
    assert recorded.copied == {} and recorded.unwritten == []
    # No padding in these shapes: the engine's layout holds exactly the checkpoint's bytes,
    # and every checkpoint tensor is read.
    checkpoint_bytes = sum(numel(s.shape) * 2 for s in sources.values())
    assert summary.param_bytes == recorded.planned_bytes == checkpoint_bytes
    assert {c.source for c in recorded.plan.copies} == set(sources) and recorded.unread == []


def test_fixtures_of_one_plan_are_one_replay(tmp_path: Path) -> None:
    by_name = {p.stem: p for p in FIXTURES}
    llama, moe = (fixture(by_name[f"vllm-{m.name}"]) for m in MODELS)
    twin = msgspec.structs.replace(llama, engine="other 1.0")  # another engine, the same plan
    paths = [write_fixture(f, tmp_path) for f in (llama, moe, twin)]
    # In path order: other-llama-3-8b, vllm-llama-3-8b, vllm-qwen1.5-moe-a2.7b.
    assert fixtures_by_plan(sorted(paths)) == [[paths[2], paths[0]], [paths[1]]]


def test_the_committed_fixtures_group_by_their_verified_hashes() -> None:
    groups = fixtures_by_plan()
    assert sorted(p for group in groups for p in group) == FIXTURES
    hashes = [{fixture(p).plan_hash for p in group} for group in groups]
    assert all(len(h) == 1 for h in hashes) and len(set().union(*hashes)) == len(groups)


def test_sglang_and_vllm_lay_out_llama_3_8b_alike() -> None:
    # docs/engines.md says so, and the GPU replay builds that layout once for both.
    by_name = {p.stem: p for p in FIXTURES}
    sglang, vllm = (fixture(by_name[f"{e}-llama-3-8b"]) for e in ("sglang", "vllm"))
    assert sglang.plan_hash == vllm.plan_hash and sglang.plan == vllm.plan


def test_a_fixture_whose_plan_was_altered_is_refused(tmp_path: Path) -> None:
    recorded = fixture(FIXTURES[0])
    plan = recorded.plan
    first = plan.copies[0]
    moved = msgspec.structs.replace(
        first, src=msgspec.structs.replace(first.src, offset=first.src.offset + 1)
    )
    altered = msgspec.structs.replace(
        recorded, plan=msgspec.structs.replace(plan, copies=[moved, *plan.copies[1:]])
    )
    path = write_fixture(altered, tmp_path)
    with pytest.raises(ValueError, match="hashes to .*not the recorded"):
        read_fixture(path)
