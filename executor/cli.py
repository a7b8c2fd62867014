"""Command-line subcommands of the executor (registered by pipedsl.cli)."""

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add this package's subcommands."""
