"""The ``streamwin`` command: pack, merge, index, verify, inspect and bench a dataset."""
from streamwin.cli.main import main

__all__ = ["main"]
