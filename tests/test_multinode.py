"""p2p across "nodes": two torchrun launchers on loopback (node ranks 0 and 1, two processes
each) run the p2p suite over gloo, as two hosts would over the network."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

SUITE = Path(__file__).parent / "p2p" / "torchrun_suite.py"


@pytest.mark.timeout(240)
def test_p2p_suite_under_two_node_torchrun():
    # The rendezvous store lives here, not in node 0's launcher: a launcher that finishes
    # first must not take the store down while the other still passes its exit barrier.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = store.port
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    launchers = [
        subprocess.Popen(
            [
                sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                "--nproc-per-node=2", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-conf=is_host=false",
                "--rdzv-id=tensorferry-multinode", f"--node-rank={node}", str(SUITE),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,  # so a hang can be ended with every rank process
        )
        for node in (0, 1)
    ]  # fmt: skip
    outputs, hung = [], False
    for launcher in launchers:
        try:
            outputs.append(launcher.communicate(timeout=150)[0])
        except subprocess.TimeoutExpired:
            hung = True
            for other in launchers:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(other.pid, signal.SIGKILL)
            outputs.append(launcher.communicate()[0])
    text = "\n".join(outputs)
    assert not hung, f"the two-node torchrun run hung\n{text[-6000:]}"
    verdicts = sorted(re.findall(r"rank \d/4 node \d: p2p suite (?:ok|FAILED)", text))
    codes = [p.returncode for p in launchers]
    assert codes == [0, 0], f"exit codes {codes}; verdicts {verdicts}\n{text[-4000:]}"
    nodes = {line.split(" node ")[1][0] for line in verdicts}
    assert len(verdicts) == 4 and all(line.endswith("p2p suite ok") for line in verdicts)
    assert nodes == {"0", "1"}, verdicts
