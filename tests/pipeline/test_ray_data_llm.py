"""Ray Data LLM's call shape: the program of docs/ray-data-llm.md, extracted from the page and
run as it is (only its model folder replaced by a tiny model) on the package's Ray cluster;
engine_kwargs, concurrency and the other config fields checked without Ray."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa
import pytest

from pipeline import LLMProcessorConfig, build_processor
from pipeline.processor.ray_llm import RayColumnsStage, engine_config

DOC = Path(__file__).parents[2] / "docs" / "ray-data-llm.md"
DOC_MODEL = '"/models/Llama-3.1-8B-Instruct"'


def ported_program() -> str:
    """The Python block after the page's `<!-- ported-program -->` marker."""
    text = DOC.read_text(encoding="utf-8")
    found = re.search(r"<!-- ported-program -->\n```python\n(.*?)\n```", text, re.DOTALL)
    assert found, "docs/ray-data-llm.md has no ported program block"
    return found.group(1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_documented_ray_data_llm_program_runs(ray_cluster, tiny_model_dir, capsys):
    program = ported_program()
    assert program.count(DOC_MODEL) == 1
    assert "from pipeline import LLMProcessorConfig, build_processor" in program
    code = program.replace(DOC_MODEL, repr(str(tiny_model_dir)))
    namespace: dict = {"__name__": "__main__"}
    exec(compile(code, str(DOC), "exec"), namespace)  # noqa: S102 (the page's own program)
    shown = capsys.readouterr().out
    # ds.show printed the one row: the postprocess's answer beside every carried column.
    assert shown.count("'answer':") == 1, shown
    # sample_index: the sampling_params column may ask several samples of a row (n); rows of
    # n samples through that column: test_processor_retry.py's samples test.
    columns = (
        "'generated_text':",
        "'messages':",
        "'prompt': '<|im_start|>system",
        "'error': None",
        "'sample_index': 0",
    )
    for column in columns:
        assert column in shown, shown


def test_engine_kwargs_map_to_the_engine_config_and_unknown_keys_are_named():
    config = engine_config(
        "m",
        {
            "max_model_len": 4096,
            "max_num_batched_tokens": 1024,
            "max_num_seqs": 8,
            "dtype": "half",
            "enable_chunked_prefill": True,
            "gpu_memory_utilization": 0.9,
            "kv_cache_memory_gb": 0.5,
        },
    )
    assert (config.model, config.max_model_len, config.max_num_batched_tokens) == ("m", 4096, 1024)
    assert (config.max_num_seqs, config.dtype, config.kv_cache_memory_gb) == (8, "float16", 0.5)
    assert engine_config("m", {"dtype": "auto"}).dtype == "auto"
    with pytest.raises(
        ValueError, match=r"\['load_format', 'quantization'\].*known: \[.*'block_size'"
    ):
        engine_config("m", {"quantization": "awq", "load_format": "runai_streamer"})
    with pytest.raises(ValueError, match="dtype"):
        engine_config("m", {"dtype": "int8"})


def test_config_fields_concurrency_and_columns():
    config = LLMProcessorConfig(model_source="m", concurrency=(1, 3), apply_chat_template=False)
    processor = build_processor(config, preprocess=dict, postprocess=dict)
    inner = processor.config
    assert inner.prompt_column == "prompt" and inner.messages_column is None
    assert inner.sampling_column == "sampling_params"
    assert inner.actor_pool_size == (1, 3) and inner.num_partitions == 3
    assert LLMProcessorConfig(model_source="m").processor_config().messages_column == "messages"
    with pytest.raises(ValueError, match="concurrency"):
        LLMProcessorConfig(model_source="m", concurrency=(3, 1))
    with pytest.raises(ValueError, match="has_image"):
        LLMProcessorConfig(model_source="m", has_image=True)
    with pytest.raises(TypeError, match="accelerator_type"):
        LLMProcessorConfig(model_source="m", accelerator_type="L4")  # type: ignore[call-arg]
    batch = pa.table(
        {
            "generated_text": ["x"],
            "generated_token_ids": [[1]],
            "num_prompt_tokens": [3],
            "item": ["a"],
        }
    )
    renamed = RayColumnsStage(detokenize=False)(batch)
    assert renamed.column_names == ["generated_tokens", "num_input_tokens", "item"]


def test_chat_rows_get_the_chat_templates_text_as_prompt():
    from actors.loader import load_tokenizer
    from pipeline.processor.ray_llm import ChatPromptStage

    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<bot>"
    chats = [[{"role": "user", "content": "Hi"}], [{"role": "system", "content": "Be brief."}]]
    tokenizer = load_tokenizer("smollm2")
    for chat_template in (None, template):
        config = LLMProcessorConfig(model_source="smollm2", chat_template=chat_template)
        stage = ChatPromptStage(config.processor_config())
        out = stage(pa.table({"messages": chats, "prompt": ["old", "old"]}))
        expected = [
            tokenizer.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=True, chat_template=chat_template
            )
            for chat in chats
        ]
        assert out.column("prompt").to_pylist() == expected
        assert out.column_names == ["messages", "prompt"]
