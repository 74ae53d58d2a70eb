"""Files and folders written so that a kill or a power loss never leaves a torn one where a
reader looks: new contents go beside the old, are flushed to the disk, and are renamed into
place (a rename within one folder is atomic), and the folder that holds them is flushed so
that the rename itself survives."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


def fsync(path: Path) -> None:
    """Flush a file's contents, or a folder's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text(path: Path, text: str) -> None:
    """`text` as `path`'s contents, all or nothing: written to a temp file beside it,
    flushed, renamed over it, and its folder flushed."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync(path.parent)


@contextlib.contextmanager
def replaced_folder(out_dir: Path) -> Iterator[Path]:
    """A new, empty folder beside `out_dir` (`.NAME.tmp`) to write `out_dir`'s contents
    into. When the block ends, that folder is flushed and takes `out_dir`'s place: an old
    `out_dir` is renamed aside (`.NAME.old`), the new one renamed in, the old deleted. A kill
    between the two renames leaves no `out_dir` (the old one whole beside it), never a
    half-written one; an exception in the block leaves `out_dir` as it was. Leftovers of a
    killed earlier call are removed."""
    out_dir = Path(out_dir)
    tmp, old = (out_dir.with_name(f".{out_dir.name}.{suffix}") for suffix in ("tmp", "old"))
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        _fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out_dir.exists():
        shutil.rmtree(old, ignore_errors=True)
        out_dir.rename(old)
    tmp.rename(out_dir)
    fsync(out_dir.parent)
    shutil.rmtree(old, ignore_errors=True)


def _fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            fsync(Path(folder) / name)
        fsync(Path(folder))
