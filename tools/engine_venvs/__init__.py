"""Per-engine virtualenvs for the engine adapter tests, cached outside git.

vLLM and SGLang pin torch versions other than ours (and each other's), so each
gets its own venv at ``~/.cache/weightcache/engines/<engine>-<pin hash>``. The
hash covers the pin files and the interpreter, so a changed pin builds a new
venv and an unchanged one is reused. A venv counts as built only once its
``.complete`` marker is written last; an interrupted build is deleted and
redone on the next run, and venvs of older pins are deleted (several GB each).
weightcache itself is installed editable from the checkout on every run
(seconds), so its entry points are registered exactly as pyproject.toml says.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ENGINES = ("vllm", "sglang")
HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]


def cache_root() -> Path:
    base = os.environ.get("WEIGHTCACHE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "weightcache"
    )
    return Path(base) / "engines"


def pin_files(engine: str) -> list[Path]:
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; expected one of {list(ENGINES)}")
    return [HERE / f"{engine}.txt", HERE / "test.txt"]


def pin_hash(engine: str, python: str = sys.executable) -> str:
    """Digest of what decides the venv's contents: the pins and the interpreter version."""
    digest = hashlib.sha256()
    for path in pin_files(engine):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    version = subprocess.run(
        [python, "-c", "import sys; print(sys.version)"], capture_output=True, text=True, check=True
    ).stdout
    digest.update(version.encode())
    return digest.hexdigest()[:12]


def venv_dir(engine: str) -> Path:
    return cache_root() / f"{engine}-{pin_hash(engine)}"


def _run(argv: list[str]) -> None:
    print("+", " ".join(argv), flush=True)
    subprocess.run(argv, check=True)


def _remove_stale(engine: str, keep: Path) -> None:
    """Venvs of older pins of this engine: several GB each."""
    root = cache_root()
    if not root.exists():
        return
    for path in root.iterdir():
        if path != keep and path.name.startswith(f"{engine}-"):
            print(f"removing stale {path}", flush=True)
            shutil.rmtree(path, ignore_errors=True)


def build(engine: str) -> Path:
    """The engine's venv, built if missing; weightcache (editable) refreshed when it changed."""
    target = venv_dir(engine)
    _remove_stale(engine, keep=target)
    if not (target / ".complete").exists():
        # Built in place (venv scripts embed their path), complete only with the marker.
        shutil.rmtree(target, ignore_errors=True)
        started = time.monotonic()
        _run([sys.executable, "-m", "venv", str(target)])
        pip = [str(target / "bin" / "python"), "-m", "pip", "--no-cache-dir", "-q"]
        _run([*pip, "install", "--upgrade", "pip"])
        requirements = [a for p in pin_files(engine) for a in ("-r", str(p))]
        _run([*pip, "install", *requirements])
        seconds = time.monotonic() - started
        (target / ".complete").write_text(f"built in {seconds:.0f} s\n")
        print(f"{engine} venv built in {seconds:.0f} s at {target}", flush=True)
    _install_weightcache(target)
    return target


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
    # --no-deps: the engine's pins already satisfy ours; never let pip move its torch.
    _run(
        [python, "-m", "pip", "--no-cache-dir", "-q", "install", "--no-deps", "-e", str(REPO_ROOT)]
    )
    missing = subprocess.run(
        [python, "-c", "import msgspec, safetensors, prometheus_client"], capture_output=True
    )
    if missing.returncode != 0:
        _run([python, "-m", "pip", "--no-cache-dir", "-q", "install", "msgspec", "safetensors",
              "prometheus-client"])  # fmt: skip
    stamp.touch()


def python(engine: str) -> Path:
    return build(engine) / "bin" / "python"
