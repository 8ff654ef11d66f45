"""`bmoe-cli --session`: one loaded model and a warm expert cache serving many prompts.

The line protocol is the "Session mode" part of shared/spec/telemetry.md. Requests arrive on
stdin, one JSON object per line; every stdout line is `BMOE_<TAG> {json}`:

    BMOE_READY {"load_s","arch","n_ctx"}            once, after the model loads
    BMOE_BEGIN {"id"}                               a generation started
    BMOE_LOAD / BMOE_PROGRESS                       per token, exactly as one-shot --progress
    BMOE_DONE  {"id","cancelled","tokens",...}      the end of a generation (also a cancelled one)
    BMOE_ERROR {"id","fatal","msg"}                 a rejected request, or (fatal) the process ends

Decisions where the contract is silent:

- A request rejected before it starts (bad line, unknown command, missing or wrongly typed field,
  context overflow, a second `generate` while one runs) gets one `BMOE_ERROR` with `fatal:false`
  and no `BMOE_BEGIN`; the session state is untouched. Its `id` is the request's own when the
  request carried an integer `id`, else -1. Fields are typed strictly (`id`/`n_predict` JSON
  integers, not floats or booleans; `n_predict` >= 1; `think`/`clear_kv` booleans; null counts as
  wrongly typed); unknown extra fields are ignored. Blank lines are ignored.
- `cancel` with nothing in flight is ignored (a notice goes to stderr, nothing to stdout), so a
  cancel racing the end of its generation is harmless. A cancel reaching a `generate` that is
  queued but not yet started cancels it before prefill.
- `close` (and EOF) while a generation runs cancels it (its `BMOE_DONE` has `cancelled:true`),
  then the process exits 0. Lines after `close` are not read.
- A cancelled turn is rolled back: the KV keeps only the prefix the turn reused, the user message
  is not added to the conversation. Its `BMOE_DONE` carries the tokens and text produced before the
  cancel, `n_prompt` = the tokens the turn set out to prefill, `n_past` = the KV length after the
  rollback. A cancelled `clear_kv:true` turn leaves an empty new chat (the old one was dropped when
  the turn started).
- `BMOE_DONE.load_s` is the session's model load time (the same as `BMOE_READY.load_s`);
  `cache_hit_pct` is cumulative over the turn's decode tokens, as in its last `BMOE_PROGRESS`
  (-1 without a cache); `cache_budget_mib` is 0 when not streaming; `spec_recall_pct` is -1 without
  a running spec-gate; `tok_s`, `stall_s_tok`, `mgmt_s_tok` are over the turn's decode tokens.
- `think` defaults to true. The conversation is rendered by llama.cpp's
  `llama_chat_apply_template` with the model's own template (exactly as one-shot `--chat` renders
  a single turn). `think:false` on a template that reads `enable_thinking` renders the
  conversation with jinja2 instead (the template itself, `enable_thinking=False`), since
  `llama_chat_apply_template` cannot pass it; on other templates `think` changes nothing. A
  template llama.cpp does not recognise is rendered with jinja2 too. A model without a chat template
  is run as plain text: the conversation is the concatenation of its messages.
- A model file whose size or mtime changed since the load is found before each `generate` and is
  fatal (`BMOE_ERROR` with the request's id, naming the file, "restart the session"): the loaded
  offsets and llama.cpp's mapping describe the old file, so no later answer could be trusted to be
  the model's, and only a new load fixes that.
- Fatal: anything that ends the process (a failed load, a lane failure, a decode error) first
  writes `BMOE_ERROR` with `fatal:true` (id of the generation in flight, else -1) and exits 1;
  SIGINT/SIGTERM do the same with exit 130/143. Shared memory and lanes are released on every
  path.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import llama_cpp

from bmoe import cli, telemetry
from bmoe.coordinator import Cancelled, ConfigError, Engine, TokenStat
from bmoe.units import MiB

NO_ID = -1
TAGS = ("READY", "BEGIN", "LOAD", "PROGRESS", "DONE", "ERROR")
DONE_KEYS = ("id", "cancelled", "tokens", "tok_s", "prefill_s", "load_s", "cache_hit_pct", "n_prompt",
             "n_past", "cache_resident_mib", "cache_budget_mib", "spec_recall_pct", "stall_s_tok",
             "mgmt_s_tok", "text")
EXIT_OK, EXIT_ERROR, EXIT_SIGINT, EXIT_SIGTERM = 0, 1, 130, 143


def _safe(text: str) -> str:
    """Text that encodes as UTF-8 (lone surrogates from a request are escaped)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _short(value: object, n: int = 60) -> str:
    r = repr(value)
    return r if len(r) <= n else r[:n] + "..."


# ---- requests ------------------------------------------------------------------------------------


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
    think: bool
    clear_kv: bool


CANCEL, CLOSE, PROFILE = "cancel", "close", "profile"


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
        raise RequestError(NO_ID, f"malformed request: not a JSON object ({_safe(str(e))[:120]})") from None
    if not isinstance(obj, dict):
        raise RequestError(NO_ID, f"malformed request: expected a JSON object, got {type(obj).__name__}")
    rid = obj["id"] if _is_int(obj.get("id")) else NO_ID
    if "cmd" not in obj:
        raise RequestError(rid, "missing field 'cmd' (generate, cancel or close)")
    cmd = obj["cmd"]
    if cmd in (CANCEL, CLOSE, PROFILE):
        return cmd
    if cmd != "generate":
        raise RequestError(rid, f"unknown command {_safe(_short(cmd))}; expected generate, cancel, close "
                                "or profile")
    if "id" not in obj:
        raise RequestError(NO_ID, "generate: missing field 'id' (an integer)")
    if not _is_int(obj["id"]):
        raise RequestError(NO_ID, f"generate: field 'id' must be an integer, got {_safe(_short(obj['id']))}")
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
        raise RequestError(rid, f"generate: field 'n_predict' must be an integer >= 1, got {_safe(_short(n))}")
    flags = {}
    for key in ("think", "clear_kv"):
        v = obj.get(key, True)
        if not isinstance(v, bool):
            raise RequestError(rid, f"generate: field '{key}' must be true or false, got {_safe(_short(v))}")
        flags[key] = v
    return Generate(rid, prompt, n, flags["think"], flags["clear_kv"])


# ---- output --------------------------------------------------------------------------------------


class ClientGone(Exception):
    """stdout is closed: nobody reads the session any more."""


class Output:
    """Protocol lines on stdout, one write + flush per line, under one lock.

    The same lock guards the session's in-flight state, so "the generation ended" and its
    BMOE_DONE line are one step for the request reader.
    """

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.lock = threading.RLock()
        self.gone = False
        self.sealed = False

    def seal(self) -> None:
        """No line after this one: the process is ending (a late bad request goes unanswered)."""
        with self.lock:
            self.sealed = True

    def raw(self, lines: list[str]) -> None:
        with self.lock:
            if self.gone or self.sealed:
                raise ClientGone()
            try:
                for line in lines:
                    self.stream.write(line + "\n")
                    self.stream.flush()
            except (BrokenPipeError, ValueError, OSError):
                self.gone = True
                try:  # the interpreter's last flush must not fail again
                    devnull = os.open(os.devnull, os.O_WRONLY)
                    os.dup2(devnull, self.stream.fileno())
                    os.close(devnull)
                except (OSError, ValueError):
                    pass
                raise ClientGone() from None

    def line(self, tag: str, obj: dict[str, Any]) -> None:
        self.raw([telemetry.tagged(tag, obj)])

    def error(self, rid: int, msg: str, fatal: bool = False) -> None:
        self.line("ERROR", {"id": rid, "fatal": fatal, "msg": _safe(msg)})


# ---- chat rendering ------------------------------------------------------------------------------


class Renderer:
    """A conversation → prompt text with the model's own chat template (see the module notes)."""

    def __init__(self, engine: Engine) -> None:
        self.vocab = engine.vocab
        raw = llama_cpp.llama_model_chat_template(engine.model, None)
        self.template: bytes | None = raw or None
        self.reads_thinking = bool(self.template and b"enable_thinking" in self.template)
        self._jinja: Any = None

    def render(self, messages: list[dict[str, str]], think: bool) -> str:
        if self.template is None:
            return "".join(m["content"] for m in messages)
        if not think and self.reads_thinking:
            return self._render_jinja(messages, enable_thinking=False)
        text = self._render_llama(messages)
        return self._render_jinja(messages) if text is None else text

    def _render_llama(self, messages: list[dict[str, str]]) -> str | None:
        """llama_chat_apply_template, add_ass=True (what one-shot --chat does); None if unsupported."""
        msgs = (llama_cpp.llama_chat_message * len(messages))()
        keep = []  # the encoded strings must outlive the call
        for m, src in zip(msgs, messages):
            role, content = src["role"].encode(), src["content"].encode()
            keep += [role, content]
            m.role, m.content = role, content
        cap = 2 * sum(len(x) for x in keep) + 1024
        buf = ctypes.create_string_buffer(cap)
        n = llama_cpp.llama_chat_apply_template(self.template, msgs, len(messages), True, buf, cap)
        if n > cap:
            buf = ctypes.create_string_buffer(n)
            n = llama_cpp.llama_chat_apply_template(self.template, msgs, len(messages), True, buf, n)
        if n < 0:
            return None
        return buf.raw[:n].decode(errors="replace")

    def _token_text(self, tok: int) -> str:
        if tok < 0:
            return ""
        return (llama_cpp.llama_vocab_get_text(self.vocab.ptr, tok) or b"").decode(errors="replace")

    def _render_jinja(self, messages: list[dict[str, str]], **kwargs: Any) -> str:
        if self._jinja is None:
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            bos = self._token_text(llama_cpp.llama_vocab_bos(self.vocab.ptr))
            eos = self._token_text(llama_cpp.llama_vocab_eos(self.vocab.ptr))
            self._jinja = (Jinja2ChatFormatter(self.template.decode(errors="replace"), eos, bos), bos)
        fmt, bos = self._jinja
        try:
            text = fmt(messages=messages, **kwargs).prompt
        except Exception as e:  # noqa: BLE001 - a template error is the request's, not the session's
            raise ConfigError(f"the model's chat template failed to render: {e}") from None
        # tokenize() adds BOS itself when the vocab asks for it: do not send a second one
        if bos and text.startswith(bos) and llama_cpp.llama_vocab_get_add_bos(self.vocab.ptr):
            text = text[len(bos):]
        return text


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


# ---- the session ---------------------------------------------------------------------------------


@dataclass
class Turn:
    """What one generation accumulates for its per-token lines and its BMOE_DONE."""

    req: Generate
    lines: list[telemetry.TokenLine] = field(default_factory=list)
    text: str = ""
    hits: int = 0
    lookups: int = 0
    t_start: float = 0.0
    prefill_s: float | None = None


class Session:
    """Conversation state over one Engine. Generation runs on the calling (main) thread only;
    the request reader thread only queues requests, answers bad ones and flags cancels."""

    def __init__(self, engine: Engine, out: Output, n_predict: int,
                 notice: Callable[[str], None] = cli.notice) -> None:
        self.engine = engine
        self.out = out
        self.n_predict = n_predict
        self.notice = notice
        self.renderer = Renderer(engine)
        self.n_ctx = min(engine.n_ctx, engine.settings.n_ctx)
        self.messages: list[dict[str, str]] = []
        self.kv_tokens: list[int] = []  # exactly the tokens in the KV, in order
        self.requests: queue.Queue[Generate | str] = queue.Queue()
        self.in_flight: int | None = None  # id of the queued or running generate (under out.lock)

    # -- reader thread --

    def read_requests(self, fd: int) -> None:
        """Read stdin lines until close or EOF; never raises."""
        buf = bytearray()
        try:
            while True:
                try:
                    chunk = os.read(fd, 1 << 16)
                except InterruptedError:
                    continue
                except OSError:
                    chunk = b""
                if not chunk:
                    break
                start = len(buf)
                buf += chunk
                while True:
                    i = buf.find(b"\n", start)
                    if i < 0:
                        break
                    line = bytes(buf[:i])
                    del buf[:i + 1]
                    start = 0
                    if self.on_line(line) == CLOSE:
                        return
            if buf.strip():
                if self.on_line(bytes(buf)) == CLOSE:
                    return
            self.on_line(b'{"cmd":"close"}')  # EOF closes
        except ClientGone:
            self.requests.put(CLOSE)
        except BaseException as e:  # noqa: BLE001 - the reader must end the session, not vanish
            self.notice(f"request reader failed: {type(e).__name__}: {e}")
            self.requests.put(CLOSE)

    def on_line(self, line: bytes) -> str | None:
        try:
            req = parse_request(line, self.n_predict)
        except RequestError as e:
            self.out.error(e.id, e.msg)
            return None
        except ClientGone:
            raise
        except Exception as e:  # noqa: BLE001 - whatever the line was, the session keeps serving
            self.out.error(NO_ID, f"malformed request: {type(e).__name__}: {e}")
            return None
        if req is None:
            return None
        if req == PROFILE:
            self.profile()
            return None
        with self.out.lock:
            if req == CANCEL:
                if self.in_flight is None:
                    self.notice("cancel ignored: no generation in flight")
                else:
                    self.engine.cancel()
                return None
            if req == CLOSE:
                if self.in_flight is not None:
                    self.engine.cancel()
                self.requests.put(CLOSE)
                return CLOSE
            if self.in_flight is not None:
                self.out.error(req.id, f"generation {self.in_flight} is still running; wait for its "
                                       "BMOE_DONE or send {\"cmd\":\"cancel\"}")
                return None
            self.in_flight = req.id
            self.requests.put(req)
        return None

    def profile(self) -> None:
        """The per-process table (coordinator, lanes) on stderr, on demand; stdout stays protocol-only."""
        from bmoe import profile

        rows = profile.collect(cli.workers(self.engine))
        print(profile.table(rows, self.engine.resident_bytes()), file=sys.stderr, flush=True)

    # -- main thread --

    def serve(self) -> None:
        """Run queued generations until close."""
        while True:
            try:
                req = self.requests.get(timeout=0.5)  # a timeout keeps signals prompt
            except queue.Empty:
                continue
            if req == CLOSE:
                return
            self.run(req)

    def _finish(self, tag: str, obj: dict[str, Any]) -> None:
        with self.out.lock:
            self.in_flight = None
            self.engine.reset_cancel()
            self.out.line(tag, obj)

    def run(self, req: Generate) -> None:
        self.engine.files.check_unchanged("restart the session to load it again")  # fatal: see the notes
        base = [] if req.clear_kv else self.messages
        msgs = base + [{"role": "user", "content": req.prompt}]
        try:
            tokens = self.engine.vocab.tokenize(self.renderer.render(msgs, req.think), add_special=True)
            if not tokens:
                raise ConfigError("the prompt is empty")
            if len(tokens) + req.n_predict > self.n_ctx:
                what = "the prompt" if req.clear_kv else "the conversation with this prompt"
                raise ConfigError(
                    f"{what} ({len(tokens)} tokens) plus n_predict {req.n_predict} exceeds the context "
                    f"of {self.n_ctx} tokens; shorten it, lower n_predict, start a new chat "
                    "(clear_kv:true) or restart the session with a larger -c")
        except ConfigError as e:
            self._finish("ERROR", {"id": req.id, "fatal": False, "msg": _safe(str(e))})
            return
        self.out.line("BEGIN", {"id": req.id})
        keep = 0 if req.clear_kv else min(common_prefix(self.kv_tokens, tokens), len(tokens) - 1)
        keep = self.engine.kv_keep(keep)
        self.kv_tokens = self.kv_tokens[:keep]
        self.messages = base
        turn = Turn(req, t_start=time.perf_counter())
        suffix = tokens[keep:]
        try:
            res = self.engine.generate_after(suffix, req.n_predict, lambda i, p, st: self._on_token(turn, p, st))
        except Cancelled:
            self.engine.kv_keep(keep)  # roll the turn back to the prefix it reused
            cancelled, text = True, turn.text
            if turn.prefill_s is None:
                turn.prefill_s = time.perf_counter() - turn.t_start
        except ConfigError as e:  # should not happen (checked above); keep serving all the same
            self.engine.kv_keep(keep)
            self._check_kv()
            self._finish("ERROR", {"id": req.id, "fatal": False, "msg": _safe(str(e))})
            return
        else:
            cancelled, text = False, res.text
            turn.prefill_s = res.prefill_s
            self.kv_tokens = tokens + res.ids
            self.messages = msgs + [{"role": "assistant", "content": res.text}]
        self._check_kv()
        self._finish("DONE", self._done(turn, cancelled, text, len(suffix)))

    def _on_token(self, turn: Turn, piece: str, st: TokenStat) -> None:

        if turn.prefill_s is None:
            turn.prefill_s = max(0.0, time.perf_counter() - turn.t_start - st.wall_ns / 1e9)
        turn.text += piece
        turn.hits += st.hits
        turn.lookups += st.lookups
        line = cli.token_line(st, len(turn.lines) + 1, turn.req.n_predict, self._hit_pct(turn),
                              self.engine.settings.overlap)
        turn.lines.append(line)
        self.out.raw(telemetry.token_lines(line, turn.text))

    def _hit_pct(self, turn: Turn) -> float:
        if not self.engine.cache_active:
            return -1.0
        return 100.0 * turn.hits / turn.lookups if turn.lookups else 0.0

    def _check_kv(self) -> None:
        """The token list must describe the KV exactly; if not (a bug), start clean rather than lie."""
        n = self.engine.kv_len()
        if n != len(self.kv_tokens):
            self.notice(f"KV holds {n} tokens but the session tracked {len(self.kv_tokens)}; clearing it")
            self.engine.clear_kv()
            self.kv_tokens = []

    def _done(self, turn: Turn, cancelled: bool, text: str, n_prompt: int) -> dict[str, Any]:
        e = self.engine
        totals = telemetry.RunTotals.of(turn.lines, overlap=e.settings.overlap)
        tok_s = totals.tokens / totals.wall_s if totals.wall_s > 0 else 0.0
        obj = {
            "id": turn.req.id, "cancelled": cancelled, "tokens": totals.tokens, "tok_s": round(tok_s, 3),
            "prefill_s": round(turn.prefill_s or 0.0, 4), "load_s": round(e.load_s, 3),
            "cache_hit_pct": round(self._hit_pct(turn), 2), "n_prompt": n_prompt, "n_past": len(self.kv_tokens),
            "cache_resident_mib": round(e.resident_bytes() / MiB, 2),
            "cache_budget_mib": round(e.budget / MiB if e.streamer else 0.0, 2),
            "spec_recall_pct": round(e.streamer.spec.recall_pct, 2) if e.streamer and e.streamer.spec else -1.0, "stall_s_tok": round(totals.per_tok(totals.stall_s), 5),
            "mgmt_s_tok": round(totals.per_tok(totals.mgmt_s), 5), "text": text,
        }
        assert tuple(obj) == DONE_KEYS
        return obj


# ---- process entry (bmoe-cli --session) ----------------------------------------------------------


def _fatal(out: Output, rid: int, exc: BaseException) -> int:
    if isinstance(exc, KeyboardInterrupt):
        msg, code = "interrupted (SIGINT); the session ended", EXIT_SIGINT
    elif isinstance(exc, SystemExit):
        code = exc.code if isinstance(exc.code, int) else EXIT_ERROR
        msg = "terminated (SIGTERM); the session ended" if code == EXIT_SIGTERM else f"exiting ({exc.code})"
    else:
        msg, code = str(exc) or type(exc).__name__, EXIT_ERROR
        if type(exc).__name__ not in ("ConfigError", "ModelError", "LaneError"):
            msg = f"{type(exc).__name__}: {msg}"
        if rid != NO_ID:
            msg = f"generation {rid} failed: {msg}"
    print(f"bmoe-cli: error: {msg}", file=sys.stderr, flush=True)
    with out.lock:
        try:
            out.error(rid, msg, fatal=True)
        except ClientGone:
            pass
        out.seal()
    return code


def serve(a: argparse.Namespace, stdin_fd: int = 0) -> int:
    """`bmoe-cli --session`: load once, then serve requests until close, EOF or a signal."""
    try:
        sys.stdout.reconfigure(encoding="utf-8", errors="backslashreplace")
    except (AttributeError, ValueError):
        pass
    out = Output(sys.stdout)
    ignored = [f for f, on in (("-p", a.prompt is not None), ("-f", a.file), ("--chat", a.chat),
                               ("--progress", a.progress), ("--csv", a.csv))
               if on]
    if ignored:
        cli.notice(f"{', '.join(ignored)} ignored in session mode (prompts come from stdin)")
    engine: Engine | None = None
    session: Session | None = None
    try:
        engine = Engine(cli.settings_from_args(a), notice=cli.notice)
        session = Session(engine, out, a.n_predict)
        out.line("READY", {"load_s": round(engine.load_s, 3), "arch": engine.files.arch, "n_ctx": session.n_ctx})
        threading.Thread(target=session.read_requests, args=(stdin_fd,), name="bmoe-requests",
                         daemon=True).start()
        session.serve()
        if a.profile:
            session.profile()
        return EXIT_OK
    except ClientGone:
        cli.notice("stdout closed; ending the session")
        return EXIT_ERROR
    except BaseException as e:  # noqa: BLE001 - every end writes its fatal line first
        rid = session.in_flight if session is not None and session.in_flight is not None else NO_ID
        return _fatal(out, rid, e)
    finally:
        out.seal()
        if engine is not None:
            engine.close()


# ---- the client ----------------------------------------------------------------------------------


class SessionError(RuntimeError):
    """The session process ended, or answered something other than the protocol expects."""


Event = tuple[str, dict[str, Any]]


class SessionClient:
    """Drive a `bmoe-cli --session` subprocess.

        with SessionClient(["-m", "model.gguf", "--cache-mb", "500"]) as s:
            print(s.ready["arch"])
            for tag, ev in s.generate(1, "Why is the sky blue?", n_predict=32):
                if tag == "PROGRESS":
                    print(ev["text"])

    stdout and stderr are read on their own threads (so neither pipe can fill up and stall the
    session); `lines` keeps every stdout line, `stray` the ones that are not protocol lines.
    """

    def __init__(self, args: list[str], *, ready_timeout: float = 600.0, cwd: str | None = None,
                 env: dict[str, str] | None = None, python: str = sys.executable) -> None:
        env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([python, "-m", "bmoe.cli", "--session", *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd, env=env)
        self.lines: list[str] = []
        self.stray: list[str] = []
        self._stderr: list[bytes] = []
        self._events: queue.Queue[Event | None] = queue.Queue()
        self._threads = [threading.Thread(target=self._read_stdout, daemon=True),
                         threading.Thread(target=self._read_stderr, daemon=True)]
        for t in self._threads:
            t.start()
        self.ready: dict[str, Any] = {}
        try:
            tag, obj = self.next_event(ready_timeout)
            if tag != "READY":
                raise SessionError(f"expected BMOE_READY, got BMOE_{tag} {obj}")
            self.ready = obj
        except BaseException:
            self.kill()
            raise

    def _read_stdout(self) -> None:
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            self.lines.append(line)
            ev = telemetry.parse_tagged(line)
            if ev is None:
                self.stray.append(line)
            else:
                self._events.put(ev)
        self._events.put(None)

    def _read_stderr(self) -> None:
        for raw in self.proc.stderr:
            self._stderr.append(raw)

    @property
    def stderr(self) -> str:
        return b"".join(self._stderr).decode("utf-8", errors="replace")

    def next_event(self, timeout: float | None = 300.0) -> Event:
        """The next protocol line; SessionError when the process ended or nothing came in time."""
        try:
            ev = self._events.get(timeout=timeout)
        except queue.Empty:
            raise SessionError(f"no line from the session in {timeout} s") from None
        if ev is None:
            self._events.put(None)  # stay at end of stream
            self.proc.wait()
            raise SessionError(f"the session ended (exit {self.proc.returncode}); stderr:\n{self.stderr[-2000:]}")
        return ev

    def send(self, obj: dict[str, Any] | str | bytes) -> None:
        """A request (dict → one JSON line; str/bytes sent as they are, newline added if missing)."""
        if isinstance(obj, dict):
            data = (json.dumps(obj) + "\n").encode()
        else:
            data = obj.encode("utf-8", "surrogateescape") if isinstance(obj, str) else obj
            if not data.endswith(b"\n"):
                data += b"\n"
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def generate(self, id: int, prompt: str, timeout: float | None = 300.0, **opts: Any) -> Iterator[Event]:
        """Send a generate request; iterate its events up to and including its DONE or ERROR
        (or a fatal ERROR). Options: n_predict, think, clear_kv."""
        self.send({"cmd": "generate", "id": id, "prompt": prompt, **opts})
        return self.events_until(id, timeout)

    def events_until(self, id: int, timeout: float | None = 300.0) -> Iterator[Event]:
        while True:
            tag, obj = self.next_event(timeout)
            yield tag, obj
            if (tag in ("DONE", "ERROR") and obj.get("id") == id) or (tag == "ERROR" and obj.get("fatal")):
                return

    def ask(self, id: int, prompt: str, **opts: Any) -> tuple[list[Event], Event]:
        """generate() collected: (all events, the final DONE/ERROR event)."""
        evs = list(self.generate(id, prompt, **opts))
        return evs, evs[-1]

    def close(self, timeout: float = 120.0) -> int:
        """Send close, wait for the process to end, return its exit code."""
        if self.proc.poll() is None:
            try:
                self.send({"cmd": "close"})
                self.proc.stdin.close()
            except (BrokenPipeError, OSError, ValueError):
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._join()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._join()

    def _join(self) -> None:
        for t in self._threads:
            t.join(10)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                f.close()
            except (OSError, ValueError):
                pass

    def __enter__(self) -> "SessionClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
