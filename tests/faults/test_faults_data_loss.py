"""Faults that could lose what a learner wrote: the progress file under concurrent writers, a
writer killed half way, files that cannot be read or written; benchmark results under a run that
produced nothing. Every test injects a fault and checks that no record is lost.

Figures for the whole suite are in tests/faults/README.md.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import types
from pathlib import Path

import pytest

from flashedu._atomic import write_atomic
from flashedu.checks import _progress

WRITERS, RECORDS_EACH = 16, 4


def _report(status="passed", n=3):
    ok = status == "passed"
    return types.SimpleNamespace(status=status, results=[("case", ok, "")] * n)


@pytest.fixture
def target(tmp_path, monkeypatch) -> Path:
    p = tmp_path / "progress.json"
    monkeypatch.setenv(_progress.ENV, str(p))
    return p


def _record_many(barrier, writer: int) -> None:
    barrier.wait()  # all writers start at once
    for r in range(RECORDS_EACH):
        assert _progress.record(f"ex_{writer}_{r}", "flashedu.checks.ch99", _report())
    os._exit(0)


def test_sixteen_processes_recording_at_once_lose_no_record(target):
    ctx = multiprocessing.get_context("fork")  # the parent's imports, no re-import per writer
    barrier = ctx.Barrier(WRITERS)
    procs = [ctx.Process(target=_record_many, args=(barrier, w)) for w in range(WRITERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * WRITERS
    data = json.loads(target.read_text())
    expected = {f"ex_{w}_{r}" for w in range(WRITERS) for r in range(RECORDS_EACH)}
    lost = expected - set(data)
    assert not lost, f"{len(lost)} of {len(expected)} records lost"
    assert not list(target.parent.glob("*.tmp"))  # no temporary file left behind


def _die_before_replace(name: str) -> None:
    def killed(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    _progress.os.replace = killed  # the child's own module: the parent's is untouched
    import flashedu._atomic as atomic

    atomic.os.replace = killed
    _progress.record(name, "flashedu.checks.ch99", _report())


def test_a_writer_killed_between_write_and_replace_leaves_the_previous_file(target):
    assert _progress.record("kept", "flashedu.checks.ch01", _report())
    before = target.read_bytes()
    child = multiprocessing.get_context("fork").Process(target=_die_before_replace, args=("x",))
    child.start()
    child.join(30)
    assert child.exitcode == -signal.SIGKILL
    assert target.read_bytes() == before  # intact, and still the whole old record
    assert len(list(target.parent.glob(".progress.json.*.tmp"))) == 1  # its written temp file
    assert _progress.record("next", "flashedu.checks.ch01", _report())  # the lock was released
    assert set(json.loads(target.read_text())) == {"kept", "next"}
    assert not list(target.parent.glob("*.tmp"))  # the next writer removed the stale one


def _hold_lock(path: str, ready, release) -> None:
    with _progress.lock(Path(path)):
        ready.set()
        release.wait(30)
        os.kill(os.getpid(), signal.SIGKILL)  # dies holding it


def test_a_writer_killed_holding_the_lock_does_not_block_the_next(target):
    ctx = multiprocessing.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_hold_lock, args=(str(target), ready, release))
    child.start()
    assert ready.wait(30)
    release.set()
    child.join(30)
    assert _progress.record("after", "flashedu.checks.ch01", _report())
    assert "after" in json.loads(target.read_text())


def test_a_lock_held_too_long_is_said_in_one_line_and_grading_goes_on(target, monkeypatch):
    ctx = multiprocessing.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_hold_lock, args=(str(target), ready, release))
    child.start()
    assert ready.wait(30)
    monkeypatch.setattr(_progress, "LOCK_TIMEOUT", 0.2)
    said = []
    assert not _progress.record("blocked", "flashedu.checks.ch01", _report(), say=said.append)
    release.set()
    child.join(30)
    assert len(said) == 1 and "blocked (passed) was not recorded" in said[0]
    assert "held too long" in said[0]


GOOD = {"kept": {"status": "passed", "cases": "3/3", "chapter": "ch01", "time": "t"}}
UNREADABLE = {
    "corrupt": b"\x89PNG\r\n\x1a\n\x00\xff",
    "truncated": json.dumps(GOOD).encode()[:25],
    "empty": b"",
    "a list": b"[1, 2, 3]",
    "an entry of the wrong type": b'{"kept": 7}',
    "an unknown status": b'{"kept": {"status": "certified", "cases": "3/3"}}',
    "a number where text belongs": b'{"kept": {"status": "passed", "cases": 3}}',
}


@pytest.mark.parametrize("kind", list(UNREADABLE))
def test_an_unreadable_file_is_moved_aside_never_overwritten(target, kind):
    target.write_bytes(UNREADABLE[kind])
    said = []
    assert _progress.record("new", "flashedu.checks.ch01", _report(), say=said.append)
    backups = list(target.parent.glob("progress.json.unreadable-*"))
    assert len(backups) == 1 and backups[0].read_bytes() == UNREADABLE[kind]
    assert len(said) == 1 and str(backups[0]) in said[0] and "could not be read" in said[0]
    assert set(json.loads(target.read_text())) == {"new"}


@pytest.mark.parametrize("kind", ["truncated", "a list"])
def test_progress_on_an_unreadable_file_says_where_it_went_and_prints_the_scorecard(target, kind):
    target.write_bytes(UNREADABLE[kind])
    lines = []
    status = _progress.progress(out=lines.append)
    assert "moved it to" in lines[0] and lines[1].startswith("progress: 0 passed")
    assert set(status.values()) == {"not attempted"}
    assert not target.exists()  # moved aside, then nothing recorded yet


def test_two_unreadable_files_in_one_second_get_two_backups(target):
    for text in (b"{", b"[}"):
        target.write_bytes(text)
        _progress.record("new", "flashedu.checks.ch01", _report(), say=lambda line: None)
    backups = sorted(p.read_bytes() for p in target.parent.glob("progress.json.unreadable-*"))
    assert backups == [b"[}", b"{"]


def test_an_unwritable_location_is_said_in_one_line(tmp_path, monkeypatch):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("a file where the folder should be")  # fails for root too, unlike chmod
    monkeypatch.setenv(_progress.ENV, str(blocker / "progress.json"))
    said = []
    assert not _progress.record("x", "flashedu.checks.ch01", _report("wrong"), say=said.append)
    assert len(said) == 1 and said[0].startswith("progress: x (wrong) was not recorded in ")
    assert blocker.read_text() == "a file where the folder should be"


def test_a_grader_says_when_it_could_not_record(tmp_path, monkeypatch):
    from flashedu import checks

    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(_progress.ENV, str(blocker / "progress.json"))
    lines = []

    def stub(*args, **kwargs):
        raise NotImplementedError

    checks.naive_attention(stub, out=lines.append)
    assert lines[0] == "naive_attention: not attempted yet"
    assert len(lines) == 2 and "was not recorded" in lines[1]


def test_atomic_write_failing_half_way_leaves_the_old_file(tmp_path, monkeypatch):
    out = tmp_path / "results.json"
    out.write_text('{"good": 1}')

    def broken_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="No space"):
        write_atomic(out, '{"new": 2}')
    assert out.read_text() == '{"good": 1}' and not list(tmp_path.glob("*.tmp"))


def test_bench_that_times_nothing_leaves_the_results_file_alone(tmp_path, capsys):
    from flashedu.bench import __main__ as bench

    out = tmp_path / "mine.json"
    out.write_text('{"good": 1}')
    mode = out.stat().st_mode
    status = bench.main(["--cpu", "--N", "10000000", "--impls", "naive", "--out", str(out)])
    assert status == 1 and out.read_text() == '{"good": 1}' and out.stat().st_mode == mode
    err = capsys.readouterr()
    assert "was not written" in err.out and "nothing was timed" in err.err


def test_bench_writes_its_results_atomically_with_the_usual_mode(tmp_path):
    from flashedu.bench import __main__ as bench

    out = tmp_path / "mine.json"
    status = bench.main(
        ["--cpu", "--quick", "--N", "32", "--impls", "naive", "--repeats", "1", "--out", str(out)]
    )
    assert status == 0 and json.loads(out.read_text())["timing"]
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600
    assert not list(tmp_path.glob("*.tmp"))
