"""raypack pipeline: the offline job, the Ray Serve app, and the processor for a user's own
Ray Data program (`ProcessorConfig`, `build_processor`)."""

from pipeline.processor import Processor, ProcessorConfig, build_processor

__all__ = ["Processor", "ProcessorConfig", "build_processor"]
