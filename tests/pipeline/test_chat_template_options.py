"""Chat template options (`chat_template`, `chat_template_kwargs`; vLLM's names) on every path
without Ray: the rendered tokens are exactly Hugging Face `apply_chat_template`'s with that
template and those variables, through the tokenizer helper, the job's and processor's prompt
builder, the job's flags (and its lineage) and Serve's chat request mapping."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from actors.loader import load_tokenizer, resolve_model
from actors.tokenization import ChatTemplateError, encode_chat
from pipeline.chat_template import parse_template_kwargs, read_chat_template
from pipeline.commands.generate import build_config, build_parser
from pipeline.config import PromptConfig
from pipeline.processor.config import ProcessorConfig
from pipeline.serve.config import ServeConfig
from pipeline.serve.errors import APIError
from pipeline.serve.service import OpenAIService
from pipeline.stages.prompts import PromptBuilder

# A template unlike SmolLM2's own, with a variable of the kind Qwen3 reads (enable_thinking).
TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT]{% if enable_thinking %} <think>{% endif %}"
    "{% endif %}"
)
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a colour."},
]


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    return load_tokenizer("smollm2")


def hf(tokenizer, template=None, **kwargs) -> list[int]:  # noqa: ANN001, ANN003
    return tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=False,
        chat_template=template, **kwargs,
    )  # fmt: skip


def test_a_custom_template_and_its_kwargs_give_hf_tokens(tokenizer) -> None:
    default = encode_chat(tokenizer, CHAT)
    custom = encode_chat(tokenizer, CHAT, chat_template=TEMPLATE)
    thinking = encode_chat(
        tokenizer, CHAT, chat_template=TEMPLATE, template_kwargs={"enable_thinking": True}
    )
    assert custom == hf(tokenizer, TEMPLATE) != default == hf(tokenizer)
    assert thinking == hf(tokenizer, TEMPLATE, enable_thinking=True) != custom
    assert tokenizer.decode(thinking).endswith("[ASSISTANT] <think>")
    with pytest.raises(ChatTemplateError, match="cannot set"):
        encode_chat(tokenizer, CHAT, template_kwargs={"tokenize": False})


def test_the_prompt_builder_of_the_job_and_processor_uses_them(tokenizer) -> None:
    config = ProcessorConfig(
        messages_column="m", chat_template=TEMPLATE, chat_template_kwargs={"enable_thinking": 1}
    ).prompt
    assert config is not None
    builder = PromptBuilder(config, tokenizer)
    row = {"m": json.dumps(CHAT)}
    assert builder.encode([builder.source(row)]) == [hf(tokenizer, TEMPLATE, enable_thinking=1)]
    assert builder.build(row) == tokenizer.decode(hf(tokenizer, TEMPLATE, enable_thinking=1))
    with pytest.raises(ValueError, match="apply to chat prompts"):
        PromptConfig(prompt_column="p", chat_template=TEMPLATE)
    with pytest.raises(ValueError, match="JSON values"):
        PromptConfig(messages_column="m", chat_template_kwargs={"x": object()})


def test_job_flags_read_a_file_or_text_and_enter_the_lineage(tmp_path) -> None:
    from dataclasses import asdict

    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    base = ["--input", "in.jsonl", "--output", "out", "--messages-column", "m"]
    args = build_parser().parse_args(
        [*base, "--chat-template", str(path), "--chat-template-kwargs", '{"enable_thinking": true}']
    )
    prompt = build_config(args).prompt
    assert prompt.chat_template == TEMPLATE
    assert prompt.chat_template_kwargs == {"enable_thinking": True}
    # The job's lineage records the prompt spec (pipeline/io/lineage.py: asdict of the prompt).
    assert asdict(prompt)["chat_template"] == TEMPLATE
    assert read_chat_template("{{ messages }}") == "{{ messages }}"
    with pytest.raises(ValueError, match="no file"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="JSON object"):
        parse_template_kwargs("[1]")


def test_serve_takes_the_server_flag_and_the_request_fields(tokenizer) -> None:
    def prepare(config: ServeConfig, **fields) -> list[int]:  # noqa: ANN003
        service = OpenAIService(config, None, tokenizer, 512, len(tokenizer))  # type: ignore[arg-type]
        body = {"model": "m", "messages": CHAT, **fields}
        return service.prepare_chat(json.dumps(body).encode()).prompt_token_ids

    from pipeline.serve.cli import serve_config_from_app_args

    plain = ServeConfig(served_model_name="m", api_keys_env=None)
    # The server flag, as `raypack serve --chat-template TEXT` and Serve's builder read it.
    flagged = serve_config_from_app_args({"chat_template": TEMPLATE})
    server = replace(plain, chat_template=flagged.chat_template)
    assert server.chat_template == TEMPLATE
    assert prepare(plain) == hf(tokenizer)
    assert prepare(server) == hf(tokenizer, TEMPLATE)
    kwargs = {"enable_thinking": True}
    assert prepare(server, chat_template_kwargs=kwargs) == hf(tokenizer, TEMPLATE, **kwargs)
    # A request's own template runs only where the operator trusts the clients (as vLLM).
    with pytest.raises(APIError) as raised:
        prepare(plain, chat_template=TEMPLATE)
    assert raised.value.status == 400 and "--trust-request-chat-template" in str(raised.value)
    trusting = replace(plain, trust_request_chat_template=True)
    assert prepare(trusting, chat_template=TEMPLATE) == hf(tokenizer, TEMPLATE)
    with pytest.raises(APIError) as raised:
        prepare(trusting, chat_template="{% if %}")
    assert raised.value.status == 400
    flag = serve_config_from_app_args({"trust_request_chat_template": "true"})
    assert flag.trust_request_chat_template


def test_a_changed_template_or_kwarg_or_n_is_a_lineage_difference(tiny_model_dir, tmp_path):
    from actors.config import EngineConfig, SamplingParams
    from pipeline.config import InputConfig, JobConfig
    from pipeline.io import lineage

    chat = PromptConfig(prompt_column="p", chat=True, chat_template=TEMPLATE)
    config = JobConfig(
        input=InputConfig("in.parquet"),
        prompt=chat,
        output=str(tmp_path / "out"),
        engine=EngineConfig(dtype="float32", model=str(tiny_model_dir)),
    )

    def record(job: JobConfig) -> dict:
        return lineage.job_lineage(job, "id", (), 512, resolve_model(job.engine.model))

    first = record(config)
    thinking = replace(chat, chat_template_kwargs={"enable_thinking": True})
    changes = [
        (
            replace(config, prompt=replace(chat, chat_template=TEMPLATE + " ")),
            "prompt.chat_template",
        ),
        (replace(config, prompt=thinking), "prompt.chat_template_kwargs"),
        (replace(config, sampling=SamplingParams(n=2)), "sampling.n"),
    ]
    for job, name in changes:
        diffs = [d[0] for d in lineage.differences(first, record(job))]
        assert diffs and all(d.startswith(name) for d in diffs), diffs
