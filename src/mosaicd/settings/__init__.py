"""One settings model for every entry point: CLI flags > MOSAIC_* environment > TOML file > defaults.

Settings configure and build nothing: what a run builds of the protocol from them (each node's aggregator,
compressor, attack and profile) is `mosaicd.protocol`'s. The modules, by concern: `values` (the values settings
take and their parsers), `flags` (each setting's flag, and errors that name it), `effects` (what each setting
needs to have an effect), `run` (`RunConfig`), `daemon` (`DaemonOptions`), `load` (`Settings`: flags, environment,
TOML).
"""

from mosaicd.settings.daemon import DaemonOptions
from mosaicd.settings.effects import ALWAYS, EFFECTS, needs_text
from mosaicd.settings.flags import COMMANDS, OPTION_TABLES, SettingsError, cli, flag_name, format_errors
from mosaicd.settings.load import Settings
from mosaicd.settings.run import RunConfig
from mosaicd.settings.values import (
    LR_SCHEDULES,
    OPTIMIZERS,
    OWN_LOOP,
    TASK_ENTRY_POINTS,
    UVLOOP_MISSING,
    EventLoop,
    OptimizerState,
    Partition,
    TaskName,
    TaskOption,
    import_path,
    task_options,
    task_spec,
    uvloop_installed,
)

__all__ = [
    "ALWAYS", "COMMANDS", "EFFECTS", "LR_SCHEDULES", "OPTIMIZERS", "OPTION_TABLES", "OWN_LOOP", "TASK_ENTRY_POINTS",
    "UVLOOP_MISSING", "DaemonOptions", "EventLoop", "OptimizerState", "Partition", "RunConfig", "Settings",
    "SettingsError", "TaskName", "TaskOption", "cli", "flag_name", "format_errors", "import_path", "needs_text",
    "task_options", "task_spec", "uvloop_installed",
]
