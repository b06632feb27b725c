"""argparse value types shared by the subcommands; each error says what was given."""

from __future__ import annotations

import argparse
from collections.abc import Callable


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
