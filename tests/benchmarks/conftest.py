"""The comparison prefills are checked on the engine tests' tiny models and tokenizer."""

from tests.actors.conftest import one_torch_thread, reference_models, tokenizer  # noqa: F401
