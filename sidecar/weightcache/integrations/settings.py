"""The adapters' configuration: from the engine's own config channel, then the environment.

vLLM and SGLang both carry a JSON object for their loader
(``--model-loader-extra-config``); its keys win over ``WEIGHTCACHE_*``
environment variables, which suit pod specs. Parsing is pure: it takes the
mapping and the environment and returns :class:`AdapterSettings` or raises
:class:`SettingsError` naming the key and what was wrong.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

from weightcache.protocol import socket_path
from weightcache.shard import PLAN_NAMES
from weightcache.transport import TRANSPORT_NAMES

# Engine config key -> environment variable.
ENV_VARS: dict[str, str] = {
    "socket": "WEIGHTCACHE_SOCKET",
    "socket_dir": "WEIGHTCACHE_SOCKET_DIR",
    "cache": "WEIGHTCACHE_CACHE",
    "transports": "WEIGHTCACHE_TRANSPORTS",
    "wait_ready_s": "WEIGHTCACHE_WAIT_READY_S",
    "fallback": "WEIGHTCACHE_FALLBACK",
    "shard_plan": "WEIGHTCACHE_SHARD_PLAN",
    "draft_socket": "WEIGHTCACHE_DRAFT_SOCKET",
    "draft_cache": "WEIGHTCACHE_DRAFT_CACHE",
}
DEFAULT_WAIT_READY_S = 300.0
# How long to wait for a socket nobody answers on (absent, or refused): a restarting
# daemon binds again within seconds; an absent one should not hold the engine up.
ABSENT_WAIT_S = 10.0
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class SettingsError(ValueError):
    """The adapter's configuration is unusable; the message names the key."""


@dataclass(frozen=True)
class AdapterSettings:
    """Where the daemon is and what the adapter may do when it cannot use it.

    ``socket``: one explicit socket path (single-GPU engines), or
    ``socket_dir`` + ``cache`` (``NAMESPACE.NAME``): each rank derives
    ``<socket_dir>/<cache>/gpu-<its GPU UUID>.sock`` as the daemon names it.
    ``transports``: what this engine accepts, preferred first (None: the
    client's default for the machine). ``wait_ready_s``: how long to wait for a
    daemon that answers but is still loading; a socket nobody answers on is
    waited for ``absent_wait_s`` at most (not configurable: a restarting daemon
    binds again within seconds). ``fallback``: load from disk (the engine's own
    loader, as vLLM's own weight cache does) when no daemon answers, it never
    became ready or holds other weights, logging why at WARNING; on by
    default, off for setups that must never load from disk.
    ``shard_plan``: the daemon's ``--shard-plan`` when tensor-parallel.
    ``draft_socket`` or ``draft_cache`` (under the same ``socket_dir``): the
    WeightCache of a speculative draft model (:meth:`for_draft`); without
    either the draft loads from disk.
    """

    socket: str | None = None
    socket_dir: str | None = None
    cache: str | None = None
    transports: tuple[str, ...] | None = None
    wait_ready_s: float = DEFAULT_WAIT_READY_S
    fallback: bool = True
    shard_plan: str | None = None
    draft_socket: str | None = None
    draft_cache: str | None = None
    absent_wait_s: float = ABSENT_WAIT_S

    @classmethod
    def from_sources(
        cls, engine_config: Mapping[str, object] | None, env: Mapping[str, str]
    ) -> AdapterSettings:
        """Engine config keys first, then ``WEIGHTCACHE_*`` variables; unknown keys raise."""
        engine_config = dict(engine_config or {})
        unknown = sorted(set(engine_config) - set(ENV_VARS))
        if unknown:
            raise SettingsError(
                f"unknown weightcache loader config key(s) {unknown}; expected some of "
                f"{sorted(ENV_VARS)}"
            )
        raw: dict[str, tuple[str, object]] = {}
        for key, var in ENV_VARS.items():
            if key in engine_config and engine_config[key] is not None:
                raw[key] = (f"loader config key {key!r}", engine_config[key])
            elif var in env:
                raw[key] = (f"environment variable {var}", env[var])
        values = {key: _PARSERS[key](where, value) for key, (where, value) in raw.items()}
        settings = cls(**values)
        settings._check()
        return settings

    def _check(self) -> None:
        if self.socket is not None and (self.socket_dir is not None or self.cache is not None):
            raise SettingsError(
                "give either socket (one explicit path) or socket_dir + cache, not both"
            )
        if self.socket is None and (self.socket_dir is None or self.cache is None):
            raise SettingsError(
                "no daemon socket configured: set socket (or WEIGHTCACHE_SOCKET), or "
                "socket_dir and cache (WEIGHTCACHE_SOCKET_DIR, WEIGHTCACHE_CACHE=NAMESPACE.NAME)"
            )
        if self.draft_socket is not None and self.draft_cache is not None:
            raise SettingsError("give either draft_socket or draft_cache, not both")
        if self.draft_cache is not None and self.socket_dir is None:
            raise SettingsError(
                "draft_cache names a WeightCache under socket_dir, which is not set; "
                "use socket_dir + cache, or draft_socket"
            )

    def for_draft(self) -> AdapterSettings | None:
        """The settings a speculative draft model attaches with, None if it loads from disk.

        A draft is not the cache's model: it attaches only to a WeightCache of its
        own (``draft_socket`` / ``draft_cache``), and since that was configured,
        an unusable one fails instead of falling back. Without one it loads from
        disk, whatever ``fallback`` says.
        """
        if self.draft_socket is None and self.draft_cache is None:
            return None
        own = {"socket": self.draft_socket, "socket_dir": None, "cache": None}
        if self.draft_cache is not None:
            own = {"socket": None, "cache": self.draft_cache}
        return dataclasses.replace(
            self, **own, fallback=False, draft_socket=None, draft_cache=None
        )

    def socket_for(self, gpu_uuid: str | None, tp_size: int = 1) -> str:
        """This rank's daemon socket: ``gpu_uuid`` is the rank's GPU (None: CPU)."""
        if self.socket is not None:
            if tp_size > 1:
                raise SettingsError(
                    f"socket names one daemon but the engine runs {tp_size} tensor-parallel "
                    "ranks, one daemon each; use socket_dir + cache so each rank finds its own"
                )
            return self.socket
        assert self.socket_dir is not None and self.cache is not None
        namespace, _, name = self.cache.partition(".")
        try:
            return socket_path(self.socket_dir, namespace, name, gpu_uuid)
        except ValueError as exc:
            raise SettingsError(str(exc)) from None


def _string(where: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise SettingsError(f"{where} must be a non-empty string, got {value!r}")
    return value


def _cache(where: str, value: object) -> str:
    text = _string(where, value)
    namespace, sep, name = text.partition(".")
    if not sep or not namespace or not name or "/" in text:
        raise SettingsError(f"{where} must be NAMESPACE.NAME (the WeightCache), got {text!r}")
    return text


def _transports(where: str, value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        names = [n.strip() for n in value.split(",") if n.strip()]
    elif isinstance(value, (list, tuple)) and all(isinstance(n, str) for n in value):
        names = list(value)
    else:
        raise SettingsError(f"{where} must be a list of transport names, got {value!r}")
    unknown = [n for n in names if n not in TRANSPORT_NAMES]
    if not names or unknown:
        raise SettingsError(
            f"{where}: unknown or no transport(s) {unknown or names!r}; "
            f"expected some of {list(TRANSPORT_NAMES)}"
        )
    return tuple(names)


def _seconds(where: str, value: object) -> float:
    try:
        if isinstance(value, bool):
            raise ValueError
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise SettingsError(f"{where} must be a number of seconds, got {value!r}") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise SettingsError(f"{where} must be >= 0 seconds, got {value!r}")
    return seconds


def _flag(where: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise SettingsError(f"{where} must be true or false, got {value!r}")


def _plan(where: str, value: object) -> str:
    text = _string(where, value)
    if text not in PLAN_NAMES:
        raise SettingsError(f"{where}: unknown shard plan {text!r}; expected one of {PLAN_NAMES}")
    return text


_PARSERS = {
    "socket": _string,
    "socket_dir": _string,
    "cache": _cache,
    "transports": _transports,
    "wait_ready_s": _seconds,
    "fallback": _flag,
    "shard_plan": _plan,
    "draft_socket": _string,
    "draft_cache": _cache,
}
