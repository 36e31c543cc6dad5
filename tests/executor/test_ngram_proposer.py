import pytest

from replica.executor.ngram_proposer import NgramProposer


@pytest.mark.parametrize("token_ids, ngram_min, ngram_max, max_drafts, expected", [
    ([1, 2, 3, 4, 1, 2, 3], 1, 3, 3, [4, 1, 2]),          # [1, 2, 3] recurs: what followed it
    ([5, 6, 7, 8, 9, 7, 0, 6, 7], 1, 2, 3, [8, 9, 7]),    # the longest suffix that recurs: [6, 7]
    ([5, 6, 7, 8, 9, 7, 0, 6, 7], 1, 1, 3, [0, 6, 7]),    # only [7]: its latest earlier occurrence
    ([1, 2, 1, 3, 1], 1, 3, 3, [3, 1]),                   # what follows runs up to the last token
    ([1, 2, 1, 3, 1], 1, 3, 1, [3]),                      # capped by max_drafts
    ([1, 2, 1, 3, 1], 1, 3, 0, []),
    ([1, 2, 3, 1], 2, 3, 3, []),                          # [3, 1] never recurs; [1] is shorter than ngram_min
    ([4, 4], 1, 3, 3, [4]),
    ([4], 1, 3, 3, []),
])
def test_drafts_follow_the_latest_earlier_occurrence_of_the_longest_recurring_suffix(
        token_ids, ngram_min, ngram_max, max_drafts, expected):
    assert NgramProposer(3, ngram_min, ngram_max).propose(token_ids, max_drafts) == expected


def test_at_most_num_speculative_tokens():
    assert NgramProposer(2, 1, 3).propose([1, 2, 3, 4, 5, 1], 10) == [2, 3]
