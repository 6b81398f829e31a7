"""`mosaicd` as the daemon tests start it by hand: a `barrier` or `node` given no --secret-file (nor
MOSAIC_SECRET_FILE) runs --insecure, as every by-hand role on loopback did before secrets became the default there.
Tests that are about the secret give one (then nothing is added) or start `Kit.mosaicd`, as a user types it."""

from __future__ import annotations

import os
import sys

from mosaicd.cli import main


def loopback_argv(argv: list[str]) -> list[str]:
    argv = list(argv)
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        argv.insert(0, "node")
    given = {a.split("=", 1)[0] for a in argv} & {"--secret-file", "--insecure", "-h", "--help"}
    if argv and argv[0] in ("barrier", "node") and not given and not os.environ.get("MOSAIC_SECRET_FILE") \
            and not os.environ.get("MOSAIC_INSECURE"):
        argv.insert(1, "--insecure")
    return argv


if __name__ == "__main__":
    main(loopback_argv(sys.argv[1:]))
