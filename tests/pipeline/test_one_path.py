"""The job and the processor share one path (`Processor.engine_rows`): the job's options reach
it through the processor's config, and its engine stage gives the processor's `logprobs`.
No Ray: the runs themselves are in test_job.py, test_parallel_job.py and test_processor.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from actors.config import EngineConfig, SamplingParams
from actors.loader import ModelSource, ResolvedModel
from actors.outputs import RequestOutput, TokenLogprob
from pipeline import ProcessorConfig, build_processor
from pipeline.config import ComputeConfig, InputConfig, JobConfig, PlanConfig, PromptConfig
from pipeline.io.input_source import InputFile, InputSource
from pipeline.job.run import PreparedJob, processor_config
from pipeline.processor.build import Processor
from pipeline.stages import stage
from pipeline.stages.engine_actor import ShardSpread
from pipeline.stages.infer import LOGPROBS_TYPE, InferStage
from pipeline.stages.plan import plan_partition
from tests.pipeline.test_plan_infer import tokenized


def test_the_jobs_options_reach_the_processors_config():
    prompt = PromptConfig(
        template="{doc}: {q}",
        system_prompt="be brief",
        chat=True,
        override_columns=("temperature",),
        sampling_column="params",
    )
    job = JobConfig(
        input=InputConfig(path="in.parquet", keep_columns=("doc",)),
        prompt=prompt,
        output="out",
        engine=EngineConfig(dtype="float32", tensor_parallel_size=2, pipeline_parallel_size=2),
        sampling=SamplingParams(max_tokens=5),
        plan=PlanConfig(max_rows_per_shard=7),
        compute=ComputeConfig(num_actors=3, torch_threads=2, engine_retries=4),
        text_column="answer",
    )
    prepared = PreparedJob(
        source=InputSource("parquet", (InputFile("in.parquet", "in.parquet", 10),)),
        columns=("doc", "q", "params", "temperature"),
        id_column=None,
        override_columns=prompt.override_columns,
        max_model_len=128,
        vocab_size=256,
        num_partitions=5,
        resolved_model=ResolvedModel("smollm2", ModelSource(Path("model"))),
    )
    config = processor_config(job, prepared)
    assert config.prompt == prompt  # the same prompt config back: one tokenizer stage
    assert config.engine is job.engine and config.sampling is job.sampling
    assert config.text_column == "answer" and config.output_columns[0] == "answer"
    assert config.compute_config == job.compute  # torch threads, retries, restarts
    assert config.num_partitions == 5  # what prepare chose (input bytes), not one per actor
    assert config.plan == dataclasses.replace(job.plan, num_partitions=5)


def test_the_processor_refuses_what_only_the_job_provides_before_any_work():
    tp = ProcessorConfig(
        prompt_column="p", engine=EngineConfig(dtype="float32", tensor_parallel_size=2)
    )
    with pytest.raises(ValueError, match="single-process engines"):
        build_processor(tp)(None)  # no placement groups of its own: before Ray or the data
    with pytest.raises(ValueError, match="named 'id' is not supported"):
        build_processor(ProcessorConfig(prompt_template="{id}: {q}"))(None)
    assert ProcessorConfig(prompt_column="p").num_partitions == 1
    assert ProcessorConfig(prompt_column="p", concurrency=3).num_partitions == 3


def test_the_plan_spreads_small_partitions_only_over_several_engine_actors():
    """`Processor.shard_dispatch`: what the plan stage and the engine pool get."""
    config = ProcessorConfig(prompt_column="p", concurrency=2)
    assert build_processor(config).shard_dispatch() == (3, ShardSpread(2, 2, 3))
    # The job knows its rows: each actor's shards in flight capped by its share.
    assert Processor(config, rows=525).shard_dispatch() == (2, ShardSpread(2, 2, 2))
    autoscaling = ProcessorConfig(prompt_column="p", concurrency=(1, 4))
    assert build_processor(autoscaling).shard_dispatch() == (3, ShardSpread(4, 4, 3))
    one = ProcessorConfig(prompt_column="p")
    assert build_processor(one).shard_dispatch() == (3, None)
    ungrouped = ProcessorConfig(
        prompt_column="p", concurrency=2, plan=PlanConfig(prefix_grouping=False)
    )
    assert build_processor(ungrouped).shard_dispatch() == (3, None)


class _LogprobEngine:
    def generate(self, prompts, params, prefix_groups):  # noqa: ANN001, ANN201
        return [
            RequestOutput(
                request_id=str(i),
                num_prompt_tokens=len(p),
                token_ids=(7,),
                text="x",
                finished=True,
                finish_reason="length",
                logprobs=(TokenLogprob(7, -0.5, ((7, -0.5), (8, -1.5))),),
            )
            for i, p in enumerate(prompts)
        ]


def test_the_engine_stage_adds_logprobs_when_asked_and_null_for_error_rows():
    rows = [("bad", None, "prompt is empty"), ("a", [5, 6], None)]
    shards, _ = plan_partition(tokenized(rows), PlanConfig(), SamplingParams(), ["doc"])
    with_lp = InferStage(
        EngineConfig(dtype="float32"), SamplingParams(), keep_columns=["doc"], with_logprobs=True,
        engine=_LogprobEngine(), text_column="answer",
    )  # fmt: skip
    out = {r[stage.ID]: r for r in with_lp(shards).to_pylist()}
    assert out["a"][stage.LOGPROBS] == [
        {"token_id": 7, "logprob": -0.5, "top": [{"token_id": 7, "logprob": -0.5},
                                                 {"token_id": 8, "logprob": -1.5}]}
    ]  # fmt: skip
    assert out["bad"][stage.LOGPROBS] is None and out["a"]["answer"] == "x"
    without = InferStage(EngineConfig(dtype="float32"), SamplingParams(), engine=_LogprobEngine())
    assert stage.LOGPROBS not in without(shards).column_names
    empty = with_lp(shards.slice(0, 0))  # the column's type even with no rows
    assert empty.num_rows == 0 and empty.schema.field(stage.LOGPROBS).type == LOGPROBS_TYPE
