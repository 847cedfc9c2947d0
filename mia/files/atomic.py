"""Atomic file writes: a file is either its old content or its whole new content, never a partial one.

Every output and cache file of mia is written through :func:`atomic_write`: the bytes go to a temporary file with a
unique name (``mkstemp``) in the destination's own directory, which is then renamed over the destination with
``os.replace`` (atomic on POSIX within one filesystem). Two processes (or threads) writing the same path at once
therefore never share a temporary file, and a reader sees one writer's complete file or the other's. A writer that
fails or is interrupted removes its temporary file (a SIGKILL leaves a ``.<name>.*.tmp`` file behind, never a
partial destination).
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Iterator


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_write(path, mode: str = "w", encoding: str = "utf-8") -> Iterator:
    """Context manager yielding a file object (``mode`` "w" text or "wb" binary) whose content replaces ``path``
    when the block ends without an exception. The parent directory must exist. The file gets the permissions a
    plain ``open(path, "w")`` would give it (0o666 minus the umask), not mkstemp's 0o600."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write: mode must be 'w' or 'wb', not {mode!r}")
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": encoding})) as f:
            yield f
            f.flush()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def is_temporary(name: str) -> bool:
    """Whether a file name is a temporary of ``atomic_write`` or ``temporary_sibling`` (``.<name>.*.tmp``): a write
    in progress (or left by a killed writer), which cache eviction must not count or delete."""
    return name.startswith(".") and name.endswith(".tmp")


def write_bytes(path, data: bytes) -> None:
    with atomic_write(path, "wb") as f:
        f.write(data)


def write_text(path, text: str) -> None:
    with atomic_write(path, "w") as f:
        f.write(text)


def write_json(path, obj, **dumps_kwargs) -> None:
    write_text(path, json.dumps(obj, **dumps_kwargs))


def save_npz(path, **arrays) -> None:
    """``np.savez`` (uncompressed) to ``path`` atomically."""
    import numpy as np

    with atomic_write(path, "wb") as f:
        np.savez(f, **arrays)


def save_figure(fig, path, **savefig_kwargs) -> None:
    """``fig.savefig`` to ``path`` atomically; the format comes from the suffix, as savefig would take it."""
    path = Path(path)
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format=savefig_kwargs.pop("format", path.suffix.lstrip(".") or None), **savefig_kwargs)


def temporary_sibling(path) -> Path:
    """A unique, not yet existing name next to ``path`` (``.<name>.<random>.tmp``), for what ``atomic_write`` cannot
    write: a directory built in place, or a hard link, then ``os.replace``d onto ``path``."""
    import secrets

    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(6)}.tmp")
