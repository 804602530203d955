"""The screens' contract, checked on any encoded request (see ``test_normalize_screen``)."""

from __future__ import annotations

from supervisor.normalize import may_fail_quietly, normalize_wire, shows_failure_signal, wire_spans


def assert_screened(payload: bytes) -> None:
    """Every span of ``payload`` that normalizes to a failure passes a screen."""
    for item in wire_spans(payload):
        record = normalize_wire(item)
        if record.error is not None:
            assert shows_failure_signal(item) or may_fail_quietly(item), (
                f"span {record.name!r} fails ({record.error}) but no screen passes it: "
                f"{dict(record.attributes)}"
            )
