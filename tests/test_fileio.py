"""spear.fileio: a file is replaced whole, or left as it was; an output folder is checked before
the work; a JSON file is read or refused in one line."""

import re
from pathlib import Path

import pytest

from spear.errors import SpearError
from spear.fileio import check_can_write_in, check_output_folder, read_json, write_folder_atomic, write_text_atomic


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "sub" / "out.json"
    assert write_text_atomic(path, "first") == path and path.read_text() == "first"
    with pytest.raises(TypeError):
        write_text_atomic(path, b"not text")  # fails inside the write, after the temporary exists
    assert path.read_text() == "first"
    assert [p.name for p in path.parent.iterdir()] == ["out.json"]
    write_text_atomic(path, "second")
    assert path.read_text() == "second"


# ---------------------------------------------------------------------- JSON files
DEEP = "[" * 100_000 + "]" * 100_000  # json.loads raises RecursionError, not JSONDecodeError


@pytest.mark.parametrize("data,message", [
    (DEEP.encode(), "is not valid JSON: nested too deeply to parse"),
    (b"{nope", "is not valid JSON: Expecting property name"),
    (b"1" * 5000, "is not valid JSON: Exceeds the limit"),  # an int past Python's digit limit: ValueError
    (b"\xff{}", "is not valid JSON: not UTF-8"),
])
def test_read_json_is_one_spear_error_naming_the_file(tmp_path, data, message):
    """Catches: a reader that turns JSONDecodeError into a SpearError but lets RecursionError (deep
    nesting) or a plain ValueError through as a traceback."""
    path = tmp_path / "table.json"
    path.write_bytes(data)
    with pytest.raises(SpearError, match=message) as info:
        read_json(path, "launch table")
    assert str(info.value).startswith(f"launch table {path} ")


def test_read_json_reads_json_and_names_a_missing_file(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"a": [1, 2.5, null]}')
    assert read_json(path) == {"a": [1, 2.5, None]}
    with pytest.raises(SpearError, match=f"cannot read {tmp_path / 'missing.json'}: No such file"):
        read_json(tmp_path / "missing.json")


# ---------------------------------------------------------------------- output folders
@pytest.mark.parametrize("where", ["under a file", "under /proc", "under /sys"])
def test_the_out_check_proves_the_folder_can_be_created(tmp_path, where):
    """A file as a parent, /proc or /sys: nothing can be created there, yet a permission check
    passes (root passes them all). Catches: the check by os.access, which let such an --out
    through to a traceback at the end of the work."""
    if where == "under a file":
        (tmp_path / "file").write_text("x")
        target, fragment = tmp_path / "file" / "x" / "ckpt", f"{tmp_path / 'file'} is not a folder"
    else:
        root = Path(where.split()[-1])
        if not root.is_dir():
            pytest.skip(f"no {root} here")
        target, fragment = root / "x", f"no folder can be created in {root}"
    for check in (lambda: check_output_folder(target, overwrite=False), lambda: check_can_write_in(target)):
        with pytest.raises(SpearError, match=re.escape(fragment)) as info:
            check()
        assert f"cannot write {target}" in str(info.value)


def test_the_out_check_accepts_new_and_existing_folders_and_leaves_no_probe(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "other.json").write_text("{}")
    check_can_write_in(results)  # a results folder keeps what else it holds
    check_can_write_in(tmp_path / "a" / "b")
    assert check_output_folder(tmp_path / "a" / "ckpt", overwrite=False) == tmp_path / "a" / "ckpt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]
    assert [p.name for p in results.iterdir()] == ["other.json"]


def test_overwrite_replaces_only_a_folder_holding_the_marker(tmp_path):
    """--overwrite on a folder of anything else (a home folder, a dataset) deletes nothing.
    Catches: overwrite replacing any existing folder."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "data.txt").write_text("precious")
    with pytest.raises(SpearError, match="holds no MARK: spear writes only to a new or empty folder, or one "
                                         "holding MARK with --overwrite"):
        check_output_folder(mine, overwrite=True, marker="MARK")
    with pytest.raises(SpearError, match="holds no MARK") as info:
        write_folder_atomic(mine, lambda tmp: (tmp / "MARK").write_text("new"), overwrite=True, marker="MARK")
    assert "--overwrite" in str(info.value)
    with pytest.raises(SpearError, match="exists and is not empty"):
        write_folder_atomic(mine, lambda tmp: (tmp / "MARK").write_text("new"), overwrite=True)
    assert [p.name for p in mine.iterdir()] == ["data.txt"] and (mine / "data.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no temporary left

    written = tmp_path / "written"
    for _ in range(2):  # new, then replaced
        assert write_folder_atomic(written, lambda tmp: (tmp / "MARK").write_text("new"), overwrite=True,
                                   marker="MARK")
    with pytest.raises(SpearError, match=r"exists and is not empty \(pass --overwrite"):
        check_output_folder(written, overwrite=False, marker="MARK")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert write_folder_atomic(empty, lambda tmp: (tmp / "MARK").write_text("new"), marker="MARK")
    assert [p.name for p in empty.iterdir()] == ["MARK"]


def test_overwrite_refuses_a_folder_with_files_beside_the_outputs_own(tmp_path):
    """--overwrite replaces a whole folder: one holding a user's file beside the output's own
    (mine.txt beside a checkpoint's files) is refused naming it, and keeps every file.
    Catches: the replace deleting the user's file with the folder."""
    folder = tmp_path / "out"
    folder.mkdir()
    for name, text in (("MARK", "old"), ("data.bin", "old"), ("mine.txt", "precious")):
        (folder / name).write_text(text)

    def owned(target):
        return {"MARK", "data.bin"}

    def write(tmp):
        (tmp / "MARK").write_text("new")
        (tmp / "data.bin").write_text("new")

    for check in (lambda: check_output_folder(folder, overwrite=True, marker="MARK", owned=owned),
                  lambda: write_folder_atomic(folder, write, overwrite=True, marker="MARK", owned=owned)):
        with pytest.raises(SpearError, match=re.escape(f"output folder {folder} holds files spear did not write "
                                                       "there (mine.txt): --overwrite replaces the whole folder "
                                                       "and never deletes them")):
            check()
    assert {p.name: p.read_text() for p in folder.iterdir()} == {"MARK": "old", "data.bin": "old",
                                                                 "mine.txt": "precious"}
    (folder / "mine.txt").unlink()
    assert write_folder_atomic(folder, write, overwrite=True, marker="MARK", owned=owned)
    assert {p.name: p.read_text() for p in folder.iterdir()} == {"MARK": "new", "data.bin": "new"}
    # without ``owned``, the marker is the output's only file
    (folder / "notes").mkdir()
    with pytest.raises(SpearError, match=r"holds files spear did not write there \(data\.bin, notes\)"):
        write_folder_atomic(folder, write, overwrite=True, marker="MARK")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary left
