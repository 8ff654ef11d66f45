"""The demo MoE built from SmolLM2-135M-Instruct (`build`: `bmoe-demo`, and the model a run without
-m uses, built on first use): its source GGUF (`source`), calibration (`calibrate`,
`calibration_text`), routers (`routers`) and the file written (`write`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bmoe.base.surface import lazy

if TYPE_CHECKING:
    from bmoe.demo.build import build_demo, default_model, default_path, main

__getattr__, __all__ = lazy(
    __name__,
    {
        "bmoe.demo.build": ["build_demo", "default_model", "default_path", "main"],
    },
)
