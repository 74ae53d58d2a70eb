"""A deadline on rendering a model's chat template.

The template comes with the model folder (an imported GGUF carries its own). transformers
renders it in Jinja's sandbox, which bounds each `range` (100,000 items) but not loops
nested in one another, so a template can hold the process for hours. `within_deadline` runs
a rendering on the calling thread and, past `RENDER_DEADLINE_S`, raises an exception into it
(Python checks for one between bytecodes, and the template's loops are Python), which
becomes `ChatTemplateTimeout`: the template is refused, saying so.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import TypeVar

RENDER_DEADLINE_S = 2.0
"""Longest one rendering may take. A real template renders a long conversation in
milliseconds; a looping one is stopped here, having built at most what two seconds of
Jinja build (hundreds of MB at worst)."""
T = TypeVar("T")


class ChatTemplateTimeout(ValueError):
    """The model's chat template did not render within `RENDER_DEADLINE_S`."""


def within_deadline(render: Callable[[], T]) -> T:
    """`render()` on this thread, stopped with `ChatTemplateTimeout` past `RENDER_DEADLINE_S`."""
    watch = _Watch(threading.get_ident())
    timer = threading.Timer(RENDER_DEADLINE_S, watch.expire)
    timer.daemon = True
    try:
        try:
            timer.start()
            return render()
        finally:
            timer.cancel()
            watch.disarm()
    except _Expired:
        raise ChatTemplateTimeout(
            f"the model's chat template did not render within {RENDER_DEADLINE_S:g} s and is refused "
            "(a loop without end?)"
        ) from None


class _Expired(BaseException):
    """Raised into a rendering past its deadline: not an Exception, so that no `except
    Exception` in the template engine swallows it."""


class _Watch:
    """Raises `_Expired` into one thread unless disarmed first. Disarming clears one that was
    raised but not yet delivered, so that none lands after the rendering has returned."""

    def __init__(self, thread_id: int) -> None:
        self.thread_id = thread_id
        self.lock = threading.Lock()
        self.armed = True
        self.fired = False

    def expire(self) -> None:
        with self.lock:
            if self.armed:
                _raise_in(self.thread_id, _Expired)
                self.fired = True

    def disarm(self) -> None:
        with self.lock:
            self.armed = False
            if self.fired:
                _raise_in(self.thread_id, None)


def _raise_in(thread_id: int, exception: type[BaseException] | None) -> None:
    """Have `exception` raised in a thread at its next bytecode; None clears a pending one."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exception) if exception else None
    )
