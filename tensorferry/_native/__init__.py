"""Compiled helpers, built on first use against the running torch; Python does without them.

A message's validation reads about seven attributes of each of its tensors, and from Python
each read costs a tenth of a microsecond or more: a call with 64 small tensors spent most of its
host time there. ``tensor_walk.cpp`` does those reads in one C++ loop, and launches the copies
in and out of a message's packed buffer (``p2p/_piece_copy.py``).

It needs a C++ compiler and the headers of Python and torch, so it is built here rather than
shipped: once per (source, torch, Python) in ``$TENSORFERRY_NATIVE_DIR`` (default
``~/.cache/tensorferry/native``), by a process of its own (``_build.py``) that a background
thread starts and waits for (:func:`start`, which ``tf.init`` calls), under a file lock so that
the ranks of one host build it once; a program that exits first leaves it finishing. Until it
is loaded, and wherever it cannot be built, callers take the Python path: :func:`helper`
returns ``None``. The two paths give the same results (the CPU tier checks them against each
other).

``TENSORFERRY_NATIVE``: ``auto`` (default: load it, building it in the background if need
be), ``wait`` (build it before :func:`start` returns: benchmarks, so that every timed call
takes one path) or ``0`` (never).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from tensorferry import envs
from tensorferry._native._build import BUILD_TIMEOUT_S

__all__ = ["helper", "start", "wait", "status", "when_loaded"]

_log = logging.getLogger("tensorferry")
_SOURCE = Path(__file__).with_name("tensor_walk.cpp")
_BUILDER = Path(__file__).with_name("_build.py")
_MODULE = "_tensorferry_native"

_loaded: ModuleType | None = None  # read on every call: a plain module global, no lock
_lock = threading.Lock()
_on_load: list[Callable[[ModuleType], None]] = []  # when_loaded's callbacks still to call
_thread: threading.Thread | None = None
_problem: str | None = None  # why it is not loaded, once that is known


def helper() -> ModuleType | None:
    """The compiled module, or ``None`` while it is not (yet) loaded."""
    return _loaded


def when_loaded(callback: Callable[[ModuleType], None]) -> None:
    """Calls ``callback(module)`` once the helper is loaded: now, on this thread, if it is;
    else on the loading thread right after it loads (never, if it does not). For callers that
    swap a slower way for the helper's once it is there, rather than ask on every call."""
    with _lock:
        module = _loaded
        if module is None:
            _on_load.append(callback)
            return
    _call_back(callback, module)


def _call_back(callback: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        callback(module)
    except Exception:  # the caller keeps its slower way
        _log.exception("tensorferry: a compiled helpers' load callback failed")


def start() -> None:
    """Loads the helper, building it on a background thread if need be (see the module doc).
    Returns at once, but with ``TENSORFERRY_NATIVE=wait``, which waits for the build."""
    global _thread
    mode = envs.native_mode()
    if mode == "0" or _loaded is not None:
        return
    with _lock:
        if _thread is None and _problem is None:
            _thread = threading.Thread(
                target=_load_or_build, name="tensorferry-native-build", daemon=True
            )
            _thread.start()
    if mode == "wait":
        wait()


def wait(timeout: float | None = None) -> ModuleType | None:
    """Waits for a build that :func:`start` began; returns :func:`helper`'s answer."""
    thread = _thread
    if thread is not None:
        thread.join(timeout)
    return _loaded


def status() -> str:
    """One line for ``tensorferry doctor``: loaded, building, or why not."""
    if envs.native_mode() == "0":
        return "off (TENSORFERRY_NATIVE=0)"
    if _loaded is not None:
        return f"loaded from {_loaded.__file__}"
    if _problem is not None:
        return f"not available: {_problem}"
    if _thread is not None and _thread.is_alive():
        return "being built"
    return "not started"


def _load_or_build() -> None:
    global _loaded, _problem
    try:
        path = _built_path()
        if not path.exists():
            _build(path)
        module = _import(path)
        with _lock:  # with the callbacks taken: when_loaded calls later ones itself
            _loaded = module
            callbacks = _on_load[:]
            _on_load.clear()
        _log.debug("tensorferry: compiled helpers loaded from %s", path)
        for callback in callbacks:
            _call_back(callback, module)
    except Exception as error:  # any failure leaves the Python path, which is always right
        _problem = str(error) or type(error).__name__
        _log.info("tensorferry: compiled helpers not used: %s", _problem)


# How it is compiled and linked (besides the compiler, the paths and the ABI flag): part of
# the build's key, so that a change here builds afresh.
_FLAGS = ("-O2", "-shared", "-fPIC", "-std=c++17", "-w")  # -w: torch's headers warn under C++17
_LIBRARIES = ("-ltorch_python", "-ltorch", "-ltorch_cpu", "-lc10")


def _built_path() -> Path:
    key = hashlib.sha256()
    key.update(_SOURCE.read_bytes())
    parts = (torch.__version__, sys.version, sysconfig.get_platform(), _abi_flag(), *_FLAGS)
    for part in (*parts, *_LIBRARIES):
        key.update(part.encode())
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return _cache_dir() / f"{_MODULE}-{key.hexdigest()[:16]}{suffix}"


def _cache_dir() -> Path:
    configured = os.environ.get("TENSORFERRY_NATIVE_DIR")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tensorferry" / "native"


def _abi_flag() -> str:
    return f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"


def _build(path: Path) -> None:
    """Builds ``path`` in a process of its own (``_build.py``, in a session of its own: a
    program that exits before the compiler does leaves it finishing, for the next process),
    and waits for it. Raises with the compiler's last line when it failed."""
    failed = path.with_suffix(".failed")
    if failed.exists():  # this host tried and failed: do not pay for it in every process
        raise RuntimeError(f"an earlier build failed; see {failed} (delete it to retry)")
    command = _compile_command(path.with_suffix(f".tmp{os.getpid()}"))
    path.parent.mkdir(parents=True, exist_ok=True)
    builder = subprocess.Popen(
        [sys.executable, str(_BUILDER), str(path), json.dumps(command)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    builder.wait(timeout=BUILD_TIMEOUT_S + 60)
    if path.exists():
        return
    if failed.exists():
        lines = failed.read_text(errors="replace").strip().splitlines()
        last = lines[-1] if len(lines) > 2 else "no output"
        raise RuntimeError(f"the build failed: {last}; see {failed}")
    raise RuntimeError(f"the build ended without {path.name} (exit code {builder.returncode})")


def _compile_command(output: Path) -> list[str]:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    python_include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(python_include, "Python.h")):
        raise RuntimeError(f"no Python headers in {python_include}")
    torch_dir = Path(torch.__file__).parent
    lib = torch_dir / "lib"
    return [
        compiler,
        *_FLAGS,
        _abi_flag(),
        f"-I{python_include}",
        f"-I{torch_dir / 'include'}",
        str(_SOURCE),
        "-o",
        str(output),
        f"-L{lib}",
        f"-Wl,-rpath,{lib}",
        *_LIBRARIES,
    ]


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(_MODULE, path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _forget_in_child() -> None:
    """A forked child has no build thread: it may start its own."""
    global _thread, _lock
    _lock = threading.Lock()
    if _loaded is None:
        _thread = None


os.register_at_fork(after_in_child=_forget_in_child)
