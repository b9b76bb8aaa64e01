"""Making a CUDA stream current for a block, without ``torch.cuda.stream``'s Python overhead.

``with torch.cuda.stream(s)`` looks up the current device through ``torch.cuda.is_available()``
(which reads an environment variable on every call), builds a ``Stream`` object for the stream
it replaces and another check of devices, on entry and on exit: a few microseconds each time on
a fast host, several times that on a busy virtual machine. The graph runner switches streams
five times per execution of a two-actor chain and the p2p layer once per transfer, all on the
critical path, so they use :func:`on_stream` instead: two calls into torch's C API.

Same effect as ``torch.cuda.stream(s)``: ``s`` is current on its device inside the block and the
previous current stream of that device afterwards; the current device is ``s``'s device inside
the block and is restored on exit.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["on_stream"]


class on_stream:  # lower case: used like torch.cuda.stream
    """Context manager: ``stream`` (a ``torch.cuda.Stream``) is current inside the block."""

    __slots__ = ("_id", "_index", "_previous", "_previous_device", "_type")

    def __init__(self, stream: Any) -> None:
        self._id = stream.stream_id
        self._index = stream.device_index
        self._type = stream.device_type

    def __enter__(self) -> None:
        self._previous_device = torch._C._cuda_getDevice()
        # (stream id, device index, device type) of the stream current on the target device.
        self._previous = torch._C._cuda_getCurrentStream(self._index)
        torch._C._cuda_setStream(
            stream_id=self._id, device_index=self._index, device_type=self._type
        )

    def __exit__(self, *exc: object) -> None:
        stream_id, index, device_type = self._previous
        # Setting a stream also makes its device current (as torch.cuda.set_stream does).
        torch._C._cuda_setStream(stream_id=stream_id, device_index=index, device_type=device_type)
        if self._previous_device != index:
            torch._C._cuda_setDevice(self._previous_device)
