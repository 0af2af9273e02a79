"""A request body read: msgspec decodes it straight into its struct (a refusal a `BadRequest`: 422 for
what is not JSON, 400 naming a wrong field), and the top-level fields gapless ignores are logged once."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TypeVar

import msgspec

from gapless.server.errors import BadRequest

log = logging.getLogger(__name__)
S = TypeVar("S", bound=msgspec.Struct)


def decode_body(body: bytes, kind: type[S]) -> S:
    """`body` decoded into `kind`, or BadRequest: 422 for what is not JSON, 400 naming a wrong field."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        message = str(e)
        param = message.rsplit("`$.", 1)[-1].rstrip("`") if "`$." in message else None
        raise BadRequest(message, param) from None
    except msgspec.DecodeError as e:
        raise BadRequest(f"request body is not valid JSON: {e}", None, status=422) from None
    except UnicodeDecodeError as e:
        raise BadRequest(f"request body is not valid UTF-8: {e}", None, status=422) from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply", None, status=422) from None


_IGNORED_LOGGED: set[tuple[str, str]] = set()  # (request type, field) pairs logged so far
_MAX_IGNORED_LOGGED = 256  # field names are the client's choice: remember (and log) only so many


def log_ignored_fields(body: bytes, kind: type[msgspec.Struct]) -> None:
    """Log, once per endpoint and name and at debug level, the top-level fields a request gave that
    gapless ignores (an OpenAI field it has no use for, or a misspelt one)."""
    if not log.isEnabledFor(logging.DEBUG) or len(_IGNORED_LOGGED) >= _MAX_IGNORED_LOGGED:
        return
    given: Iterable[str] = msgspec.json.decode(body, type=dict[str, msgspec.Raw]).keys()
    for name in sorted(set(given) - set(kind.__struct_fields__)):
        key = (kind.__name__, name)
        if key not in _IGNORED_LOGGED and len(_IGNORED_LOGGED) < _MAX_IGNORED_LOGGED:
            _IGNORED_LOGGED.add(key)
            log.debug("%s: ignoring the field %r, which gapless does not use", kind.__name__, name[:80])
