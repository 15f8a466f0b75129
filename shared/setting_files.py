"""Settings read from files named by `MESHLLM_<FIELD>_FILE` (Docker and Kubernetes secrets).

Orchestrators hand secrets to a container as files (`/run/secrets/<name>` in Swarm, a mounted
Secret volume in Kubernetes), so a password never has to sit in an environment variable that
`docker service inspect` or `/proc/<pid>/environ` shows. The convention is the one of the
official database images (`POSTGRES_PASSWORD_FILE`): for any setting `X`, `MESHLLM_X_FILE`
names a file whose content is the value.

Rules:
- the value is the file's content without its trailing line break (`echo pw | docker secret
  create` adds one); a JSON-valued setting (a list) is parsed as JSON, as from the environment;
- `MESHLLM_X` set to a non-empty value together with `MESHLLM_X_FILE` is an error: two sources
  for one secret is a misconfiguration, not a precedence question. An empty `MESHLLM_X` (compose
  files default secrets to "") gives way to the file;
- a file that cannot be read is an error naming the variable, at start-up, not a silent default.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

FILE_SUFFIX = "_FILE"


class SettingFileError(ValueError):
    """A `MESHLLM_*_FILE` variable that cannot be honoured."""


class FileSettingsSource(PydanticBaseSettingsSource):
    """Values of the fields whose `<prefix><FIELD>_FILE` variable is set (see module docstring)."""

    def __init__(self, settings_cls: type[BaseSettings], environ: dict[str, str] | None = None):
        super().__init__(settings_cls)
        self.prefix = str(settings_cls.model_config.get("env_prefix", ""))
        source = os.environ if environ is None else environ
        # Environment names are matched case-insensitively, as pydantic-settings does.
        self.environ = {key.upper(): value for key, value in source.items()}

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        name = f"{self.prefix}{field_name}".upper()
        path = self.environ.get(name + FILE_SUFFIX)
        if not path:
            return None, name, False
        if self.environ.get(name):
            raise SettingFileError(
                f"both {name} and {name}{FILE_SUFFIX} are set: give the value one way only"
            )
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise SettingFileError(f"{name}{FILE_SUFFIX}={path}: cannot read it: {exc}") from exc
        return text.rstrip("\r\n"), name, self.field_is_complex(field)

    def __call__(self) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for field_name, field in self.settings_cls.model_fields.items():
            value, name, is_complex = self.get_field_value(field, field_name)
            if value is None:
                continue
            if is_complex:
                try:
                    value = json.loads(value)
                except ValueError as exc:
                    raise SettingFileError(f"{name}{FILE_SUFFIX}: not JSON: {exc}") from exc
            values[field_name] = value
        return values
