"""The demo MoE built from SmolLM2-135M-Instruct (`build`: `bmoe-demo`, and the model a run without
-m uses, built on first use): its source GGUF (`source`), calibration (`calibrate`,
`calibration_text`), routers (`routers`) and the file written (`write`).
"""
