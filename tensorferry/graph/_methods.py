"""Actor methods as an actor process calls them.

An ``async def`` method runs to completion on an event loop of the calling thread, made once and
kept, so an actor class may mix plain and async methods and its callers see plain results
either way. Plain methods are returned as they are: nothing is added to their calls.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["actor_method", "check_method_name", "signature_mismatch"]

_loops = threading.local()


def actor_method(instance: Any, name: str) -> Callable[..., Any]:
    """``instance.name`` as a plain callable (see the module doc)."""
    method = getattr(instance, name)
    if not inspect.iscoroutinefunction(method):
        return method

    @functools.wraps(method)
    def run_to_completion(*args: Any, **kwargs: Any) -> Any:
        return _loop().run_until_complete(method(*args, **kwargs))

    return run_to_completion


def _loop() -> asyncio.AbstractEventLoop:
    loop = getattr(_loops, "loop", None)
    if loop is None or loop.is_closed():
        loop = _loops.loop = asyncio.new_event_loop()
    return loop


def check_method_name(actor_class: type, name: str) -> None:
    """Raises ``AttributeError`` unless an actor handle exposes ``name`` as a method of
    ``actor_class``. Names starting with ``_`` never are: Python and libraries probe handles
    for such attributes (``__deepcopy__``, ``_repr_html_``) and must be told no at once; a
    private method the class does define is named as such."""
    if name.startswith("_"):
        if not name.startswith("__") and callable(getattr(actor_class, name, None)):
            raise AttributeError(
                f"{actor_class.__name__}.{name} is private (its name starts with '_'): actor "
                "handles expose public methods only"
            )
        raise AttributeError(name)
    if not callable(getattr(actor_class, name, None)):
        raise AttributeError(f"{actor_class.__name__} has no method {name!r}")


def signature_mismatch(actor_class: type, name: str, args: tuple, kwargs: dict) -> str | None:
    """Why ``name`` of ``actor_class`` cannot take ``args`` and ``kwargs``: "arguments do not fit
    its signature", the signature (without ``self``) and what does not fit it, for errors of
    compile, call and spawn alike. ``None`` when they fit, or when there is no signature to
    check (some builtins). ``name="__init__"`` checks the constructor."""
    signature = _signature(actor_class, name)
    if signature is None:
        return None
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        return f"arguments do not fit its signature {signature}: {exc}"
    return None


@functools.lru_cache(maxsize=1024)
def _signature(actor_class: type, name: str) -> inspect.Signature | None:
    try:
        if name == "__init__":
            return inspect.signature(actor_class)
        method = inspect.getattr_static(actor_class, name)
        signature = inspect.signature(getattr(actor_class, name))
    except (AttributeError, TypeError, ValueError):  # no such method, or no signature to read
        return None
    if isinstance(method, (staticmethod, classmethod)):  # no self (a classmethod is bound)
        return signature
    params = list(signature.parameters.values())
    return signature.replace(parameters=params[1:])
