"""Outputs: a name the file system takes is written whatever its length, an error names the
file asked for (not a temporary one), and an output that cannot be written is refused
before any work (:func:`~dynaseq.core.files.check_writable`)."""

from __future__ import annotations

import os

import pytest

from dynaseq.core.errors import DynaseqError
from dynaseq.core.files import atomic_write, check_writable


def test_the_longest_name_the_file_system_takes_is_written(tmp_path):
    name = "x" * (os.pathconf(tmp_path, "PC_NAME_MAX") - 4) + ".txt"
    atomic_write(tmp_path / name, "hi\n")  # the temporary sibling's name was 18 longer
    assert (tmp_path / name).read_text() == "hi\n"
    assert [p.name for p in tmp_path.iterdir()] == [name]


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
