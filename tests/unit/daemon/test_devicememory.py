"""The device's memory as the daemon reports it and as --rollout auto checks it.

The cgroup files are written as the kernel lays them out (v1 and v2, a container's
mount at its own cgroup); the daemon's own process is read for real at the end.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from weightcache.daemon import devicememory
from weightcache.daemon.devicememory import DeviceMemory
from weightcache.daemon.generations import ROOM_MARGIN, Generations, Room

MIB = 1 << 20


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_cgroup_v2_takes_the_tightest_limit_of_its_cgroup_and_those_above(tmp_path) -> None:
    write(tmp_path, {"kubepods/pod1/ctr/memory.max": "max\n",
                     "kubepods/pod1/ctr/memory.current": "100\n",
                     "kubepods/pod1/memory.max": f"{512 * MIB}\n",
                     "kubepods/pod1/memory.current": f"{200 * MIB}\n"})
    found = devicememory.cgroup_memory("0::/kubepods/pod1/ctr\n", tmp_path)
    assert found is not None and (found.total, found.free) == (512 * MIB, 312 * MIB)
    assert found.source == f"cgroup v2 {tmp_path / 'kubepods/pod1'}"


def test_cgroup_v1_inside_a_container_reads_its_own_mount(tmp_path) -> None:
    """The host path /proc/self/cgroup names does not exist under the container's mount,
    which is the container's own cgroup."""
    write(tmp_path, {"memory/memory.limit_in_bytes": f"{1024 * MIB}\n",
                     "memory/memory.usage_in_bytes": f"{700 * MIB}\n"})
    lines = "12:pids:/x\n4:memory:/node/kubepods/burstable/pod9/abc\n0::/\n"
    found = devicememory.cgroup_memory(lines, tmp_path)
    assert found is not None and (found.total, found.free) == (1024 * MIB, 324 * MIB)


def test_inactive_page_cache_is_room_as_the_kubelet_counts_it(tmp_path) -> None:
    """A checkpoint read from disk leaves page cache charged to the cgroup; the kernel
    reclaims its inactive part before an OOM kill, so it is free (the kubelet's working
    set is usage less inactive_file). Active file pages and shmem (the weights' memfd)
    are not on that list, and stay used."""
    write(tmp_path, {"pod/memory.max": f"{1024 * MIB}\n",
                     "pod/memory.current": f"{900 * MIB}\n",
                     "pod/memory.stat": f"anon {100 * MIB}\nfile {800 * MIB}\n"
                                        f"shmem {300 * MIB}\nactive_file {100 * MIB}\n"
                                        f"inactive_file {400 * MIB}\n"})
    found = devicememory.cgroup_memory("0::/pod\n", tmp_path)
    assert found is not None and (found.total, found.free) == (1024 * MIB, 524 * MIB)


def test_cgroup_v1_takes_the_hierarchys_inactive_page_cache(tmp_path) -> None:
    """v1's memory.stat has the cgroup's own inactive_file and total_inactive_file, its
    children's included, as usage_in_bytes includes them: the total is the one to take."""
    write(tmp_path, {"memory/pod/memory.limit_in_bytes": f"{1024 * MIB}\n",
                     "memory/pod/memory.usage_in_bytes": f"{700 * MIB}\n",
                     "memory/pod/memory.stat": f"inactive_file 0\nactive_file 0\n"
                                               f"total_inactive_file {200 * MIB}\n"})
    found = devicememory.cgroup_memory("4:memory:/pod\n", tmp_path)
    assert found is not None and found.free == 524 * MIB


def test_without_memory_stat_the_whole_usage_counts(tmp_path) -> None:
    write(tmp_path, {"pod/memory.max": f"{1024 * MIB}\n",
                     "pod/memory.current": f"{900 * MIB}\n"})
    found = devicememory.cgroup_memory("0::/pod\n", tmp_path)
    assert found is not None and found.free == 124 * MIB


def test_without_a_limit_the_nodes_meminfo_counts(tmp_path) -> None:
    write(tmp_path, {"memory/memory.limit_in_bytes": "9223372036854771712\n",
                     "memory/memory.usage_in_bytes": "1\n",
                     "proc/cgroup": "4:memory:/\n",
                     "proc/meminfo": "MemTotal:       16384 kB\nMemFree:  1 kB\n"
                                     "MemAvailable:    8192 kB\n"})
    found = devicememory.cpu_memory(tmp_path / "proc/cgroup", tmp_path,
                                    tmp_path / "proc/meminfo")
    assert found == DeviceMemory(16384 * 1024, 8192 * 1024, "meminfo")
    with pytest.raises(ValueError, match="MemAvailable"):
        devicememory.meminfo_memory("MemTotal: 1 kB\n")


def test_this_process_is_read_for_real() -> None:
    found = devicememory.sample(torch.device("cpu"))
    assert found is not None and 0 <= found.free <= found.total


class FakeKept(Generations):
    """Kept bytes as a number: what Room reads of the kept generations."""

    def __init__(self, kept: int) -> None:
        super().__init__("/nonexistent/cpu.sock", None, torch.device("cpu"))  # type: ignore[arg-type]
        self.kept = kept

    def __bool__(self) -> bool:
        return self.kept > 0

    def total_bytes(self) -> int:
        return self.kept


def test_a_load_waits_for_room_only_beside_kept_generations_and_only_under_auto() -> None:
    """The device's memory is a stand-in here (no test can fill a real device to order):
    what is checked is the decision and the wait, which the daemon runs as is."""
    memory = {"free": 1000 * MIB}
    kept = FakeKept(400 * MIB)
    changes: list[bool] = []
    room = Room(torch.device("cpu"), "auto", kept,
                lambda _: DeviceMemory(4096 * MIB, memory["free"], "test"),
                poll_seconds=0.01, on_change=lambda: changes.append(room.waiting))
    # 1000 free, 400 of it kept elsewhere (a CPU): 600 left, 344 + 256 fit.
    room.wait(344 * MIB, "fits")
    assert changes == []
    done = threading.Event()
    threading.Thread(target=lambda: (room.wait(400 * MIB, "too big"), done.set()),
                     daemon=True).start()
    time.sleep(0.2)
    assert not done.is_set() and room.waiting and changes == [True]
    kept.kept = 0  # dropped: nothing kept, nothing to wait for
    assert done.wait(5) and not room.waiting and changes == [True, False]
    # On a GPU the free memory already counts the kept weights: nothing is taken off.
    gpu = Room(torch.device("cuda", 0), "auto", FakeKept(1 << 40),
               lambda _: DeviceMemory(1 << 34, 2 * ROOM_MARGIN, "cuda"), poll_seconds=0.01)
    gpu.wait(ROOM_MARGIN, "fits on the GPU")
    # surge loads regardless, and so does a daemon that cannot read its memory.
    Room(torch.device("cpu"), "surge", FakeKept(1 << 40),
         lambda _: DeviceMemory(1, 0, "test")).wait(1 << 30, "surge")
    Room(torch.device("cpu"), "auto", FakeKept(1 << 40), lambda _: None).wait(1 << 30, "blind")
