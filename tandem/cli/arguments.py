"""argparse types the subcommands share."""

from __future__ import annotations

import argparse


def count(text: str) -> int:
    """A whole number of at least 0 (argparse type)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative: give 0 or more")
    return value


def positive(text: str) -> int:
    """A whole number of at least 1 (argparse type)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: give 1 or more")
    return value


def tau2_domains(text: str) -> str:
    """Comma-separated τ²-bench domains Tandem plays (argparse type)."""
    from services.config import TAU2_DOMAINS

    unknown = [d for d in text.split(",") if d not in TAU2_DOMAINS]
    if unknown or not text:
        raise argparse.ArgumentTypeError(f"{text!r}: domains are a comma-separated list of {', '.join(TAU2_DOMAINS)}")
    return text
