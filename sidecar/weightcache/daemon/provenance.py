"""Where a daemon's bytes came from: the checkpoint's files as they were when read from disk.

A CacheConfig names a checkpoint by its headers (cheap on purpose), so a file
rewritten in place under the same header keeps its fingerprint. Without more,
bytes read from a poisoned file could outlive the file's repair: re-adopted
from engines after a restart, copied to a neighbour, and copied back, never
compared with the disk again.

So bytes carry their provenance: the stamps of the checkpoint's files (size,
inode, modification and change times) taken just before the disk read they
descend from, recorded in the manifest. A disk load stamps the files; a
re-adopted or seeded copy inherits the stamps of the manifest it was verified
against. A daemon takes bytes from an engine or a neighbour only while the
files still carry those stamps; once anything rewrote, replaced or touched
them, it reads the disk again. Only root on the node could change a file and
restore its change time, and root is outside the threat model.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from weightcache.checkpoint import checkpoint_files


class FileStamp(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    size: int
    inode: int
    mtime_ns: int
    ctime_ns: int


Source = tuple[FileStamp, ...]


def stamp(model_dir: str | Path) -> Source:
    """The checkpoint files' stamps now, by file name."""
    stamps = []
    for path in checkpoint_files(Path(model_dir)):
        st = os.stat(path)
        stamps.append(FileStamp(path.name, st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(sorted(stamps, key=lambda s: s.name))


def difference(recorded: Source, current: Source) -> str | None:
    """What changed between two stamps of the checkpoint (None: nothing)."""
    before = {s.name: s for s in recorded}
    now = {s.name: s for s in current}
    for name in sorted(set(before) | set(now)):
        if name not in before or name not in now:
            return f"{name} {'appeared' if name in now else 'went away'}"
        if before[name] != now[name]:
            return f"{name} was rewritten or replaced"
    return None
