"""Routing traces: what each token routed at every MoE layer, in bmoe's format or route_trace v1.

`bmoe-cli --route-trace PATH` writes JSON lines (a header, then one line per decode token) and
`PATH.hidden.npy` with each token's router-input hidden state per layer, so predictors and cache
policies can be evaluated offline against the model's own routers (bmoe.replay.stats,
bmoe.replay.policies). With a `.csv` PATH it writes route_trace v1 instead, the format of the C++
project bmoe descends from (its `--route-trace`; ../shared/traces/README.md describes it), so
traces move both ways: `Trace.read` takes either, and a v1 file carries the model's shape (layers,
experts, top-k, each layer's expert bytes) in its header, enough to replay it with no model file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

V1_MAGIC = "# route_trace v1"
V1_COLUMNS = "turn,phase,step,layer,slot,expert,weight,residency,expert_bytes"
PROMPT, DECODE = 0, 1  # v1's phase column

TokenRoutes = dict[int, list[int]]  # MoE layer -> the token's routed experts there, best first
Weights = dict[int, list[float]]  # MoE layer -> their router weights, as the layer applies them


@dataclass
class TraceWriter:
    path: Path
    header: dict
    active: bool = False
    routes: TokenRoutes = field(default_factory=dict)
    weights: Weights = field(default_factory=dict)
    predicted: dict[int, list[int]] = field(default_factory=dict)
    hidden: dict[int, np.ndarray] = field(default_factory=dict)
    steps: list[dict] = field(default_factory=list)
    hidden_rows: list[np.ndarray] = field(default_factory=list)
    prompting: bool = False  # a prompt is being prefilled (Engine.begin / prefill)
    prompt: list[TokenRoutes] = field(default_factory=list)  # the first prompt's tokens' routing (v1 writes it)
    prompt_weights: list[Weights] = field(default_factory=list)
    prompt_base: int = -1  # the prompt row of the decode under way's first token; -1: not recording it

    def begin_batch(self, n_tokens: int) -> None:
        """A llama_decode starts. While the first prompt is prefilled (before any decode step is
        recorded) its tokens are the prompt's next rows."""
        self.prompt_base = -1
        if self.prompting and not self.steps:
            self.prompt_base = len(self.prompt)
            self.prompt += [{} for _ in range(n_tokens)]
            self.prompt_weights += [{} for _ in range(n_tokens)]

    def on_route(self, layer: int, ids: np.ndarray, predicted: set[int] | None = None,
                 at: np.ndarray | None = None) -> None:
        """Record the last token's routing and, with --spec-gate, what was predicted for it in time;
        in the prompt, the routing of each row, `at` being the rows' tokens within the decode. An id
        below 0 is a position that reads nothing (bmoe.streaming.lossy.DROPPED): not an expert, left out."""
        if self.active:
            self.routes[layer] = [int(x) for x in ids[-1]]
            if predicted is not None:
                self.predicted[layer] = sorted(int(x) for x in predicted)
        elif self.prompt_base >= 0 and at is not None:
            for r, t in enumerate(at):
                self.prompt[self.prompt_base + int(t)][layer] = [int(x) for x in ids[r]]

    def on_weights(self, layer: int, shares: np.ndarray, at: np.ndarray | None = None) -> None:
        """The last token's router weights at the layer, each expert's share of the top-k's weight (in the
        prompt, each row's, as on_route)."""
        if self.active:
            self.weights[layer] = [float(x) for x in shares[-1]]
        elif self.prompt_base >= 0 and at is not None:
            for r, t in enumerate(at):
                self.prompt_weights[self.prompt_base + int(t)][layer] = [float(x) for x in shares[r]]

    def on_router_input(self, layer: int, h: np.ndarray) -> None:
        if self.active:
            self.hidden[layer] = h[-1].astype(np.float32)

    def end_step(self, token: int) -> None:
        layers = self.header["layers"]
        routes, weights = _experts_only(self.routes, self.weights)
        step = {"step": len(self.steps) + 1, "token": token,
                "routes": {str(layer): routes.get(layer, []) for layer in layers}}
        if self.predicted:
            step["predicted"] = {str(layer): ids for layer, ids in self.predicted.items()}
        if weights:
            step["weights"] = {str(layer): w for layer, w in weights.items()}
        self.steps.append(step)
        n_embd = self.header["n_embd"]
        self.hidden_rows.append(np.stack([self.hidden.get(layer, np.full(n_embd, np.nan, np.float32))
                                          for layer in layers]))
        self.routes, self.weights, self.hidden, self.predicted = {}, {}, {}, {}

    def write(self) -> None:
        if self.path.suffix == ".csv":
            self.trace().write_v1(self.path)
        else:
            self._write_json()
        if self.hidden_rows:
            np.save(hidden_path(self.path), np.stack(self.hidden_rows))

    def trace(self) -> Trace:
        """What was recorded, as a Trace."""
        weights = [{int(k): v for k, v in s.get("weights", {}).items()} for s in self.steps]
        prompt = [_experts_only(r, w) for r, w in zip(self.prompt, self.prompt_weights)]
        return Trace(self.header, list(self.header["layers"]), [{int(k): v for k, v in s["routes"].items()}
                                                                 for s in self.steps],
                     None, weights=weights if any(weights) else None,
                     prompt=[r for r, _ in prompt], prompt_weights=[w for _, w in prompt] if self.prompt else None,
                     expert_bytes={int(k): v for k, v in self.header.get("expert_bytes", {}).items()})

    def _write_json(self) -> None:
        with open(self.path, "w") as f:
            f.write(json.dumps({"kind": "header", **self.header}) + "\n")
            for s in self.steps:
                f.write(json.dumps({"kind": "token", **s}) + "\n")


def _experts_only(routes: TokenRoutes, weights: Weights) -> tuple[TokenRoutes, Weights]:
    """One token's routing without the positions that read no expert (ids below 0), weights aligned."""
    kept = {layer: [i for i, e in enumerate(ids) if e >= 0] for layer, ids in routes.items()}
    return ({layer: [routes[layer][i] for i in ix] for layer, ix in kept.items()},
            {layer: [w[i] for i in kept.get(layer, range(len(w))) if i < len(w)] for layer, w in weights.items()})


def hidden_path(trace: Path) -> Path:
    return Path(str(trace) + ".hidden.npy")


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file, the line and the fix."""


@dataclass
class Trace:
    """One run's routing. `routes[s]` is decode token s's; `prompt` the prompt tokens' (v1 files
    record them; bmoe's JSON traces hold decode only). `weights`/`prompt_weights`, when recorded,
    align with them. `expert_bytes[layer]` is one whole expert's bytes (v1 header), which lets a
    replay run without the model file. `header` holds at least arch, n_expert, top_k and model."""

    header: dict
    layers: list[int]
    routes: list[TokenRoutes]
    hidden: np.ndarray | None
    prompt: list[TokenRoutes] = field(default_factory=list)
    weights: list[Weights] | None = None
    prompt_weights: list[Weights] | None = None
    expert_bytes: dict[int, int] = field(default_factory=dict)
    dense_bytes: dict[int, int] = field(default_factory=dict)

    @classmethod
    def read(cls, path: str | Path) -> Trace:
        """Either format, told apart by the first line."""
        path = Path(path)
        with open(path, errors="replace") as f:
            first = f.readline().strip()
        if first == V1_MAGIC:
            return cls.read_v1(path)
        return cls._read_json(path)

    @classmethod
    def _read_json(cls, path: Path) -> Trace:
        try:
            lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        except json.JSONDecodeError as e:
            raise TraceError(f"{path} is neither a bmoe route trace (JSON lines) nor route_trace v1 CSV "
                             f"({e}); write one with bmoe-cli --route-trace") from None
        if not lines or lines[0].get("kind") != "header":
            raise TraceError(f"{path} is not a bmoe route trace (no header line); write one with --route-trace")
        header = lines[0]
        tokens = [x for x in lines[1:] if x.get("kind") == "token"]
        routes = [{int(k): v for k, v in x["routes"].items()} for x in tokens]
        weights = [{int(k): v for k, v in x.get("weights", {}).items()} for x in tokens]
        hp = hidden_path(path)
        hidden = np.load(hp) if hp.exists() else None
        return cls(header, list(header["layers"]), routes, hidden, weights=weights if any(weights) else None,
                   expert_bytes={int(k): v for k, v in header.get("expert_bytes", {}).items()})

    @classmethod
    def read_v1(cls, path: Path) -> Trace:
        """route_trace v1: `#` header lines (the model's shape, one line per MoE layer), then CSV rows
        turn,phase,step,layer,slot,expert,weight,… in step order. Rows of the first turn are read."""
        header: dict = {}
        expert_bytes: dict[int, int] = {}
        dense_bytes: dict[int, int] = {}
        steps: dict[tuple[int, int], tuple[TokenRoutes, Weights]] = {}
        with open(path) as f:
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line or line == V1_MAGIC:
                    continue
                if line.startswith("#"):
                    kv = dict(x.split("=", 1) for x in line[1:].split() if "=" in x)
                    if "layer" in kv:
                        layer = int(kv["layer"])
                        expert_bytes[layer] = int(kv.get("expert_bytes", 0))
                        dense_bytes[layer] = int(kv.get("dense_bytes", 0))
                    else:
                        header.update(kv)
                    continue
                if line == V1_COLUMNS:
                    continue
                cells = line.split(",")
                try:
                    turn, phase, step, layer, _slot, expert = (int(x) for x in cells[:6])
                    weight = float(cells[6])
                except (ValueError, IndexError):
                    raise TraceError(f"{path}:{n}: not a route_trace v1 row ({V1_COLUMNS}): {line[:80]!r}") from None
                if turn != 0:
                    break
                routes, weights = steps.setdefault((phase, step), ({}, {}))
                routes.setdefault(layer, []).append(expert)
                weights.setdefault(layer, []).append(weight)
        missing = [k for k in ("n_expert", "n_expert_used") if k not in header]
        if missing:
            raise TraceError(f"{path}: the route_trace v1 header lacks {', '.join(missing)}; "
                             f"its first lines must say n_layer=… n_expert=… n_expert_used=…")
        layers = sorted(expert_bytes) or sorted({layer for r, _ in steps.values() for layer in r})
        header = {"model": header.get("model", ""), "arch": header.get("arch", ""),
                  "n_layer": int(header.get("n_layer", len(layers))), "n_expert": int(header["n_expert"]),
                  "top_k": int(header["n_expert_used"]), "layers": layers}
        ordered = [steps[k] for k in sorted(steps)]
        phases = [k[0] for k in sorted(steps)]
        prompt = [s for s, p in zip(ordered, phases) if p == PROMPT]
        decode = [s for s, p in zip(ordered, phases) if p != PROMPT]
        return cls(header, layers, [r for r, _ in decode], None, prompt=[r for r, _ in prompt],
                   weights=[w for _, w in decode], prompt_weights=[w for _, w in prompt],
                   expert_bytes=expert_bytes, dense_bytes=dense_bytes)

    def write_v1(self, path: str | Path) -> None:
        """This trace as route_trace v1 (prompt rows, then decode rows; no residency recorded: 0)."""
        h = self.header
        out = [V1_MAGIC, f"# model={h.get('model', '')} arch={h.get('arch', '')} "
                         f"n_layer={h.get('n_layer', len(self.layers))} n_expert={h['n_expert']} "
                         f"n_expert_used={h['top_k']}"]
        out += [f"# layer={layer} expert_bytes={self.expert_bytes.get(layer, 0)} "
                f"dense_bytes={self.dense_bytes.get(layer, 0)}" for layer in self.layers]
        out.append(V1_COLUMNS)
        phases = [(PROMPT, self.prompt, self.prompt_weights), (DECODE, self.routes, self.weights)]
        step = 0
        for phase, routes, weights in phases:
            for i, r in enumerate(routes):
                w = weights[i] if weights else {}
                for layer in self.layers:
                    ws = w.get(layer, [])
                    for slot, e in enumerate(r.get(layer, [])):
                        weight = f"{ws[slot]:.9g}" if slot < len(ws) else "0"
                        out.append(f"0,{phase},{step},{layer},{slot},{e},{weight},0,"
                                   f"{self.expert_bytes.get(layer, 0)}")
                step += 1
        Path(path).write_text("\n".join(out) + "\n")
