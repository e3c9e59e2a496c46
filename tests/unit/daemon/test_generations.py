"""Two generations resident (issue 42 item 1): real daemon and engine processes over memfd.

A daemon that a model change replaces (here: another `--revision` and spec hash, the
same MiniLM files, so both generations have equal sizes: the fine-tune case) takes the
old generation's weights back from the engines that map them, keeps them, serves them
to an engine asking for exactly their config, and drops them once no engine holds them;
a rollback takes the kept weights back as its own. What an engine hands back counts only
when its keyed digests match, at the take-back and at every later check.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.unit.daemon.test_readopt import FORGER
from tests.unit.wc_harness import DaemonProcess, package_env, wait_until
from weightcache.daemon.manifest import (
    manifest_path,
    read_manifest,
    retained_fingerprints,
    retained_manifest_path,
)
from weightcache.protocol import DaemonStatus
from weightcache.report import SPEC_HASH_ENV

H1, H2 = "1" * 64, "2" * 64
GRACE = ("--retained-grace-seconds", "2", "--retained-check-seconds", "0.5")

# Attaches asking for exactly the config of revision REV (an engine of that generation
# restarting in its pod), prints the fingerprint and the checksum of its tensors.
ENGINE = textwrap.dedent(
    """
    import sys, torch
    from weightcache.checkpoint import cache_config, read_checkpoint
    from weightcache.client import attach
    config = cache_config(read_checkpoint(sys.argv[2]), torch.device("cpu"), None, None,
                          sys.argv[3])
    attached = attach(sys.argv[1], config=config, transports=["memfd"])
    total = sum(float(t.double().sum()) for t in attached.tensors.values())
    print(attached.fingerprint, total, flush=True)
    sys.stdin.read()
    """
)


class Generation(DaemonProcess):
    """A daemon whose generation (revision, spec hash) a test changes between starts."""

    spec_hash: str = H1

    def environment(self) -> dict[str, str]:
        return {**package_env(), SPEC_HASH_ENV: self.spec_hash}

    def roll(self, revision: str, spec_hash: str) -> DaemonStatus:
        """The daemon pod replaced by one of another generation (kill -9, then start)."""
        self.kill()
        self.spec_hash = spec_hash
        self.extra_args = ("--transport", "memfd", "--revision", revision, *GRACE)
        return self.start().status()


@pytest.fixture
def generation(daemons, minilm_dir: Path) -> Generation:
    daemon = Generation(minilm_dir, daemons.workdir(),
                        ("--transport", "memfd", "--revision", "r1", *GRACE))
    return daemons.adopt(daemon.start())


def start_engine(engines, daemon: Generation, revision: str):
    """An engine of `revision` (its argv: socket, model, revision)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", ENGINE, daemon.socket, str(daemon.model_dir), revision],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=package_env())
    engines.procs.append(proc)
    line = proc.stdout.readline().split()
    if len(line) != 2:
        proc.kill()
        raise AssertionError(f"engine of {revision} failed: {proc.stderr.read()}")
    return proc, line[0], float(line[1])


def stop(proc) -> None:
    proc.stdin.close()
    proc.kill()
    proc.wait()


def test_a_model_change_keeps_the_old_weights_serves_them_and_drops_them_unheld(
    generation: Generation, engines, minilm_reference
) -> None:
    old, fp1, sum1 = start_engine(engines, generation, "r1")
    assert read_manifest(manifest_path(generation.socket)).spec_hash == H1

    status = generation.roll("r2", H2)  # the model changed: a new daemon pod
    assert status.state == "ready" and status.load_source == "disk"
    assert [(r.spec_hash, r.fingerprint) for r in status.retained] == [(H1, fp1)]
    assert "kept layout" in status.load_reason and "every checksum matching" in status.load_reason
    assert read_manifest(manifest_path(generation.socket)).spec_hash == H2
    assert read_manifest(retained_manifest_path(generation.socket, fp1)).fingerprint == fp1
    assert status.memory_total_bytes and status.memory_free_bytes is not None

    # An old engine restarting in its pod asks for exactly its config: served the kept
    # weights (the same values); a new one gets the new generation.
    _, again, sum_again = start_engine(engines, generation, "r1")
    new, fp2, sum2 = start_engine(engines, generation, "r2")
    assert (again, sum_again) == (fp1, sum1) and fp2 != fp1 and sum2 == sum1
    expected = sum(float(t.double().sum()) for t in minilm_reference.values())
    assert sum1 == pytest.approx(expected)

    # A rollback: the kept weights are this generation's again (re-adopted, nothing read),
    # and the generation it replaces is kept in turn.
    status = generation.roll("r1", H1)
    assert status.load_source == "readopted", status.load_reason
    assert status.fingerprint == fp1
    assert [(r.spec_hash, r.fingerprint) for r in status.retained] == [(H2, fp2)]
    assert read_manifest(manifest_path(generation.socket)).fingerprint == fp1
    assert retained_fingerprints(generation.socket) == [fp2]

    # The last engine of r2 goes: the kept weights go 2 s later (checked every 0.5 s).
    stop(new)
    def dropped() -> DaemonStatus | None:
        status = generation.status()
        return None if status.retained else status

    assert wait_until(dropped, "the kept generation dropped", within=60).state == "ready"
    assert retained_fingerprints(generation.socket) == []
    assert "dropped the kept layout" in generation.log()
    stop(old)


def test_only_verified_bytes_are_kept_and_only_they_count_as_held(
    generation: Generation, engines
) -> None:
    """An engine that offers other bytes of the same size under the old fingerprint (a
    fine-tune with the same shapes) is neither taken back nor counted as holding the kept
    weights: once the real holder is gone they are dropped although it still answers."""
    forger = engines.start(generation.socket, FORGER)
    holder, fp1, _ = start_engine(engines, generation, "r1")
    assert forger.line == fp1

    status = generation.roll("r2", H2)
    assert [r.fingerprint for r in status.retained] == [fp1]
    stop(holder)
    # Checked by sizes alone, the forger would hold them for good.
    wait_until(lambda: not generation.status().retained, "the kept generation dropped",
               within=60)
    assert forger.poll() is None  # it kept answering all along


def test_other_bytes_are_never_taken_back(generation: Generation, engines) -> None:
    forger = engines.start(generation.socket, FORGER)
    status = generation.roll("r2", H2)
    assert forger.line and status.retained == [] and status.load_source == "disk"
    assert "does not match the manifest" in status.load_reason


def test_without_an_engine_of_the_old_generation_nothing_is_kept(
    generation: Generation,
) -> None:
    status = generation.roll("r2", H2)
    assert status.retained == [] and status.load_source == "disk"
    assert retained_fingerprints(generation.socket) == []
    assert "manifest is stale" in status.load_reason


def test_a_kept_generation_is_listed_with_its_waiting_time(
    generation: Generation, engines
) -> None:
    holder, fp1, _ = start_engine(engines, generation, "r1")
    generation.roll("r2", H2)
    time.sleep(1.0)
    (kept,) = generation.status().retained
    assert kept.fingerprint == fp1 and kept.unheld_seconds < 2  # the checks find it held
    assert kept.bytes >= kept.expected_bytes > 0
    stop(holder)
