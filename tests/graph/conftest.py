"""Fixtures shared by the graph tests."""

from __future__ import annotations

import glob
import uuid

import pytest

from tensorferry.graph._channel import Channel, Control, unlink_prefix


@pytest.fixture
def ring():
    """A control block and one shared-memory channel of two slots: (control, writer, reader).
    Removed afterwards, and checked to leave nothing in /dev/shm."""
    prefix = f"tftest{uuid.uuid4().hex[:8]}"
    control = Control(f"{prefix}c", create=True)
    Channel.create(f"{prefix}e", slots=2, slot_size=4096)
    writer, reader = Channel(f"{prefix}e", control), Channel(f"{prefix}e", control)
    yield control, writer, reader
    writer.close()
    reader.close()
    control.close()
    unlink_prefix(prefix)
    assert not glob.glob(f"/dev/shm/{prefix}*")
