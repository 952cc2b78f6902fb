"""Token deltas -> text deltas, and stop strings.

``tokenizers``' DecodeStream emits text only once the bytes decoded so far form whole UTF-8
characters, so a character split across byte-level BPE tokens never shows up as U+FFFD, and
the pieces concatenate to the full decode (but where byte fallback makes bytes already streamed
invalid UTF-8: _step). Stop strings are searched only where a new piece
could complete one, and the last ``len(longest stop) - 1`` characters are held back from
streamed text while they could still turn out to be the start of a stop string.
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream

from dabba.engine.tokenizer import Tokenizer
from dabba.sampling_params import SamplingParams


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self.token_ids: list[int] = []
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.num_chars_released = 0  # by new_output_text
        self.stopped = False
        self.flushed = False  # the final full decode replaced the streamed text

    def update(self, new_token_ids: list[int], check_stop: bool = True) -> str | None:
        """Decode new tokens; returns the stop string if one is now complete (the text is then
        cut before it, or after it with include_stop_str_in_output). With ``check_stop`` False
        (before min_tokens) stop strings are not looked for."""
        for token_id in new_token_ids:
            if self.stopped:
                break
            self.token_ids.append(token_id)
            piece = self._step(token_id)
            if not piece:
                continue
            search_from = max(0, len(self.text) - self.hold_back)
            self.text += piece
            match = self._find_stop(search_from) if check_stop else None
            if match is not None:
                index, stop = match
                self.text = self.text[: index + (len(stop) if self.include_stop else 0)]
                self.stopped = True
                return stop
        return None

    def _step(self, token_id: int) -> str | None:
        """The stream's next piece. Under byte fallback a byte token can make the bytes before it,
        streamed already as a character of their own ("C", then 0xBF), part of invalid UTF-8, which
        a whole decode writes as U+FFFD: tokenizers' DecodeStream then refuses to go on. The text
        goes on with what this token adds to the whole decode (all of what the whole decode adds to
        the streamed text, where it still extends it), and the stream starts again from this token."""
        try:
            return self.stream.step(self.tokenizer.hf_tokenizer, token_id)
        except Exception as e:  # tokenizers raises its own Exception
            if "Invalid prefix" not in str(e):
                raise
        self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        alone = self.stream.step(self.tokenizer.hf_tokenizer, token_id)  # and the next token's context
        whole, before = (self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
                         for ids in (self.token_ids, self.token_ids[:-1]))
        for streamed in (self.text, before):
            if whole.startswith(streamed):
                return whole[len(streamed):]
        return alone

    def _find_stop(self, search_from: int) -> tuple[int, str] | None:
        best = None
        for stop in self.stop:
            index = self.text.find(stop, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def output_text(self, finished: bool) -> str:
        """All text once finished; while running, all but what might still become a stop string."""
        end = self._num_released(finished)  # first: it may replace self.text with the full decode
        return self.text[:end]

    def new_output_text(self, finished: bool) -> str:
        """The text released since the previous call (DELTA outputs). The pieces concatenate to
        ``output_text(finished=True)``: released text is never taken back, since a stop string can
        only start inside the held-back tail and the final decode only adds to the streamed text."""
        end = self._num_released(finished)
        new = self.text[self.num_chars_released:end]
        self.num_chars_released = max(end, self.num_chars_released)
        return new

    def _num_released(self, finished: bool) -> int:
        """How many characters of ``self.text`` may be shown."""
        if finished and not self.stopped and not self.flushed:
            # Flush bytes the stream still holds (an unfinished character at the very end
            # decodes to U+FFFD, as in a full decode); once, however often it is asked after.
            self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
            self.flushed = True
        if finished or not self.stop:
            return len(self.text)
        return max(len(self.text) - self.hold_back, 0)
