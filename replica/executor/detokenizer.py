"""Incremental detokenization of one request's output, with stop strings.

Text is released only once complete: a token ending inside a multi-byte character yields nothing
until the character is whole, and while stop strings are set the last (longest stop - 1)
characters are held back, since they may turn out to begin a stop string.

What has been released is thus a function of the tokens fed so far, however they were grouped
(the text only grows, and the hold-back is fixed): a detokenizer given a migrated request's output
tokens up front resumes exactly where the lost replica's left off.
"""
from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from replica.executor.tokenizer import Tokenizer

# prompt tokens given to the decoder as context (a SentencePiece token's leading space depends on them)
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: list[str],
                 output_token_ids: Sequence[int] = ()):
        """output_token_ids: tokens generated before, whose released text the caller already has."""
        self._backend = tokenizer.backend
        self._stream = DecodeStream(ids=prompt_token_ids[-_PROMPT_CONTEXT:], skip_special_tokens=True)
        self._stop = stop
        self._hold_back = max(map(len, stop), default=1) - 1
        self.text = ""        # the output text so far, cut before a stop string once one appears
        self._num_released = 0
        if output_token_ids:
            self.update(list(output_token_ids), finished=False)

    def update(self, token_ids: list[int], finished: bool) -> tuple[str, bool]:
        """Feed new tokens -> (newly released text, whether a stop string appeared)."""
        stopped = False
        for token_id in token_ids:
            piece = self._stream.step(self._backend, token_id)
            if piece and self._append(piece):
                stopped = finished = True
                break
        end = len(self.text) if finished else max(self._num_released, len(self.text) - self._hold_back)
        released = self.text[self._num_released:end]
        self._num_released = end
        return released, stopped

    def _append(self, piece: str) -> bool:
        """Add piece to the text; True (and the text cut) when that completes a stop string."""
        search_from = max(0, len(self.text) - self._hold_back)
        self.text += piece
        hits = [index for stop in self._stop if (index := self.text.find(stop, search_from)) >= 0]
        if hits:
            self.text = self.text[:min(hits)]
        return bool(hits)
