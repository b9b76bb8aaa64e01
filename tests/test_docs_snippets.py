"""Every Python block of the README and the guides runs, on the CPU.

How a fenced ``python`` block in ``README.md`` or ``docs/**/*.md`` is treated, by its first line:

- ``# run: COMMAND``: the block is a file of ``examples/``, byte for byte, and ``COMMAND`` (which
  names that file) runs it; ``torchrun`` in it runs as ``python -m torch.distributed.run
  --standalone``.
- ``# not run: WHY``: shown only (it needs GPUs, a cluster, or is a fragment).
- anything else: the block is a whole script and runs alone with ``python``.

Pages whose blocks carry no such line are listed in ``UNMARKED``, block by block. Every file of
``examples/`` runs too, by the ``# run:`` line it starts with, whether a page shows it or not.
Each run must finish within ``TIMEOUT_S`` and exit 0.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 60
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])

# Pages edited for other reasons, whose blocks carry no marker: (page, block index) -> (the
# block's first line, how it runs: "python", "torchrun N" or "not run: WHY").
UNMARKED = {
    ("docs/multihost.md", 0): (
        "import ray",
        "not run: needs a Ray cluster of two hosts (tests/ray runs the same graph on two nodes)",
    ),
    ("docs/multihost.md", 1): ("import ray", "python"),
    ("docs/multihost.md", 2): ("# ring.py", "torchrun 2"),
}
# Pages being rewritten: their blocks are run once they carry a marker; unmarked ones are
# skipped until the page leaves this set.
REWRITE_PENDING: set[str] = set()

_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def _blocks() -> list[tuple[str, int, str]]:
    found = []
    for page in PAGES:
        name = page.relative_to(ROOT).as_posix()
        for i, match in enumerate(_FENCE.finditer(page.read_text())):
            found.append((name, i, match.group(1)))
    return found


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    env.pop("TENSORFERRY_VISUALIZE_SCHEDULE", None)
    return env


def _run(argv: list[str], cwd: Path) -> None:
    try:
        done = subprocess.run(
            argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired as timeout:
        pytest.fail(f"{shlex.join(argv)} ran past {TIMEOUT_S} s:\n{timeout.stdout}{timeout.stderr}")
    if done.returncode != 0:
        pytest.fail(f"{shlex.join(argv)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")


def _argv(command: str) -> list[str]:
    """A ``# run:`` command as an argv: ``python`` is this interpreter, ``torchrun`` torch's."""
    words = shlex.split(command)
    if words[0] == "python":
        return [sys.executable, *words[1:]]
    if words[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", *words[1:]]
    raise ValueError(f"a run command starts with python or torchrun, not {command!r}")


def _how(page: str, index: int, text: str) -> str:
    first = text.splitlines()[0] if text.strip() else ""
    if first.startswith("# not run:"):
        return first[2:]
    if first.startswith("# run:"):
        return first[2:]
    if (page, index) in UNMARKED:
        expected_first, how = UNMARKED[(page, index)]
        assert first == expected_first, (
            f"{page} block {index} now starts {first!r}: update UNMARKED in this file"
        )
        return how
    if page in REWRITE_PENDING:
        return "not run: the page is being rewritten"
    return "python"


BLOCKS = _blocks()


@pytest.mark.parametrize(("page", "index", "text"), BLOCKS, ids=[f"{p}#{i}" for p, i, _ in BLOCKS])
def test_block_runs(page: str, index: int, text: str, tmp_path: Path) -> None:
    how = _how(page, index, text)
    if how.startswith("not run:"):
        reason = how.removeprefix("not run:").strip()
        assert reason, f"{page} block {index}: '# not run:' needs a reason"
        pytest.skip(reason)
    if how.startswith("run:"):
        command = how.removeprefix("run:").strip()
        files = [w for w in shlex.split(command) if w.startswith("examples/")]
        assert len(files) == 1, f"{page} block {index}: {command!r} names no examples/ file"
        example = ROOT / files[0]
        assert example.is_file(), f"{page} block {index} mirrors {files[0]}, which is missing"
        assert example.read_text() == text, (
            f"{page} block {index} differs from {files[0]}: copy one onto the other"
        )
        return  # test_example_runs runs it
    script = tmp_path / "block.py"
    script.write_text(text)
    if how == "python":
        _run([sys.executable, str(script)], cwd=tmp_path)
    else:
        ranks = how.removeprefix("torchrun").strip()
        _run(_argv(f"torchrun --nproc-per-node {ranks} {script}"), cwd=tmp_path)


EXAMPLE_FILES = sorted(EXAMPLES.glob("*.py"))


@pytest.mark.parametrize("example", EXAMPLE_FILES, ids=[p.name for p in EXAMPLE_FILES])
def test_example_runs(example: Path) -> None:
    first = example.read_text().splitlines()[0]
    assert first.startswith("# run: "), f"{example.name} must start with '# run: COMMAND'"
    command = first.removeprefix("# run: ")
    assert f"examples/{example.name}" in shlex.split(command), f"{first!r} runs another file"
    _run(_argv(command), cwd=ROOT)


def test_commands_in_pages_name_existing_files() -> None:
    """Commands that pages show for ``examples/`` or ``tools/`` files name files that exist."""
    missing = []
    for page in PAGES:
        for path in re.findall(r"\b((?:examples|tools)/[\w./-]+\.(?:py|sh))", page.read_text()):
            if not (ROOT / path).is_file():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, "pages name files that do not exist:\n" + "\n".join(missing)
