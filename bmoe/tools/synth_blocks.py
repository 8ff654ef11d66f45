"""bmoe-synth's tensor bytes: random quantized blocks under scales that give each tensor its std
(K-quant scale packing included), float tensors, and a writer that takes them in chunks, so a
GB-size file is made fast and never whole in memory."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
from gguf import GGUFWriter
from gguf.gguf_writer import WriterState

from bmoe.tools.synth_shape import BLOCK, Shape, Tensor
from bmoe.tools.synth_vocab import EMITTED, ENDS

# The types files written before K-quants had: their bytes come from PCG64 as they always did,
# so an old command still writes the same file. Everything newer draws from SFC64, 7x faster.
_PCG64_QUANTS = ("f16", "q8_0", "q4_0", "mxfp4")
_SELF_PENALTY = 5.0  # how strongly output.weight discourages repeating the current token

# Each type's codes are uniform random bits; these set the scales so a weight has the tensor's
# std and mean ~0. rms/mean of the code values: int8 73.9; 4-bit c-8 4.64; 5-bit c-16 9.25;
# 4-bit c 4.61 (mean 7.5); 5-bit c 9.23 (mean 15.5); 6-bit c-32 18.48; e2m1 2.93.
_K_SCALE = 36  # every sub-block's 6-bit scale (and min): above 15, so the packing's top bits count


def pack_k_scales(scale: int, minimum: int) -> bytes:
    """block_q4_K/q5_K `scales[12]` (ggml-common.h) for eight sub-blocks of one scale and min:
    bytes 0-3 hold scales 0-3 (6 bits) and the top 2 bits of scales 4-7, bytes 4-7 the same for
    the mins, bytes 8-11 the low 4 bits of scales 4-7 and (high nibble) of mins 4-7."""
    q = bytearray(12)
    for j in range(4):
        q[j] = (scale & 63) | ((scale >> 4) << 6)
        q[j + 4] = (minimum & 63) | ((minimum >> 4) << 6)
        q[j + 8] = (scale & 0xF) | ((minimum & 0xF) << 4)
    return bytes(q)


def _f16(x: float) -> np.ndarray:
    return np.frombuffer(np.float16(x).tobytes(), np.uint8)


def _set_scales(blocks: np.ndarray, qtype: str, std: float) -> None:
    """Overwrite the scale fields of random `blocks` so the weights have std `std`, mean ~0."""
    if qtype == "q8_0":  # f16 d, 32 x int8: d*c
        blocks[:, :2] = _f16(std / 73.9)
    elif qtype == "q4_0":  # f16 d, 32 x 4-bit: d*(c-8)
        blocks[:, :2] = _f16(std / 4.64)
    elif qtype == "q5_0":  # f16 d, qh[4], qs[16]: d*(c-16)
        blocks[:, :2] = _f16(std / 9.25)
    elif qtype == "q5_1":  # f16 d, f16 m, qh[4], qs[16]: d*c + m
        d = std / 9.23
        blocks[:, :2], blocks[:, 2:4] = _f16(d), _f16(-15.5 * d)
    elif qtype in ("q4_k", "q5_k"):  # f16 d, f16 dmin, scales[12], (qh[32]), qs: d*sc*c - dmin*m
        rms, mean = (4.61, 7.5) if qtype == "q4_k" else (9.23, 15.5)
        d = std / (_K_SCALE * rms)
        blocks[:, :2], blocks[:, 2:4] = _f16(d), _f16(mean * d)  # dmin*m = mean*d*sc: mean 0
        blocks[:, 4:16] = np.frombuffer(pack_k_scales(_K_SCALE, _K_SCALE), np.uint8)
    elif qtype == "q6_k":  # ql[128], qh[64], int8 scales[16], f16 d: d*sc*(c-32)
        blocks[:, 192:208] = _K_SCALE
        blocks[:, 208:210] = _f16(std / (_K_SCALE * 18.48))
    elif qtype == "mxfp4":  # E8M0 exponent e, 32 x e2m1: 2^(e-127) * {0, ±.5, .., ±6}
        blocks[:, 0] = 127 + round(math.log2(std / 2.93))
    else:
        raise ValueError(f"no random blocks for {qtype}")


def _zero_blocks(blocks: np.ndarray, qtype: str, which: np.ndarray) -> None:
    """Make the blocks `which` selects decode to zeros: their scales become 0."""
    if qtype == "q6_k":
        blocks[which, 208:210] = 0
    elif qtype == "mxfp4":
        blocks[which] = 0  # an all-zero code is 0 whatever the exponent
    else:
        blocks[which, :4 if qtype in ("q5_1", "q4_k", "q5_k") else 2] = 0


_CHUNK_BYTES = 64 << 20  # what one write holds: a 0.5 GB expert tensor is never whole in memory


def quantized_chunks(t: Tensor, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """`t`'s blocks, whole rows at a time: uniformly random codes under the scales of `t.std`.

    Drawing raw bits is far cheaper than quantizing float noise, which matters for GB-size files.
    Chunks hold a multiple of 8 rows, so every chunk but the last is whole 64-bit draws and the
    bytes do not depend on the chunk size. For `output` only whole words and the end tokens get a
    non-zero row, so generated text reads as words (synth_vocab.EMITTED).
    """
    per_block, block_bytes = BLOCK[t.qtype]
    blocks_per_row = t.shape[-1] // per_block
    row_bytes = blocks_per_row * block_bytes
    rows = math.prod(t.shape[:-1])
    step = max(8, _CHUNK_BYTES // row_bytes // 8 * 8)
    keep = None
    if t.fill == "output":
        keep = np.zeros(rows, bool)
        keep[list(EMITTED)] = True
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        raw = rng.bit_generator.random_raw((n * row_bytes + 7) // 8)
        blocks = raw.view(np.uint8)[: n * row_bytes].reshape(n * blocks_per_row, block_bytes)
        _set_scales(blocks, t.qtype, t.std)
        if keep is not None:
            _zero_blocks(blocks, t.qtype, np.repeat(~keep[r0:r0 + n], blocks_per_row))
        yield blocks


def _expert_ids(t: Tensor, n_expert: int, rng: np.random.Generator) -> np.ndarray:
    """deepseek4's token -> expert table: each token's row holds distinct experts."""
    rows, k = t.shape
    return np.argsort(rng.random((rows, n_expert)), axis=1)[:, :k].astype(np.int32)


def _float_data(t: Tensor, rng: np.random.Generator, token_embd: np.ndarray | None) -> np.ndarray:
    if t.fill == "ones":
        return np.ones(t.shape, np.float32)
    data = rng.standard_normal(t.shape, np.float32)
    data *= t.std
    if t.fill == "negative":  # a recurrent layer's decay: below zero, around -1
        data = -np.exp(data)
    if t.fill == "positive":  # a scale: above zero, around 1, different per element
        data = np.exp(data)
    if t.fill == "output":
        assert token_embd is not None, "an f16 output.weight is derived from an f16 token_embd"
        # The residual stream is dominated by the current token's embedding; subtracting the
        # embeddings from the output rows makes that token unlikely to follow itself, so greedy
        # decoding does not settle on one token repeated forever.
        data -= (_SELF_PENALTY / t.shape[1]) * token_embd.astype(np.float32)
        keep = np.zeros(t.shape[0], bool)  # only EMITTED tokens get an output row: words, and ends
        keep[list(EMITTED)] = True
        data[~keep] = 0.0
        # End tokens stay possible but rare, so a test's 32-token generation is not cut short.
        data[list(ENDS)] *= 0.25
    return data.astype(np.float16 if t.qtype == "f16" else np.float32)


def tensor_data(shape: Shape, tensors: Sequence[Tensor], seed: int) -> Iterator[Iterable[np.ndarray]]:
    """Each of `tensors`' bytes in turn, as chunks; the same (shape, tensors, seed) give the same bytes."""
    # Files of the types bmoe-synth always had keep their bytes (PCG64); newer ones use SFC64.
    bit_generator = np.random.PCG64 if shape.quant in _PCG64_QUANTS and not shape.name else np.random.SFC64
    token_embd = None  # an f16 output.weight is derived from the f16 token_embd
    for index, t in enumerate(tensors):
        # One stream per tensor: the bytes of a tensor depend only on (seed, its index).
        rng = np.random.Generator(bit_generator([seed, index]))
        if t.qtype == "i32":
            yield [_expert_ids(t, shape.experts, rng)]
        elif t.qtype in ("f16", "f32"):
            data = _float_data(t, rng, token_embd)
            if t.name == "token_embd.weight":
                token_embd = data
            yield [data]
        else:
            yield quantized_chunks(t, rng)


class ChunkWriter(GGUFWriter):
    """GGUFWriter that takes a tensor's bytes in pieces (its write_tensor_data, chunked)."""

    def write_tensor_chunks(self, chunks: Iterable[np.ndarray]) -> None:
        assert self.fout is not None and self.state in (WriterState.TI_DATA, WriterState.WEIGHTS)
        file_id = next(i for i, tensors in enumerate(self.tensors) if tensors)
        fout = self.fout[file_id]
        info = self.tensors[file_id].pop(next(iter(self.tensors[file_id])))
        self.write_padding(fout, fout.tell())
        written = 0
        for chunk in chunks:
            chunk.tofile(fout)
            written += chunk.nbytes
        assert written == info.nbytes, (written, info.nbytes)
        self.write_padding(fout, written)
        self.state = WriterState.WEIGHTS

    def skip_tensor_data(self) -> None:
        """Leave the next tensor's bytes unwritten: a hole of zeros in a sparse file."""
        assert self.fout is not None and self.state in (WriterState.TI_DATA, WriterState.WEIGHTS)
        file_id = next(i for i, tensors in enumerate(self.tensors) if tensors)
        fout = self.fout[file_id]
        info = self.tensors[file_id].pop(next(iter(self.tensors[file_id])))
        self.write_padding(fout, fout.tell())
        fout.seek(self.ggml_pad(info.nbytes, self.data_alignment), 1)
        fout.truncate()  # the file ends after the hole, even the last one
        self.state = WriterState.WEIGHTS
