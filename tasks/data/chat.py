"""Chat templates for SFT: render a conversation the way transformers' `apply_chat_template` does and
split the text into context (no loss) and the assistant's turns (the only text trained on).

Which template (`load`, called by tasks/data_prep.py with the tokenizer it was given):

- `chat_template.jinja` beside tokenizer.json, else tokenizer_config.json's `chat_template` (a string,
  or a list of `{name, template}` of which the one named "default" is used), as transformers 5.24
  loads them. The template sees `messages`, `add_generation_prompt`, `tools=None`, `documents=None`
  and tokenizer_config.json's special tokens (`bos_token`, `eos_token`, ...; a token the config does
  not name is undefined and renders empty, as in transformers).
- otherwise `DEFAULT_CHAT_TEMPLATE`, with the tokenizer's bos/eos spellings: data_prep's original chat
  format, written as a template so that it can ship in a tokenizer_config.json:

      {bos}<|user|>\\n{system}\\n\\n{user}\\n<|assistant|>\\n{answer}{eos}<|user|>\\n{user}\\n<|assistant|>\\n{answer}{eos}

  system and user messages between two assistant turns share one `<|user|>` block, in order,
  separated by a blank line; the generation prompt is `<|assistant|>\\n`.

The environment mirrors transformers 5.24 `utils/chat_template_utils.py` (`_cached_compile_jinja_template`):
jinja2's `ImmutableSandboxedEnvironment` with `trim_blocks` and `lstrip_blocks`, the `loopcontrols`
extension, a `tojson` filter that does not escape HTML, and the globals `raise_exception`,
`strftime_now` (the wall clock, as in transformers: a template that prints today's date makes the
data depend on the day), `dict` and a `namespace` that refuses underscore attributes. Templates with
`{% generation %}` blocks parse; the blocks render their body unchanged.

Assistant spans come from prefix renders, so they need no `{% generation %}` tags: for each
assistant message i, `render(messages[:i], add_generation_prompt=True)` ends where the answer starts
and `render(messages[:i + 1])` ends where it stops; whitespace after the answer's last non-space
character (the "\\n" after ChatML's `<|im_end|>`) is context. So the answer and its end-of-turn
marker are trained; system and user turns and the generation-prompt header are not. A template
whose prefix renders are not prefixes of the whole conversation's render (one that rewrites earlier
turns depending on what follows) cannot be split this way and is rejected with a one-line error.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

DEFAULT_CHAT_TEMPLATE = r"""{{- bos_token -}}
{%- set ns = namespace(open=false) -%}
{%- for message in messages -%}
    {%- if message['role'] == 'system' or message['role'] == 'user' -%}
        {{- '\n\n' if ns.open else '<|user|>\n' -}}
        {{- message['content'] -}}
        {%- set ns.open = true -%}
    {%- elif message['role'] == 'assistant' -%}
        {%- if ns.open -%}{{- '\n' -}}{%- endif -%}
        {{- '<|assistant|>\n' + message['content'] -}}{{- eos_token -}}
        {%- set ns.open = false -%}
    {%- else -%}
        {{- raise_exception('chat roles must be system, user or assistant, got ' + message['role']) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {%- if ns.open -%}{{- '\n' -}}{%- endif -%}
    {{- '<|assistant|>\n' -}}
{%- endif -%}"""

DEFAULT_WHERE = "the default chat template (tasks/data/chat.py DEFAULT_CHAT_TEMPLATE)"

# tokenizer_config.json keys transformers passes to templates (PreTrainedTokenizerBase.special_tokens_map)
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


# ----------------------------------------------------------------------------------------------
# the jinja environment (transformers' `_cached_compile_jinja_template`)


@functools.cache
def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: transformers' assistant-mask markers; the body renders as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller) -> str:
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


@functools.lru_cache(maxsize=16)
def _compile(source: str):
    return _environment().from_string(source)


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


# ----------------------------------------------------------------------------------------------
# the template


def _plain_messages(messages: Sequence[Mapping]) -> list[dict]:
    """Fresh plain dicts without None values (transformers' `_normalize_chat_messages`)."""
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template plus the variables it renders with; `where` names it in errors."""

    source: str
    variables: Mapping[str, Any] = field(default_factory=dict)
    where: str = DEFAULT_WHERE

    def __post_init__(self):
        import jinja2

        try:
            _compile(self.source)
        except jinja2.TemplateError as e:
            raise ValueError(f"{self.where}: not a valid Jinja template ({_first_line(e)})") from None

    def render(self, messages: Sequence[Mapping], *, add_generation_prompt: bool = False) -> str:
        """The conversation as text (`apply_chat_template(..., tokenize=False)`)."""
        import jinja2

        try:
            return _compile(self.source).render(
                messages=_plain_messages(messages), tools=None, documents=None,
                add_generation_prompt=add_generation_prompt, **self.variables)
        except (jinja2.TemplateError, ArithmeticError, LookupError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{self.where}: rendering failed ({_first_line(e)})") from None  # the template's bug

    def pieces(self, messages: Sequence[Mapping]) -> list[str]:
        """[context, answer, context, answer, ..., context]: alternating, one answer per assistant message,
        concatenating to the render of `messages` up to its last assistant message. Answers are trained on.

        The last context is whatever follows the last answer (often just whitespace); every piece may be
        empty. Raises ValueError when there is no assistant message or the template is not prefix-stable.
        """
        turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if not turns:
            raise ValueError("conversation has no assistant message to train on")
        messages = list(messages[: turns[-1] + 1])
        full = self.render(messages)
        out: list[str] = []
        pos = 0
        for i in turns:
            prompt = self.render(messages[:i], add_generation_prompt=True)
            turn = full if i == turns[-1] else self.render(messages[: i + 1])
            head = len(prompt)
            if not (pos <= head <= len(turn) and full.startswith(turn) and full.startswith(prompt)):
                raise ValueError(
                    f"{self.where}: not prefix-stable: the renders of messages[:{i}] (with add_generation_prompt) "
                    f"and messages[:{i + 1}] are not prefixes of the whole conversation's render, so the "
                    "assistant turns cannot be located (the template rewrites earlier turns)")
            end = max(head, len(turn.rstrip()))  # trailing whitespace after the end-of-turn marker is context
            out += [full[pos:head], full[head:end]]
            pos = end
        out.append(full[pos:])
        return out

    def prompt(self, messages: Sequence[Mapping]) -> str:
        """The generation prompt for the last assistant message: the messages before it, rendered with
        add_generation_prompt=True (`pieces(messages)[:-2]` joined)."""
        turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if not turns:
            raise ValueError("conversation has no assistant message to train on")
        return self.render(messages[: turns[-1]], add_generation_prompt=True)


def _token_string(value) -> str | None:
    if isinstance(value, dict):  # AddedToken as serialized in tokenizer_config.json
        value = value.get("content")
    return value if isinstance(value, str) else None


def select_template(value, where: str) -> str:
    """tokenizer_config.json's `chat_template`: a string, or [{name, template}, ...] -> the "default" one."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) for t in value):
        named = {t.get("name"): t.get("template") for t in value}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ValueError(f"{where}: no template named 'default' among {sorted(str(n) for n in named)}")
    raise ValueError(f"{where}: expected a string or a list of {{name, template}}, got {type(value).__name__}")


def load(tokenizer_config: Mapping | None, special_tokens: Mapping, *, template_file: str | None = None,
         folder: str = "") -> ChatTemplate:
    """The chat template data_prep renders conversations with.

    tokenizer_config: tokenizer_config.json's contents (or None); special_tokens: data_prep's resolved
    {"bos_token", "eos_token", ...} spellings, used by the default template; template_file: the text of a
    chat_template.jinja beside tokenizer.json (wins, as in transformers); folder: their folder, for errors.
    """
    cfg = dict(tokenizer_config or {})
    prefix = f"{folder.rstrip('/')}/" if folder else ""
    variables = {k: s for k in SPECIAL_TOKEN_KEYS if (s := _token_string(cfg.get(k))) is not None}
    if template_file is not None:
        return ChatTemplate(template_file, variables, f"{prefix}chat_template.jinja")
    if cfg.get("chat_template") is not None:
        where = f"{prefix}tokenizer_config.json: chat_template"
        return ChatTemplate(select_template(cfg["chat_template"], where), variables, where)
    return ChatTemplate(DEFAULT_CHAT_TEMPLATE, {"bos_token": special_tokens["bos_token"],
                                                "eos_token": special_tokens["eos_token"]}, DEFAULT_WHERE)


__all__ = ["DEFAULT_CHAT_TEMPLATE", "ChatTemplate", "load", "select_template"]
