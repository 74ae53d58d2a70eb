"""Progress that suits where the output goes.

On a terminal, a live tqdm bar. In a file or a pipe, a plain line every few seconds and one
at the end: a bar redraws with carriage returns, which a log keeps as one endless line.
"""

from __future__ import annotations

import math
import sys
import time
from typing import TextIO

LINE_EVERY_S = 5.0
"""How often a plain line is written when the output is not a terminal."""


class Progress:
    """`n` of `total` `unit`s, a description and a few named figures, shown as the output
    allows. Set the position with `update`; `write` prints a message without breaking the bar."""

    def __init__(
        self, total: float, desc: str, unit: str, file: TextIO | None = None, every_s: float = LINE_EVERY_S
    ) -> None:
        self.file = file or sys.stderr
        self.total, self.desc, self.unit, self.every_s = total, desc, unit, every_s
        self.n: float = 0
        self.postfix: dict[str, str] = {}
        self.started = time.monotonic()
        self.last_line = -math.inf
        self.last_shown: tuple | None = None
        self.bar = None
        if self.file.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, file=self.file, dynamic_ncols=True, mininterval=1.0)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def update(self, n: float | None = None, desc: str | None = None, postfix: dict[str, str] | None = None) -> None:
        """Move to position `n` (absolute), and change the description or figures if given."""
        self.n = self.n if n is None else n
        self.desc = desc or self.desc
        self.postfix = self.postfix if postfix is None else postfix
        if self.bar is not None:
            self.bar.n = self.n
            self.bar.set_description(self.desc, refresh=False)
            self.bar.set_postfix(self.postfix, refresh=False)
            self.bar.refresh()
        elif time.monotonic() - self.last_line >= self.every_s:
            self._line()

    def advance(self, by: float = 1) -> None:
        self.update(self.n + by)

    def write(self, message: str) -> None:
        if self.bar is not None:
            self.bar.write(message, file=self.file)
        else:
            print(message, file=self.file, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.last_shown != self._state():
            self._line()

    def _state(self) -> tuple:
        return self.n, self.desc, tuple(self.postfix.items())

    def _line(self) -> None:
        self.last_line, self.last_shown = time.monotonic(), self._state()
        share = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        figures = "".join(f", {name}={value}" for name, value in self.postfix.items())
        elapsed = time.monotonic() - self.started
        print(
            f"{self.desc}: {self.n:g}/{self.total:g} {self.unit}{share}, {elapsed:.0f} s{figures}",
            file=self.file,
            flush=True,
        )
