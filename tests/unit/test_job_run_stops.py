"""SIGTERM reaches every kind of job through Run.check_stop, which asks the run for a
stop's checkpoint: each kind must take that call (a generate job's SIGTERM once raised
TypeError here, since only the RL run's signature had changed)."""

from __future__ import annotations

import inspect

import pytest

from learner.runs import RUNS


@pytest.mark.parametrize("run", RUNS.values(), ids=lambda c: c.__name__)
def test_every_job_kind_takes_the_stop_checkpoint_call(run):
    inspect.signature(run.checkpoint).bind(object(), stopping=True)
    assert inspect.iscoroutinefunction(run.checkpoint)
