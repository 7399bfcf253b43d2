"""Logprobs equal Hugging Face's: each returned logprob (and the top-k list) is log_softmax of
the reference model's next-token logits for the same context, within LOGPROB_TOL, for greedy
and sampled requests in one batch with prefix groups (so paged, shared-prefix and chunked
attention all feed the numbers)."""

from __future__ import annotations

import torch

from actors import SamplingParams
from tests.actors.groups import prefix_groups_for, shared_prefix_prompts
from tests.actors.reference import torch_threads

# float32 logits of a batched paged forward vs a solo SDPA forward differ by ~1e-6 here; a
# planted bug (wrong scale, the wrong row, a temperature applied) moves them by > 1e-2.
LOGPROB_TOL = 1e-4
TOP = 5


@torch.inference_mode()
def hf_logprobs(model, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    logits = model(torch.tensor([ids])).logits[0, -1].float()
    return torch.log_softmax(logits, dim=-1)


def test_logprobs_equal_hf_log_softmax(make_engine, reference_models, tokenizer) -> None:  # noqa: ANN001
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in shared_prefix_prompts()]
    engine = make_engine("llama", num_kv_blocks=256, chunk_size=16)
    params = [
        SamplingParams(max_tokens=5, logprobs=TOP)
        if i % 2 == 0
        else SamplingParams(max_tokens=5, logprobs=TOP, temperature=1.0, seed=i)
        for i in range(len(prompts))
    ]
    outputs = engine.generate(prompts, params, prefix_groups_for(prompts))
    model = reference_models["llama"]
    checked = 0
    with torch_threads(1):
        for ids, out in zip(prompts, outputs, strict=True):
            assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
            for k, entry in enumerate(out.logprobs):
                expected = hf_logprobs(model, ids + list(out.token_ids[:k]))
                assert entry.token_id == out.token_ids[k]
                assert abs(entry.logprob - float(expected[entry.token_id])) < LOGPROB_TOL
                top_values, top_ids = expected.topk(TOP)
                got_ids = [t for t, _ in entry.top]
                got_values = torch.tensor([v for _, v in entry.top])
                torch.testing.assert_close(got_values, top_values, atol=LOGPROB_TOL, rtol=0)
                # ids equal except where two candidates are tied within the tolerance
                for g, e, v in zip(got_ids, top_ids.tolist(), top_values.tolist(), strict=True):
                    assert g == e or abs(float(expected[g]) - v) < LOGPROB_TOL
                checked += 1
    assert checked >= 5 * len(prompts) - 2  # (a sequence may end early at EOS)
    # greedy rows: the chosen token is the most likely one
    for out in outputs[::2]:
        assert all(e.token_id == e.top[0][0] for e in out.logprobs or ())
