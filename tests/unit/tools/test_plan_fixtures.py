"""The committed load-plan fixtures (tools/plan_fixtures.py): intact, valid, complete."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from tools.plan_fixtures import MODELS, fixture_paths, read_fixture, write_fixture
from weightcache.plan import check_plan, numel

FIXTURES = fixture_paths()


def test_every_model_has_a_committed_fixture() -> None:
    assert sorted(p.stem for p in FIXTURES) == sorted(f"vllm-{m.name}" for m in MODELS)


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_a_fixture_is_a_valid_plan_that_writes_every_parameter_byte(path: Path) -> None:
    fixture = read_fixture(path)  # its plan hashes to the recorded hash
    model = next(m for m in MODELS if m.name == fixture.model)
    sources = fixture.sources()
    # The checkpoint table is the tool's, in its order: the GPU replay writes exactly it.
    assert list(sources) == list(model.checkpoint()) and sources == model.checkpoint()
    summary = check_plan(fixture.plan, sources)
    assert summary.incomplete == [] and fixture.copied == {}
    # No padding in these shapes: the engine's layout holds exactly the checkpoint's bytes,
    # and every checkpoint tensor is read.
    checkpoint_bytes = sum(numel(s.shape) * 2 for s in sources.values())
    assert summary.param_bytes == fixture.planned_bytes == checkpoint_bytes
    assert {c.source for c in fixture.plan.copies} == set(sources)


def test_a_fixture_whose_plan_was_altered_is_refused(tmp_path: Path) -> None:
    fixture = read_fixture(FIXTURES[0])
    plan = fixture.plan
    first = plan.copies[0]
    moved = msgspec.structs.replace(
        first, src=msgspec.structs.replace(first.src, offset=first.src.offset + 1)
    )
    altered = msgspec.structs.replace(
        fixture, plan=msgspec.structs.replace(plan, copies=[moved, *plan.copies[1:]])
    )
    path = write_fixture(altered, tmp_path)
    with pytest.raises(ValueError, match="hashes to .*not the recorded"):
        read_fixture(path)
