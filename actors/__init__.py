"""raypack actors: the inference engine (scheduler, paged KV cache, model runner, sampler)."""

from actors.config import EngineConfig, SamplingParams
from actors.engine import LLMEngine
from actors.outputs import RequestOutput, TokenLogprob

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams", "TokenLogprob"]
