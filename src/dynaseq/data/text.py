"""Line-oriented text files: one sentence per line, plain UTF-8 or gzip.

Reading is strict: a file that is missing, unreadable, not valid UTF-8 or a corrupt gzip
stream raises :class:`~dynaseq.core.errors.DynaseqError` with a one-line message that names the
file (and the line, for bad UTF-8). ``OSError`` and ``UnicodeDecodeError`` never escape.

Example::

    src, tgt = read_parallel("data/train.en.gz", "data/train.de.gz")
    write_lines("run/hyp.txt", hyps)
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterable
from pathlib import Path

from dynaseq.core.errors import DynaseqError
from dynaseq.core.files import atomic_write, os_reason
from dynaseq.data.datasets import resolve_data_path

#: The first two bytes of every gzip stream (RFC 1952).
GZIP_MAGIC = b"\x1f\x8b"


def read_bytes(p: Path) -> bytes:
    """All bytes of ``p``; a missing or unreadable file raises a one-line DynaseqError."""
    try:
        return p.read_bytes()
    except FileNotFoundError:
        raise DynaseqError(f"cannot read {p}: no such file") from None
    except OSError as e:
        raise DynaseqError(f"cannot read {p}: {os_reason(e)}") from None


def _read_bytes(p: Path) -> bytes:
    """All bytes of ``p``, gunzipped when they start with the gzip magic bytes.

    The file is read in one go (no seeking), so pipes such as ``/dev/stdin`` work too.
    """
    data = read_bytes(p)
    if data[:2] != GZIP_MAGIC:
        return data
    try:
        return gzip.decompress(data)
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        detail = " ".join(str(e).split()) or type(e).__name__
        raise DynaseqError(f"{p}: corrupt gzip file ({detail})") from None


def read_lines(path: str | Path, strip: bool = True) -> list[str]:
    """Read one sentence per line from a plain-text or gzip file.

    Gzip is detected by the magic bytes ``1f 8b`` (the ``.gz`` suffix is neither needed nor
    trusted). The content must be valid UTF-8; a leading byte-order mark is dropped.
    Lines are split on ``"\\n"`` only (so ``"\\r\\n"`` files work, and Unicode line
    separators such as U+2028 inside a sentence do not split it), and each line is then
    stripped of surrounding whitespace with :meth:`str.strip`. A final newline does not
    add an empty last line; empty lines elsewhere are kept as ``""`` so that the lines of
    a parallel corpus stay aligned. ``strip=False`` leaves each line as it is (a
    classifier's pair line ``"\\tb"`` keeps its tab; the fields are stripped there).

    The whole file is read into memory. A path starting ``$DATA/`` is under the data root
    (:func:`~dynaseq.data.datasets.resolve_data_path`).

    Example::

        >>> read_lines("train.en.gz")[:2]  # doctest: +SKIP
        ['Two young guys ...', 'Several men in hard hats ...']

    Raises:
        DynaseqError: ``"cannot read {path}: no such file"``, ``"cannot read {path}:
            <reason>"`` (a directory, no permission), ``"{path}: line {n} is not valid
            UTF-8"``, ``"{path}: corrupt gzip file (<detail>)"``, or a missing dataset
            under the data root.
    """
    p = resolve_data_path(path)
    return decode_lines(_read_bytes(p), str(p), strip=strip)


def decode_lines(data: bytes, name: str, first_line: int = 1, strip: bool = True) -> list[str]:
    """The lines of UTF-8 ``data`` as :func:`read_lines` splits them (``"\\n"`` only, a final
    newline adds no line, a byte-order mark dropped, each line stripped unless ``strip`` is
    False): the one rule for
    files and standard input alike, so one line in is one line out. ``first_line``: the
    number of ``data``'s first line in its stream (a stream read line by line: only the
    stream's first line may start with a byte-order mark).

    Raises:
        DynaseqError: ``"{name}: line {n} is not valid UTF-8"``.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line_no = data.count(b"\n", 0, e.start) + first_line
        raise DynaseqError(f"{name}: line {line_no} is not valid UTF-8") from None
    if first_line == 1 and text.startswith("\ufeff"):
        text = text[1:]
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line.strip() for line in lines] if strip else lines


def read_parallel(src_path: str | Path, tgt_path: str | Path) -> tuple[list[str], list[str]]:
    """Read two line-aligned files (see :func:`read_lines`); line *i* translates line *i*.

    Raises:
        DynaseqError: when a file cannot be read, or ``"{src} has N lines but {tgt} has
            M"`` when the line counts differ.
    """
    src = read_lines(src_path)
    tgt = read_lines(tgt_path)
    if len(src) != len(tgt):
        raise DynaseqError(
            f"{Path(src_path)} has {len(src)} lines but {Path(tgt_path)} has {len(tgt)}"
        )
    return src, tgt


def write_lines(path: str | Path, lines: Iterable[str]) -> None:
    """Write ``lines`` as UTF-8, each followed by ``"\\n"``; parent folders are created.

    The file is always plain text (no gzip, whatever the suffix), written atomically: a
    failure (a full disk) leaves the old file, if any, in place.

    Raises:
        DynaseqError: a line contains ``"\\n"`` (it would not read back as one line) or
            cannot be encoded as UTF-8 (a lone surrogate), or the file cannot be written.
            Nothing is written in the first two cases.
    """
    p = Path(path)
    items = list(lines)
    for i, line in enumerate(items, 1):
        if "\n" in line:
            raise DynaseqError(f"cannot write {p}: line {i} contains a newline")
    text = "".join(line + "\n" for line in items)
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as e:
        line_no = text.count("\n", 0, e.start) + 1
        raise DynaseqError(f"cannot write {p}: line {line_no} is not encodable as UTF-8") from None
    try:
        atomic_write(p, data)
    except OSError as e:
        raise DynaseqError(f"cannot write {p}: {os_reason(e)}") from None
