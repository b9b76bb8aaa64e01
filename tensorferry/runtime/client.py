"""``Client``: a process's handle to its devices, holding a set of streams per device.

Like a PjRt client, a client owns per device a compute stream, host↔device copy streams,
point-to-point send/recv streams, a callback stream and device↔device copy streams. Making a
client is cheap: its streams come from the process-level stream pool and go back to it, reset,
on :meth:`Client.close`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from tensorferry.errors import ClientClosedError
from tensorferry.runtime import _registry
from tensorferry.runtime._devices import cuda_device_count, parse_device
from tensorferry.runtime._streams import PRIORITIES, Stream, StreamKey, StreamPool

__all__ = ["Client", "ClientConfig", "STREAM_ROLES"]

# Roles every CUDA device gets once; the rest of ``streams_per_device`` are device_to_device.
STREAM_ROLES = ("compute", "host_to_device", "device_to_host", "send", "recv", "callback")


@dataclass(kw_only=True, slots=True, frozen=True)
class ClientConfig:
    """How a :class:`Client` sets up its devices."""

    streams_per_device: int = 14
    """Streams per CUDA device: one per role in ``STREAM_ROLES``, the rest device_to_device."""
    priority: str = "normal"
    """Stream priority: ``"normal"`` or ``"high"``."""
    non_blocking: bool = True
    """Streams do not synchronise with the legacy default stream."""
    pool_streams: bool = True
    """Take streams from the process-level pool; off, every client creates and destroys its own."""

    def __post_init__(self) -> None:
        if not isinstance(self.streams_per_device, int) or isinstance(
            self.streams_per_device, bool
        ):
            raise TypeError(
                f"streams_per_device must be an int, got {type(self.streams_per_device).__name__}"
            )
        if self.streams_per_device < len(STREAM_ROLES):
            raise ValueError(
                f"streams_per_device must be >= {len(STREAM_ROLES)} (one per role "
                f"{', '.join(STREAM_ROLES)}), got {self.streams_per_device}"
            )
        if self.priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {PRIORITIES}, got {self.priority!r}")


_DEFAULT_CONFIG = ClientConfig()
_ROLE_INDEX = {role: i for i, role in enumerate(STREAM_ROLES)} | {
    "device_to_device": len(STREAM_ROLES)
}


# Parsed device lists by argument (a client cycle should not re-parse the same list), bounded.
_PARSED: dict[Any, tuple[torch.device, ...]] = {}
_PARSED_MAX = 64


def _cached_devices(devices: Any) -> tuple[torch.device, ...]:
    # Types are part of the key: True == 1, but True is not a device.
    if isinstance(devices, (list, tuple)):
        key: Any = tuple((d.__class__, d) for d in devices)
    else:
        key = (devices.__class__, devices)
    try:
        return _PARSED[key]
    except (KeyError, TypeError):  # TypeError: an unhashable entry; parse without caching
        pass
    parsed = tuple(_normalise_devices(devices))
    try:
        if len(_PARSED) < _PARSED_MAX:
            _PARSED[key] = parsed
    except TypeError:
        pass
    return parsed


def _normalise_devices(devices: Any) -> list[torch.device]:
    if devices is None:
        count = cuda_device_count()
        return [torch.device("cuda", i) for i in range(count)] or [torch.device("cpu")]
    if isinstance(devices, (int, str, torch.device)):
        devices = [devices]
    if not isinstance(devices, Iterable):
        raise TypeError(f"devices must be a device or a list of devices, got {devices!r}")
    result: list[torch.device] = []
    count = None  # CUDA devices visible, asked once
    for value in devices:
        entry = parse_device(value, what="devices")
        if entry.type == "cuda":
            index = 0 if entry.index is None else entry.index
            if count is None:
                count = cuda_device_count()
            if index < 0 or index >= count:
                raise ValueError(
                    f"devices: cuda:{index} is out of range (this process sees {count} CUDA "
                    "device(s))"
                )
            if entry.index is None:
                entry = torch.device("cuda", index)
        if entry in result:
            raise ValueError(f"devices: {entry} is listed twice")
        result.append(entry)
    if not result:
        raise ValueError("devices: the list is empty")
    return result


_KEYS: dict[tuple[int, str, bool], StreamKey] = {}


def _stream_key(device: int, priority: str, non_blocking: bool) -> StreamKey:
    spec = (device, priority, non_blocking)
    key = _KEYS.get(spec)
    if key is None:
        key = _KEYS[spec] = StreamKey(device=device, priority=priority, non_blocking=non_blocking)
    return key


class Client:
    """A process's handle to its devices.

    Args:
        devices: CUDA indices, ``"cuda:N"``/``"cpu"`` strings or ``torch.device`` objects;
            ``None`` takes every visible CUDA device (or the CPU when there is none).
        config: stream set-up; see :class:`ClientConfig`.
        pool: the stream pool to lease from (the process-level one by default).

    Raises:
        ValueError: an unknown device, an index out of range, or a device listed twice.

    Example::

        with tf.Client(devices=[0, 1]) as client:
            with torch.cuda.stream(client.stream(0, "send")):
                ...
    """

    def __init__(
        self,
        devices: Any = None,
        *,
        config: ClientConfig | None = None,
        pool: StreamPool | None = None,
    ) -> None:
        self.config = config if config is not None else _DEFAULT_CONFIG
        if not isinstance(self.config, ClientConfig):
            raise TypeError(f"config must be a ClientConfig, got {type(self.config).__name__}")
        self.devices: tuple[torch.device, ...] = _cached_devices(devices)
        self._lock = threading.Lock()
        self._closed = False
        # Per CUDA device its leased streams in lease order: STREAM_ROLES first, then
        # device_to_device (kept flat so a lease cycle does no per-stream bookkeeping).
        self._streams: dict[torch.device, list[Stream]] = {}
        cuda_devices = [d for d in self.devices if d.type == "cuda"]
        self._pool = pool if pool is not None or not cuda_devices else _registry.stream_pool()
        try:
            for device in cuda_devices:
                self._streams[device] = self._lease(device)
        except BaseException:
            self._give_back()
            raise

    # ------------------------------------------------------------------ streams
    def stream(self, device: Any, role: str = "compute", index: int = 0) -> Any:
        """The ``torch`` stream for ``role`` on ``device`` (``None`` for CPU devices).

        Raises:
            ClientClosedError: the client is closed.
            ValueError: ``device`` is not one of this client's, or ``role``/``index`` unknown.
        """
        stream = self.raw_stream(device, role, index)
        return None if stream is None else stream.torch

    def raw_stream(self, device: Any, role: str = "compute", index: int = 0) -> Stream | None:
        """Like :meth:`stream` but returns the pooled :class:`Stream` lease."""
        self._check_open()
        dev = self._own_device(device)
        # Checked before the CPU's answer: a role or index that is wrong is wrong everywhere, and
        # code tried on a CPU machine should not first fail on a GPU one.
        first = _ROLE_INDEX.get(role)
        if first is None:
            raise ValueError(f"role must be one of {sorted(_ROLE_INDEX)}, got {role!r}")
        count = self.config.streams_per_device - first if role == "device_to_device" else 1
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
            raise ValueError(f"{role} has {count} stream(s); index {index!r} is invalid")
        if dev.type == "cpu":
            return None
        return self._streams[dev][first + index]

    def streams(self, device: Any) -> dict[str, list[Stream]]:
        """Every stream this client holds on ``device``, by role (empty for CPU devices)."""
        self._check_open()
        dev = self._own_device(device)
        streams = self._streams.get(dev)
        if not streams:
            return {}
        roles = {role: [streams[i]] for i, role in enumerate(STREAM_ROLES)}
        roles["device_to_device"] = streams[len(STREAM_ROLES) :]
        return roles

    # ------------------------------------------------------------------ lifetime
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Gives every stream back to the pool (reset first). A second call does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._give_back()

    def __enter__(self) -> Client:
        self._check_open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        names = ", ".join(str(d) for d in self.devices)
        return f"Client([{names}], {state})"

    # ------------------------------------------------------------------ internals
    def _lease(self, device: torch.device) -> list[Stream]:
        assert self._pool is not None
        key = _stream_key(device.index, self.config.priority, self.config.non_blocking)
        count = self.config.streams_per_device
        if self.config.pool_streams:
            streams = self._pool.acquire_many(key, count)
        else:
            streams = []
            try:
                streams.extend(self._pool.create_unpooled(key) for _ in range(count))
            except BaseException:
                for stream in streams:
                    self._pool.destroy_unpooled(stream)
                raise
        return streams

    def _give_back(self) -> None:
        leases = list(self._streams.values())
        self._streams.clear()
        if self._pool is None:
            return
        for streams in leases:  # one device's lease goes back as one set
            if self.config.pool_streams:
                self._pool.release_many(streams)
                continue
            for stream in streams:
                self._pool.destroy_unpooled(stream)

    def _own_device(self, device: Any) -> torch.device:
        try:
            (dev,) = _normalise_devices(device)
        except ValueError as exc:
            raise ValueError(f"device {device!r} is not one of {list(self.devices)}") from exc
        if dev not in self.devices:
            raise ValueError(f"device {dev} is not one of this client's {list(self.devices)}")
        return dev

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosedError("this Client is closed; make a new one")
