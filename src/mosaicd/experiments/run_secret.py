"""A cluster's own secret: unless --secret-file is given (or --insecure asks for none), `mosaicd cluster` makes a
random secret for the run, in a 0600 file in a private 0700 temporary folder (never in the output folder), hands
every process its path (MOSAIC_SECRET_FILE) and deletes it at the end.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from mosaicd.daemon.http.auth import Secret, write_new_secret


class RunSecret:
    """The run's secret file, from `make` until `remove`; `path` None while there is none of the launcher's own."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self.path: Path | None = None
        self.secret = Secret(None)  # what this process signs with (`make`): the one value, not the file again

    def make(self) -> dict[str, Any]:
        """The settings override that gives every process the run's secret: the user's --secret-file, none with
        --insecure, else a fresh random one (`path`)."""
        s = self.settings
        if s.secret_file is not None or s.insecure:
            self.secret = Secret.of(s)
            return {}
        folder = Path(tempfile.mkdtemp(prefix="mosaic-secret-"))  # 0700, outside the output folder
        self.secret = Secret.new()
        assert self.secret.value is not None
        self.path = write_new_secret(folder / "secret", self.secret.value)
        return {"secret_file": str(self.path)}

    def load(self) -> bytes | None:
        """The secret's bytes the run's requests are signed with (the user's or the launcher's), None without one."""
        return self.secret.value

    def remove(self) -> None:
        """Delete the launcher's own secret and its folder (the user's --secret-file stays)."""
        if self.path is not None:
            shutil.rmtree(self.path.parent, ignore_errors=True)
