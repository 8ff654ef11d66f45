"""The demo's calibration: every layer's router input, captured while dense SmolLM2 reads real text.

The router input of the MoE graph is the RMS-normed FFN input, the graph node `ffn_norm-L`
(src/models/llama.cpp), which is what `ffn_gate_inp` multiplies. The dense model computes the
same node, so its states over `bmoe.demo.calibration_text`, copied by `bmoe.seam.NodeTap`, are
what the routers are fitted to. The states do not depend on the expert count: they are kept in the
cache dir and shared by every demo size.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

CALIBRATION_VERSION = 1  # bump when calibrate() captures something else (it keys the cached states)
NORM_NODE = "ffn_norm"  # router input in llama.cpp's llama graph: cb(cur, "ffn_norm", il)


def _render_dialogue(model: Any, turns: tuple[tuple[str, str], ...]) -> str:
    """A whole dialogue in SmolLM2's own chat template, so calibration sees chat as the CLI sends it."""
    from bmoe.seam import llama

    tmpl = llama.chat_template(model)
    text = llama.apply_template(tmpl, turns, False) if tmpl else None
    if text is None:
        raise RuntimeError("llama.cpp could not render SmolLM2's chat template")
    return text


def calibrate(src: Path, say: Callable[[str], None], threads: int = 0) -> list[np.ndarray]:
    """Router-input states of every layer over the calibration text: one [n_tokens, n_embd] array per layer.

    Each passage is one sequence decoded with logits requested for every token, so the last
    layer (which llama.cpp computes only for output rows) sees every token too. The first token
    of each passage is dropped: its state is the attention-sink outlier every sequence has.
    """
    from bmoe import seam
    from bmoe.demo.calibration_text import DIALOGUES, PASSAGES
    from bmoe.seam import llama
    from bmoe.seam.llama import Vocab, init_backend, load_model, new_context

    init_backend()
    model = load_model(src)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {src}")
    ctx = None
    try:
        rows: list[list[np.ndarray]] = [[] for _ in range(llama.n_layer(model))]
        tap = seam.NodeTap((NORM_NODE,), lambda _name, layer, r: rows[layer].append(r))
        vocab = Vocab(model)
        texts = list(PASSAGES) + [_render_dialogue(model, d) for d in DIALOGUES]
        docs = [vocab.tokenize(t, add_special=False) for t in texts]
        longest = max(len(d) for d in docs)
        n_ctx = 1 << max(8, math.ceil(math.log2(longest)))
        ctx = new_context(model, n_ctx, threads, tap.c_callback, n_ubatch=n_ctx)
        total = sum(len(d) for d in docs)
        done, last = 0, 0.0
        for doc in docs:
            llama.kv_clear(ctx)
            before = [len(r) for r in rows]
            rc, _ = llama.decode(ctx, [(0, doc, 0)], every_logit=True)
            if tap.error is not None:
                raise tap.error
            if rc != 0:
                raise RuntimeError(f"llama_decode failed with code {rc} during calibration")
            for layer, got_rows in enumerate(rows):
                got = sum(r.shape[0] for r in got_rows[before[layer]:])
                if got != len(doc):
                    raise RuntimeError(f"layer {layer} produced {got} router-input rows for {len(doc)} tokens")
                # drop position 0 (first row of this document's first chunk)
                got_rows[before[layer]] = got_rows[before[layer]][1:]
            done += len(doc)
            now = time.monotonic()
            if now - last >= 1.0 or done == total:
                last = now
                say(f"calibration: {done}/{total} tokens ({100 * done // total}%)")
        return [np.concatenate(r) for r in rows]
    finally:
        if ctx:
            llama.free_context(ctx)
        llama.free_model(model)


def _calibration_key(src: Path) -> str:
    """What the states depend on: the source file, this capture, llama.cpp's version and the text."""
    from bmoe.demo import calibration_text
    from bmoe.seam.llama import BINDINGS_VERSION

    h = hashlib.sha256()
    with open(src, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    h.update(repr((CALIBRATION_VERSION, BINDINGS_VERSION, calibration_text.PASSAGES,
                   calibration_text.DIALOGUES)).encode())
    return h.hexdigest()[:16]


def calibration_states(src: Path, cache: Path, say: Callable[[str], None]) -> list[np.ndarray]:
    """`calibrate`'s states rounded to float16, kept in `cache` so that every demo size built
    there shares one calibration run."""
    path = cache / f"calibration-{_calibration_key(src)}.npy"
    try:
        states = np.load(path)
        if states.ndim == 3 and states.dtype == np.float16:
            say(f"calibration: reusing {path}")
            return list(states)
    except (OSError, ValueError):
        pass
    states = np.stack(calibrate(src, say)).astype(np.float16)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            np.save(f, states)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        say(f"calibration: could not keep {path} ({e.strerror}); continuing")
    return list(states)
