"""Template format specs (issue 31 item 5): a field inside a field's spec is a column the
template uses (checked like any other), and whatever one row's values make `format` raise is
that row's error, never a crashed job."""

from __future__ import annotations

import pyarrow as pa
import pytest

from actors.config import SamplingParams
from pipeline.config import PromptConfig
from pipeline.stages import stage
from pipeline.stages.prompts import MAX_FORMAT_WIDTH, PromptBuilder, RowError
from pipeline.stages.tokenize import TokenizeStage
from tests.tiny_tokenizers import tiny_tokenizer


def test_fields_inside_format_specs_are_template_fields():
    assert PromptConfig(template="{prompt:>{n}}").template_fields == ("prompt", "n")
    assert PromptConfig(template="{a:{w}.{p}} {b!r:^{w}}").template_fields == ("a", "w", "p", "b")
    for bad, message in (
        ("{a!x}", "conversion must be"),
        ("{a:{0}}", "column names"),
        ("{a:{b:{c}}}", "nest one level"),
    ):
        with pytest.raises(ValueError, match=message):
            PromptConfig(template=bad)


@pytest.mark.parametrize(
    ("template", "row", "message"),
    [
        ("{prompt:d}", {"prompt": "text"}, "Unknown format code 'd'"),
        ("{prompt:>{n}}", {"prompt": "x", "n": "wide"}, "ValueError"),
        ("{prompt:>{n}}", {"prompt": "x", "n": None}, "column 'n' is null"),
        ("{prompt:>{n}}", {"prompt": "x", "n": 10**9}, f"over {MAX_FORMAT_WIDTH}"),
        ("{prompt:.{n}f}", {"prompt": 1.5, "n": 10**30}, "ValueError"),
        ("{prompt:,}", {"prompt": [1, 2]}, "TypeError"),
    ],
)
def test_a_row_the_template_cannot_render_is_a_row_error(template, row, message):
    builder = PromptBuilder(PromptConfig(template=template))
    with pytest.raises(RowError, match=message):
        builder.source(row)


def test_template_specs_render_as_str_format():
    builder = PromptBuilder(PromptConfig(template="[{prompt:>{n}}] {x:.2f} {prompt!r}"))
    assert builder.source({"prompt": "ab", "n": 4, "x": 1.0}) == "[  ab] 1.00 'ab'"


def test_tokenize_stage_turns_a_bad_spec_into_an_error_row_beside_good_rows():
    tok = tiny_tokenizer("none")
    config = PromptConfig(template="{prompt:>{n}}")
    tokenize = TokenizeStage(
        config, model="", max_model_len=512, sampling=SamplingParams(), tokenizer=tok
    )
    batch = pa.table({stage.ID: ["a", "b", "c"], "prompt": ["x", "y", "z"], "n": [3, -1, 2]})
    out = tokenize(batch)
    errors = out.column(stage.ERROR).to_pylist()
    assert errors[0] is None and errors[2] is None
    assert "template cannot render this row" in errors[1]
