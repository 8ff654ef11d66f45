"""How OpenMP's idle threads wait, set before llama.cpp loads libgomp: asleep, not spinning.

ggml's CPU backend is an OpenMP build here: each graph piece runs in one OpenMP parallel region, and
between regions libgomp by default keeps the idle worker spinning for a while. A streaming decode
computes a token in many pieces (every stop of the eval callback ends one), and between them Python,
the I/O lanes and the spec-gate need the very cores a spinning worker holds; so does any other
program on a shared machine or a phone. `OMP_WAIT_POLICY=PASSIVE` lets the worker sleep at once
(what it is worth, busy and quiet: docs/architecture.md, "The llama.cpp seam"). It is set only when
the user has not set it, and it changes no output: the same threads compute the same pieces.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
