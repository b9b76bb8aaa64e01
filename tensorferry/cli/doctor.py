"""``tensorferry doctor``: what this machine offers tensorferry, and why a transport is unusable.

Prints versions, devices, peer access and link type between each device pair, and for every
transport whether it can be used here — with the reason when it cannot.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import re
import shutil
import subprocess
import sys

from tensorferry.cli._args import positive_float

__all__ = [
    "add_arguments",
    "run",
    "transport_report",
    "executor_report",
    "link_matrix",
    "node_layout",
    "native_report",
    "native_build_coming",
]

_MULTICAST_ENV = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument(
        "--layout-timeout",
        type=positive_float,
        default=60.0,
        help="under torchrun: seconds to wait for every rank when gathering the node layout",
    )


def node_layout(timeout_s: float) -> dict | None:
    """Under torchrun: every rank's host, node rank and local rank, gathered over gloo.

    Returns ``None`` outside torchrun. Every rank must run ``tensorferry doctor``.
    """
    if not all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        return None
    import datetime

    import torch.distributed as dist

    me = {
        "host": platform.node(),
        "rank": int(os.environ["RANK"]),
        "node_rank": int(os.environ.get("GROUP_RANK", "0")),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
    }
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, me)
    finally:
        if owned:
            dist.destroy_process_group()
    nodes: dict[int, dict] = {}
    for entry in sorted(everyone, key=lambda e: e["rank"]):
        node = nodes.setdefault(entry["node_rank"], {"host": entry["host"], "ranks": []})
        node["ranks"].append(entry["rank"])
    return {"world_size": len(everyone), "nodes": nodes, "me": me}


def _version(module: str) -> str | None:
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception:
        return None


def link_matrix(count: int) -> dict[tuple[int, int], str]:
    """Link type per device pair from ``nvidia-smi topo -m`` (e.g. ``NV18``, ``PIX``, ``SYS``)."""
    if count < 2 or shutil.which("nvidia-smi") is None:
        return {}
    try:
        text = subprocess.run(
            ["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=10, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    links = {}
    for line in text.splitlines():
        cells = re.sub(r"\x1b\[[0-9;]*m", "", line).split()
        if not cells or not re.fullmatch(r"GPU\d+", cells[0]):
            continue
        row = int(cells[0][3:])
        for col, cell in enumerate(cells[1 : count + 1]):
            if col != row:
                links[(row, col)] = cell
    return links


# Where each transport name is accepted: tf.send's ``transport=`` (p2p), a graph edge's
# ``with_transport`` (graph), or both.
TRANSPORT_USES = {
    "gloo": "p2p (CPU tensors)",
    "ce": "p2p, graph",
    "nccl": "p2p, graph",
    "nvlink": "p2p, graph",
    "shm": "graph (local executor)",
    "tcp": "graph (Ray executor)",
}


def transport_report() -> dict[str, str | None]:
    """Per transport name (see :data:`TRANSPORT_USES`): ``None`` when usable here, else why
    not."""
    import torch
    import torch.distributed as dist

    from tensorferry.runtime._devices import cuda_device_count

    cuda = cuda_device_count()
    report: dict[str, str | None] = {}
    if not dist.is_available():
        reason = "this torch build has no torch.distributed"
        return dict.fromkeys(("gloo", "nccl", "nvlink", "ce"), reason) | _host_channels()
    report["gloo"] = None if dist.is_gloo_available() else "torch built without gloo"
    if cuda == 0:
        report["nccl"] = "no CUDA device"
    elif not dist.is_nccl_available():
        report["nccl"] = "torch built without NCCL"
    else:
        report["nccl"] = None
    peer = cuda >= 2 and all(
        torch.cuda.can_device_access_peer(i, j) for i in range(cuda) for j in range(cuda) if i != j
    )
    peer_reason = (
        "needs 2 CUDA devices" if cuda < 2 else None if peer else "no peer access between devices"
    )
    try:
        import torch.distributed._symmetric_memory

        symm_reason = None
    except Exception as exc:
        symm_reason = f"symmetric memory unavailable ({exc})"
    report["ce"] = None if cuda else "needs a CUDA device"
    if _version("triton") is None:
        triton_reason = "Triton is not installed (pip install 'tensorferry[triton]')"
    else:
        triton_reason = None
    report["nvlink"] = peer_reason or symm_reason or triton_reason
    return report | _host_channels()


def _host_channels() -> dict[str, str | None]:
    """The graph's host channels, which need no torch.distributed: shm (local executor), tcp
    (Ray executor, usable where Ray is)."""
    return {"shm": None, "tcp": executor_report()["ray"]}


def executor_report() -> dict[str, str | None]:
    """Per graph executor: ``None`` when usable here, else why not."""
    ray = None if _version("ray") else "Ray is not installed (pip install 'tensorferry[ray]')"
    return {"local": None, "ray": ray}


def side_channel_report() -> str:
    """How this process's p2p ranks carry their control frames to each other (``p2p._link``)."""
    from tensorferry.p2p import _link

    listener = _link.open_local_listener()
    if listener is None:
        return "tcp to every rank (no abstract Unix sockets here)"
    listener.close()
    return "unix socket to ranks of this host, tcp to other hosts"


def native_build_coming() -> bool:
    """Whether loading the compiled helper (``tensorferry/_native``) compiles it first, which
    takes seconds: not loaded in this process, not built on this host, no earlier build failed,
    and ``TENSORFERRY_NATIVE`` is not ``0``."""
    from tensorferry import _native, envs
    from tensorferry._native._build import build_needed

    try:
        if envs.native_mode() == "0" or _native.helper() is not None:
            return False
        return build_needed(_native._built_path())
    except Exception:  # an unknown setting or an unreadable source: native_report says why
        return False


def native_report(timeout_s: float = 300.0) -> str:
    """Whether the compiled validation loop is used here (``tensorferry/_native``): loads it,
    building it first if need be (once per torch and Python version)."""
    from tensorferry import _native

    try:
        _native.start()
    except ValueError as error:  # TENSORFERRY_NATIVE set to something unknown
        return str(error)
    _native.wait(timeout_s)
    return _native.status()


def piece_copy_report(devices: int) -> str:
    """How each device copies a packed message in and out of its buffer (``p2p/_piece_copy``):
    one kernel of tensorferry's own, compiled ahead as ``tf.init`` does, or torch's copy."""
    if not devices:
        return "no CUDA device"
    from tensorferry.p2p import _piece_copy

    reports = [_piece_copy.status(i) for i in range(devices)]
    if len(set(reports)) == 1:
        return f"every device: {reports[0]}"
    return "; ".join(f"cuda:{i}: {report}" for i, report in enumerate(reports))


def nccl_calls_report(devices: int) -> str:
    """How the ``nccl`` transport calls NCCL here: the library itself (our own communicators),
    or ``ProcessGroupNCCL``, which costs each call far more host time, and why."""
    if not devices:
        return "no CUDA device"
    from tensorferry.p2p._nccl_lib import library

    lib = library()
    if lib is None:
        return "through ProcessGroupNCCL: no NCCL library could be loaded to call directly"
    version = lib.version()
    dotted = f"{version // 10000}.{version % 10000 // 100}.{version % 100}"
    return f"the library directly: NCCL {dotted} from {lib.path}"


def event_calls_report() -> str:
    """Which CUDA event calls every transfer makes (``runtime/_events``): the runtime's, holding
    the GIL, or torch's, which let go of it (tens of microseconds more per call on a busy
    process), and why."""
    from tensorferry.runtime import _events

    return _events.calls_report()


def _collect() -> dict:
    import torch

    from tensorferry.runtime._devices import cuda_device_count

    cuda = cuda_device_count()
    info: dict = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "ray": _version("ray"),
        "tensorferry": _version("tensorferry"),
        "cpu_cores": os.cpu_count(),
    }
    try:
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if cuda else None
    except Exception:
        info["nccl"] = None
    info["devices"] = [
        {
            "index": i,
            "name": torch.cuda.get_device_name(i),
            "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1),
            "sms": torch.cuda.get_device_properties(i).multi_processor_count,
        }
        for i in range(cuda)
    ]
    links = link_matrix(cuda)
    info["pairs"] = [
        {
            "pair": [i, j],
            "peer_access": torch.cuda.can_device_access_peer(i, j),
            "link": links.get((i, j), "unknown"),
        }
        for i in range(cuda)
        for j in range(cuda)
        if i < j
    ]
    info["transports"] = transport_report()
    info["executors"] = executor_report()
    info["side_channel"] = side_channel_report()
    if native_build_coming():
        # Otherwise the doctor says nothing for the compiler's seconds (stderr: --json keeps
        # stdout to the JSON object).
        print("building the compiled helper (once, ~12 s)…", file=sys.stderr, flush=True)
    info["native"] = native_report()
    info["piece_copy"] = piece_copy_report(cuda)
    info["event_calls"] = event_calls_report()
    info["nccl_calls"] = nccl_calls_report(cuda)
    info["env"] = {name: os.environ.get(name) for name in _MULTICAST_ENV}
    return info


def run(args: argparse.Namespace) -> int:
    info = _collect()
    info["layout"] = node_layout(args.layout_timeout)
    if args.json:
        import json

        print(json.dumps(info, indent=2, default=str))
        return 0
    print("tensorferry doctor")
    for key in ("tensorferry", "python", "torch", "cuda", "nccl", "triton", "ray", "cpu_cores"):
        print(f"  {key:<12} {info[key] if info[key] is not None else '-'}")
    if info["devices"]:
        print("devices")
        for d in info["devices"]:
            print(f"  cuda:{d['index']}  {d['name']}  {d['memory_gib']} GiB  {d['sms']} SMs")
    else:
        print("devices\n  no CUDA device: CPU transfers go over gloo")
    if info["pairs"]:
        print("device pairs")
        for p in info["pairs"]:
            i, j = p["pair"]
            access = "peer access" if p["peer_access"] else "NO peer access"
            print(f"  cuda:{i} <-> cuda:{j}  {p['link']:<8} {access}")
    print("transports (p2p: tf.send's transport=; graph: an edge's with_transport)")
    for name, reason in info["transports"].items():
        usable = "usable" if reason is None else "unusable: " + reason
        print(f"  {name:<7} {TRANSPORT_USES[name]:<23} {usable}")
    print("graph executors")
    for name, reason in info["executors"].items():
        print(f"  {name:<7} {'usable' if reason is None else 'unusable: ' + reason}")
    print(f"p2p control links (message frames, fault notices)\n  {info['side_channel']}")
    print(f"compiled validation (TENSORFERRY_NATIVE)\n  {info['native']}")
    print(f"packed messages' copies (CUDA)\n  {info['piece_copy']}")
    print(f"CUDA event calls of each transfer\n  {info['event_calls']}")
    print(f"NCCL calls\n  {info['nccl_calls']}")
    layout = info["layout"]
    if layout is not None:
        print(f"torchrun layout: {layout['world_size']} ranks on {len(layout['nodes'])} node(s)")
        for node_rank, node in sorted(layout["nodes"].items()):
            print(f"  node {node_rank}  {node['host']}  ranks {node['ranks']}")
    unset = [k for k, v in info["env"].items() if v is None]
    if info["devices"] and unset:
        print(
            "note: NVLink multicast is never used by tensorferry; unset here: " + ", ".join(unset)
        )
    return 0
