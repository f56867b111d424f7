"""Output files written atomically with ordinary permissions.

A result file is written to a temporary file beside it and renamed into place only when
complete, so a failure never leaves half a file. `tempfile.mkstemp` would create that
temporary file with mode 0600, which the rename keeps; here it is created like `open(path,
"w")` would create it: mode 0666 less the process umask (0644 under umask 022), applied by
the kernel at creation, so no umask has to be read or changed (that would race with threads).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)


def create_beside(path: str | Path) -> tuple[int, str]:
    """(fd, name) of a new, empty temporary file in `path`'s folder, mode 0666 & ~umask."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    while True:
        tmp = str(folder / f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, _FLAGS, 0o666), tmp
        except FileExistsError:  # 48 random bits collided: draw again
            continue


def write_atomic(path: str | Path, data: bytes | str) -> None:
    """Write a whole file: a finished temporary file renamed onto `path`."""
    fd, tmp = create_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
