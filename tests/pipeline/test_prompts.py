"""Ids, prompt building and sampling overrides, as plain functions (no Ray)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from actors.config import SamplingParams
from actors.loader import load_tokenizer
from pipeline.config import InputConfig, JobConfig, PlanConfig, PromptConfig
from pipeline.stages.prompts import (
    PromptBuilder,
    RowError,
    RowIdStage,
    content_id,
    merge_sampling,
    sampling_overrides,
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2")


def test_prompt_config_needs_exactly_one_source():
    with pytest.raises(ValueError, match="exactly one"):
        PromptConfig()
    with pytest.raises(ValueError, match="exactly one"):
        PromptConfig(prompt_column="a", template="{b}")
    assert PromptConfig(template="{doc} and {q} {doc}").template_fields == ("doc", "q")
    with pytest.raises(ValueError, match="column names"):
        PromptConfig(template="{} and {0}")
    with pytest.raises(ValueError, match="malformed"):
        PromptConfig(template="{doc")


def test_other_configs_validate():
    with pytest.raises(ValueError, match="max_rows_per_shard"):
        PlanConfig(max_rows_per_shard=0)
    with pytest.raises(ValueError, match="--keep-columns .id."):
        InputConfig("x.parquet", keep_columns=("id",))
    with pytest.raises(ValueError, match="--keep-columns .snippet.*generated text"):
        JobConfig(
            InputConfig("x", keep_columns=("snippet",)),
            PromptConfig(prompt_column="p"),
            "out",
            text_column="snippet",
        )


def test_row_ids_from_column_or_content_and_resume_filter():
    table = pa.table({"key": [3, 1, None], "p": ["a", "b", "c"]})
    out = RowIdStage("key")(table)
    assert out.column("id").to_pylist()[:2] == ["3", "1"]
    assert out.column("id")[2].as_py() == content_id({"key": None, "p": "c"})
    hashed = RowIdStage(None)(table).column("id").to_pylist()
    assert hashed == RowIdStage(None)(table).column("id").to_pylist()  # stable
    assert len(set(hashed)) == 3
    done = RowIdStage("key", done_ids={"3"})(table)
    assert done.column("id").to_pylist()[0] == "1" and done.num_rows == 2


def test_stage_names_missing_and_arrived_columns():
    with pytest.raises(ValueError, match=r"'key' \(the id column\).*\['p'\]"):
        RowIdStage("key")(pa.table({"p": ["a"]}))


def test_prompt_from_column_template_and_chat(tokenizer):
    assert PromptBuilder(PromptConfig(prompt_column="p")).build({"p": "hello"}) == "hello"
    built = PromptBuilder(PromptConfig(template="{d} / {q}")).build({"d": "doc", "q": 7})
    assert built == "doc / 7"
    chat = PromptBuilder(
        PromptConfig(prompt_column="p", chat=True, system_prompt="Be brief."), tokenizer
    )
    text = chat.build({"p": "hello"})
    assert "Be brief." in text and "hello" in text and text.endswith("<|im_start|>assistant\n")


def test_messages_column_list_or_json(tokenizer):
    builder = PromptBuilder(PromptConfig(messages_column="m"), tokenizer)
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    direct = builder.build({"m": msgs})
    assert "What is 2+2?" in direct
    assert builder.build({"m": '[{"role": "user", "content": "What is 2+2?"}]'}) == direct


@pytest.mark.parametrize(
    ("config", "row", "message"),
    [
        (PromptConfig(prompt_column="p"), {"p": None}, "is null"),
        (PromptConfig(prompt_column="p"), {"p": 12}, "holds int, not text"),
        (PromptConfig(prompt_column="p"), {"p": "   "}, "empty"),
        (PromptConfig(template="{a}{b}"), {"a": "x", "b": None}, "'b' is null"),
        (PromptConfig(messages_column="m"), {"m": "not json"}, "not JSON"),
        (PromptConfig(messages_column="m"), {"m": [{"role": "user"}]}, "'role' and 'content'"),
        (PromptConfig(messages_column="m"), {"m": []}, "non-empty list"),
    ],
)
def test_bad_rows_raise_row_errors(tokenizer, config, row, message):
    with pytest.raises(RowError, match=message):
        PromptBuilder(config, tokenizer).build(row)


def test_sampling_overrides_from_columns_and_dict():
    row = {"max_tokens": 5.0, "temperature": None, "sp": '{"top_k": 3, "stop": ["x"]}'}
    found = sampling_overrides(row, ["max_tokens", "temperature"], "sp")
    assert found == {"max_tokens": 5, "top_k": 3, "stop": ("x",)}
    params = merge_sampling(SamplingParams(max_tokens=9), found)
    assert (params.max_tokens, params.top_k, params.stop) == (5, 3, ("x",))
    assert merge_sampling(SamplingParams(), {}) == SamplingParams()


def test_unknown_or_invalid_override_is_a_row_error():
    with pytest.raises(RowError, match="unknown sampling override.*'nucleus'"):
        sampling_overrides({"sp": {"nucleus": 0.5}}, [], "sp")
    with pytest.raises(RowError, match="max_tokens"):
        merge_sampling(SamplingParams(), {"max_tokens": -3})
    with pytest.raises(RowError, match="dict of sampling fields"):
        sampling_overrides({"sp": "[1, 2]"}, [], "sp")


def test_penalty_min_p_and_logit_bias_overrides():
    """CSV cells arrive as text: the penalties and min_p as numbers, logit_bias as JSON."""
    row = {
        "presence_penalty": "0.5",
        "repetition_penalty": "1.2",
        "logit_bias": '{"42": 100, "7": -5}',
        "sp": '{"frequency_penalty": -1, "min_p": 0.1, "logit_bias": {"3": 1}}',
    }
    found = sampling_overrides(row, ["presence_penalty", "repetition_penalty", "logit_bias"], None)
    params = merge_sampling(SamplingParams(), found)
    assert (params.presence_penalty, params.repetition_penalty) == (0.5, 1.2)
    assert params.logit_bias == ((7, -5.0), (42, 100.0))
    params = merge_sampling(SamplingParams(), sampling_overrides(row, [], "sp"))
    assert (params.frequency_penalty, params.min_p, params.logit_bias) == (-1.0, 0.1, ((3, 1.0),))
    with pytest.raises(RowError, match="column 'presence_penalty'.*presence_penalty must be"):
        merge_sampling(
            SamplingParams(),
            sampling_overrides({"presence_penalty": "3"}, ["presence_penalty"], None),
        )
    with pytest.raises(RowError, match="logit_bias is not a JSON object"):
        sampling_overrides({"logit_bias": "{42: 1"}, ["logit_bias"], None)
