"""The `prompt` of a completions request (OpenAI's /v1/completions, llama-server's /completion) read as
llama-server reads it (its tokenize_input_prompts): one prompt or several, each a text, a list of token ids
(texts may stand among them), or llama-server's `{"prompt_string": text}` object. A list that holds a number
is one prompt; any other list is several. Several prompts are answered as several choices (bmoe.server.answer_loop),
at most CHOICES_MAX together with `n`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bmoe.server.http_errors import ServeError

CHOICES_MAX = 16  # the answers one request may ask for: its prompts times its `n`

Prompt = str | list[int | str]  # a text, or token ids with texts among them


def _is_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def prompts_of(p: Any) -> list[Prompt]:
    """The prompts of a request's `prompt` (see the module notes); a 400 naming `prompt` for anything else."""
    if isinstance(p, list) and not any(_is_id(x) for x in p):
        if not p:
            raise ServeError(400, "prompt: an empty list has no prompt", param="prompt")
        return [_one(x, f"prompt[{i}]") for i, x in enumerate(p)]
    return [_one(p, "prompt")]


def _one(p: Any, param: str) -> Prompt:
    if isinstance(p, str):
        return p
    if isinstance(p, dict):
        if p.get("multimodal_data") not in (None, []):
            raise ServeError(400, f"{param}.multimodal_data: this model takes text only (bmoe loads no multimodal "
                             "projector)", param=f"{param}.multimodal_data")
        if not isinstance(p.get("prompt_string"), str):
            raise ServeError(400, f"{param}.prompt_string: the prompt's text", param=f"{param}.prompt_string")
        return str(p["prompt_string"])
    if isinstance(p, list) and p and all(_is_id(x) or isinstance(x, str) for x in p):
        return list(p)
    raise ServeError(400, f"{param}: a text, a list of token ids (texts may stand among them), or "
                     "{\"prompt_string\": text}", param=param)


def check_choices(prompts: int, n: int, param: str = "n") -> None:
    """At most CHOICES_MAX answers in one request (`prompts` times `n`); a 400 naming `param` past it."""
    if prompts * n > CHOICES_MAX:
        raise ServeError(400, f"{param}: {prompts} prompt(s) times {n} choice(s) is {prompts * n} answers; at most "
                         f"{CHOICES_MAX} in one request", param=param)


def tokens_of(p: Prompt, tokenize: Callable[[str, bool], list[int]]) -> str | list[int]:
    """A prompt as bmoe.api.Ask takes it: a text as it is; ids with texts among them as ids, the texts tokenized
    (`tokenize(text, add_special)`: the first item's with the vocab's special tokens, BOS, the others' without,
    as llama-server's tokenize_mixed does)."""
    if isinstance(p, str):
        return p
    out: list[int] = []
    for i, x in enumerate(p):
        out += tokenize(x, i == 0) if isinstance(x, str) else [x]
    return out
