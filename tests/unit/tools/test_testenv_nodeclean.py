import json
from pathlib import Path

from tools.testenv import nodeclean, nodeconfig


def test_mounts_under_lists_deepest_first() -> None:
    info = "\n".join(
        f"{i} 1 0:1 / {point} rw - tmpfs tmpfs rw"
        for i, point in enumerate(["/", "/r", "/r/a", "/r/a/b", "/rr", "/s/x\\040y"])
    )
    assert nodeclean.mounts_under("/r", "/s", mountinfo=info) == ["/r/a/b", "/r/a", "/s/x y", "/r"]


def test_state_round_trips_the_layout(tmp_path: Path) -> None:
    layout = nodeconfig.Layout(run=str(tmp_path), store=str(tmp_path / "s"), name="n", cgroup="c",
                         cluster_ip="10.96.0.1", sockets=str(tmp_path / "t"))
    nodeclean.write_state(layout, {"layout": layout.__dict__, "sysctls": {}, "created_dirs": []})
    assert nodeconfig.Layout(**json.loads(layout.state_file.read_text())["layout"]) == layout


def test_mount_points_decode_every_escape_the_kernel_writes() -> None:
    info = "1 1 0:1 / /h/a\\011b\\012c\\134d rw - tmpfs tmpfs rw"
    assert nodeclean.mount_points(info) == ["/h/a\tb\nc\\d"]
