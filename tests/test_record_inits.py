"""Records whose ``__init__`` is written out (see ``supervisor.records``) match their fields.

A field added to such a class, reordered, or given another default, without
the same change to its ``__init__``, fails here: the written-out ``__init__``
must take exactly the fields, in order, with the dataclass's defaults.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from policies._breakers import BreakerInfo
from supervisor.ingest.queue import Batch
from supervisor.pipeline import Outcome
from supervisor.records import Classification, Command, Decision, ErrorEvidence, Failure

WRITTEN_OUT: list[type[Any]] = [
    ErrorEvidence,
    Classification,
    Failure,
    Decision,
    Command,
    Outcome,
    BreakerInfo,
    Batch,
]


class _Marker:
    """A value no default equals, one per field."""

    def __init__(self, name: str) -> None:
        self.name = name


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    assert field.default_factory is not dataclasses.MISSING, field.name
    return field.default_factory()


@pytest.mark.parametrize("cls", WRITTEN_OUT, ids=lambda cls: cls.__name__)
def test_init_is_written_out(cls: type[Any]) -> None:
    assert "__init__" in vars(cls)


@pytest.mark.parametrize("cls", WRITTEN_OUT, ids=lambda cls: cls.__name__)
def test_every_field_in_order(cls: type[Any]) -> None:
    fields = dataclasses.fields(cls)
    markers = [_Marker(f.name) for f in fields]

    by_position = cls(*markers)
    by_keyword = cls(**{f.name: m for f, m in zip(fields, markers, strict=True)})

    for field, marker in zip(fields, markers, strict=True):
        assert getattr(by_position, field.name) is marker, field.name
        assert getattr(by_keyword, field.name) is marker, field.name
    with pytest.raises(TypeError):
        cls(*markers, _Marker("one too many"))


@pytest.mark.parametrize("cls", WRITTEN_OUT, ids=lambda cls: cls.__name__)
def test_defaults_are_the_fields(cls: type[Any]) -> None:
    fields = dataclasses.fields(cls)
    required = [
        f
        for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    record = cls(*[_Marker(f.name) for f in required])

    for field in fields[len(required) :]:
        assert getattr(record, field.name) == _default(field), field.name
    if required:
        with pytest.raises(TypeError):
            cls(*[_Marker(f.name) for f in required[:-1]])


@pytest.mark.parametrize("cls", WRITTEN_OUT, ids=lambda cls: cls.__name__)
def test_still_frozen(cls: type[Any]) -> None:
    fields = dataclasses.fields(cls)
    record = cls(*[_Marker(f.name) for f in fields])

    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(record, fields[0].name, "changed")
    assert dataclasses.replace(record, **{fields[0].name: "changed"}) != record
