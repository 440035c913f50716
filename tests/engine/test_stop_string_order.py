"""Several stop strings completed by one token: the text stops at the one completed first."""

from __future__ import annotations

import pytest

from runtime.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from runtime.sampling_params import SamplingParams
from runtime.testing.models import smollm2_tokenizer


@pytest.mark.parametrize("include, expected", [(False, "Hello"), (True, "Hello ")])
def test_one_token_completing_two_stop_strings_stops_at_the_first_completed(include, expected):
    tokenizer = smollm2_tokenizer()
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    assert tokenizer.decode(ids[-1:]) == " world"  # " " and "lo wo" both complete with this one token
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["lo wo", " "], include_stop_str_in_output=include))
    hits = [detok.update([token_id], False) for token_id in ids]
    assert hits == [None, " "]
    assert detok.output_text == expected
    # No stop string lies inside what is sent before the stop string itself.
    body = expected[:-1] if include else expected
    assert "lo wo" not in body and " " not in body


def test_find_stop_string_prefers_the_earliest_end():
    # "cd" ends at 4, "bcde" at 5: "cd" was complete first, though "bcde" starts earlier.
    assert find_stop_string("abcde", 5, 0, ["bcde", "cd"], False) == ("cd", 2)
    assert find_stop_string("abcde", 5, 0, ["bcde", "cd"], True) == ("cd", 4)
    # Ending together: the longer one (it starts earlier) names the stop.
    assert find_stop_string("abcde", 5, 0, ["e", "cde"], False) == ("cde", 2)
    assert find_stop_string("abcde", 5, 0, ["e", "cde"], True) == ("cde", 5)
