"""Chat templates rendered from skeletons (`rlhf_core.data.template_skeleton`): byte for byte what
`apply_chat_template(..., tokenize=False)` renders, for templates that write contents as they are (ChatML, Qwen2.5
with its default system prompt and tools branches, Phi-3, a `set content` template, one that tests a content for
emptiness) and for those the syntax check declines and renders in full (Llama-3's and Gemma's trim, Mistral's,
Qwen3's `'</think>' in content`), on contents with edge cases; the refusals still name the row."""

from __future__ import annotations

import pickle

import pytest

from rlhf_core.data import template_skeleton
from rlhf_core.data.records import Record
from rlhf_core.data.samples import Renderer
from rlhf_core.data.template_skeleton import TemplateSkeletons, content_use_problem
from rlhf_core.errors import UserError
from tests.families import GEMMA_IT, MISTRAL_INST, PHI3_TEMPLATE, TEMPLATES
from tests.hub_cache import CHATML_TEMPLATE, LLAMA3_INSTRUCT, QWEN2_CHATML, build_tokenizer

QWEN25_TEMPLATE = (TEMPLATES / "qwen2.5-instruct.jinja").read_text()
QWEN3_TEMPLATE = (TEMPLATES / "qwen3.jinja").read_text()
SET_CONTENT_TEMPLATE = (  # Llama-3's shape without its trim: the content bound to a name, then written
    "{% for message in messages %}{% set content = '<|' + message['role'] + '|>\n' + message['content'] %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content ~ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")
EMPTY_TEST_TEMPLATE = (  # SOLAR's: an empty system message writes nothing
    "{% for message in messages %}{% if message['role'] == 'system' %}{% if message['content'] %}"
    "{{ '### System:\n' + message['content'] + '\n\n' }}{% endif %}{% elif message['role'] == 'user' %}"
    "{{ '### User:\n' + message['content'] + '\n\n' }}{% elif message['role'] == 'assistant' %}"
    "{{ '### Assistant:\n' + message['content'] }}{% endif %}{% if loop.last and add_generation_prompt %}"
    "{{ '### Assistant:\n' }}{% endif %}{% endfor %}")
BRACES_TEMPLATE = (  # the text around the contents holds what str.format reads: the skeleton escapes it
    "{% for message in messages %}{{ '{' + message.role + '} {0} {{x}}: ' + message.content + ' }' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '{assistant}' }}{% endif %}")
URL = "chat.jsonl"
# The first is plain, so a shape's check against its first row cannot be what keeps the others exact.
CONTENTS = ["sort : 3 1 2 =", "  leading and trailing  ", "\n\nnewlines around\n\n", "</think>",
            "<think>\nfirst 1 then 2\n</think>\n\n1 2 3", "{braces} {0} {{x}} {% raw %}", "", "héllo — 你好 🙂\t",
            "\ue000 private use \ue001", "<|im_end|>", "%s %d"]


def conversation(roles: str, row: int) -> list[dict]:
    names = {"s": "system", "u": "user", "a": "assistant"}
    return [{"role": names[role], "content": CONTENTS[(row + turn) % len(CONTENTS)] if row else f"turn {turn}"}
            for turn, role in enumerate(roles)]


# family: (tokenizer spec, chat template or None for the spec's own, role sequences the template accepts)
CASES = {
    "chatml": (QWEN2_CHATML, None, ["ua", "sua", "uaua", "u", "su"]),
    "qwen2.5": (QWEN2_CHATML, QWEN25_TEMPLATE, ["ua", "sua", "uaua", "u", "su", "usua"]),
    "phi3": (QWEN2_CHATML, PHI3_TEMPLATE, ["ua", "sua", "u"]),
    "set-content": (LLAMA3_INSTRUCT, SET_CONTENT_TEMPLATE, ["ua", "sua", "u"]),
    "empty-test": (QWEN2_CHATML, EMPTY_TEST_TEMPLATE, ["sua", "ua", "su"]),
    "braces": (QWEN2_CHATML, BRACES_TEMPLATE, ["ua", "sua"]),
    "qwen3": (QWEN2_CHATML, QWEN3_TEMPLATE, ["ua", "sua", "uaua", "u", "su"]),
    "llama3": (LLAMA3_INSTRUCT, None, ["ua", "sua", "uaua", "u"]),
    "gemma": (GEMMA_IT, None, ["ua", "uaua", "u"]),
    "mistral": (MISTRAL_INST, None, ["ua", "sua", "uaua", "u"]),
}
VERBATIM = {"chatml", "qwen2.5", "phi3", "set-content", "empty-test", "braces"}


@pytest.fixture(scope="module")
def tokenizers() -> dict:
    return {id(spec): build_tokenizer(spec) for spec in (QWEN2_CHATML, LLAMA3_INSTRUCT, GEMMA_IT, MISTRAL_INST)}


def family_tokenizer(tokenizers: dict, family: str):
    spec, template, _ = CASES[family]
    tokenizer = tokenizers[id(spec)]
    tokenizer.chat_template = template or spec.chat_template
    return tokenizer


@pytest.mark.parametrize("family", list(CASES))
def test_texts_are_what_apply_chat_template_renders(tokenizers, family):
    tokenizer = family_tokenizer(tokenizers, family)
    renderer = Renderer(tokenizer, URL, apply_chat_template=True)
    for roles in CASES[family][2]:
        for row in range(len(CONTENTS) + 1):
            messages = conversation(roles, row)
            for generation_prompt in (False, True):
                expected = tokenizer.apply_chat_template(messages, tokenize=False,
                                                         add_generation_prompt=generation_prompt)
                assert renderer.chat(messages, generation_prompt) == expected, (roles, row, generation_prompt)
    plain = renderer._plain_renderer()
    assert (plain.problem is None) == (family in VERBATIM), plain.problem
    skeletons = [skeleton for skeleton in plain.shapes.values() if skeleton is not None]
    assert len(skeletons) >= (2 * len(CASES[family][2]) if family in VERBATIM else 0)


def test_a_skeleton_renders_each_shape_twice_then_formats(tokenizers, monkeypatch):
    tokenizer = family_tokenizer(tokenizers, "qwen2.5")
    renders = []
    full = TemplateSkeletons.full
    monkeypatch.setattr(TemplateSkeletons, "full", lambda self, *args: renders.append(args) or full(self, *args))
    renderer = Renderer(tokenizer, URL, apply_chat_template=True)
    for row in range(200):
        renderer.chat([{"role": "system", "content": f"s{row}"}, {"role": "user", "content": f" {row} {{"},
                       {"role": "assistant", "content": CONTENTS[row % 6]}])
    assert len(renders) == 2  # the skeleton, and the first row to check it; the other 199 are str.format


@pytest.mark.parametrize("source,problem", [
    (CASES["llama3"][0].chat_template, "content filtered with 'trim'"),
    (GEMMA_IT.chat_template, "content filtered with 'trim'"),
    (MISTRAL_INST.chat_template, "messages compared"),  # message == user_messages[-1]; its trim comes later
    (QWEN3_TEMPLATE, "content looked into"),  # message.content.startswith(...)
    ("{% for m in messages %}{% if '</think>' in m.content %}x{% endif %}{{ m.content }}{% endfor %}",
     "content compared"),
    ("{% for m in messages %}{{ m.content[1:] }}{% endfor %}", "content looked into"),
    ("{% for m in messages %}{{ m.content|length }}{% endfor %}", "filtered with 'length'"),
    ("{% for m in messages %}{{ m.get('content') }}{% endfor %}", "messages called"),
    ("{% for m in messages %}{{ m }}{% endfor %}", "the messages written"),
    ("{{ messages|map(attribute='content')|join }}", "messages filtered with 'map'"),
    ("{% macro r(x) %}{{ x }}{% endmacro %}{% for m in messages %}{{ r(m.content)|trim }}{% endfor %}",
     "handed to a call"),
    ("{% macro r() %}{{ messages[0].content }}{% endmacro %}{{ r()|trim }}", "inside a block that captures"),
    ("{% set ns = namespace(c='') %}{% for m in messages %}{% set ns.c = m.content %}{% endfor %}{{ ns.c|trim }}",
     "stored in a namespace"),
    ("{% for m in messages %}{{ x|trim }}{% set x = m.content %}{% endfor %}", "filtered with 'trim'"),
    ("{% for m in messages %}{% if loop.previtem %}{{ loop.previtem.content|trim }}{% endif %}{% endfor %}",
     "filtered with 'trim'"),
    ("{% for m in messages %}{% set k = 'content' %}{{ m[k]|upper }}{% endfor %}", "messages filtered"),
    ("{% for m in messages %}{% set k = 'content' %}{{ m[k]|length }}{% endfor %}", "computed key's value"),
    ("{% for m in messages %}{% for c in m['con' ~ 'tent'] %}{{ c.upper() }}{% endfor %}{% endfor %}",
     "messages called"),
    ("{% for m in messages %}{% for c in m[loop.cycle('content')] %}{{ loop.previtem|count }}{% endfor %}"
     "{% endfor %}", "computed key's value"),
    ("{% set xs = [] %}{% for m in messages %}{% set _ = xs.append(m.content) %}{% endfor %}{{ xs|join }}",
     "handed to a call"),
    ("{{ strftime_now('%d') }}{% for m in messages %}{{ m.content }}{% endfor %}", "a call of 'strftime_now'"),
    ("{% filter trim %}{% for m in messages %}{{ m.content }}{% endfor %}{% endfilter %}",
     "inside a block that captures"),
])
def test_the_syntax_check_declines_contents_not_written_as_they_are(source, problem):
    from transformers.utils.chat_template_utils import _compile_jinja_template

    found = content_use_problem(_compile_jinja_template(source).environment, source)
    assert found is not None and problem in found, found


@pytest.mark.parametrize("source", [
    CHATML_TEMPLATE, QWEN25_TEMPLATE, PHI3_TEMPLATE, SET_CONTENT_TEMPLATE, EMPTY_TEST_TEMPLATE,
    "{% for m in messages %}{{ m.content if m.content else '(empty)' }}{{ m.content or '-' }}{% endfor %}",
    "{% for m in messages %}{% if m.content is string %}{{ m.content|string }}{% endif %}{% endfor %}",
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
    "{% endif %}{% endfor %}",
    "{% for m in messages|selectattr('role', 'equalto', 'user')|list %}{{ messages[loop.index0].content }}"
    "{% endfor %}{{ messages|length }}",
])
def test_the_syntax_check_accepts_contents_written_as_they_are(source):
    from transformers.utils.chat_template_utils import _compile_jinja_template

    assert content_use_problem(_compile_jinja_template(source).environment, source) is None


def test_a_template_that_refuses_a_shape_still_names_each_row(tokenizers):
    tokenizer = tokenizers[id(QWEN2_CHATML)]
    tokenizer.chat_template = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('No system "
                               "here') }}{% endif %}{{ m.role + ': ' + m.content + '\n' }}{% endfor %}")
    renderer = Renderer(tokenizer, URL, apply_chat_template=True)
    assert renderer._plain_renderer().problem is None
    assert renderer.chat(conversation("ua", 1)) == ("user:   leading and trailing  \n"
                                                    "assistant: \n\nnewlines around\n\n\n")
    for line in (2, 3):  # the refused shape is not kept: every row with it is refused, by its own render
        with pytest.raises(UserError, match=rf"^chat.jsonl line {line}: the tokenizer's chat template refused "
                                            r"'chosen' with \"No system here\""):
            renderer.chat(conversation("sua", line), record=Record(line, {}), keys=("chosen",))


def test_a_shape_its_first_row_does_not_confirm_renders_in_full(tokenizers, monkeypatch):
    """The check against the first row is the second guard: with the syntax check made to accept Llama-3's trim,
    a shape whose first row shows the difference is rendered in full from then on."""
    tokenizer = family_tokenizer(tokenizers, "llama3")
    monkeypatch.setattr(template_skeleton, "content_use_problem", lambda environment, source: None)
    renderer = Renderer(tokenizer, URL, apply_chat_template=True)
    for row in (2, 0, 1, 3):  # row 2's content ends in newlines, which the trim takes away
        messages = conversation("ua", row)
        assert renderer.chat(messages) == tokenizer.apply_chat_template(messages, tokenize=False)
    assert list(renderer._plain_renderer().shapes.values()) == [None]


def test_placeholders_that_do_not_come_out_whole_render_in_full(tokenizers):
    tokenizer = tokenizers[id(QWEN2_CHATML)]
    source = "{% for m in messages %}{{ bos_token + m.content }}{% endfor %}"
    tokenizer.chat_template = source
    renderer = Renderer(tokenizer, URL, apply_chat_template=True)
    compiled = renderer._plain_renderer().compiled
    plain = TemplateSkeletons(compiled, source, {"bos_token": "\ue000"})  # a special token like a placeholder's edge
    assert plain.render([{"role": "user", "content": "a{b}"}], False) == "\ue000a{b}"
    assert list(plain.shapes.values()) == [None]


def test_rich_messages_and_many_shapes_go_to_the_full_render(tokenizers, monkeypatch):
    tokenizer = family_tokenizer(tokenizers, "chatml")
    renderer = Renderer(tokenizer, URL, apply_chat_template=True)
    plain = renderer._plain_renderer()
    assert plain.render([{"role": "user", "content": "a", "name": "x"}], False) is None  # transformers renders it
    assert plain.render([{"role": "user", "content": ["a"]}], False) is None
    monkeypatch.setattr(template_skeleton, "MAX_SHAPES", 2)
    for roles in ("u", "ua", "uau", "uaua"):
        messages = conversation(roles, 1)
        assert renderer.chat(messages) == tokenizer.apply_chat_template(messages, tokenize=False)
    assert len(plain.shapes) == 2


def test_a_renderer_pickles_without_its_skeletons(tokenizers):
    tokenizer = family_tokenizer(tokenizers, "chatml")
    renderer = Renderer(tokenizer, URL, apply_chat_template=True)
    messages = conversation("sua", 4)
    text = renderer.chat(messages)
    copy = pickle.loads(pickle.dumps(renderer))
    assert copy._plain == {}
    assert copy.chat(messages) == text
