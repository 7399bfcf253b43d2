"""Streaming equals not streaming (issue 31): the pieces `StreamCursor` releases while a
request's text grows add up to exactly its finished text, whatever the stop strings (short,
longer than the output, multi-byte, overlapping, several), and that text is cut where the stop
strings say. Real parts: the tiny byte-level tokenizer, `Detokenizer.update` and `find_stop`
on a `Request`, fed token by token as the engine feeds them (`LLMEngine._append`)."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from actors.config import SamplingParams
from actors.detokenizer import Detokenizer, StreamCursor
from actors.request import Request
from tests.tiny_tokenizers import tiny_tokenizer

TOKENIZER = tiny_tokenizer("none")
DETOKENIZER = Detokenizer(TOKENIZER)
PROMPT = TOKENIZER.encode("Q: 2 + 2 =", add_special_tokens=False)
# Spaces, punctuation, two- to four-byte characters (each byte its own token here, so a
# character arrives over several tokens, the first ones decoding to U+FFFD).
ALPHABET = "ab ,.\n<>/sé日🙂"


def run(output: str, stops: tuple[str, ...], max_tokens: int) -> tuple[list[str], str, list[str]]:
    """Generate `output`'s tokens (at most max_tokens) as the engine does; the pieces a cursor
    released after each token, the finished text, and the uncut text after each token."""
    ids = TOKENIZER.encode(output, add_special_tokens=False)[:max_tokens]
    request = Request("r", list(PROMPT), SamplingParams(max_tokens=max(1, len(ids)), stop=stops))
    DETOKENIZER.start(request)
    cursor = StreamCursor.for_stops(stops)
    pieces: list[str] = []
    for i, token in enumerate(ids):
        request.append_token(token)
        num_chars = len(DETOKENIZER.update(request))
        finished = DETOKENIZER.find_stop(request, num_chars) or i == len(ids) - 1
        pieces.append(cursor.release(request.text, finished))
        if finished:
            break
    else:  # no token at all: the empty text, finished
        pieces.append(cursor.release(request.text, True))
    return pieces, request.text, uncut(ids)


def uncut(ids: list[int]) -> list[str]:
    """The text after each token with no stop strings."""
    request = Request("u", list(PROMPT), SamplingParams(max_tokens=max(1, len(ids))))
    DETOKENIZER.start(request)
    texts = []
    for token in ids:
        request.append_token(token)
        DETOKENIZER.update(request)
        texts.append(request.text)
    return texts


def expected_text(texts: list[str], stops: tuple[str, ...]) -> str:
    """The text cut at the first stop string to complete: after the first token whose text
    holds one, at the earliest place any stop string starts in it."""
    for text in texts:
        found = [text.find(s) for s in stops if s in text]
        if found:
            return text[: min(found)]
    return texts[-1] if texts else ""


@st.composite
def outputs_and_stops(draw: st.DrawFn) -> tuple[str, tuple[str, ...], int]:
    output = draw(st.text(alphabet=ALPHABET, max_size=40))
    stops: list[str] = []
    for _ in range(draw(st.integers(1, 4))):
        if output and draw(st.booleans()):  # a piece of the output: it does stop it
            start = draw(st.integers(0, len(output) - 1))
            stops.append(output[start : draw(st.integers(start + 1, len(output)))])
        else:  # anything, up to longer than the output
            stops.append(draw(st.text(alphabet=ALPHABET, min_size=1, max_size=25)))
    return output, tuple(stops), draw(st.integers(1, 64))


@settings(max_examples=300, deadline=None)
@given(outputs_and_stops())
@example((" 2 + 2 = 4</s>", ("</s>",), 64))  # the case: '  2 + 2 =' was streamed
@example((",, the city of Nov", ("x" * 20,), 64))  # a stop longer than the whole output
@example(("aaaa", ("aa", "aaa", "a a"), 64))  # overlapping stop strings
@example(("日本🙂日", ("🙂", "本🙂"), 64))  # multi-byte, one stop inside another
@example(("ab, ab", (" ", "\n"), 3))  # whitespace stops, max_tokens cuts first
def test_streamed_pieces_add_up_to_the_finished_text(case: tuple[str, tuple[str, ...], int]):
    output, stops, max_tokens = case
    pieces, final, texts = run(output, stops, max_tokens)
    assert "".join(pieces) == final
    assert final == expected_text(texts, stops)
    assert not any(s in final for s in stops)


def test_nothing_is_sent_twice_while_the_text_is_shorter_than_the_hold() -> None:
    cursor = StreamCursor.for_stops(["x" * 20])
    assert cursor.hold == 19
    assert [cursor.release(t, False) for t in ("a", "ab", "a" * 25)] == ["", "", "a" * 6]
    assert cursor.release("a" * 25 + "b", True) == "a" * 19 + "b"
    no_stops = StreamCursor.for_stops([])
    assert [no_stops.release(t, False) for t in ("a", "ab")] == ["a", "b"]
