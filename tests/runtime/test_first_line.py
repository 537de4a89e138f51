"""first_line(e): the one helper for one-line errors; safe on empty and blank messages."""

import zipfile

import numpy as np
import pytest

from precast.errors import InputError, first_line


@pytest.mark.parametrize(
    "message, plain, typed",
    [
        ("", "ValueError", "ValueError"),
        ("\n  \n", "ValueError", "ValueError"),
        ("  first line  \nsecond", "first line", "ValueError: first line"),
        ("\n\nafter blanks\n", "after blanks", "ValueError: after blanks"),
    ],
)
def test_first_line(message, plain, typed):
    assert first_line(ValueError(message)) == plain
    assert first_line(ValueError(message), with_type=True) == typed


def test_an_empty_library_error_still_gives_one_line(tmp_path, monkeypatch):
    """The hand copies (str(e).splitlines()[0]) raised IndexError here instead of naming the file."""
    from precast.cli.feeds_io import read_feeds

    path = tmp_path / "feeds.npz"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("x.npy", b"")

    def broken(*a, **k):
        raise ValueError("")

    monkeypatch.setattr(np, "load", broken)
    with pytest.raises(InputError) as info:
        read_feeds(str(path))
    assert str(info.value) == f"{path}: not a readable .npz of arrays (ValueError)"
