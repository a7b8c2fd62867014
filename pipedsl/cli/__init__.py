"""The ``pipedsl`` command line (:mod:`pipedsl.cli.main`); ``python -m pipedsl`` runs it too."""

from pipedsl.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
