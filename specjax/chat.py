"""Chat templates: a conversation rendered to prompt text as ``transformers``' ``apply_chat_template`` does.

A chat template is a Jinja2 program stored with the tokenizer (GGUF metadata ``tokenizer.chat_template``,
or a Hugging Face ``tokenizer_config.json`` / ``chat_template.jinja``). :func:`render` runs it in
transformers' environment: a sandbox with ``trim_blocks``, ``lstrip_blocks`` and the ``loopcontrols``
extension, a ``tojson`` filter that keeps non-ASCII text, and ``raise_exception`` / ``strftime_now``
globals; the context holds ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token`` and any
extra keywords.

:class:`ChatFormat` bundles a template with its tokenizer's special tokens and the ids that end an
assistant turn (:func:`end_of_turn_ids`), which a generation loop stops at.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any


class ChatTemplateError(ValueError):
  """A chat template that cannot be compiled or refuses the conversation (its ``raise_exception``)."""


@functools.lru_cache(maxsize=16)
def _compile(template: str):
  import datetime

  import jinja2
  from jinja2.ext import loopcontrols
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  try:
    return env.from_string(template)
  except jinja2.exceptions.TemplateError as e:
    raise ChatTemplateError(f"chat template does not compile: {e}") from e


def render(template: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
           bos_token: str | None = None, eos_token: str | None = None, **context: Any) -> str:
  """Renders ``messages`` with ``template`` exactly as ``apply_chat_template(..., tokenize=False)`` does.

  Args:
    template: the Jinja2 chat template.
    messages: ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``.
    add_generation_prompt: end with the header of an assistant turn, so the model answers next.
    bos_token, eos_token: the tokenizer's BOS / EOS strings (undefined in the template when None).
    **context: further template variables (``tools``, ``documents``, template-specific switches).

  Returns:
    The prompt text. Tokenize it without adding BOS again when the template writes ``bos_token`` itself.

  Raises:
    ChatTemplateError: the template does not compile or rejects the conversation.
  """
  import jinja2

  variables = dict(context, messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt)
  variables.update({k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v is not None})
  try:
    return _compile(template).render(**variables)
  except jinja2.exceptions.TemplateError as e:
    raise ChatTemplateError(f"chat template refused the conversation: {e}") from e


def end_of_turn_ids(tokenizer, template: str | None, eos_id: int | None = None, bos_token: str | None = None,
                    eos_token: str | None = None) -> tuple[int, ...]:
  """The token ids that end an assistant turn: the template's end-of-turn token, then EOS.

  The template is rendered for a user turn and an assistant turn; the first special token after the
  assistant's text is the end-of-turn token (``<|im_end|>`` for ChatML templates such as SmolLM2's,
  ``<|eot_id|>`` for Llama 3, ``<end_of_turn>`` for Gemma, EOS itself for Llama 2). Without a template, or
  when the template or tokenizer shows none, the result is EOS alone.

  Args:
    tokenizer: a tokenizer with ``encode``; a ``tokenizers``-backed one (``.tokenizer``) tells special
      tokens apart. template: the chat template or None. eos_id: defaults to ``tokenizer.eos_id``.
    bos_token, eos_token: the strings the template sees; default to the tokenizer's BOS / EOS tokens.

  Returns:
    Distinct ids, end-of-turn first; empty when there is neither an end-of-turn token nor an EOS.
  """
  eos_id = getattr(tokenizer, "eos_id", None) if eos_id is None else eos_id
  ids = []
  backend = getattr(tokenizer, "tokenizer", None)
  if template is not None and hasattr(backend, "get_added_tokens_decoder"):
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    reply = "\x00specjax reply\x00"
    try:
      names = _special_strings(tokenizer)
      text = render(template, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": reply}],
                    bos_token=bos_token or names.get("bos_token"), eos_token=eos_token or names.get("eos_token"))
    except Exception:  # a template that wants another conversation shape (list contents, tools...): EOS only
      text = ""
    if reply in text:
      after = backend.encode(text.split(reply, 1)[1], add_special_tokens=False).ids
      ids += [i for i in after if i in special][:1]
  if eos_id is not None:
    ids.append(int(eos_id))
  return tuple(dict.fromkeys(ids))


def _special_strings(tokenizer) -> dict[str, str]:
  names = {}
  for name, attr in (("bos_token", "bos_id"), ("eos_token", "eos_id")):
    i = getattr(tokenizer, attr, None)
    if i is not None and hasattr(tokenizer, "id_to_token"):
      names[name] = tokenizer.id_to_token(i)
  return names


@dataclasses.dataclass(frozen=True)
class ChatFormat:
  """A chat template with what rendering and stopping need.

  Attributes:
    template: the Jinja2 source.
    bos_token, eos_token: strings the template sees as ``bos_token`` / ``eos_token`` (None: undefined).
    end_of_turn_ids: ids that end an assistant turn, end-of-turn token first (see :func:`end_of_turn_ids`).
  """

  template: str
  bos_token: str | None = None
  eos_token: str | None = None
  end_of_turn_ids: tuple[int, ...] = ()

  @classmethod
  def create(cls, template: str, tokenizer, bos_token: str | None = None,
             eos_token: str | None = None) -> ChatFormat:
    """The format of ``template`` for ``tokenizer``; BOS/EOS strings default to the tokenizer's
    ``bos_id`` / ``eos_id`` tokens.

    Raises:
      ChatTemplateError: the template does not compile.
    """
    _compile(template)
    names = _special_strings(tokenizer)
    bos_token, eos_token = bos_token or names.get("bos_token"), eos_token or names.get("eos_token")
    return cls(template=template, bos_token=bos_token, eos_token=eos_token,
               end_of_turn_ids=end_of_turn_ids(tokenizer, template, bos_token=bos_token, eos_token=eos_token))

  def stop_ids(self, tokenizer) -> list[int]:
    """The ids a generated answer stops at: the end-of-turn ids, then the tokenizer's ``eos_id`` (if any and
    not among them); pass them as :func:`specjax.generate`'s ``eos_id``."""
    eos = getattr(tokenizer, "eos_id", None)
    return list(dict.fromkeys([*self.end_of_turn_ids, *([eos] if eos is not None else [])]))

  def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
             **context: Any) -> str:
    """``messages`` as prompt text (see :func:`render`); by default ready for the assistant's answer."""
    return render(self.template, messages, add_generation_prompt=add_generation_prompt,
                  bos_token=self.bos_token, eos_token=self.eos_token, **context)

  def prompt(self, user: str, system: str | None = None) -> str:
    """One user turn (after an optional system turn), ending with the assistant's header."""
    messages = ([{"role": "system", "content": system}] if system is not None else [])
    return self.render(messages + [{"role": "user", "content": user}])

  def encode(self, tokenizer, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
             **context: Any) -> list[int]:
    """``messages`` rendered and tokenized without adding BOS/EOS again (the template writes them), as
    ``apply_chat_template(..., tokenize=True)`` does; feed the ids to :func:`specjax.generate`.

    Args:
      tokenizer: a ``tokenizers``-backed tokenizer (``.tokenizer``, e.g. :class:`specjax.hf.HFTokenizer`);
        any other is used through its own ``encode``.
    """
    return self.tokenize(tokenizer, self.render(messages, add_generation_prompt=add_generation_prompt, **context))

  @staticmethod
  def tokenize(tokenizer, text: str) -> list[int]:
    """Rendered chat text as ids, adding no BOS/EOS (the template writes them) and reading the special tokens
    it writes (``<|im_end|>``...) as themselves; a tokenizer without a ``tokenizers`` backend uses its own
    ``encode``."""
    backend = getattr(tokenizer, "tokenizer", None)
    if hasattr(backend, "encode"):
      return list(backend.encode(text, add_special_tokens=False).ids)
    return list(tokenizer.encode(text))


def _template_choice(value: Any, where: str) -> str | None:
  """A template from a config value: a string, or a list of ``{"name", "template"}`` ("default" first)."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, list) and all(isinstance(t, dict) and "template" in t for t in value):
    named = {t.get("name"): t["template"] for t in value}
    return named.get("default", value[0]["template"] if value else None)
  raise ChatTemplateError(f"{where}: chat_template must be a string or a list of {{name, template}}, got "
                          f"{type(value).__name__}")


def hf_chat_format(path: str, tokenizer) -> ChatFormat | None:
  """The chat format of a Hugging Face checkpoint directory, or None when it has no template.

  The template is ``chat_template.jinja`` when present, else ``chat_template`` of
  ``tokenizer_config.json`` (a string, or the ``"default"`` entry of a list of named templates); the
  ``bos_token`` / ``eos_token`` strings come from ``tokenizer_config.json`` (a string or an object with
  ``content``), else from the tokenizer.

  Raises:
    ChatTemplateError: a malformed ``tokenizer_config.json`` or a template that does not compile.
  """
  config_file = os.path.join(path, "tokenizer_config.json")
  config: dict[str, Any] = {}
  if os.path.isfile(config_file):
    try:
      with open(config_file, encoding="utf-8") as f:
        config = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ChatTemplateError(f"{config_file}: not valid JSON ({e})") from e
    if not isinstance(config, dict):
      raise ChatTemplateError(f"{config_file}: expected a JSON object")
  jinja_file = os.path.join(path, "chat_template.jinja")
  source = jinja_file if os.path.isfile(jinja_file) else config_file
  if source == jinja_file:
    with open(jinja_file, encoding="utf-8") as f:
      template = f.read()
  else:
    template = _template_choice(config.get("chat_template"), config_file)
  if template is None:
    return None

  def token(name: str) -> str | None:
    value = config.get(name)
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None

  try:
    return ChatFormat.create(template, tokenizer, bos_token=token("bos_token"), eos_token=token("eos_token"))
  except ChatTemplateError as e:
    raise ChatTemplateError(f"{source}: {e}") from e
