"""What the hot path reads before normalizing must agree with normalization.

Checked on any encoded request (see ``test_normalize_screen``): every span
that normalizes to a failure passes a screen, and :func:`dependency_of`
names the same dependency as the normalized record.
"""

from __future__ import annotations

from supervisor.normalize import (
    dependency_of,
    may_fail_quietly,
    normalize_wire,
    shows_failure_signal,
    wire_spans,
)


def assert_early_reads_agree(payload: bytes) -> None:
    for item in wire_spans(payload):
        record = normalize_wire(item)
        if record.error is not None:
            assert shows_failure_signal(item) or may_fail_quietly(item), (
                f"span {record.name!r} fails ({record.error}) but no screen passes it: "
                f"{dict(record.attributes)}"
            )
        assert dependency_of(item) == record.dependency, dict(record.attributes)
