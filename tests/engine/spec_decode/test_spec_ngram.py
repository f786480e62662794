"""N-gram (prompt lookup) proposals: exact outputs."""

from pdserve.engine.request import Request, SamplingParams
from pdserve.engine.spec_decode.ngram import NgramProposer, propose_ngram


def test_longest_match_wins_and_most_recent_occurrence_is_copied():
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 2, 3]
    # n=3 ([8 2 3]) and n=2... [2 3] occurs at 1 and 5: the most recent (5) is followed by 8 2 3
    assert propose_ngram(tokens, k=3, min_n=1, max_n=3) == [8, 2, 3]
    # a longer suffix that matches decides over shorter ones
    tokens = [5, 2, 3, 7, 1, 2, 3, 6, 5, 2, 3]
    assert propose_ngram(tokens, k=2, min_n=1, max_n=3) == [7, 1]  # [5 2 3] at 0
    assert propose_ngram(tokens, k=2, min_n=1, max_n=2) == [6, 5]  # [2 3] most recent at 5


def test_no_match_or_too_short_proposes_nothing():
    assert propose_ngram([1, 2, 3, 4], k=3, min_n=1, max_n=4) == []
    assert propose_ngram([1, 2, 3, 1, 2, 4], k=3, min_n=2, max_n=4) == []  # [2 4] never occurred
    assert propose_ngram([7], k=3, min_n=1, max_n=4) == []
    assert propose_ngram([1, 1], k=0, min_n=1, max_n=4) == []


def test_min_n_bounds_the_shortest_match():
    tokens = [4, 5, 6, 4]
    assert propose_ngram(tokens, k=2, min_n=1, max_n=3) == [5, 6]
    assert propose_ngram(tokens, k=2, min_n=2, max_n=3) == []


def test_copy_runs_on_into_the_proposal_for_loops():
    # [a b a b]: suffix [a b] (n=2) recurs 2 back, so the loop continues with period 2
    assert propose_ngram([1, 2, 1, 2], k=5, min_n=1, max_n=4) == [1, 2, 1, 2, 1]
    assert propose_ngram([9, 9, 9], k=3, min_n=1, max_n=4) == [9, 9, 9]
    # a match far back copies what followed it, then what it copied
    assert propose_ngram([3, 4, 5, 3, 4], k=4, min_n=1, max_n=2) == [5, 3, 4, 5]


def test_proposer_reads_prompt_and_output_and_skips_requests_without_match():
    a = Request("a", [1, 2, 3, 1], SamplingParams())
    a.output_token_ids = [2]
    b = Request("b", [1, 2, 3], SamplingParams())
    proposer = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    proposals = proposer.propose([(a, 2), (b, 2)])
    assert list(proposals) == ["a"]
    assert proposals["a"].token_ids == [3, 1] and proposals["a"].probs is None
