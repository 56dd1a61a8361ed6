"""Files and folders written whole or not at all, checked before the work that fills them; JSON
files read with every failure named."""

from __future__ import annotations

import json
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


def read_json(path: str | os.PathLike, what: str = ""):
    """The JSON value stored in ``path``. Every way the file can fail to hold one is a SpearError
    naming it (``what`` says what the file is, e.g. "latency table"): unreadable, not UTF-8, not
    JSON, a number too long to convert, or nested deeper than the parser's recursion limit (a
    RecursionError that would otherwise end a command with a traceback)."""
    path = Path(path)
    label = f"{what} {path}" if what else str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise SpearError(f"{label} is not valid JSON: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise SpearError(f"cannot read {label}: {exc.strerror or exc}") from None
    try:
        return json.loads(text)
    except RecursionError:
        raise SpearError(f"{label} is not valid JSON: nested too deeply to parse") from None
    except ValueError as exc:  # JSONDecodeError, and ints past Python's digit limit
        raise SpearError(f"{label} is not valid JSON: {exc}") from None


def check_can_write_in(folder: str | os.PathLike, target: str | os.PathLike | None = None) -> None:
    """Prove that ``folder`` is, or can be made, a folder to write in: its nearest existing
    ancestor (or itself) is a folder in which a folder can be created, which a probe folder
    created and removed at once shows. A permission bit cannot tell (root passes every access
    check, yet nothing is created under /proc, /sys, or a file). ``target`` names the output in
    the error (default: ``folder``)."""
    folder = Path(folder).expanduser()
    target = folder if target is None else Path(target)
    existing = folder
    while not os.path.lexists(existing):  # lexists: a dangling link is there, and is no folder
        existing = existing.parent
    if not os.path.isdir(existing):
        raise SpearError(f"cannot write {target}: {existing} is not a folder")
    try:
        probe = tempfile.mkdtemp(prefix=".spear-probe-", dir=existing)
    except OSError as exc:
        raise SpearError(f"cannot write {target}: no folder can be created in {existing} "
                         f"({exc.strerror or exc})") from None
    os.rmdir(probe)


def check_can_write_file(path: str | os.PathLike) -> Path:
    """Prove that :func:`write_text_atomic` can write ``path`` (before the work whose result goes
    there): it is not a folder, and its folder is, or can be made, one to write in."""
    path = Path(path).expanduser()
    if os.path.isdir(path):
        raise SpearError(f"cannot write {path}: it is a folder")
    check_can_write_in(path.parent, path)
    return path


def _refuse_to_replace(target: Path, overwrite: bool, marker: str | None, owned=None) -> None:
    """Refuse to replace ``target`` when it holds files and this write may not replace them: only
    with ``overwrite``, only a folder holding ``marker``, the file every folder of this kind of
    output holds (a spear checkpoint's spear_config.json), and only a folder holding nothing but
    this kind of output's own files: ``owned(target)`` names them (a SpearError where ``marker``
    is not this kind of output's; without ``owned``, ``marker`` alone is). A replace removes the
    whole folder, so a user's file beside spear's (notes.txt in a checkpoint) is refused, never
    deleted; a mistyped --out never deletes anything else. An empty folder is always fine."""
    if not os.path.isdir(target):
        return
    try:
        held = sorted(p.name for p in target.iterdir())
    except OSError as exc:
        raise SpearError(f"cannot read output folder {target}: {exc.strerror or exc}") from None
    if not held:
        return
    replaceable = marker is not None and (target / marker).is_file()
    own = {marker}
    if replaceable and owned is not None:
        try:
            own = set(owned(target))
        except SpearError as exc:
            raise SpearError(f"output folder {target} holds a {marker} that is not spear's ({exc}): spear replaces "
                             "only what it wrote (choose another folder, or remove it yourself if it should go)") \
                from None
    if replaceable and overwrite:
        foreign = [name for name in held if name not in own]
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise SpearError(f"output folder {target} holds files spear did not write there ({shown}): --overwrite "
                             "replaces the whole folder and never deletes them (move them out, or choose another "
                             "folder)")
        return
    if replaceable:
        raise SpearError(f"output folder {target} exists and is not empty (pass --overwrite to replace it)")
    held = f" and holds no {marker}" if marker else ""
    allowed = f", or one holding {marker} with --overwrite" if marker else ""
    raise SpearError(f"output folder {target} exists and is not empty{held}: spear writes only to a new or "
                     f"empty folder{allowed} (choose another one, or remove it yourself if it should go)")


def check_output_folder(target: str | os.PathLike, overwrite: bool, marker: str | None = None, owned=None) -> Path:
    """Refuse an output folder a write would refuse, before any work is spent on what goes in it:
    a file in its place; a folder holding files, unless ``overwrite`` and it holds ``marker`` that
    ``owned`` accepts and nothing but the files ``owned`` names (so that --overwrite replaces what
    spear wrote, never a folder of anything else nor a file beside spear's); a place where no
    folder can be created. First remove the temporary folders a killed
    writer of ``target`` left, so that they go even when this run fails too."""
    target = Path(target).expanduser()
    clean_stale_temporaries(target)
    if os.path.lexists(target) and not os.path.isdir(target):
        raise SpearError(f"output {target} exists and is not a folder")
    _refuse_to_replace(target, overwrite, marker, owned)
    check_can_write_in(target.parent, target)  # the write goes to a temporary sibling of target
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
    if not os.path.isdir(target.parent):  # os.path: a parent it may not look into is none to clean
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


def write_folder_atomic(target: Path, write, overwrite: bool = False, keep_existing: bool = False,
                        marker: str | None = None, owned=None) -> bool:
    """Have ``write(tmp)`` fill a temporary sibling of ``target``, then rename it into place: a failed
    or killed write leaves no half-written folder. ``overwrite``: replace a ``target`` holding
    ``marker`` that ``owned`` accepts (see :func:`check_output_folder`). ``keep_existing``: a ``target`` that another
    writer completed meanwhile is kept and this one dropped. True when this write is in place."""
    target = check_output_folder(target, overwrite, marker, owned)  # removes stale temporaries
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
            _refuse_to_replace(target, overwrite, marker, owned)  # again: it may have been filled meanwhile
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
