"""What a run is asked to do: every setting declared once, and the one check of it.

Each setting is a dataclass field declared with `setting(...)`: its name, type and default, and
in the same place its flag, its `bmoe.load` keyword (the flag's words unless given), its help
and its bounds (`Option`, bmoe.base.option). `bmoe-cli`'s and `bmoe-server`'s flags (bmoe.edges.flags) and
`bmoe.load`'s keywords (`from_keywords`) are generated from these declarations, and `validate`
words its errors in the caller's own vocabulary (`FLAGS` or `KEYWORDS`), so adding a setting is
one declaration here. The order of declaration is the order of `--help`.

`validate` is pure: it looks at the settings alone, never at the model or the machine
(bmoe.memory.budget decides what the machine allows).
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterator, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from typing import Any, cast, get_type_hints

from bmoe.base.argtypes import number, percent, positive_float, positive_int
from bmoe.base.draft_settings import DraftSettings
from bmoe.base.errors import ConfigError
from bmoe.base.logit_bias import BIAS_MAX, logit_bias_of, parse_logit_bias
from bmoe.base.option import Option, setting

N_PREDICT = 64  # tokens a request generates when it does not say
POOLINGS = ("none", "mean", "cls", "last")  # llama.cpp's pooling types by llama-server's --pooling names
REASONING = ("on", "off", "auto")  # llama-server's --reasoning
# the cache policies by name (bmoe.streaming.cache_policy.POLICIES makes each; a test holds the two together)
POLICY_NAMES = ("lru", "cycle", "cycle-lfu", "next-use", "quota", "predict")
DEFAULT_POLICY = "next-use"


def _cache_mb(text: str) -> float | None:
    """--cache-mb: MiB, or 'auto' (None)."""
    if text == "auto":
        return None
    return number(text, float, "a number of MiB or 'auto'", lambda v: not v < 0,
                  "must be 0 (no cache), a positive number of MiB, or 'auto'")


def _mib(text: str) -> float:
    """--cache-floor-mb and --cache-ceil-mb: a MiB count, 0 or more."""
    return number(text, float, "a number of MiB", lambda v: v >= 0 and v != float("inf"),
                  "must be a number of MiB, 0 or more")


def _share(text: str) -> float:
    """--drop-cold and --cache-routing: a fraction from 0 (off) up to, not including, 1."""
    return number(text, float, "a number", lambda v: 0 <= v < 1, "must be a fraction from 0 (off) to below 1")


def _policy(text: str) -> str:
    if text not in POLICY_NAMES:
        raise argparse.ArgumentTypeError(f"unknown cache policy {text!r}; choose one of {', '.join(POLICY_NAMES)}")
    return text


@dataclass(frozen=True)
class CacheSettings:
    """The expert cache: its budget and which slice it gives up first."""

    mb: float | None = setting(
        None, "--cache-mb", parse=_cache_mb, auto="auto", ok=lambda v: v >= 0,
        rule="a budget is 0 (no cache), a positive number of MiB, or auto",
        help="expert cache budget in MiB; 0 = no cache (re-read every token); 'auto' (default) = the least room "
             "any memory limit leaves (the cgroup's, the machine's, an rlimit's) minus --cache-floor-mb, at most "
             "--cache-ceil-mb, following free memory while it runs; a budget below one token's working set is "
             "refused (auto falls back to no cache) unless --force, and so is a fixed one above the room the "
             "memory limits leave, unless --force or --adapt")
    policy: str = setting(
        DEFAULT_POLICY, "--cache-policy", parse=_policy, metavar="NAME", ok=lambda v: v in POLICY_NAMES,
        rule=f"unknown cache policy; choose one of {', '.join(POLICY_NAMES)}",
        help=f"which experts the cache gives up first: {', '.join(POLICY_NAMES)} (default {{default}}; compare them "
             "on a trace with `bmoe-bench policies`)")
    floor_mb: float | None = setting(
        None, "--cache-floor-mb", parse=_mib, ok=lambda v: v >= 0, rule="a number of MiB, 0 or more",
        help="memory --cache-mb auto (and --adapt) leaves free under every limit (default 1536, at most a quarter "
             "of a cgroup's limit)")
    ceil_mb: float | None = setting(
        None, "--cache-ceil-mb", parse=_mib, ok=lambda v: v >= 0, rule="a number of MiB, 0 or more",
        help="the most --cache-mb auto may take (default: no cap)")
    adapt: bool = setting(
        False, "--adapt",
        help="let a fixed --cache-mb follow free memory too: shrink (giving pages back) when the cgroup or machine "
             "runs short of --cache-floor-mb, grow back up to N when it frees (--cache-mb auto always does)")
    force: bool = setting(
        False, "--force",
        help="run with a cache budget below one token's working set (it thrashes: every token re-reads experts "
             "it just evicted), or a fixed one above the room the memory limits leave")
    warm_start: bool = setting(
        True, "--no-warm-start",
        help="neither use nor save a usage profile: every start begins with an empty cache")
    usage_dir: str | None = setting(
        None, "--usage-dir", metavar="DIR",
        help="where each model's usage profile (how often each expert was routed) is kept: saved at exit, used at "
             "the next start to fill the cache in the background, most used first (default: $BMOE_USAGE_DIR, else "
             "$XDG_CACHE_HOME/bmoe/usage, i.e. ~/.cache/bmoe/usage)")

    FLOOR_MB = 1536.0  # what `auto` leaves free when floor_mb is None

    @property
    def adaptive(self) -> bool:
        return self.mb is None or self.adapt


@dataclass(frozen=True)
class StreamSettings:
    """Where expert bytes come from and how the reads are waited for."""

    io_threads: int = setting(2, "--io-threads", parse=positive_int, ok=lambda v: v >= 1,
                              rule="streaming needs at least one I/O lane",
                              help="I/O lane processes (default {default})")
    lane_timeout: float = setting(
        30.0, "--lane-timeout", parse=positive_float, ok=lambda v: v > 0, rule="a number of seconds above 0",
        help="seconds an I/O lane may leave a read unanswered before it is replaced (default {default})")
    shm_backend: str = setting(
        "auto", "--shm", keyword="shm", choices=("auto", "posix", "memfd"),
        ok=lambda v: v in ("auto", "posix", "memfd"),
        rule="choose auto, posix or memfd",
        help="cache segment: POSIX shared memory (/dev/shm) or an anonymous memfd; auto picks memfd when /dev/shm "
             "is missing (default {default})")
    odirect: bool = setting(True, "--no-odirect", help="buffered reads + FADV_DONTNEED instead of O_DIRECT")
    preload: bool = setting(False, "--preload",
                            help="read every expert into the cache at start (when the budget holds them all)")
    enabled: bool = setting(True, "--no-stream", help="plain llama.cpp (mmap), no expert streaming")
    pin_dense: bool = setting(
        False, "--pin-dense",
        help="lock the dense (non-expert) weights in memory (mlock), so a tight memory limit cannot evict them and "
             "fault them back in every token; they count against the budget")
    overlap: bool = setting(
        True, "--overlap", toggle=True,
        help="read asynchronously: wait for gate/up slices at the routing node and for down slices only before the "
             "down matmul; speculative reads run during compute (default: on when streaming; --no-overlap waits "
             "for every read at the routing node)")


@dataclass(frozen=True)
class SpecSettings:
    """Reads ahead: temporal prefetch and the spec-gate's next-layer prediction."""

    prefetch: int = setting(
        0, "--prefetch", parse=positive_int, metavar="K", ok=lambda v: v >= 0, rule="a number of layers, 0 or more",
        help="after a layer routes, read ahead the experts the previous token routed at the next K layers (needs a "
             "cache; off by default: docs/levers.md has what it measured)")
    guess: float = setting(
        0.0, "--guess", parse=_share, metavar="P", ok=lambda v: 0 <= v < 1,
        rule="a probability from 0 (off) to below 1",
        help="while a lane is idle, read ahead the next layer's experts that follow, in the routing seen so far, "
             "what this layer routed with probability P or more (bmoe.streaming.route_guess); 0 = off (default "
             "{default}: docs/levers.md has what it measured)")
    gate: bool = setting(
        False, "--spec-gate", toggle=True,
        help="predict the next layer's experts from this layer's router input in a separate process and read them "
             "ahead (needs a cache and F32/F16 routers; off by default: docs/levers.md has what it measured)")
    warmup: int = setting(
        512, "--spec-warmup", parse=positive_int, metavar="N", ok=lambda v: v >= 1, rule="1 or more predictions",
        help="predictions scored before the recall governor may switch --spec-gate off (default {default})")
    recall_min: float = setting(
        75.0, "--spec-recall-min", parse=percent, metavar="P", ok=lambda v: 0 <= v <= 100,
        rule="a percentage from 0 to 100",
        help="switch --spec-gate off for the run when its recall is below P%% after the warm-up; 0 = never "
             "(default {default})")
    precision: float = setting(  # see bench/reports/2026-11-29-issue5 and bmoe.streaming.speculation.Confidence
        70.0, "--spec-precision", parse=percent, metavar="P", ok=lambda v: 0 <= v <= 100,
        rule="a percentage from 0 to 100",
        help="read a predicted expert ahead only when predictions as sure as this one came true at least P%% of the "
             "time (measured per band of router probability as the run goes; 0 = read every prediction; default "
             "{default})")


@dataclass(frozen=True)
class SamplerSettings:
    """llama.cpp's sampler chain (bmoe.seam.llama.make_sampler); temp 0 is greedy. The defaults of
    min_p, the penalties and the logit bias are neutral: those samplers join the chain only when set."""

    temp: float = setting(0.0, "--temp", parse=float, ok=lambda v: v >= 0, rule="0 (greedy) or more",
                          help="temperature; 0 = greedy (default {default})")
    top_k: int = setting(40, "--top-k", parse=int, ok=lambda v: v >= 0, rule="0 (off) or more",
                         help="top-k when sampling (default {default})")
    top_p: float = setting(0.95, "--top-p", parse=float, ok=lambda v: 0 < v <= 1, rule="above 0 and at most 1",
                           help="top-p when sampling (default {default})")
    min_p: float = setting(0.0, "--min-p", parse=float, ok=lambda v: 0 <= v <= 1, rule="from 0 (off) to 1",
                           help="min-p when sampling: drop tokens less likely than P times the likeliest (0 = off; "
                                "default {default})")
    seed: int = setting(0, "--seed", parse=int, help="sampling seed (default {default})")
    repeat_penalty: float = setting(
        1.0, "--repeat-penalty", parse=float, ok=lambda v: v > 0, rule="above 0 (1 = off)",
        help="divide the logit of a token generated in the last --repeat-last-n tokens by this (llama.cpp's; "
             "1 = off; default {default})")
    repeat_last_n: int = setting(
        64, "--repeat-last-n", parse=int, ok=lambda v: v >= 0, rule="0 (no penalties) or more",
        help="how many of the latest generated tokens the penalties count (0 = none; default {default})")
    frequency_penalty: float = setting(
        0.0, "--frequency-penalty", parse=float, ok=lambda v: -2 <= v <= 2, rule="from -2 to 2",
        help="subtract this times a token's count in the last --repeat-last-n generated tokens from its logit "
             "(OpenAI's; 0 = off; default {default})")
    presence_penalty: float = setting(
        0.0, "--presence-penalty", parse=float, ok=lambda v: -2 <= v <= 2, rule="from -2 to 2",
        help="subtract this from the logit of a token in the last --repeat-last-n generated tokens (OpenAI's; "
             "0 = off; default {default})")
    logit_bias: tuple[tuple[int, float], ...] = setting(
        (), "--logit-bias", parse=parse_logit_bias, from_value=logit_bias_of, metavar="ID(+|-)BIAS[,...]",
        ok=lambda v: all(-BIAS_MAX <= b <= BIAS_MAX for _, b in v),
        rule=f"each bias from {-BIAS_MAX:g} to {BIAS_MAX:g}",
        help="add BIAS to token ID's logit before any other sampler (-100 bans it in practice; default none)")

    @property
    def penalized(self) -> bool:
        """Whether llama.cpp's penalties sampler has anything to do."""
        return self.repeat_last_n > 0 and (self.repeat_penalty != 1 or self.frequency_penalty != 0
                                           or self.presence_penalty != 0)


# a request's names for the sampler settings (OpenAI's, as bmoe.load's Model.prepare and the server take them)
SAMPLING_FIELDS = {"temperature": "temp", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
                   "repeat_penalty": "repeat_penalty", "repeat_last_n": "repeat_last_n",
                   "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
                   "logit_bias": "logit_bias"}


def check_sampling(name: str, value: Any) -> None:
    """ConfigError when a request's sampling field (`name`, of SAMPLING_FIELDS) is out of its
    setting's declared bound: the one check of those bounds for every edge."""
    option = next(f.metadata["option"] for f in fields(SamplerSettings) if f.name == SAMPLING_FIELDS[name])
    if option.ok is not None and not option.ok(value):
        shown = f"{value:g}" if isinstance(value, float) else repr(dict(value)) if name == "logit_bias" else value
        raise ConfigError(f"{name} {shown}: it is {option.rule}")


LOSSY = "CHANGES THE OUTPUT (lossy, off by default; its price: `bmoe-bench quality`): "


@dataclass(frozen=True)
class LossySettings:
    """Opt-in routing changes that read fewer experts and change the output (bmoe.streaming.lossy); each is
    exact when off. A request can still ask for lossless output (bmoe.api, bmoe-server)."""

    experts_per_token: int = setting(
        0, "--experts-per-token",
        parse=lambda t: number(t, int, "a whole number", lambda v: v >= 0, "must be 0 or more"),
        metavar="K", ok=lambda v: v >= 0, rule="a number of experts, 0 (the model's own) or more",
        help=LOSSY + "route each token to its K best experts of the model's top-k, their weights normalised as the "
                     "model normalises its own (0 = the model's top-k; default {default})")
    drop_cold: float = setting(
        0.0, "--drop-cold", parse=_share, metavar="F", ok=lambda v: 0 <= v < 1, rule="a fraction from 0 to below 1",
        help=LOSSY + "skip a routed expert that is not in the cache and carries less than F of the token's routing "
                     "weight (never its best one): no read, its weight goes to the others as the model normalises "
                     "(0 = off; default {default})")
    cache_routing: float = setting(
        0.0, "--cache-routing", parse=_share, metavar="D", ok=lambda v: 0 <= v < 1, rule="a fraction from 0 to below 1",
        help=LOSSY + "when a routed expert is not in the cache, use the cached expert of the layer the router "
                     "scores best among the others if its router probability is at least (1-D) times the missing "
                     "one's (relative: D=0.2 takes one within 20%%; 0 = off; default {default})")

    @property
    def on(self) -> bool:
        return bool(self.experts_per_token or self.drop_cold or self.cache_routing)


@dataclass(frozen=True)
class Settings:
    """A run: the model and every setting, top-level and in groups (the groups are code's; each
    setting has one flag and one keyword of its own)."""

    model: str = setting("", "--model", short="-m",
                         help="GGUF model (first shard of a split model); default: the demo model")
    hf: str | None = setting(  # bmoe.api.hub
        None, "--hf-repo", short="-hf", keyword="hf", metavar="ORG/REPO[:QUANT]",
        help="a model by name on the Hugging Face hub, downloaded once into its cache (every shard; HF_TOKEN, "
             "HF_ENDPOINT, HF_HUB_OFFLINE apply; needs the hf extra); QUANT picks the file (default Q4_K_M or the "
             "repository's only model)")
    threads: int = setting(0, "--threads", short="-t", parse=positive_int, ok=lambda v: v >= 0,
                           rule="a number of threads (0: every core)", help="compute threads (default: all cores)")
    n_ctx: int = setting(2048, "--ctx-size", short="-c", keyword="n_ctx", metavar="CTX_SIZE", parse=positive_int,
                         ok=lambda v: v >= 1,
                         rule="the context needs at least one token", help="context size in tokens (default {default})")
    parallel: int = setting(
        1, "--parallel", parse=positive_int, metavar="N", ok=lambda v: v >= 1, rule="at least one sequence decodes",
        help="KV sequences, each of -c tokens: up to N requests may decode together in one batch (bmoe-server's "
             "concurrent requests, bmoe.Model.batch; default {default})")
    chat_template_file: str | None = setting(
        None, "--chat-template-file", metavar="FILE",
        help="render chats with this jinja chat template instead of the model's own (e.g. one with tools for a "
             "model whose template has none)")
    chat_template: str | None = setting(
        None, "--chat-template", metavar="NAME",
        help="render chats with a llama.cpp built-in template by name (chatml, llama3, command-r, ...; no tools)")
    jinja: bool = setting(
        False, "--jinja", toggle=True,
        help="render every chat with its template's jinja, given enable_thinking and today's date, as llama-server "
             "does by default; default: llama.cpp's formatter for the templates it recognises")
    reasoning: str = setting(
        "auto", "--reasoning", choices=REASONING, metavar="on|off|auto", ok=lambda v: v in REASONING,
        rule=f"choose one of {', '.join(REASONING)}",
        help="thinking for a chat that does not say (the template's enable_thinking; auto: on, with --jinja only "
             "for a template that reads it), as llama-server's --reasoning")
    prompt_cache: str | None = setting(  # bmoe.generation.prompt_cache
        None, "--prompt-cache", metavar="DIR",
        help="keep the KV of each prompt's prefix (a chat's system prompt, tools and earlier turns) in DIR and, "
             "for a later prompt that starts with a kept prefix, even after a restart, load it instead of "
             "prefilling it")
    prompt_cache_mb: float = setting(
        4096.0, "--prompt-cache-mb", parse=positive_float, metavar="MB", ok=lambda v: v > 0,
        rule="a number of MiB above 0",
        help="the most --prompt-cache DIR may hold; the least recently used prefixes go first (default {default})")
    embedding: bool = setting(  # bmoe.engine.embeddings
        False, "--embedding", alias="--embeddings",
        help="also compute embeddings (bmoe-server's /v1/embeddings and /embeddings, bmoe.Model.embed), as "
             "llama-server --embedding does: each input is one decode through the streamed experts")
    pooling: str | None = setting(
        None, "--pooling", choices=POOLINGS, ok=lambda v: v in POOLINGS, rule=f"choose one of {', '.join(POOLINGS)}",
        help="with --embedding, how a sequence's token embeddings become one vector: none (one per token), mean, "
             "cls (the first token's), last (the last token's); default: the model's own (its GGUF's pooling_type, "
             "else none), as llama.cpp's")
    cache: CacheSettings = field(default_factory=CacheSettings)
    streaming: StreamSettings = field(default_factory=StreamSettings)
    speculation: SpecSettings = field(default_factory=SpecSettings)
    sampler: SamplerSettings = field(default_factory=SamplerSettings)
    lossy: LossySettings = field(default_factory=LossySettings)
    draft: DraftSettings = field(default_factory=DraftSettings)
    route_trace: str | None = setting(
        None, "--route-trace", metavar="PATH",
        help="write each decode token's routed experts per layer (JSON lines) and the router inputs "
             "(PATH.hidden.npy), for `bmoe-bench routes`; a PATH ending in .csv writes route_trace v1 (the "
             "prompt's tokens too, with router weights and each layer's expert bytes)")
    replay_routes: str | None = setting(
        None, "--replay-routes", metavar="TRACE",
        help="BENCHMARK MODE, CHANGES THE OUTPUT: route every token to the experts, with the router weights, that "
             "TRACE records (a --route-trace file or route_trace v1 CSV: its prompt rows, then its decode tokens, "
             "wrapping around), so the cache, lanes and memory budget run that model's real reads on this model "
             "file (one of its shape: same MoE layers, experts in range); not for bmoe-server")
    verbose: bool = setting(False, "--verbose", help="show llama.cpp's own log on stderr")

    @property
    def reads_ahead(self) -> bool:
        return bool(self.speculation.prefetch or self.speculation.gate or self.speculation.guess)


# ---- the schema ------------------------------------------------------------------------------------

# each group's default factory is its dataclass
GROUPS = {f.name: cast(type, f.default_factory) for f in fields(Settings) if f.default_factory is not MISSING}


@dataclass(frozen=True)
class Entry:
    """One setting in the schema: where it lives in Settings, its declaration and its Python type."""

    group: str | None  # None: a top-level field of Settings
    field: Field
    option: Option
    type: Any

    @property
    def name(self) -> str:
        return self.option.name

    def get(self, s: Settings) -> Any:
        return getattr(s if self.group is None else getattr(s, self.group), self.field.name)

    @property
    def default(self) -> Any:
        return self.field.default


def _entries(cls: type, group: str | None) -> Iterator[Entry]:
    hints = get_type_hints(cls)
    for f in fields(cls):
        if "option" in f.metadata:
            yield Entry(group, f, f.metadata["option"], hints[f.name])
        elif f.name in GROUPS and cls is Settings:
            yield from _entries(GROUPS[f.name], f.name)


def schema_of(cls: type) -> tuple[Entry, ...]:
    """The settings a dataclass declares with `setting(...)`, in order (Settings' groups included)."""
    return tuple(_entries(cls, None))


SCHEMA: tuple[Entry, ...] = schema_of(Settings)
BY_NAME = {e.name: e for e in SCHEMA}
assert len(BY_NAME) == len(SCHEMA), "two settings share a keyword"


def build(values: Mapping[str, Any]) -> Settings:
    """Settings with these values (by keyword) and every other setting at its default."""
    top = {BY_NAME[k].field.name: v for k, v in values.items() if BY_NAME[k].group is None}
    groups = {g: replace(make(), **{BY_NAME[k].field.name: v for k, v in values.items() if BY_NAME[k].group == g})
              for g, make in GROUPS.items()}
    return Settings(**top, **groups)


# ---- how each edge names a setting ----------------------------------------------------------------


class Naming:
    """How errors name settings and values: as flags (`--cache-mb 500`) or as keywords (`cache_mb=500`)."""

    def __init__(self, flags: bool) -> None:
        self.flags = flags

    def name(self, key: str) -> str:
        o = BY_NAME[key].option
        return (o.short or o.flag) if self.flags else o.name

    def value(self, key: str, v: Any) -> str:
        """The setting at value v, as the user would have written it."""
        e = BY_NAME[key]
        o = e.option
        if isinstance(v, bool) and not self.flags:
            return f"{o.name}={v}"
        if isinstance(v, bool):
            if o.toggle:
                return o.flag if v else "--no-" + o.flag.removeprefix("--")
            return o.flag
        text = (o.auto if v is None and o.auto else f"{v:g}" if isinstance(v, float)
                else ",".join(f"{t}{b:+g}" for t, b in v) if isinstance(v, tuple) else str(v))
        if self.flags:
            return f"{o.short or o.flag} {text}"
        if isinstance(v, tuple):
            return f"{o.name}={dict(v)!r}"
        return f"{o.name}={text!r}" if v is None or isinstance(v, str) else f"{o.name}={text}"


FLAGS, KEYWORDS = Naming(flags=True), Naming(flags=False)



def _check_draft(s: Settings, w: Naming) -> None:
    """ConfigError for drafting with a setting whose per-token work it cannot share yet."""
    if s.draft.mode == "none":
        return
    draft = w.value("draft", s.draft.mode)
    other = [w.name(k) for k, on in (("route_trace", s.route_trace), ("replay_routes", s.replay_routes),
                                     ("experts_per_token", s.lossy.experts_per_token),
                                     ("drop_cold", s.lossy.drop_cold), ("cache_routing", s.lossy.cache_routing)) if on]
    if other:
        raise ConfigError(f"{draft} verifies several tokens per decode, and {' and '.join(other)} "
                          f"{'work' if len(other) > 1 else 'works'} one token per decode; drop one of them")
    why = {"prompt_cache": "keeps the target's KV state alone", "spec_gate": "predicts the trunk's layers alone"}
    other = [f"{w.name(k)} {why[k]}" for k, on in (("prompt_cache", s.prompt_cache), ("spec_gate", s.speculation.gate))
             if on and s.draft.mode == "mtp"]
    if other:
        raise ConfigError(f"{draft} runs the model's MTP layer in a second context, and {' and '.join(other)}; "
                          "drop one of them")


# ---- bmoe.load's keywords --------------------------------------------------------------------------


def from_keywords(path: str, **kw: Any) -> Settings:
    """Settings for the model at `path` from bmoe.load's keywords, validated in their words.

    A keyword's value has the setting's type; text is read as its flag would read it
    (`cache_mb="auto"`). TypeError names an unknown keyword (and the nearest known ones) or a
    value of the wrong type; ConfigError a value out of bounds or settings that contradict.
    """
    values: dict[str, Any] = {"model": path}
    for key, v in kw.items():
        e = BY_NAME.get(key)
        if e is None or key == "model":
            near = difflib.get_close_matches(key, list(BY_NAME), n=3)
            hint = f"; did you mean {' or '.join(near)}?" if near else ""
            raise TypeError(f"unknown setting {key!r}{hint} (the settings are: {', '.join(names())})")
        values[key] = _coerce(e, v)
    s = build(values)
    validate(s, KEYWORDS, frozenset(kw))
    return s


def names() -> list[str]:
    """Every keyword bmoe.load takes for a setting, in the schema's order."""
    return [e.name for e in SCHEMA if e.name != "model"]


def _coerce(e: Entry, v: Any) -> Any:
    """A keyword's value checked against the setting's type; text parsed as the flag parses it."""
    o = e.option
    if o.from_value is not None and not isinstance(v, str):
        return o.from_value(v)  # its ConfigError names the keyword
    if isinstance(v, str) and o.parse is not None and not _accepts(e.type, v):
        try:
            return o.parse(v)
        except (argparse.ArgumentTypeError, ValueError) as err:
            raise ConfigError(f"{o.name}={v!r}: {err}") from None
    if not _accepts(e.type, v):
        raise TypeError(f"{o.name}={v!r}: expected {_type_words(e.type)}, not {type(v).__name__}")
    return float(v) if isinstance(v, int) and not isinstance(v, bool) and float in _members(e.type) else v


def _members(t: Any) -> tuple[type, ...]:
    return tuple(getattr(t, "__args__", (t,)))


def _accepts(t: Any, v: Any) -> bool:
    for m in _members(t):
        if m is type(None) and v is None:
            return True
        if m is bool and isinstance(v, bool):
            return True
        if m in (int, float) and isinstance(v, (int, float) if m is float else int) and not isinstance(v, bool):
            return True
        if m is str and isinstance(v, str):
            return True
    return False


def _type_words(t: Any) -> str:
    return " or ".join("None" if m is type(None) else m.__name__ for m in _members(t))


# ---- the one check ---------------------------------------------------------------------------------


def validate(s: Settings, w: Naming = FLAGS, given: frozenset[str] = frozenset()) -> None:
    """Raise ConfigError for a setting out of its bounds or settings that contradict each other, in
    the caller's words (`w`); `given` are the settings the user set (the rest are defaults)."""
    for e in SCHEMA:
        v = e.get(s)
        if e.option.ok is not None and v is not None and not e.option.ok(v):
            raise ConfigError(f"{w.value(e.name, v)}: {e.option.rule}")
    c, st, sp = s.cache, s.streaming, s.speculation
    ahead = " and ".join(w.name(k) for k, on in (("prefetch", sp.prefetch), ("spec_gate", sp.gate), ("guess", sp.guess))
                         if on)
    no_stream = w.value("stream", False)
    if not st.enabled and "overlap" in given and st.overlap:
        raise ConfigError(f"{w.value('overlap', True)} streams experts; drop it or drop {no_stream}")
    if ahead and not st.enabled:
        raise ConfigError(f"{ahead} stream experts; drop them or drop {no_stream}")
    auto = w.value("cache_mb", None)
    sizing = [w.name(k) for k, v in (("cache_floor_mb", c.floor_mb), ("cache_ceil_mb", c.ceil_mb)) if v is not None]
    if sizing and c.mb is not None and (c.ceil_mb is not None or not c.adapt):
        raise ConfigError(f"{' and '.join(sizing)} size {auto}, and {w.value('cache_mb', c.mb)} is fixed; "
                          f"drop {' and '.join(sizing)} or use {auto}")
    if sizing and not st.enabled:
        raise ConfigError(f"{' and '.join(sizing)} size the expert cache, and {no_stream} has none; drop one of them")
    if c.ceil_mb == 0:
        raise ConfigError(f"{w.value('cache_ceil_mb', 0.0)} leaves {auto} no room; for no cache say "
                          f"{w.value('cache_mb', 0.0)}")
    if st.pin_dense and not st.enabled:
        raise ConfigError(f"{w.name('pin_dense')} keeps the dense weights resident while experts stream, and "
                          f"{no_stream} streams nothing; drop one of them")
    if c.adapt and (c.mb == 0 or not st.enabled):
        raise ConfigError(f"{w.name('adapt')} moves the expert cache's budget with free memory, and "
                          f"{w.value('cache_mb', 0.0) if st.enabled else no_stream} has no cache; drop one of them")
    if c.usage_dir is not None and not c.warm_start:
        raise ConfigError(f"{w.name('usage_dir')} names where usage profiles are kept, and "
                          f"{w.value('warm_start', False)} "
                          "uses none; drop one of them")
    if ahead and c.mb == 0:
        budget = "--cache-mb N or auto" if w.flags else "cache_mb=N or 'auto'"
        raise ConfigError(f"{ahead} read experts ahead into the cache, and {w.value('cache_mb', 0.0)} has none; "
                          f"give it a budget ({budget})")
    if s.hf and s.model:
        raise ConfigError(f"{w.name('model')} names a file and {w.name('hf')} a model on the hub; give one of them")
    if s.chat_template and s.chat_template_file:
        raise ConfigError(f"{w.name('chat_template')} names a built-in template and {w.name('chat_template_file')} "
                          "gives one; give one of them")
    lo = s.lossy
    cached = [w.name(k) for k, v in (("drop_cold", lo.drop_cold), ("cache_routing", lo.cache_routing)) if v]
    if cached and not st.enabled:
        raise ConfigError(f"{' and '.join(cached)} change routing by what the expert cache holds, and {no_stream} "
                          f"has none; drop one of them")
    if lo.cache_routing and c.mb == 0:
        raise ConfigError(f"{w.name('cache_routing')} takes a cached expert instead of a missing one, and "
                          f"{w.value('cache_mb', 0.0)} caches none; give it a budget or drop it")
    if s.replay_routes:
        replay = w.name("replay_routes")
        if not st.enabled:
            raise ConfigError(f"{replay} sets the routing where bmoe streams experts, and {no_stream} does not; "
                              "drop one of them")
        if lo.on:
            raise ConfigError(f"{replay} sets every token's routing to a trace's, and the lossy routing settings "
                              "change it again; drop one of them")
        if s.parallel > 1:
            raise ConfigError(f"{replay} replays one sequence of tokens, and {w.value('parallel', s.parallel)} "
                              "decodes several; drop one of them")
        if s.prompt_cache:
            raise ConfigError(f"{replay} computes the KV with a trace's routing, and {w.name('prompt_cache')} would "
                              "keep it for later runs of the model's own; drop one of them")
    if s.pooling is not None and not s.embedding:
        raise ConfigError(f"{w.name('pooling')} pools the embeddings {w.name('embedding')} computes; add it or drop "
                          f"{w.name('pooling')}")
    _check_draft(s, w)
    if s.route_trace and s.parallel > 1:
        raise ConfigError(f"{w.name('route_trace')} records one sequence's routing, and "
                          f"{w.value('parallel', s.parallel)} decodes several; drop one of them")
