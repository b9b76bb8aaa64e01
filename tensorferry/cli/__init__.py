"""The ``tensorferry`` command line: ``doctor``, ``demo`` and ``bench``."""
