"""The console the looking tools (`status`, `runs`, `log`) print tables on."""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

PIPED_WIDTH = 100_000  # a table piped to a file or a program: one line per row, never wrapped at 80 columns


def seconds(text: str) -> float:
    """An argparse type for a duration: a finite number of seconds above 0 (0 made `status --watch` spin, a
    negative one failed after the first table, `--timeout 0` was a socket error)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected seconds above 0, got {text}")
    return value


def console() -> Console:
    """rich's Console on stdout: the terminal's width on a terminal; piped, plain text (no colours, no escape
    sequences) and as wide as the rows are."""
    from rich.console import Console

    console = Console(highlight=False)
    if console.is_terminal:
        return console
    return Console(width=PIPED_WIDTH, highlight=False, no_color=True, color_system=None)


def show(console: Console, renderable: Any) -> None:
    """Print on `console`; piped, without the spaces that pad a table's rows to its width."""
    if console.is_terminal:
        console.print(renderable)
        return
    with console.capture() as captured:
        console.print(renderable)
    console.file.write("\n".join(line.rstrip() for line in captured.get().splitlines()) + "\n")
    console.file.flush()
