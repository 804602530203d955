"""How a client finds the sidecar's control API and its token, and says where each came from.

One rule for every client: the operator verbs of the CLI,
:class:`~supervisor.client.SupervisorClient` (and so ``guard()``) and
:class:`~supervisor.client.pull.CommandPuller` (and so the LangGraph adapter)
all call :func:`resolve_access`. Unless told otherwise, a client looks where
``spanvisor run`` started with the same environment and settings file listens.

The address, the first that is set:

1. given: ``--api URL`` (CLI), ``base_url=`` (client);
2. ``SPANVISOR_API_URL``;
3. the sidecar's own ``api_host`` and ``api_port``, key by key as the sidecar
   reads them: ``SPANVISOR_API_HOST`` / ``SPANVISOR_API_PORT``, else the
   settings file's (a host of ``0.0.0.0`` or ``::`` is reached on loopback);
4. ``http://127.0.0.1:4320``.

The token, the first that is set:

1. given: ``--token`` (CLI), ``token=`` (client);
2. ``SPANVISOR_API_TOKEN``;
3. ``api_token`` in the settings file;
4. the token file the sidecar writes at start when it has no ``api_token``:
   ``SPANVISOR_TOKEN_FILE``, else ``token_file`` in the settings file, else
   ``~/.spanvisor/api-token``.

The settings file is ``--config FILE`` (CLI), else ``SPANVISOR_CONFIG``; only
those four keys are read from it (the sidecar validates the rest).

Standard library only, but for PyYAML, imported when a settings file is named:
the agent-side client imports this module.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final
from urllib.parse import urlsplit

from supervisor.addresses import (
    API_PORT_ENV,
    DEFAULT_API_PORT,
    LOOPBACK,
    api_url,
    default_token_file,
)
from supervisor.errors import ConfigError

__all__ = [
    "API_HOST_ENV",
    "API_URL_ENV",
    "CLI",
    "CLIENT",
    "CONFIG_ENV",
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "ApiAccess",
    "Names",
    "resolve_access",
]

#: A full URL of the control API, for clients only (the sidecar binds api_host/api_port).
API_URL_ENV: Final = "SPANVISOR_API_URL"
#: The sidecar's ``api_host`` setting; clients read it too.
API_HOST_ENV: Final = "SPANVISOR_API_HOST"
#: The sidecar's ``api_token`` setting; clients send it.
TOKEN_ENV: Final = "SPANVISOR_API_TOKEN"  # noqa: S105 - the name of a variable
#: The sidecar's ``token_file`` setting; clients read the token there.
TOKEN_FILE_ENV: Final = "SPANVISOR_TOKEN_FILE"  # noqa: S105 - the name of a variable
#: The settings file, for ``spanvisor run`` and its clients alike (``--config`` wins).
CONFIG_ENV: Final = "SPANVISOR_CONFIG"

#: Addresses a sidecar binds to that a client reaches on loopback.
_ANY_ADDRESS: Final = {"": LOOPBACK, "0.0.0.0": LOOPBACK, "::": "::1"}  # noqa: S104


@dataclass(frozen=True, slots=True)
class Names:
    """How the caller's own arguments are called, for messages that name them."""

    api: str
    token: str
    config: str


#: The CLI's flags.
CLI: Final = Names(api="--api", token="--token", config="--config")  # noqa: S106 - a flag's name
#: The client classes' arguments (they take no settings file: SPANVISOR_CONFIG names it).
CLIENT: Final = Names(api="base_url=", token="token=", config="")  # noqa: S106 - an argument


@dataclass(frozen=True, slots=True)
class ApiAccess:
    """The control API's URL and the token to show it, each with where it came from."""

    url: str
    #: Where the URL came from, e.g. ``from SPANVISOR_API_URL`` or ``port from SPANVISOR_API_PORT``.
    url_from: str
    token: str | None
    #: Where the token came from, e.g. ``from --token`` or ``from the token file /x``; "" if none.
    token_from: str
    #: The token file read, or looked for in vain; None when the token came from elsewhere.
    token_file: Path | None
    #: What named that file: ``SPANVISOR_TOKEN_FILE``, the settings file, or the default.
    token_file_from: str
    #: Why the token file gave no token ("No such file or directory", "empty"); "" if it did.
    token_problem: str
    names: Names

    @property
    def sidecar(self) -> str:
        """``the sidecar at URL (where the URL came from)``."""
        return f"the sidecar at {self.url} ({self.url_from})"

    def unreachable(self, why: str) -> str:
        """Nobody answered at the URL: which one, how it was chosen, how to choose another."""
        return (
            f"cannot reach the control API at {self.url} ({self.url_from}): {why}. "
            f"Is the sidecar running there? Name its address with {self._address_knobs()}"
        )

    def refused(self, status: int, detail: str) -> str:
        """The sidecar answered 401/403: which sidecar, which token, what to check."""
        said = f"{status}: {detail}" if detail else str(status)
        if self.token is None:
            return f"{self.sidecar} answered {said}: no API token was sent: {self._none_found()}"
        advice = f"pass the right one with {self._token_knobs()}"
        if self.token_file is not None:
            advice = (
                "a sidecar writes a new token there at every start unless api_token is set, so"
                " it may be another sidecar's file or an earlier start's token: check that its"
                f" token_file is {self.token_file}, or {advice}"
            )
        return f"{self.sidecar} refused the API token {self.token_from} ({said}): {advice}"

    def missing_token(self) -> str:
        """No token anywhere: where it was looked for, and how to give one."""
        return f"no API token for {self.sidecar}: {self._none_found()}"

    def _none_found(self) -> str:
        looked = (
            f"the token file {self.token_file} ({self.token_file_from}) gave none:"
            f" {self.token_problem}"
            if self.token_file is not None
            else f"no token file was found: {self.token_problem}"
        )
        return (
            f"{looked}; the sidecar writes its token there at start unless api_token is set."
            f" Give one with {self._token_knobs()}"
        )

    def _address_knobs(self) -> str:
        given = f"{self.names.api} URL, " if self.names.api else ""
        return f"{given}{API_URL_ENV}, or api_host/api_port in {self._settings_file()}"

    def _token_knobs(self) -> str:
        given = f"{self.names.token}, " if self.names.token else ""
        return f"{given}{TOKEN_ENV}, or {TOKEN_FILE_ENV} naming the sidecar's token file"

    def _settings_file(self) -> str:
        named = f"{self.names.config} FILE or {CONFIG_ENV}" if self.names.config else CONFIG_ENV
        return f"the settings file ({named})"


def resolve_access(
    api: str | None = None,
    token: str | None = None,
    *,
    config: str | os.PathLike[str] | None = None,
    names: Names = CLI,
    environ: Mapping[str, str] | None = None,
) -> ApiAccess:
    """Where the control API is and the token it takes, by the rule of this module's docstring.

    ``api`` and ``token`` are the caller's own (a flag, an argument), None when
    not given. Raises :class:`ConfigError` naming the variable or the file for
    a value that cannot be used (a port that is no number, an unreadable
    settings file); a token file that cannot be read is no error, only no token.
    """
    env = os.environ if environ is None else environ
    settings = _SettingsFile.named(config, names, env)
    url, url_from = _url(api, names, env, settings)
    found = _token(token, names, env, settings)
    return ApiAccess(url, url_from, *found, names)


@dataclass(frozen=True, slots=True)
class _SettingsFile:
    """The keys of a settings file a client reads, and how to name the file."""

    label: str
    values: Mapping[str, object]

    @classmethod
    def named(
        cls, config: str | os.PathLike[str] | None, names: Names, env: Mapping[str, str]
    ) -> _SettingsFile | None:
        if config is not None and str(config):
            path, by = Path(config), names.config or "config="
        elif env.get(CONFIG_ENV, "").strip():
            path, by = Path(env[CONFIG_ENV].strip()), CONFIG_ENV
        else:
            return None
        label = f"the settings file {path} ({by})"
        try:
            text = path.expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            why = getattr(exc, "strerror", None) or str(exc)
            raise ConfigError(f"{label}: cannot read it: {why}") from None
        import yaml  # only when a settings file is named: the agent's client rarely does

        try:
            loaded: object = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{label}: not valid YAML: {exc}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{label}: must be a mapping of keys to values")
        return cls(label, loaded)

    def get(self, key: str) -> object:
        return self.values.get(key)


def _url(
    given: str | None, names: Names, env: Mapping[str, str], settings: _SettingsFile | None
) -> tuple[str, str]:
    if given:
        return _checked_url(given, names.api), f"from {names.api}"
    if env.get(API_URL_ENV, "").strip():
        return _checked_url(env[API_URL_ENV].strip(), API_URL_ENV), f"from {API_URL_ENV}"
    host, host_from = _setting("api_host", API_HOST_ENV, env, settings)
    port, port_from = _setting("api_port", API_PORT_ENV, env, settings)
    if host is None and port is None:
        return api_url(), (
            f"the default address: no {names.api + ', ' if names.api else ''}{API_URL_ENV},"
            f" {API_HOST_ENV}, {API_PORT_ENV} or settings file names another"
        )
    number = _port(port, port_from) if port is not None else DEFAULT_API_PORT
    name = _host(host, host_from) if host is not None else LOOPBACK
    said = [
        f"{what} from {where}"
        for what, where in (("host", host_from), ("port", port_from))
        if where
    ]
    return api_url(number, name), ", ".join(said)


def _setting(
    key: str, variable: str, env: Mapping[str, str], settings: _SettingsFile | None
) -> tuple[object, str]:
    """A sidecar setting as the sidecar reads it: its variable, else the settings file."""
    if env.get(variable, "").strip():
        return env[variable].strip(), variable
    if settings is not None and settings.get(key) is not None:
        return settings.get(key), f"{key} in {settings.label}"
    return None, ""


def _checked_url(url: str, source: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{source}: {url!r} is not an http:// or https:// URL of the control API")
    try:
        parts.port  # noqa: B018 - raises for a port that is no number
    except ValueError:
        raise ConfigError(f"{source}: {url!r} has no valid port") from None
    return url.rstrip("/")


def _port(value: object, source: str) -> int:
    number: object = value
    if isinstance(value, str):
        try:
            number = int(value)
        except ValueError:
            number = None
    if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number <= 65535:
        raise ConfigError(f"{source}: {value!r} is not a port number (1 to 65535)")
    if number == 0:
        raise ConfigError(
            f"{source}: port 0 has the sidecar pick a free port, which a client cannot know:"
            f" name the address with {API_URL_ENV} (or --api)"
        )
    return number


def _host(value: object, source: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{source}: {value!r} is not a host name or address")
    host = _ANY_ADDRESS.get(value.strip(), value.strip())
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _token(
    given: str | None, names: Names, env: Mapping[str, str], settings: _SettingsFile | None
) -> tuple[str | None, str, Path | None, str, str]:
    """The token and where it came from; the token file read or looked for, what named
    it and why it gave no token."""
    if given:
        return given, f"given by {names.token}", None, "", ""
    if env.get(TOKEN_ENV, "").strip():
        return env[TOKEN_ENV].strip(), f"from {TOKEN_ENV}", None, "", ""
    if settings is not None and isinstance(settings.get("api_token"), str):
        value = str(settings.get("api_token")).strip()
        if value:
            return value, f"from api_token in {settings.label}", None, "", ""
    named, source = _setting("token_file", TOKEN_FILE_ENV, env, settings)
    source = source or "the default"
    try:
        path = Path(os.path.expanduser(str(named))) if named is not None else default_token_file()
    except RuntimeError:  # no home directory to find the default in
        return None, "", None, source, "no home directory for ~/.spanvisor/api-token"
    try:
        value = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        return None, "", path, source, exc.strerror or str(exc)
    except UnicodeDecodeError:
        return None, "", path, source, "not text"
    if not value:
        return None, "", path, source, "empty"
    return value, f"from the token file {path} ({source})", path, source, ""
