"""RouteGuess: what it counts from the routing it sees and what it guesses from the counts."""

from __future__ import annotations

import numpy as np

from bmoe.streaming.route_guess import WARMUP, RouteGuess


def _token(g: RouteGuess, routes: dict[int, list[int]]) -> None:
    for layer in g.layers:
        g.observe(layer, np.array([routes[layer]]))


def test_an_expert_that_always_follows_is_guessed_and_one_that_follows_half_the_time_only_below_a_half() -> None:
    g = RouteGuess([0, 1, 2], 8, threshold=0.6)
    for t in range(WARMUP):
        _token(g, {0: [0, 1], 1: [2, 3 if t % 2 else 4], 2: [5, 6]})
    assert dict(g.guess(0)) == {2: 1.0}, "3 and 4 each followed 0 and 1 in half the tokens"
    assert dict(g.guess(1)) == {5: 1.0, 6: 1.0}
    assert dict(g.guess(2)) == {0: 1.0, 1: 1.0}, "the layers are a cycle: the last layer's successor is the first"
    low = RouteGuess([0, 1, 2], 8, threshold=0.5)
    for t in range(WARMUP):
        _token(low, {0: [0, 1], 1: [2, 3 if t % 2 else 4], 2: [5, 6]})
    assert dict(low.guess(0)) == {2: 1.0, 3: 0.5, 4: 0.5}
    assert low.guess(0)[0][0] == 2, "likeliest first"


def test_no_guess_before_the_warm_up_nor_for_a_layer_not_seen() -> None:
    g = RouteGuess([0, 1], 4, threshold=0.1)
    for _ in range(WARMUP - 1):
        _token(g, {0: [0], 1: [1]})
    assert g.guess(0) == [] and g.tokens == WARMUP - 1
    _token(g, {0: [0], 1: [1]})
    assert g.guess(0) == [(1, 1.0)]
    assert RouteGuess([0, 1], 4, threshold=0.1).guess(1) == []


def test_a_prompts_rows_count_token_by_token_and_dropped_positions_do_not() -> None:
    """Rows pair with the same token's row at the layer before; a layer with fewer rows (llama.cpp's
    last layer computes the logits' rows only) has the last tokens; -1 (a dropped position) is no expert."""
    g = RouteGuess([0, 1], 4, threshold=0.1)
    g.observe(0, np.array([[0, 1], [2, 3], [0, -1]]))
    g.observe(1, np.array([[1, 2], [3, 0], [2, 2]]))
    assert g.follow[0][np.ix_([0, 1], [1, 2])].tolist() == [[1, 2], [1, 1]]
    assert g.follow[0][0, 2] == 2 and g.follow[0][2, 3] == 1 and g.seen[0].tolist() == [2, 1, 1, 1]
    g.observe(0, np.array([[3, 1]]))  # (the next token: its first layer pairs with the last layer's last row)
    assert g.follow[1][2, 3] == 1 and g.follow[1][2, 1] == 1 and g.seen[1].tolist() == [0, 0, 1, 0]
    assert g.tokens == 4
