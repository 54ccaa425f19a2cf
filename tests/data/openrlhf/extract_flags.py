#!/usr/bin/env python3
"""Extract the argparse options of OpenRLHF CLI modules at given git tags.

Writes ``flags.json`` next to this script (or to ``--out``).  The source is read
straight out of a git directory with ``git show TAG:PATH``; nothing is imported
or executed, only parsed with :mod:`ast`.

Usage::

    python extract_flags.py [--repo /work/.mirror/OpenRLHF+OpenRLHF/repo] \
        [--tags v0.9.10 v0.11.0] [--older v0.9.0=train_prm] [--out flags.json] [--verify]

``--tags`` are read for every CLI of ``--clis``; ``--older TAG=CLI[,CLI...]`` adds CLIs
that OpenRLHF removed before those tags, read at the one older tag named
(default: ``v0.9.0=train_prm``; ``openrlhf/cli/train_prm.py`` is gone by v0.9.10).
Each becomes ``flags.json[TAG][CLI]`` in the same record shape, and the tag's
commit joins ``commits``.

What is extracted
-----------------
Every ``ast.Call`` whose ``func`` is an attribute named ``add_argument``
(``parser.add_argument(...)``, ``group.add_argument(...)``, ...) in
``openrlhf/cli/NAME.py``.  Multi-line calls are a non-issue for ``ast``.

* ``flag``    first long option string (``--x``) without the dashes; if the
              option has no long form, the first option string without dashes
              (positional arguments keep their name).
* ``aliases`` the other option strings of the same call, dashes stripped.
* ``dest``    the explicit ``dest=`` (source text), else null.
* ``type``    name of the ``type=`` callable (``int``, ``str``, ...) or the
              unparsed source if it is not a plain name; null if absent.
* ``action``, ``nargs``, ``required``, ``metavar``, ``const`` - literal values
              when literal, else source text; null if absent.
* ``default`` source text of ``default=`` via ``ast.unparse``; null if the
              keyword is absent (argparse then uses None, or False for
              ``store_true``).
* ``choices`` source text or null.
* ``help``    the string if it is a (possibly implicitly concatenated)
              literal, else source text; null if absent.
* ``source``  repository path of the file holding the ``add_argument`` call.
* ``lineno``  line of the call in that file.
* ``loop``    only for calls inside ``for VAR in (<literals>)`` loops (e.g.
              v0.11.0 train_ppo_ray's ``for prefix in ("actor", "critic")``):
              the binding used for this expansion.  The call is emitted once
              per loop value, with the loop variable substituted and f-strings /
              constant conditional expressions folded, so ``f"--{prefix}.adam.lr"``
              becomes ``actor.adam.lr`` and ``critic.adam.lr``, and
              ``1e-6 if prefix == "actor" else 9e-6`` becomes ``1e-06`` /
              ``9e-06``.  ``default_source`` then keeps the unsubstituted text.

Shared helpers
--------------
For every tag the script also greps all ``openrlhf/**/*.py`` for
``add_argument``.  If a non-CLI module defines a function that calls
``add_argument`` and a CLI module calls that function (by name, directly or as
``module.func``), that function's options are appended to the CLI with
``source`` set to the helper's path.  At v0.9.10 and v0.11.0 no such helper
exists (``add_argument`` only occurs in ``openrlhf/cli/*.py``); the report
printed at the end says so.
"""

from __future__ import annotations

import argparse
import ast
import copy
import itertools
import json
import os
import subprocess
import sys

DEFAULT_REPO = "/work/.mirror/OpenRLHF+OpenRLHF/repo"
DEFAULT_TAGS = ["v0.9.10", "v0.11.0"]
CLIS = ["train_sft", "train_rm", "train_dpo", "train_ppo_ray", "lora_combiner"]
# CLIs OpenRLHF removed before DEFAULT_TAGS, read at one older tag each (train_prm: v0.9.0, the seed guide's
# release; it lasted to v0.9.5 and was removed in 6a981c8c).
OLDER = {"v0.9.0": ["train_prm"]}


def _older(spec: str) -> tuple[str, list[str]]:
    tag, _, clis = spec.partition("=")
    if not tag or not clis:
        raise argparse.ArgumentTypeError(f"expected TAG=CLI[,CLI...], got {spec!r}")
    return tag, clis.split(",")


def git(repo: str, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", repo, *args], check=True, capture_output=True, text=True
    ).stdout


def show(repo: str, tag: str, path: str) -> str:
    return git(repo, "show", f"{tag}:{path}")


# --------------------------------------------------------------------------
# loop-variable substitution and constant folding


class _Subst(ast.NodeTransformer):
    def __init__(self, binding: dict):
        self.binding = binding

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Load) and node.id in self.binding:
            return ast.copy_location(ast.Constant(self.binding[node.id]), node)
        return node


class _Fold(ast.NodeTransformer):
    """Fold f-strings, comparisons and conditional expressions of constants."""

    def visit_JoinedStr(self, node):
        self.generic_visit(node)
        parts = []
        for v in node.values:
            if isinstance(v, ast.Constant):
                parts.append(str(v.value))
            elif (
                isinstance(v, ast.FormattedValue)
                and isinstance(v.value, ast.Constant)
                and v.conversion == -1
                and v.format_spec is None
            ):
                parts.append(str(v.value.value))
            else:
                return node
        return ast.copy_location(ast.Constant("".join(parts)), node)

    def visit_Compare(self, node):
        self.generic_visit(node)
        if (
            len(node.ops) == 1
            and isinstance(node.left, ast.Constant)
            and isinstance(node.comparators[0], ast.Constant)
            and isinstance(node.ops[0], (ast.Eq, ast.NotEq))
        ):
            eq = node.left.value == node.comparators[0].value
            return ast.copy_location(ast.Constant(eq if isinstance(node.ops[0], ast.Eq) else not eq), node)
        return node

    def visit_IfExp(self, node):
        self.generic_visit(node)
        if isinstance(node.test, ast.Constant):
            return node.body if node.test.value else node.orelse
        return node


def _literal_loop_values(it: ast.AST):
    try:
        vals = ast.literal_eval(it)
    except Exception:
        return None
    if isinstance(vals, (list, tuple)):
        return list(vals)
    return None


# --------------------------------------------------------------------------
# add_argument call collection


def _collect_calls(tree: ast.AST):
    """Yield (call_node, loop_bindings) for every add_argument call.

    loop_bindings is a list of (var, [values]) for enclosing literal for-loops.
    """
    out = []

    def visit(node, loops):
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name):
            vals = _literal_loop_values(node.iter)
            if vals is not None:
                inner = loops + [(node.target.id, vals)]
                for child in node.body:
                    visit(child, inner)
                for child in node.orelse:
                    visit(child, loops)
                return
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument"
        ):
            out.append((node, loops))
        for child in ast.iter_child_nodes(node):
            visit(child, loops)

    visit(tree, [])
    return out


def _lit_or_src(node):
    if node is None:
        return None
    try:
        return ast.literal_eval(node)
    except Exception:
        return ast.unparse(node)


def _src(node):
    return None if node is None else ast.unparse(node)


def _option_record(call: ast.Call, binding: dict, source: str):
    orig = call
    if binding:
        call = _Fold().visit(_Subst(binding).visit(copy.deepcopy(call)))
        ast.fix_missing_locations(call)

    names = []
    for a in call.args:
        if isinstance(a, ast.Constant) and isinstance(a.value, str):
            names.append(a.value)
        else:
            names.append(ast.unparse(a))
    longs = [n for n in names if n.startswith("--")]
    primary = longs[0] if longs else (names[0] if names else None)
    flag = primary.lstrip("-") if primary else None
    aliases = [n.lstrip("-") for n in names if n != primary]

    kw = {k.arg: k.value for k in call.keywords if k.arg}
    okw = {k.arg: k.value for k in orig.keywords if k.arg}

    t = kw.get("type")
    if t is None:
        type_name = None
    elif isinstance(t, ast.Name):
        type_name = t.id
    elif isinstance(t, ast.Attribute):
        type_name = ast.unparse(t)
    else:
        type_name = ast.unparse(t)

    h = kw.get("help")
    help_val = _lit_or_src(h) if h is not None else None
    if h is not None and not isinstance(help_val, str):
        help_val = ast.unparse(h)

    rec = {
        "flag": flag,
        "aliases": aliases,
        "dest": _lit_or_src(kw.get("dest")),
        "type": type_name,
        "action": _lit_or_src(kw.get("action")),
        "nargs": _lit_or_src(kw.get("nargs")),
        "default": _src(kw.get("default")),
        "choices": _src(kw.get("choices")),
        "help": help_val,
        "required": _lit_or_src(kw.get("required")),
        "source": source,
        "lineno": orig.lineno,
    }
    for extra in ("metavar", "const"):
        if extra in kw:
            rec[extra] = _lit_or_src(kw[extra])
    other = sorted(set(kw) - {"dest", "type", "action", "nargs", "default", "choices", "help",
                              "required", "metavar", "const"})
    if other:
        rec["other_kwargs"] = {k: _src(kw[k]) for k in other}
    if binding:
        rec["loop"] = dict(binding)
        if "default" in okw and _src(okw["default"]) != rec["default"]:
            rec["default_source"] = _src(okw["default"])
    return rec


def options_from_source(text: str, source: str, only_funcs: set | None = None):
    tree = ast.parse(text)
    roots = [tree]
    if only_funcs is not None:
        roots = [
            n for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name in only_funcs
        ]
    recs = []
    for root in roots:
        for call, loops in _collect_calls(root):
            if loops:
                names = [v for v, _ in loops]
                for combo in itertools.product(*[vals for _, vals in loops]):
                    recs.append(_option_record(call, dict(zip(names, combo)), source))
            else:
                recs.append(_option_record(call, {}, source))
    return recs


# --------------------------------------------------------------------------
# shared-helper detection


def _funcs_with_add_argument(text: str):
    tree = ast.parse(text)
    funcs = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for c in ast.walk(n):
                if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == "add_argument":
                    funcs.add(n.name)
                    break
    return funcs


def _called_names(text: str):
    tree = ast.parse(text)
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            if isinstance(n.func, ast.Name):
                names.add(n.func.id)
            elif isinstance(n.func, ast.Attribute):
                names.add(n.func.attr)
    return names


def helper_modules(repo: str, tag: str):
    """Return {path: set(funcs)} for non-CLI openrlhf modules that call add_argument."""
    try:
        hits = git(repo, "grep", "-l", "add_argument", tag, "--", "openrlhf").split()
    except subprocess.CalledProcessError:  # git grep exits 1 when nothing matches
        hits = []
    paths = [h.split(":", 1)[1] for h in hits]
    helpers = {}
    for p in paths:
        if p.startswith("openrlhf/cli/") or not p.endswith(".py"):
            continue
        funcs = _funcs_with_add_argument(show(repo, tag, p))
        if funcs:
            helpers[p] = funcs
    return paths, helpers


# --------------------------------------------------------------------------
# optional cross-check against the real argparse parser


def verify_against_argparse(text: str, recs: list) -> None:
    """Build the CLI's real parser and compare it with the AST records.

    Executes only the ``if __name__ == "__main__":`` block of the module up to
    (not including) the ``parse_args()`` line, with ``argparse`` and
    ``datetime`` in scope; nothing else of the module is imported.
    """
    import datetime as _dt

    body = text[text.index('if __name__ == "__main__":'):].split("\n")[1:]
    end = next(i for i, l in enumerate(body) if "parse_args(" in l)
    code = "\n".join(l[4:] for l in body[:end])
    ns = {"argparse": argparse, "datetime": _dt.datetime}
    exec(compile(code, "<cli __main__>", "exec"), ns)  # noqa: S102 - argparse setup only
    parser = ns["parser"]
    acts = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    real = {}
    for a in acts:
        longs = [o for o in a.option_strings if o.startswith("--")]
        real[(longs[0] if longs else a.option_strings[0]).lstrip("-")] = a
    ours = {r["flag"]: r for r in recs}
    assert set(real) == set(ours), f"flag sets differ: {sorted(set(real) ^ set(ours))}"
    for f, a in real.items():
        r = ours[f]
        assert (a.type.__name__ if a.type else None) == r["type"], (f, "type")
        assert r["action"] or a.nargs == r["nargs"], (f, "nargs")
        assert (a.help or None) == (r["help"] or None), (f, "help")
        assert a.dest == (r["dest"] or f), (f, "dest")
        assert sorted(o.lstrip("-") for o in a.option_strings) == sorted([f] + r["aliases"]), (f, "aliases")
        if r["choices"] is not None:
            assert list(a.choices) == list(ast.literal_eval(r["choices"])), (f, "choices")
        if r["default"] is not None and "datetime" not in r["default"]:
            assert a.default == eval(r["default"], {"int": int, "float": float}), (f, "default")  # noqa: S307


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repo", default=DEFAULT_REPO, help="git dir of OpenRLHF/OpenRLHF")
    ap.add_argument("--tags", nargs="+", default=DEFAULT_TAGS)
    ap.add_argument("--clis", nargs="+", default=CLIS)
    ap.add_argument("--older", nargs="*", type=_older, default=list(OLDER.items()), metavar="TAG=CLI[,CLI...]",
                    help="CLIs read only at one (older) tag; default: "
                         + " ".join(f"{t}={','.join(c)}" for t, c in OLDER.items()))
    ap.add_argument("--verify", action="store_true",
                    help="also build each real argparse parser (exec of the __main__ argparse block) and compare")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "flags.json"))
    a = ap.parse_args(argv)

    result = {}
    commits = {}
    jobs = [(tag, a.clis) for tag in a.tags] + [(tag, clis) for tag, clis in a.older]
    for tag, clis in jobs:
        commits[tag] = git(a.repo, "rev-list", "-n1", tag).strip()
        paths, helpers = helper_modules(a.repo, tag)
        print(f"[{tag}] files under openrlhf/ containing add_argument: {', '.join(paths) or '(none)'}")
        print(f"[{tag}] non-CLI helper functions adding arguments: "
              f"{ {p: sorted(f) for p, f in helpers.items()} or '(none)'}")
        result.setdefault(tag, {})
        for cli in clis:
            path = f"openrlhf/cli/{cli}.py"
            text = show(a.repo, tag, path)
            recs = options_from_source(text, path)
            called = _called_names(text)
            for hpath, funcs in helpers.items():
                used = funcs & called
                if used:
                    recs += options_from_source(show(a.repo, tag, hpath), hpath, used)
            if a.verify:
                verify_against_argparse(text, [r for r in recs if r["source"] == path])
                print(f"[{tag}] {cli}: AST records match the real argparse parser ({len(recs)} options)")
            flags = [r["flag"] for r in recs]
            dups = sorted({f for f in flags if flags.count(f) > 1})
            if dups:
                print(f"[{tag}] WARNING {cli}: duplicate flags {dups}", file=sys.stderr)
            result[tag][cli] = recs
    result["commits"] = commits

    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2, ensure_ascii=False)
        f.write("\n")

    print(f"\nwrote {a.out}")
    print(f"{'cli':<16}" + "".join(f"{t:>10}" for t in a.tags))
    for cli in a.clis:
        print(f"{cli:<16}" + "".join(f"{len(result[t][cli]):>10}" for t in a.tags))
    for tag, clis in a.older:
        for cli in clis:
            print(f"{cli:<16}{len(result[tag][cli]):>10} (at {tag} only)")


if __name__ == "__main__":
    main()
