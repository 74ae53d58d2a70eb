"""How a learner's last exit is read back by the learner that restarts its job."""

from __future__ import annotations

from learner.torchrun import EXIT_FILE, NO_EXIT_RECORDED, take_exit


def test_an_exit_record_torn_by_a_full_disk_reads_as_none_and_is_removed(tmp_path):
    # torchrun's write on a full disk leaves the file empty; a restarted learner that
    # failed reading it would never count its restart and would crash-loop.
    record = tmp_path / "job-1" / EXIT_FILE
    record.parent.mkdir()
    record.write_text("")

    assert take_exit(str(tmp_path), "job-1", not_before=0.0) == NO_EXIT_RECORDED
    assert not record.exists()
