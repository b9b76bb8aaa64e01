"""Benchmarks behind ``tensorferry bench``; each module has ``add_arguments`` and ``run``."""
