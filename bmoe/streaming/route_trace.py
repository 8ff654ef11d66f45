"""Routing traces: what each decode token routed at every MoE layer.

`bmoe-cli --route-trace PATH` writes JSON lines (a header, then one line per
token) and `PATH.hidden.npy` with each token's router-input hidden state per
layer, so predictors and cache policies can be evaluated offline against the
model's own routers (bmoe.replay.stats, bmoe.replay.policies).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class TraceWriter:
    path: Path
    header: dict
    active: bool = False
    routes: dict[int, list[int]] = field(default_factory=dict)
    predicted: dict[int, list[int]] = field(default_factory=dict)
    hidden: dict[int, np.ndarray] = field(default_factory=dict)
    steps: list[dict] = field(default_factory=list)
    hidden_rows: list[np.ndarray] = field(default_factory=list)

    def on_route(self, layer: int, ids: np.ndarray, predicted: set[int] | None = None) -> None:
        """Record the last token's routing and, with --spec-gate, what was predicted for it in time."""
        if self.active:
            self.routes[layer] = [int(x) for x in ids[-1]]
            if predicted is not None:
                self.predicted[layer] = sorted(int(x) for x in predicted)

    def on_router_input(self, layer: int, h: np.ndarray) -> None:
        if self.active:
            self.hidden[layer] = h[-1].astype(np.float32)

    def end_step(self, token: int) -> None:
        layers = self.header["layers"]
        step = {"step": len(self.steps) + 1, "token": token,
                "routes": {str(layer): self.routes.get(layer, []) for layer in layers}}
        if self.predicted:
            step["predicted"] = {str(layer): ids for layer, ids in self.predicted.items()}
        self.steps.append(step)
        n_embd = self.header["n_embd"]
        self.hidden_rows.append(np.stack([self.hidden.get(layer, np.full(n_embd, np.nan, np.float32))
                                          for layer in layers]))
        self.routes, self.hidden, self.predicted = {}, {}, {}

    def write(self) -> None:
        with open(self.path, "w") as f:
            f.write(json.dumps({"kind": "header", **self.header}) + "\n")
            for s in self.steps:
                f.write(json.dumps({"kind": "token", **s}) + "\n")
        if self.hidden_rows:
            np.save(hidden_path(self.path), np.stack(self.hidden_rows))


def hidden_path(trace: Path) -> Path:
    return Path(str(trace) + ".hidden.npy")


@dataclass
class Trace:
    header: dict
    layers: list[int]
    routes: list[dict[int, list[int]]]
    hidden: np.ndarray | None

    @classmethod
    def read(cls, path: str | Path) -> Trace:
        path = Path(path)
        lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        if not lines or lines[0].get("kind") != "header":
            raise ValueError(f"{path} is not a bmoe route trace (no header line); write one with --route-trace")
        header = lines[0]
        routes = [{int(k): v for k, v in x["routes"].items()} for x in lines[1:] if x.get("kind") == "token"]
        hp = hidden_path(path)
        hidden = np.load(hp) if hp.exists() else None
        return cls(header, list(header["layers"]), routes, hidden)
