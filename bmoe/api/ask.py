"""What a caller asks of one generation (`Ask`), before bmoe.api.model's Model.prepare checks and tokenizes it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bmoe.base.settings import N_PREDICT

FIX = "shorten the prompt, lower max_tokens, or load the model with a larger n_ctx"


@dataclass(frozen=True)
class Ask:
    """What a caller asks of one generation, before it is checked and tokenized (Model.prepare): a
    prompt or a conversation (`messages`, OpenAI's), and how to answer it.

    Sampling options left None keep the load's (greedy by default). `stop` strings end the answer
    where one first appears (it is not part of the text). `think` False renders the conversation
    with `enable_thinking=False` for templates that read it; None leaves it to the load's `reasoning`
    (bmoe.chat.template). `fix` ends the message of a prompt too
    long for the context (ContextTooLong). `response_format` (OpenAI's: json_object or json_schema)
    or `grammar` (GBNF) hold the answer to a form while it is sampled; `tools`, `tool_choice` and
    `parallel_tool_calls` (OpenAI's, for a chat) show the model tools and, unless tool_choice is
    none, read its calls (bmoe.chat.request). `lossless` asks for plain llama.cpp's output whatever
    lossy routing the model was loaded with (bmoe.streaming.lossy). `forced` are token ids to
    generate instead of sampled ones (teacher forcing, as `bmoe-bench quality` scores a text;
    max_tokens is then their number), and `logits` puts on each Chunk the distribution its token
    was chosen from. `logprobs` N puts on each Chunk (and the Completion) its tokens' log-probabilities
    with the N likeliest alternatives at each step (0 to 20; bmoe.generation.logprobs); None: none.
    `add_generation_prompt` False renders a conversation without the generation prompt that opens the
    assistant's turn; `continue_final_message` continues its last (assistant) message instead of closing
    that turn (llama-server's and transformers' fields of these names).
    `ignore_eos` bans every end-of-generation token (a logit bias of -inf, as llama.cpp's common sampler
    does for its `ignore_eos`): the answer runs to max_tokens or a stop string.
    llama-server's `return_progress`, `post_sampling_probs` and `id_slot` are `progress`, `post_sampling`, `slot`.
    `clip` makes max_tokens a default rather than what the asker asked for: it is cut to the room the
    prompt leaves in the context (only a prompt that leaves none is too long), as OpenAI and llama-server
    answer a request without max_tokens (bmoe-server's `-n`).
    The sampling options besides temperature, top_p, top_k and seed (min_p, the penalties,
    logit_bias: OpenAI's token id -> bias map) are the load's settings of the same names.
    """

    prompt: str | Sequence[int] | None = None  # text, or the model's token ids as they are (llama-server's)
    messages: Sequence[Mapping[str, Any]] | None = None
    max_tokens: int = N_PREDICT
    clip: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: Mapping[int | str, float] | None = None
    stop: str | Sequence[str] | None = None
    think: bool | None = None
    fix: str = FIX
    response_format: Mapping[str, Any] | None = None
    grammar: str | None = None
    tools: Sequence[Mapping[str, Any]] | None = None
    tool_choice: str | Mapping[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    lossless: bool = False
    forced: Sequence[int] = ()
    logits: bool = False
    logprobs: int | None = None
    ignore_eos: bool = False
    progress: bool = False  # Chunks with `progress` (no text) as the prefill starts and after each llama_decode call
    post_sampling: bool = False  # logprobs of the sampler chain after its last sampler (-inf: dropped); same draws
    slot: int | None = None  # the KV sequence (Model.slots index) it runs on (the server waits for it); None: any
