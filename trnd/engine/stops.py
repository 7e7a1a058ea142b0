"""Stop strings over streamed text: emit what is safe, hold back what could still start a stop string.

Semantics: generation stops at the first character where some stop string is complete; the output
is the text before that occurrence (the longest stop string if several complete there). This equals
OpenAI's "text truncated before the first occurrence of any stop string" except when one stop
string sits strictly inside another (e.g. "c" and "abcd"): "c" completes first and wins, since a
streaming engine cannot wait for the future. It does not depend on how the text is split into deltas.
Empty stop strings are ignored. With `include` (vLLM's include_stop_str_in_output) the output runs to the
end of the stop string instead.
"""

from __future__ import annotations


class StopChecker:
    def __init__(self, stop: list[str], include: bool = False):
        self.stops = [s for s in stop if s]
        self.include = include
        self._max_hold = max((len(s) for s in self.stops), default=1) - 1
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended generation (OpenAI stop_reason)

    def push(self, delta: str) -> tuple[str, bool]:
        """Feed the next text delta; returns (text safe to emit now, stopped). After a stop, ("", True)."""
        if self.stopped:
            return "", True
        if not self.stops:
            return delta, False
        buf = self._held + delta
        # The held text contains no complete stop string (we would have stopped), and any match
        # must start inside it or later: earlier text was released only because no stop starts there.
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        if best is not None:
            self.stopped, self.matched, self._held = True, best[2], ""
            return buf[:best[0] if self.include else best[1]], True
        hold = self._hold_len(buf)
        self._held = buf[len(buf) - hold:]
        return buf[:len(buf) - hold], False

    def flush(self) -> str:
        """End of generation without a stop (length/eos): release the held-back tail."""
        out, self._held = self._held, ""
        return out

    def _hold_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        for n in range(min(len(buf), self._max_hold), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
