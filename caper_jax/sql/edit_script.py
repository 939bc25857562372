"""Minimum-cost edit scripts between clause trees, and the root-cause node they point at.

sqlglot.diff (ChangeDistiller) is a heuristic and can return scripts longer than needed; we want
the *minimum* script, so we run exact tree edit distance (APTED, unit costs: delete 1, insert 1,
relabel 1 when labels differ) on the labelled trees of ``caper_jax.sql.canonical``. Those labels
carry the non-expression arguments of each node (DESC, join side/kind, DISTINCT, the operator
class, literal values, column and table names), so editing any of them costs one relabel. Trees
are one clause each (tens of nodes on Spider), where APTED's O(n^3) is cheap.

Root-cause rule (v*): among the source nodes the script touches -- relabelled nodes, deleted
nodes, and for an inserted node the source node its nearest mapped target ancestor corresponds to
(the place the insertion hangs from) -- v* is the first in pre-order. Pre-order puts a node
before its descendants and left before right, so v* is the highest, then leftmost, edited node:
one relabelled literal gives that literal; a wrong predicate that must be replaced whole gives the
predicate, not one of its leaves.
"""
from __future__ import annotations

import dataclasses

from apted import APTED, Config

from caper_jax.sql.canonical import LabelledNode


@dataclasses.dataclass(frozen=True)
class EditOp:
    op: str                 # "relabel" | "delete" | "insert"
    source: str | None      # label of the predicted node (None for an insertion)
    target: str | None      # label of the corrected node (None for a deletion)
    source_sql: str | None  # SQL of the predicted node's AST subtree, where there is one
    target_sql: str | None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class EditScript:
    cost: int
    ops: tuple[EditOp, ...]
    root_cause: LabelledNode | None     # v* in the source tree; None when the script is empty


class _LabelConfig(Config):
    def rename(self, node1: LabelledNode, node2: LabelledNode) -> int:
        return int(node1.label != node2.label)

    def children(self, node: LabelledNode) -> list[LabelledNode]:
        return node.children


def tree_edit_distance(source: LabelledNode, target: LabelledNode) -> int:
    return int(APTED(source, target, _LabelConfig()).compute_edit_distance())


def edit_script(source: LabelledNode, target: LabelledNode) -> EditScript:
    """Minimum-cost edit script turning ``source`` into ``target``, in source pre-order."""
    apted = APTED(source, target, _LabelConfig())
    cost = int(apted.compute_edit_distance())
    pairs = apted.compute_edit_mapping()
    to_source = {id(t): s for s, t in pairs if s is not None and t is not None}
    order = {id(n): i for i, n in enumerate(source.preorder())}
    target_order = {id(n): i for i, n in enumerate(target.preorder())}

    touched: list[tuple[int, LabelledNode]] = []
    ops: list[tuple[tuple[int, int], EditOp]] = []
    for s, t in pairs:
        if s is not None and t is not None:
            if s.label != t.label:
                touched.append((order[id(s)], s))
                ops.append(((order[id(s)], 0), EditOp("relabel", s.label, t.label, _sql(s), _sql(t))))
        elif s is not None:
            touched.append((order[id(s)], s))
            ops.append(((order[id(s)], 0), EditOp("delete", s.label, None, _sql(s), None)))
        else:
            anchor = _insertion_anchor(t, to_source)
            position = order[id(anchor)] if anchor is not None else 0
            if anchor is not None:
                touched.append((position, anchor))
            ops.append(((position, 1 + target_order[id(t)]), EditOp("insert", None, t.label, None, _sql(t))))
    ops.sort(key=lambda item: item[0])
    root = min(touched, key=lambda item: item[0])[1] if touched else None
    return EditScript(cost=cost, ops=tuple(op for _, op in ops), root_cause=root)


def _insertion_anchor(node: LabelledNode, to_source: dict[int, LabelledNode]) -> LabelledNode | None:
    parent = node.parent
    while parent is not None:
        if id(parent) in to_source:
            return to_source[id(parent)]
        parent = parent.parent
    return None


def _sql(node: LabelledNode) -> str | None:
    return node.node.sql(dialect="sqlite") if node.node is not None else None
