"""spear.fileio: a file is replaced whole, or left as it was."""

import pytest

from spear.fileio import write_text_atomic


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "sub" / "out.json"
    assert write_text_atomic(path, "first") == path and path.read_text() == "first"
    with pytest.raises(TypeError):
        write_text_atomic(path, b"not text")  # fails inside the write, after the temporary exists
    assert path.read_text() == "first"
    assert [p.name for p in path.parent.iterdir()] == ["out.json"]
    write_text_atomic(path, "second")
    assert path.read_text() == "second"
