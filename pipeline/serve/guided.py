"""Structured output in request bodies: OpenAI's `response_format` and vLLM's extra fields
(`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, `structured_outputs`),
read into one `GuidedDecodingParams` (actors/guided.py). A bad schema or two of these fields
at once is a 400 naming the field."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from actors.guided import GuidedDecodingParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class JsonSchemaFormat(_Strict):
    """OpenAI's `response_format.json_schema`."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(description="The schema's name (OpenAI requires one; not used here).")
    description: str | None = Field(default=None, description="Accepted and ignored.")
    schema_: dict[str, Any] | None = Field(
        default=None, alias="schema", description="The JSON Schema the output must match."
    )
    strict: bool | None = Field(
        default=None,
        description="Accepted; the output always matches the schema here (constrained decoding).",
    )


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: plain text, any JSON object, or a JSON Schema."""

    type: Literal["text", "json_object", "json_schema"] = Field(description="The output's form.")
    json_schema: JsonSchemaFormat | None = Field(
        default=None, description="With type json_schema: the schema."
    )


class GuidedFields(_Strict):
    """The structured-output fields of completions and chat completions."""

    response_format: ResponseFormat | None = Field(
        default=None,
        description='{"type": "json_object"} or {"type": "json_schema", "json_schema": '
        '{"name": ..., "schema": {...}}}: the output is held to it.',
    )
    guided_json: dict[str, Any] | str | None = Field(
        default=None, description="vLLM extension: a JSON Schema the output must match."
    )
    guided_regex: str | None = Field(
        default=None, description="vLLM extension: a regular expression the output must match."
    )
    guided_choice: list[str] | None = Field(
        default=None, description="vLLM extension: the output is one of these strings."
    )
    guided_grammar: str | None = Field(
        default=None, description="vLLM extension: an EBNF grammar (root ::= ...) to match."
    )
    structured_outputs: dict[str, Any] | None = Field(
        default=None,
        description="vLLM extension: {json | regex | choice | grammar | json_object: ...}.",
    )

    def guided_decoding(self) -> tuple[GuidedDecodingParams | None, str | None]:
        """The params these fields ask for (None: none) and the field they came from;
        ValueError (with the field) when two are given or the grammar is invalid."""
        given: list[tuple[str, dict[str, Any]]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise GuidedFieldError(
                    "response_format", "response_format json_schema needs json_schema.schema"
                )
            given.append(("response_format", {"json": fmt.json_schema.schema_}))
        for name, key in (
            ("guided_json", "json"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "grammar"),
        ):
            if getattr(self, name) is not None:
                given.append((name, {key: getattr(self, name)}))
        if self.structured_outputs is not None:
            given.append(("structured_outputs", dict(self.structured_outputs)))
        if not given:
            return None, None
        if len(given) > 1:
            names = [name for name, _ in given]
            raise GuidedFieldError(names[1], f"give one structured-output field, got {names}")
        name, fields = given[0]
        try:
            return GuidedDecodingParams.coerce(fields), name
        except ValueError as exc:
            raise GuidedFieldError(name, str(exc)) from None


class GuidedFieldError(ValueError):
    """A structured-output field that cannot be used; `param` names it (the 400's param)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
