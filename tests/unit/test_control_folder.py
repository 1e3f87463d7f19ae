"""The folder of the control sockets, made while other sessions of the same user start and end."""

from __future__ import annotations

import os
import stat

import pytest

from xsp.core import control


def test_a_folder_removed_just_as_it_was_made_is_made_again(tmp_path, monkeypatch):
    folder = tmp_path / "xsp"
    folder.mkdir(mode=0o700)  # another session's, which ends now
    real_lstat = os.lstat
    removed = []

    def lstat_after_the_other_session_ended(path, *rest, **keywords):
        if str(path) == str(folder) and not removed:
            os.rmdir(folder)  # its end removes the folder, empty, between this one's mkdir and lstat
            removed.append(True)
        return real_lstat(path, *rest, **keywords)

    monkeypatch.setattr(os, "lstat", lstat_after_the_other_session_ended)
    assert control.private_folder(folder) is None
    assert removed
    assert stat.S_IMODE(real_lstat(folder).st_mode) == 0o700


def test_a_file_where_the_folder_should_be_is_named_as_such(tmp_path):
    folder = tmp_path / "xsp"
    folder.write_text("")
    assert control.private_folder(folder) == f"{folder} is not a folder"


@pytest.mark.skipif(os.geteuid() == 0, reason="root may make a folder anywhere")
def test_a_folder_that_cannot_be_made_says_why(tmp_path):
    parent = tmp_path / "closed"
    parent.mkdir(mode=0o500)
    assert control.private_folder(parent / "xsp").startswith(f"cannot make {parent / 'xsp'}: ")


def test_a_folder_others_can_enter_is_refused(tmp_path):
    folder = tmp_path / "xsp"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    assert "can be opened by other users (mode 755" in control.private_folder(folder)
