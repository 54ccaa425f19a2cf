"""Chat templates rendered without Jinja for most rows: a template that only ever writes a message's content as it
is (ChatML's, Qwen2.5's, Phi-3's) renders every conversation of one shape (its roles, which contents are empty, the
generation prompt) as the same text around the contents. That text is rendered once per shape with placeholders,
checked once against a full render of the shape's first real row, and filled in with `str.format` for the others:
byte for byte what the template renders, for a fraction of Jinja's cost.

Whether a template only writes contents as they are is read from its syntax tree (`content_use_problem`): a content
may be written (alone, joined with `+` or `~`, picked by `if`/`and`/`or`), set to a name that obeys the same rules,
tested for being empty or for its type, nothing else. A filter (`trim`), a method (`.strip()`), a comparison
(`'</think>' in content`) or a content handed to a call makes the template one this module declines (Llama-3's,
Gemma's, Mistral's, Qwen3's): those render in full, as before. Not in OpenRLHF, which renders every row in full.
"""

from __future__ import annotations

import functools
import logging
import re
import secrets
from typing import Any

from jinja2 import nodes

logger = logging.getLogger(__name__)

# What a value may hold: nothing of the contents, a content verbatim, messages (the list, a slice, a message, a
# method of one), and PART: what a key computed at render time picks from a message, which may be its content.
FREE, CONTENT, MESSAGES, PART = 0, 1, 2, 4
ANY = CONTENT | MESSAGES | PART  # what a name, a truth or a type test may take: emptiness, type, a list's length
# Tests that look at a value's type only: a content is always a str, a message a dict, a conversation a list.
TYPE_TESTS = frozenset({"defined", "undefined", "none", "string", "mapping", "iterable", "sequence", "number",
                        "integer", "float", "boolean", "true", "false", "callable"})
MESSAGE_FILTERS = frozenset({"length", "count", "list", "first", "last", "reverse", "selectattr", "rejectattr"})
NONDETERMINISTIC = frozenset({"strftime_now", "lipsum", "random"})  # a skeleton would freeze what they return
CONTAINER_ATTRIBUTES = frozenset(dir(dict)) | frozenset(dir(list)) | frozenset(dir(str))  # methods: m.items
_COMPUTED = object()  # a key known only at render time
MAX_SHAPES = 4096  # conversations of more shapes than this render in full (each shape costs two renders once)


class Declined(Exception):
    """A use of a message's content this module cannot prove verbatim."""


def content_use_problem(environment, source: str) -> str | None:
    """None when the template `source` (for jinja2 `environment`, transformers') uses each message's content only by
    writing it as it is; else the first use that is not, in words (for tests and logs)."""
    if environment.autoescape or environment.finalize is not None:
        return "the environment escapes or finalizes what it writes"
    tree = environment.parse(source)
    names: dict[str, int] = {"messages": MESSAGES}
    while True:  # names gain kinds until none changes: a later `set` may taint an earlier use
        before = dict(names)
        try:
            _ContentFlow(names).statements(tree.body)
        except Declined as problem:  # the kinds only grow, so what is declined now stays declined
            return str(problem)
        if names == before:
            return None


class _ContentFlow:
    """One pass over a template's tree, binding names to what they may hold and declining any use of a content
    other than writing it, testing it for emptiness or type, or binding it to a name."""

    def __init__(self, names: dict[str, int]):
        self.names = names
        self.capturing = False  # inside a macro, call or filter block, or `set` block: its text is not written as is

    def decline(self, node: nodes.Node, what: str) -> Declined:
        return Declined(f"template line {node.lineno}: {what}")

    # ------------------------------------------------------------------------------------------- statements
    def statements(self, body: list[nodes.Node]) -> None:
        for node in body:
            self.statement(node)

    def statement(self, node: nodes.Node) -> None:
        if isinstance(node, nodes.Output):
            for child in node.nodes:
                if not isinstance(child, nodes.TemplateData):
                    self.use(child, FREE if self.capturing else CONTENT,
                             "written inside a block that captures it" if self.capturing else "written")
        elif isinstance(node, nodes.If):
            self.use(node.test, ANY)
            self.statements(node.body + node.elif_ + node.else_)
        elif isinstance(node, nodes.For):
            self.loop(node)
        elif isinstance(node, nodes.Assign):
            self.bind(node.target, self.use(node.node, ANY), node)
        elif isinstance(node, nodes.With):
            for target, value in zip(node.targets, node.values):
                self.bind(target, self.use(value, ANY), node)
            self.statements(node.body)
        elif isinstance(node, nodes.Scope):
            self.statements(node.body)
        elif isinstance(node, nodes.ExprStmt):
            self.use(node.node, FREE)
        elif isinstance(node, (nodes.Macro, nodes.CallBlock, nodes.FilterBlock, nodes.AssignBlock)):
            self.block(node)
        elif type(node).__name__ not in ("Continue", "Break"):  # loopcontrols' nodes
            raise self.decline(node, f"a {type(node).__name__} statement")

    def loop(self, node: nodes.For) -> None:
        held = self.use(node.iter, MESSAGES | PART, "iterated over")
        if held and node.recursive:
            raise self.decline(node, "a recursive loop over messages")
        self.bind(node.target, held, node)
        if node.test is not None:
            self.use(node.test, ANY)
        self.statements(node.body + node.else_)

    def block(self, node: nodes.Macro | nodes.CallBlock | nodes.FilterBlock | nodes.AssignBlock) -> None:
        """A macro, call, filter or `set` block: its text goes somewhere other than the output, so no content may be
        written in it. Transformers' `{% generation %}` block is the exception: it returns its text as it is."""
        if isinstance(node, nodes.CallBlock) and _is_generation_block(node.call):
            self.statements(node.body)
            return
        for expression in [*getattr(node, "args", []), *getattr(node, "defaults", [])]:
            if isinstance(expression, nodes.Name) and expression.ctx in ("param", "store"):
                self.bind(expression, FREE, node)
            else:
                self.use(expression, FREE)
        if isinstance(node, nodes.Macro):
            self.names.setdefault(node.name, FREE)
        elif isinstance(node, nodes.CallBlock):
            self.use(node.call, FREE)
        elif isinstance(node, nodes.AssignBlock):
            self.bind(node.target, FREE, node)
        if isinstance(node, (nodes.FilterBlock, nodes.AssignBlock)) and node.filter is not None:
            self.filter_arguments(node.filter)
        capturing, self.capturing = self.capturing, True
        try:
            self.statements(node.body)
        finally:
            self.capturing = capturing

    def bind(self, target: nodes.Node, held: int, where: nodes.Node) -> None:
        if isinstance(target, nodes.Name):
            self.names[target.name] = self.names.get(target.name, FREE) | held
        elif held:  # a namespace attribute or a tuple of names: not followed, so declined
            raise self.decline(where, "messages or a content stored in a namespace or unpacked")
        elif isinstance(target, nodes.Tuple):
            for item in target.items:
                self.bind(item, FREE, where)

    # ---------------------------------------------------------------------------------------------- values
    def use(self, node: nodes.Node, allowed: int, how: str = "used") -> int:
        held = self.value(node)
        if held & ~allowed:
            what = "a message's content" if held & ~allowed & CONTENT else "the messages"
            raise self.decline(node, f"{what} {how} ({type(node).__name__})")
        return held

    def value(self, node: nodes.Node) -> int:  # noqa: C901 - one branch per kind of expression
        """What `node`'s value may hold, its parts' uses checked."""
        if isinstance(node, (nodes.Const, nodes.TemplateData, nodes.ContextReference, nodes.EnvironmentAttribute,
                             nodes.ExtensionAttribute, nodes.InternalName, nodes.ImportedName)):
            return FREE
        if isinstance(node, nodes.Name):
            return self.names.get(node.name, FREE)
        if isinstance(node, (nodes.Getattr, nodes.Getitem)):
            return self.lookup(node)
        if isinstance(node, (nodes.Add, nodes.Concat)):  # text joined: a content stays whole in it
            parts = node.nodes if isinstance(node, nodes.Concat) else [node.left, node.right]
            return functools.reduce(lambda held, part: held | self.use(part, CONTENT, "joined"), parts, FREE)
        if isinstance(node, (nodes.And, nodes.Or)):  # the value is one side as it is; each is tested for truth
            return self.value(node.left) | self.value(node.right)
        if isinstance(node, nodes.CondExpr):
            self.use(node.test, ANY)
            return self.value(node.expr1) | (FREE if node.expr2 is None else self.value(node.expr2))
        if isinstance(node, nodes.Not):
            self.use(node.node, ANY)
            return FREE
        if isinstance(node, nodes.Test):
            self.use(node.node, ANY if node.name in TYPE_TESTS else FREE, f"tested with '{node.name}'")
            self.arguments(node)
            return FREE
        if isinstance(node, nodes.Filter):
            return self.filtered(node)
        if isinstance(node, nodes.Call):
            return self.call(node)
        if isinstance(node, nodes.Compare):
            for operand in [node.expr, *(operand.expr for operand in node.ops)]:
                self.use(operand, FREE, "compared")
            return FREE
        children = _plain_children(node)
        if children is None:
            raise self.decline(node, f"a {type(node).__name__} expression")
        for child in children:  # arithmetic, literals, slices: no content may be in them
            self.use(child, FREE, f"used in a {type(node).__name__}")
        return FREE

    def lookup(self, node: nodes.Getattr | nodes.Getitem) -> int:
        """`x.key` or `x[key]`: a message's 'content' is a content, its other keys are free (a message here has
        only role and content), a method or a constant index into messages is messages, a computed key may be a
        content too (PART)."""
        base = node.node
        if isinstance(node, nodes.Getattr):
            key: Any = node.attr
        elif isinstance(node.arg, nodes.Const) and isinstance(node.arg.value, str):
            key = node.arg.value
        else:
            self.use(node.arg, FREE, "used as an index")
            key = None if isinstance(node.arg, (nodes.Const, nodes.Slice)) else _COMPUTED
        if isinstance(base, nodes.Name) and base.name == "loop" and key in ("previtem", "nextitem"):
            return MESSAGES | PART  # the loop's neighbouring item: a message, or what a loop over a PART gives
        held = self.use(base, MESSAGES | PART, "looked into")
        if not held:
            return FREE
        if key == "content":
            return CONTENT
        if key is _COMPUTED:
            return MESSAGES | PART
        return held if key is None or key in CONTAINER_ATTRIBUTES else FREE

    def filtered(self, node: nodes.Filter) -> int:
        if node.name in NONDETERMINISTIC:
            raise self.decline(node, f"the filter '{node.name}'")
        held = FREE if node.node is None else self.value(node.node)
        self.filter_arguments(node)
        if held & CONTENT and node.name != "string":  # `string` returns a str as it is
            raise self.decline(node, f"a message's content filtered with '{node.name}'")
        if held & (MESSAGES | PART):
            if node.name not in MESSAGE_FILTERS or (node.name in ("selectattr", "rejectattr") and not (
                    node.args and isinstance(node.args[0], nodes.Const) and node.args[0].value == "role")):
                raise self.decline(node, f"the messages filtered with '{node.name}'")
            if node.name in ("length", "count"):
                if held & PART:
                    raise self.decline(node, f"a computed key's value filtered with '{node.name}'")
                return FREE
            return held & (MESSAGES | PART)
        return held

    def filter_arguments(self, node: nodes.Filter) -> None:
        if node.name in NONDETERMINISTIC:
            raise self.decline(node, f"the filter '{node.name}'")
        self.arguments(node)

    def call(self, node: nodes.Call) -> int:
        if isinstance(node.node, nodes.Name) and node.node.name in NONDETERMINISTIC:
            raise self.decline(node, f"a call of '{node.node.name}'")
        self.use(node.node, FREE, "called")
        self.arguments(node)
        return FREE

    def arguments(self, node: nodes.Call | nodes.Filter | nodes.Test) -> None:
        for argument in [*node.args, *(keyword.value for keyword in node.kwargs), node.dyn_args, node.dyn_kwargs]:
            if argument is not None:
                self.use(argument, FREE, "handed to a call, filter or test")


def _plain_children(node: nodes.Node) -> list[nodes.Node] | None:
    """The operands of an expression whose value holds nothing of its operands' text (arithmetic, a literal list,
    tuple or dict, a slice); None for any other expression."""
    if isinstance(node, (nodes.Sub, nodes.Mul, nodes.Div, nodes.FloorDiv, nodes.Mod, nodes.Pow)):
        return [node.left, node.right]
    if isinstance(node, (nodes.Neg, nodes.Pos)):
        return [node.node]
    if isinstance(node, (nodes.Tuple, nodes.List)):
        return list(node.items)
    if isinstance(node, nodes.Dict):
        return [part for pair in node.items for part in (pair.key, pair.value)]
    if isinstance(node, nodes.Slice):
        return [part for part in (node.start, node.stop, node.step) if part is not None]
    return None


def _is_generation_block(call: nodes.Node) -> bool:
    return (isinstance(call, nodes.Call) and isinstance(call.node, nodes.ExtensionAttribute)
            and call.node.name == "_generation_support")


_MISSING: Any = object()


class TemplateSkeletons:
    """`compiled` (a chat template) rendering plain conversations, with `variables` (the special tokens): each shape
    once by Jinja with placeholders for its non-empty contents, then `str.format`. A template that uses a content
    otherwise, a shape whose first row the skeleton does not reproduce exactly, or a shape past MAX_SHAPES renders
    in full."""

    def __init__(self, compiled, source: str, variables: dict):
        self.compiled, self.variables = compiled, variables
        self.problem = content_use_problem(compiled.environment, source)
        self.shapes: dict[tuple, str | None] = {}  # shape -> str.format skeleton, None: renders in full
        self.nonce = secrets.token_hex(8)
        self.placeholder = re.compile("\ue000" + self.nonce + r"(\d+)\ue001")

    def render(self, messages: list, generation_prompt: bool) -> str | None:
        """`messages` rendered, when each is a dict of exactly a str role and a str content; else None."""
        shape: list = [generation_prompt]
        contents = []
        for message in messages:
            if type(message) is not dict or len(message) != 2:
                return None
            role, content = message.get("role"), message.get("content")
            if type(role) is not str or type(content) is not str:
                return None
            shape.append(role if content else (role,))  # a template may test a content for emptiness
            contents.append(content)
        if self.problem is not None:
            return self.full(messages, generation_prompt)
        key = tuple(shape)
        skeleton = self.shapes.get(key, _MISSING)
        if skeleton is _MISSING:
            return self.first_of_shape(key, messages, contents, generation_prompt)
        return self.full(messages, generation_prompt) if skeleton is None else skeleton.format(*contents)

    def full(self, messages: list, generation_prompt: bool) -> str:
        """What `apply_chat_template(messages, tokenize=False)` renders of plain messages: the same compiled template
        with the same variables (the special tokens, no tools or documents), less transformers' conversion of rich
        message objects, which costs more than the render itself and leaves plain strings as they are."""
        return self.compiled.render(messages=[dict(message) for message in messages], tools=None, documents=None,
                                    add_generation_prompt=generation_prompt, **self.variables)

    def first_of_shape(self, shape: tuple, messages: list, contents: list[str], generation_prompt: bool) -> str:
        """The row rendered in full, and its shape's skeleton kept if it gives the same text (else None is kept:
        the template refuses the shape, changes a placeholder, or uses a content in a way the check missed)."""
        if len(self.shapes) >= MAX_SHAPES:
            return self.full(messages, generation_prompt)
        skeleton = self.skeleton(messages, contents, generation_prompt)
        self.shapes[shape] = None
        text = self.full(messages, generation_prompt)  # raises what the template raises for this row
        if skeleton is not None and skeleton.format(*contents) == text:
            self.shapes[shape] = skeleton
        elif skeleton is not None:
            logger.debug("chat template skeleton of shape %r differs from its first row's render", shape)
        return text

    def skeleton(self, messages: list, contents: list[str], generation_prompt: bool) -> str | None:
        """The shape rendered with a placeholder for each non-empty content, as a `str.format` string; None when
        the template raises on it or a placeholder does not come out whole."""
        marked = [{"role": message["role"], "content": f"\ue000{self.nonce}{index}\ue001" if content else ""}
                  for index, (message, content) in enumerate(zip(messages, contents))]
        try:
            rendered = self.full(marked, generation_prompt)
        except Exception:  # noqa: BLE001 - the row's own render raises it again, and names the row
            return None
        pieces = self.placeholder.split(rendered)  # text, index, text, index, ..., text
        texts = pieces[0::2]
        if any(self.nonce in text or "\ue000" in text or "\ue001" in text for text in texts):
            return None
        return "".join(text.replace("{", "{{").replace("}", "}}") + ("{" + pieces[2 * number + 1] + "}"
                                                                      if 2 * number + 1 < len(pieces) else "")
                       for number, text in enumerate(texts))
