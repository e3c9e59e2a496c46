"""weightcache.integrations.settings: engine config over environment, errors that name the key."""

from __future__ import annotations

import pytest

from weightcache.integrations.settings import (
    ABSENT_WAIT_S,
    DEFAULT_WAIT_READY_S,
    AdapterSettings,
    SettingsError,
)

UUID = "GPU-0a1b2c3d-0000-1111-2222-333344445555"


def test_engine_config_wins_over_environment_and_values_are_parsed() -> None:
    env = {
        "WEIGHTCACHE_SOCKET_DIR": "/env/dir",
        "WEIGHTCACHE_CACHE": "envns.envname",
        "WEIGHTCACHE_TRANSPORTS": "memfd, torch_ipc",
        "WEIGHTCACHE_WAIT_READY_S": "12.5",
        "WEIGHTCACHE_FALLBACK": "yes",
    }
    settings = AdapterSettings.from_sources(
        {"socket_dir": "/run/weightcache", "cache": "prod.llama", "fallback": False}, env
    )
    assert settings.socket_dir == "/run/weightcache"
    assert settings.cache == "prod.llama"
    assert settings.transports == ("memfd", "torch_ipc")
    assert settings.wait_ready_s == 12.5
    assert settings.fallback is False


def test_defaults_fall_back_to_disk_and_wait_long_only_for_a_loading_daemon() -> None:
    settings = AdapterSettings.from_sources({"socket": "/tmp/d.sock"}, {})
    assert settings.fallback is True  # as vLLM's own weight cache
    assert settings.wait_ready_s == DEFAULT_WAIT_READY_S == 300
    assert settings.absent_wait_s == ABSENT_WAIT_S == 10
    assert settings.transports is None
    assert (
        AdapterSettings.from_sources({"socket": "/d.sock", "fallback": "off"}, {}).fallback is False
    )


def test_each_rank_derives_the_socket_the_daemon_names_by_gpu_uuid() -> None:
    settings = AdapterSettings.from_sources({"socket_dir": "/run/wc/", "cache": "ns.m"}, {})
    assert settings.socket_for(UUID, tp_size=4) == f"/run/wc/ns.m/gpu-{UUID}.sock"
    assert settings.socket_for(None) == "/run/wc/ns.m/cpu.sock"


def test_one_explicit_socket_cannot_serve_several_ranks() -> None:
    settings = AdapterSettings.from_sources({"socket": "/tmp/d.sock"}, {})
    assert settings.socket_for(UUID) == "/tmp/d.sock"
    with pytest.raises(SettingsError, match="4 tensor-parallel ranks"):
        settings.socket_for(UUID, tp_size=4)


def test_socket_paths_over_the_unix_limit_are_refused() -> None:
    settings = AdapterSettings.from_sources({"socket_dir": "/" + "d" * 80, "cache": "ns.m"}, {})
    with pytest.raises(SettingsError, match="107-byte limit"):
        settings.socket_for(UUID)


@pytest.mark.parametrize(
    ("config", "env", "message"),
    [
        ({"sockett": "/x"}, {}, r"unknown weightcache loader config key\(s\) \['sockett'\]"),
        ({}, {}, "no daemon socket configured"),
        ({"socket_dir": "/run/wc"}, {}, "no daemon socket configured"),
        ({"socket": "/x", "socket_dir": "/y", "cache": "a.b"}, {}, "not both"),
        ({"socket_dir": "/y", "cache": "nodot"}, {}, "'cache' must be NAMESPACE.NAME"),
        ({"socket": "/x", "transports": ["nvlink"]}, {}, r"'transports': unknown"),
        ({"socket": "/x"}, {"WEIGHTCACHE_TRANSPORTS": ""}, "WEIGHTCACHE_TRANSPORTS: unknown"),
        ({"socket": "/x", "wait_ready_s": -1}, {}, "'wait_ready_s' must be >= 0"),
        ({"socket": "/x"}, {"WEIGHTCACHE_WAIT_READY_S": "soon"}, "WEIGHTCACHE_WAIT_READY_S"),
        ({"socket": "/x", "wait_ready_s": True}, {}, "number of seconds"),
        ({"socket": "/x"}, {"WEIGHTCACHE_FALLBACK": "maybe"}, "must be true or false"),
        ({"socket": "/x", "shard_plan": "mixtral"}, {}, "unknown shard plan 'mixtral'"),
        ({"socket": 3}, {}, "'socket' must be a non-empty string"),
    ],
)
def test_bad_settings_name_what_is_wrong(config: dict, env: dict, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        AdapterSettings.from_sources(config, env)


def test_a_draft_without_a_cache_of_its_own_loads_from_disk_even_without_fallback() -> None:
    settings = AdapterSettings.from_sources({"socket": "/tmp/d.sock", "fallback": False}, {})
    assert settings.for_draft() is None


def test_a_draft_cache_is_its_own_and_never_falls_back() -> None:
    by_cache = AdapterSettings.from_sources(
        {"socket_dir": "/run/wc", "cache": "ns.target"}, {"WEIGHTCACHE_DRAFT_CACHE": "ns.draft"}
    ).for_draft()
    assert by_cache is not None and by_cache.fallback is False  # configured: must be usable
    assert by_cache.socket_for(None) == "/run/wc/ns.draft/cpu.sock"
    assert by_cache.for_draft() is None
    by_socket = AdapterSettings.from_sources(
        {"socket_dir": "/run/wc", "cache": "ns.target", "draft_socket": "/tmp/draft.sock"}, {}
    ).for_draft()
    assert by_socket is not None and by_socket.socket_for(None) == "/tmp/draft.sock"
    assert by_socket.fallback is False


def test_draft_settings_that_cannot_name_one_daemon_are_refused() -> None:
    with pytest.raises(SettingsError, match="either draft_socket or draft_cache"):
        AdapterSettings.from_sources(
            {"socket_dir": "/d", "cache": "n.m", "draft_socket": "/x", "draft_cache": "n.d"}, {}
        )
    with pytest.raises(SettingsError, match="draft_cache names a WeightCache under socket_dir"):
        AdapterSettings.from_sources({"socket": "/d.sock", "draft_cache": "n.d"}, {})
    with pytest.raises(SettingsError, match="must be NAMESPACE.NAME"):
        AdapterSettings.from_sources({"socket_dir": "/d", "cache": "n.m", "draft_cache": "x"}, {})
