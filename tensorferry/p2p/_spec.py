"""What a message is: tensor specs, argument validation and the header descriptor.

A *descriptor* is the list of ``(dtype, shape)`` of a message's tensors. The sender's descriptor
travels to the receiver in the header, the receiver's expectation travels back, and both sides
compare the two with :func:`compare` — so both raise the same :class:`MismatchError`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tensorferry import _native
from tensorferry.errors import MismatchError

__all__ = [
    "TensorSpec",
    "Descriptor",
    "as_tensor_list",
    "as_recv_list",
    "check_receives_apart",
    "lazy_view_problem",
    "check_peer",
    "compare",
    "descriptor_text",
    "descriptor_from_text",
]

# (dtype name, shape) per tensor, e.g. (("float32", (4, 8)),). Shapes read from tensors stay
# torch.Size objects (a tuple subclass, equal to and hashing like the plain tuple a peer's
# header gives): copying each into a tuple cost about a tenth of a message's validation.
Descriptor = tuple[tuple[str, tuple[int, ...]], ...]


# Quantized dtypes (their tensors carry a quantizer, not just bytes): refused like the tensors.
_QUANTIZED = frozenset(
    getattr(torch, name)
    for name in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
    if hasattr(torch, name)
)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Shape and dtype of a tensor to receive; ``tf.recv`` allocates it on this rank's device.

    Attributes:
        shape: sizes, e.g. ``(4, 1024)``; must equal the sender's tensor shape.
        dtype: element type; must equal the sender's.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    def __init__(self, shape: Any, dtype: torch.dtype = torch.float32) -> None:
        # Integers of other types (numpy's, a 0-d integer tensor) are taken; bools are not.
        given = shape
        if not isinstance(shape, (tuple, list)):  # torch.Size is a tuple
            shape = (shape,)  # one size; anything else fails below
        sizes = [_as_int(s) for s in shape]
        if any(s is None for s in sizes):
            raise TypeError(f"TensorSpec shape must be a tuple of ints, got {given!r}")
        shape = sizes
        if any(s < 0 for s in shape):
            raise ValueError(f"TensorSpec shape has a negative size: {tuple(shape)}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"TensorSpec dtype must be a torch.dtype, got {dtype!r}")
        if dtype in _QUANTIZED:  # torch.empty of one fails inside torch, with an internal assert
            raise TypeError(
                f"TensorSpec dtype {dtype} is quantized: quantized tensors are not supported"
            )
        object.__setattr__(self, "shape", tuple(shape))
        object.__setattr__(self, "dtype", dtype)

    @classmethod
    def like(cls, tensor: torch.Tensor) -> TensorSpec:
        """The spec of an existing tensor."""
        return cls(tuple(tensor.shape), tensor.dtype)

    def empty(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)


def _as_int(value: Any) -> int | None:
    """``value`` as a Python int when it is an integer of any type (numpy's, a 0-d integer
    tensor), else ``None``: bools and floats are not (shape sizes and peer ranks)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


class _Interned(tuple):
    """A descriptor that remembers its hash. A message's descriptor is looked up in several
    caches on its way out (header text, transport ranking, packing plan, staging buffer), and
    a tuple hashes all its items again for each: for a message of 64 tensors, microseconds
    per lookup. Equal to, and hashing like, the plain tuple it wraps."""

    def __new__(cls, items: tuple) -> _Interned:
        self = super().__new__(cls, items)
        self._hash = tuple.__hash__(self)
        return self

    def __hash__(self) -> int:
        return self._hash


_INTERNED: dict[Descriptor, Descriptor] = {}


def _intern(desc: Descriptor) -> Descriptor:
    """The one instance of ``desc``: messages repeat their layouts, so later lookups of the
    same layout compare by identity and reuse the remembered hash."""
    known = _INTERNED.get(desc)
    if known is not None:
        return known
    if len(_INTERNED) >= 4096:  # bounded: a program of ever-new layouts gets plain tuples
        return desc
    known = _INTERNED[desc] = _Interned(desc)
    return known


def describe(tensors: Sequence[torch.Tensor]) -> Descriptor:
    return _intern(tuple((_dtype_name(t.dtype), t.shape) for t in tensors))


_DESCRIPTOR_TEXTS: dict[Descriptor, str] = {}


def descriptor_text(desc: Descriptor) -> str:
    """``desc`` as headers carry it: ``dtype:d0,d1|dtype:d0|...`` (``dtype:`` for a scalar).

    One string with nothing to escape rather than a JSON list of lists: writing, reading and
    comparing it costs one string operation, where a list costs work per tensor (a header of
    64 tensors took tens of microseconds each way). Cached: messages repeat their layouts.
    """
    text = _DESCRIPTOR_TEXTS.get(desc)
    if text is None:
        text = "|".join(f"{dtype}:{','.join(map(str, shape))}" for dtype, shape in desc)
        if len(_DESCRIPTOR_TEXTS) < 4096:
            _DESCRIPTOR_TEXTS[desc] = text
    return text


def descriptor_from_text(text: str) -> Descriptor:
    """The descriptor :func:`descriptor_text` wrote."""
    if not text:
        return ()
    items = []
    for item in text.split("|"):
        dtype, _, dims = item.partition(":")
        items.append((dtype, tuple(int(d) for d in dims.split(",")) if dims else ()))
    return tuple(items)


def check_peer(peer: Any, *, rank: int, world_size: int, what: str) -> int:
    """Validates a peer rank; returns it as an ``int``. Integers of other types (numpy's, say)
    are taken; bools and floats are not. Raises TypeError/ValueError naming ``what``
    (e.g. ``"dst"``)."""
    if type(peer) is not int:
        rank_given = _as_int(peer)
        if rank_given is None:
            raise TypeError(f"{what} must be an int rank, got {type(peer).__name__} {peer!r}")
        peer = rank_given
    if not 0 <= peer < world_size:
        raise ValueError(f"{what}={peer} is out of range: world size is {world_size}")
    if peer == rank:
        raise ValueError(f"{what}={peer} is this process's own rank; p2p needs another rank")
    return peer


# dtypes seen so far that a message may carry (quantized ones never get here): their names.
_PLAIN_DTYPES: dict[torch.dtype, str] = {}
# Tensor types the one-pass check takes (weights arrive as parameters).
_PLAIN_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))
_PLAIN_TYPE_TUPLE = tuple(_PLAIN_TYPES)
# The descriptor the one pass gave last: the compiled check gives it back, allocating nothing,
# when the next message has the same layout (messages repeat theirs). A hint only: it compares
# in full.
_last_walked: Descriptor | None = None
# Only these can carry a conjugate bit: the one-pass check asks the others one flag, not two.
_COMPLEX = frozenset((torch.complex32, torch.complex64, torch.complex128))


def lazy_view_problem(t: torch.Tensor) -> str | None:
    """Why ``t``'s memory does not hold its values, or ``None`` when it does.

    ``x.conj()`` and ``x.conj().imag`` are views whose conjugation or negation is a flag that
    every torch operation applies as it reads them: their bytes are ``x``'s. Transports move
    bytes, so such a tensor would arrive as something else; written into, it would read back
    changed."""
    if t.is_conj():
        return (
            "is a conjugate view (x.conj()): its memory holds the unconjugated values; pass "
            "tensor.resolve_conj()"
        )
    if t.is_neg():
        return (
            "is a negative view (such as x.conj().imag): its memory holds the values before "
            "negation; pass tensor.resolve_neg()"
        )
    return None


def _inspect(
    items: Sequence[Any], device: torch.device, what: str
) -> tuple[tuple[torch.Tensor, ...], Descriptor]:
    """Validates every tensor and describes them, in one pass (a message may hold hundreds of
    small tensors, and each attribute read costs a tenth of a microsecond).

    Tensors that require grad (parameters, activations) are returned detached: the same memory,
    outside autograd. Transports write received bytes in place and view tensors as bytes, which
    autograd refuses on a leaf that requires grad; moving data is not an operation to record.
    """
    if type(items[0]) in _PLAIN_TYPES:
        plain = _inspect_plain(items, device, what)
        if plain is not None:
            return plain
    tensors = _check_tensors(items, device, what)
    for t in tensors:
        _PLAIN_DTYPES.setdefault(t.dtype, _dtype_name(t.dtype))
    return _detached(tensors), describe(tensors)


def _inspect_plain(
    items: Sequence[Any], device: torch.device, what: str
) -> tuple[tuple[torch.Tensor, ...], Descriptor] | None:
    """:func:`_inspect`'s one pass, for a message of plain contiguous tensors of one device:
    ``None`` when any item is something else (a subclass, a lazy view, a ``TensorSpec``...),
    for the detailed check to name it. Raises only when they are all on another rank's device."""
    global _last_walked
    native = _native.helper()
    if native is not None:  # the same loop in C++ (tensorferry/_native)
        walked = native.inspect_plain(items, _PLAIN_TYPE_TUPLE, _PLAIN_DTYPES, _last_walked)
    else:
        walked = _walk(items)
    if walked is None:
        return None
    grads, desc = walked
    if desc is not _last_walked:
        desc = _last_walked = _intern(desc)
    expected = items[0].device
    if expected != device and expected.type != "cpu":
        _check_tensor(items[0], 0, device, what)  # raises: not this rank's device
    return _detached(items) if grads else tuple(items), desc


def _walk(items: Sequence[Any]) -> tuple[bool, Descriptor] | None:
    """The one pass in Python: ``(any requires grad, descriptor)``, or ``None`` for anything
    unusual (as ``inspect_plain`` of ``tensorferry/_native``)."""
    expected = items[0].device
    names = _PLAIN_DTYPES
    desc = []
    grads = False
    try:
        for t in items:
            # is_contiguous() raises for sparse layouts: they take the detailed path too.
            if type(t) not in _PLAIN_TYPES or t.device != expected or not t.is_contiguous():
                return None
            dtype = t.dtype
            name = names.get(dtype)
            if name is None or t.is_neg() or (dtype in _COMPLEX and t.is_conj()):
                return None
            desc.append((name, t.shape))
            grads = grads or t.requires_grad
    except RuntimeError:
        return None
    return grads, tuple(desc)


def _detached(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``tensors`` with those that require grad detached, each once: a tensor listed twice
    stays one object, so :func:`check_receives_apart` still sees it listed twice."""
    once: dict[int, torch.Tensor] = {}
    out = []
    for t in tensors:
        if t.requires_grad:
            detached = once.get(id(t))
            if detached is None:
                detached = once[id(t)] = t.detach()
            t = detached
        out.append(t)
    return tuple(out)


def _check_tensors(items: Sequence[Any], device: torch.device, what: str) -> tuple:
    """Validates every tensor, attribute by attribute (the path of unusual messages)."""
    first = items[0]
    if not isinstance(first, torch.Tensor):
        _check_tensor(first, 0, device, what)  # raises the precise error
    expected = first.device
    for i, t in enumerate(items):
        if (
            type(t) is not torch.Tensor
            or t.device != expected
            or t.layout is not torch.strided
            or t.is_quantized
            or t.is_nested
            or not t.is_contiguous()
            or t.is_neg()
            or t.is_conj()
        ):
            _check_tensor(t, i, device, what)
            if t.device != expected:
                _check_one_device(items, what)
    if expected != device and expected.type != "cpu":
        _check_tensor(first, 0, device, what)
    return tuple(items)


def _check_tensor(t: Any, index: int, device: torch.device, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}[{index}] must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device and t.device.type != "cpu":
        owner = (
            " (another rank's device: each process moves tensors of its own device only)"
            if t.device.type == device.type == "cuda"
            else ""
        )
        where = "the CPU" if device.type == "cpu" else f"{device} or the CPU"
        raise ValueError(
            f"{what}[{index}] is on {t.device}; this rank moves tensors of {where}{owner}"
        )
    # Before is_contiguous(): CSR has none. A nested tensor has no one shape to describe.
    if t.layout is not torch.strided or t.is_quantized or t.is_nested:
        raise TypeError(f"{what}[{index}]: sparse, quantized and nested tensors are not supported")
    if not t.is_contiguous():
        raise ValueError(
            f"{what}[{index}] is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); "
            "pass tensor.contiguous()"
        )
    problem = lazy_view_problem(t)
    if problem is not None:
        raise ValueError(f"{what}[{index}] {problem}")
    return t


def as_tensor_list(
    tensors: Any, device: torch.device, what: str
) -> tuple[tuple[torch.Tensor, ...], Descriptor, bool]:
    """Normalises a tensor or a sequence of tensors to send.

    Returns:
        ``(tensors, descriptor, single)``: ``single`` is true when one bare tensor was passed.
    """
    single = isinstance(tensors, torch.Tensor)
    items = [tensors] if single else tensors
    if not isinstance(items, (list, tuple)):
        raise TypeError(f"{what} must be a tensor or a list of tensors, got {type(items).__name__}")
    if not items:
        raise ValueError(f"{what} is an empty list: nothing to transfer")
    return (*_inspect(items, device, what), single)


def _check_one_device(tensors: Sequence[torch.Tensor], what: str) -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(
            f"{what} mixes devices {sorted(map(str, devices))}: one call moves tensors of one "
            "device (use a tf.batch() with one send/recv per device)"
        )


def as_recv_list(
    buffers: Any, device: torch.device, what: str
) -> tuple[tuple[torch.Tensor, ...], Descriptor, bool]:
    """Normalises receive buffers: tensors (written in place) or :class:`TensorSpec` (allocated
    here, on the caller's current stream). Returns ``(tensors, descriptor, single)``."""
    single = isinstance(buffers, (torch.Tensor, TensorSpec))
    items = [buffers] if single else buffers
    if not isinstance(items, (list, tuple)):
        raise TypeError(
            f"{what} must be a tensor, a TensorSpec or a list of them, got {type(items).__name__}"
        )
    if not items:
        raise ValueError(f"{what} is an empty list: nothing to transfer")
    if type(items[0]) in _PLAIN_TYPES:  # buffers given, the usual case: one pass checks all
        plain = _inspect_plain(items, device, what)
        if plain is not None:
            return (*plain, single)
    if not any(isinstance(item, TensorSpec) for item in items):  # buffers given
        try:
            return (*_inspect(items, device, what), single)
        except TypeError:
            _check_buffer_types(items, what)  # a shape or a (shape, dtype) where a spec belongs
            raise
    _check_buffer_types(items, what)
    out = [
        item.empty(device) if isinstance(item, TensorSpec) else _check_tensor(item, i, device, what)
        for i, item in enumerate(items)
    ]
    _check_one_device(out, what)
    return _detached(out), describe(out), single


def _first_overlap(tensors: Sequence[torch.Tensor]) -> tuple[int, int] | None:
    """Positions of two of ``tensors`` whose bytes share memory, or ``None`` when none do."""
    native = _native.helper()
    if native is not None:
        return native.first_overlap(tensors)
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.nbytes, i) for i, t in enumerate(tensors) if t.nbytes
    )
    furthest, owner = -1, None
    for start, end, i in spans:
        if owner is not None and start < furthest:
            return owner, i
        if end > furthest:
            furthest, owner = end, i
    return None


def check_receives_apart(
    parts: Sequence[tuple[Any, str, Sequence[torch.Tensor]]],
    *,
    names: Callable[[Any], str] = str,
) -> None:
    """Raises ``ValueError`` when a receive buffer shares memory with another tensor of the same
    call: another receive buffer, or a tensor the call sends (an exchange in place). The
    transports read and write a call's tensors at once, so what arrived would be garbled, and
    differently on NCCL, gloo and with packing. ``parts``: ``(what, kind, tensors)`` per message,
    ``kind`` being ``"send"`` or ``"recv"``; ``names(what)`` names the message in the error (a
    batch gives its entries' numbers, named only when one is wrong). Sends may share memory with
    each other.

    A call that only receives is checked in one compiled pass where the helper is loaded
    (reading each tensor's address and size from Python costs a fraction of a microsecond)."""
    kinds = {kind for _, kind, _ in parts}
    if "recv" not in kinds:
        return
    if "send" not in kinds:
        tensors = [t for _, _, part in parts for t in part] if len(parts) > 1 else parts[0][2]
        clash = _first_overlap(tensors) if len(tensors) > 1 else None
        if clash is not None:  # (who is who is worked out only for the error)
            owners = [(what, i) for what, _, part in parts for i in range(len(part))]
            _overlap_error(owners[clash[1]], owners[clash[0]], names)
        return
    spans = []
    for what, kind, tensors in parts:
        for i, t in enumerate(tensors):
            if t.nbytes:
                start = t.data_ptr()
                spans.append((start, start + t.nbytes, kind == "recv", (what, i)))
    spans.sort(key=lambda span: span[0])
    # Sorted by start: a span overlaps an earlier one exactly when it starts before the
    # furthest end so far of that kind, whose owner is then one it overlaps.
    recv_end = send_end = -1
    recv_owner = send_owner = None
    for start, end, is_recv, owner in spans:
        clash = (
            recv_owner if start < recv_end else send_owner if is_recv and start < send_end else None
        )
        if clash is not None:
            _overlap_error(owner, clash, names)
        if is_recv and end > recv_end:
            recv_end, recv_owner = end, owner
        elif not is_recv and end > send_end:
            send_end, send_owner = end, owner


def _overlap_error(owner: tuple[Any, int], clash: tuple[Any, int], names: Callable) -> None:
    raise ValueError(
        f"{names(owner[0])}[{owner[1]}] shares memory with {names(clash[0])}[{clash[1]}]: "
        "a transfer cannot receive into memory it also sends from or receives into "
        "elsewhere; receive into a separate tensor"
    )


def _check_buffer_types(items: Sequence[Any], what: str) -> None:
    for i, item in enumerate(items):
        if not isinstance(item, (torch.Tensor, TensorSpec)):
            raise TypeError(
                f"{what}[{i}] must be a torch.Tensor or a tf.TensorSpec(shape, dtype), got "
                f"{type(item).__name__}"
            )


def compare(
    sender: Descriptor,
    receiver: Descriptor,
    *,
    src: int,
    dst: int,
    names: tuple[str, str] = ("sender", "receiver"),
) -> None:
    """Raises :class:`MismatchError` naming the first field where sender and receiver differ.

    Both sides call this on the same pair of descriptors, so both raise the same error.
    ``names`` say what the two descriptors are, when they are not the two sides' messages (a
    static channel's agreed layout against a new message, say).
    """
    if sender == receiver:  # the common case, compared in C: no per-tensor loop
        return
    where = f"rank {src} -> rank {dst}"
    first, second = names
    if len(sender) != len(receiver):
        counts = (
            f"sender sends {len(sender)} tensor(s), receiver expects {len(receiver)}"
            if names == ("sender", "receiver")
            else f"{first} has {len(sender)} tensor(s), {second} {len(receiver)}"
        )
        raise MismatchError(f"{where}: {counts}", field="count")
    for i, ((s_dtype, s_shape), (r_dtype, r_shape)) in enumerate(
        zip(sender, receiver, strict=False)
    ):
        if s_dtype != r_dtype:
            raise MismatchError(
                f"{where}: tensor {i} dtype differs: {first} {s_dtype}, {second} {r_dtype}",
                field="dtype",
            )
        if s_shape != r_shape:
            raise MismatchError(
                f"{where}: tensor {i} shape differs: {first} {list(s_shape)}, {second} "
                f"{list(r_shape)}",
                field="shape",
            )
