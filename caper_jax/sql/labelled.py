"""Labelled trees: the surface-free form of a query that comparisons and edit scripts work on.

``label_tree(node)`` returns a tree of ``LabelledNode``: one node per sqlglot expression, with the
expression's non-expression arguments (DESC, join side/kind, operator class, literal value,
identifier names) in its label, so that an edit of any of them has a cost. The order-free parts are
put in a fixed order: AND/OR chains are flattened and sorted, ``=``/``<>`` operands are sorted,
``a > b`` and ``b < a`` meet, redundant parentheses disappear, and a FROM clause made only of
inner/cross joins becomes the sorted set of its tables plus the sorted conjunction of all its ON
conditions. ``canonical_key`` of two clause trees is equal iff they differ only on the surface.

Its own module, below ``canonical`` and ``equivalences``: the equivalence rules compare subtrees by
their keys, and canonicalisation applies the rules, so both import this and neither the other.
``caper_jax.sql.canonical`` re-exports every public name here.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Sequence

from sqlglot import exp

from caper_jax.sql.clauses import compound_name
from caper_jax.sql.contract import CLAUSE_NAMES

# Clause names in written order; compound queries name their operator parts (see clause_slots).
SELECT, FROM, WHERE, GROUP_BY, HAVING, ORDER_BY, LIMIT = CLAUSE_NAMES
SLOT_ARGS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (SELECT, ("distinct", "expressions")),
    (FROM, ("from_", "joins")),
    (WHERE, ("where",)),
    (GROUP_BY, ("group",)),
    (HAVING, ("having",)),
    (ORDER_BY, ("order",)),
    (LIMIT, ("limit", "offset")),
)


@dataclasses.dataclass(frozen=True)
class ClauseSlot:
    """One clause of a query: its name and the AST nodes that make it up, in written order."""
    name: str
    nodes: tuple[exp.Expression, ...]


def clause_slots(tree: exp.Expression) -> list[ClauseSlot]:
    """The clauses of a query in written order.

    Names and order follow ``caper_jax.sql.clauses.split_clauses``: a leading CTE list is "WITH";
    a compound query ``A UNION B`` is its left part's clauses, then one unit named after the
    operator ("UNION", "UNION ALL", "INTERSECT", "EXCEPT") whose node is the whole right part, then
    the ORDER BY / LIMIT that apply to the compound result. Nested queries stay inside the clause
    that contains them.
    """
    if isinstance(tree, exp.Subquery):
        tree = tree.this
    with_ = [ClauseSlot("WITH", (tree.args["with_"],))] if tree.args.get("with_") else []
    if isinstance(tree, exp.SetOperation):
        slots = with_ + clause_slots(tree.this) + [ClauseSlot(compound_name(tree), (tree.expression,))]
        for slot_name, args in SLOT_ARGS[-2:]:
            nodes = _slot_nodes(tree, args)
            if nodes:
                slots.append(ClauseSlot(slot_name, nodes))
        return slots
    slots = with_
    for name, args in SLOT_ARGS:
        nodes = _slot_nodes(tree, args)
        if nodes:
            slots.append(ClauseSlot(name, nodes))
    return slots


def _slot_nodes(tree: exp.Expression, args: Sequence[str]) -> tuple[exp.Expression, ...]:
    nodes: list[exp.Expression] = []
    for arg in args:
        value = tree.args.get(arg)
        if isinstance(value, list):
            nodes.extend(v for v in value if isinstance(v, exp.Expression))
        elif isinstance(value, exp.Expression):
            nodes.append(value)
    return tuple(nodes)


# --------------------------------------------------------------------------------------------
# Labelled trees: the surface-free form that comparisons and edit scripts work on.

@dataclasses.dataclass(eq=False)
class LabelledNode:
    label: str
    children: list["LabelledNode"]
    node: exp.Expression | None          # the AST node it stands for (None for synthetic nodes)
    parent: "LabelledNode | None" = None

    def preorder(self) -> Iterator["LabelledNode"]:
        yield self
        for child in self.children:
            yield from child.preorder()

    def key(self) -> tuple:
        return (self.label, tuple(c.key() for c in self.children))

    def size(self) -> int:
        return sum(1 for _ in self.preorder())


_SYMMETRIC = (exp.EQ, exp.NEQ, exp.NullSafeEQ, exp.NullSafeNEQ)
_FLIPPED = {exp.GT: exp.LT, exp.LT: exp.GT, exp.GTE: exp.LTE, exp.LTE: exp.GTE}
_INNER_KINDS = {"", "INNER", "CROSS"}


def label_tree(node: exp.Expression) -> LabelledNode:
    """Labelled tree of an AST node (queries get one child per clause, see clause_slots)."""
    root = _label(node)
    _link_parents(root)
    return root


def clause_tree(slot: ClauseSlot) -> LabelledNode:
    """Labelled tree of one clause: a synthetic root named after the clause over its nodes."""
    root = _clause_label(slot)
    _link_parents(root)
    return root


def canonical_key(node: exp.Expression | ClauseSlot, *, qualifiers: bool = True) -> tuple:
    """Equal for two clauses (or nodes) iff they differ only on the surface.

    ``qualifiers=False`` also ignores which table a column is read from: comparing SELECT this way
    tells a wrong column from a right column whose table the (later) FROM clause got wrong.
    """
    key = (clause_tree(node) if isinstance(node, ClauseSlot) else label_tree(node)).key()
    return key if qualifiers else _without_qualifiers(key)


_QUALIFIER = re.compile(r"(?<=[\[,])table=[^,\]]*,?")


def _without_qualifiers(key: tuple) -> tuple:
    label, children = key
    if label.startswith("Column["):
        label = _QUALIFIER.sub("", label).replace(",]", "]").replace("[]", "")
    return (label, tuple(_without_qualifiers(c) for c in children))


def _link_parents(root: LabelledNode) -> None:
    for n in root.preorder():
        for c in n.children:
            c.parent = n


def _clause_label(slot: ClauseSlot) -> LabelledNode:
    if slot.name == FROM:
        inner = [n for n in slot.nodes[1:] if isinstance(n, exp.Join)]
        if len(inner) == len(slot.nodes) - 1 and all(_is_inner(j) for j in inner):
            tables = [_label(slot.nodes[0].this if isinstance(slot.nodes[0], exp.From) else slot.nodes[0])]
            tables += [_label(j.this) for j in inner]
            conditions = [c for j in inner if j.args.get("on") for c in _flatten(j.args["on"], exp.And)]
            children = sorted(tables, key=LabelledNode.key)
            if conditions:
                children.append(_nary("And", conditions, None))
            return LabelledNode(FROM, children, None)
    return LabelledNode(slot.name, [_label(n) for n in slot.nodes], None)


def _is_inner(join: exp.Join) -> bool:
    return (not join.args.get("side") and (join.args.get("kind") or "").upper() in _INNER_KINDS
            and not join.args.get("using"))


def _flatten(node: exp.Expression, kind: type[exp.Expression]) -> list[exp.Expression]:
    node = _unparen(node)
    if isinstance(node, kind):
        return _flatten(node.this, kind) + _flatten(node.expression, kind)
    return [node]


def _unparen(node: exp.Expression) -> exp.Expression:
    while isinstance(node, exp.Paren) and not isinstance(node.this, exp.Query):
        node = node.this
    return node


def _nary(label: str, operands: list[exp.Expression], node: exp.Expression | None) -> LabelledNode:
    return LabelledNode(label, sorted((_label(o) for o in operands), key=LabelledNode.key), node)


def _label(node: exp.Expression) -> LabelledNode:
    node = _unparen(node)
    if isinstance(node, (exp.And, exp.Or)):
        return _nary(type(node).__name__, _flatten(node, type(node)), node)
    if isinstance(node, exp.Select) or (isinstance(node, exp.SetOperation) and node.args.get("order")):
        return LabelledNode(_own_label(node), [_clause_label(s) for s in clause_slots(node)], node)
    if isinstance(node, _SYMMETRIC):
        return _nary(type(node).__name__, [node.this, node.expression], node)
    if type(node) in _FLIPPED:
        left, right = _label(node.this), _label(node.expression)
        if right.key() < left.key():    # b < a  ==  a > b
            return LabelledNode(_FLIPPED[type(node)].__name__, [right, left], node)
        return LabelledNode(type(node).__name__, [left, right], node)
    children = [_label(c) for c in _child_expressions(node)]
    return LabelledNode(_own_label(node), children, node)


def _child_expressions(node: exp.Expression) -> list[exp.Expression]:
    out = []
    for key, value in node.args.items():
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, exp.Expression) and not _folded(node, key, v):
                out.append(v)
    return out


def _folded(parent: exp.Expression, key: str, value: exp.Expression) -> bool:
    """Identifiers and plain table aliases are part of their parent's label, not nodes."""
    if isinstance(value, exp.Identifier):
        return True
    return isinstance(value, exp.TableAlias) and not value.args.get("columns")


def _own_label(node: exp.Expression) -> str:
    if isinstance(node, exp.Literal):
        return f"Literal:{node.this!r}" if node.is_string else f"Literal:{_number(node.this)}"
    if isinstance(node, exp.Identifier):
        return f"Identifier:{node.name}"
    parts = []
    for key, value in sorted(node.args.items()):
        if isinstance(node, exp.Ordered) and key == "nulls_first":
            # SQLite sorts NULLs first ascending, last descending; only a deviation is written.
            if bool(value) != (not node.args.get("desc")):
                parts.append(f"nulls_first={bool(value)}")
            continue
        if isinstance(value, exp.Identifier):
            parts.append(f"{key}={value.name}")
        elif isinstance(value, exp.TableAlias) and not value.args.get("columns"):
            if not (isinstance(node, exp.Table) and value.name == node.name):
                parts.append(f"{key}={value.name}")
        elif isinstance(value, bool):
            if value and key not in ("big_int",):
                parts.append(key)
        elif isinstance(value, (str, int, float)) and value != "":
            parts.append(f"{key}={str(value).upper() if key in ('side', 'kind') else value}")
    if isinstance(node, exp.Anonymous):
        parts = [p.lower() for p in parts]
    name = type(node).__name__
    return f"{name}[{','.join(parts)}]" if parts else name


def _number(text: str) -> str:
    try:
        value = float(text)
    except ValueError:
        return text
    return repr(int(value)) if value.is_integer() and "e" not in text.lower() else repr(value)


def query_tree(tree: exp.Expression) -> LabelledNode:
    """Labelled tree of a whole query: a root over one synthetic node per clause (clause_slots)."""
    root = LabelledNode("Query", [_clause_label(s) for s in clause_slots(tree)], tree)
    _link_parents(root)
    return root


def find_labelled(root: LabelledNode, node: exp.Expression) -> LabelledNode | None:
    """The labelled node standing for ``node``, or for its nearest ancestor that has one.

    Parentheses, identifiers and the inner links of an AND/OR chain have no labelled node of their
    own; they resolve to the node that absorbed them.
    """
    by_id = {id(n.node): n for n in root.preorder() if n.node is not None}
    while node is not None:
        if id(node) in by_id:
            return by_id[id(node)]
        node = node.parent
    return None
