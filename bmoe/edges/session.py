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
  integers, not floats or booleans; `n_predict` >= 1; `think`/`clear_kv`/`lossless` booleans; null
  counts as wrongly typed); unknown extra fields are ignored. Blank lines are ignored.
- bmoe's additions: a session loaded with lossy routing (docs/lossy.md) answers a request with
  `"lossless": true` with plain llama.cpp's output, and its `BMOE_DONE` lines carry, after the
  contract's keys, what lossy routing did (`protocol.LOSSY_DONE_KEYS`). Every `BMOE_DONE` then has
  `page_cache_mib`: what the I/O lanes copied from the page cache instead of reading flash this turn
  (`protocol.PAGE_CACHE_DONE_KEYS`; docs/architecture.md, "The slab and the slot pools"); a session
  loaded with `--draft` ends it with the turn's drafts (`protocol.DRAFT_DONE_KEYS`; docs/levers.md).
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
- `think` defaults to the load's `--reasoning` (auto: true). The conversation is rendered by llama.cpp's
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
import os
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

from bmoe.api import Ask, Chunk, Completion, Model, open_model
from bmoe.base import BmoeError, ConfigError, MiB, Settings, telemetry
from bmoe.edges import console, profile
from bmoe.edges.exits import EXIT_ERROR, EXIT_OK, EXIT_SIGINT, EXIT_SIGTERM
from bmoe.edges.protocol import (
    CANCEL,
    CLOSE,
    DONE_KEYS,
    DRAFT_DONE_KEYS,
    LOSSY_DONE_KEYS,
    NO_ID,
    PAGE_CACHE_DONE_KEYS,
    PROFILE,
    Generate,
    RequestError,
    parse_request,
    safe,
)

CONTEXT_FIX = "shorten it, lower n_predict, start a new chat (clear_kv:true) or restart the session with a larger -c"


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
        self.line("ERROR", {"id": rid, "fatal": fatal, "msg": safe(msg)})


# ---- the session ---------------------------------------------------------------------------------


class Session:
    """Conversation state over one Model (bmoe.api: its `run` keeps the conversation and the KV).
    Generation runs on the calling (main) thread only; the request reader thread only queues
    requests, answers bad ones and flags cancels."""

    def __init__(self, model: Model, out: Output, n_predict: int,
                 notice: Callable[[str], None] = console.notice) -> None:
        self.model = model
        self.out = out
        self.n_predict = n_predict
        self.notice = notice
        self.requests: queue.Queue[Generate | str] = queue.Queue()
        self.in_flight: int | None = None  # id of the queued or running generate (under out.lock)
        self.cancel_asked = False  # a cancel came for it before its Generation was made (under out.lock)

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
                    self._cancel()
                return None
            if req == CLOSE:
                if self.in_flight is not None:
                    self._cancel()
                self.requests.put(CLOSE)
                return CLOSE
            assert isinstance(req, Generate)  # every other command is handled above
            if self.in_flight is not None:
                self.out.error(req.id, f"generation {self.in_flight} is still running; wait for its "
                                       "BMOE_DONE or send {\"cmd\":\"cancel\"}")
                return None
            self.in_flight = req.id
            self.requests.put(req)
        return None

    def _cancel(self) -> None:
        """Cancel the generate in flight: its Generation if made, else when it is (under out.lock)."""
        self.cancel_asked = True
        self.model.cancel()

    def profile(self) -> None:
        """The per-process table (coordinator, workers) on stderr, on demand; stdout stays protocol-only."""
        e = self.model.stats.engine
        print(profile.process_table(profile.collect(list(e.workers)), e.resident_bytes, list(e.lanes)), file=sys.stderr,
              flush=True)

    # -- main thread --

    def serve(self) -> None:
        """Run queued generations until close."""
        while True:
            try:
                req = self.requests.get(timeout=0.5)  # a timeout keeps signals prompt
            except queue.Empty:
                self.model.follow_memory()
                continue
            if req == CLOSE:
                return
            assert isinstance(req, Generate)  # the queue holds generations and CLOSE
            self.run(req)

    def _finish(self, tag: str, obj: dict[str, Any]) -> None:
        with self.out.lock:
            self.in_flight = None
            self.cancel_asked = False
            self.out.line(tag, obj)

    def run(self, req: Generate) -> None:
        self.model.check_unchanged("restart the session to load it again")  # fatal: see the notes
        base = [] if req.clear_kv else self.model.messages
        try:
            job = self.model.prepare(Ask(messages=[*base, {"role": "user", "content": req.prompt}],
                                         max_tokens=req.n_predict, think=req.think, fix=CONTEXT_FIX,
                                         lossless=req.lossless))
        except ConfigError as e:
            self._finish("ERROR", {"id": req.id, "fatal": False, "msg": safe(str(e))})
            return
        self.out.line("BEGIN", {"id": req.id})
        text = ""

        def on_chunk(c: Chunk) -> None:
            nonlocal text
            if c.token is not None:
                text += c.text
                self.out.raw(telemetry.token_lines(c.token, text))

        with self.out.lock:
            gen = self.model.generation(job, on_chunk)
            if self.cancel_asked:
                self.model.driver.cancel(gen)
        try:
            done = self.model.run(gen)
        except ConfigError as e:  # should not happen (checked above); keep serving all the same
            self._finish("ERROR", {"id": req.id, "fatal": False, "msg": safe(str(e))})
            return
        self._finish("DONE", self._done(req.id, done))

    def _done(self, rid: int, done: Completion) -> dict[str, Any]:
        e, s = self.model.stats.engine, done.stats
        gate = e.spec_gate
        obj = {
            "id": rid, "cancelled": s.finish_reason == "cancelled", "tokens": s.completion_tokens,
            "tok_s": round(s.tok_s, 3), "prefill_s": round(s.prefill_s, 4), "load_s": round(e.load_s, 3),
            "cache_hit_pct": round(s.cache_hit_pct, 2), "n_prompt": s.prefill_tokens, "n_past": s.kv_tokens,
            "cache_resident_mib": round(e.resident_bytes / MiB, 2),
            "cache_budget_mib": round(e.budget_bytes / MiB, 2),
            "spec_recall_pct": round(gate[0], 2) if gate else -1.0,
            "stall_s_tok": round(s.stall_s_per_token, 5), "mgmt_s_tok": round(s.mgmt_s_per_token, 5),
            "text": done.text,
        }
        if e.lossy:
            obj.update(lossy=s.lossy, experts_per_token=s.experts_per_token, dropped_tok=round(s.dropped_per_token, 3),
                       substituted_tok=round(s.substituted_per_token, 3),
                       weight_changed_pct=round(s.weight_changed_pct, 3))
        obj["page_cache_mib"] = round(s.page_cache_mib, 2)
        drafting = self.model.settings.draft.mode != "none"
        if drafting:
            obj.update(drafted=s.drafted, accepted=s.accepted, draft_extra_mib=round(s.draft_extra_mib, 2))
        assert tuple(obj) == (DONE_KEYS + (LOSSY_DONE_KEYS if e.lossy else ()) + PAGE_CACHE_DONE_KEYS
                              + (DRAFT_DONE_KEYS if drafting else ()))
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
        if not isinstance(exc, BmoeError):
            msg = f"{type(exc).__name__}: {msg}"
        if rid != NO_ID:
            msg = f"generation {rid} failed: {msg}"
    console.error(msg)
    with out.lock:
        try:
            out.error(rid, msg, fatal=True)
        except ClientGone:
            pass
        out.seal()
    return code


def serve_session(a: argparse.Namespace, settings: Settings, stdin_fd: int = 0) -> int:
    """`bmoe-cli --session`: load once, then serve requests until close, EOF or a signal."""
    try:
        # typeshed's TextIO has no reconfigure; a replaced stdout may lack it (AttributeError)
        sys.stdout.reconfigure(encoding="utf-8", errors="backslashreplace")  # type: ignore[union-attr]
    except (AttributeError, ValueError):
        pass
    out = Output(sys.stdout)
    ignored = [f for f, on in (("-p", a.prompt is not None), ("-f", a.file), ("--chat", a.chat),
                               ("--progress", a.progress), ("--csv", a.csv))
               if on]
    if ignored:
        console.notice(f"{', '.join(ignored)} ignored in session mode (prompts come from stdin)")
    model: Model | None = None
    session: Session | None = None
    try:
        model = open_model(settings, console.notice)
        session = Session(model, out, a.n_predict)
        e = model.stats.engine
        out.line("READY", {"load_s": round(e.load_s, 3), "arch": e.arch, "n_ctx": e.n_ctx})
        threading.Thread(target=session.read_requests, args=(stdin_fd,), name="bmoe-requests",
                         daemon=True).start()
        session.serve()
        if a.profile:
            session.profile()
        return EXIT_OK
    except ClientGone:
        console.notice("stdout closed; ending the session")
        return EXIT_ERROR
    except BaseException as e:  # noqa: BLE001 - every end writes its fatal line first
        rid = session.in_flight if session is not None and session.in_flight is not None else NO_ID
        return _fatal(out, rid, e)
    finally:
        out.seal()
        if model is not None:
            model.close()
