"""Fixtures of the process tests."""

from __future__ import annotations

import pytest

from tests.launch import Listener


@pytest.fixture
def listener():
    li = Listener()
    yield li
    li.close()
