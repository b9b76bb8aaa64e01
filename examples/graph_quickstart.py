# run: python examples/graph_quickstart.py
import torch

import tensorferry as tf
from tensorferry.graph import InputNode, MultiOutputNode


# Actor classes live at the top level of a module: each actor's process imports its class.
class Producer:
    def __init__(self, size: int, device: str) -> None:
        self.size, self.device = size, device

    def produce(self, step: int, branch: int) -> torch.Tensor:
        return torch.full((self.size, self.size), float(step + branch), device=self.device)


class Consumer:
    def __init__(self, size: int, device: str) -> None:
        self.weight = 2 * torch.eye(size, device=device)

    def consume(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.weight).sum(dim=0)


def main() -> None:
    size = 256
    two_gpus = torch.cuda.device_count() >= 2
    devices = ("cuda:0", "cuda:1") if two_gpus else ("cpu", "cpu")
    producer = tf.actor(Producer).spawn(size, devices[0], device=devices[0])  # a process each
    consumer = tf.actor(Consumer).spawn(size, devices[1], device=devices[1])
    with InputNode() as step:
        outs = [consumer.consume.bind(producer.produce.bind(step, b)) for b in range(3)]
    graph = MultiOutputNode(outs).compile(overlap_communication=True, max_inflight=2)
    with graph:  # leaving the block tears the graph down and ends the actors
        for i in range(5):
            results = graph.execute(i).get(timeout=60)  # a list: one tensor per output
            for b, r in enumerate(results):
                assert torch.equal(r.cpu(), torch.full((size,), 2.0 * size * (i + b)))
    print("graph: ok on", "two GPUs" if two_gpus else "the CPU")


if __name__ == "__main__":  # actor processes import this file: keep the driver under the guard
    main()
