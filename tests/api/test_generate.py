from __future__ import annotations

import pytest

from mgserve.api.generate import StopMatcher


@pytest.mark.parametrize(
    ("stops", "pieces", "sent", "word"),
    [
        ((), ["ab", "c"], ["ab", "c"], None),
        (("END",), ["hello E", "N", "D more"], ["hello ", "", ""], "END"),
        (("END",), ["hello E", "x"], ["hello ", "Ex"], None),  # a false start is released
        (("ab", "bcd"), ["xb", "cd"], ["x", ""], "bcd"),
        (("ab", "b"), ["xab"], ["x"], "ab"),  # the earliest match wins
        (("<|im_end|>",), ["Hi<|im", "_end|>tail"], ["Hi", ""], "<|im_end|>"),
    ],
)
def test_stop_matcher(
    stops: tuple[str, ...], pieces: list[str], sent: list[str], word: str | None
) -> None:
    m = StopMatcher(stops)
    out, found = [], None
    for p in pieces:
        text, found = m.push(p)
        out.append(text)
        if found:
            break
    assert out == sent and found == word


def test_stop_matcher_flush_releases_the_held_tail() -> None:
    m = StopMatcher(("STOP",))
    assert m.push("abc ST") == ("abc ", None)
    assert m.flush() == "ST"
