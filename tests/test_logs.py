"""Log lines are one JSON object each, whatever span content a failure carries."""

from __future__ import annotations

import json
import logging

from supervisor.logs import JsonFormatter


def _line(**extra: object) -> dict[str, object]:
    record = logging.LogRecord(
        "spanvisor.failures", logging.INFO, __file__, 1, "msg %s", ("x",), None
    )
    for key, value in extra.items():
        setattr(record, key, value)
    text = JsonFormatter().format(record)
    assert "\n" not in text
    parsed = json.loads(text)
    assert isinstance(parsed, dict)
    return parsed


def test_a_line_carries_the_message_and_the_extras() -> None:
    line = _line(event="failure", failure={"message": "é \u2028 \x00", "params": {"delay_s": 1.5}})
    assert line["level"] == "info" and line["logger"] == "spanvisor.failures"
    assert line["msg"] == "msg x"
    assert line["failure"] == {"message": "é \u2028 \x00", "params": {"delay_s": 1.5}}


def test_values_json_cannot_hold_are_written_as_text() -> None:
    line = _line(failure={3: object(), "set": {1}})
    failure = line["failure"]
    assert isinstance(failure, dict)
    assert failure["3"].startswith("<object object")
    assert failure["set"] == "{1}"


def test_integers_over_64_bits_are_kept() -> None:
    assert _line(failure={"n": 2**70})["failure"] == {"n": 2**70}
