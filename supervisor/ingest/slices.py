"""Decode a large protobuf message in slices, so one request never holds the GIL for long.

protobuf's C parser holds the GIL for a whole ``ParseFromString``: a 20 MB
request decoded in a worker thread still stops the event loop for the
quarter of a second it takes. Protobuf's encoding is a concatenation of
fields, and merging a run of whole fields into a message is the same as
parsing them with the rest (repeated fields append, in order). So the
payload is walked field by field and merged a slice of at most
``slice_bytes`` at a time; a repeated message field longer than a slice
(a ``ResourceSpans`` holding 100,000 spans) is descended into the same way.
Between slices the thread runs Python again, where the interpreter hands the
GIL to the event loop when it waits for it.

The result is the message a single parse gives. Anything the walk does not
understand (a group, a truncated field) raises :class:`Unsliceable`; the
caller then parses the whole payload in one go, which reports the error as
it always did.
"""

from __future__ import annotations

from typing import Any, Final

from google.protobuf.descriptor import FieldDescriptor

__all__ = ["SLICE_BYTES", "Unsliceable", "merge_in_slices"]

#: About a millisecond of C parsing.
SLICE_BYTES: Final = 256 * 1024

_LEN: Final = 2


class Unsliceable(ValueError):
    """The payload cannot be walked field by field; parse it whole instead."""


def merge_in_slices(message: Any, payload: bytes, slice_bytes: int = SLICE_BYTES) -> None:
    """Merge ``payload`` into ``message`` a slice of whole fields at a time.

    Raises :class:`Unsliceable` for a payload the walk cannot follow, and
    protobuf's ``DecodeError`` for a slice the parser refuses.
    """
    _merge(message, memoryview(payload), 0, len(payload), slice_bytes)


def _merge(message: Any, view: memoryview, start: int, end: int, slice_bytes: int) -> None:
    fields = message.DESCRIPTOR.fields_by_number
    pending = start  # where the run of fields not yet merged begins
    pos = start
    while pos < end:
        field_at = pos
        key, pos = _varint(view, pos, end)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = _varint(view, pos, end)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == _LEN:
            size, pos = _varint(view, pos, end)
            if size > slice_bytes and _is_repeated_message(fields.get(number)):
                if pending < field_at:
                    message.MergeFromString(view[pending:field_at])
                child = getattr(message, fields[number].name).add()
                _merge(child, view, pos, pos + size, slice_bytes)
                pos += size
                pending = pos
                continue
            pos += size
        else:
            raise Unsliceable(f"wire type {wire} at byte {field_at}")
        if pos > end:
            raise Unsliceable(f"field at byte {field_at} runs past its message")
        if pos - pending >= slice_bytes:
            message.MergeFromString(view[pending:pos])
            pending = pos
    if pending < end:
        message.MergeFromString(view[pending:end])


def _is_repeated_message(field: FieldDescriptor | None) -> bool:
    if field is None or field.message_type is None:
        return False
    if field.message_type.GetOptions().map_entry:  # a map: no add(), merged whole
        return False
    repeated = getattr(field, "is_repeated", None)
    if repeated is None:  # protobuf < 6
        return bool(getattr(field, "label", None) == FieldDescriptor.LABEL_REPEATED)
    return bool(repeated)


def _varint(view: memoryview, pos: int, end: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while pos < end and shift < 64:
        byte = view[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
    raise Unsliceable(f"truncated or overlong varint before byte {pos}")
