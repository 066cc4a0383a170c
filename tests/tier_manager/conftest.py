"""Fixtures shared by the tier manager's tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def staging_made(monkeypatch) -> list[int]:
    """The sizes of the IO engine's staging buffers made from here on, one entry each."""
    from tierstack.services.tier_manager import io_engine

    made: list[int] = []

    class Counted(io_engine.StagingBuffer):
        def __init__(self, nbytes: int) -> None:
            made.append(nbytes)
            super().__init__(nbytes)

    monkeypatch.setattr(io_engine, "StagingBuffer", Counted)
    return made
