"""The seam: the only code that touches llama.cpp.

`graph.py` reaches into ggml's compute graph through the eval callback (struct layout, node
names, op codes; tests/test_seam.py pins each fact); `llama.py` is llama.cpp's own API (model,
context, KV, decode, vocab, samplers, chat templates). Nothing here imports a bmoe module above
the base package: a grammar arrives as GBNF text, settings as plain values.
"""

from bmoe.seam import llama
from bmoe.seam.graph import (
    NORM_NONE,
    NORM_SOFTMAX,
    Capture,
    EvalHook,
    ExpertBias,
    ExpertScale,
    ExpertTensor,
    NodeTap,
    deliver,
    last_router_input,
    moe_weights,
    no_populate,
    router_input,
    router_scores,
    tensor_at,
)
