"""``tensorferry demo``: its table, checks, pictures and claims; and the error a driver script
without a main guard gets when it starts an actor."""

from __future__ import annotations

import importlib.util
import io
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tensorferry.cli.main import main

_ROOT = Path(__file__).resolve().parents[1]
_ROW = re.compile(
    r"^\s*(?P<size>[\d.]+ (?:B|KiB|MiB|GiB))\s+(?P<tf>[\d.]+) µs\s+(?P<torch>[\d.]+) µs"
    r"\s+(?P<tf_rate>[\d.]+)\s+(?P<torch_rate>[\d.]+)\s+(?P<faster>(?:tensorferry|torch) [\d.]+×)"
    r"\s+checked ok$"
)
_HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _run(args: list[str], *, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT),
           os.environ.get("PYTHONPATH")]))}  # fmt: skip
    return subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def _demo(tmp_path: Path, *extra: str, timeout: float = 240) -> tuple[str, Path]:
    out = tmp_path / "pictures"
    done = _run(
        [sys.executable, "-m", "tensorferry.cli.main", "demo", "--out", str(out), *extra],
        cwd=tmp_path,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout, out


def _table(text: str) -> list[re.Match]:
    return [m for m in map(_ROW.match, text.splitlines()) if m is not None]


def test_the_cpu_demo_times_both_libraries_checks_every_byte_and_claims_no_overlap(tmp_path):
    text, out = _demo(tmp_path, "--device", "cpu")
    rows = _table(text)
    assert [row["size"] for row in rows] == ["4 KiB", "64 KiB", "1 MiB", "4 MiB"], text
    for row in rows:
        assert float(row["tf"]) > 0 and float(row["torch"]) > 0, row.group(0)
        assert float(row["tf_rate"]) > 0 and float(row["torch_rate"]) > 0, row.group(0)
    checked = re.search(r"bytes checked: (\d+) MiB moved by tensorferry and (\d+) MiB by torch",
                        text)  # fmt: skip
    assert checked and int(checked[1]) > 0 and checked[1] == checked[2], text
    assert "gloo over loopback" in text and "2 GPUs" in text  # what CPU numbers mean
    assert (out / "p2p.png").exists() == _HAS_MATPLOTLIB
    graph = text.split("== compiled actor graph")[1]
    assert graph.count("results checked") == 2, graph
    assert re.search(r"receiver 0% of communication overlapped compute", graph), graph
    assert "no speed-up from overlap is claimed" in graph
    for line in graph.splitlines():
        claim = re.search(r"faster|slower|speed-up from overlap:|ms per execution", line)
        assert claim is None or "no speed-up" in line, line
    if _HAS_MATPLOTLIB:
        for mode in ("off", "on"):
            assert (out / f"schedule_overlap_{mode}.dot").exists()
            assert (out / f"timeline_overlap_{mode}.png").exists()


@pytest.mark.multigpu
def test_the_gpu_demo_times_overlap_and_prints_the_timelines_share(tmp_path):
    text, out = _demo(tmp_path, timeout=300)
    rows = _table(text)
    assert len(rows) == 6 and all(float(r["tf"]) > 0 and float(r["torch"]) > 0 for r in rows)
    graph = text.split("== compiled actor graph")[1]
    for mode in ("off", "on"):
        line = re.search(rf"overlap {mode} *: +([\d.]+) ms per execution; timeline: (.*)", graph)
        assert line and float(line[1]) > 0 and "receiver" in line[2], graph
    assert re.search(r"overlap on is [\d.]+× (faster|slower) than off", graph), graph
    assert (out / "p2p.png").exists() == _HAS_MATPLOTLIB


def test_the_printed_overlap_share_follows_the_timeline_pictures_rule():
    from tensorferry.demo.graph import overlap_shares

    def span(actor, execution, kind, lane, start, end):
        return (actor, execution, 0, kind, kind, lane, start, end)

    records = [
        # execution 0: dropped (only the last 2 count), though it overlapped in full
        span("gpu", 0, "COMPUTE", "compute", 0.0, 1.0),
        span("gpu", 0, "READ", "recv", 0.0, 1.0),
        # executions 1 and 2: 1 s of 4 s of communication ran beside compute
        span("gpu", 1, "COMPUTE", "compute", 10.0, 11.0),
        span("gpu", 1, "READ", "recv", 10.5, 12.5),
        span("gpu", 2, "WRITE", "send", 20.0, 22.0),
        span("gpu", 2, "COMPUTE", "host", 20.0, 22.0),  # the issuing thread: not device work
        # one thread does all: nothing overlaps
        span("cpu", 1, "READ", "recv", 0.0, 1.0),
        span("cpu", 1, "COMPUTE", "main", 1.0, 2.0),
        span("idle", 1, "COMPUTE", "main", 0.0, 1.0),  # no communication: no share
    ]
    shares = overlap_shares(records, last=2)
    assert shares == {"cpu": 0.0, "gpu": pytest.approx(0.5 / 4.0)}


def test_the_demo_help_describes_both_parts_the_output_folder_and_requirements(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for words in ("Point to point", "torch.distributed", "every byte is checked",
                  "Compiled actor graph", "overlap off and on", "no speed-up is claimed",
                  "--out", "default demo-out/", "2 CUDA GPUs", "matplotlib"):  # fmt: skip
        assert words.lower() in text.lower(), words


def test_without_matplotlib_the_demo_says_so_and_draws_no_chart(monkeypatch, tmp_path):
    from tensorferry.demo import _chart, p2p

    def no_matplotlib(*args, **kwargs):
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(_chart, "write_p2p_chart", no_matplotlib)
    out = io.StringIO()
    p2p._draw([], tmp_path / "p2p.png", "title", out)
    assert out.getvalue() == "chart: matplotlib is not installed, so no chart is drawn\n"
    assert not (tmp_path / "p2p.png").exists()


def test_each_ranks_payload_differs_from_the_others_in_every_word_and_from_the_poison():
    from tensorferry.demo._p2p_rank import POISON, payload

    first, second = payload(4096, 0, torch.device("cpu")), payload(4096, 1, torch.device("cpu"))
    assert bool((first != second).all())
    assert int(first.min()) >= 0 and int(second.min()) >= 0 and POISON < 0
    assert torch.equal(first, payload(4096, 0, torch.device("cpu")))  # the peer recomputes it


_UNGUARDED = """
    import tensorferry as tf


    class Worker:
        def ping(self):
            return 1


    worker = tf.actor(Worker).spawn(start_timeout=60)
    print(worker.ping.call())
"""

_CLASS_UNDER_THE_GUARD = """
    import tensorferry as tf

    if __name__ == "__main__":

        class Worker:
            def ping(self):
                return 1

        worker = tf.actor(Worker).spawn(start_timeout=60)
"""


def test_a_driver_script_without_a_main_guard_is_told_so_when_its_actor_dies(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(_UNGUARDED))
    done = _run([sys.executable, str(script)], cwd=tmp_path, timeout=120)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("tensorferry.errors.ActorDiedError: actor Worker-0"), done.stderr
    assert f"the driver's script {script} again" in last
    assert 'has no `if __name__ == "__main__":` guard' in last
    assert 'Put the code that starts actors and graphs under `if __name__ == "__main__":`' in last
    # The actor process's own traceback names it too, not a pickling problem.
    assert "Worker.spawn() ran while an actor process imported the driver's main" in done.stderr
    assert "cannot be pickled" not in done.stderr


def test_an_actor_class_under_the_main_guard_is_told_to_move_to_the_top_level(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(_CLASS_UNDER_THE_GUARD))
    done = _run([sys.executable, str(script)], cwd=tmp_path, timeout=120)
    assert done.returncode != 0
    assert "tensorferry.errors.ActorError: Worker-0" in done.stderr, done.stderr
    assert done.stderr.strip().endswith(
        "the actor process imports __main__.Worker by name and did not find it there: define "
        'actor classes at the top level of their module, not under `if __name__ == "__main__":` '
        "or inside another block"
    ), done.stderr
