"""Small files: reading (configs, vocabularies) with one clear error for bad input, and
writing atomically (a crash or a full disk never leaves half a file in place of the old one)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import secrets
import stat
import sys
from pathlib import Path

from dynaseq.core.errors import DynaseqError


def read_text(path: str | Path, what: str, error: type[DynaseqError] = DynaseqError) -> str:
    """The UTF-8 text of ``path``; ``error("<what> not found: PATH")`` if it is missing and
    ``error("cannot read <what> PATH: ...")`` if it cannot be read or decoded."""
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{what} not found: {p}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"cannot read {what} {p}: {e}") from None


def user_path(path: str | os.PathLike[str]) -> Path:
    """``path`` with a leading ``~`` or ``~user`` expanded to that home directory, as a shell
    expands it on a command line: a config's ``run_dir: ~/runs/x`` or a Python call's
    ``load("~/runs/x")`` name the same folder as ``--out ~/runs/x`` does, not a folder named
    ``~``. A ``~user`` with no home directory is left as it is (:meth:`Path.expanduser`
    raises there)."""
    p = Path(path)
    try:
        return p.expanduser()
    except RuntimeError:
        return p


def os_reason(e: OSError) -> str:
    """A short lower-case reason for an ``OSError`` ("permission denied")."""
    text = e.strerror or str(e) or type(e).__name__
    text = " ".join(text.split())
    return text[:1].lower() + text[1:]


#: paths that name one of the process's own descriptors (``-o /dev/stdout``)
_STREAM = re.compile(r"/dev/(std(out|err))|/(dev|proc/self)/fd/(?P<fd>\d+)")


def _stream_fd(path: str | Path) -> int | None:
    """The descriptor ``path`` names (``/dev/stdout`` 1, ``/dev/stderr`` 2, ``/dev/fd/N`` and
    ``/proc/self/fd/N`` N), or None."""
    m = _STREAM.fullmatch(str(path))
    if m is None:
        return None
    return int(m["fd"]) if m["fd"] is not None else (1 if m.group(1) == "stdout" else 2)


def _target(path: str | Path) -> Path | None:
    """Where :func:`atomic_write` puts ``path``'s file: None for a path written in place (a
    descriptor of the process, or an existing path that is not a regular file:
    ``/dev/null``, a pipe); else the path with its links resolved (a link to a file: that
    file is replaced, the link stays)."""
    p = Path(path)
    if _stream_fd(p) is not None or (p.exists() and not p.is_file()):
        return None
    return Path(os.path.realpath(p))


def _tmp_name(p: Path, tag: str) -> Path:
    """A temporary sibling of ``p``: its name cut to 100 bytes, so that any name the file
    system takes (255 bytes) leaves room for the affixes whatever its characters."""
    stem = os.fsencode(p.name)[:100].decode("utf-8", "ignore")
    return p.parent / f".tmp-{tag}{stem}-{secrets.token_hex(6)}"


def _existing(folder: Path) -> Path:
    """``folder``, or the nearest folder above it that exists (the rest would be created)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def _name_max(folder: Path) -> int:
    """The longest file name (bytes) the file system of ``folder`` (or the nearest folder
    above it that exists) takes."""
    try:
        return os.pathconf(_existing(folder), "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def check_writable(path: str | Path) -> None:
    """Refuse (DynaseqError ``"cannot write PATH: <reason>"``) an output ``path`` that
    :func:`atomic_write` could not write, before any work is done: a file of the temporary
    name's length is made and removed in its folder (or the nearest folder above it that
    exists: the rest would be created). A path written in place (a stream, ``/dev/null``) is
    not probed. Permission bits do not tell (root passes ``os.access`` on ``/sys``, where
    nothing can be created): only trying does."""
    fd = _stream_fd(path)
    if fd is not None:  # it must be open for writing
        try:
            writable = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY
        except OSError as e:
            raise DynaseqError(f"cannot write {path}: {os_reason(e)}") from None
        if not writable:
            raise DynaseqError(f"cannot write {path}: it is open for reading only")
        return
    if len(os.fsencode(Path(path).name)) > _name_max(Path(path).parent):
        raise DynaseqError(f"cannot write {path}: file name too long")
    try:
        target = _target(path)
    except OSError as e:
        raise DynaseqError(f"cannot write {path}: {os_reason(e)}") from None
    if target is None:
        return
    folder = _existing(target.parent)
    probe = _tmp_name(folder / target.name, "probe-")
    try:
        if not folder.is_dir():
            raise NotADirectoryError(20, "not a directory", str(folder))
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.unlink(probe)
    except OSError as e:
        raise DynaseqError(f"cannot write {path}: {os_reason(e)}") from None


def atomic_write(path: str | Path, data: bytes | str) -> None:
    """Write ``data`` (str as UTF-8) to ``path`` so that a reader sees the old file or the
    whole new one, never a part: written to a temporary sibling, flushed to disk, then
    renamed over ``path``. The temporary file is removed if anything fails (a full disk),
    and the old file stays. Parent folders are created. A link to a file replaces that
    file (the link stays, as ``open(path, "w")`` would leave it); a stream of the process
    (``/dev/stdout``) or a path that is not a regular file (``/dev/null``, a named pipe) is
    written to as it is. The file gets the mode a plain ``open(path, "w")`` gives (0666
    less the umask; an existing file's own mode): not ``mkstemp``'s 0600, which no server
    or job of another user could read. Raises OSError as the OS reports it, naming ``path``
    (not the temporary file).
    """
    payload = data.encode("utf-8") if isinstance(data, str) else data
    fd = _stream_fd(path)
    if fd is not None:  # through the descriptor itself: reopening the path would truncate
        if fd in (1, 2):  # what Python has buffered goes first
            (sys.stdout if fd == 1 else sys.stderr).flush()
        with os.fdopen(os.dup(fd), "wb") as f:  # the file redirected to (>> appends)
            f.write(payload)
        return
    p = _target(path)
    if p is None:  # written to, never replaced (a rename put a file in place of /dev/null)
        with open(path, "wb") as f:
            f.write(payload)
        return
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(p, "")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None
    try:
        with os.fdopen(fd, "wb") as f:
            with contextlib.suppress(FileNotFoundError):  # an existing file keeps its mode
                os.fchmod(f.fileno(), stat.S_IMODE(os.stat(p).st_mode))
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename == str(tmp):
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise


def same_file(a: str | Path, b: str | Path) -> bool:
    """True when ``a`` and ``b`` name one existing file (links and relative paths resolved)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def inside(path: str | Path, folder: str | Path) -> bool:
    """True when ``path`` is ``folder`` or lies below it, links and relative paths resolved
    (neither need exist)."""
    return Path(path).resolve().is_relative_to(Path(folder).resolve())


def sha256_file(path: str | Path) -> str:
    """The hex sha256 of a file's bytes, read in 1 MiB blocks (checkpoint checksums, the
    dataset manifest)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
