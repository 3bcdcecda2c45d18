"""Outputs: a name the file system takes is written whatever its length, an error names the
file asked for (not a temporary one), and an output that cannot be written is refused
before any work (:func:`~dynaseq.core.files.check_writable`)."""

from __future__ import annotations

import os

import pytest

from dynaseq.core.errors import DynaseqError
from dynaseq.core.files import atomic_write, check_writable


@pytest.mark.parametrize("char", ["x", "日"])  # 1 and 3 bytes in UTF-8
def test_the_longest_name_the_file_system_takes_is_written(tmp_path, char):
    room = os.pathconf(tmp_path, "PC_NAME_MAX") - 4  # bytes, ".txt" aside
    name = char * (room // len(char.encode())) + ".txt"
    check_writable(tmp_path / name)
    atomic_write(tmp_path / name, "hi\n")  # the temporary sibling's name was 18 longer
    assert (tmp_path / name).read_text() == "hi\n"
    assert [p.name for p in tmp_path.iterdir()] == [name]


def test_a_link_to_a_file_replaces_the_file_and_a_stream_is_written_in_place(tmp_path):
    (tmp_path / "target.txt").write_text("old\n")
    (tmp_path / "link").symlink_to("target.txt")
    check_writable(tmp_path / "link")
    atomic_write(tmp_path / "link", "new\n")  # as open("link", "w"): the link stays
    assert (tmp_path / "link").is_symlink() and (tmp_path / "target.txt").read_text() == "new\n"
    log = tmp_path / "log.txt"  # -o /dev/stdout >> log: appended through the descriptor
    log.write_text("before\n")
    with open(log, "ab") as f:
        fd = f.fileno()
        check_writable(f"/dev/fd/{fd}")
        atomic_write(f"/dev/fd/{fd}", "after\n")  # reopening the path truncated the file
    assert log.read_text() == "before\nafter\n"
    with pytest.raises(DynaseqError, match="cannot write /dev/fd/"):
        check_writable(f"/dev/fd/{fd}")  # closed now: refused before any work
    with pytest.raises(DynaseqError, match="file name too long"):
        check_writable(tmp_path / ("x" * 300 + ".txt"))
    r, w = os.pipe()  # /dev/fd/N: the process's own stream, not a file to rename over
    try:
        check_writable(f"/dev/fd/{w}")
        atomic_write(f"/dev/fd/{w}", "piped\n")
        assert os.read(r, 100) == b"piped\n"
    finally:
        os.close(r)
        os.close(w)


def test_a_failed_write_names_the_file_asked_for(tmp_path):
    if os.path.isdir("/sys/kernel"):  # sysfs: nothing can be created there, even by root
        target = "/sys/out.txt"
    else:
        (tmp_path / "sub").mkdir(mode=0o500)
        target = str(tmp_path / "sub" / "out.txt")
        if os.access(tmp_path / "sub", os.W_OK):
            pytest.skip("permission bits do not bind this user")
    with pytest.raises(OSError) as e:
        atomic_write(target, "x")
    assert e.value.filename == target  # not the temporary sibling's name


def test_an_output_that_cannot_be_written_is_refused_before_any_work(tmp_path):
    a_file = tmp_path / "a.txt"
    a_file.write_text("x")
    with pytest.raises(DynaseqError, match=f"cannot write {a_file}/out.txt: not a directory"):
        check_writable(a_file / "out.txt")
    with pytest.raises(DynaseqError, match="cannot write /proc/version/x: not a directory"):
        check_writable("/proc/version/x")
    if os.path.isdir("/sys/kernel"):  # nothing can be created there, even by root
        with pytest.raises(DynaseqError, match="cannot write /sys/out.txt: "):
            check_writable("/sys/out.txt")
    check_writable(tmp_path / "new" / "deeper" / "out.txt")  # folders to be made: fine
    check_writable(os.devnull)  # not a regular file: written as it is
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]  # the probes are gone
