"""mhmla_fast.filelock: the one exclusive-lock helper behind run folders, outputs and the export
cache."""

import os
import threading
import time

import pytest

from mhmla_fast import filelock

pytestmark = pytest.mark.skipif(not filelock.SUPPORTED, reason="no flock on this platform")


def _open(path):
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)


def test_try_lock_refuses_a_second_holder_until_the_first_lets_go(tmp_path):
    a, b = _open(tmp_path / "x"), _open(tmp_path / "x")  # two open files: two holders
    try:
        assert filelock.try_lock(a)
        assert not filelock.try_lock(b)
        filelock.unlock(a)
        assert filelock.try_lock(b)
        assert not filelock.try_lock(a)
    finally:
        os.close(a)
        os.close(b)


def test_closing_the_file_lets_go(tmp_path):
    a = _open(tmp_path / "x")
    assert filelock.try_lock(a)
    os.close(a)
    b = _open(tmp_path / "x")
    try:
        assert filelock.try_lock(b)
    finally:
        os.close(b)


def test_lock_waits_for_the_holder(tmp_path):
    a, b = _open(tmp_path / "x"), _open(tmp_path / "x")
    got = threading.Event()
    try:
        assert filelock.try_lock(a)
        t = threading.Thread(target=lambda: (filelock.lock(b), got.set()))
        t.start()
        time.sleep(0.2)
        assert not got.is_set()  # still waiting while a holds it
        filelock.unlock(a)
        t.join(5)
        assert got.is_set()
        assert not filelock.try_lock(a)  # b holds it now
    finally:
        os.close(a)
        os.close(b)


def test_errors_other_than_held_are_raised(tmp_path):
    fd = _open(tmp_path / "x")
    os.close(fd)
    with pytest.raises(OSError):  # a closed descriptor is not "held by another"
        filelock.try_lock(fd)


@pytest.mark.parametrize("code", ["ENOLCK", "ENOSYS", "EOPNOTSUPP"])
def test_a_file_system_without_locks_is_used_unlocked_with_a_warning(tmp_path, monkeypatch, code):
    import errno

    def no_locks(fd, op):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    monkeypatch.setattr(filelock.fcntl, "flock", no_locks)
    fd = _open(tmp_path / "x")
    try:
        with pytest.warns(filelock.LocksUnavailableWarning, match="no file locks"):
            assert filelock.try_lock(fd)
        with pytest.warns(filelock.LocksUnavailableWarning):
            filelock.lock(fd)
        filelock.unlock(fd)  # nothing held, nothing to say
    finally:
        os.close(fd)


def test_a_training_run_on_such_a_file_system_goes_on(tmp_path, monkeypatch):
    import errno

    from mhmla_fast.checkpoint import run_lock

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(filelock.fcntl, "flock", no_locks)
    with pytest.warns(filelock.LocksUnavailableWarning), run_lock(tmp_path / "run"):
        assert (tmp_path / "run" / ".lock").read_text().strip() == str(os.getpid())
