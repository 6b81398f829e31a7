"""The optional parts of the install (pyproject's extras) and the one-line error when one is missing.

`learning` (torch, scikit-learn; scipy comes with scikit-learn): every task but `quadratic`.
`plots` (matplotlib): the figures of `mosaicd report` and `mosaicd analyze`.
`tensorboard`, `mlflow` (mlflow-skinny with SQLAlchemy): `--tensorboard DIR`, `--mlflow DIR` (mosaicd/trackers.py).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator

EXTRA_OF = {"torch": "learning", "sklearn": "learning", "scipy": "learning", "matplotlib": "plots",
            "tensorboard": "tensorboard", "mlflow": "mlflow", "sqlalchemy": "mlflow", "alembic": "mlflow"}


class MissingExtra(ValueError):
    """A module of an extra is not installed; the message names the pip command that installs it."""

    def __init__(self, what: str, module: str) -> None:
        self.module, self.extra = module, EXTRA_OF[module]
        super().__init__(f"{what} needs {module}, which is not installed: "
                         f"pip install 'mosaic-learning[{self.extra}]'")


def require(what: str, *modules: str) -> None:
    """Raise MissingExtra for the first of `modules` (top-level names) that cannot be imported."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            raise MissingExtra(what, module)


@contextlib.contextmanager
def needs(what: str) -> Iterator[None]:
    """Turn a ModuleNotFoundError for a module of an extra, raised in the block, into MissingExtra."""
    try:
        yield
    except ModuleNotFoundError as exc:
        module = (exc.name or "").partition(".")[0]
        if module not in EXTRA_OF:
            raise
        raise MissingExtra(what, module) from None
