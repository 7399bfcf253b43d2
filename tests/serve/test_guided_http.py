"""Structured output over HTTP: OpenAI's `response_format` (json_schema, json_object) and
vLLM's `guided_*` / `structured_outputs` fields hold what the served model writes; every
schema answer parses and validates; a bad schema or two such fields is a 400 naming it."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import requests

from tests.actors.test_guided import SCHEMA
from tests.serve.conftest import MODEL, Live

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
QUESTIONS = ["Which animal is it?", "Rate the film.", "Is the sky green?", "Label: meow."]


def post(live: Live, path: str, **fields) -> requests.Response:  # noqa: ANN003
    return requests.post(live.url(path), json={"model": MODEL, **fields}, timeout=120)


def chat(live: Live, question: str, **fields) -> dict:  # noqa: ANN003
    messages = [{"role": "user", "content": question}]
    answer = post(live, "/v1/chat/completions", messages=messages, max_tokens=64, **fields)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]


def complete(live: Live, **fields) -> dict:  # noqa: ANN003
    answer = post(live, "/v1/completions", prompt=QUESTIONS[0], max_tokens=64, **fields)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]


def test_response_format_json_schema_validates_on_every_answer(live: Live) -> None:
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "label", "schema": SCHEMA, "strict": True},
    }
    for question in QUESTIONS:
        for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 11}):
            choice = chat(live, question, response_format=response_format, **sampling)
            assert choice["finish_reason"] == "stop", choice
            jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_vllm_fields_hold_the_output_and_the_constraint_acts(live: Live) -> None:
    labels = ["positive", "negative"]
    free = complete(live, temperature=0)["text"]
    assert free not in labels  # unconstrained, the tiny model writes something else
    assert complete(live, temperature=0, guided_choice=labels)["text"] in labels
    text = complete(live, temperature=1.0, seed=5, guided_regex="[a-z]{3}-[0-9]{2}")["text"]
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", text), text
    value = json.loads(complete(live, temperature=0, guided_json=SCHEMA)["text"])
    jsonschema.validate(value, SCHEMA)
    grammar = 'root ::= "yes" | "no"'
    assert complete(live, temperature=0, structured_outputs={"grammar": grammar})["text"] in (
        "yes",
        "no",
    )
    messages = [{"role": "user", "content": QUESTIONS[1]}]
    stream = post(
        live, "/v1/chat/completions", messages=messages, stream=True, guided_choice=labels
    )
    deltas = [
        json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        for line in stream.text.splitlines()
        if line.startswith("data: {")
    ]
    assert "".join(deltas) in labels


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"guided_json": {"type": "nonsense"}}, "guided_json"),
        ({"guided_regex": "[a-z"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"structured_outputs": {"json_schema": {}}}, "structured_outputs"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": 3}},
                }
            },
            "response_format",
        ),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ],
)
def test_bad_structured_output_is_a_400_naming_the_field(live: Live, fields, param) -> None:  # noqa: ANN001
    messages = [{"role": "user", "content": "hi"}]
    answer = post(live, "/v1/chat/completions", messages=messages, **fields)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param, answer.text
