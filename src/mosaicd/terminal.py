"""The console the looking tools (`status`, `runs`, `log`) print tables on."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

PIPED_WIDTH = 100_000  # a table piped to a file or a program: one line per row, never wrapped at 80 columns


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
