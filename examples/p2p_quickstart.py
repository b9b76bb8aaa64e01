# run: torchrun --nproc-per-node 2 examples/p2p_quickstart.py
import os

import torch

import tensorferry as tf

tf.init()  # rank and world size from torchrun's environment
rank = tf.get_rank()
peer = 1 - rank
if torch.cuda.is_available():
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
else:
    device = torch.device("cpu")

# One tensor one way: both calls return a Transfer at once.
if rank == 0:
    tf.send(torch.arange(1024, dtype=torch.float32, device=device), dst=1).wait(timeout=30)
else:
    y = tf.recv(tf.TensorSpec((1024,), torch.float32), src=0).result(timeout=30)
    assert torch.equal(y.cpu(), torch.arange(1024, dtype=torch.float32))

# Both ways at once: the batch's sends and receives go together when the block ends.
x = torch.full((4096,), float(rank), device=device)
y = torch.empty(4096, device=device)
with tf.batch() as b:
    b.send(x, peer)
    b.recv(y, peer)
b.wait(timeout=30)
assert torch.equal(y.cpu(), torch.full((4096,), float(peer)))

print(f"rank {rank}: ok")
tf.shutdown()
