"""argparse value types shared by the subcommands; each error says what was given."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from .._options import REFUSED


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low``.

    Example:
        >>> int_at_least(1)("2")
        2
    """

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return value

    return parse


def precision(text: str) -> str:
    """An argparse type for ``--precision``: a value that cannot run yet (fp8) is refused, saying what it needs.

    Example:
        >>> precision("bf16")
        'bf16'
    """
    why = REFUSED["precision"].get(text)
    if why is not None:
        raise argparse.ArgumentTypeError(why)
    return text
