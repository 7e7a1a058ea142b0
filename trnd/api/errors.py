"""The OpenAI routes' own refusals: a 400 naming the param, and msgspec's decode errors as 400s with the
field's path. The error schema itself (APIError and its handlers) is every port's: trnd/http/errors.py."""

from __future__ import annotations

import re

import msgspec

from trnd.http.errors import APIError


def invalid(param: str, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# msgspec ends its messages with "- at `$.messages[0].content`"; the path (minus "$.") is the param.
_AT = re.compile(r"\s*- at `\$\.?([^`]*)`\s*$")
_MISSING = re.compile(r"missing required field `([^`]+)`")
_UNKNOWN = re.compile(r"unknown field `([^`]+)`")


def from_decode_error(e: msgspec.DecodeError) -> APIError:
    """A 400 for invalid JSON (param None) or a body of the wrong shape (param = the field's path)."""
    msg = str(e)
    if not isinstance(e, msgspec.ValidationError):
        return APIError(400, f"Invalid JSON body: {msg}", code="invalid_json")
    param = None
    m = _AT.search(msg)
    if m:
        param = m.group(1) or None
        msg = msg[:m.start()]
    missing = _MISSING.search(msg) or _UNKNOWN.search(msg)
    if missing:
        param = f"{param}.{missing.group(1)}" if param else missing.group(1)
    where = f" (at '{param}')" if param else ""
    return APIError(400, f"Invalid request body: {msg}{where}", param=param, code="invalid_value")
