"""SGLang's weight-mutating APIs, refused at the server's front door when weightcache loads.

A model loaded through the weightcache loader maps the daemon's memory,
which every engine attached to that daemon shares: nothing may write it in
place. SGLang's tokenizer manager (the HTTP server's and ``sgl.Engine``'s
entry to the scheduler) receives every weight-mutating request; hooked here
(SGLang plugin hooks, registered by :func:`weightcache.integrations.sglang.register`),
each is answered with a refusal naming the API before any payload is
deserialized or any scheduler sees it, and the server serves on:

- ``update_weights_from_disk`` / ``_from_tensor`` / ``_from_distributed`` /
  ``_from_ipc``, ``init_weights_update_group`` (a trainer's broadcast group)
  and ``begin_weight_update`` (the session inside which a trainer writes
  weights, also by P2P/RDMA without any loader): answered ``(False, message)``
  as SGLang answers a failed update (HTTP 400);
- ``release_memory_occupation`` / ``resume_memory_occupation`` for the
  ``weights`` tag (no tags means all): raise, which SGLang's HTTP server turns
  into HTTP 400 with the message. Releasing the weights would free the
  engine's copied tensors and leave the mapped ones to the daemon; resuming
  would restore them in place. The KV cache alone is SGLang's to release;
- ``check_weights`` (``/weights_checker``) with action ``reset_tensors``, which
  overwrites every parameter with random values in place: answered
  ``(False, message, None, None)`` as SGLang answers a failed check (HTTP 400);
  its reading actions (``checksum``, ``snapshot``, ``compare``) run.

The rule follows configuration, not the load's outcome: whenever the extra
config selects weightcache (both routes put it there), disk fallback included,
so every rank and every request gets the same answer. The model-level marker
SGLang checks in its scheduler (``_derived_weight_cache_error``, set by the
loader) stays as the second line for callers that bypass the tokenizer manager.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

from weightcache.integrations.sglang import CONFIG_KEY

log = logging.getLogger(__name__)

TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
CONTROL_MIXIN = "sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin"
WEIGHTS_TAG = "weights"

# API -> SGLang's answer to a failed call of it (the HTTP handler unpacks this shape).
UPDATE_APIS: dict[str, Callable[[str], tuple]] = {
    f"{TOKENIZER_MANAGER}.update_weights_from_disk": lambda m: (False, m, 0),
    f"{CONTROL_MIXIN}.update_weights_from_tensor": lambda m: (False, m),
    f"{CONTROL_MIXIN}.update_weights_from_distributed": lambda m: (False, m),
    f"{CONTROL_MIXIN}.update_weights_from_ipc": lambda m: (False, m),
    f"{CONTROL_MIXIN}.init_weights_update_group": lambda m: (False, m),
    f"{CONTROL_MIXIN}.begin_weight_update": lambda m: (False, m),
}
MEMORY_APIS = (
    f"{CONTROL_MIXIN}.release_memory_occupation",
    f"{CONTROL_MIXIN}.resume_memory_occupation",
)
WEIGHT_CHECKER = f"{CONTROL_MIXIN}.check_weights"
RESET_ACTION = "reset_tensors"  # the weight checker's one writing action


class WeightMutationRefused(ValueError):
    """A weight-mutating SGLang API was called on weights mapped from a daemon."""


def refusal(api: str) -> str:
    return (
        f"weightcache: {api} is refused: this engine's weights are mapped read-only from the "
        "weightcache daemon, which shares them with every engine attached to it. Serve new "
        "weights from a WeightCache of their own (or restart without the weightcache loader)"
    )


def selects_weightcache(extra_config: object) -> bool:
    """Whether SGLang's ``model_loader_extra_config`` (a dict or its JSON) selects us."""
    if isinstance(extra_config, str):
        try:
            extra_config = json.loads(extra_config) if extra_config.strip() else {}
        except ValueError:
            return False
    return isinstance(extra_config, dict) and CONFIG_KEY in extra_config


def touches_weights(tags: Sequence[str] | None) -> bool:
    """SGLang's memory tags: none given means every tag, the weights included."""
    return not tags or WEIGHTS_TAG in tags


def _selected(manager: Any) -> bool:
    server_args = getattr(manager, "server_args", None)
    return selects_weightcache(getattr(server_args, "model_loader_extra_config", None))


async def _answer(value: object) -> object:
    return value


async def _raise(exc: Exception) -> None:
    raise exc


def refuse_update(target: str) -> Callable[..., Any]:
    """AROUND hook for one weight-update API (``target``: its dotted path)."""
    api = target.rsplit(".", 1)[1]
    failed = UPDATE_APIS[target]

    def hook(original: Callable[..., Any], manager: Any, *args: Any, **kwargs: Any) -> Any:
        if not _selected(manager):
            return original(manager, *args, **kwargs)
        log.warning("weightcache: refused %s", api)
        return _answer(failed(refusal(api)))

    return hook


def refuse_weights_memory(target: str) -> Callable[..., Any]:
    """AROUND hook for release/resume_memory_occupation: refused for the weights tag."""
    api = target.rsplit(".", 1)[1]

    def hook(original: Callable[..., Any], manager: Any, obj: Any, *args: Any, **kw: Any) -> Any:
        if not _selected(manager) or not touches_weights(getattr(obj, "tags", None)):
            return original(manager, obj, *args, **kw)
        log.warning("weightcache: refused %s of the weights", api)
        return _raise(WeightMutationRefused(refusal(f"{api} of the weights")))

    return hook


def refuse_weight_reset(
    original: Callable[..., Any], manager: Any, obj: Any, *args: Any, **kw: Any
) -> Any:
    """AROUND hook for check_weights: its ``reset_tensors`` action refused, the rest run."""
    if not _selected(manager) or getattr(obj, "action", None) != RESET_ACTION:
        return original(manager, obj, *args, **kw)
    log.warning("weightcache: refused check_weights %s", RESET_ACTION)
    return _answer((False, refusal(f"check_weights action {RESET_ACTION}"), None, None))


def hooks() -> dict[str, Callable[..., Any]]:
    """Every AROUND hook this module adds, by SGLang target."""
    out = {target: refuse_update(target) for target in UPDATE_APIS}
    out.update({target: refuse_weights_memory(target) for target in MEMORY_APIS})
    out[WEIGHT_CHECKER] = refuse_weight_reset
    return out
