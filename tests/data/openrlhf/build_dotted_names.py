#!/usr/bin/env python3
"""Derive the v0.9.10 -> v0.11.0 flag-name correspondence of OpenRLHF CLIs.

Writes ``dotted_names.json`` next to this script (or ``--out``).

Evidence is collected mechanically from the git history, then combined with a
small table of hand-reviewed decisions (``MANUAL`` below) for the cases the
mechanical evidence cannot settle on its own (one flag split into several,
dropped flags, renames whose help text also changed).  Every entry carries the
evidence that supports it.

Evidence kinds (all from commit ed62d0e2, "dotted config hierarchy", which is
the only commit between the tags that renames options of these five CLIs;
this is checked, see ``check_intermediate_commits``):

``argparse diff``  In ``openrlhf/cli/NAME.py`` the removed ``add_argument`` line
                   for ``--old`` and the added line for ``--new`` sit at the same
                   position of the same diff block (difflib replace block with
                   the same number of options on both sides, or a 1:1 line pair).
``same attrs``     The old and new ``add_argument`` calls agree on type, action,
                   nargs, default (compared by value where literal), choices and
                   help (only the attributes that differ are listed).
``usage``          In a ``.py`` file changed by ed62d0e2, a line using
                   ``args.old`` / ``getattr(args, "old")`` was replaced by a line
                   using ``args.new.dotted`` at the same position (the count of
                   such line pairs and the files are given).
``script``         In an ``examples/scripts/*.sh`` file that launches this CLI,
                   a ``--old VALUE`` line became ``--new VALUE`` (same value).
``readme``         Same, in README.md / README_zh.md / README_ja.md.

Confidence: "high" when the argparse diff pairing is confirmed by at least one
independent kind (same attrs, usage, script or readme) or the entry is a
reviewed manual decision backed by code evidence; "low" otherwise.

Usage::

    python build_dotted_names.py [--repo /work/.mirror/OpenRLHF+OpenRLHF/repo] [--out dotted_names.json]
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import os
import re
import subprocess
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from extract_flags import CLIS, DEFAULT_REPO, git, options_from_source, show  # noqa: E402

OLD_TAG, NEW_TAG = "v0.9.10", "v0.11.0"
RENAME_COMMIT = "ed62d0e20dea08397251eba5e010ee9dabc4d048"

# ---------------------------------------------------------------------------
# Hand-reviewed decisions.  key: (cli, old_flag).  "dotted" may be None
# (dropped).  "also" lists further v0.11.0 options that took over part of the
# old option's role (the old flag was split).  "note" explains semantics.
PRE = RENAME_COMMIT + "^"
DS = "openrlhf/utils/deepspeed/deepspeed.py"
_SFT_OPT_PRE = "create_optimizer(model, lr=args.learning_rate, betas=args.adam_betas, weight_decay=args.l2)"
_DS_ADAM = [(NEW_TAG, DS, '"weight_decay": adam["weight_decay"]'), (NEW_TAG, DS, '"betas": list(adam["betas"])'),
            (NEW_TAG, DS, '"lr": adam["lr"]')]


def _sft_rm(cli, note=None):
    code = [(PRE, f"openrlhf/cli/{cli}.py", _SFT_OPT_PRE), (NEW_TAG, f"openrlhf/cli/{cli}.py", "adam=vars(args.adam)")]
    return dict(code=code + _DS_ADAM, **({"note": note} if note else {}))


def _ppo(old_pre, new_actor, new_critic, old_pre_critic=None):
    return [
        (PRE, "openrlhf/trainer/ray/ppo_actor.py", old_pre),
        (PRE, "openrlhf/trainer/ray/ppo_critic.py", old_pre_critic or old_pre),
        (NEW_TAG, "openrlhf/trainer/ray/ppo_actor.py", new_actor),
        (NEW_TAG, "openrlhf/trainer/ray/ppo_critic.py", new_critic),
    ]


# Hand-reviewed decisions.  key: (cli, old_flag).
#   dotted  v0.11.0 name, or None (dropped)
#   also    further v0.11.0 options that took over part of the old option's role
#   note    semantics
#   code    [(rev, path, snippet)] code evidence; the script checks that every
#           snippet really occurs in that file at that revision.
MANUAL = {
    # --- optimizer hyper-parameters: create_optimizer(lr=..., betas=..., weight_decay=...)
    #     replaced by strategy.prepare((model, cfg)) with cfg["adam"] = vars(args.adam)
    ("train_sft", "learning_rate"): dict(
        dotted="adam.lr",
        note="AdamW LR; with --optim muon it is the LR of the aux-Adam group (2D weights use --muon.lr). "
        "The cosine_with_min_lr floor was hard-coded learning_rate*0.1 and is now --min_lr_ratio (default 0.1)",
        **{k: v for k, v in _sft_rm("train_sft").items() if k == "code"},
    ),
    ("train_rm", "learning_rate"): dict(
        dotted="adam.lr",
        note="AdamW LR; with --optim muon it is the LR of the aux-Adam group (2D weights use --muon.lr). "
        "The cosine_with_min_lr floor was hard-coded learning_rate*0.1 and is now --min_lr_ratio (default 0.1)",
        **{k: v for k, v in _sft_rm("train_rm").items() if k == "code"},
    ),
    ("train_dpo", "learning_rate"): dict(
        dotted="adam.lr",
        note="AdamW LR; with --optim muon it is the LR of the aux-Adam group (2D weights use --muon.lr). "
        "Unlike train_sft/train_rm, train_dpo already had --min_lr_ratio at v0.9.10 (name unchanged)",
        **{k: v for k, v in _sft_rm("train_dpo").items() if k == "code"},
    ),
    ("train_sft", "l2"): dict(dotted="adam.weight_decay", **_sft_rm("train_sft")),
    ("train_rm", "l2"): dict(dotted="adam.weight_decay", **_sft_rm("train_rm")),
    ("train_dpo", "l2"): dict(dotted="adam.weight_decay", **_sft_rm("train_dpo")),
    ("train_sft", "adam_betas"): dict(dotted="adam.betas", **_sft_rm("train_sft")),
    ("train_rm", "adam_betas"): dict(dotted="adam.betas", **_sft_rm("train_rm")),
    ("train_dpo", "adam_betas"): dict(dotted="adam.betas", **_sft_rm("train_dpo")),
    ("train_ppo_ray", "actor_learning_rate"): dict(
        dotted="actor.adam.lr",
        note="with --actor.optim muon it is the aux-Adam LR (2D weights use --actor.muon.lr); "
        "min LR was hard-coded actor_learning_rate*0.1, now --actor.min_lr_ratio",
        code=[(PRE, "openrlhf/trainer/ray/ppo_actor.py", "lr=args.actor_learning_rate"),
              (NEW_TAG, "openrlhf/trainer/ray/ppo_actor.py", "adam=vars(args.actor.adam)")] + _DS_ADAM,
    ),
    ("train_ppo_ray", "critic_learning_rate"): dict(
        dotted="critic.adam.lr",
        note="min LR was hard-coded critic_learning_rate*0.1, now --critic.min_lr_ratio",
        code=[(PRE, "openrlhf/trainer/ray/ppo_critic.py", "lr=args.critic_learning_rate"),
              (NEW_TAG, "openrlhf/trainer/ray/ppo_critic.py", "adam=vars(args.critic.adam)")] + _DS_ADAM,
    ),
    # --- ppo: one shared flag became per-entity (actor.* and critic.*) ----------
    ("train_ppo_ray", "l2"): dict(
        dotted="actor.adam.weight_decay",
        also=["critic.adam.weight_decay"],
        note="one weight decay shared by actor and critic became per-entity options",
        code=_ppo("weight_decay=args.l2", "adam=vars(args.actor.adam)", "adam=vars(args.critic.adam)") + _DS_ADAM[:1],
    ),
    ("train_ppo_ray", "adam_betas"): dict(
        dotted="actor.adam.betas",
        also=["critic.adam.betas"],
        note="one betas pair shared by actor and critic became per-entity options",
        code=_ppo("betas=strategy.args.adam_betas", "adam=vars(args.actor.adam)", "adam=vars(args.critic.adam)",
                  old_pre_critic="betas=args.adam_betas") + _DS_ADAM[1:2],
    ),
    ("train_ppo_ray", "max_norm"): dict(
        dotted="actor.max_norm",
        also=["critic.max_norm"],
        note="v0.9.10 applied one --max_norm to every DeepSpeed model through get_strategy(args); "
        "v0.11.0 passes --actor.max_norm / --critic.max_norm per model via cfg['max_norm']. "
        "get_strategy still reads getattr(args, 'max_norm', 1.0), which train_ppo_ray no longer defines "
        "(only a fallback for legacy callers)",
        code=[(OLD_TAG, "openrlhf/utils/utils.py", 'max_norm=getattr(args, "max_norm", 1.0)'),
              (NEW_TAG, "openrlhf/trainer/ray/ppo_actor.py", "max_norm=args.actor.max_norm"),
              (NEW_TAG, "openrlhf/trainer/ray/ppo_critic.py", "max_norm=args.critic.max_norm"),
              (NEW_TAG, DS, 'max_norm=cfg.get("max_norm", 1.0)')],
    ),
    ("train_ppo_ray", "lr_warmup_ratio"): dict(
        dotted="actor.lr_warmup_ratio",
        also=["critic.lr_warmup_ratio"],
        note="one warmup ratio shared by actor and critic became per-entity options",
        code=_ppo("math.ceil(max_steps * args.lr_warmup_ratio)", "lr_warmup_ratio=args.actor.lr_warmup_ratio",
                  "lr_warmup_ratio=args.critic.lr_warmup_ratio"),
    ),
    ("train_ppo_ray", "lr_scheduler"): dict(
        dotted="actor.lr_scheduler",
        also=["critic.lr_scheduler"],
        note="one scheduler shared by actor and critic became per-entity options",
        code=_ppo("args.lr_scheduler,", "lr_scheduler=args.actor.lr_scheduler", "lr_scheduler=args.critic.lr_scheduler"),
    ),
    ("train_ppo_ray", "ref_reward_offload"): dict(
        dotted="ref.offload",
        also=["reward.offload"],
        note="one flag offloading both reference and reward models became two flags",
    ),
    ("train_ppo_ray", "gradient_checkpointing"): dict(
        dotted="actor.gradient_checkpointing_enable",
        note="still a single switch: the critic also reads args.actor.gradient_checkpointing_enable",
        code=[(NEW_TAG, "openrlhf/trainer/ray/ppo_critic.py", "if args.actor.gradient_checkpointing_enable:")],
    ),
    ("train_ppo_ray", "gradient_checkpointing_use_reentrant"): dict(
        dotted="actor.gradient_checkpointing_reentrant",
        note="still a single switch: the critic also reads args.actor.gradient_checkpointing_reentrant",
        code=[(NEW_TAG, "openrlhf/trainer/ray/ppo_critic.py", '"use_reentrant": args.actor.gradient_checkpointing_reentrant')],
    ),
    ("train_ppo_ray", "aux_loss_coef"): dict(
        dotted="actor.aux_loss_coef",
        note="still a single value: the critic also reads args.actor.aux_loss_coef",
        code=[(NEW_TAG, "openrlhf/trainer/ray/ppo_critic.py", "self.args.actor.aux_loss_coef")],
    ),
    ("train_ppo_ray", "freezing_actor_steps"): dict(
        dotted="critic.freezing_steps",
        note="help changed from 'Used for critic initialization' to 'Freeze the actor for the first N steps "
        "to let the critic warm up'; same int, default -1, same use in ppo_trainer.py",
    ),
    # --- options removed by ed62d0e2 ("drop dead flags") ----------------------
    ("train_ppo_ray", "ptx_coef"): dict(dotted=None, note="dead flag dropped by ed62d0e2 (no reader left at v0.9.10)"),
    ("train_ppo_ray", "actor_init_on_gpu"): dict(dotted=None, note="dead flag dropped by ed62d0e2 (no reader left at v0.9.10)"),
    ("train_ppo_ray", "perf"): dict(dotted=None, note="dead flag dropped by ed62d0e2 (no reader left at v0.9.10)"),
    ("train_sft", "train_split"): dict(
        dotted=None,
        note="dead flag dropped by ed62d0e2 (never read; --dataset_split / --data.dataset_split selects the split)",
    ),
}


# Remarks on v0.11.0 options without a v0.9.10 counterpart (keyed by the last
# dotted component, so they apply to actor.* / critic.* alike).
NEW_NOTES = {
    "min_lr_ratio": "replaces the hard-coded min_lr = lr * 0.1 of v0.9.10 (default 0.1 keeps the old behaviour)",
    "eps": "v0.9.10 used the optimizer's built-in eps (1e-8, same as the new default)",
    "optim": "new: adam (default, v0.9.10 behaviour) or muon",
    "experts_implementation": "new: MoE expert kernel passed to transformers from_pretrained",
}


def check_code_evidence(repo):
    """Every code snippet quoted in MANUAL must occur in its file at its revision."""
    cache = {}
    for key, m in MANUAL.items():
        for rev, path, snip in m.get("code", []):
            if (rev, path) not in cache:
                cache[(rev, path)] = show(repo, rev, path)
            if snip not in cache[(rev, path)]:
                raise SystemExit(f"code evidence for {key} not found: {rev}:{path}: {snip!r}")


def code_evidence_text(m):
    out = []
    for rev, path, snip in m.get("code", []):
        r = "pre-ed62d0e2" if rev == PRE else rev
        out.append(f"{r} {os.path.basename(path)}: `{snip}`")
    return out


# ---------------------------------------------------------------------------


def norm_value(src):
    """Compare defaults by value where they are literals or simple calls."""
    if src is None:
        return None
    try:
        return ("v", ast.literal_eval(src))
    except Exception:
        pass
    m = re.fullmatch(r"(int|float)\((.*)\)", src)
    if m:
        try:
            return ("v", {"int": int, "float": float}[m.group(1)](ast.literal_eval(m.group(2)) if m.group(2)[0] != '"' else m.group(2).strip('"')))
        except Exception:
            pass
    return ("s", src)


def attr_diff(o, n):
    diffs = []
    for k in ("type", "action", "nargs", "choices", "help"):
        a, b = o.get(k), n.get(k)
        if k == "choices":
            a, b = norm_value(a), norm_value(b)
        if isinstance(a, list):
            a = tuple(a)
        if isinstance(b, list):
            b = tuple(b)
        if a != b:
            diffs.append(k)
    da, db = norm_value(o.get("default")), norm_value(n.get("default"))
    if da != db:
        # treat (0.9, 0.95) vs [0.9, 0.95], 0 vs 0.0 as the same value
        va = da[1] if da else None
        vb = db[1] if db else None
        if isinstance(va, (list, tuple)) and isinstance(vb, (list, tuple)):
            same = list(va) == list(vb)
        else:
            same = va == vb and da[0] == db[0]
        if not same:
            diffs.append("default")
    return diffs


# --- tokenizers --------------------------------------------------------------
# Each tokenizer returns [(start, end, token)] for a line, in order.

ARG_OPT = re.compile(r"""f?["']--([\w.{}]+)["']""")
ARGS_CHAIN = re.compile(r"\bargs((?:\.[A-Za-z_]\w*)+)")
GETATTR = re.compile(r"""getattr\(\s*(?:self\.)?(?:strategy\.)?args((?:\.[A-Za-z_]\w*)*)\s*,\s*["'](\w+)["']""")
CLI_OPT = re.compile(r"(?<![\w-])--([A-Za-z_][\w.]*)")


def argparse_tokens(line):
    return [(m.start(), m.end(), m.group(1)) for m in ARG_OPT.finditer(line)]


def py_tokens(line):
    """args attribute chains used in a python line (args.x.y, getattr(args.x, "y"))."""
    toks = []
    for m in GETATTR.finditer(line):
        toks.append((m.start(), m.end(), (m.group(1) + "." + m.group(2)).lstrip(".")))
    for m in ARGS_CHAIN.finditer(line):
        if any(s <= m.start() < e for s, e, _ in toks):
            continue
        toks.append((m.start(), m.end(), m.group(1).lstrip(".")))
    return sorted(toks)


def cli_tokens(line):
    """--option tokens of a shell / markdown line; token = (name, value)."""
    out = []
    for m in CLI_OPT.finditer(line):
        rest = line[m.end():].strip().rstrip("\\").strip()
        val = rest.split()[0] if rest and not rest.startswith("-") else ""
        out.append((m.start(), m.end(), (m.group(1), val)))
    return out


def _norm(line, tok):
    """The line with every token replaced by a placeholder (for alignment)."""
    out, pos = [], 0
    for s, e, _ in tok(line):
        out.append(line[pos:s])
        out.append("\u00a7")
        pos = e
    out.append(line[pos:])
    return "".join(out).strip()


def _pos_pairs(old_lines, new_lines, tok):
    ot = [t for l in old_lines for _, _, t in tok(l)]
    nt = [t for l in new_lines for _, _, t in tok(l)]
    if ot and len(ot) == len(nt):
        return list(zip(ot, nt))
    return []


def token_pairs(old_text, new_text, tok):
    """(old_token, new_token) pairs at the same place of a rename diff.

    Lines are aligned with every token replaced by a placeholder, so a line
    whose only change is the option / attribute name compares equal; such
    lines pair their tokens positionally.  Leftover replace blocks pair their
    tokens positionally when both sides hold the same number of tokens.
    """
    a, b = old_text.splitlines(), new_text.splitlines()
    na, nb = [_norm(l, tok) for l in a], [_norm(l, tok) for l in b]
    pairs = []
    sm = difflib.SequenceMatcher(None, na, nb, autojunk=False)
    for op, i1, i2, j1, j2 in sm.get_opcodes():
        if op == "equal":
            for la, lb in zip(a[i1:i2], b[j1:j2]):
                ta, tb = tok(la), tok(lb)
                if len(ta) == len(tb):
                    pairs += [(x[2], y[2]) for x, y in zip(ta, tb)]
        elif op == "replace":
            pairs += _pos_pairs(a[i1:i2], b[j1:j2], tok)
    return pairs


def resolve(chain, flagset):
    """Longest dotted prefix of an attribute chain that is a known option dest."""
    parts = chain.split(".")
    for k in range(len(parts), 0, -1):
        cand = ".".join(parts[:k])
        if cand in flagset:
            return cand
    return None


# ---------------------------------------------------------------------------


def flags_at(repo, rev, cli):
    return {r["flag"]: r for r in options_from_source(show(repo, rev, f"openrlhf/cli/{cli}.py"), f"openrlhf/cli/{cli}.py")}


def check_intermediate_commits(repo):
    """Report every flag-set / attribute change between the tags, per commit."""
    report = []
    paths = [f"openrlhf/cli/{c}.py" for c in CLIS]
    commits = git(repo, "log", "--reverse", "--format=%H", f"{OLD_TAG}..{NEW_TAG}", "--", *paths).split()
    for h in commits:
        subj = git(repo, "log", "-1", "--format=%s", h).strip()
        for cli in CLIS:
            try:
                a, b = flags_at(repo, h + "^", cli), flags_at(repo, h, cli)
            except subprocess.CalledProcessError:
                continue
            rem = [f for f in a if f not in b]
            add = [f for f in b if f not in a]
            chg = {}
            for f in a:
                if f in b:
                    d = attr_diff(a[f], b[f])
                    if d:
                        chg[f] = {k: [a[f].get(k), b[f].get(k)] for k in d}
            if rem or add or chg:
                report.append(dict(commit=h, subject=subj, cli=cli, removed=rem, added=add, changed=chg))
    return report


def name_match(old_name, new_name):
    """Old flat name and new dotted name denote the same thing by spelling."""
    parts = new_name.split(".")
    last = parts[-1]
    cands = {last, "_".join(parts), "_".join(reversed(parts))}
    for suf in ("_enable",):
        if last.endswith(suf):
            cands.add(last[: -len(suf)])
    return old_name in cands


KIND_ORDER = ["argparse diff", "usage", "script", "readme", "name+attrs"]


def collect_evidence(repo):
    pre = RENAME_COMMIT + "^"
    changed = git(repo, "show", "--format=", "--name-status", RENAME_COMMIT).splitlines()
    files = [l.split("\t")[-1] for l in changed if l and l[0] == "M"]
    ev = {"argparse": {}, "usage": [], "script": [], "readme": []}
    for c in CLIS:
        path = f"openrlhf/cli/{c}.py"
        ev["argparse"][c] = token_pairs(show(repo, pre, path), show(repo, RENAME_COMMIT, path), argparse_tokens)
    for f in files:
        if f.endswith(".py"):
            for o, n in token_pairs(show(repo, pre, f), show(repo, RENAME_COMMIT, f), py_tokens):
                if o != n:
                    ev["usage"].append((o, n, f))
        elif f.startswith("examples/scripts/") and f.endswith(".sh"):
            otext = show(repo, pre, f)
            clis = set(re.findall(r"openrlhf\.cli\.(\w+)", otext))
            for (o, ov), (n, nv) in token_pairs(otext, show(repo, RENAME_COMMIT, f), cli_tokens):
                if o != n and ov == nv:
                    ev["script"].append((o, n, f, clis))
        elif os.path.basename(f).startswith("README") and f.endswith(".md"):
            for (o, ov), (n, nv) in token_pairs(show(repo, pre, f), show(repo, RENAME_COMMIT, f), cli_tokens):
                if o != n and ov == nv:
                    ev["readme"].append((o, n, f))
    return ev


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", default=DEFAULT_REPO)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "dotted_names.json"))
    a = ap.parse_args(argv)
    repo = a.repo
    pre = RENAME_COMMIT + "^"

    history = check_intermediate_commits(repo)
    renaming = [h for h in history if h["removed"] and h["commit"] != RENAME_COMMIT]
    if renaming:
        print("WARNING: commits other than ed62d0e2 remove flags:", renaming, file=sys.stderr)

    old = {c: flags_at(repo, OLD_TAG, c) for c in CLIS}
    new = {c: flags_at(repo, NEW_TAG, c) for c in CLIS}
    pre_f = {c: flags_at(repo, pre, c) for c in CLIS}
    post_f = {c: flags_at(repo, RENAME_COMMIT, c) for c in CLIS}
    for c in CLIS:
        # the only flag-set change between the tags outside ed62d0e2 is additions
        assert set(old[c]) <= set(pre_f[c]), (c, set(old[c]) - set(pre_f[c]))
        assert set(post_f[c]) == set(new[c]), (c, set(post_f[c]) ^ set(new[c]))

    check_code_evidence(repo)
    E = collect_evidence(repo)

    result, new_in = {}, {}
    origin = defaultdict(dict)
    for c in CLIS:
        O, N = old[c], new[c]
        # candidate -> kind -> [detail]
        cand = defaultdict(lambda: defaultdict(lambda: defaultdict(set)))
        for o, n in E["argparse"][c]:
            if o in O and n in N and o != n:
                cand[o][n]["argparse diff"].add(f"cli/{c}.py")
        for o, n, f in E["usage"]:
            ro, rn = resolve(o, O), resolve(n, N)
            if ro and rn and ro != rn and rn not in O:
                cand[ro][rn]["usage"].add(os.path.basename(f))
        for o, n, f, clis in E["script"]:
            if c in clis and o in O and n in N and n not in O:
                cand[o][n]["script"].add(os.path.basename(f))
        for o, n, f in E["readme"]:
            if o in O and n in N and n not in O:
                cand[o][n]["readme"].add(f)
        for o in O:
            if o in N:
                continue
            for n in N:
                if n not in O and name_match(o, n) and not attr_diff(O[o], N[n]):
                    cand[o][n]["name+attrs"].add("same spelling, same attrs")

        entries = {}
        for of, orec in O.items():
            man = MANUAL.get((c, of))
            if of in N and man is None:
                d = attr_diff(orec, N[of])
                e = dict(dotted=of, evidence="name unchanged", confidence="high")
                if d:
                    e["changes"] = {k: [orec.get(k), N[of].get(k)] for k in d}
                entries[of] = e
                continue
            votes = cand.get(of, {})
            if man is not None:
                choice = man["dotted"]
            elif votes:
                choice = max(votes, key=lambda n: (len(votes[n]), "argparse diff" in votes[n]))
            else:
                choice = None
            targets = ([choice] if choice else []) + (man.get("also", []) if man else [])
            detail, short = [], []
            kinds = set()
            for k in KIND_ORDER:
                files = set()
                for t in targets:
                    if k in votes.get(t, {}):
                        files |= votes[t][k]
                        where = ", ".join(sorted(votes[t][k]))
                        if k == "argparse diff":
                            detail.append(f"argparse diff --{of} -> --{t} ({where})")
                        elif k == "usage":
                            detail.append(f"args.{of} -> args.{t} in {where}")
                        elif k == "script":
                            detail.append(f"script line --{of} -> --{t} ({where})")
                        elif k == "readme":
                            detail.append(f"readme line --{of} -> --{t} ({where})")
                        else:
                            detail.append(f"same spelling and attrs as --{t}")
                if files:
                    kinds.add(k)
                    label = {"argparse diff": "argparse diff", "usage": "args.{} -> args.{}".format(of, choice),
                             "script": "script line", "readme": "readme line",
                             "name+attrs": "same spelling+attrs"}[k]
                    if k in ("usage", "script", "readme"):
                        label += f" ({len(files)} file{'s' if len(files) > 1 else ''})"
                    short.append(label)
            if man and man.get("code"):
                detail += code_evidence_text(man)
                kinds.add("code")
                short.append("code: " + ", ".join(sorted({os.path.basename(p) for _, p, _ in man["code"]})))
            conflicts = {n: sorted(k) for n, k in votes.items() if n not in targets}
            e = dict(dotted=choice)
            if choice is not None:
                d = attr_diff(orec, N[choice])
                if not d:
                    detail.append("same type/action/nargs/default/choices/help")
                    short.append("same type/default/help")
                else:
                    e["changes"] = {k: [orec.get(k), N[choice].get(k)] for k in d}
                    detail.append("same attrs except " + ", ".join(d))
                    short.append("same attrs except " + "/".join(d))
                strong = kinds & {"argparse diff", "usage", "script", "readme", "code"}
                if man is not None:
                    conf = "high" if strong else "low"
                else:
                    conf = "high" if strong and len(kinds) >= 2 and not conflicts else "low"
            else:
                n_uses = read_count(repo, pre, of)
                detail.insert(0, f"--{of} removed from cli/{c}.py by ed62d0e2 with no replacement option")
                detail.append(f"{n_uses} lines under openrlhf/ mention '{of}' besides its add_argument call (just before ed62d0e2)")
                short = ["removed in ed62d0e2, no replacement", f"{n_uses} readers before removal"]
                conf = "high" if man is not None and not votes else "low"
            if conflicts:
                detail.append("other candidates: " + "; ".join(f"{n} ({', '.join(k)})" for n, k in conflicts.items()))
                short.append("conflicting candidates: " + ", ".join(conflicts))
            if man:
                short.append("reviewed")
            e["evidence"] = "; ".join(short)
            e["confidence"] = conf
            if man and man.get("also"):
                e["also"] = man["also"]
            if man and man.get("note"):
                e["note"] = man["note"]
            e["evidence_detail"] = detail
            entries[of] = e
        result[c] = entries
        used = set()
        for e in entries.values():
            if e["dotted"]:
                used.add(e["dotted"])
            used.update(e.get("also", []))
        # the same v0.11.0 option claimed by two v0.9.10 flags?
        claims = defaultdict(list)
        for of, e in entries.items():
            if e["dotted"]:
                claims[e["dotted"]].append(of)
        for n, ofs in claims.items():
            if len(ofs) > 1:
                print(f"WARNING {c}: {n} claimed by {ofs}", file=sys.stderr)
        new_in[c] = [f for f in N if f not in used]
        # where do the options without a v0.9.10 counterpart come from?
        for f in new_in[c]:
            prev = [o for o, n in E["argparse"][c] if n == f and o in pre_f[c]]
            if prev:
                intro = [h for h in history if prev[0] in h.get("added", []) and h["cli"] == c]
                where = f"{intro[0]['commit'][:8]} ({intro[0]['subject']})" if intro else "?"
                origin[c][f] = f"added after v0.9.10 as --{prev[0]} in {where}; renamed by ed62d0e2"
            else:
                origin[c][f] = "added by ed62d0e2"
            if f.split(".")[-1] in NEW_NOTES:
                origin[c][f] += "; " + NEW_NOTES[f.split(".")[-1]]
            if N[f].get("dest"):
                origin[c][f] += f"; dest={N[f]['dest']} (negative switch of --{N[f]['dest']})"

    result["new_in_0.11"] = new_in
    meta = {
        "old_tag": OLD_TAG,
        "new_tag": NEW_TAG,
        "old_commit": git(repo, "rev-list", "-n1", OLD_TAG).strip(),
        "new_commit": git(repo, "rev-list", "-n1", NEW_TAG).strip(),
        "rename_commit": RENAME_COMMIT,
        "flag_changes_between_tags": history_summary(history),
        "new_in_0.11_origin": origin,
        "fields": {
            "dotted": "v0.11.0 option name, or null when the option was dropped",
            "also": "further v0.11.0 options that took over part of the old option (one flag split in several)",
            "changes": "attributes whose value differs between v0.9.10 and v0.11.0: [old, new]",
            "evidence": "short summary of the evidence kinds",
            "evidence_detail": "each piece of evidence with the files it was found in",
            "confidence": "high or low",
            "note": "hand-reviewed remark on semantics",
        },
    }
    with open(a.out, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2, ensure_ascii=False)
        fh.write("\n")
    meta_out = os.path.splitext(a.out)[0] + "_meta.json"
    with open(meta_out, "w", encoding="utf-8") as fh:
        json.dump(meta, fh, indent=2, ensure_ascii=False)
        fh.write("\n")
    print(f"wrote {a.out} and {meta_out}")
    for c in CLIS:
        e = result[c]
        same = sum(1 for k, v in e.items() if v["dotted"] == k)
        h = sum(1 for k, v in e.items() if v["dotted"] and v["dotted"] != k and v["confidence"] == "high")
        lo = sum(1 for v in e.values() if v["dotted"] and v["confidence"] == "low")
        dr = sum(1 for v in e.values() if v["dotted"] is None)
        print(f"{c:<15} v0.9.10={len(e):>4} unchanged={same:>3} renamed-high={h:>4} low={lo:>3} "
              f"dropped={dr:>3} new_in_0.11={len(new_in[c])}")


def read_count(repo, rev, name):
    """Lines under openrlhf/ at rev that mention name, other than add_argument lines."""
    try:
        out = git(repo, "grep", "-wn", name, rev, "--", "openrlhf")
    except subprocess.CalledProcessError:
        return 0
    return sum(1 for l in out.splitlines() if "add_argument" not in l)


def history_summary(history):
    out = []
    for h in history:
        if h["commit"] == RENAME_COMMIT:
            out.append(dict(commit=h["commit"], subject=h["subject"], cli=h["cli"],
                            removed=len(h["removed"]), added=len(h["added"]), note="the dotted rename"))
        else:
            out.append(h)
    return out


if __name__ == "__main__":
    main()
