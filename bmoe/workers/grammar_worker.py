"""Grammar check: llama.cpp parses each grammar here first, in a process that may die.

Run as `python -m bmoe.workers.grammar_worker MODEL.gguf` so `ps` shows its role. It loads only
the model's vocabulary, then for each request `[text, root, triggers]` (msgpack, stdin) builds
llama.cpp's grammar sampler exactly as generation will and answers `[ok, why]` on stdout. A
grammar that crashes llama.cpp's native parser takes down this process, not the server
(bmoe.chat.grammar_check turns that into an error naming the grammar). It owns no state of the run
and exits on EOF, so it never outlives its coordinator.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile

import msgpack


def _parse_errors(said: str) -> str:
    """What llama.cpp's parser printed on stderr about the grammar ("Undefined rule identifier ...")."""
    lines = [line.split("error parsing grammar:", 1)[1].strip() for line in said.splitlines()
             if "error parsing grammar:" in line]
    return "; ".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the coordinator stops us by closing stdin
    out = sys.stdout.buffer
    from bmoe.base.errors import ConfigError
    from bmoe.seam.llama import Vocab, free_sampler, grammar_rejected, grammar_sampler, init_backend, load_vocab

    init_backend()
    model = load_vocab(args[0]) if len(args) == 1 else None
    why = "" if model else f"llama.cpp could not read the vocabulary of {args}"
    out.write(msgpack.packb(["hello", bool(model), why]))
    out.flush()
    if not model:
        return 0
    vocab = Vocab(model)
    unpacker = msgpack.Unpacker()
    said = tempfile.TemporaryFile()  # llama.cpp's parser prints its reason on stderr, not to its log
    os.dup2(said.fileno(), 2)
    while chunk := os.read(0, 1 << 16):
        unpacker.feed(chunk)
        for text, root, triggers in unpacker:
            said.seek(0)
            said.truncate()
            try:
                free_sampler(grammar_sampler(vocab, (text, root, tuple(triggers))))
                answer = [True, ""]
            except ConfigError as e:
                said.seek(0)
                reason = _parse_errors(said.read().decode(errors="replace"))
                answer = [False, str(grammar_rejected(reason) if reason else e)]
            out.write(msgpack.packb(answer))
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
