"""What a caught exception says: its type as rules name it, its HTTP status, its server's delay.

Foreign exceptions are read defensively: a property that raises or a headers
object of an odd shape means "nothing here", never an error for the agent.
"""

from __future__ import annotations

import sys

from supervisor.retry_after import retry_after_from_headers


def exception_type_name(exc_type: type[BaseException]) -> str:
    """``module.QualName`` as classification rules expect it (``openai.RateLimitError``).

    As the OpenTelemetry SDK records it (builtins bare), except that a class
    living in a private submodule (``openai._exceptions``) is named after the
    shortest public package that re-exports it, or else after the public part
    of its module path.
    """
    qualname = exc_type.__qualname__
    module = exc_type.__module__ or ""
    if module in ("builtins", ""):
        return qualname
    parts = module.split(".")
    if not any(part.startswith("_") for part in parts[1:]):
        return f"{module}.{qualname}"
    for end in range(1, len(parts)):
        prefix = ".".join(parts[:end])
        if _resolve(sys.modules.get(prefix), qualname) is exc_type:
            return f"{prefix}.{qualname}"
    public: list[str] = []
    for part in parts:
        if part.startswith("_") and public:
            break
        public.append(part)
    return f"{'.'.join(public)}.{qualname}"


def _resolve(namespace: object, qualname: str) -> object:
    try:  # a module's lazy __getattr__ may import, and fail
        for name in qualname.split("."):
            if namespace is None:
                return None
            namespace = getattr(namespace, name, None)
    except Exception:
        return None
    return namespace


def status_of(exc: BaseException) -> int | None:
    """``exc.status_code`` (openai, anthropic) or ``exc.response.status_code`` (httpx, requests)."""
    for path in (("status_code",), ("response", "status_code")):
        value: object = exc
        try:  # properties of foreign exceptions may raise
            for name in path:
                value = getattr(value, name, None)
        except Exception:  # noqa: S112 - any failure means "no status here"
            continue
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
            return value
    return None


def retry_after_of(exc: BaseException) -> float | None:
    """The delay the headers of the exception's response ask for (``exc.response.headers``).

    Read as the sidecar reads captured headers from spans
    (:func:`supervisor.retry_after.retry_after_from_headers`).
    """
    try:
        headers = getattr(getattr(exc, "response", None), "headers", None)
        if headers is None:
            return None

        def values(name: str) -> list[str]:
            value = headers.get(name)
            return [value] if isinstance(value, str) else []

        return retry_after_from_headers(values)
    except Exception:  # an odd headers object: leave it to the message
        return None
