"""What the span path reads before normalizing must agree with normalization.

Checked on any encoded request (see ``test_normalize_screen``): every span
that normalizes to a failure passes a screen, and the view's dependency
(memoized by the values the adapters read) is the one the adapters give
when asked afresh.
"""

from __future__ import annotations

from supervisor.normalize import may_fail_quietly, read_spans, shows_failure_signal
from supervisor.normalize.attributes import Draft
from supervisor.normalize.identity import dependency_and_tool, identify
from supervisor.normalize.span import Span
from supervisor.normalize.wire import LazyConverted
from supervisor.records import Role


def fresh_dependency(span: Span) -> str:
    """The dependency the adapters name for ``span``, with no memo."""
    draft = Draft(LazyConverted(span.attributes))
    identify(draft, span.present, span.kind)
    return dependency_and_tool(draft, draft.role or Role.OTHER, span.name)[1]


def assert_early_reads_agree(payload: bytes) -> None:
    for item in read_spans(payload):
        record = item.record()
        if record.error is not None:
            assert shows_failure_signal(item) or may_fail_quietly(item), (
                f"span {record.name!r} fails ({record.error}) but no screen passes it: "
                f"{dict(record.attributes)}"
            )
        assert item.dependency == fresh_dependency(item) == record.dependency, dict(
            record.attributes
        )
