"""operator/Dockerfile, sidecar/Dockerfile and examples/minilm-engine.Dockerfile, read as text.

Checks what a build would otherwise only reveal later: pinned bases (no
`latest`, no bare name), a non-root final USER, COPY sources that exist in the
build context (the repository root), and pip installs pinned to exact versions.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.unit.chart.chartkit import CHART, REPO_ROOT

DOCKERFILES = [
    REPO_ROOT / "operator" / "Dockerfile",
    REPO_ROOT / "sidecar" / "Dockerfile",
    REPO_ROOT / "examples" / "minilm-engine.Dockerfile",
]


@dataclass
class Stage:
    image: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, rest = line.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a line continuation"
    return out


def substitute(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], m[0]), value)


def stages(path: Path) -> list[Stage]:
    args: dict[str, str] = {}
    result: list[Stage] = []
    for keyword, rest in instructions(path.read_text()):
        if keyword == "ARG" and not result:
            name, _, default = rest.partition("=")
            args[name] = default
        elif keyword == "FROM":
            parts = rest.split()
            image = substitute(parts[0], args)
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
            result.append(Stage(image, name))
        else:
            assert result, f"{path}: {keyword} before the first FROM"
            result[-1].instructions.append((keyword, rest))
    return result


def is_pinned(image: str) -> bool:
    if "@sha256:" in image:
        return re.fullmatch(r".+@sha256:[0-9a-f]{64}", image) is not None
    last = image.rsplit("/", 1)[-1]
    if ":" not in last:
        return False
    tag = last.rsplit(":", 1)[1]
    # An exact version, not a moving alias like latest, stable or a bare major.
    return tag != "latest" and re.search(r"\d+\.\d+", tag) is not None


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_bases_are_pinned(dockerfile: Path) -> None:
    names = {s.name for s in stages(dockerfile) if s.name}
    for stage in stages(dockerfile):
        if stage.image in names:
            continue
        assert "$" not in stage.image, f"{dockerfile}: unresolved base {stage.image}"
        assert is_pinned(stage.image), f"{dockerfile}: base {stage.image} is not pinned"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_final_stage_runs_as_non_root(dockerfile: Path) -> None:
    final = stages(dockerfile)[-1]
    users = [rest for keyword, rest in final.instructions if keyword == "USER"]
    assert users, f"{dockerfile}: the final stage sets no USER (it would run as root)"
    user, _, group = users[-1].partition(":")
    assert user not in ("root", "0"), f"{dockerfile}: USER {users[-1]}"
    assert group not in ("root", "0"), f"{dockerfile}: USER {users[-1]}"
    assert user.isdigit(), f"{dockerfile}: USER {user} should be numeric (runAsNonRoot checks uids)"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_copy_sources_exist_in_the_build_context(dockerfile: Path) -> None:
    for stage in stages(dockerfile):
        for keyword, rest in stage.instructions:
            if keyword not in ("COPY", "ADD") or "--from=" in rest:
                continue
            *sources, _ = shlex.split(rest)
            for source in sources:
                assert (REPO_ROOT / source).exists(), (
                    f"{dockerfile}: COPY {source}: not in the build context (repository root)")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_pip_installs_are_pinned(dockerfile: Path) -> None:
    final = stages(dockerfile)[-1]
    installs = 0
    for keyword, rest in final.instructions:
        if keyword != "RUN":
            continue
        for command in rest.split("&&"):
            words = shlex.split(command)
            if words[:2] != ["pip", "install"]:
                continue
            installs += 1
            for word in words[2:]:
                if word.startswith("-"):
                    continue
                local = word.startswith("/wheels/") or word.startswith("${wheel}")
                assert local or "==" in word, f"{dockerfile}: pip install {word} is not pinned"
    assert installs, f"{dockerfile}: the final stage installs nothing"


def test_the_daemon_image_runs_as_the_daemons_uid_not_the_operators() -> None:
    """Issue 25 item 13: the sidecar image said USER 65532:65532, the operator's uid."""
    from weightcache_operator.spec import DEFAULT_RUN_AS

    def user(path: Path) -> str:
        final = stages(path)[-1]
        return [rest for keyword, rest in final.instructions if keyword == "USER"][-1]

    operator_uid = yaml.safe_load((CHART / "values.yaml").read_text())[
        "podSecurityContext"]["runAsUser"]
    assert user(REPO_ROOT / "operator" / "Dockerfile") == f"{operator_uid}:{operator_uid}"
    assert user(REPO_ROOT / "sidecar" / "Dockerfile") == f"{DEFAULT_RUN_AS}:{DEFAULT_RUN_AS}"
    assert DEFAULT_RUN_AS != operator_uid
