"""Refuses EBNF grammars a sequence could get stuck in: every rule reachable from `root` must derive some finite
string (`root ::= root` derives none, so its mask would allow no token at all). Read from xgrammar's own
parse of the grammar (`Grammar.serialize_json`: rules, and expressions in CSR form)."""

from __future__ import annotations

import json

from engines.structured import InvalidConstraint, StructuredOutput

# xgrammar 0.2.9's GrammarExprType (cpp/grammar_impl.h); each expression is [type, length, data...]
_BYTES, _CLASS, _CLASS_STAR, _EMPTY, _RULE_REF, _SEQUENCE, _CHOICES, _TAG_DISPATCH, _REPEAT = range(9)


def require_finite_derivation(so: StructuredOutput) -> None:
    """InvalidConstraint naming `so.param` when a grammar's rule reachable from root has no finite derivation."""
    if so.kind != "grammar":
        return
    import xgrammar as xgr

    try:
        data = json.loads(xgr.Grammar.from_ebnf(so.spec).serialize_json())
    except Exception as e:  # xgrammar's parser names the syntax error
        raise InvalidConstraint(so.param, f"{so.param} cannot be compiled: {e}") from None
    names = [r[0] for r in data["rules"]]
    bodies = [r[1] for r in data["rules"]]
    flat, indptr = data["grammar_expr_data"], data["grammar_expr_indptr"]

    def expr(i: int) -> tuple[int, list[int]]:  # indptr holds each expression's start
        e = flat[indptr[i]:indptr[i + 1] if i + 1 < len(indptr) else len(flat)]
        return e[0], e[2:]

    productive = [False] * len(names)

    def derives(i: int) -> bool:
        kind, args = expr(i)
        if kind in (_BYTES, _CLASS_STAR, _EMPTY, _TAG_DISPATCH):
            return True
        if kind == _CLASS:  # [negated, lo, hi, ...]: empty only when not negated and without ranges
            return bool(args[0]) or len(args) > 1
        if kind == _RULE_REF:
            return productive[args[0]]
        if kind == _SEQUENCE:
            return all(derives(a) for a in args)
        if kind == _CHOICES:
            return any(derives(a) for a in args)
        if kind == _REPEAT:  # [rule, min, max]
            return args[1] == 0 or productive[args[0]]
        return True  # an expression type this check does not know: leave it to the compiler

    changed = True
    while changed:  # the least fixpoint: a rule derives a string when its body does with what is known
        changed = False
        for r, body in enumerate(bodies):
            if not productive[r] and derives(body):
                productive[r] = changed = True
    reachable, todo = set(), [data["root_rule_id"]]
    while todo:
        r = todo.pop()
        if r in reachable:
            continue
        reachable.add(r)
        todo.extend(_refs(expr, bodies[r]))
    dead = sorted(names[r] for r in reachable if not productive[r])
    if dead:
        raise InvalidConstraint(so.param, f"{so.param}: rule {dead[0]!r} derives no finite string (every "
                                "alternative refers back to itself), so no output could ever complete it")


def _refs(expr, i: int) -> list[int]:
    """The rules expression `i` refers to."""
    kind, args = expr(i)
    if kind == _RULE_REF:
        return [args[0]]
    if kind == _REPEAT:
        return [args[0]]
    if kind in (_SEQUENCE, _CHOICES):
        return [r for a in args for r in _refs(expr, a)]
    return []
