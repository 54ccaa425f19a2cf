"""How one stage turns a record's fields into text (`Renderer`): the tokenizer's chat template, rendered as
transformers renders it (plain messages by the compiled template directly, cheaper than transformers' conversion,
and where the template allows, from a skeleton per conversation shape: `template_skeleton`), else --input_template;
and whether the tokenizer puts a BOS before plain text. docs/design-notes.md ("Chat data and templates") has the
rules."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any

import jinja2

from rlhf_core.data.records import Record
from rlhf_core.data.template_skeleton import TemplateSkeletons
from rlhf_core.errors import UserError
from rlhf_core.notices import warn_once

logger = logging.getLogger(__name__)


@functools.cache  # each template is checked (and its \\n warned about) once per process: every sample asks
def usable_input_template(template: str) -> str | None:
    """The template, if it holds one '{}' for the prompt and nothing else str.format would read; without '{}',
    None with a warning, as OpenRLHF's CLIs set it to None."""
    if "{}" not in template:
        warn_once(f"--input_template {template!r} has no '{{}}' where the prompt goes, so it is not used (as "
                  "OpenRLHF sets it to None): the prompts are used as written.")
        return None
    try:
        template.format("")
    except (IndexError, KeyError, ValueError) as error:
        raise UserError(f"--input_template {template!r} is not a str.format template with one '{{}}' ({error!r}); "
                        "write other braces as '{{' and '}}'.") from None
    if "\\n" in template:  # as OpenRLHF: a shell quoting slip, not an error
        logger.warning("--input_template contains the two characters \\n, not a newline; in bash pass $'...\\n...'.")
    return template


@dataclass(frozen=True)
class Renderer:
    """How one stage turns fields into text: the tokenizer's chat template, else --input_template."""

    tokenizer: Any
    url: str
    apply_chat_template: bool
    input_template: str | None = None
    # each chat template's plain renderer (None: transformers renders), made at its first row; not pickled
    _plain: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.apply_chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise UserError("--apply_chat_template: the tokenizer of --pretrain has no chat template; give one "
                            "with --tokenizer_chat_template.")

    def chat(self, messages: list[dict], generation_prompt: bool = False, record: Record | None = None,
             keys: tuple[str, ...] = ()) -> str:
        """`messages` (of `record`'s `keys`) rendered by the chat template. The template is the user's code: what
        it raises (its raise_exception, as Gemma's on a system message) is about their data or template, so a
        UserError naming the row, not a traceback."""
        try:
            plain = self._plain_renderer()
            text = None if plain is None else plain.render(messages, generation_prompt)
            if text is not None:
                return text
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except jinja2.TemplateSyntaxError as error:  # the template itself: every row would fail alike
            raise UserError(f"the tokenizer's chat template (--pretrain's, or --tokenizer_chat_template) is not "
                            f"valid Jinja: {error.message} (template line {error.lineno}).") from None
        except Exception as error:
            raise UserError(self._refusal(error, record, keys)) from None

    def _plain_renderer(self) -> TemplateSkeletons | None:
        """The current chat template's renderer of plain {role, content} str messages, with the special tokens as
        they are at its first row (a stage's tokenizer is set up before it renders); None where transformers has
        no compiler for it."""
        template = getattr(self.tokenizer, "chat_template", None)
        if not isinstance(template, str):
            return None
        plain = self._plain.get(template, self)
        if plain is self:
            compiled = _compiled_template(template)
            plain = None if compiled is None else TemplateSkeletons(compiled, template,
                                                                    _template_tokens(self.tokenizer))
            self._plain[template] = plain
        return plain

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_plain": {}}  # compiled templates do not pickle: a worker makes its own

    def _refusal(self, error: Exception, record: Record | None, keys: tuple[str, ...]) -> str:
        where = self.url if record is None else record.where(self.url)
        fields = " and ".join(map(repr, keys)) or "a conversation"
        # jinja2's TemplateError (raise_exception's) carries the template's own words; others need their type
        said = str(error) if isinstance(error, jinja2.TemplateError) else f"{type(error).__name__}: {error}"
        return (f"{where}: the tokenizer's chat template refused {fields} with \"{said}\"; change the row to a "
                "conversation the template accepts.")

    def begin(self, text: str) -> str:
        """`text` with the BOS token's text in front for plain text, where the tokenizer adds one and it is absent
        (a chat template writes its own BOS, or none)."""
        tokenizer = self.tokenizer
        if self.apply_chat_template or not adds_bos(tokenizer) or text.startswith(tokenizer.bos_token):
            return text
        return tokenizer.bos_token + text

    def plain_prompt(self, text: str) -> str:
        template = usable_input_template(self.input_template) if self.input_template else None
        return text if template is None else template.format(text)

    def split(self, record: Record, prompt: list[dict], whole: list[dict],
              keys: tuple[str, ...] = ()) -> tuple[str, str]:
        """(prompt text with the generation prompt, the rest of the whole conversation's text), as OpenRLHF cuts
        them: at the prompt's length, with a warning when the whole does not begin with the prompt."""
        prompt_text = self.chat(prompt, generation_prompt=True, record=record, keys=keys)
        whole_text = self.chat(whole, record=record, keys=keys)
        if not whole_text.startswith(prompt_text):
            warn_once(f"{record.where(self.url)} (and maybe others): the chat template renders the conversation so "
                      "that it does not begin with its prompt as rendered with the generation prompt; the response "
                      "is cut where OpenRLHF cuts it (at the prompt's length) and may be wrong.",
                      key=f"template-rewrites-prompt:{self.url}")
        return prompt_text, whole_text[len(prompt_text):]


@functools.lru_cache(maxsize=8)
def _compiled_template(template: str):
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a transformers without it: every render through apply_chat_template
        return None
    return _compile_jinja_template(template)


def _template_tokens(tokenizer) -> dict:
    """The special tokens apply_chat_template hands the template (its `special_tokens_map`), as plain values."""
    return {key: list(value) if isinstance(value, (list, tuple)) else str(value)
            for key, value in tokenizer.special_tokens_map.items()}



@functools.lru_cache(maxsize=8)
def adds_bos(tokenizer) -> bool:
    """Whether the tokenizer puts its BOS before plain text by itself (Llama, Mistral, Gemma; not Qwen, GPT-2)."""
    if tokenizer.bos_token_id is None:
        return False
    ids = tokenizer("a").input_ids
    return bool(ids) and ids[0] == tokenizer.bos_token_id
