"""Grammars that are slow to parse (issue 50): llama.cpp's parse of a new grammar grows with the square of
its alternatives, and the server parses every new grammar before the request queues. Checked on the
threads every request is tokenized on, a few such grammars took all of them and a plain request waited
for them (19 s behind seven on two cores). Now they are checked on threads of their own: while they are,
a plain completion and a grammar checked before are answered; past --grammar-checks plus --grammar-queue
a new grammar gets 503 at once; each slow one gets a 400 naming its field and --grammar-timeout. The
clients wait on what the server says (answers, its gauge of grammar checks), never on a fixed sleep."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.test_server import FLAGS, KEY, PROMPT, Server, auth, error_of
from tests.test_server_hostile import metric

TIMEOUT_S = 5  # --grammar-timeout
# the threads of the event loop's default executor, where grammars were checked: one slow grammar more than them
SHARED = min(32, (os.cpu_count() or 1) + 4) + 1
HANG_S = 120  # a bound only against a hang
# both far slower to parse than TIMEOUT_S (107 s and 86 s measured on a busy 2-core VM), within every size bound
SLOW_GBNF = "root ::= " + "|".join(['"a"'] * 150_000)  # 600 KB of one-letter alternatives
SLOW_FORMAT = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"enum": list(range(100_000))}}}
KNOWN = 'root ::= "yes"'


@pytest.fixture(scope="module")
def server(small_moe) -> Iterator[Server]:
    """One grammar checked at a time, one waiting."""
    s = Server("-m", str(small_moe), *FLAGS, "--grammar-checks", "1", "--grammar-queue", "1",
               "--grammar-timeout", str(TIMEOUT_S), env={"BMOE_API_KEY": KEY})
    yield s
    s.stop()


def post(server: Server, **body: Any) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", headers=auth(), timeout=HANG_S,
                      json={"prompt": PROMPT, "max_tokens": 2, **body})


def checks(server: Server) -> int:
    return int(metric(server, "bmoe_grammar_checks"))


def wait_for(what: Callable[[], bool], why: str) -> None:
    """Until `what` holds (the server's state, polled), or HANG_S pass."""
    end = time.monotonic() + HANG_S
    while not what():
        assert time.monotonic() < end, why
        time.sleep(0.05)


class Sent:
    """A request sent from a thread of its own; `answer` once it is answered."""

    def __init__(self, server: Server, answered: list[httpx.Response], **body: Any) -> None:
        self.answer: httpx.Response | None = None

        def send() -> None:
            self.answer = post(server, **body)
            answered.append(self.answer)

        self.thread = threading.Thread(target=send, daemon=True)
        self.thread.start()


def test_slow_grammars_are_checked_aside_while_plain_requests_are_answered(server: Server) -> None:
    """A slow response_format, then SHARED slow GBNF grammars at once: one is checked, one waits, the others
    get 503 at once. While the two are checked, a plain completion and a grammar checked before are
    answered; then each of the two gets its 400, naming its field and the bound."""
    assert post(server, grammar=KNOWN).status_code == 200  # checked once: it needs no check again
    answered: list[httpx.Response] = []
    schema = Sent(server, answered, response_format=SLOW_FORMAT)
    wait_for(lambda: checks(server) == 1, "the slow response_format was never checked")
    gbnf = [Sent(server, answered, grammar=SLOW_GBNF) for _ in range(SHARED)]
    wait_for(lambda: len(answered) + checks(server) == SHARED + 1, "the slow grammars never all reached the server")

    before = len(answered)  # the 503s: every slow one past the check and the one waiting
    plain, known = post(server), post(server, grammar=KNOWN)
    assert plain.status_code == 200 and plain.json()["choices"][0]["text"], plain.text
    assert known.status_code == 200, known.text
    assert len(answered) == before, "a slow grammar's check ended before the plain request was answered"

    for s in (schema, *gbnf):
        s.thread.join(HANG_S)
    full = [error_of(r, 503) for r in answered if r.status_code == 503]
    assert len(full) == SHARED - 1, [r.status_code for r in answered]
    for err in full:
        assert err["code"] == "grammar_checks_full", err
        assert "--grammar-checks" in err["message"] and "--grammar-queue" in err["message"], err
    assert schema.answer is not None
    err = error_of(schema.answer, 400)
    assert err["param"] == "response_format.json_schema.schema", err
    assert f"took longer than {TIMEOUT_S} s" in err["message"] and "--grammar-timeout" in err["message"], err
    [slow] = [r for r in answered if r.status_code == 400 and r is not schema.answer]
    err = error_of(slow, 400)
    assert err["param"] == "grammar" and err["message"].startswith("grammar: "), err
    assert f"took longer than {TIMEOUT_S} s" in err["message"] and "--grammar-timeout" in err["message"], err
    assert checks(server) == 0
    assert post(server, grammar='root ::= "no"').status_code == 200  # a new grammar is checked again
