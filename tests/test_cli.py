"""The command line: doctor, bench lifecycle, and doctor's node layout under a 2-node torchrun."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tensorferry.cli.main import main


def test_doctor_reports_transports_and_where_each_name_goes(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert "p2p" in lines["gloo"] and "graph" not in lines["gloo"]
    assert lines["gloo"].endswith(" usable")
    assert "graph (local executor)" in lines["shm"] and "graph (Ray executor)" in lines["tcp"]
    assert "graph executors" in out


def test_doctor_says_how_packed_messages_are_copied(capsys, monkeypatch):
    import tensorferry.cli.doctor as doctor

    assert doctor.piece_copy_report(0) == "no CUDA device"
    monkeypatch.setattr(doctor, "piece_copy_report", lambda devices: f"{devices} device(s) here")
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert f"packed messages' copies (CUDA)\n  {count} device(s) here\n" in out


def test_doctor_names_the_devices_whose_packed_copies_differ(monkeypatch):
    from tensorferry.cli.doctor import piece_copy_report
    from tensorferry.p2p import _piece_copy

    asked = []

    def status(index):
        asked.append(index)
        return "torch's _foreach_copy_: no NVRTC" if index == 1 else "one launch"

    monkeypatch.setattr(_piece_copy, "status", status)
    assert piece_copy_report(1) == "every device: one launch"
    assert piece_copy_report(2) == "cuda:0: one launch; cuda:1: torch's _foreach_copy_: no NVRTC"
    assert asked == [0, 0, 1], "each device asked once"


@pytest.mark.gpu
def test_doctor_finds_the_packed_copy_kernel_compiled_on_every_device():
    from tensorferry.cli.doctor import piece_copy_report

    report = piece_copy_report(torch.cuda.device_count())
    assert report == (
        "every device: one launch of tensorferry's kernel per message (compiled ahead at tf.init)"
    ), report


def test_doctor_says_how_nccl_is_called(capsys, monkeypatch):
    import tensorferry.cli.doctor as doctor
    from tensorferry.p2p import _nccl_lib

    class Library:
        path = "/opt/nccl/libnccl.so.2"

        def version(self):
            return 22809

    assert doctor.nccl_calls_report(0) == "no CUDA device"
    monkeypatch.setattr(_nccl_lib, "library", lambda: Library())
    direct = "the library directly: NCCL 2.28.9 from /opt/nccl/libnccl.so.2"
    assert doctor.nccl_calls_report(2) == direct
    monkeypatch.setattr(_nccl_lib, "library", lambda: None)
    assert doctor.nccl_calls_report(1) == (
        "through ProcessGroupNCCL: no NCCL library could be loaded to call directly"
    )
    monkeypatch.setattr(doctor, "nccl_calls_report", lambda devices: f"{devices} device(s)")
    assert main(["doctor"]) == 0
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert f"NCCL calls\n  {count} device(s)\n" in capsys.readouterr().out


def test_doctor_says_which_cuda_event_calls_transfers_make(capsys, monkeypatch):
    from tensorferry.runtime import _events

    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    expected = _events.calls_report()
    if torch.cuda.is_available():  # the GPU machine: the runtime's calls pass their check
        assert expected == "the CUDA runtime's, called holding the GIL"
    else:
        assert expected == "no CUDA device"
    assert f"CUDA event calls of each transfer\n  {expected}\n" in out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_events, "_runtime", lambda: None)
    monkeypatch.setattr(_events, "_why_torch", "cudaEventRecord failed")
    assert _events.calls_report() == (
        "torch's, which let go of the GIL around each (cudaEventRecord failed)"
    )


def test_doctor_says_how_ranks_carry_their_frames(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    if sys.platform.startswith("linux"):
        expected = "unix socket to ranks of this host, tcp to other hosts"
    else:
        expected = "tcp to every rank (no abstract Unix sockets here)"
    assert f"p2p control links (message frames, fault notices)\n  {expected}\n" in out


def test_doctor_says_it_builds_the_compiled_helper_only_when_it_does(capsys, monkeypatch):
    import tensorferry.cli.doctor as doctor

    monkeypatch.setattr(doctor, "native_report", lambda: "loaded")
    for coming in (True, False):
        monkeypatch.setattr(doctor, "native_build_coming", lambda coming=coming: coming)
        assert main(["doctor"]) == 0
        captured = capsys.readouterr()
        note = "building the compiled helper (once, ~12 s)…"
        assert (note in captured.err) == coming, captured.err
        assert note not in captured.out  # stderr: --json keeps stdout to the JSON object


def test_a_build_is_coming_when_the_helper_is_neither_loaded_built_nor_failed(
    tmp_path, monkeypatch
):
    from tensorferry import _native
    from tensorferry.cli.doctor import native_build_coming

    built = tmp_path / "helper.so"
    monkeypatch.setattr(_native, "_built_path", lambda: built)
    monkeypatch.setattr(_native, "_loaded", None)
    monkeypatch.delenv("TENSORFERRY_NATIVE", raising=False)
    assert native_build_coming()
    monkeypatch.setenv("TENSORFERRY_NATIVE", "0")
    assert not native_build_coming()
    monkeypatch.delenv("TENSORFERRY_NATIVE")
    built.with_suffix(".failed").write_text("an earlier build failed")
    assert not native_build_coming()
    built.with_suffix(".failed").unlink()
    built.write_bytes(b"")
    assert not native_build_coming()
    built.unlink()
    monkeypatch.setattr(_native, "_loaded", sys)  # loaded in this process already
    assert not native_build_coming()


def test_doctor_json_explains_unusable_transports(capsys):
    assert main(["doctor", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["transports"]["gloo"] is None
    unusable = {k: v for k, v in info["transports"].items() if v is not None}
    assert all(isinstance(reason, str) and reason for reason in unusable.values())
    if not info["devices"]:
        assert info["transports"]["nccl"] == "no CUDA device"
    # The names a transport= or with_transport accepts, and no executor among them.
    assert set(info["transports"]) == {"gloo", "ce", "nccl", "nvlink", "shm", "tcp"}
    assert info["executors"]["local"] is None and "ray" in info["executors"]


def test_bench_lifecycle_writes_results(tmp_path, capsys):
    assert main(["bench", "lifecycle", "--cycles", "20", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "unpooled" in out
    (csv_path,) = tmp_path.glob("lifecycle_*.csv")
    csv_text = csv_path.read_text()
    assert csv_text.splitlines()[0].startswith("mode,cycles,create_us")
    assert len(csv_text.splitlines()) == 4
    md = csv_path.with_suffix(".md").read_text()
    assert "command:" in md and "| mode |" in md


def test_unknown_command_is_a_usage_error():
    with pytest.raises(SystemExit) as exc:
        main(["teleport"])
    assert exc.value.code == 2


def test_doctor_gathers_node_layout_under_two_node_torchrun():
    from tensorferry.p2p._launch import reserved_port

    with reserved_port() as port:  # until both nodes are done: held from other worlds' stores
        nodes = [
            subprocess.Popen(
                [
                    sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                    "--nproc-per-node=1", f"--node-rank={rank}", "--master-addr=127.0.0.1",
                    f"--master-port={port}", "-m", "tensorferry.cli.main", "doctor",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank in (0, 1)
        ]  # fmt: skip
        outputs = []
        for node in nodes:
            try:
                outputs.append(node.communicate(timeout=120)[0])
            except subprocess.TimeoutExpired:
                for n in nodes:
                    n.kill()
                pytest.fail("torchrun doctor hung")
            assert node.returncode == 0, outputs[-1][-2000:]
    for out in outputs:
        assert "torchrun layout: 2 ranks on 2 node(s)" in out
        assert "node 0" in out and "node 1" in out


def test_sendrecv_report_has_provenance_and_whole_caveats(tmp_path):
    import argparse

    from tensorferry.bench import sendrecv

    rows = [
        {"mode": m, "nbytes": n, "transport": t, "chosen": t, "us": 12.5, "gbps": 80.0}
        for m in ("one_way", "both")
        for n in (1 << 20, 1 << 26)
        for t in ("nccl", "nvlink")
    ]
    sendrecv._write_reports(rows, argparse.Namespace(out=str(tmp_path)))
    md = (tmp_path / "sendrecv.md").read_text()
    assert "- torch:" in md and "- command:" in md
    assert "| 64 MiB | 12.5 µs / 80 | 12.5 µs / 80 |" in md
    # Each caveat keeps its continuation lines (a bullet ends with a full stop).
    caveats = md.split("## Fairness caveats")[1].strip().splitlines()
    assert len(caveats) == 4 and all(c.startswith("- ") and c.endswith(".") for c in caveats)
    assert len((tmp_path / "sendrecv.csv").read_text().splitlines()) == len(rows) + 1


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["bench", "graph", "--iters", "-5"], "--iters: must be a positive integer, got '-5'"),
        (["bench", "batch", "--large-mib", "-1"], "--large-mib: must be an integer >= 0"),
        (["bench", "toy", "--steps", "0"], "--steps: must be a positive integer, got '0'"),
        (["bench", "sendrecv", "--max-seconds-per-point", "nan"], "must be a positive number"),
        (["demo", "--iterations", "two"], "--iterations: must be a positive integer, got 'two'"),
    ],
)
def test_bad_numbers_are_usage_errors_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_a_run_that_fails_its_checks_leaves_no_out_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "new" / "deeper"
    with pytest.raises(SystemExit):  # the out folder can be made, the sizes are bad
        main(["bench", "sendrecv", "--sizes", "1X", "--out", str(out)])
    with pytest.raises(SystemExit):  # the same with the default folder, in the working one
        main(["bench", "sendrecv", "--sizes", "1X"])
    assert list(tmp_path.iterdir()) == []


def test_an_out_folder_that_cannot_be_made_is_a_usage_error(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for argv, command in (
        (["demo", "--out", str(blocker / "pictures")], "tensorferry demo"),
        (["bench", "batch", "--out", str(blocker)], "tensorferry bench batch"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "cannot make that folder" in err
        # The usage and the error are the command's own, not the top level's list of commands.
        assert f"usage: {command} " in err and f"{command}: error:" in err, err


@pytest.mark.parametrize(
    "argv, text",
    [
        (["bench", "sendrecv", "--sizes", "1X"], "size '1X' is not a byte count"),
        (["bench", "sendrecv", "--transports", "pigeon"], "--transports 'pigeon': choose from"),
        (["bench", "sendrecv", "--modes", "sideways"], "--modes 'sideways': choose from"),
        (
            ["bench", "sendrecv", "--tune", "--modes", "one_way"],
            "--tune needs --modes one_way,both",
        ),
        (
            ["bench", "sendrecv", "--tune", "--transports", "auto"],
            "at least one of nvlink, ce, nccl",
        ),
        (["bench", "sendrecv", "--table", "/no/such/table.json"], "--table '/no/such/table.json'"),
        (["bench", "allgather", "--transports", "pigeon", "--world", "2"], "unknown ['pigeon']"),
        (["bench", "lifecycle", "--devices", "9"], "--devices '9'"),
        (["bench", "toy", "--modes", ""], "--modes must be cached, uncached or both"),
        (["bench", "toy", "--programs", ","], "--programs: choose one or more of"),
    ],
)
def test_bad_lists_are_one_line_before_anything_starts(argv, text):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert text in str(exc.value.code)


@pytest.mark.parametrize(
    "argv, env, text",
    [
        # Passed the parser, then a traceback from ClientConfig.
        (["bench", "lifecycle", "--streams-per-device", "3"], {}, "must be at least 6"),
        # Reached the store: a C++ traceback.
        (["doctor", "--layout-timeout", "-1"], {}, "must be a positive number, got '-1'"),
        (["doctor"], {"TENSORFERRY_LOG_LEVEL": "loud"}, "TENSORFERRY_LOG_LEVEL='loud' must be"),
    ],
)
def test_bad_values_are_usage_errors(argv, env, text, monkeypatch, capsys):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert text in capsys.readouterr().err


def test_the_log_level_variable_sets_the_library_logger_where_it_is_set(monkeypatch):
    import logging

    from tensorferry import envs

    logger = logging.getLogger("tensorferry")
    before = logger.level
    try:
        monkeypatch.setenv("TENSORFERRY_LOG_LEVEL", "debug")
        envs.apply_log_level()  # (tf.init, an actor's spawn)
        assert logger.level == logging.DEBUG
        monkeypatch.delenv("TENSORFERRY_LOG_LEVEL")
        logger.setLevel(logging.ERROR)
        envs.apply_log_level()  # unset: the program's own configuration stays
        assert logger.level == logging.ERROR
        monkeypatch.setenv("TENSORFERRY_LOG_LEVEL", "loud")
        with pytest.raises(ValueError, match="TENSORFERRY_LOG_LEVEL='loud' must be one of"):
            envs.apply_log_level()
    finally:
        logger.setLevel(before)


@pytest.mark.parametrize(
    "argv, text",
    [
        (["bench", "toy", "--device", "cuda"], "--device cuda needs 2 CUDA devices"),
        (["bench", "batch", "--device", "cuda"], "--device cuda needs 2 CUDA devices"),
        (["bench", "sendrecv"], "tensorferry bench sendrecv needs 2 CUDA devices"),
        (["bench", "allgather", "--transports", "gloo,nccl"], "nccl moves CUDA tensors"),
        (["bench", "overlap", "--transports", "auto,ce"], "--transports auto,ce needs 2 CUDA"),
    ],
)
def test_a_benchmark_that_needs_gpus_this_machine_lacks_says_so_before_anything_starts(
    argv, text, monkeypatch
):
    import torch

    import tensorferry.graph
    import tensorferry.p2p._launch

    def started(*args, **kwargs):
        raise AssertionError("a rank, actor or launcher was started")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(tensorferry.p2p._launch, "run_world", started)
    monkeypatch.setattr(tensorferry.graph, "actor", started)
    monkeypatch.setattr(subprocess, "call", started)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    message = str(exc.value.code)
    assert text in message
    assert "this machine has 0" in message or "0 CUDA devices here" in message
