"""A failure attributable to one request (admission, sampling with its values, detokenizing, a
stop check) ends that request alone with `finish_reason="error"`; its neighbours finish with
the tokens they get in a run without it, every KV block comes back, and the engine serves new
requests afterwards. Failures are planted in real engine parts (a Detokenizer or Sampler
subclass that raises for one request) on the tiny context-sensitive model."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from actors import SamplingParams
from actors.config import MAX_INT32
from actors.detokenizer import Detokenizer
from actors.request import Request
from actors.sampler import Sampler
from tests.actors.groups import prefix_groups_for, shared_prefix_prompts
from tests.actors.reference import sample_prompts

IsBad = Callable[[Request], bool]

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=10, temperature=0.8, top_k=50, seed=7, ignore_eos=True)
# min_tokens masks EOS in place and logprobs read the raw logits: a failed batch must not
# leave the mask behind for the retry (test_a_failed_sampler_call_leaves_logits_... shows it).
MASKED = SamplingParams(max_tokens=10, min_tokens=6, logprobs=3)
BAD = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True, stop=("zz",))


def neighbours() -> dict[str, tuple[str, SamplingParams]]:
    texts = sample_prompts(3, start=5)
    return {
        "greedy": (texts[0], GREEDY),
        "seeded": (texts[1], SEEDED),
        "masked": (texts[2], MASKED),
    }


def by_id(request_id: str) -> IsBad:
    return lambda request: request.request_id == request_id


class FailingDetokenizer(Detokenizer):
    """Raises in one stage (`start`, `update` or `find_stop`) for the bad request, from its
    `after`-th output token on."""

    def __init__(self, tokenizer, stage: str, is_bad: IsBad, after: int = 0) -> None:
        super().__init__(tokenizer)
        self.stage, self.is_bad, self.after = stage, is_bad, after

    def start(self, request: Request) -> None:
        self._maybe_fail("start", request)
        super().start(request)

    def update(self, request: Request) -> str:
        self._maybe_fail("update", request)
        return super().update(request)

    def find_stop(self, request: Request, num_new_chars: int) -> bool:  # type: ignore[override]
        self._maybe_fail("find_stop", request)
        return Detokenizer.find_stop(request, num_new_chars)

    def _maybe_fail(self, stage: str, request: Request) -> None:
        if stage == self.stage and self.is_bad(request) and request.num_output_tokens >= self.after:
            raise RuntimeError(f"planted {stage} failure")


class FailingSampler(Sampler):
    """Raises after drawing the random rows' noise when the bad request is among them (so the
    seeded neighbours' generators have moved and must be put back)."""

    def __init__(self, eos_token_ids, is_bad: IsBad) -> None:
        super().__init__(eos_token_ids)
        self.is_bad = is_bad

    def _sample(self, logits: torch.Tensor, requests) -> torch.Tensor:
        tokens = super()._sample(logits, requests)
        if any(self.is_bad(r) for r in requests):
            raise RuntimeError("planted sampling failure")
        return tokens


def run(engine, requests: dict[str, tuple[str, SamplingParams]]) -> dict:
    """Add every request, step until all finish; the final outputs by id."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(prompt, params, request_id=request_id)
    finals = {}
    for _ in range(200):
        if not engine.has_unfinished():
            break
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    assert not engine.has_unfinished()
    return finals


def assert_same(got, expected) -> None:
    assert got.error is None and got.finish_reason == expected.finish_reason
    assert got.token_ids == expected.token_ids and got.text == expected.text
    # Logprobs are tokens' and alternatives' equal, values to float noise (another batch).
    assert (got.logprobs is None) == (expected.logprobs is None)
    for a, b in zip(got.logprobs or (), expected.logprobs or (), strict=True):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def assert_all_free(engine) -> None:
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine.scheduler.prefix_holders


def assert_serves_again(engine, reference) -> None:
    prompt = sample_prompts(1, start=9)[0]
    again = run(engine, {"later": (prompt, GREEDY)})["later"]
    assert_same(again, run(reference, {"later": (prompt, GREEDY)})["later"])
    assert_all_free(engine)


@pytest.mark.parametrize(
    ("stage", "after", "message"),
    [
        ("start", 0, "admitting the request failed: RuntimeError: planted start failure"),
        ("update", 3, "postprocessing a generated token failed: RuntimeError: planted update"),
        ("find_stop", 2, "postprocessing a generated token failed: RuntimeError: planted find"),
    ],
)
def test_a_failing_request_ends_alone(make_engine, tokenizer, stage, after, message) -> None:
    good = neighbours()
    reference = make_engine(num_kv_blocks=64)
    expected = run(reference, good)

    engine = make_engine(num_kv_blocks=64)
    engine.detokenizer = FailingDetokenizer(tokenizer, stage, by_id("bad"), after)
    bad_prompt = sample_prompts(1, start=8)[0]
    finals = run(engine, {**good, "bad": (bad_prompt, BAD)})

    bad = finals["bad"]
    assert bad.finished and bad.finish_reason == "error"
    assert bad.error is not None and bad.error.startswith(message)
    assert len(bad.token_ids) == (0 if stage == "start" else after)
    for request_id, out in expected.items():
        assert_same(finals[request_id], out)
    assert_all_free(engine)
    assert_serves_again(engine, reference)


def test_a_failing_sampler_row_ends_alone(make_engine) -> None:
    good = neighbours()
    reference = make_engine(num_kv_blocks=64)
    expected = run(reference, good)

    engine = make_engine(num_kv_blocks=64)
    engine.sampler = FailingSampler(engine.sampler.eos_token_ids, by_id("bad"))
    finals = run(engine, {**good, "bad": (sample_prompts(1, start=8)[0], BAD)})

    bad = finals["bad"]
    assert bad.finish_reason == "error" and not bad.token_ids
    assert bad.error == "sampling failed: RuntimeError: planted sampling failure"
    for request_id, out in expected.items():
        assert_same(finals[request_id], out)
    assert_all_free(engine)
    assert_serves_again(engine, reference)


def test_failing_group_members_release_the_shared_prefix(make_engine, tokenizer) -> None:
    """One member of a prefix group fails at admission, one of another group mid-decode:
    the other members are unchanged and the groups' prefix blocks are all released."""
    prompts = shared_prefix_prompts()
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    groups = prefix_groups_for(ids)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    reference = make_engine(num_kv_blocks=128)
    expected = reference.generate(ids, params, groups)

    for stage, bad_index, after in (("start", 2, 0), ("update", 6, 2)):
        engine = make_engine(num_kv_blocks=128)
        bad_ids = ids[bad_index]
        engine.detokenizer = FailingDetokenizer(
            tokenizer, stage, lambda r, b=bad_ids: r.prompt_token_ids == b, after
        )
        outs = engine.generate(ids, params, groups)
        assert outs[bad_index].finish_reason == "error", stage
        assert f"planted {stage} failure" in (outs[bad_index].error or "")
        for index, (out, exp) in enumerate(zip(outs, expected, strict=True)):
            if index != bad_index:
                assert_same(out, exp)
        assert_all_free(engine)
        assert_serves_again(engine, reference)


def test_a_failed_sampler_call_leaves_logits_and_generators_as_they_were() -> None:
    requests = [
        Request("masked", [1, 2, 3], SamplingParams(min_tokens=2, logprobs=2)),
        Request("seeded", [4, 5], SamplingParams(temperature=1.0, seed=11)),
        Request("bad", [6], SamplingParams(temperature=1.0)),
    ]
    sampler = FailingSampler([2], by_id("bad"))
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    before, state = logits.clone(), requests[1].generator.get_state()
    with pytest.raises(RuntimeError, match="planted"):
        sampler(logits, requests)
    assert torch.equal(logits, before)
    assert torch.equal(requests[1].generator.get_state(), state)

    each = sampler.sample_each(logits, requests)
    assert each.errors == {2: "sampling failed: RuntimeError: planted sampling failure"}
    alone = Sampler([2])(
        before.clone()[:2],
        [Request(r.request_id, r.prompt_token_ids, r.params) for r in requests[:2]],
    )
    assert each.token_ids[:2] == alone.token_ids and each.token_ids[2] == -1
    assert each.logprobs[:2] == alone.logprobs


def test_any_top_k_samples_as_top_k_off() -> None:
    """top_k beyond the vocabulary (up to SamplingParams' bound) keeps every token: the
    same draws as top_k off, with or without top_p, and no overflow building tensors."""
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(1))
    for top_p in (1.0, 0.7):
        draws = {}
        for top_k in (0, 100, 101, MAX_INT32):
            params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, seed=5)
            reqs = [Request(str(i), [1], params) for i in range(4)]
            draws[top_k] = [Sampler([])(logits.clone(), reqs).token_ids for _ in range(3)]
        assert len({str(v) for v in draws.values()}) == 1, (top_p, draws)


def test_a_prompt_that_cannot_be_read_is_an_error_output(make_engine) -> None:
    """Token ids that are not integers fail their request at admission, in a streaming
    add and in a batch, and the rest of the batch runs."""
    engine = make_engine(num_kv_blocks=64)
    rid = engine.add_request([5, "six", 7], GREEDY)
    (out,) = engine.step()
    assert out.request_id == rid and out.finish_reason == "error"
    assert out.error is not None and out.error.startswith("admitting the request failed")
    good = sample_prompts(1, start=5)[0]
    outs = engine.generate([good, [1, None], good], GREEDY)
    assert outs[1].finish_reason == "error" and "admitting the request failed" in outs[1].error
    assert outs[0].error is None and outs[0].token_ids == outs[2].token_ids
    assert_all_free(engine)
