"""Argument types the benchmarks share: a count must be a count, refused by argparse (exit 2)."""

from __future__ import annotations

import argparse
from pathlib import Path


def positive_int(text: str) -> int:
    """An int of at least 1 (rounds, repeats, positions, conversations, threads), else argparse's error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def positive_ints(text: str) -> tuple[int, ...]:
    """Comma-separated positive ints (``--sizes 1000,10000``), else argparse's error naming the bad one."""
    return tuple(positive_int(part.strip()) for part in text.split(","))


def checkout(text: str) -> Path:
    """Another checkout of kvstate (``--against DIR``): a folder holding the ``kvstate`` package."""
    path = Path(text)
    if not (path / "kvstate").is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is no kvstate checkout (no folder {str(path / 'kvstate')!r})")
    return path

