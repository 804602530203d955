"""A console form's fields, read from its URL-encoded body (bounded).

The console's forms are small: a token, a note, a CSRF token. Reading them
here keeps python-multipart out of the dependencies (Starlette's form parser
needs it), and a body past :data:`MAX_FORM_BYTES` is refused, not read.
"""

from __future__ import annotations

from urllib.parse import parse_qs

from starlette.requests import Request

__all__ = ["MAX_FORM_BYTES", "FormTooLarge", "read_form"]

#: A note of 2,000 characters, URL-encoded, with room to spare.
MAX_FORM_BYTES = 32 * 1024


class FormTooLarge(Exception):
    """A form's body past :data:`MAX_FORM_BYTES` (answered 413)."""


async def read_form(request: Request) -> dict[str, str]:
    """The form's fields, the first value of each; a body that is not a form gives none."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        return {}
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise FormTooLarge
    try:
        fields = parse_qs(
            body.decode("utf-8", "replace"), keep_blank_values=True, max_num_fields=32
        )
    except ValueError:  # more fields than any console form has
        return {}
    return {name: values[0] for name, values in fields.items() if values}
