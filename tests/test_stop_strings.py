"""`cluster.serve.stop_strings`: where a sampled response ends on a Tinker `stop` string, worked by hand on
a vocabulary whose tokens are multi-character strings (so a stop string can end inside a token or span
two)."""

from __future__ import annotations

import numpy as np

from cluster.serve.stop_strings import stop_at_strings

VOCAB = ["7", "}", "\n", "\n\nUs", "er:", " more", "User:"]


def decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


def test_the_response_ends_with_the_token_that_completes_the_stop_string():
    # "7}" + "\n\nUs" + "er:" + " more": "\n\nUser:" is complete only after token 3 ("er:")
    assert stop_at_strings(np.array([0, 1, 3, 4, 5]), ["\n\nUser:"], decode) == 4


def test_a_stop_string_spanning_three_tokens_and_the_first_of_several():
    # "7" "\n" "\n" "User:": the two-newline stop completes at token 2, before "User:" arrives
    ids = np.array([0, 2, 2, 6, 5])
    assert stop_at_strings(ids, ["\n\nUser:"], decode) == 4
    assert stop_at_strings(ids, ["\n\nUser:", "\n\n"], decode) == 3


def test_no_stop_string_or_none_asked_keeps_the_whole_response():
    assert stop_at_strings(np.array([0, 1, 5]), ["\n\nUser:"], decode) is None
    assert stop_at_strings(np.array([0, 3, 4]), [], decode) is None
