from hypothesis import given, settings
from hypothesis import strategies as st

from trnd.engine.stops import StopChecker

ALPHABET = "abc "  # small, so stop strings actually occur and overlap


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    """Scan character by character; at the first end position where a stop string completes,
    truncate before the longest stop string completing there."""
    stops = [s for s in stops if s]
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            return text[:end - max(map(len, hits))], True
    return text, False


def longest_pending(text: str, stops: list[str]) -> int:
    """Longest suffix of text that is a proper prefix of a stop string (what must be held back)."""
    return max((n for n in range(1, len(text) + 1) for s in stops
                if len(s) > n and s.startswith(text[-n:])), default=0)


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])] or [""]


def run(text, stops, deltas):
    """Feed deltas; check the streaming invariants; return (concatenated output, stopped)."""
    want, want_stopped = reference(text, stops)
    checker = StopChecker(stops)
    emitted, seen, stopped = "", "", False
    for d in deltas:
        out, stopped = checker.push(d)
        emitted += out
        seen += d
        # Never emit anything that a later stop would have cut: emitted text is always final.
        assert want.startswith(emitted)
        if stopped:
            break
        # ...and hold back no more than necessary.
        assert emitted == seen[:len(seen) - longest_pending(seen, [s for s in stops if s])]
    if not stopped:
        emitted += checker.flush()
    assert stopped == want_stopped
    return emitted


texts = st.text(alphabet=ALPHABET, max_size=40)
stop_lists = st.lists(st.text(alphabet=ALPHABET, min_size=0, max_size=4), max_size=3)
cut_lists = st.lists(st.integers(min_value=0, max_value=60), max_size=12)


@settings(max_examples=400, deadline=None)
@given(texts, stop_lists, cut_lists)
def test_matches_reference_for_any_split(text, stops, cuts):
    assert run(text, stops, split(text, cuts)) == reference(text, stops)[0]


@settings(max_examples=400, deadline=None)
@given(texts, stop_lists, cut_lists)
def test_openai_first_occurrence_without_nested_stops(text, stops, cuts):
    """Truncation before the first occurrence, whenever no stop string lies strictly inside another."""
    stops = [s for s in stops if s]
    if any(b in a[1:-1] for a in stops for b in stops):
        return
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    assert run(text, stops, split(text, cuts)) == text[:min(found, default=len(text))]


def test_examples():
    c = StopChecker(["wor"])
    assert c.push("Hel") == ("Hel", False)
    assert c.push("lo w") == ("lo ", False)  # "w" may start "wor"
    assert c.push("orld") == ("", True)
    assert c.matched == "wor"
    assert c.push("more") == ("", True)

    c = StopChecker(["</s>", "\n\n"])
    assert c.push("a<") == ("a", False)
    assert c.push("b") == ("<b", False)  # "<b" cannot start a stop string any more
    assert c.push("\n") == ("", False)
    assert c.flush() == "\n"

    c = StopChecker(["c", "abcd"])  # "c" completes first
    assert c.push("abcd") == ("ab", True)
    assert c.matched == "c"

    c = StopChecker([])
    assert c.push("anything") == ("anything", False)
    assert c.flush() == ""
