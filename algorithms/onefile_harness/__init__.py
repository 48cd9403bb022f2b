"""The run harness of the algorithm files in algorithms/: `python algorithms/<name>.py` hands over to
`command_line` here (the command line, sweeps, devices, progress, checkpoints and resume, tracking,
statistics and plots, evaluation and rendering, XLA's set-up, environment suites). It reaches a
file only through the interface written down in `protocol.py`."""

from .main import command_line

__all__ = ["command_line"]
