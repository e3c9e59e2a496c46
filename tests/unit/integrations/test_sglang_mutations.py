"""weightcache.integrations.sglang.mutations: which SGLang calls are refused, and how.

The hooks run here on a stand-in tokenizer manager (SGLang is not installed in
the project's venv); tests/engines/test_sglang.py applies them through SGLang's
own hook registry in each SGLang venv, and tests/engines/test_sglang_server.py
calls every API over HTTP on a real server.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from weightcache.integrations.sglang import mutations

SELECTED = json.dumps({"weightcache": {"socket": "/tmp/d.sock"}})


def manager(extra: object) -> SimpleNamespace:
    return SimpleNamespace(server_args=SimpleNamespace(model_loader_extra_config=extra))


async def reached(manager, obj, request=None):  # noqa: ANN001 - SGLang's method, standing in
    return "SGLang's own"


def test_the_extra_config_selects_weightcache_as_a_dict_or_its_json() -> None:
    assert mutations.selects_weightcache(SELECTED)
    assert mutations.selects_weightcache({"weightcache": {}})
    assert not mutations.selects_weightcache({"other": 1})
    assert not mutations.selects_weightcache("")
    assert not mutations.selects_weightcache("{not json")
    assert not mutations.selects_weightcache(None)


@pytest.mark.parametrize("target", sorted(mutations.UPDATE_APIS))
def test_weight_updates_are_answered_as_sglang_answers_a_failed_update(target) -> None:
    hook = mutations.hooks()[target]
    api = target.rsplit(".", 1)[1]
    answer = asyncio.run(hook(reached, manager(SELECTED), object(), None))
    assert answer[0] is False and answer[1] == mutations.refusal(api)
    assert api in answer[1] and "mapped read-only from the weightcache daemon" in answer[1]
    # Without weightcache selected, SGLang's own method runs.
    assert asyncio.run(hook(reached, manager("{}"), object(), None)) == "SGLang's own"


@pytest.mark.parametrize("target", mutations.MEMORY_APIS)
def test_memory_release_and_resume_are_refused_for_the_weights_only(target) -> None:
    hook = mutations.hooks()[target]
    for tags in (None, [], ["weights"], ["kv_cache", "weights"]):
        with pytest.raises(mutations.WeightMutationRefused, match="of the weights is refused"):
            asyncio.run(hook(reached, manager(SELECTED), SimpleNamespace(tags=tags)))
    kv_only = SimpleNamespace(tags=["kv_cache"])
    assert asyncio.run(hook(reached, manager(SELECTED), kv_only)) == "SGLang's own"
    assert asyncio.run(hook(reached, manager(None), SimpleNamespace(tags=None))) == "SGLang's own"


def test_the_weight_checkers_reset_is_refused_and_its_reading_actions_run() -> None:
    hook = mutations.hooks()[mutations.WEIGHT_CHECKER]
    reset = SimpleNamespace(action="reset_tensors")
    answer = asyncio.run(hook(reached, manager(SELECTED), reset, None))
    assert answer[0] is False and answer[2:] == (None, None)
    assert "check_weights action reset_tensors is refused" in answer[1]
    for action in ("checksum", "snapshot", "compare"):
        obj = SimpleNamespace(action=action)
        assert asyncio.run(hook(reached, manager(SELECTED), obj, None)) == "SGLang's own"
    assert asyncio.run(hook(reached, manager("{}"), reset, None)) == "SGLang's own"
