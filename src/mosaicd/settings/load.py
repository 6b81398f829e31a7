"""`Settings`: every knob, loaded from CLI flags > MOSAIC_* environment > TOML file > defaults."""

from __future__ import annotations

import os
import tomllib
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from mosaicd.settings.daemon import DaemonOptions
from mosaicd.settings.effects import defaults, void_raw, void_setting
from mosaicd.settings.flags import SettingsError, cli, format_errors
from mosaicd.settings.run import RunConfig

_toml_path: ContextVar[Path | None] = ContextVar("mosaic_toml_path", default=None)


class _TomlSource(PydanticBaseSettingsSource):
    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:  # pragma: no cover
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = _toml_path.get()
        if path is None:
            return {}
        with open(path, "rb") as f:
            data = tomllib.load(f)
        table = data.pop("mosaic", None)  # the settings may sit in a [mosaic] table; any other table is refused
        if isinstance(table, dict):
            data.update(table)
        elif table is not None:
            data["mosaic"] = table
        return {k.replace("-", "_"): v for k, v in data.items()}


DEFAULTS_ENV = "MOSAIC_DEFAULTS"  # a deployment file's defaults, as TOML: `round_deadline = 300`


class _DeploymentDefaults(PydanticBaseSettingsSource):
    """MOSAIC_DEFAULTS: the defaults a deployment file gives its process (compose.yaml: 300 s rounds for dozens of
    containers on few cores). Each is used where no flag, MOSAIC_* variable or --config gives that setting, and
    only where it has an effect (`effects.EFFECTS`): an asynchronous run has no round, so compose's round deadline
    is left out there, where a deadline a person gives is refused. A deployment file passes a person's own value
    as `${MOSAIC_X:-}`: empty, it is no value."""

    def __init__(self, settings_cls: type[BaseSettings], given: tuple[PydanticBaseSettingsSource, ...]) -> None:
        super().__init__(settings_cls)
        self.given = given

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:  # pragma: no cover
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        text = os.environ.get(DEFAULTS_ENV, "")
        if not text.strip():
            return {}
        try:
            table = {k.replace("-", "_"): v for k, v in tomllib.loads(text).items()}
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"{DEFAULTS_ENV}: not valid TOML ({exc}): e.g. {DEFAULTS_ENV}='round_deadline = "
                                "300'") from None
        fields = self.settings_cls.model_fields
        if unknown := sorted(k for k in table if k not in fields):
            raise SettingsError(f"{DEFAULTS_ENV}: no setting {unknown[0]!r}")
        given: dict[str, Any] = {}
        for source in reversed(self.given):
            given.update(source())
        field_defaults = defaults(self.settings_cls)
        values = {**field_defaults, **given}
        return {k: v for k, v in table.items() if k not in given
                and not void_raw(k, {**values, k: v}, field_defaults)}


class Settings(BaseSettings, RunConfig, DaemonOptions):
    """Every knob of a run, a node, the barrier and the tooling. Field names are the CLI flags."""

    # an empty MOSAIC_* variable is no value: a deployment file passes a person's own as `${MOSAIC_X:-}`
    model_config = SettingsConfigDict(env_prefix="MOSAIC_", extra="forbid", validate_default=True, frozen=False,
                                      env_ignore_empty=True)

    batched: bool = Field(False, description="simulate: train and evaluate all nodes' models together (vmap); "
                          "close to, not bit-identical with, the exact run", **cli("learning", "simulate"))
    data_dir: Path = Field(Path("data"), description="where data sets live", **cli("outputs"))
    checkpoint_rounds: int = Field(10, ge=0, description="simulate: save what --resume continues from (every "
                                   "node's model, the barrier's state) after every N rounds (0: never; --sync "
                                   "async: at the first point of the --eval-every grid N iterations on)",
                                   **cli("outputs", "simulate"))
    checkpoint_seconds: float = Field(30.0, ge=0, description="simulate: ... and after a round that ends this many "
                                      "seconds after the last save, if that comes first (0: by rounds only)",
                                      **cli("outputs", "simulate"))
    linger: float = Field(0.0, ge=0, description="seconds a node keeps serving after its last round",
                          **cli("outputs", "node", "barrier"))
    log_level: str = Field("info", pattern=r"^(debug|info|warning|error)$", **cli("outputs"))
    log_json: bool | None = Field(None, description="JSON log lines, every one, for log shippers (default: lines "
                                  "for people, a warning of a kind at most every 10 s)", **cli("outputs"))
    log_file: Path | None = Field(None, description="node, barrier: every log line (info and up), as JSON, also "
                                  "appended to this file, whatever the console shows (`mosaicd log` reads a run's "
                                  "OUT/logs/*.log; rank 0 of a --peer-list writes its own there)",
                                  **cli("outputs", "node", "barrier"))

    @model_validator(mode="after")
    def _effects(self) -> Settings:
        own = [n for n in Settings.model_fields if n not in RunConfig.model_fields and n not in
               DaemonOptions.model_fields]
        if (void := void_setting(self, own, defaults(Settings))) is not None:
            raise ValueError(void)  # --batched without training, ... (settings/effects.py)
        return self

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource, **_: PydanticBaseSettingsSource) -> tuple:
        toml = _TomlSource(settings_cls)
        return init_settings, env_settings, toml, _DeploymentDefaults(settings_cls, (init_settings, env_settings, toml))

    @classmethod
    def load(cls, config: Path | None = None, **flags: Any) -> Settings:
        """Build settings from explicit flags, the environment and an optional TOML file; errors name the flag."""
        if config is not None and not Path(config).is_file():
            raise SettingsError(f"--config: no such file: {config}")
        token = _toml_path.set(Path(config) if config else None)
        try:
            return cls(**{k: v for k, v in flags.items() if v is not None})
        except ValidationError as exc:
            raise SettingsError(format_errors(exc, config)) from None
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"--config {config}: not valid TOML: {exc}") from None
        finally:
            _toml_path.reset(token)

    def run_config(self) -> RunConfig:
        return RunConfig.model_validate({k: getattr(self, k) for k in RunConfig.model_fields})

    def daemon_options(self) -> DaemonOptions:
        return DaemonOptions.model_validate({k: getattr(self, k) for k in DaemonOptions.model_fields})

    def run_fields(self) -> dict[str, Any]:
        """The fields every node of a run must share, as JSON (what the barrier hands out)."""
        return self.run_config().model_dump(mode="json")
