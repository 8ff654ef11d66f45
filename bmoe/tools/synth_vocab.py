"""bmoe-synth's tokenizer and chat template: an SPM vocabulary of real word pieces, so prompts
tokenize and the noise a random model generates detokenizes into words."""

from __future__ import annotations

from typing import NamedTuple

from gguf import GGUFWriter

_SPACE = "\u2581"  # SentencePiece's "▁" word-start marker
_TT_NORMAL, _TT_UNKNOWN, _TT_CONTROL, _TT_UNUSED, _TT_BYTE = 1, 2, 3, 5, 6  # gguf.TokenType values
_SPECIALS = (
    ("<unk>", _TT_UNKNOWN),
    ("<s>", _TT_CONTROL),
    ("</s>", _TT_CONTROL),
    ("<|im_start|>", _TT_CONTROL),
    ("<|im_end|>", _TT_CONTROL),  # end of a chat turn: written as the EOT (end-of-generation) id
)
_UNK, _BOS, _EOS, _IM_END = 0, 1, 2, 4

_WORDS = """
the of and to in a is that for it as was with be by on not he I this are or his from at which
but have an they you were her she there been one all we their has would when if so no will more
can out up who them some into its only time other then than do could my like him new what about
over also any these after first two may most well where way even back much our through year make
before good people just those many man how world long day still own same each great might state
should part life work found down under here never while last since right place against both used
school old house year off home high things both public little small set number too being world
must great again need show give old thought children went say said every day three night home
point water room mother area money story fact month lot study book eye job word business issue
side kind head far black long both little hand really family system program question government
during without again open seem together next white begin walk example ease paper group always
music those both mark often letter until mile river car feet care second enough plain girl usual
young ready above ever red list though feel talk bird soon body dog family direct pose leave song
measure door product black short numeral class wind question happen complete ship area half rock
order fire south problem piece told knew pass since top whole king space heard best hour better
true during hundred five remember step early hold west ground interest reach fast verb sing listen
six table travel less morning ten simple several vowel toward war lay against pattern slow center
love person money serve appear road map rain rule govern pull cold notice voice unit power town
fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest correct
able pound done beauty drive stood contain front teach week final gave green quick develop ocean
warm free minute strong special mind behind clear tail produce street inch multiply nothing course
stay wheel full force blue object decide surface deep moon island foot system busy test record
boat common gold possible plane stead dry wonder laugh thousand ago ran check game shape equate
hot miss brought heat snow tire bring yes distant fill east paint language among
"""
_SUFFIXES = ("s", "ed", "ing", "er", "ly", "est", "ion", "al", "ful", "ness")
_CHARS = (
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    ".,!?;:'\"-()[]/&%$#@*+=<>_"
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class TokenizerArrays(NamedTuple):
    """The tokenizer's tables, index = token id."""

    tokens: list[str]
    scores: list[float]
    types: list[int]
    word_ids: list[int]  # whole words: the only normal tokens the model is made to emit


def _vocab() -> TokenizerArrays:
    """SPM vocab: specials, 256 byte-fallback tokens, then word pieces with all their prefixes.

    llama.cpp's SPM tokenizer only builds a piece by merging adjacent pieces that are themselves
    in the vocab, so every prefix of a word must be a token too; anything else falls back to
    single characters or bytes, which is why any text tokenizes and round-trips.
    """
    tokens = [tok for tok, _ in _SPECIALS]
    types = [tt for _, tt in _SPECIALS]
    scores = [0.0] * len(_SPECIALS)
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(_TT_BYTE)
        scores.append(0.0)

    pieces: dict[str, float] = {}

    def add(piece: str, score: float) -> None:
        pieces[piece] = max(pieces.get(piece, score), score)

    add(_SPACE, -1.0)
    for ch in _CHARS:
        add(ch, -2.0)
        add(_SPACE + ch, -1.5)
    words = list(dict.fromkeys(_WORDS.split()))
    whole = set()
    for rank, word in enumerate(words):
        for form in (word, word.capitalize()):
            full = _SPACE + form
            whole.add(full)
            for n in range(2, len(full) + 1):
                # Whole words score higher than the prefixes that lead to them.
                add(full[:n], (1.0 if n == len(full) else 0.0) - rank / len(words) - 3.0 / n)
    for suffix in _SUFFIXES:
        for n in range(1, len(suffix) + 1):
            add(suffix[:n], -1.0 - 1.0 / n)
    for piece, score in pieces.items():
        tokens.append(piece)
        types.append(_TT_NORMAL)
        scores.append(score)
    word_ids = [i for i, tok in enumerate(tokens) if tok in whole and len(tok) > 2]
    return TokenizerArrays(tokens, scores, types, word_ids)


VOCAB = _vocab()
# The tokens the output projection gives a row: whole words and the end tokens, so generated text
# reads as words (prompts can still use every piece and the byte fallback).
EMITTED: tuple[int, ...] = (*VOCAB.word_ids, _EOS, _IM_END)
ENDS: tuple[int, ...] = (_EOS, _IM_END)


def add_tokenizer(w: GGUFWriter, n_vocab: int, chat_template: str) -> None:
    """The tokenizer.* keys: this vocabulary padded with unused tokens up to `n_vocab`, so a --like
    file's token_embd and output have the real model's row count while text tokenizes with ours."""
    pad = n_vocab - len(VOCAB.tokens)
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_array("tokenizer.ggml.tokens", VOCAB.tokens + [f"<unused{i}>" for i in range(pad)])
    w.add_array("tokenizer.ggml.scores", VOCAB.scores + [0.0] * pad)
    w.add_array("tokenizer.ggml.token_type", VOCAB.types + [_TT_UNUSED] * pad)
    w.add_uint32("tokenizer.ggml.unknown_token_id", _UNK)
    w.add_uint32("tokenizer.ggml.bos_token_id", _BOS)
    w.add_uint32("tokenizer.ggml.eos_token_id", _EOS)
    w.add_uint32("tokenizer.ggml.eot_token_id", _IM_END)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_bool("tokenizer.ggml.add_eos_token", False)
    w.add_string("tokenizer.chat_template", chat_template)
