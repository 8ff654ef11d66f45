"""The seam: the only code that touches llama.cpp.

ggml's compute graph is reached through the eval callback: `ggml_mirror.py` mirrors its tensor struct
and reads the nodes, `capture.py` learns a model's graph from one warm-up decode, `eval_hook.py` is the
callback while bmoe streams (`eval_filter.py` answers it in C where the answer is known); `populate.py`
lets llama.cpp's load map the file without reading it (struct layouts, node names, op codes:
tests/test_seam.py pins each fact). `llama.py` is llama.cpp's own API (model, context, KV, decode,
vocab, samplers, chat templates). Nothing here imports a bmoe module above the base package: a grammar
arrives as GBNF text, settings as plain values.
"""

from bmoe.seam import llama
from bmoe.seam.capture import NORM_NONE, NORM_SOFTMAX, Capture, ExpertBias, ExpertScale, ExpertTensor, Scratch
from bmoe.seam.eval_filter import FastTables
from bmoe.seam.eval_hook import EvalHook, NodeTap, deliver
from bmoe.seam.ggml_mirror import last_router_input, moe_weights, router_input, router_scores, tensor_at
from bmoe.seam.populate import no_populate
