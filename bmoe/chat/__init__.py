"""What a request asks beyond its text, made ready for the engine: the model's chat template
(`template`, rendered in jinja2 as llama.cpp renders it by `jinja_render`), tool-call and reasoning
syntaxes (`syntax`), the reading of an answer (`output`), grammars from JSON schemas (`grammar`, checked
in a throwaway process by `grammar_check`) and the bounds of one request (`limits`).
"""

from bmoe.chat.grammar import Grammar, schema_grammar
from bmoe.chat.grammar_check import CHECK_S, GrammarCheck
from bmoe.chat.limits import STOP_STRINGS_MAX
from bmoe.chat.output import Delta, Reply
