"""The OpenAI endpoints' structured-output fields, as `SamplingParams`' (`json_schema`, `regex`, `ebnf`,
`choice`, `json_object`): OpenAI's `response_format` and vLLM's `guided_json`, `guided_regex`,
`guided_grammar` and `guided_choice`. At most one of them; each is compiled here (xgrammar, without the
tokenizer), so one that cannot be is a 400 naming the request's own field before anything is queued."""

from __future__ import annotations

from typing import Any

from gapless.engine.grammar import check_structured
from gapless.sampling_params import SamplingParams

# request field -> SamplingParams field
GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_grammar": "ebnf",
    "guided_choice": "choice",
}
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


class StructuredError(ValueError):
    """A structured-output field that cannot be honoured; `param` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    """`response_format` as SamplingParams fields (none for text)."""
    kind = fmt.get("type")
    if kind not in RESPONSE_FORMATS:
        raise StructuredError(
            f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}, got {kind!r}",
            "response_format",
        )
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise StructuredError(
                "response_format.json_schema.schema is required: the JSON schema the output must follow",
                "response_format.json_schema",
            )
        return {"json_schema": spec["schema"]}
    return {}


def structured_fields(request: Any) -> tuple[dict[str, Any], str | None]:
    """The SamplingParams fields of `request`'s structured-output fields, and the request field they came
    from (None: no constraint); StructuredError if it gives more than one."""
    given = {name: getattr(request, name) for name in GUIDED if getattr(request, name) is not None}
    fmt = getattr(request, "response_format", None)
    fields = _response_format(fmt) if fmt else {}
    if fields:
        given["response_format"] = fmt
    if len(given) > 1:
        raise StructuredError(
            f"give at most one of response_format and guided_*; got {sorted(given)}", sorted(given)[1]
        )
    if not given:
        return {}, None
    source = next(iter(given))
    return (fields if source == "response_format" else {GUIDED[source]: given[source]}), source


def check_compiles(params: SamplingParams, field: str | None) -> None:
    """StructuredError naming `field` when `params`' constraint cannot be compiled."""
    if field is None:
        return
    try:
        check_structured(params, field)
    except ValueError as e:
        raise StructuredError(str(e), field) from None
