"""Offline bounds for `bmoe-bench policies`: policies that read the trace's future.

They plug into the live `ExpertCache` like any policy in bmoe.streaming.cache_policy, but only a replay
knows the future, so no run of bmoe-cli can use them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from bmoe.streaming.cache_policy import ExpertKey, NextUse, Policy


class Future:
    """The trace's routing ahead of the replay position, for the simulator-only bounds.

    `uses[(layer, expert)]` is the sorted list of positions (token index × N + layer position)
    at which that expert is routed; `now` is the current position, set by the policy's `begin`.
    `prefill_tokens` token passes come before the trace's first (not in `uses`).
    """

    NEVER = float("inf")

    def __init__(self, uses: dict[tuple[int, int], list[int]], prefill_tokens: int) -> None:
        self.uses = uses
        self.prefill_tokens = prefill_tokens
        self.cursor: dict[tuple[int, int], int] = {}
        self.now = -1

    def at(self, token: int, n_layers: int, pos: int) -> None:
        self.now = (token - 1 - self.prefill_tokens) * n_layers + pos

    def next_use(self, layer: int, expert: int) -> float:
        """The first position after now at which the expert is routed (NEVER if none)."""
        ek = (layer, expert)
        uses = self.uses.get(ek, ())
        i = self.cursor.get(ek, 0)
        while i < len(uses) and uses[i] <= self.now:
            i += 1
        self.cursor[ek] = i
        return uses[i] if i < len(uses) else self.NEVER


class Belady(Policy):
    """Belady's MIN: evict the expert whose next use is furthest in the future (offline bound).

    `future` as in `Future`. Simulator only.
    """

    name = "belady"

    def __init__(self, layers: Sequence[int], future: dict[tuple[int, int], list[int]],
                 prefill_tokens: int = 0) -> None:
        super().__init__(layers)
        self.future = Future(future, prefill_tokens)
        self.resident: set[ExpertKey] = set()

    def begin(self, layer: int) -> None:
        super().begin(layer)
        self.future.at(self.token, len(self.layers), self.pos[layer])

    def next_use(self, key: ExpertKey) -> float:
        return self.future.next_use(key[0], key[1])

    def touch(self, key: ExpertKey) -> None:
        pass

    def admit(self, key: ExpertKey, speculative: bool = False) -> None:
        self.resident.add(key)

    def forget(self, key: ExpertKey) -> None:
        self.resident.discard(key)

    def victims(self, layer: int | None) -> Iterator[ExpertKey]:
        return iter(sorted(self.resident, key=self.next_use, reverse=True))


class NextTokenOracle(NextUse):
    """`next-use` told the next token's routing exactly: a bound for any next-token predictor.

    An expert routed within the next N layer steps gets its true distance; any
    other is known to wait past its layer's next visit, d + N/p (N(1/p - 1) more steps expected
    after that visit, as in `next-use`). Its distance to Belady is what knowing more than one
    token ahead is worth. Simulator only (`future` as in `Future`).
    """

    name = "next-token-oracle"

    def __init__(self, layers: Sequence[int], future: dict[tuple[int, int], list[int]],
                 prefill_tokens: int = 0) -> None:
        super().__init__(layers)
        self.future = Future(future, prefill_tokens)

    def begin(self, layer: int) -> None:
        super().begin(layer)
        self.future.at(self.token, len(self.layers), self.pos[layer])

    def _wait(self, key: ExpertKey, cur: int) -> float:
        n = len(self.layers)
        soon = self.future.next_use(key[0], key[1]) - self.future.now
        if soon <= n:
            return soon
        return ((self.pos[key[0]] - cur) % n or n) + n / self.frequency(key[0], key[1])

    def victims(self, layer: int | None) -> Iterator[ExpertKey]:
        cur = self.pos.get(layer, 0) if layer is not None else 0
        # by layer, least recently used first
        keys = sorted(self.entry, key=lambda k: (self.pos[k[0]], self.entry[k][1]))
        return iter(sorted(keys, key=lambda k: self._wait(k, cur), reverse=True))
