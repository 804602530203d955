"""Logging set-up: one JSON object per line on stderr, so log pipelines can parse it."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import orjson

#: Attributes every LogRecord has; anything else passed in ``extra`` is data.
_STANDARD = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """``{"ts": ..., "level": ..., "logger": ..., "msg": ..., **extra}`` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                payload[key] = value
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        try:
            # orjson: a failure's line (one per failure) costs a third of json's.
            return orjson.dumps(payload, default=str, option=orjson.OPT_NON_STR_KEYS).decode()
        except (TypeError, orjson.JSONEncodeError):  # e.g. an int over 64 bits
            return json.dumps(payload, default=str, ensure_ascii=False)


def configure_logging(level: str = "INFO") -> None:
    """Route the ``spanvisor`` loggers to stderr as JSON lines (idempotent)."""
    root = logging.getLogger("spanvisor")
    root.setLevel(level)
    if not any(getattr(h, "_spanvisor", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter())
        handler._spanvisor = True  # type: ignore[attr-defined]  # marks our handler
        root.addHandler(handler)
    root.propagate = False
