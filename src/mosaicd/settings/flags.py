"""The settings as a person types them: each setting's flag and help group, and errors worded to name the flag."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

COMMANDS = ("node", "barrier", "cluster", "simulate")


def cli(group: str, *commands: str, metavar: str | None = None) -> dict[str, Any]:
    """A setting's place on the command line (Field metadata): its help group and the subcommands that take it
    (default: all), and the flag's metavar where the type does not say it. `mosaicd`'s flags are generated from it."""
    extra: dict[str, Any] = {"group": group, "commands": list(commands or COMMANDS)}
    if metavar is not None:
        extra["metavar"] = metavar
    return {"json_schema_extra": extra}


class SettingsError(ValueError):
    """A settings problem, worded for the person who typed the flag."""


OPTION_TABLES = {"task_options": "--task-option", "optimizer_options": "--optimizer-option",
                 "lr_schedule_options": "--lr-schedule-option"}  # tables given as repeated KEY=VALUE flags


def flag_name(name: str) -> str:
    """A setting's flag: `--local-steps`; `--task-option` (repeated) for the table `task_options`."""
    return OPTION_TABLES.get(name) or "--" + name.replace("_", "-")


def format_errors(exc: ValidationError, config: Path | None = None) -> str:
    """One line for the errors, each naming where the value can come from: its flag, its variable, --config's key."""
    lines = []
    for err in exc.errors():
        loc = [str(x) for x in err["loc"]]
        if err["type"] == "extra_forbidden" and loc:  # only a --config file can name a setting that does not exist
            kind = "table" if isinstance(err.get("input"), dict) else "setting"
            lines.append(f"--config {config}: unknown {kind} {loc[0]!r} (see mosaicd node --help for the settings)"
                         if config else f"unknown setting {loc[0]!r} (a Settings argument; see mosaicd node --help)")
            continue
        key = f", or {loc[0]} in --config {config}" if config and loc else ""
        where = f"{flag_name(loc[0])} (MOSAIC_{loc[0].upper()}{key})" if loc else "settings"
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {msg}" + (f" (got {err['input']!r})" if loc and "input" in err else ""))
    return "; ".join(lines)
