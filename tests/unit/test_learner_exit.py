"""How a learner's last exit and its ranks' errors are read back for the job's record."""

from __future__ import annotations

from learner.control import rank_errors
from learner.torchrun import EXIT_FILE, NO_EXIT_RECORDED, take_exit


def test_an_exit_record_torn_by_a_full_disk_reads_as_none_and_is_removed(tmp_path):
    # torchrun's write on a full disk leaves the file empty; a restarted learner that
    # failed reading it would never count its restart and would crash-loop.
    record = tmp_path / "job-1" / EXIT_FILE
    record.parent.mkdir()
    record.write_text("")

    assert take_exit(str(tmp_path), "job-1", not_before=0.0) == NO_EXIT_RECORDED
    assert not record.exists()


def test_a_rank_error_its_rank_could_not_write_still_names_the_rank(tmp_path):
    # A full disk leaves the error file empty: the job's reason must not be blank.
    (tmp_path / "rank-0.txt").write_text("rank 0 failed in 'save': OSError: [Errno 28] No space left on device")
    (tmp_path / "rank-1.txt").write_text("")

    assert rank_errors(tmp_path) == [
        "rank 0 failed in 'save': OSError: [Errno 28] No space left on device",
        "rank 1 failed; its error could not be written (a full disk?)",
    ]
