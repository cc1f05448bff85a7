"""Argument types the benchmarks share: a count must be a count, refused by argparse (exit 2)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An int of at least 1 (rounds, repeats, positions, conversations, threads), else argparse's error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value
