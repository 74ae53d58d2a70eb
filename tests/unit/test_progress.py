"""Progress output: a live bar on a terminal, plain lines in a file or a pipe."""

from __future__ import annotations

import io

from tandem.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_file_gets_plain_lines_with_no_carriage_return_and_a_last_line_at_the_end():
    out = io.StringIO()
    with Progress(40, "job-1 rl", "step", file=out, every_s=0.0) as progress:
        progress.update(10, postfix={"reward": "0.50"})
        progress.write("job-1: a health alert")
        progress.update(40, desc="job-1 succeeded")

    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[0].startswith("job-1 rl: 10/40 step (25%), ") and lines[0].endswith(", reward=0.50")
    assert lines[1] == "job-1: a health alert"
    assert lines[2].startswith("job-1 succeeded: 40/40 step (100%)")
    assert len(lines) == 3  # closing adds no line: the last one already shows the end


def test_a_file_gets_at_most_one_line_per_interval_however_often_the_position_moves():
    out = io.StringIO()
    progress = Progress(1000, "groups", "group", file=out, every_s=3600.0)
    for n in range(1, 1001):
        progress.update(n)
    progress.close()

    lines = out.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == ["groups: 1/1000 group (0%)", "groups: 1000/1000 group (100%)"]


def test_a_terminal_gets_a_bar_that_redraws_in_place():
    out = Terminal()
    with Progress(4, "job-1 rl", "step", file=out) as progress:
        for n in range(1, 5):
            progress.update(n, postfix={"reward": f"{n / 4:.2f}"})

    text = out.getvalue()
    assert "\r" in text and "4/4" in text and "reward=1.00" in text
    assert text.count("\n") <= 1  # redrawn in place, one newline when it closes
