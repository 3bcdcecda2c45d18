from __future__ import annotations

import gzip
import os
from pathlib import Path

import pytest

from dynaseq.core.errors import DynaseqError
from dynaseq.data.text import read_lines, read_parallel, write_lines

CONTENT = "Ein Hund läuft.\r\n  two  spaces inside \n\n\tÇa va ?\nlast line without newline"
EXPECTED = ["Ein Hund läuft.", "two  spaces inside", "", "Ça va ?", "last line without newline"]


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_plain_and_gzip_read_the_same(tmp_path: Path) -> None:
    raw = CONTENT.encode("utf-8")
    plain = _write(tmp_path / "a.txt", raw)
    gz = _write(tmp_path / "a.txt.gz", gzip.compress(raw))
    assert read_lines(plain) == EXPECTED
    assert read_lines(gz) == EXPECTED
    assert read_lines(str(gz)) == EXPECTED


def test_gzip_is_detected_by_magic_bytes_not_suffix(tmp_path: Path) -> None:
    raw = CONTENT.encode("utf-8")
    gz_without_suffix = _write(tmp_path / "a.txt", gzip.compress(raw))
    plain_with_gz_suffix = _write(tmp_path / "b.gz", raw)
    assert read_lines(gz_without_suffix) == EXPECTED
    assert read_lines(plain_with_gz_suffix) == EXPECTED


def test_multi_member_gzip(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.gz", gzip.compress(b"one\n") + gzip.compress(b"two\n"))
    assert read_lines(path) == ["one", "two"]


def test_line_splitting_details(tmp_path: Path) -> None:
    assert read_lines(_write(tmp_path / "e", b"")) == []
    assert read_lines(_write(tmp_path / "n", b"\n")) == [""]
    assert read_lines(_write(tmp_path / "t", b"a\n\n")) == ["a", ""]
    # a byte-order mark is dropped; U+2028 inside a sentence does not split it
    text = "\ufeffa\u2028b\nc\n".encode()
    assert read_lines(_write(tmp_path / "bom", text)) == ["a\u2028b", "c"]


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.txt"
    with pytest.raises(DynaseqError) as err:
        read_lines(path)
    assert str(err.value) == f"cannot read {path}: no such file"


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(DynaseqError) as err:
        read_lines(tmp_path)
    assert str(err.value) == f"cannot read {tmp_path}: is a directory"


def _unreadable(tmp_path: Path, reason: str) -> Path:
    """A path that ``open`` refuses for ``reason`` (the first two also under root)."""
    if reason == "not a directory":  # a file under a regular file
        return _write(tmp_path / "plain.txt", b"x\n") / "child.txt"
    if reason == "too many levels of symbolic links":  # a symlink to itself
        loop = tmp_path / "loop.txt"
        loop.symlink_to(loop)
        return loop
    path = _write(tmp_path / "secret.txt", b"x\n")
    path.chmod(0)
    return path


@pytest.mark.parametrize("reason", [
    "not a directory", "too many levels of symbolic links",
    pytest.param("permission denied", marks=pytest.mark.skipif(
        not hasattr(os, "geteuid") or os.geteuid() == 0,
        reason="root ignores file permissions (the other reasons run under root)"))])
def test_unopenable_path_is_one_line(tmp_path: Path, reason: str) -> None:
    """Any OSError of ``open`` becomes one DynaseqError line naming the file and why."""
    path = _unreadable(tmp_path, reason)
    try:
        with pytest.raises(DynaseqError) as err:
            read_lines(path)
        assert str(err.value) == f"cannot read {path}: {reason}"
    finally:
        if reason == "permission denied":
            path.chmod(0o600)


@pytest.mark.parametrize("compress", [False, True])
def test_invalid_utf8_names_the_line(tmp_path: Path, compress: bool) -> None:
    raw = b"fine\nalso fine\nbad \xff\xfe byte\nfine again\n"
    path = _write(tmp_path / "bad.txt", gzip.compress(raw) if compress else raw)
    with pytest.raises(DynaseqError) as err:
        read_lines(path)
    assert str(err.value) == f"{path}: line 3 is not valid UTF-8"


def test_invalid_utf8_on_first_line(tmp_path: Path) -> None:
    path = _write(tmp_path / "latin1.txt", "Grüße\n".encode("latin-1"))
    with pytest.raises(DynaseqError, match="line 1 is not valid UTF-8"):
        read_lines(path)


def test_truncated_gzip(tmp_path: Path) -> None:
    data = gzip.compress(("a sentence\n" * 200).encode())
    path = _write(tmp_path / "cut.gz", data[: len(data) // 2])
    with pytest.raises(DynaseqError) as err:
        read_lines(path)
    message = str(err.value)
    assert message.startswith(f"{path}: corrupt gzip file (") and message.endswith(")")
    assert "\n" not in message


def test_corrupt_gzip_checksum(tmp_path: Path) -> None:
    data = bytearray(gzip.compress(b"hello\nworld\n"))
    data[-8] ^= 0xFF  # the CRC32 in the trailer
    path = _write(tmp_path / "crc.gz", bytes(data))
    with pytest.raises(DynaseqError, match=r"corrupt gzip file \("):
        read_lines(path)


def test_read_parallel(tmp_path: Path) -> None:
    src = _write(tmp_path / "s", b"a\nb\n")
    tgt = _write(tmp_path / "t", gzip.compress(b"x\ny\n"))
    assert read_parallel(src, tgt) == (["a", "b"], ["x", "y"])


def test_read_parallel_line_count_mismatch(tmp_path: Path) -> None:
    src = _write(tmp_path / "s", b"a\nb\nc\n")
    tgt = _write(tmp_path / "t", b"x\ny\n")
    with pytest.raises(DynaseqError) as err:
        read_parallel(src, tgt)
    assert str(err.value) == f"{src} has 3 lines but {tgt} has 2"


def test_write_lines_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "new" / "dir" / "out.txt"
    lines = ["Grüße", "", "日本語 テキスト", "x"]
    write_lines(path, lines)
    assert path.read_bytes() == "Grüße\n\n日本語 テキスト\nx\n".encode()
    assert read_lines(path) == lines
    write_lines(path, [])
    assert read_lines(path) == []


def test_write_lines_rejects_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "out.txt"
    with pytest.raises(DynaseqError, match="line 2 contains a newline"):
        write_lines(path, ["ok", "two\nlines"])
    with pytest.raises(DynaseqError, match="line 1 is not encodable"):
        write_lines(path, ["\udcff"])
    assert not path.exists()


def test_write_lines_unwritable(tmp_path: Path) -> None:
    blocker = _write(tmp_path / "file", b"")
    with pytest.raises(DynaseqError, match=r"^cannot write "):
        write_lines(blocker / "sub" / "out.txt", ["x"])
