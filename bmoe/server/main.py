"""`bmoe-server`: one loaded model served over HTTP (FastAPI + uvicorn) in five APIs: OpenAI's
completions and chat completions (bmoe.server.openai_wire), OpenAI's Responses API
(bmoe.server.responses_wire), Anthropic's Messages API (bmoe.server.anthropic_wire), Ollama's API
(bmoe.server.ollama_wire) and llama-server's native API (bmoe.server.llama_wire), the OpenAI routes
also without `/v1` as llama-server serves them. Each request is translated into the chat route's
(or the completions route's), so one engine, scheduler, grammar and prompt cache answer them all,
through one answer loop (bmoe.server.app's Endpoints.answer); every generation goes through
bmoe.generation.request_life.Generation. The routes, and what each takes and refuses, are listed
once: docs/server.md.

Decisions:

- Up to `--parallel N` generations run at once (one KV sequence each), on one worker thread
  (bmoe.server.scheduler): each step batches them or lets them take turns (`--batching`, by default
  whichever measured faster per generated token). Up to `--queue` more requests wait, more get
  429. The `X-Queue-Position` header says how many requests were ahead at admission (0: it runs
  at once); a stream also says `: queue position N` (an SSE comment, which clients skip) as it
  moves up.
- A request is checked before it queues (pydantic with strict types; the prompt against the
  context; a new grammar parsed by llama.cpp on threads of its own, so that slow grammars hold up
  no other request: bmoe.server.grammar_pool), so a bad one gets its 400 at once and never waits.
- Options a request leaves out take the server's flags: `max_tokens` is `-n`, sampling is
  `--temp/--top-k/--top-p/--min-p/--seed`, the penalties and `--logit-bias` (greedy by default, so a
  request's answer equals `bmoe-cli`'s for the same prompt and settings). `top_k`, `min_p`,
  `repeat_penalty`, `repeat_last_n` and `think` (chat: False renders the conversation with
  `enable_thinking=False`, true with true; left out, `--reasoning` decides) are extensions; `n` choices are
  that many requests queued, choice i seeded with the request's seed plus i, as llama-server seeds its copies
  (bmoe.server.answer_loop), so each is what one request with that seed gives (decoded together, what those
  requests give together); the `model` field is not checked (one model is served, as llama-server does with
  one model; responses name it: `--alias`, else the GGUF's name; `GET /v1/models/{id}` takes either and
  404s any other).
- A field of OpenAI's (or llama-server's) API that bmoe does not implement (`best_of`, `echo`,
  `suffix`, `mirostat`, ...: bmoe.server.openai_wire.UNIMPLEMENTED) is a 400 naming it unless its value asks
  for nothing (`echo: false`, `best_of: 1`); silently ignoring it would answer another question.
  Any other unknown field is ignored: clients send their own extensions.
- Lossy routing (`--experts-per-token`, `--drop-cold`, `--cache-routing`; docs/lossy.md) is a
  load-time setting; a request asks for plain llama.cpp's output with `"bmoe": {"lossless": true}`
  and gets it (never from KV a lossy request computed). The `bmoe` object is strict: a key it does
  not know is a 400.
- A chat whose messages extend an earlier request's conversation (its messages, the answer as
  it was returned, then more; a tool call's arguments compared as JSON values, reasoning left
  out) reuses that KV sequence's prefix while the sequence still holds it
  (a free sequence is taken least recently used first); any other request starts from an empty KV.
- Telemetry: each response's `bmoe` field holds the request's (bmoe.api.GenerationStats: tok/s,
  MiB/token, hit %, stall, prefill ...), a streamed token's chunk that token's (the contract's
  BMOE_PROGRESS fields but the text); `/metrics` has totals and the last request's figures.
  A stream's finish chunk carries `bmoe`; `usage` only with `stream_options.include_usage`, as the
  spec has it: `null` on every chunk, then a last chunk of its own with `choices: []`.
- A client that disconnects cancels its generation at once, or leaves the queue.
- `--draft ngram|mtp` (bmoe-cli's flags, bmoe.engine.drafts): a request decoding alone (`--parallel 1`, a
  `turns` step, or the only one running) drafts and verifies as bmoe-cli does, each sequence with its own
  drafts and gate; requests decoded together in one batch take one token a step, and so does a request asking
  for logprobs. llama-server's reports follow: `timings.draft_n`/`draft_n_accepted`, `/slots`' `speculative`,
  the `llamacpp:spec_decode_*` series; a request's `speculative.*` fields are ignored, as llama-server ignores them.
- `--embedding` (bmoe.server.embeddings) keeps generation on, as llama-server does: the context is made
  with embeddings on and each embeddings request turns them on for its own decodes only. Its inputs
  queue with the generations, take a free KV sequence (one holding no conversation first) and are
  decoded one by one between the running generations' steps, so a long embeddings request delays
  their next token by its inputs' prefills; a client that leaves stops it mid-decode.
- Security: binds 127.0.0.1 by default; `--api-key` (or `--api-key-file`, or `BMOE_API_KEY`) requires
  `Authorization: Bearer KEY` (or Anthropic's `x-api-key: KEY`) on every route but /health and the
  chat page's static files (the page sends the key it is given on its own API calls); a
  non-loopback `--host` without a key is refused unless `--insecure`; a keyed route refuses a
  request without the key (401) before it reads the body. Without a key, a request whose `Host`
  names neither an IP address, localhost, `--host` nor an `--allowed-host`, or that comes from a web
  page of another origin than the chat page's (`--allowed-origin`), gets 403: a page cannot rebind
  its name to 127.0.0.1 and drive the server (bmoe.server.hosts). CORS headers go to exactly the
  `--allowed-origin` pages (`localhost`: every loopback page), keyed or not; none by default (a preflight is
  then a 405). Bodies over `--max-body-kb` get
  413; a body must arrive within `--body-timeout` of its head plus a second per `--min-body-rate` KB
  (408), and every connection's bodies together are bounded by `--max-bodies-mb` (503). The
  Responses API's stored responses take `--store-responses-mb` of memory at most, every field
  counted (bmoe.server.response_store). New grammars are parsed within `--grammar-timeout` (400
  past it), `--grammar-checks` at a time with `--grammar-queue` more waiting (503 past them). Every error
  is an OpenAI error object `{"error": {"message", "type", "param", "code"}}` (llama-server's types on its
  own routes: bmoe.server.llama_routes); in a stream that has
  begun, an `{"error": ...}` event before `[DONE]`. Under /v1/messages it is
  Anthropic's `{"type": "error", "error": {"type", "message"}}` (an `error` event in a stream), and
  a full queue is 529 `overloaded_error` there (Anthropic's clients retry it as they retry the API's own);
  under /api/ it is Ollama's `{"error": "..."}` (an `{"error": ...}` line in a stream).
- `--sleep-idle-seconds S` (llama-server's sleep mode, bmoe.server.sleep): S seconds with no request that needs
  the model, it is released as a shutdown releases it (the Model object stays, its engine closed); /health,
  /props (`is_sleeping`), /models and /metrics answer without waking it, and the next request that needs it
  loads it again with the same settings first (one load for concurrent ones; a failed load is a 503).
- One of several replicas behind a router (docs/deploy.md, bmoe.server.replica): every answer names the replica
  (`--replica-id`, header X-Bmoe-Replica) and so do the Responses API's ids; `--response-store sqlite:PATH`
  keeps the stored responses in a file the replicas on one machine share (bmoe.server.response_sqlite), so a
  conversation goes on on any of them and across restarts.
- SIGTERM drains first (`--drain-seconds`, bmoe.server.replica): new requests get 503 with Retry-After and
  /health says "draining" (a router takes the replica out and retries elsewhere), the requests in flight run
  to their end within the drain's seconds; then, and at once on SIGINT, the shutdown: the running generation
  is cancelled, waiting requests get 503, and the process exits 143 / 130 with its I/O lanes stopped and its
  shared memory freed. The shutdown takes `--shutdown-timeout` seconds at most (open responses ending, the
  generation stopping); past it, or at a second signal, the process exits at once, its lanes killed and its
  shared memory unlinked, llama.cpp's objects left to the exit (bmoe.edges.exits.Shutdown). A lane that
  keeps failing or a model file changed under the server is fatal: the request gets a 500 and
  the server exits 1, as the session does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import ipaddress
import math
import os
import signal
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

try:
    import uvicorn

    from bmoe.server.app import create_app
    from bmoe.server.connections import BodyLimits, HeadDeadline
    from bmoe.server.grammar_pool import GrammarPool
    from bmoe.server.hosts import Trusted, host_names, origins
    from bmoe.server.replica import DRAIN_S, Replica, replica_name
    from bmoe.server.response_redis import RedisResponses
    from bmoe.server.response_sqlite import SqliteResponses
    from bmoe.server.response_store import ENTRY_BYTES, KEPT, KEPT_MB, TTL_S, KeptResponses, ResponseStore
    from bmoe.server.vertex import Vertex
except ImportError as e:  # the server extra is not installed
    raise SystemExit(f"bmoe-server: error: {e.name} is missing; install the server extra: "
                     "pip install 'bmoe[server]'") from None

from bmoe.api import Model, open_model
from bmoe.base import (
    N_PREDICT,
    SCHEMA,
    BmoeError,
    ConfigError,
    nonneg_int,
    number,
    positive_float,
    positive_int,
    schema_of,
    setting,
)
from bmoe.chat import CHECK_S
from bmoe.edges import console, exits, flags
from bmoe.server.scheduler import MODES, Scheduler

PROG = "bmoe-server"
RESTART_FIX = "restart bmoe-server to load it again"

EXAMPLES = """\
examples:
  bmoe-server                                      # the demo model at http://127.0.0.1:8000/v1
  bmoe-server -m model.gguf --cache-mb 2000 --io-threads 4 --queue 16
  bmoe-server -m model.gguf --parallel 4          # up to 4 requests decode at once, batched when it pays
  bmoe-server -m model.gguf --draft ngram --draft-max 4   # a request decoding alone drafts 4 tokens from its
                      # prompt and verifies them in one decode (the same text; timings' draft_n, /metrics' spec_decode)
  bmoe-server -m model.gguf --host 0.0.0.0 --api-key-file ~/.bmoe-key  # from the network, with the key in a file
                      # (its first line; unlike --api-key KEY, not in the process list other local users can read)
  BMOE_API_KEY=secret bmoe-server -m model.gguf --port 0      # any free port (printed at start)
  bmoe-server -m model.gguf --alias my-moe        # clients see (and may ask for) the model as "my-moe"
  bmoe-server -m model.gguf --no-webui             # the API only: no chat page at /
  bmoe-server -m model.gguf --sleep-idle-seconds 300  # release the model after 5 idle minutes; a request reloads it
  bmoe-server -m model.gguf --port 8601 --replica-id r1 --response-store sqlite:/var/lib/bmoe/responses.db
                      # one replica of several behind a router (docs/deploy.md; deploy/haproxy.cfg)
  bmoe-server -m model.gguf --allowed-host my-alias,bmoe.home --allowed-origin chrome-extension://abcdef
                      # no key: also answer names that /etc/hosts points here, and requests from that extension
  bmoe-server -m model.gguf --api-key-file ~/.bmoe-key --allowed-origin http://localhost:5173
                      # a browser app at that origin may call the server (CORS), with the key

  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32}'
  python -c 'import openai; c = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none");
             print(c.completions.create(model="bmoe", prompt="Once upon a time", max_tokens=32).choices[0].text)'
  python -c 'import anthropic; c = anthropic.Anthropic(base_url="http://127.0.0.1:8000", api_key="none");
             print(c.messages.create(model="bmoe", max_tokens=32, messages=[{"role": "user", "content": "Hi"}]))'
"""


def _addresses(text: str) -> str:
    """--host: one address or a comma list of them, spaces dropped; none at all is a usage error."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("give an address to listen on, e.g. 127.0.0.1 or 127.0.0.1,::1")
    return ",".join(names)


def _tags(text: str) -> tuple[str, ...]:
    return tuple(sorted({t.strip() for t in text.split(",") if t.strip()}))


def _seconds(text: str) -> float:
    return number(text, float, "a number of seconds", lambda v: 0 <= v < float("inf"), "must be 0 or more")


STORES = ("memory", "sqlite:PATH", "redis://HOST:PORT/DB")


def _store(text: str) -> str:
    """--response-store: `memory`, `sqlite:` and a file's path, or a Redis URL."""
    if text == "memory" or (text.startswith("sqlite:") and text.removeprefix("sqlite:")) or \
            text.startswith(("redis://", "rediss://", "unix://")):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: give one of {', '.join(STORES)} (e.g. sqlite:/var/lib/bmoe/r.db)")


def _port(text: str) -> int:
    return number(text, int, "a port number", lambda v: 0 <= v <= 65535, "must be 0 (any free port) to 65535")


@dataclass(frozen=True)
class ServeSettings:
    """The server's own settings (the model's are bmoe.base.settings'), declared as those are."""

    host: str = setting("127.0.0.1", "--host", parse=_addresses,
                        help="address to listen on, or several comma-separated (e.g. 127.0.0.1,::1), all on --port "
                             "(default {default}: this machine only); any other address needs --api-key, or "
                             "--insecure")
    port: int = setting(8000, "--port", parse=_port, help="TCP port (default {default}; 0: any free port, printed)")
    api_key: str | None = setting(None, "--api-key", metavar="KEY",
                                  help="require 'Authorization: Bearer KEY' on every route but /health (default: "
                                       "$BMOE_API_KEY; none); any local user can read it in the process list: "
                                       "prefer --api-key-file or $BMOE_API_KEY")
    api_key_file: str | None = setting(None, "--api-key-file", metavar="PATH",
                                       help="--api-key's KEY read from the first line of this file (stripped), so "
                                            "it is not in the process list")
    insecure: bool = setting(False, "--insecure",
                             help="allow a non-loopback --host without an API key (anyone who reaches it can use it)")
    allowed_hosts: tuple[str, ...] = setting(
        (), "--allowed-host", parse=host_names, repeat=True, metavar="NAME",
        help="without an API key, also answer requests sent to this name (repeat it or give a comma list; * for "
             "any): by default only IP addresses, localhost and --host are answered, so a web page cannot point "
             "its own name at this server (DNS rebinding); with a key, names are not checked")
    allowed_origins: tuple[str, ...] = setting(
        (), "--allowed-origin", parse=origins, repeat=True, metavar="ORIGIN",
        help="let a web page at ORIGIN (SCHEME://HOST[:PORT], null, or localhost: every page on this machine's "
             "loopback names, any scheme and port) use this server from a browser (repeat it or give a comma list; * "
             "for any): it gets CORS headers, with or without a key, and without a key "
             "its requests are served; by default no page gets CORS headers and, without a key, only the server's "
             "own chat page and clients that send no Origin are served")
    queue: int = setting(8, "--queue", parse=nonneg_int, metavar="N",
                         help="requests that may wait for a KV sequence (see --parallel); more get 429 (default "
                              "{default})")
    batching: str = setting(
        "auto", "--batching", choices=MODES,
        help="with --parallel N above 1, how running requests share a decode step: batch (one llama.cpp batch, "
             "each layer reads their experts' union once), turns (the oldest alone), or auto (default: whichever "
             "it measured faster per generated token; it starts with batch when every expert is cached, turns "
             "otherwise)")
    max_body_kb: int = setting(1024, "--max-body-kb", parse=positive_int, metavar="KB",
                               help="largest request body; larger gets 413 (default {default})")
    body_timeout: float = setting(10.0, "--body-timeout", parse=positive_float, metavar="S",
                                  help="seconds a request's body may take to arrive after its head, plus one for "
                                       "every --min-body-rate KB it has brought; then it gets 408 and the "
                                       "connection is closed (default {default})")
    min_body_rate: int = setting(32, "--min-body-rate", parse=positive_int, metavar="KB",
                                 help="KB a second a body must keep up past --body-timeout's first seconds "
                                      "(default {default})")
    max_bodies_mb: int = setting(64, "--max-bodies-mb", parse=positive_int, metavar="MB",
                                 help="request bodies held at once, every connection's together; a body that "
                                      "would pass it gets 503 (default {default})")
    write_timeout: float = setting(30.0, "--write-timeout", parse=positive_float, metavar="S",
                                   help="seconds a client may leave a piece of its response unread (a slow or stuck "
                                        "reader); then the response is cut and its generation cancelled "
                                        "(default {default})")
    max_connections: int = setting(256, "--max-connections", parse=positive_int, metavar="N",
                                   help="open connections at most; more get 503 at once (default {default})")
    idle_timeout: int = setting(5, "--idle-timeout", parse=positive_int, metavar="S",
                                help="seconds a connection may stay open without a request: from connecting, or "
                                     "from its last answer, to a request's complete head (default {default})")
    store_responses: int = setting(
        KEPT, "--store-responses", parse=nonneg_int, metavar="N",
        help="responses the Responses API keeps for previous_response_id and GET /v1/responses/ID, the least "
             "recently used dropped first (default {default}; 0 keeps none)")
    store_responses_mb: int = setting(
        KEPT_MB, "--store-responses-mb", parse=positive_int, metavar="MB",
        help="MiB the kept responses take together, every field of each counted: in memory each is held as "
             f"its JSON bytes plus {ENTRY_BYTES} bytes, in a shared --response-store as its JSON bytes; one larger "
             "than this alone is not kept (default {default})")
    response_store: str = setting(
        "memory", "--response-store", parse=_store, metavar="STORE",
        help="where the Responses API's kept responses are: memory (default: this process's, gone at a restart), "
             "sqlite:PATH, a file the replicas on this machine share (WAL mode), or redis://HOST:PORT/DB, a Redis "
             "server replicas on several machines share (pip install 'bmoe[redis]'): previous_response_id then goes "
             "on on any replica and across restarts (docs/deploy.md)")
    store_responses_ttl: float = setting(
        TTL_S, "--store-responses-ttl", parse=positive_float, metavar="S",
        help="seconds a response stays in a shared --response-store after it was kept (default {default}: 30 "
             "days, as OpenAI keeps them); in memory they last as long as the process and the bounds")
    replica_id: str | None = setting(
        None, "--replica-id", parse=replica_name, metavar="NAME",
        help="this server's name among the replicas behind a router: every answer carries it (header "
             "X-Bmoe-Replica) and the Responses API's ids end with it, so a router can send a conversation back "
             "(letters, digits, '.', ':', '-'; none by default: a lone server does not tell its clients the "
             "machine's name)")
    drain_seconds: float = setting(
        DRAIN_S, "--drain-seconds", parse=_seconds, metavar="S",
        help="on SIGTERM, first drain for up to S seconds: new requests get 503 (Retry-After) and /health answers "
             "503 draining, the requests in flight run to their end; then the shutdown (--shutdown-timeout). 0: no "
             "drain; SIGINT never drains (default {default})")
    grammar_checks: int = setting(2, "--grammar-checks", parse=positive_int, metavar="N",
                                  help="new grammars (a request's grammar, response_format or tools) llama.cpp "
                                       "parses at once, each in a process of its own, on threads no other request "
                                       "waits for (default {default})")
    grammar_queue: int = setting(8, "--grammar-queue", parse=nonneg_int, metavar="N",
                                 help="new grammars that may wait for one of --grammar-checks; more get 503 at once "
                                      "(default {default}); a grammar that passed before does not wait")
    grammar_timeout: float = setting(CHECK_S, "--grammar-timeout", parse=positive_float, metavar="S",
                                     help="seconds llama.cpp may take to parse a new grammar; a slower one gets 400 "
                                          "naming its field (default {default})")
    alias: str | None = setting(None, "--alias", metavar="NAME",
                                help="the model's id: what /v1/models lists and responses name (default: the GGUF's "
                                     "name, which GET /v1/models/ID takes either way; a request's `model` is not "
                                     "checked); several comma-separated are all taken, the first in sorted order "
                                     "being the id, as llama-server's")
    tags: tuple[str, ...] = setting((), "--tags", parse=_tags, metavar="TAGS",
                                    help="labels /v1/models lists with the model, comma-separated (as llama-server's; "
                                         "informational: they route nothing)")
    webui: bool = setting(True, "--no-webui", help="serve no chat page at / (the API and its events stay)")
    slots: bool = setting(True, "--no-slots",
                          help="serve no /slots (llama-server's view of the KV sequences: each one's state and token "
                               "count, no text); it answers 501")
    metrics: bool = setting(True, "--no-metrics", help="serve no /metrics (Prometheus); it answers 501")
    sleep_idle_seconds: float | None = setting(
        None, "--sleep-idle-seconds", parse=positive_float, metavar="S",
        help="release the model after S seconds with no request that needs it (llama-server's sleep mode: its "
             "memory, KV, I/O lanes and shared memory handed back; /health, /props, /models and /metrics answer "
             "without waking it); the next such request loads it again with the same settings before it runs "
             "(default: never)")
    shutdown_timeout: float = setting(
        10.0, "--shutdown-timeout", parse=positive_float, metavar="S",
        help="seconds a shutdown (SIGINT, SIGTERM after its drain) may take while open responses end and the "
             "running generation stops; past it, or at a second signal, the server exits at once with its I/O lanes "
             "stopped and its shared memory freed (default {default})")


SERVE = schema_of(ServeSettings)


def build_parser() -> argparse.ArgumentParser:
    """Every model setting's flag (bmoe.base.settings), -n, and the server's own group."""
    ap = argparse.ArgumentParser(
        prog=PROG, usage="%(prog)s [-m MODEL] [options]", epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve a Mixture-of-Experts GGUF larger than RAM over the OpenAI HTTP API (completions, chat "
                    "completions, responses, streaming), Anthropic's Messages API and Ollama's API, streaming its "
                    "experts from flash; one model, up to --parallel generations at a time, more requests queue.")
    flags.add_options(ap, SCHEMA, before={"threads": lambda ap: flags.add_n_predict(
        ap, f"max_tokens of a request that does not say (default {N_PREDICT})")})
    flags.add_options(ap.add_argument_group("server"), SERVE)
    return ap


def serve_settings(ap: argparse.ArgumentParser, a: argparse.Namespace) -> ServeSettings:
    """The server's own flags; a network address without a key, or a bound on every body below one body's,
    is a usage error (exit 2)."""
    s = ServeSettings(**{e.field.name: v for e, v in ((e, getattr(a, e.name)) for e in SERVE) if v is not None})
    if s.api_key_file is not None:
        if s.api_key is not None:
            ap.error("give either --api-key or --api-key-file, not both")
        s = dataclasses.replace(s, api_key=_key_from(ap, s.api_key_file))
    if s.api_key is None and os.environ.get("BMOE_API_KEY"):
        s = dataclasses.replace(s, api_key=os.environ["BMOE_API_KEY"])
    if s.max_bodies_mb * 1024 < s.max_body_kb:
        ap.error(f"--max-bodies-mb {s.max_bodies_mb} holds less than one body of --max-body-kb {s.max_body_kb}; "
                 "raise it or lower --max-body-kb")
    for host in s.host.split(","):
        if not _loopback(host) and not s.api_key and not s.insecure:
            ap.error(f"--host {host} lets other machines reach the model; give --api-key-file PATH, "
                     "--api-key KEY or BMOE_API_KEY, or say --insecure to serve it without a key")
    return s


def _key_from(ap: argparse.ArgumentParser, path: str) -> str:
    """--api-key-file's key: the file's first line, stripped; an unreadable or empty file is a usage error."""
    try:
        with open(path, encoding="utf-8") as f:
            key = f.readline().strip()
    except (OSError, UnicodeDecodeError) as e:
        ap.error(f"--api-key-file {path}: cannot read it ({getattr(e, 'strerror', None) or e}); give a readable file "
                 "whose first line is the key")
    if not key:
        ap.error(f"--api-key-file {path}: its first line is empty; put the key on it")
    return key


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen(hosts: str, port: int) -> list[socket.socket]:
    """The listening sockets, one per --host address, made before the model loads so a busy port fails at
    once; with --port 0 the first address's free port is every address's. An IPv6 socket takes IPv6 only
    (Python's default), so `::` beside `0.0.0.0` does not claim it twice."""
    socks: list[socket.socket] = []
    try:
        for host in hosts.split(","):
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            try:
                socks.append(socket.create_server((host, port), family=family))
            except OSError as e:
                raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}; choose another --port or "
                                  "--host") from None
            port = socks[0].getsockname()[1]
    except ConfigError:
        for sock in socks:
            sock.close()
        raise
    return socks


class Server(uvicorn.Server):
    """uvicorn's server with bmoe's start line and a shutdown that cancels the generation at once.

    Signals are bmoe's (exits.Shutdown, which calls `handle_exit` on the first): uvicorn's own
    handlers would be put back once it stops serving, leaving a second signal during the rest of
    the shutdown (the scheduler's join, the model's close) to nobody, and re-raise the first."""

    def __init__(self, config: uvicorn.Config, sched: Scheduler, url: str, chat_page: bool) -> None:
        super().__init__(config)
        self.sched = sched
        self.url = url
        self.chat_page = chat_page
        self.loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.loop = asyncio.get_running_loop()
        if self.started:
            console.notice(f"serving {self.sched.model.name} at {self.url}/v1 (parallel {self.sched.capacity}, "
                           f"batching {self.sched.batching.mode}, queue {self.sched.size})")
            if self.chat_page:
                console.notice(f"chat page at {self.url}/")

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.sched.close)

    def end(self) -> None:
        """From any thread: stop serving (a fatal error)."""
        self.should_exit = True


def open_store(opts: ServeSettings) -> KeptResponses:
    """The Responses store --response-store names, within --store-responses and --store-responses-mb."""
    most, bound = opts.store_responses, opts.store_responses_mb << 20
    if opts.response_store.startswith("sqlite:"):
        path = os.path.expanduser(opts.response_store.removeprefix("sqlite:"))
        return SqliteResponses(path, most, bound, opts.store_responses_ttl)
    if opts.response_store != "memory":
        return RedisResponses(opts.response_store, most, bound, opts.store_responses_ttl)
    return ResponseStore(most, bound)


def drain_on_sigterm(replica: Replica, shutdown: exits.Shutdown, server: Server) -> None:
    """SIGTERM drains first (bmoe.server.replica), then starts the shutdown; a SIGTERM before the server serves,
    or while it drains, is the shutdown's own (a second one during the shutdown ends it at once)."""
    def on_sigterm(signum: int, frame: Any) -> None:
        loop = server.loop
        if replica.draining or loop is None or shutdown.code is not None:
            shutdown.on_signal(signum, frame)
            return
        replica.draining = True  # at once: a second SIGTERM before the loop starts the drain is the shutdown's

        def drained() -> None:
            if shutdown.code is None:  # no other signal started the shutdown meanwhile
                shutdown.on_signal(signum, None)

        loop.call_soon_threadsafe(replica.drain, drained)

    signal.signal(signal.SIGTERM, on_sigterm)


def run_server(model: Model, opts: ServeSettings, n_predict: int, socks: list[socket.socket],
               kept: KeptResponses, vertex: Vertex | None = None) -> int:
    """Serve until a signal (exit 143/130, after a SIGTERM's drain, bounded by --shutdown-timeout: exits.Shutdown)
    or a fatal error (exit 1)."""
    fatal: list[BaseException] = []
    server: Server | None = None

    def on_fatal(e: BaseException) -> None:
        fatal.append(e)
        assert server is not None  # the scheduler starts after the server exists
        server.end()

    sched = Scheduler(model, opts.queue, on_fatal, reload_fix=RESTART_FIX, batching=opts.batching)
    host, port = socks[0].getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    replica = Replica(opts.replica_id or "", opts.drain_seconds)
    limits = BodyLimits(size=opts.max_body_kb * 1024, timeout=opts.body_timeout, rate=opts.min_body_rate * 1024,
                        total=opts.max_bodies_mb << 20)
    grammars = GrammarPool(str(model.settings.model), opts.grammar_checks, opts.grammar_queue, opts.grammar_timeout)
    app = create_app(model, sched, api_key=opts.api_key, limits=limits, grammars=grammars, n_predict=n_predict,
                     alias=opts.alias, webui=opts.webui, write_timeout=opts.write_timeout,
                     trusted=Trusted(opts.host, opts.allowed_hosts, opts.allowed_origins),
                     kept=kept, slots=opts.slots, metrics_route=opts.metrics, tags=opts.tags, vertex=vertex,
                     sleep_idle=opts.sleep_idle_seconds, replica=replica)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=math.ceil(opts.shutdown_timeout),
                            http=HeadDeadline, limit_concurrency=opts.max_connections,
                            timeout_keep_alive=opts.idle_timeout)
    server = Server(config, sched, url, opts.webui)
    shutdown = exits.Shutdown(opts.shutdown_timeout, lambda sig: server.handle_exit(sig, None), model.release_now,
                              PROG)
    shutdown.install()
    if opts.drain_seconds > 0:
        drain_on_sigterm(replica, shutdown, server)
    sched.start()
    try:
        server.run(sockets=socks)
    finally:
        sched.close()
        sched.join()
    if fatal:
        e = fatal[0]
        console.error(f"{type(e).__name__}: {e}", PROG)
        return exits.EXIT_ERROR
    if shutdown.code == exits.EXIT_SIGINT:
        console.error("interrupted", PROG)
    return shutdown.code or exits.EXIT_OK


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    settings = flags.settings_from(ap, a)
    if settings.replay_routes:  # a benchmark mode: the answers would not be the model's
        ap.error("--replay-routes is a benchmark mode: every answer would follow the trace's routing, not the "
                 "model's; bmoe-server does not run it (use bmoe-cli or bmoe-bench run)")
    opts = serve_settings(ap, a)
    exits.install_signal_handlers()
    model: Model | None = None
    kept: KeptResponses | None = None
    try:
        vertex = Vertex.of(os.environ)  # Vertex AI's container: its port and prediction route (bmoe.server.vertex)
        socks = listen(opts.host, vertex.port if vertex is not None else opts.port)
        try:
            kept = open_store(opts)  # before the model: a store that cannot be used fails at once
            model = open_model(settings, console.notice)
            return run_server(model, opts, a.n_predict, socks, kept, vertex)
        finally:
            for sock in socks:
                sock.close()
            if model is not None:
                model.close()
            if kept is not None:
                kept.close()
    except (BmoeError, OSError) as e:
        console.error(str(e), PROG)
        return exits.EXIT_ERROR
    except KeyboardInterrupt:
        console.error("interrupted", PROG)
        return exits.EXIT_SIGINT
