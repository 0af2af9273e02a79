"""How the server refuses a request: `BadRequest` (a status and the parameter to blame) and OpenAI's error
object, the one shape every endpoint answers an error in."""

from __future__ import annotations

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    500: "server_error",
    503: "server_error",
    504: "timeout_error",
}


class BadRequest(ValueError):
    """An invalid request: answered with `status` and an OpenAI-style error naming `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


def error_body(
    status: int, message: str, param: str | None = None, code: int | None = None
) -> dict[str, dict[str, str | int | None]]:
    """OpenAI's error object: `{"error": {"message", "type", "param", "code"}}`."""
    kind = _ERROR_TYPES.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def prompt_too_long(tokens: int, max_prompt_tokens: int) -> str:
    """The refusal of a prompt of `tokens` tokens, worded the same wherever it is measured."""
    return (
        f"prompt is {tokens} tokens but this server takes at most {max_prompt_tokens} "
        f"(its context of {max_prompt_tokens + 1} tokens must hold the prompt and one generated token)"
    )
