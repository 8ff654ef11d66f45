"""How a loaded model's MoE layers route, and which of bmoe's router-side features can follow it.

Read at load from the warm-up graph (`bmoe.seam.Capture.gating`: the nodes `build_moe_ffn` names in
src/llama-graph.cpp) and the file's metadata, not from a table of architectures: the gating op
(softmax, sigmoid, sqrt of softplus, or the logits themselves), a selection bias (`exp_probs_b`,
added for the choice only), a group limit (`expert_group_count` > 1), routing weights multiplied into
the experts' input instead of their output (llama4) and hash layers whose ids are a token table's row
(deepseek4's `ffn_gate_tid2eid`). The spec-gate's predictor (bmoe.workers.routers) reproduces the
gating; where it cannot, and where a lossy mode would mean something else than on the other models,
the feature is refused for the model with the reason (docs/architectures.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from bmoe.base.gguf_table import read_table
from bmoe.base.model_files import ModelFiles

SOFTMAX, SIGMOID, SQRT_SOFTPLUS, LOGITS = "softmax", "sigmoid", "sqrt_softplus", "logits"
_FUNC = {"SOFT_MAX": SOFTMAX, "SIGMOID": SIGMOID, "SQRT": SQRT_SOFTPLUS}

# Architectures whose router reads a mix of several residual streams (hyper-connections): layer L+1's
# router input is a per-layer gated mix of 4 streams, which layer L's router input does not give.
HYPER_CONNECTIONS = {
    "qwen4exp": "its router input is layer L's own hyper-connection mix of 4 residual streams (hc_mixed-L), "
                "and layer L+1 mixes them with other weights",
    "deepseek4": "its router input is an RMS norm of layer L's own hyper-connection pre-mix of 4 residual "
                 "streams (hc_ffn_pre-L), and layer L+1 mixes them with other weights",
}


@dataclass(frozen=True)
class Gating:
    """How the routed layers of one model choose and weigh their experts."""

    arch: str
    func: str  # SOFTMAX, SIGMOID, SQRT_SOFTPLUS, LOGITS (top-k of the logits: gpt-oss, llama4's choice)
    biased: bool  # a selection bias is added to the probabilities for the choice only
    groups: tuple[int, int]  # (expert_group_count, expert_group_used_count); (0, 0) without a group limit
    weights_into_input: bool  # the weights scale the experts' input (llama4), not their output
    hash_layers: tuple[int, ...]  # layers whose ids are the token's row of a table (no ranking)
    mixed: str = ""  # the layers disagree: what differs (nothing can follow such a model)


def read_gating(files: ModelFiles, per_layer: dict[int, dict[str, str]]) -> Gating:
    """The model's gating from the capture's per-layer nodes (`Capture.gating`) and its metadata."""
    hash_layers = tuple(sorted(layer for layer, g in per_layer.items() if g.get("topk") == "GET_ROWS"))
    routed = [g for layer, g in sorted(per_layer.items()) if layer not in hash_layers]
    kinds = {(_FUNC.get(g.get("probs", ""), LOGITS), "probs_biased" in g, "group_topk" in g,
              g.get("weighted") == "input") for g in routed}
    func, biased, grouped, into_input = sorted(kinds)[0] if kinds else (SOFTMAX, False, False, False)
    groups = (0, 0)
    if grouped:
        fields = read_table(files.paths[0]).fields
        groups = (int(fields.get(f"{files.arch}.expert_group_count") or 0),
                  int(fields.get(f"{files.arch}.expert_group_used_count") or 0))
    mixed = "" if len(kinds) <= 1 else f"its routed layers gate differently ({sorted(kinds)})"
    return Gating(files.arch, func, biased, groups, into_input, hash_layers, mixed)


def spec_gate_refusal(g: Gating, router_norm_known: bool) -> str | None:
    """Why the spec-gate's predictor cannot follow this model's routing, or None."""
    if g.arch in HYPER_CONNECTIONS:
        return f"--spec-gate cannot predict {g.arch}'s routing: {HYPER_CONNECTIONS[g.arch]}"
    if not router_norm_known:
        return (f"--spec-gate cannot predict {g.arch}'s routing: bmoe does not know which weights scale its "
                "router's input (bmoe.workers.routers.ROUTER_NORM)")
    if g.mixed:
        return f"--spec-gate cannot predict {g.arch}'s routing: {g.mixed}"
    if g.hash_layers:
        return (f"--spec-gate cannot predict {g.arch}'s routing: its hash layers {list(g.hash_layers)} take their "
                "experts from the token, which the gate is not sent")
    return None


def lossy_refusal(g: Gating, on: dict[str, str]) -> str | None:
    """Why the lossy settings that are on (`on`: setting name -> as the user wrote it) would not mean on
    this model what docs/lossy.md defines, or None."""
    if not on:
        return None
    what = " and ".join(on.values())
    if g.weights_into_input:
        return (f"{what}: {g.arch} multiplies each expert's routing weight (an unnormalised sigmoid) into the "
                "expert's input, not its output, so dropping or replacing an expert does not mean what these "
                "settings define; run without them")
    if g.hash_layers:
        return (f"{what}: {g.arch}'s hash layers {list(g.hash_layers)} take their experts from a token table "
                "(ffn_gate_tid2eid), not a ranking these settings could cut or substitute in; run without them")
    if g.mixed:
        return f"{what}: {g.mixed}; run without them"
    if g.groups[0] > 1 and "cache_routing" in on:
        return (f"{on['cache_routing']}: {g.arch} limits each token's experts to {g.groups[1]} of {g.groups[0]} "
                "groups, and a cached substitute could come from a group it masked out; run without it")
    return None
