"""Files and folders written whole or not at all."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path

from spear.errors import SpearError

OWNER_FILE = ".spear-writer"  # inside a temporary folder: the host and pid writing it


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same folder renamed over it, so a
    reader (or a crash) never sees half a file; the folder is created if missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def publish_permissions(folder: Path) -> None:
    """Give a folder made by mkdtemp (mode 0700) the permissions of a normal one."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in folder.rglob("*"):
        os.chmod(f, (0o777 if f.is_dir() else 0o666) & ~umask)


def check_output_folder(target: str | os.PathLike, overwrite: bool) -> Path:
    """Refuse an output folder a write would refuse, before any work is spent on what goes in it.
    First remove the temporary folders a killed writer of ``target`` left, so that they go even
    when this run fails too."""
    target = Path(target).expanduser()
    clean_stale_temporaries(target)
    if target.exists() and not target.is_dir():
        raise SpearError(f"output {target} exists and is not a folder")
    if target.exists() and any(target.iterdir()) and not overwrite:
        raise SpearError(f"output folder {target} exists and is not empty (pass --overwrite to replace it)")
    parent = target.parent
    while not parent.exists():
        parent = parent.parent
    if not os.access(parent, os.W_OK):
        raise SpearError(f"cannot write {target}: {parent} is not writable")
    return target


def _writer_alive(folder: Path) -> bool:
    """The process that made this temporary folder still runs (on this host); unknown counts as dead
    only when the folder is old enough that no live writer can have left it unmarked."""
    import time

    try:
        host, pid = (folder / OWNER_FILE).read_text().split()
    except (OSError, ValueError):
        return time.time() - folder.stat().st_mtime < 60  # made a moment ago: the writer is marking it
    if host != socket.gethostname():
        return True  # another machine's writer on a shared disk: not ours to judge
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError):
        return True
    return True


def clean_stale_temporaries(target: Path) -> list[Path]:
    """Remove the temporary siblings (``.NAME.tmp-*``, ``.NAME.old-*``) of ``target`` that a killed
    writer left behind; returns what was removed."""
    removed = []
    if not target.parent.is_dir():
        return removed
    for pattern in (f".{target.name}.tmp-*", f".{target.name}.old-*"):
        for folder in target.parent.glob(pattern):
            if folder.is_dir() and not _writer_alive(folder):
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
    return removed


def make_temporary(target: Path, kind: str = "tmp") -> Path:
    """An empty temporary sibling of ``target`` marked with this process as its writer."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.{kind}-", dir=target.parent))
    (tmp / OWNER_FILE).write_text(f"{socket.gethostname()} {os.getpid()}")
    return tmp


def write_folder_atomic(target: Path, write, overwrite: bool = False, keep_existing: bool = False) -> bool:
    """Have ``write(tmp)`` fill a temporary sibling of ``target``, then rename it into place: a failed
    or killed write leaves no half-written folder. ``keep_existing``: a ``target`` that another
    writer completed meanwhile is kept and this one dropped. True when this write is in place."""
    target = check_output_folder(target, overwrite)  # removes stale temporaries
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temporary(target)
    try:
        write(tmp)
        (tmp / OWNER_FILE).unlink()
        publish_permissions(tmp)
        if target.exists() and keep_existing:
            shutil.rmtree(tmp)
            return False
        if target.exists():
            trash = make_temporary(target, "old")
            os.replace(target, trash / "old")
            os.replace(tmp, target)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return True
