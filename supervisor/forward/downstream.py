"""Where forwarded spans and the sidecar's own spans go: one OTLP downstream.

A :class:`Downstream` is plain, validated data: the forwarder and the
decision tracer read it, the settings module builds it from its own fields,
and :func:`downstream_from_env` builds it from the standard
``OTEL_EXPORTER_OTLP_*`` variables exactly as the OpenTelemetry specification
defines them (signal-specific ``..._TRACES_...`` variables win over the
general ones; an empty variable counts as unset).

Deliberate choices, where the specification leaves room:

- the default protocol is ``http/protobuf``, the specification's default
  (the Python SDK alone defaults to ``grpc``);
- ``http/json`` is accepted but sent as ``http/protobuf`` with a warning:
  the forwarder relays the agent's protobuf bytes unchanged, and every OTLP/HTTP
  receiver must accept protobuf;
- a value that makes no sense (an unknown protocol or compression, a negative
  timeout, a boolean that is neither ``true`` nor ``false``, a malformed
  header list) raises :class:`~supervisor.errors.ConfigError` naming the
  variable, rather than being ignored with a warning: a sidecar that silently
  drops its configuration ships spans nowhere.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal
from urllib.parse import unquote, urlsplit

from supervisor.errors import ConfigError

log = logging.getLogger("spanvisor.downstream")

OtlpProtocol = Literal["grpc", "http/protobuf"]
Compression = Literal["none", "gzip"]

#: The OTLP/HTTP path for traces, appended to a base endpoint.
TRACES_PATH = "/v1/traces"
#: The specification's default export timeout (10 s).
DEFAULT_TIMEOUT_S = 10.0

_PROTOCOLS: frozenset[str] = frozenset({"grpc", "http/protobuf"})
_COMPRESSIONS: frozenset[str] = frozenset({"none", "gzip"})
# An HTTP token (RFC 9110): what a header name may contain.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# Control characters (CR, LF, NUL...) would let a value smuggle extra headers.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_UNSUPPORTED_TLS_VARS = (
    "CERTIFICATE",
    "CLIENT_KEY",
    "CLIENT_CERTIFICATE",
)


@dataclass(frozen=True)
class Downstream:
    """One OTLP endpoint and how to talk to it.

    ``endpoint`` is, for ``http/protobuf``, the URL that is POSTed to
    (``http://host:4318/v1/traces``); a URL with no path at all
    (``http://host:4318``) means the standard ``/v1/traces`` (see
    :attr:`http_url`). For ``grpc`` it is ``host:port`` or
    ``http(s)://host:port``; a scheme decides TLS (``https`` → TLS, ``http`` →
    plaintext), and only a bare ``host:port`` is governed by ``insecure``.
    Header names are compared case-insensitively and sent lowercase.
    """

    endpoint: str
    protocol: OtlpProtocol
    headers: tuple[tuple[str, str], ...] = ()
    timeout_s: float = DEFAULT_TIMEOUT_S
    insecure: bool = False
    compression: Compression = "none"

    def __post_init__(self) -> None:
        if self.protocol not in _PROTOCOLS:
            raise ConfigError(
                f"downstream protocol must be one of {sorted(_PROTOCOLS)}, got {self.protocol!r}"
            )
        if self.compression not in _COMPRESSIONS:
            raise ConfigError(
                f"downstream compression must be one of {sorted(_COMPRESSIONS)}, "
                f"got {self.compression!r}"
            )
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s)):
            raise ConfigError(
                f"downstream timeout_s must be a finite number, got {self.timeout_s!r}"
            )
        if self.timeout_s <= 0:
            raise ConfigError(f"downstream timeout_s must be > 0 seconds, got {self.timeout_s!r}")
        if not self.endpoint or self.endpoint != self.endpoint.strip():
            raise ConfigError(f"downstream endpoint must be a non-empty URL, got {self.endpoint!r}")
        for name, value in self.headers:
            _check_header(name, value, where="downstream headers")
        if self.protocol == "http/protobuf":
            _check_http_url(self.endpoint, where="downstream endpoint")
        else:
            _check_grpc_endpoint(self.endpoint, where="downstream endpoint")

    @property
    def http_url(self) -> str:
        """The URL an OTLP/HTTP export is POSTed to."""
        parts = urlsplit(self.endpoint)
        if parts.path == "":
            return parts._replace(path=TRACES_PATH).geturl()
        return self.endpoint

    @property
    def grpc_target(self) -> str:
        """``host:port`` for a gRPC channel (the scheme and any path removed)."""
        if "://" in self.endpoint:
            return urlsplit(self.endpoint).netloc
        return self.endpoint

    @property
    def grpc_insecure(self) -> bool:
        """Whether the gRPC channel is plaintext: the scheme decides, else ``insecure``."""
        if "://" in self.endpoint:
            return urlsplit(self.endpoint).scheme == "http"
        return self.insecure

    @property
    def header_dict(self) -> dict[str, str]:
        """The headers with lowercase names (later entries win)."""
        return {name.lower(): value for name, value in self.headers}


def downstream_from_env(environ: Mapping[str, str]) -> Downstream | None:
    """A downstream from the standard ``OTEL_EXPORTER_OTLP_*`` variables; None when unset.

    Only an endpoint (signal-specific or general) makes a downstream: the
    sidecar forwards nowhere unless told where. Raises ConfigError naming the
    variable for values that cannot be used.
    """
    env = _Env(environ)
    signal_endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    base_endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if signal_endpoint is None and base_endpoint is None:
        return None

    protocol_var, raw_protocol = env.pick("PROTOCOL")
    protocol = _parse_protocol(protocol_var, raw_protocol)

    if signal_endpoint is not None:
        endpoint_var, endpoint = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", signal_endpoint
    else:
        assert base_endpoint is not None
        endpoint_var, endpoint = "OTEL_EXPORTER_OTLP_ENDPOINT", base_endpoint

    insecure_var, raw_insecure = env.pick("INSECURE")
    insecure_flag = _parse_bool(insecure_var, raw_insecure)

    if protocol == "http/protobuf":
        _check_http_url(endpoint, where=endpoint_var, hint=True)
        if endpoint_var == "OTEL_EXPORTER_OTLP_ENDPOINT":
            endpoint = _append_traces_path(endpoint)
        elif urlsplit(endpoint).path == "":
            # The spec: a signal-specific URL is used as-is, and with no path
            # the root path is used. Spell the root out, so Downstream's
            # "no path means /v1/traces" convenience does not apply.
            endpoint = urlsplit(endpoint)._replace(path="/").geturl()
        insecure = urlsplit(endpoint).scheme == "http"
    else:
        _check_grpc_endpoint(endpoint, where=endpoint_var)
        if urlsplit(endpoint).path not in ("", "/") and "://" in endpoint:
            log.warning(
                "a gRPC endpoint has no path; ignoring it",
                extra={"variable": endpoint_var, "path": urlsplit(endpoint).path},
            )
        insecure = urlsplit(endpoint).scheme == "http" if "://" in endpoint else bool(insecure_flag)

    headers_var, raw_headers = env.pick("HEADERS")
    headers = _parse_headers(headers_var, raw_headers) if raw_headers is not None else ()

    timeout_var, raw_timeout = env.pick("TIMEOUT")
    timeout_s = _parse_timeout_ms(timeout_var, raw_timeout) if raw_timeout is not None else None

    compression_var, raw_compression = env.pick("COMPRESSION")
    compression = _parse_compression(compression_var, raw_compression)

    for suffix in _UNSUPPORTED_TLS_VARS:
        var, value = env.pick(suffix)
        if value is not None:
            log.warning(
                "custom TLS files are not supported for the downstream; "
                "the system trust store is used",
                extra={"variable": var},
            )

    return Downstream(
        endpoint=endpoint,
        protocol=protocol,
        headers=headers,
        timeout_s=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s,
        insecure=insecure,
        compression=compression,
    )


class _Env:
    """Reads ``OTEL_EXPORTER_OTLP_[TRACES_]X``: signal-specific first, empty = unset."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self._environ = environ

    def get(self, name: str) -> str | None:
        value = self._environ.get(name)
        if value is None:
            return None
        value = value.strip()
        return value or None

    def pick(self, suffix: str) -> tuple[str, str | None]:
        """(the variable that decided, its value) for ``suffix``, e.g. ``"PROTOCOL"``."""
        specific = f"OTEL_EXPORTER_OTLP_TRACES_{suffix}"
        value = self.get(specific)
        if value is not None:
            return specific, value
        general = f"OTEL_EXPORTER_OTLP_{suffix}"
        return general, self.get(general)


def _parse_protocol(var: str, raw: str | None) -> OtlpProtocol:
    if raw is None:
        return "http/protobuf"
    value = raw.lower()
    if value == "grpc":
        return "grpc"
    if value == "http/protobuf":
        return "http/protobuf"
    if value == "http/json":
        log.warning(
            "http/json is sent as http/protobuf: spans are forwarded as the protobuf "
            "bytes the agent sent, and every OTLP/HTTP receiver accepts protobuf",
            extra={"variable": var},
        )
        return "http/protobuf"
    raise ConfigError(f"{var}={raw!r}: the protocol must be grpc, http/protobuf or http/json")


def _parse_bool(var: str, raw: str | None) -> bool | None:
    if raw is None:
        return None
    value = raw.lower()
    if value == "true":
        return True
    if value == "false":
        return False
    raise ConfigError(f"{var}={raw!r}: must be true or false")


def _parse_timeout_ms(var: str, raw: str) -> float:
    try:
        millis = float(raw)
    except ValueError:
        raise ConfigError(f"{var}={raw!r}: must be a number of milliseconds") from None
    if not math.isfinite(millis) or millis <= 0:
        raise ConfigError(f"{var}={raw!r}: must be a positive number of milliseconds")
    return millis / 1000.0


def _parse_compression(var: str, raw: str | None) -> Compression:
    if raw is None:
        return "none"
    value = raw.lower()
    if value == "gzip":
        return "gzip"
    if value == "none":
        return "none"
    raise ConfigError(f"{var}={raw!r}: compression must be gzip or none")


def _parse_headers(var: str, raw: str) -> tuple[tuple[str, str], ...]:
    """``k=v,k2=v2`` (W3C baggage style), values percent-decoded, names lowercased.

    Errors name the member's position and header name but never echo the value:
    headers carry API keys.
    """
    headers: dict[str, str] = {}
    for position, raw_member in enumerate(raw.split(","), start=1):
        member = raw_member.strip(" \t")
        if not member:
            continue
        name, sep, value = member.partition("=")
        name = name.strip(" \t")
        if not sep:
            raise ConfigError(f"{var}: entry {position} is not name=value")
        if not _TOKEN.fullmatch(name):
            raise ConfigError(f"{var}: entry {position} has an invalid header name {name!r}")
        try:
            decoded = unquote(value.strip(" \t"), errors="strict")
        except UnicodeDecodeError:
            raise ConfigError(
                f"{var}: the value of header {name!r} is not valid percent-encoded UTF-8"
            ) from None
        if _CONTROL.search(decoded):
            raise ConfigError(f"{var}: the value of header {name!r} contains control characters")
        headers[name.lower()] = decoded
    return tuple(headers.items())


def _append_traces_path(base: str) -> str:
    """The spec's rule for a base endpoint: ``{base}/v1/traces``, one slash between."""
    parts = urlsplit(base)
    path = parts.path.rstrip("/") + TRACES_PATH
    return parts._replace(path=path).geturl()


def _check_http_url(url: str, *, where: str, hint: bool = False) -> None:
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises ValueError on a bad port
    except ValueError as exc:
        raise ConfigError(f"{where}={url!r}: not a valid URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        extra = " (or set the protocol to grpc)" if hint else ""
        raise ConfigError(
            f"{where}={url!r}: OTLP/HTTP needs an http:// or https:// URL with a host{extra}"
        )


def _check_grpc_endpoint(endpoint: str, *, where: str) -> None:
    if "://" in endpoint:
        try:
            parts = urlsplit(endpoint)
            _ = parts.port
        except ValueError as exc:
            raise ConfigError(f"{where}={endpoint!r}: not a valid URL ({exc})") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(
                f"{where}={endpoint!r}: a gRPC endpoint is host:port or http(s)://host:port"
            )
        return
    if any(ch in endpoint for ch in " /?#") or endpoint.startswith(":"):
        raise ConfigError(
            f"{where}={endpoint!r}: a gRPC endpoint is host:port or http(s)://host:port"
        )


def _check_header(name: object, value: object, *, where: str) -> None:
    if not isinstance(name, str) or not _TOKEN.fullmatch(name):
        raise ConfigError(f"{where}: invalid header name {name!r}")
    if not isinstance(value, str) or _CONTROL.search(value):
        raise ConfigError(
            f"{where}: the value of header {name!r} must be text without control characters"
        )
