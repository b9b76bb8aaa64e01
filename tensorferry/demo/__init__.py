"""``tensorferry demo``: the two jobs of tensorferry, measured and checked on this machine.

- :mod:`tensorferry.demo.p2p`: two local processes exchange tensors with ``tf.send``/``tf.recv``
  and with ``torch.distributed``, same sizes, same timing; every byte is checked.
- :mod:`tensorferry.demo.graph`: a compiled actor graph, overlap off and on; every result is
  checked, and the schedules and timelines are drawn.

``tensorferry.cli.demo`` is the command that runs both.
"""
