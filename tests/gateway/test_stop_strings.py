"""StopStringMatcher and SequenceOutput: exact text released, held back and cut."""

from __future__ import annotations

import random
import time

from pdserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from pdserve.gateway.sequence import SequenceOutput
from pdserve.gateway.stop_strings import StopStringMatcher
from pdserve.v1 import common_pb2, node_pb2


def test_text_without_stop_strings_is_released_at_once() -> None:
    m = StopStringMatcher([])
    assert m.feed("Hello") == ("Hello", None)
    assert m.feed(" world") == (" world", None)


def test_possible_stop_prefix_is_held_back() -> None:
    m = StopStringMatcher(["END"])
    assert m.feed("abcE") == ("abc", None)
    assert m.feed("N") == ("", None)
    assert m.feed("x") == ("ENx", None)  # not a match after all: released
    assert m.feed("yEN") == ("y", None)
    assert m.feed("D tail") == ("", "END")
    assert m.text == "abcENxy"
    assert m.feed("more") == ("", "END")


def test_stop_split_across_deltas_and_longest_hold() -> None:
    m = StopStringMatcher(["ab", "xyz"])
    assert m.feed("1x") == ("1", None)
    assert m.feed("y") == ("", None)
    assert m.feed("a") == ("xy", None)  # "xya" cannot start "xyz" but "a" can start "ab"
    assert m.feed("b") == ("", "ab")
    assert m.text == "1xy"


def test_first_listed_stop_wins_like_the_engine() -> None:
    m = StopStringMatcher(["cd", "ab"])
    assert m.feed("xxabcd") == ("xxab", "cd")


def test_flush_releases_held_text() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("go ST") == ("go ", None)
    assert m.flush("!") == "ST!"


def _chunk(ids: list[int], finish: int = 0) -> node_pb2.TokenChunk:
    return node_pb2.TokenChunk(token_ids=ids, finish_reason=finish, num_prompt_tokens=1)


def test_sequence_emits_whole_characters(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("é你", add_special_tokens=False)
    assert len(ids) > 2  # byte-level: the characters span several tokens
    params = common_pb2.SamplingParams(max_tokens=10)
    seq = SequenceOutput(0, tokenizer, [0], params)
    texts = [seq.add_chunk(_chunk([t])).text for t in ids[:-1]]
    last = seq.add_chunk(_chunk([ids[-1]], common_pb2.FINISH_REASON_LENGTH))
    assert "".join(texts) + last.text == "é你"
    assert all("\ufffd" not in t for t in texts)
    assert (last.finish_reason, last.stop_reason, last.num_output_tokens) == (
        "length",
        None,
        len(ids),
    )


def test_sequence_stop_string_and_stop_token(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(" the lazy dog", add_special_tokens=False)
    params = common_pb2.SamplingParams(max_tokens=50, stop=["zy d"])
    seq = SequenceOutput(0, tokenizer, [0], params)
    out = "".join(seq.add_chunk(_chunk([t])).text for t in ids)
    assert out == " the la" and seq.finish_reason == "stop" and seq.stop_reason == "zy d"
    params = common_pb2.SamplingParams(max_tokens=50, stop_token_ids=[ids[1]])
    seq = SequenceOutput(0, tokenizer, [0], params)
    seq.add_chunk(_chunk([ids[0]]))
    delta = seq.add_chunk(_chunk([ids[1]], common_pb2.FINISH_REASON_STOP))
    assert (delta.finish_reason, delta.stop_reason) == ("stop", ids[1])


def test_sequence_matches_the_offline_engine(tokenizer: Tokenizer) -> None:
    """Random token streams, random chunking: the gateway's text and stop decision equal
    engine.llm's for the same tokens."""
    from pdserve.engine.llm import _OfflineRequest  # imports torch: only here
    from pdserve.engine.request import Request, SamplingParams

    rng = random.Random(0)
    words = tokenizer.encode(" ab abc é 你好 ba bab\n", add_special_tokens=False)
    for trial in range(200):
        tokens = [rng.choice(words) for _ in range(rng.randint(1, 30))]
        stops = rng.sample(["ab", "c é", "好 b", "\n", "bab", "zz"], rng.randint(0, 3))
        prompt = [0, rng.choice(words)]
        engine_params = SamplingParams(max_tokens=len(tokens), stop=tuple(stops))
        tracked = _OfflineRequest(
            Request(str(trial), prompt, engine_params), 0, IncrementalDetokenizer(tokenizer, prompt)
        )
        seq = SequenceOutput(
            0, tokenizer, prompt, common_pb2.SamplingParams(max_tokens=len(tokens), stop=stops)
        )
        streamed, start = "", 0
        while start < len(tokens) and not seq.finished:
            end = min(len(tokens), start + rng.randint(1, 3))
            finish = common_pb2.FINISH_REASON_LENGTH if end == len(tokens) else 0
            streamed += seq.add_chunk(_chunk(tokens[start:end], finish)).text
            stopped = tracked.feed(tokens[start:end])
            start = end
            if stopped:
                break
        tracked.close()
        assert streamed == tracked.text == seq.text, (tokens, stops)
        assert seq.stop_reason == tracked.stop_reason


def _reference(stops: list[str], deltas: list[str], include: bool) -> tuple[list[str], str]:
    """The quadratic search the matcher replaced: whole text, each stop in order."""
    text, released, out = "", 0, []
    for delta in deltas:
        text += delta
        for stop in stops:
            cut = text.find(stop)
            if cut != -1:
                text = text[: cut + len(stop) if include else cut]
                out.append(text[released:])
                return out, text
        hold = max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        out.append(text[released : len(text) - hold])
        released = max(released, len(text) - hold)
    return out, text


def test_matches_the_quadratic_reference_on_random_text() -> None:
    rng = random.Random(7)
    for _ in range(400):
        alphabet = "ab" if rng.random() < 0.5 else "abc"
        stops = [
            "".join(rng.choices(alphabet, k=rng.randint(1, 5))) for _ in range(rng.randint(1, 3))
        ]
        deltas = ["".join(rng.choices(alphabet, k=rng.randint(0, 4))) for _ in range(12)]
        include = rng.random() < 0.5
        m = StopStringMatcher(stops, include_stop_str=include)
        got = []
        for delta in deltas:
            match = m.feed(delta)
            got.append(match.text)
            if match.stop is not None:
                break
        want, text = _reference(stops, deltas, include)
        assert (got, m.text) == (want, text), (stops, deltas, include)


def test_include_stop_str_keeps_the_stop_string() -> None:
    m = StopStringMatcher(["END"], include_stop_str=True)
    assert m.feed("abcEN") == ("abc", None)
    assert m.feed("D tail") == ("END", "END")
    assert m.text == "abcEND"


def test_64kb_stop_strings_cost_linear_time() -> None:
    """Four 64 KB stop strings against text whose every suffix is compared with them by a
    naive search (quadratic: minutes here): 16 sequences of 2000 deltas, well under a second
    or two."""
    stops = ["a" * 65535 + c for c in "bcde"]
    start = time.perf_counter()
    for _ in range(16):
        m = StopStringMatcher(stops)
        released = "".join(m.feed("ba").text for _ in range(2000))
        assert released + m.flush() == "ba" * 2000
        assert released == "ba" * 1999 + "b"  # the last "a" may start a stop string
    assert time.perf_counter() - start < 2.0
