"""Every grammar is parsed by llama.cpp in a throwaway process before the engine sees it.

llama.cpp's grammar parser is native code that crashes the process, rather than raising, on
inputs nobody bounded (bmoe.chat.limits bounds the ones we know of), and takes time that grows with
the square of a grammar's alternatives (its first stacks are deduplicated pairwise: 80000 one-letter
alternatives, 0.8 MB, take 15 s). So the first time a grammar is seen it goes to a checker process
(bmoe.workers.grammar_worker) that builds the same sampler generation will build: if that process
dies or takes longer than `deadline_s`, the request gets a GrammarError naming its grammar and the
caller goes on; the checker is started again for the next one. There are `checkers` processes, so
that many grammars are parsed at once (a check waits for a free one). Grammars that passed are
remembered (a tool list or a schema comes back with every request of an agent), so a grammar costs
one round trip to a checker once; `known` says so without waiting.
"""

from __future__ import annotations

import collections
import os
import queue
import select
import signal
import subprocess
import threading
import time
from typing import Any

import msgpack

from bmoe import workers
from bmoe.chat.grammar import Grammar, GrammarError, check_gbnf

CHECK_S = 10.0  # one grammar's parse; a longer one is refused as too complex
START_S = 120.0  # the checker's start (Python, llama.cpp, the vocabulary) on a loaded machine
REMEMBERED = 256  # grammars that passed, most recent kept


class Checker:
    """One checker process, started on first use and again after it died or was killed; one caller at a time."""

    def __init__(self, cmd: list[str]) -> None:
        self.cmd = cmd
        self.proc: subprocess.Popen[bytes] | None = None
        self.unpacker = msgpack.Unpacker()

    def ask(self, g: Grammar, deadline_s: float, bound: str) -> tuple[bool, str]:
        """Whether llama.cpp takes `g`, and its complaint if not (`bound` names what sets `deadline_s`)."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(msgpack.packb([g.text, g.root, list(g.triggers)]))
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died: the read below finds out how
        answer = self._read(deadline_s)
        if answer is None:
            self.stop(kill=True)
            named = f" (the bound: {bound})" if bound else ""
            return False, f"llama.cpp took longer than {deadline_s:g} s to parse the grammar{named}; simplify it"
        if answer is EOFError:
            code = self.stop()
            how = f"signal {-code}" if code < 0 else f"exit code {code}"
            return False, f"llama.cpp's grammar parser crashed on this grammar ({how}); simplify it"
        ok, why = answer
        return bool(ok), (why.removeprefix("grammar: ") if not ok else "")

    def _start(self) -> None:
        self.stop()
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.unpacker = msgpack.Unpacker()
        hello = self._read(START_S)
        if not isinstance(hello, list) or hello[:2] != ["hello", True]:
            self.stop()
            why = hello[2] if isinstance(hello, list) else "it did not start"
            raise GrammarError(f"grammar: the grammar checker could not start ({why}); see --verbose", "grammar")

    def _read(self, timeout: float) -> Any:
        """The checker's next answer; None when it did not come in time, EOFError when it died."""
        assert self.proc is not None and self.proc.stdout is not None
        fd, end = self.proc.stdout.fileno(), time.monotonic() + timeout
        while True:
            for msg in self.unpacker:
                return msg
            left = end - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return EOFError
            self.unpacker.feed(chunk)

    def stop(self, kill: bool = False) -> int:
        """End the process (EOF, then a kill if it hangs; at once with `kill`); its exit code."""
        proc, self.proc = self.proc, None
        if proc is None:
            return 0
        if kill:
            proc.kill()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except BrokenPipeError:
                    pass
        try:
            return proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            return proc.wait()


class GrammarCheck:
    """The checker processes for one model file (`checkers` of them, each started on first use); thread-safe.
    `bound` names what sets `deadline_s` in the error of a grammar past it (bmoe-server's flag)."""

    def __init__(self, model_path: str, deadline_s: float = CHECK_S, checkers: int = 1, bound: str = "") -> None:
        cmd = workers.command("bmoe.workers.grammar_worker", model_path)
        self.deadline_s = deadline_s
        self.bound = bound
        self.checkers = [Checker(cmd) for _ in range(checkers)]
        self.idle: queue.SimpleQueue[Checker] = queue.SimpleQueue()
        for c in self.checkers:
            self.idle.put(c)
        self.passed: collections.OrderedDict[tuple[str, str, tuple[str, ...]], None] = collections.OrderedDict()
        self.lock = threading.Lock()  # over `passed`

    def known(self, g: Grammar) -> bool:
        """Whether `g` passed already (then `check` returns at once)."""
        with self.lock:
            if (g.text, g.root, g.triggers) not in self.passed:
                return False
            self.passed.move_to_end((g.text, g.root, g.triggers))
            return True

    def check(self, g: Grammar) -> None:
        """GrammarError when `g` is too large (bmoe.chat.grammar.check_gbnf), when llama.cpp refuses it,
        or when parsing it crashed or outlasted the deadline."""
        check_gbnf(g)
        if self.known(g):
            return
        checker = self.idle.get()
        try:
            ok, why = checker.ask(g, self.deadline_s, self.bound)
        finally:
            self.idle.put(checker)
        if not ok:
            raise GrammarError(f"{g.where}: {why}", g.where)
        with self.lock:
            self.passed[(g.text, g.root, g.triggers)] = None
            if len(self.passed) > REMEMBERED:
                self.passed.popitem(last=False)

    def close(self) -> None:
        """Stop every checker, each once its check in progress (if any) has ended; a later check starts one again."""
        stopped = [self.idle.get() for _ in self.checkers]
        for c in stopped:
            c.stop()
            self.idle.put(c)
