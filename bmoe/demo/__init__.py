"""The demo MoE built from SmolLM2-135M-Instruct (`build`: `bmoe-demo`, and the model a run without
-m uses, built on first use): its source GGUF (`smollm2`), calibration (`calibrate`,
`calibration_text`), routers (`router_fit`) and the file written (`write`).
"""
