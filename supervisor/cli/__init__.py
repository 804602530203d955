"""The ``spanvisor`` command line (:mod:`.verbs`) and its demo (:mod:`.demo`, :mod:`.demo_view`)."""

from supervisor.cli.verbs import build_parser, main

__all__ = ["build_parser", "main"]
