"""Crash-safe files: write under a temporary name in the same directory, fsync, rename into place, fsync the
directory. A reader then sees the old file or the new one, never a torn one (checkpoints, the data cache,
Hugging Face exports and `latest` pointers all go through here)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory (best effort: some filesystems refuse it on directories)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temp_name(path: str | os.PathLike) -> Path:
    """A unique sibling of `path` that readers ignore (`<name>.tmp-<random>`)."""
    path = Path(path)
    return path.with_name(f"{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def replace_durably(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Rename a fully written `tmp` (file or directory) onto `path` and make the rename itself durable."""
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(Path(path).parent)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    tmp = temp_name(path)
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    replace_durably(tmp, path)
