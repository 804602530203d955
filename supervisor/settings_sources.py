"""Where the sidecar's settings come from, and naming that place when one is wrong.

pydantic-settings reads the sources and merges them, key by key: arguments
(``spanvisor run``'s flags) over ``SPANVISOR_*`` variables over the YAML settings
file over defaults. What is added here is what an operator needs on top: a
settings file that cannot be read and bad JSON in a variable are ConfigErrors
naming them, a ``SPANVISOR_*`` name that is no setting is logged (a misspelt
variable would otherwise change nothing, silently), and a value that fails
validation is reported with the variable or the file it came from.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    YamlConfigSettingsSource,
)

from supervisor.errors import ConfigError

log = logging.getLogger("spanvisor.settings")

#: A validation error's location: field names, mapping keys, list indices.
Loc = tuple[str | int, ...]

#: ``SPANVISOR_*`` names that are not settings: read by one component (the
#: settings file and the clients' API address: ``supervisor.api_access``), or set
#: by the command actuator for the commands it runs.
NOT_SETTINGS = frozenset(
    {
        "CONFIG",
        "API_URL",
        "LLM_API_KEY",
        "COMPILE",
        "COMMAND",
        "COMMAND_ID",
        "COMMAND_TYPE",
        "IDEMPOTENCY_KEY",
        "RUN_ID",
        "SERVICE",
        "PHOENIX_PYTHON",
    }
)


def _holds(values: Any, loc: Loc) -> bool:
    """Whether the nested mappings and lists of ``values`` have something at ``loc``."""
    for key in loc:
        if isinstance(values, Mapping) and str(key) in values:
            values = values[str(key)]
        elif isinstance(values, list) and isinstance(key, int) and 0 <= key < len(values):
            values = values[key]
        else:
            return False
    return True


class VariablesSource(EnvSettingsSource):
    """``SPANVISOR_*`` variables as pydantic-settings reads them, able to name the ones used."""

    def __init__(self, settings_cls: type[BaseSettings]) -> None:
        super().__init__(settings_cls)
        #: What the variables set, once read: to tell which of them a bad value came from.
        self.values: dict[str, Any] = {}
        # The names as they were spelt: pydantic-settings lower-cases them.
        self._spelt = {self._normal(name): name for name in os.environ}

    def __call__(self) -> dict[str, Any]:
        self.values = super().__call__()
        self._log_unknown()
        return self.values

    def prepare_field_value(
        self, field_name: str, field: FieldInfo, value: Any, value_is_complex: bool
    ) -> Any:
        try:
            return super().prepare_field_value(field_name, field, value, value_is_complex)
        except json.JSONDecodeError as exc:
            names = " or ".join(self.variables((field_name,)))
            raise ConfigError(f"{names}: not valid JSON: {exc}") from None

    def variables(self, loc: Loc) -> list[str]:
        """The variables behind the value at ``loc``.

        The one naming ``loc`` or the nearest mapping holding it
        (``SPANVISOR_AGENTS`` as JSON), else those naming keys inside it
        (``SPANVISOR_DOWNSTREAM__ENDPOINT`` for ``downstream``).
        """
        delimiter = self.env_nested_delimiter or ""
        for depth in range(len(loc), 0, -1):
            name = self._normal(self.env_prefix + delimiter.join(str(k) for k in loc[:depth]))
            if self.env_vars.get(name) is not None:
                return [self._spelt.get(name, name)]
        inside = self._normal(self.env_prefix + delimiter.join(str(k) for k in loc) + delimiter)
        return sorted(
            self._spelt.get(name, name)
            for name, value in self.env_vars.items()
            if value is not None and name.startswith(inside)
        )

    def _normal(self, name: str) -> str:
        return name if self.case_sensitive else name.lower()

    def _log_unknown(self) -> None:
        prefix = self._normal(self.env_prefix)
        settings = [self._normal(name) for name in self.settings_cls.model_fields]
        delimiter = self.env_nested_delimiter
        for name in sorted(self.env_vars):
            rest = name[len(prefix) :]
            if not name.startswith(prefix) or rest.upper() in NOT_SETTINGS:
                continue
            setting = rest.split(delimiter, 1)[0] if delimiter else rest
            if setting in settings:
                continue
            closest = difflib.get_close_matches(setting, settings, n=1)
            log.warning(
                "ignoring %s: no setting has that name%s",
                self._spelt.get(name, name),
                f" (did you mean {self.env_prefix}{closest[0].upper()}?)" if closest else "",
            )


class SettingsFileSource(YamlConfigSettingsSource):
    """The YAML settings file; unlike pydantic-settings' own, a missing one is an error."""

    def __init__(self, settings_cls: type[BaseSettings], path: Path) -> None:
        self.path = path
        if not path.expanduser().is_file():
            problem = "not a file" if path.expanduser().exists() else "no such file"
            raise ConfigError(f"{path}: cannot read settings file: {problem}")
        super().__init__(settings_cls, yaml_file=path)

    def _read_file(self, file_path: Any) -> dict[str, Any]:
        try:
            loaded: object = super()._read_file(file_path)
        except OSError as exc:
            raise ConfigError(f"{self.path}: cannot read settings file: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"{self.path}: not valid YAML: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"{self.path}: the settings file must be a mapping of keys to values")
        return loaded


class SettingsLoad:
    """One load of the settings: its file, and the sources made for it.

    The sources are kept so that a value failing validation, which happens
    after they have all been read and merged, can be traced back to one of them.
    """

    def __init__(self, file: Path | None) -> None:
        self.file = file
        self._arguments: Mapping[str, Any] = {}
        self._variables: VariablesSource | None = None
        self._file: SettingsFileSource | None = None

    def sources(
        self, settings_cls: type[BaseSettings], arguments: PydanticBaseSettingsSource
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Highest precedence first; pydantic-settings adds the defaults last."""
        self._arguments = arguments()
        self._variables = VariablesSource(settings_cls)
        self._file = SettingsFileSource(settings_cls, self.file) if self.file else None
        return (arguments, self._variables, *([self._file] if self._file else []))

    def origin(self, loc: Loc) -> str | None:
        """The variables or the file that set the value at ``loc`` (or the nearest
        mapping holding it); None when it was an argument or a default."""
        for depth in range(len(loc), 0, -1):
            where = loc[:depth]
            if _holds(self._arguments, where):
                return None
            if self._variables is not None and _holds(self._variables.values, where):
                return " or ".join(self._variables.variables(where))
            if self._file is not None and _holds(self._file.yaml_data, where):
                return str(self._file.path)
        return None

    def explain(self, error: ValidationError) -> ConfigError:
        """Every problem of ``error`` with its field path and where its value came from."""
        problems: list[str] = []
        for problem in error.errors():
            loc: Loc = tuple(problem["loc"])
            where = [self.origin(loc), ".".join(str(key) for key in loc)]
            problems.append(": ".join([*filter(None, where), problem["msg"]]))
        return ConfigError("invalid settings: " + "; ".join(problems))


# A Settings class picks its sources in a class method, which takes no argument
# of its own: the file of the load under way reaches it through this context
# (per thread and per task, so concurrent loads do not mix).
_LOADING: ContextVar[SettingsLoad | None] = ContextVar("spanvisor_settings_load", default=None)


@contextmanager
def loading(file: Path | None) -> Iterator[SettingsLoad]:
    """Within this block, settings are read with ``file`` as the settings file."""
    load = SettingsLoad(file)
    token = _LOADING.set(load)
    try:
        yield load
    finally:
        _LOADING.reset(token)


def current_load() -> SettingsLoad:
    """The load under way, or one without a settings file (``Settings()`` built directly)."""
    return _LOADING.get() or SettingsLoad(None)
