"""The shared path of the job and the processor: ids, prompts, tokens, plan, engine actors."""
