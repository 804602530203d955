"""Records whose ``__init__`` is written out (see ``supervisor.records``) match their fields.

A field added to such a class, reordered, or given another default, without
the same change to its ``__init__``, fails here: the written-out ``__init__``
must take exactly the fields, in order, with the dataclass's defaults.

Compiled, such an ``__init__`` checks the type of each argument, so the
values below have the fields' types; each differs from its field's default,
and neighbours of one type differ from each other, so a swap shows.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from policies._breakers import BreakerInfo, BreakerState
from supervisor.ingest.queue import Batch
from supervisor.pipeline import Outcome
from supervisor.records import (
    Action,
    Classification,
    Command,
    CommandType,
    Decision,
    ErrorEvidence,
    Failure,
    FailureClass,
    Role,
)

_EVIDENCE = ErrorEvidence(
    True, "status", "ValueError", "boom", "timeout", 503, 14, "overloaded_error",
    ("length",), True, 2.5, ("not_offered",),
)  # fmt: skip
_FAILURE = Failure(
    "trace", "span", "parent", "svc", "name", "run", Role.TOOL, FailureClass.PERMANENT,
    "kind", "dep", "rule", "message", _EVIDENCE, 123, ("ancestor",), {"repeats": 3}, True,
)  # fmt: skip
_DECISION = Decision(Action.FALLBACK, "entry", {"chain": ("b",)}, "why", True)

#: Each class with a written-out ``__init__``, and one value per field, in order.
SAMPLES: dict[type[Any], tuple[object, ...]] = {
    ErrorEvidence: tuple(getattr(_EVIDENCE, f.name) for f in dataclasses.fields(ErrorEvidence)),
    Classification: (FailureClass.MODEL, "kind", "dep", "rule"),
    Failure: tuple(getattr(_FAILURE, f.name) for f in dataclasses.fields(Failure)),
    Decision: (Action.FALLBACK, "entry", {"chain": ("b",)}, "why", True),
    Command: (
        "cmd_1",
        "key",
        CommandType.REWIND_RUN,
        "svc",
        "run",
        "trace",
        "span",
        {"kind": "loop"},
        {"steps_back": 2},
        10.5,
        9.5,
    ),
    Outcome: (_FAILURE, _DECISION),
    BreakerInfo: ("dep", BreakerState.OPEN, 3, 1.5, 31.5),
    Batch: (ExportTraceServiceRequest(), b"raw", 5, "http/json", 7),
}


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    assert field.default_factory is not dataclasses.MISSING, field.name
    return field.default_factory()


def _required(cls: type[Any]) -> int:
    return sum(
        f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        for f in dataclasses.fields(cls)
    )


@pytest.mark.parametrize("cls", SAMPLES, ids=lambda cls: cls.__name__)
def test_init_is_written_out(cls: type[Any]) -> None:
    # dataclass generates its __init__ from source text it compiles as "<string>";
    # a written-out one is the module's own (compiled: a native slot, with no code object).
    code = getattr(cls.__init__, "__code__", None)
    assert code is None or code.co_filename != "<string>"


@pytest.mark.parametrize("cls", SAMPLES, ids=lambda cls: cls.__name__)
def test_the_samples_tell_fields_apart(cls: type[Any]) -> None:
    fields = dataclasses.fields(cls)
    values = SAMPLES[cls]

    assert len(values) == len(fields)
    for field, value in zip(fields[_required(cls) :], values[_required(cls) :], strict=True):
        assert value != _default(field), field.name
    for a, b in itertools.pairwise(values):
        assert type(a) is not type(b) or a != b


@pytest.mark.parametrize("cls", SAMPLES, ids=lambda cls: cls.__name__)
def test_every_field_in_order(cls: type[Any]) -> None:
    fields = dataclasses.fields(cls)
    values = SAMPLES[cls]

    by_position = cls(*values)
    by_keyword = cls(**{f.name: v for f, v in zip(fields, values, strict=True)})

    for field, value in zip(fields, values, strict=True):
        assert getattr(by_position, field.name) == value, field.name
        assert getattr(by_keyword, field.name) == value, field.name
    with pytest.raises(TypeError):
        cls(*values, values[-1])


@pytest.mark.parametrize("cls", SAMPLES, ids=lambda cls: cls.__name__)
def test_defaults_are_the_fields(cls: type[Any]) -> None:
    fields = dataclasses.fields(cls)
    required = _required(cls)
    record = cls(*SAMPLES[cls][:required])

    for field in fields[required:]:
        assert getattr(record, field.name) == _default(field), field.name
    if required:
        with pytest.raises(TypeError):
            cls(*SAMPLES[cls][: required - 1])


@pytest.mark.parametrize("cls", SAMPLES, ids=lambda cls: cls.__name__)
def test_still_frozen(cls: type[Any]) -> None:
    record = cls(*SAMPLES[cls])
    first = dataclasses.fields(cls)[0].name

    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(record, first, SAMPLES[cls][1])
    assert dataclasses.replace(record) == record
