"""The one generation loop: every caller's generations are begun, stepped and finished here.

`bmoe-cli`, the session and `bmoe.load(...)`'s generate/stream/chat run one Generation through
`Driver.run`; `Model.batch` runs several; the server's scheduler admits, steps and finishes them
one call at a time (`begin`, `step`). Whoever drives the engine holds `turn`.

Cancelling is one mechanism, `Driver.cancel`: the generation is flagged and ends after the token
being decoded (`Generation.take`) or before its next step. When every generation in the llama.cpp
decode under way is cancelled, that decode is interrupted too (Engine.interrupt), so a lone
request stops mid-prefill or mid-token; a batch step with one live member runs to its end.

Closing is `Driver.close`, for every edge (Model.close, its finalizer at the interpreter's exit,
the session's and the server's ends): no generation begins after it (ModelClosed), the live ones
are cancelled and waited for, and only then is the engine freed, so no thread is left decoding in
a freed llama.cpp context or an unmapped slab. A `Driver.run` a close cut short raises ModelClosed.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

from bmoe.base.errors import Cancelled, ModelClosed
from bmoe.generation.records import Completion
from bmoe.generation.request_life import Generation

if TYPE_CHECKING:
    from bmoe.coordinator import Engine

_T = TypeVar("_T")

CLOSED = "the model was closed; load it again to generate"


class Driver:
    """Drives the engine for generations: prefill one, decode a step for several, finish them."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.turn = threading.RLock()  # whoever drives the engine holds it (a run: for all of it)
        self._lock = threading.Lock()  # guards `_decoding`, `_live` and `closed` against other threads
        self._decoding: list[Generation] = []  # the generations in the llama_decode under way
        self._live: list[Generation] = []  # made and not finished: what `live` and `close` reach
        self._driver: int | None = None  # the thread holding `turn`
        self._alone: Callable[[], bool] | None = None  # the cancel of the decode `decode_alone` runs
        self.closed = False  # `close` began: nothing drives the engine any more

    def track(self, gen: Generation) -> None:
        """`gen` was made (Model.generation): `live` and `close` reach it until it finishes;
        ModelClosed once the driver is closed."""
        with self._lock:
            if self.closed:
                raise ModelClosed(CLOSED)
            self._live = [g for g in self._live if not g.finished] + [gen]

    def live(self) -> list[Generation]:
        """The generations made and not finished."""
        with self._lock:
            return [g for g in self._live if not g.finished]

    @contextlib.contextmanager
    def driving(self) -> Iterator[None]:
        """Hold `turn` to drive the engine; ModelClosed once the driver is closed (a caller that
        waited for the turn while a close took it finds the engine gone)."""
        with self.turn:
            outer, self._driver = self._driver, threading.get_ident()
            try:
                if self.closed:
                    raise ModelClosed(CLOSED)
                yield
            finally:
                self._driver = outer

    def close(self, timeout: float | None = None) -> bool:
        """Free the engine once nothing drives it: new generations are refused (ModelClosed), the
        live ones cancelled (a lone decode stops mid-token), and the driver's turn awaited, at most
        `timeout` seconds (None: as long as it takes). True when the engine was freed in full; False
        when the turn was still held at the bound (a decode stuck outside llama.cpp's graph, such as
        a read that does not come): then only the workers and the shared memory's names go, and
        llama.cpp's objects and the mappings that decode reads stay until the process exits.
        Idempotent; not from a generation's own thread (an on_chunk callback), which holds the turn."""
        if self._driver == threading.get_ident():
            raise RuntimeError("close() was called from inside one of the model's generations (an on_chunk "
                               "callback); cancel it there, and close the model once the call returned")
        with self._lock:
            self.closed = True
            live = [g for g in self._live if not g.finished]
            if self._alone is not None:
                self.engine.interrupt()
        for g in live:
            self.cancel(g)
        if not self.turn.acquire(timeout=-1 if timeout is None else timeout):
            self.engine.close(in_use=True)
            return False
        try:
            self.engine.close()
        finally:
            self.turn.release()
        return True

    def run(self, gens: Sequence[Generation]) -> list[Completion]:
        """Prefill each of `gens` in order, then decode them together, a step for every one still
        going, until each has ended; their Completions in order. An engine error finishes every
        generation begun (KV rolled back) and is raised; ModelClosed when a close cut them short."""
        done: dict[int, Completion] = {}
        with self.driving():
            try:
                for g in gens:
                    if (c := self.begin(g)) is not None:
                        done[id(g)] = c
                while live := [g for g in gens if id(g) not in done]:
                    for g, c in self.step(live):
                        done[id(g)] = c
            except BaseException as e:
                self._abandon([g for g in gens if id(g) not in done and g.slot.busy], e)
                raise
        if self.closed and any(c.finish_reason == "cancelled" for c in done.values()):
            raise ModelClosed(f"{CLOSED} (it was closed while this generation ran)")
        return [done[id(g)] for g in gens]

    def begin(self, gen: Generation) -> Completion | None:
        """Prefill `gen`; its Completion when it ended there (cancelled), else None.

        A ConfigError (the request cannot run) or an engine error is raised after `gen` was
        finished and its KV rolled back."""
        with self.driving():
            try:
                self._decode([gen], gen.begin)
            except Cancelled as e:
                return gen.finish(e)
            except BaseException as e:
                gen.finish(e)  # raises e again after the KV is rolled back
                raise
        return None

    def step(self, gens: Sequence[Generation]) -> list[tuple[Generation, Completion]]:
        """One decode step for `gens` (begun, not ended) in one llama.cpp batch; returns those that
        ended with their Completions. A cancelled one ends before the step, without decoding.
        An engine error is raised as is: the caller finishes what it began (`run`, the scheduler)."""
        ended: list[tuple[Generation, Completion]] = []
        with self.driving():
            going = []
            for g in gens:
                if g.cancelled:
                    ended.append((g, g.finish(Cancelled())))
                else:
                    going.append(g)
            if not going:
                return ended
            try:
                steps = self._decode(going, lambda: self.engine.step([g.begun for g in going]))
            except Cancelled as e:  # every one of them was cancelled mid-step
                return ended + [(g, g.finish(e)) for g in going]
            for g, decoded in zip(going, steps):
                try:
                    g.take(decoded)
                except Exception as e:  # noqa: BLE001 - its on_chunk failed: this one ends, with that error
                    g.ended, g.done = e, True
            failed: BaseException | None = None
            for g in going:
                if g.done:
                    try:
                        ended.append((g, g.finish()))
                    except BaseException as e:  # noqa: BLE001 - raised once the others are finished
                        failed = failed or e
            if failed is not None:
                raise failed
        return ended

    def cancel(self, gen: Generation) -> None:
        """Stop `gen` (finish_reason "cancelled", KV rolled back); safe from any thread."""
        with self._lock:
            gen.cancelled = True
            if self._decoding and all(g.cancelled for g in self._decoding):
                self.engine.interrupt()

    def decode_alone(self, call: Callable[[], _T], cancelled: Callable[[], bool]) -> _T:
        """Run an engine call that is no generation's (an embedding's decode; the caller holds `turn`),
        interrupted when `interrupt_alone` finds `cancelled` true while it runs, or by `close`."""
        with self._lock:
            self._alone = cancelled
            if cancelled() or self.closed:
                self.engine.interrupt()
        try:
            return call()
        finally:
            with self._lock:
                self._alone = None
                self.engine.clear_interrupt()

    def interrupt_alone(self) -> None:
        """Stop the decode `decode_alone` runs, if its `cancelled` now says so; safe from any thread."""
        with self._lock:
            if self._alone is not None and self._alone():
                self.engine.interrupt()

    def _decode(self, gens: list[Generation], call: Callable[[], _T]) -> _T:
        """Run an engine call for `gens`, interruptible by `cancel` while it runs."""
        with self._lock:
            self._decoding = gens
            if all(g.cancelled for g in gens):
                self.engine.interrupt()
        try:
            return call()
        finally:
            with self._lock:
                self._decoding = []
                self.engine.clear_interrupt()

    def _abandon(self, gens: list[Generation], error: BaseException) -> None:
        """Finish generations an error left begun, rolling back their KV; the first error is the one raised."""
        for g in gens:
            try:
                g.finish(error)
            except BaseException:  # noqa: BLE001, S110 - `error` is raised by the caller
                pass
