"""A request's or a command line's logit bias as llama.cpp's logit-bias sampler takes it: (token id, bias) pairs."""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from typing import Any

from bmoe.base.errors import ConfigError

LogitBias = tuple[tuple[int, float], ...]  # (token id, bias) pairs, as llama.cpp's logit-bias sampler takes them
BIAS_MAX = 100.0  # OpenAI's bound on a logit bias, either way


def logit_bias_of(value: Any) -> LogitBias:
    """OpenAI's logit_bias map (token id, as text or a number → bias), or (id, bias) pairs, as sorted
    (id, bias) pairs; ConfigError naming a key that is not a token id or a bias that is not a number."""
    if isinstance(value, (tuple, list)) and all(isinstance(p, (tuple, list)) and len(p) == 2 for p in value):
        value = dict(value)
    if not isinstance(value, Mapping):
        raise ConfigError(f"logit_bias {value!r}: it maps token ids to biases, e.g. {{\"15043\": -100}}")
    out = []
    for key, bias in value.items():
        try:
            tok = int(key)
        except (TypeError, ValueError):
            raise ConfigError(f"logit_bias: key {key!r} is not a token id (a whole number)") from None
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise ConfigError(f"logit_bias: the bias of token {tok} is {bias!r}, not a number")
        out.append((tok, float(bias)))
    return tuple(sorted(out))


def parse_logit_bias(text: str) -> LogitBias:
    """--logit-bias: TOKEN_ID(+|-)BIAS, comma-separated (llama.cpp's spelling: `15043-100,2+5`)."""
    pairs = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\d+)([+-](?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)", part)
        if m is None:
            raise argparse.ArgumentTypeError(f"{part!r} is not TOKEN_ID+BIAS or TOKEN_ID-BIAS (e.g. 15043-100)")
        pairs[m.group(1)] = float(m.group(2))
    return logit_bias_of(pairs)
