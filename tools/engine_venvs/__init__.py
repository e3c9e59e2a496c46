"""Per-engine virtualenvs for the engine adapter tests, cached outside git.

The adapters support a range of engine releases (docs/engines.md): the
pinned one and the previous minor of each engine. Each release gets its own
venv (vLLM and SGLang pin torch versions other than ours and each other's) at
``~/.cache/weightcache/engines/<venv>-<pin hash>``; :data:`VENVS` names them,
the engine whose adapter they test, and the test modules run in each.

A venv's pins are ``<venv>.txt`` plus ``test.txt`` (pip requirement files)
and, where a release's own metadata cannot be installed from PyPI as it is,
``<venv>.overrides.txt`` (uv's ``--overrides``: replaces that requirement for
every package). The hash covers those files and the interpreter, so a changed
pin builds a new venv and an unchanged one is reused. Builds run one at a
time under a file lock (another checkout may be building); a venv counts as
built only once its ``.complete`` marker is written last; an interrupted build
is redone on the next run; venvs of older pins are deleted (several GB each).

Packages are installed with uv: pip cannot override a dependency's pin, and
uv's parallel install halves a cold build. The venvs share one uv cache beside
them, installed from by hard links: a wheel two venvs need (torch 2.14.1 and
the CUDA libraries for both SGLang venvs, most of the rest for all four) is
downloaded once and stored once, on a fresh machine as here (the four venvs
hold about 38 GB of files, 20 GB of them distinct). Deleting a stale venv
also clears the cache (the live venvs keep their files: hard links), so old
pins leave nothing behind. weightcache itself is installed editable from the
checkout (seconds), so its entry points are registered exactly as
pyproject.toml says.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]


@dataclass(frozen=True)
class EngineVenv:
    """One engine release's venv: ``engine`` is the adapter it tests."""

    name: str
    engine: str
    tests: tuple[str, ...]
    # Test ids (``<module>::<test>``) left out in this venv, each named in pytest's summary
    # ("N deselected"); docs/engines.md, "Verified", says which and why.
    deselect: tuple[str, ...] = ()


# Underscores, not hyphens, in the names of added venvs: a venv named "<engine>-..."
# would look stale to the stale-venv cleanup of checkouts older than this module.
VENVS: dict[str, EngineVenv] = {
    venv.name: venv
    for venv in (
        # The adapter tests run in every venv; each server test, the mixed-torch test and
        # vLLM's KV sizing test once, the engine-layout tests at TP 2 in the pinned
        # releases only: the previous minors run them at TP 1, through the same weight
        # loaders that TP 2 shards with (a rank process each, a minute per venv;
        # docs/engines.md, "Verified").
        EngineVenv(
            "vllm",
            "vllm",
            ("test_vllm.py", "test_vllm_layouts.py", "test_vllm_kv.py", "test_mixed_torch.py"),
        ),
        # vLLM's CPU build: the only one whose worker starts on CPU (and generates), so the
        # server tests: MiniLM's embeddings, and decoders generating (issue 33).
        EngineVenv(
            "vllm_prev",
            "vllm",
            ("test_vllm.py", "test_vllm_layouts.py", "test_vllm_server.py",
             "test_vllm_decoders.py"),
            deselect=(
                "test_vllm_layouts.py::"
                "test_at_tp_2_each_rank_maps_its_own_layout_bit_equal_to_a_cold_load",
            ),
        ),
        # The server test, and sglang_real.py's engine process generating on CPU (the GPU
        # run's dry run), once.
        EngineVenv(
            "sglang", "sglang", ("test_sglang.py", "test_sglang_server.py", "test_sglang_real.py")
        ),
        EngineVenv(
            "sglang_prev",
            "sglang",
            ("test_sglang.py",),
            deselect=(
                "test_sglang.py::test_llama_qwen2_and_moe_classes_map_sglangs_own_layout_at_tp[2]",
            ),
        ),
    )
}
ENGINES = ("vllm", "sglang")


def cache_root() -> Path:
    base = os.environ.get("WEIGHTCACHE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "weightcache"
    )
    return Path(base) / "engines"


def _venv(name: str) -> EngineVenv:
    if name not in VENVS:
        raise ValueError(f"unknown engine venv {name!r}; expected one of {list(VENVS)}")
    return VENVS[name]


def pin_files(name: str) -> list[Path]:
    _venv(name)
    return [HERE / f"{name}.txt", HERE / "test.txt"]


def overrides_file(name: str) -> Path | None:
    path = HERE / f"{name}.overrides.txt"
    return path if path.exists() else None


def pin_hash(name: str, python: str = sys.executable) -> str:
    """Digest of what decides the venv's contents: the pins and the interpreter version."""
    digest = hashlib.sha256()
    files = pin_files(name) + [p for p in [overrides_file(name)] if p is not None]
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    version = subprocess.run(
        [python, "-c", "import sys; print(sys.version)"], capture_output=True, text=True, check=True
    ).stdout
    digest.update(version.encode())
    return digest.hexdigest()[:12]


def venv_dir(name: str) -> Path:
    return cache_root() / f"{name}-{pin_hash(name)}"


def uv() -> str:
    """The uv binary of the test extra (``pip install -e '.[test]'``)."""
    from uv import find_uv_bin

    return find_uv_bin()


def _run(argv: list[str]) -> None:
    print("+", " ".join(argv), flush=True)
    # Never fetch an interpreter: the venv uses ours.
    subprocess.run(argv, check=True, env={**os.environ, "UV_PYTHON_DOWNLOADS": "never"})


def _remove_stale(name: str, keep: Path) -> bool:
    """Delete the venvs of older pins of this venv (several GB each); whether any was."""
    root = cache_root()
    if not root.exists():
        return False
    stale = re.compile(re.escape(name) + r"-[0-9a-f]{12}")
    removed = False
    for path in root.iterdir():
        if path != keep and stale.fullmatch(path.name):
            print(f"removing stale {path}", flush=True)
            shutil.rmtree(path, ignore_errors=True)
            removed = True
    return removed


def uv_cache() -> Path:
    """uv's cache, shared by the venvs (hard links need the same file system)."""
    return cache_root() / ".uv-cache"


def build(name: str) -> Path:
    """The venv, built if missing; weightcache (editable) refreshed when it changed."""
    target = venv_dir(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    # One lock for all venvs: they share uv's cache, which a stale venv's removal clears.
    with open(target.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another checkout may be building
        if _remove_stale(name, keep=target):
            shutil.rmtree(uv_cache(), ignore_errors=True)  # live venvs keep their links
        if not (target / ".complete").exists():
            _build(name, target)
        _install_weightcache(target)
    return target


def _build(name: str, target: Path) -> None:
    # Built in place (venv scripts embed their path), complete only with the marker.
    shutil.rmtree(target, ignore_errors=True)
    started = time.monotonic()
    _run([uv(), "venv", "--quiet", "--python", sys.executable, str(target)])
    requirements = [a for p in pin_files(name) for a in ("-r", str(p))]
    overrides = overrides_file(name)
    if overrides is not None:
        requirements += ["--overrides", str(overrides)]
    # Hard links from the shared cache: each distinct file stored once across the venvs.
    # Bytecode compiled now (about 90 CPU-seconds a venv): engine processes start many
    # times in the tests and may not write it themselves (PYTHONDONTWRITEBYTECODE), and
    # an import without it costs 2.5 times the CPU (SGLang's server modules: 37 s, 15 s).
    _run([uv(), "pip", "install", "--quiet", "--cache-dir", str(uv_cache()),
          "--link-mode", "hardlink", "--compile-bytecode",
          "--python", str(target / "bin" / "python"), *requirements])  # fmt: skip
    seconds = time.monotonic() - started
    (target / ".complete").write_text(f"built in {seconds:.0f} s\n")
    print(f"{name} venv built in {seconds:.0f} s at {target}", flush=True)


def _install_weightcache(target: Path) -> None:
    """Editable install of this checkout; redone only when the checkout or pyproject changes."""
    pyproject = REPO_ROOT / "pyproject.toml"
    key = hashlib.sha256(str(REPO_ROOT).encode() + b"\0" + pyproject.read_bytes()).hexdigest()
    stamp = target / f".weightcache-{key[:12]}"
    if stamp.exists():
        return
    for old in target.glob(".weightcache-*"):
        old.unlink()
    python = str(target / "bin" / "python")
    install = [uv(), "pip", "install", "--quiet", "--no-cache", "--python", python]
    # --no-deps: the engine's pins already satisfy ours; never let the installer move its torch.
    _run([*install, "--no-deps", "-e", str(REPO_ROOT)])
    missing = subprocess.run(
        [python, "-c", "import msgspec, safetensors, prometheus_client"], capture_output=True
    )
    if missing.returncode != 0:
        _run([*install, "msgspec", "safetensors", "prometheus-client"])
    stamp.touch()


def python(name: str) -> Path:
    return build(name) / "bin" / "python"
