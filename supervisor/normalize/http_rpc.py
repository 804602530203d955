"""HTTP and RPC semantic conventions: status codes and the remote host.

Old and new names: ``http.response.status_code`` (semconv 1.21+) and
``http.status_code``; ``server.address`` and ``net.peer.name`` /
``http.host``, falling back to the host of ``url.full`` / ``http.url``;
``rpc.grpc.status_code`` (an int), ``rpc.response.status_code`` (the new
string name, e.g. ``"UNAVAILABLE"``) and ``rpc.status_code``. gRPC code names
are mapped to their numbers so rules match one spelling.

A span whose only convention is HTTP/RPC gets role ``http``; a client span
(any kind but SERVER) also gets the ``http:<host>`` dependency.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from supervisor.normalize.attributes import MAX_NAME_CHARS, Draft, as_int, as_str
from supervisor.records import GRPC_CODES, AttrValue, Role

__all__ = [
    "ERROR_TYPE",
    "GRPC_CODES",
    "HTTP_STATUS_KEYS",
    "RPC_STATUS_KEYS",
    "SPAN_KIND_SERVER",
    "extract",
    "grpc_code",
    "host_of_url",
    "identify",
]

#: OTLP SpanKind SERVER.
SPAN_KIND_SERVER: Final = 2


#: ``error.type`` (general semconv): present only when the operation failed.
ERROR_TYPE: Final = "error.type"
#: The response status, new name first; the first present is the one read.
HTTP_STATUS_KEYS: Final[tuple[str, ...]] = ("http.response.status_code", "http.status_code")
RPC_STATUS_KEYS: Final[tuple[str, ...]] = (
    "rpc.grpc.status_code",
    "rpc.response.status_code",
    "rpc.status_code",
)
_HOST_KEYS: Final[tuple[str, ...]] = ("server.address", "net.peer.name", "http.host")
_URL_KEYS: Final[tuple[str, ...]] = ("url.full", "http.url")
_MARKERS: Final = frozenset(
    {
        "http.request.method",
        "http.method",
        "http.response.status_code",
        "http.status_code",
        "url.full",
        "http.url",
        "rpc.system",
    }
)


_MARKER_ORDER: Final = tuple(sorted(_MARKERS))


def grpc_code(value: object) -> int | None:
    """A gRPC status as its number, from an int, a digit string or a name.

    Accepts ``14``, ``"14"``, ``"UNAVAILABLE"``, ``"unavailable"`` and
    ``"StatusCode.UNAVAILABLE"``; anything else (or out of 0..16) is ``None``.
    """
    code = as_int(value)
    if code is None and isinstance(value, str) and len(value) <= 64:
        name = value.strip().upper()
        if name.startswith("STATUSCODE."):
            name = name[len("STATUSCODE.") :]
        code = GRPC_CODES.get(name)
    if code is None or not 0 <= code <= 16:
        return None
    return code


def host_of_url(url: str) -> str:
    """The host of an absolute URL (no port, no userinfo), lower-cased; ``""`` if none."""
    start = url.find("://")
    if start < 0:
        return ""
    rest = url[start + 3 : start + 3 + 2 * MAX_NAME_CHARS]
    for sep in "/?#":
        cut = rest.find(sep)
        if cut >= 0:
            rest = rest[:cut]
    rest = rest.rpartition("@")[2]
    if rest.startswith("["):
        end = rest.find("]")
        host = rest[1:end] if end > 0 else rest[1:]
    else:
        host = rest.partition(":")[0]
    return host[:MAX_NAME_CHARS].lower()


def identify(draft: Draft, span_kind: int) -> None:
    """Role ``http`` for a span no other convention claimed, and the host it called."""
    if draft.role is not None:
        return
    a = draft.attrs.values
    is_rpc = "rpc.system" in a or "rpc.grpc.status_code" in a or "rpc.response.status_code" in a
    has_status = "http.response.status_code" in a or "http.status_code" in a
    if not is_rpc and not has_status and not _is_http(a):
        return
    draft.role = Role.HTTP
    if span_kind != SPAN_KIND_SERVER:
        draft.host = _host(a) or (as_str(a.get("rpc.service")) if is_rpc else "")


def extract(draft: Draft) -> None:
    """Read HTTP/RPC status codes for every span."""
    a = draft.attrs.values
    status = a.get(HTTP_STATUS_KEYS[0])
    if status is None:
        status = a.get(HTTP_STATUS_KEYS[1])
    if status is not None:
        draft.http_status = as_int(status)
        draft.conventions.append("http")
    is_rpc = "rpc.system" in a or "rpc.grpc.status_code" in a or "rpc.response.status_code" in a
    if is_rpc:
        draft.conventions.append("rpc")
        draft.grpc_code = _grpc(a)
    elif status is None and draft.role is Role.HTTP:
        draft.conventions.append("http")  # named by its method or URL only


def _grpc(a: Mapping[str, AttrValue]) -> int | None:
    for key in RPC_STATUS_KEYS:
        value = a.get(key)
        if value is not None:
            code = grpc_code(value)
            if code is not None:
                return code
    return None


def _is_http(a: Mapping[str, AttrValue]) -> bool:
    # Lookups, not a pass over the keys: dependency_of memoizes by the keys read.
    return any(marker in a for marker in _MARKER_ORDER)


def _host(a: Mapping[str, AttrValue]) -> str:
    for key in _HOST_KEYS:
        host = as_str(a.get(key))
        if host:
            return host.lower()
    for key in _URL_KEYS:
        url = a.get(key)
        if isinstance(url, str):
            host = host_of_url(url)
            if host:
                return host
    return ""
