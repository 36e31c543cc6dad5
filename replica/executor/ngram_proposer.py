"""Prompt-lookup (n-gram) drafts for speculative decoding: no draft model, only the request's own tokens."""
from collections.abc import Sequence

import numpy as np


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, ngram_min: int, ngram_max: int):
        self.num_speculative_tokens = num_speculative_tokens
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        """Up to min(num_speculative_tokens, max_drafts) tokens: those that followed an earlier occurrence
        of the longest suffix of token_ids (ngram_max down to ngram_min tokens) that recurs; [] if none does.

        Of several occurrences the latest is taken: when the model copies or edits a text, the place it
        copies from is where that n-gram appeared last, and in a repetition loop it is the current cycle."""
        num_drafts = min(self.num_speculative_tokens, max_drafts)
        if num_drafts <= 0:
            return []
        tokens = np.asarray(token_ids)
        for n in range(min(self.ngram_max, len(tokens) - 1), self.ngram_min - 1, -1):
            # every n-gram that starts before the suffix itself does, so something follows it
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if matches.size:
                start = int(matches[-1]) + n
                return tokens[start:start + num_drafts].tolist()
        return []
