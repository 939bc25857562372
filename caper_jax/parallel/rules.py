"""Logical axis names → mesh axes, and creating NNX params already sharded.

Params carry *logical* axis names (``out_sharding`` metadata, e.g. ``("embed", "mlp")``); a config's
``rules`` — a list of ``(logical, mesh_axis | (mesh_axes...) | None)`` pairs — decide where each goes.
Changing the parallelism layout is then a config edit, never a model edit (the MaxText/t5x design).

Resolution rules, applied per parameter (see ``logical_to_spec``):
  * every logical name must appear in the rules (a typo is a ``LogicalAxisError``, not silent
    replication); ``None`` means "replicated";
  * a mesh axis shards at most one dimension of an array: if an earlier dimension already used it,
    the later dimension drops it (e.g. ``("embed", "embed")`` → ``P("fsdp", None)``);
  * given the array's shape and the mesh, mesh axes that do not divide a dimension are dropped from
    the right (e.g. 4 KV heads on an 8-way ``tensor`` axis stay replicated) — uneven shards would pad
    every collective, and a clear fallback beats a compile error deep inside XLA.

Params are created sharded: ``create_sharded`` runs the module constructor under ``nnx.eval_shape``
to learn shapes and names, then once more inside ``jax.jit(..., out_shardings=...)`` so each device
only ever materialises its own shard. Flax's *eager* sharding is switched off while constructing, so
the model can carry logical names that are not mesh axes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None
LogicalRules = Sequence[tuple[str, MeshAxes]]
M = TypeVar("M", bound=nnx.Module)

# Default layout (names as in docs/model.md): FSDP over `embed` for every weight matrix, tensor
# parallelism over attention heads / DeltaNet value heads / MLP features / vocab, batch over both
# data-parallel axes. The layer-stack, per-head-dim and conv-kernel axes stay replicated. `conv` (the
# concatenated [q | k | v] DeltaNet projection) is replicated over `tensor`: splitting it would cut
# across the q/k/v boundaries and make every layer re-gather it (FSDP still shards its `embed` dim).
# `act_*` names are activations (`with_sharding_constraint` inside the model).
DEFAULT_RULES: tuple[tuple[str, MeshAxes], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("v_heads", "tensor"),
    ("head_dim", None),
    ("conv", None),
    ("conv_kernel", None),
    ("layers", None),
    ("act_batch", ("data", "fsdp")),
    ("act_length", None),
    ("act_embed", None),
    ("act_mlp", "tensor"),
    ("act_heads", "tensor"),
    ("act_vocab", "tensor"),
)


class LogicalAxisError(ValueError):
    """A logical axis name that the rules do not map (or a malformed rule)."""


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def rules_dict(rules: LogicalRules) -> dict[str, tuple[str, ...]]:
    """Validates ``rules`` and returns ``{logical: (mesh axes...)}`` (the first rule for a name wins)."""
    table: dict[str, tuple[str, ...]] = {}
    for rule in rules:
        if len(rule) != 2 or not isinstance(rule[0], str):
            raise LogicalAxisError(f"a rule is (logical_name, mesh_axes | None), got {rule!r}")
        table.setdefault(rule[0], _as_tuple(rule[1]))
    return table


def logical_to_spec(
    logical_axes: Sequence[str | None] | None,
    rules: LogicalRules,
    *,
    shape: Sequence[int] | None = None,
    mesh: Mesh | None = None,
) -> PartitionSpec:
    """Maps one array's logical axis names to a PartitionSpec (resolution rules: module docstring)."""
    if not logical_axes:
        return PartitionSpec()
    if shape is not None and len(shape) != len(logical_axes):
        raise LogicalAxisError(f"logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
    table = rules_dict(rules)
    used: set[str] = set()
    spec: list[MeshAxes] = []
    for dim, name in enumerate(logical_axes):
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise LogicalAxisError(f"logical axis {name!r} has no rule; rules cover {sorted(table)}")
        axes = [a for a in table[name] if a not in used]
        if mesh is not None:
            unknown = [a for a in axes if a not in mesh.shape]
            if unknown:
                raise LogicalAxisError(f"rule {name!r} → {unknown} names axes missing from mesh {dict(mesh.shape)}")
            if shape is not None:
                while axes and shape[dim] % _product(mesh, axes):
                    axes.pop()
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*spec)


def _product(mesh: Mesh, axes: Sequence[str]) -> int:
    size = 1
    for axis in axes:
        size *= mesh.shape[axis]
    return size


def _variable_sharding(variable: nnx.Variable, mesh: Mesh, rules: LogicalRules) -> NamedSharding:
    names = variable.get_metadata().get("out_sharding")
    shape = getattr(variable.get_value(), "shape", None)
    return NamedSharding(mesh, logical_to_spec(names, rules, shape=shape, mesh=mesh))


def logical_to_sharding(tree: Any, mesh: Mesh, rules: LogicalRules) -> Any:
    """NamedShardings for every leaf of ``tree``, same structure (usable as jit in/out shardings).

    Leaves may be ``nnx.Variable`` (abstract or concrete; their ``out_sharding`` metadata holds the
    logical names — none means replicated), ``PartitionSpec`` of logical names, or plain arrays /
    ``ShapeDtypeStruct`` (replicated). An ``nnx.State`` comes back as a State of Variables holding
    NamedShardings, which jit accepts as a matching pytree.
    """

    def convert(leaf: Any) -> Any:
        if isinstance(leaf, nnx.Variable):
            return leaf.replace(_variable_sharding(leaf, mesh, rules))
        if isinstance(leaf, PartitionSpec):
            return NamedSharding(mesh, logical_to_spec(tuple(leaf), rules, mesh=mesh))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(convert, tree, is_leaf=lambda x: isinstance(x, (nnx.Variable, PartitionSpec)))


def abstract_state(
    init_fn: Callable[[], M], mesh: Mesh, rules: LogicalRules
) -> tuple[nnx.GraphDef[M], nnx.State]:
    """(graphdef, state of ShapeDtypeStructs carrying their target shardings) — no memory allocated."""
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(nnx.eval_shape(init_fn))
    shardings = logical_to_sharding(state, mesh, rules)
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
    )
    return graphdef, abstract


def abstract_train_state(
    init_fn: Callable[[], M], init_state: Callable[[nnx.State], Any], mesh: Mesh, rules: LogicalRules
) -> tuple[nnx.GraphDef[M], Any]:
    """(graphdef, train state of ShapeDtypeStructs with shardings): params plus whatever
    ``init_state(params)`` adds (optimizer moments follow their params' logical names). For dry runs."""
    graphdef, params = abstract_state(init_fn, mesh, rules)
    state = jax.eval_shape(init_state, params)
    shardings = logical_to_sharding(state, mesh, rules)
    return graphdef, jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)


def create_sharded(init_fn: Callable[[], M], mesh: Mesh, rules: LogicalRules) -> M:
    """Runs ``init_fn`` (builds an nnx.Module) under jit so its params come out already sharded."""
    graphdef, abstract = abstract_state(init_fn, mesh, rules)
    shardings = jax.tree.map(lambda x: x.sharding, abstract)

    def init() -> nnx.State:
        with nnx.use_eager_sharding(False):
            return nnx.state(init_fn())

    with jax.set_mesh(mesh):
        state = jax.jit(init, out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def shard_state(state: Any, mesh: Mesh, rules: LogicalRules) -> Any:
    """Moves an existing (e.g. host-loaded) state onto the mesh with its rule-derived shardings."""
    return jax.device_put(state, logical_to_sharding(state, mesh, rules))
