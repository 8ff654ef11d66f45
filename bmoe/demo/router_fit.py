"""The numbers that make the demo a mixture: k-means routers, and a signature per expert.

Routers: per layer, spherical k-means (fixed seed) of the calibration states, after dividing each
dimension by its RMS so a few large dimensions do not decide the clusters. The router row of
expert e is `scale * c_e / d` (c_e the unit centroid, d the per-dimension RMS), so its logit is
`scale * cos(c_e, x / d) * |x / d|`; `scale` is chosen per layer so that, on the calibration
states, the top-k experts hold `TOPK_MASS` of the softmax on average: peaked, not one-hot.

Signatures: every expert is the layer's dense FFN with its output scaled by `1 + eps`, `|eps|`
between g/2 and g (drawn per layer and expert from `SEED`; g = 0.07 * sqrt(top_k), at most 0.3)
and the sign alternating with the expert index, so neighbouring experts always differ by at
least g. The model tolerates that well (perplexity within the Q8_0 requantization noise, answers
stay SmolLM2's), while a wrong expert changes greedy output within a few dozen tokens and a
missing (zero) one at once. Scaling each output row by a random ±g instead cost far more
coherence for the same detectability.
"""

from __future__ import annotations

import math

import numpy as np

SEED = 1234
TOPK_MASS = 0.7  # mean softmax mass of the routed top-k on calibration states
SIGN_GAIN = 0.07  # signature strength: |eps| in [g/2, g] with g = SIGN_GAIN * sqrt(top_k), at most 0.3
KMEANS_ITERS = 30


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
        for idle in np.flatnonzero(counts == 0):
            worst = int(best.argmin())
            new[worst] = idle
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
