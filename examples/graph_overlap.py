# run: python examples/graph_overlap.py
import tempfile
from pathlib import Path

import torch

import tensorferry as tf
from tensorferry.graph import InputNode, MultiOutputNode


class Sender:
    def __init__(self, size: int) -> None:
        self.size = size

    def produce(self, step: int, branch: int) -> torch.Tensor:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return torch.full((self.size, self.size), float(step * 10 + branch))


class Receiver:
    def __init__(self, size: int) -> None:
        self.weight = torch.eye(size)

    def consume(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return (x @ self.weight).sum(dim=0) * scale


def main() -> None:
    size = 128
    s = tf.actor(Sender).spawn(size, name="sender")
    r = tf.actor(Receiver).spawn(size, name="receiver")
    print(r.consume.call(torch.ones(size, size), 1.0)[:3])  # a direct call, outside any graph

    with InputNode() as inp:  # inp[0] is execute's first argument, inp.scale a keyword
        outs = [
            r.consume.bind(s.produce.bind(inp[0], b).with_transport("auto"), inp.scale)
            for b in range(3)
        ]
    graph = MultiOutputNode(outs).compile(overlap_communication=True, max_inflight=2)
    with graph:
        refs = [graph.execute(i, scale=0.5) for i in range(4)]  # two in flight at a time
        last = refs[-1].get(timeout=60)
        assert torch.equal(last[2], torch.full((size,), 0.5 * size * 32.0))

        try:
            graph.execute(-1, scale=1.0).get(timeout=60)
        except tf.ActorError as error:  # the remote traceback is in the message
            print("failed as expected:", str(error).splitlines()[0])
        graph.execute(1, scale=1.0).get(timeout=60)  # the next execution runs normally

        out = Path(tempfile.mkdtemp())
        dot, picture = graph.visualize_schedule(out / "schedule.png")
        print("schedule:", dot.name, picture.name)


if __name__ == "__main__":
    main()
