"""The session's line protocol (shared/spec/telemetry.md, "Session mode"): requests in, tags out.

Pure: no llama.cpp, no engine. bmoe.edges.session serves it, bmoe.edges.session_client speaks it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

NO_ID = -1
DONE_KEYS = ("id", "cancelled", "tokens", "tok_s", "prefill_s", "load_s", "cache_hit_pct", "n_prompt",
             "n_past", "cache_resident_mib", "cache_budget_mib", "spec_recall_pct", "stall_s_tok",
             "mgmt_s_tok", "text")
# bmoe's, after the contract's, in a session loaded with lossy routing (bmoe.streaming.lossy): what it did
# to this generation
LOSSY_DONE_KEYS = ("lossy", "experts_per_token", "dropped_tok", "substituted_tok", "weight_changed_pct")
# bmoe's, in every BMOE_DONE: the MiB the I/O lanes copied from the page cache instead of reading flash
PAGE_CACHE_DONE_KEYS = ("page_cache_mib",)
# bmoe's, last in a session loaded with --draft (bmoe.engine.drafts): the tokens drafted, those accepted, and the MiB
# read for experts only the verify steps' drafted rows routed
DRAFT_DONE_KEYS = ("drafted", "accepted", "draft_extra_mib")
CANCEL, CLOSE, PROFILE = "cancel", "close", "profile"


def safe(text: str) -> str:
    """Text that encodes as UTF-8 (lone surrogates from a request are escaped)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _short(value: object, n: int = 60) -> str:
    r = repr(value)
    return r if len(r) <= n else r[:n] + "..."


class RequestError(Exception):
    """A request the session rejects without ending (BMOE_ERROR fatal:false)."""

    def __init__(self, rid: int, msg: str) -> None:
        super().__init__(msg)
        self.id = rid
        self.msg = msg


@dataclass
class Generate:
    id: int
    prompt: str
    n_predict: int
    think: bool | None  # None: the load's --reasoning
    clear_kv: bool
    lossless: bool = False  # bmoe's: plain llama.cpp's output whatever lossy routing the session loaded with


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_request(line: bytes | str, n_predict: int) -> Generate | str | None:
    """One stdin line → a Generate, CANCEL, CLOSE, or None for a blank line; RequestError otherwise."""
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(NO_ID, "malformed request: the line is not valid UTF-8") from None
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError) as e:
        raise RequestError(NO_ID, f"malformed request: not a JSON object ({safe(str(e))[:120]})") from None
    if not isinstance(obj, dict):
        raise RequestError(NO_ID, f"malformed request: expected a JSON object, got {type(obj).__name__}")
    rid = obj["id"] if _is_int(obj.get("id")) else NO_ID
    if "cmd" not in obj:
        raise RequestError(rid, "missing field 'cmd' (generate, cancel or close)")
    cmd = obj["cmd"]
    if cmd in (CANCEL, CLOSE, PROFILE):
        return cmd
    if cmd != "generate":
        raise RequestError(rid, f"unknown command {safe(_short(cmd))}; expected generate, cancel, close "
                                "or profile")
    if "id" not in obj:
        raise RequestError(NO_ID, "generate: missing field 'id' (an integer)")
    if not _is_int(obj["id"]):
        raise RequestError(NO_ID, f"generate: field 'id' must be an integer, got {safe(_short(obj['id']))}")
    if "prompt" not in obj:
        raise RequestError(rid, "generate: missing field 'prompt' (a string)")
    prompt = obj["prompt"]
    if not isinstance(prompt, str):
        raise RequestError(rid, f"generate: field 'prompt' must be a string, got {type(prompt).__name__}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(rid, "generate: field 'prompt' holds an unpaired surrogate (\\ud800-\\udfff)") from None
    n = obj.get("n_predict", n_predict)
    if not _is_int(n) or n < 1:
        raise RequestError(rid, f"generate: field 'n_predict' must be an integer >= 1, got {safe(_short(n))}")
    flags: dict[str, bool | None] = {}
    for key, default in (("think", None), ("clear_kv", True), ("lossless", False)):
        if key not in obj:  # think left out: the load's --reasoning
            flags[key] = default
            continue
        v = obj[key]
        if not isinstance(v, bool):
            raise RequestError(rid, f"generate: field '{key}' must be true or false, got {safe(_short(v))}")
        flags[key] = v
    return Generate(rid, prompt, n, flags["think"], flags["clear_kv"] is not False, flags["lossless"] is True)
