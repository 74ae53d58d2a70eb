"""The compose test needs a Docker engine and built images: `make test-compose` (which sets
TANDEM_COMPOSE=1) runs it; `make test` skips it."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config, items):
    if os.environ.get("TANDEM_COMPOSE"):
        return
    skip = pytest.mark.skip(reason="needs a Docker engine and images: make test-compose runs it")
    for item in items:
        if "compose" in item.keywords:
            item.add_marker(skip)
