"""How a model's chat template writes tool calls and reasoning, and the grammars that hold it to that.

The syntax is read from the template text (the model's own; llama.cpp's jinja path does the same
by other means):

- `hermes` (Qwen2.5/Qwen3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  reasoning in `<think>…</think>`;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "abcdefghi"}]`, or with the newer
  templates (`[ARGS]` in them) `[TOOL_CALLS]name[ARGS]{...}`; reasoning in `[THINK]…[/THINK]`;
- `harmony` (gpt-oss): messages `<|channel|>analysis<|message|>…<|end|>`, the answer on channel
  `final`, a call as `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`;
- `deepseek-r1` (DeepSeek R1/V3, and llama.cpp's llama-cpp-deepseek-r1 template):
  `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>`,
  or with DeepSeek V3.1's templates (no ```json in them)
  `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`;
  reasoning in `<think>…</think>`;
- `command-r7b` (Command R7B, Cohere2 MoE): `<|START_ACTION|>[{"tool_call_id": "0", "tool_name": ...,
  "parameters": {...}}]<|END_ACTION|>`, reasoning in `<|START_THINKING|>…<|END_THINKING|>`, the answer in
  `<|START_RESPONSE|>…<|END_RESPONSE|>` (Cohere2 MoE's `<|START_TEXT|>…<|END_TEXT|>`; the markers are not content);
- `llama3` (Llama 3.x's JSON): `{"name": ..., "parameters": {...}}`, one call per answer (the template
  renders no more);
- otherwise `plain`: no tool calls; reasoning in `<think>…</think>` when the template has it.

Whether a template takes tools at all is tested by rendering (bmoe.chat.template.Renderer.supports_tools).

`tool_choice` "required" and a named function are enforced from the first token by a grammar
(GBNF from bmoe.chat.grammar: each tool's parameters through the JSON-schema converter, wrapped in the
syntax's markers); "auto" gets a lazy grammar that applies once the model opens a call (llama.cpp's
trigger patterns), so even a small model's calls are well formed; "none" none at all. A thinking
template keeps its reasoning block in front of a forced call or a JSON answer.
"""

from __future__ import annotations

import hashlib
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bmoe.chat.grammar import Grammar, GrammarError, check_schema, literal, not_containing, schema_rules

HERMES, MISTRAL, HARMONY, PLAIN = "hermes", "mistral", "harmony", "plain"
DEEPSEEK_R1, COMMAND_R7B, LLAMA3 = "deepseek-r1", "command-r7b", "llama3"
R1_CALLS, R1_CALL, R1_SEP = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>"
R1_CALL_END, R1_CALLS_END = "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"
R7B_ACTION, R7B_ACTION_END = "<|START_ACTION|>", "<|END_ACTION|>"
# around Command R7B's answer (Cohere2 MoE's: TEXT): not content
R7B_RESPONSE = ("<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_TEXT|>", "<|END_TEXT|>")
PARSED = (HERMES, MISTRAL, HARMONY, DEEPSEEK_R1, COMMAND_R7B, LLAMA3)
# where each syntax's calls begin in the answer (a JSON array follows mistral's and Command R7B's)
OPENERS = {HERMES: "<tool_call>", MISTRAL: "[TOOL_CALLS]", DEEPSEEK_R1: R1_CALLS, COMMAND_R7B: R7B_ACTION,
           LLAMA3: '{"name"'}
# llama.cpp's lazy-grammar trigger patterns (ECMAScript regular expressions); Llama 3's calls have no marker,
# and llama.cpp holds its tool_choice auto to no grammar
TRIGGERS = {HERMES: r"<tool_call>", MISTRAL: r"\[TOOL_CALLS\]", DEEPSEEK_R1: R1_CALLS,
            COMMAND_R7B: r"<\|START_ACTION\|>", HARMONY: r"<\|channel\|>commentary to=functions\."}
CHOICES = ("auto", "none", "required")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function name
_ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True)
class Syntax:
    """One family's markers. `think` is the reasoning block's (open, close) tags, if any; `markers`
    are the texts that must reach the parser as written (special tokens included)."""

    name: str
    think: tuple[str, str] | None = None
    args_form: bool = False  # mistral's `[TOOL_CALLS]name[ARGS]{...}` (else a JSON array of calls); DeepSeek V3.1's
    # name, R1_SEP, the arguments (else R1's "function", R1_SEP, the name and a ```json block)

    @property
    def tools(self) -> bool:
        return self.name != PLAIN

    @property
    def markers(self) -> tuple[str, ...]:
        tags = self.think or ()
        if self.name == HERMES:
            return (*tags, "<tool_call>", "</tool_call>")
        if self.name == MISTRAL:
            return (*tags, "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")
        if self.name == HARMONY:
            return ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>")
        if self.name == DEEPSEEK_R1:
            return (*tags, R1_CALLS, R1_CALL, R1_SEP, R1_CALL_END, R1_CALLS_END)
        if self.name == COMMAND_R7B:
            return (*tags, R7B_ACTION, R7B_ACTION_END, *R7B_RESPONSE)
        return tags

    def call_id(self, salt: str, index: int) -> str:
        """Call `index`'s id in the answer to the request `salt` stands for (the same each time that
        answer is read); Mistral's templates take only 9 letters and digits."""
        h = int.from_bytes(hashlib.sha256(f"{salt}:{index}".encode()).digest(), "big")
        if self.name == MISTRAL:
            return "".join(_ALNUM[(h >> (6 * i)) % len(_ALNUM)] for i in range(9))
        return f"call_{h & ((1 << 96) - 1):024x}"


def detect(template: str | None) -> Syntax:
    """The syntax a chat template's text uses (see the module notes)."""
    t = template or ""
    if "<|channel|>" in t and "<|message|>" in t:
        return Syntax(HARMONY)
    if "[TOOL_CALLS]" in t:
        return Syntax(MISTRAL, ("[THINK]", "[/THINK]") if "[THINK]" in t else None, args_form="[ARGS]" in t)
    think = ("<think>", "</think>") if "<think>" in t else None
    if R1_CALLS in t:
        return Syntax(DEEPSEEK_R1, ("<think>", "</think>"), args_form="```json" not in t)
    if R7B_ACTION in t:
        return Syntax(COMMAND_R7B, ("<|START_THINKING|>", "<|END_THINKING|>") if "<|START_THINKING|>" in t else None)
    if "<tool_call>" in t:
        return Syntax(HERMES, think)
    if "<|start_header_id|>" in t and '"parameters"' in t:
        return Syntax(LLAMA3, think)
    return Syntax(PLAIN, think)


# ---- a request's tools ----------------------------------------------------------------------


@dataclass(frozen=True)
class Tools:
    """A request's checked `tools` and `tool_choice`: `functions` maps each name to its parameters'
    schema; `choice` is auto, none, required, or the one function's name."""

    functions: dict[str, Any]
    choice: str
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice not in ("auto", "none")

    @property
    def allowed(self) -> dict[str, Any]:
        """The functions a call may name: the one named by tool_choice, else all."""
        return self.functions if self.choice in CHOICES else {self.choice: self.functions[self.choice]}


def check_tools(tools: Any, tool_choice: Any = None, parallel: Any = None) -> Tools | None:
    """`tools`/`tool_choice`/`parallel_tool_calls` as OpenAI defines them; None when there are no
    tools (or tool_choice none leaves nothing to do); GrammarError naming the bad field."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise GrammarError("tool_choice: there are no tools to choose from; send tools with it", "tool_choice")
        return None
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise GrammarError("tools: a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    functions: dict[str, Any] = {}
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, Mapping) or t.get("type") != "function" or not isinstance(t.get("function"), Mapping):
            raise GrammarError(f"{where}: a tool is {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}", where)
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise GrammarError(f"{where}.function.name: 1 to 64 letters, digits, _ or -", f"{where}.function.name")
        if name in functions:
            raise GrammarError(f"{where}.function.name: {name!r} is there twice", f"{where}.function.name")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, Mapping):
            raise GrammarError(f"{where}.function.parameters: a JSON schema object", f"{where}.function.parameters")
        check_schema(params, f"{where}.function.parameters")
        functions[name] = params
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, Mapping):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise GrammarError("tool_choice: auto, none, required or {\"type\": \"function\", \"function\": "
                               "{\"name\": ...}}", "tool_choice")
        if name not in functions:
            raise GrammarError(f"tool_choice: no tool is named {name!r}; the tools are: {', '.join(functions)}",
                               "tool_choice")
        choice = name
    elif choice not in CHOICES:
        raise GrammarError(f"tool_choice: {choice!r} is not auto, none, required or a named function", "tool_choice")
    if parallel is not None and not isinstance(parallel, bool):
        raise GrammarError("parallel_tool_calls: true or false", "parallel_tool_calls")
    return Tools(functions, choice, True if parallel is None else parallel)


# ---- grammars -------------------------------------------------------------------------------


def _call_schemas(syntax: Syntax, tools: Tools) -> dict[str, Any]:
    """One schema per allowed function for what follows its opening marker."""
    out = {}
    name_key, args_key = ("tool_name", "parameters") if syntax.name == COMMAND_R7B else \
        ("name", "parameters") if syntax.name == LLAMA3 else ("name", "arguments")
    for name, params in tools.allowed.items():
        if syntax.name in (HERMES, LLAMA3, COMMAND_R7B) or (syntax.name == MISTRAL
                                                                       and not syntax.args_form):
            props: dict[str, Any] = {name_key: {"const": name}, args_key: params}
            if syntax.name == MISTRAL:
                props["id"] = {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}
            if syntax.name == COMMAND_R7B:
                props = {"tool_call_id": {"type": "string", "pattern": "^[0-9]{1,3}$"}, **props}
            out[f"call-{name}"] = {"type": "object", "properties": props, "required": list(props),
                                   "additionalProperties": False}
        else:
            out[f"args-{name}"] = params
    return out


def _calls_rule(syntax: Syntax, tools: Tools, rules: Mapping[str, str]) -> str:
    """The GBNF expression for the call(s), starting at the syntax's opening marker."""
    many = tools.parallel and syntax.name not in (HARMONY, LLAMA3)  # gpt-oss and Llama 3 make one call an answer
    if syntax.name == HERMES:
        one = f'"<tool_call>\\n" ({" | ".join(rules.values())}) "\\n</tool_call>"'
        return f'{one} ("\\n" {one})*' if many else one
    if syntax.name == LLAMA3:
        return f'({" | ".join(rules.values())})'
    if syntax.name == COMMAND_R7B or (syntax.name == MISTRAL and not syntax.args_form):
        calls = f'({" | ".join(rules.values())})'
        sep = '" "?' if syntax.name == MISTRAL else "[ \\n]{0,8}"
        more = f' ("," {sep} {calls})*' if many else ""
        if syntax.name == COMMAND_R7B:
            return f'{literal(R7B_ACTION)} "[" [ \\n]{{0,8}} {calls}{more} [ \\n]{{0,4}} "]" {literal(R7B_ACTION_END)}'
        return f'"[TOOL_CALLS]" "[" {calls}{more} "]"'
    if syntax.name == MISTRAL:
        one = "(" + " | ".join(f'"[TOOL_CALLS]" {literal(n)} "[ARGS]" {rules[f"args-{n}"]}'
                               for n in tools.allowed) + ")"
        return f"{one}+" if many else one
    if syntax.name == DEEPSEEK_R1:
        head, tail = ((R1_CALL + "{}" + R1_SEP, R1_CALL_END) if syntax.args_form else
                      (R1_CALL + "function" + R1_SEP + "{}\n```json\n", "\n```" + R1_CALL_END))
        one = "(" + " | ".join(f'{literal(head.format(n))} {rules[f"args-{n}"]} {literal(tail)}'
                               for n in tools.allowed) + ")"
        more = f' ("\\n"? {one})*' if many else ""
        return f'{literal(R1_CALLS)} {one}{more} {literal(R1_CALLS_END)}'
    if syntax.name == HARMONY:
        alts = " | ".join(f'{literal(n)} " <|constrain|>json<|message|>" {rules[f"args-{n}"]}' for n in tools.allowed)
        return f'"<|channel|>commentary to=functions." ({alts})'
    raise AssertionError(syntax)


def _reasoning_rule(syntax: Syntax, think_open: bool) -> tuple[str, str]:
    """(prefix expression, extra rules) for a reasoning block before what a grammar forces:
    optional, or already open when the prompt ends inside one."""
    if syntax.name == HARMONY:
        body = f"({not_containing('<|end|>')})*"
        return ('(analysis "<|start|>assistant")? ',
                f'analysis ::= "<|channel|>analysis<|message|>" {body} "<|end|>"\n')
    if syntax.think is None:
        return "", ""
    open_, close = syntax.think
    body = f"({not_containing(close)})*"
    if think_open:
        return f'{body} {literal(close)} ws ', 'ws ::= [ \\n]{0,4}\n'
    return (f'({literal(open_)} {body} {literal(close)} ws)? ', 'ws ::= [ \\n]{0,4}\n')


def tool_grammar(syntax: Syntax, tools: Tools, thinking: bool = False, think_open: bool = False) -> Grammar | None:
    """The grammar for a request's calls: forced (required, a named function) or lazy (auto);
    None for tool_choice none, and for auto in a syntax whose calls have no marker to trigger on
    (Llama 3's, as llama.cpp). `thinking`: the template's reasoning block may come first (forced
    only); `think_open`: the prompt ends inside one."""
    if tools.choice == "none" or (not tools.forced and syntax.tools and syntax.name not in TRIGGERS):
        return None
    if not syntax.tools:
        raise GrammarError(f"tools: the chat template's tool-call syntax is not one bmoe parses (it parses "
                           f"{', '.join(PARSED)}); give a template of those with --chat-template-file", "tools")
    text, rules = schema_rules(_call_schemas(syntax, tools), "tools")
    calls = _calls_rule(syntax, tools, rules)
    if not tools.forced:
        return Grammar(f"{text}\nroot ::= {calls}\n", triggers=(TRIGGERS[syntax.name],), where="tools")
    prefix, extra = _reasoning_rule(syntax, think_open) if (thinking or think_open) else ("", "")
    return Grammar(f"{text}\n{extra}root ::= {prefix}{calls}\n", where="tools")


def with_reasoning(syntax: Syntax, g: Grammar, think_open: bool) -> Grammar:
    """`g` (a JSON answer's grammar, root `root`) with the template's reasoning block allowed in front."""
    prefix, extra = _reasoning_rule(syntax, think_open)
    if not prefix:
        return g
    if syntax.name == HARMONY:
        prefix += '"<|channel|>final<|message|>" '
    body = re.sub(r"^root ::=", "answer ::=", g.text, flags=re.M)
    return Grammar(f"{body}\n{extra}root ::= {prefix}answer\n", where=g.where)
