"""Column-/row-wise pairs, read off module structure — pure.

A row-wise Linear pairs with the column-wise Linears of its *scope*: they sit beside it under
one parent (attention, MLP), directly or inside a projection group (a module whose parameters are
all column-wise, e.g. a ``qkv`` module holding ``wq``/``wk``/``wv``). A scope also pairs across
parents, as Hugging Face's BERT is built: the column-wise ``attention.self.{query,key,value}``
(a projection group) and the row-wise ``attention.output.dense`` one level down in a sibling.

A pair's column-wise modules hand their local output to the row-wise ones. Their shared input is
marked once (the *prepare* point: the scope, or the projection group when the scope's input also
reaches other parameters), so backward reduces their input gradients once per pair.

Checked while planning, each a :class:`PlanError` naming the modules:

- a Linear beside the pair's column-wise ones left replicated (``wq`` sharded, ``wk``/``wv``
  not): ranks would hold different heads of q than of k and v;
- a column-wise output wider than the row-wise partner's input: a fused projection (``c_attn``
  packing q, k and v; ``gate_up_proj``), where each rank would hold a slice across the packed
  projections instead of whole heads of each, or a row-wise Linear that cannot consume it.

Example:
    >>> from meshtrain.plan.ir import ModuleStyle
    >>> mlp = nn.ModuleDict({"up": nn.Linear(4, 8), "down": nn.Linear(8, 4)})
    >>> raw = {"up": ModuleStyle("up", "Linear", "colwise", "tp"),
    ...        "down": ModuleStyle("down", "Linear", "rowwise", "tp")}
    >>> find_pairs(raw, dict(mlp.named_modules()))[0]
    (Pair(scope='', prepare='', colwise=('up',), rowwise=('down',)),)
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from meshtrain.errors import PlanError
from meshtrain.plan.ir import ModuleStyle, TPStyle
from meshtrain.plan.layers import is_linear_like, linear_widths


@dataclass(frozen=True)
class Pair:
    """Column-wise modules feeding row-wise ones; ``prepare`` marks their shared input (None:
    each column-wise module marks its own)."""

    scope: str
    prepare: str | None
    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]


def find_pairs(
    raw: dict[str, ModuleStyle], modules: dict[str, nn.Module]
) -> tuple[tuple[Pair, ...], tuple[str, ...]]:
    """The pairs, and the column-wise modules in none (in module order)."""
    rowwise = [f for f, s in raw.items() if s.style == TPStyle.ROWWISE]
    rowwise_parents = {_parent(f) for f in rowwise}
    scopes: dict[str, list[str]] = {}
    for fqn, style in raw.items():
        if style.style == TPStyle.COLWISE:
            scopes.setdefault(_pair_scope(fqn, rowwise_parents, modules, raw), []).append(fqn)
    colwise_parents = {_parent(f) for f, s in raw.items() if s.style == TPStyle.COLWISE}
    pairs, unpaired = [], []
    for scope, colwise in scopes.items():
        direct = [r for r in rowwise if _parent(r) == scope]
        # one level down, in a sibling that holds no column-wise module (BERT's attention.output)
        cross = [
            r
            for r in rowwise
            if _parent(_parent(r)) == scope
            and _parent(r) not in scopes
            and not any(p == _parent(r) or p.startswith(_parent(r) + ".") for p in colwise_parents)
        ]
        partners = direct or cross
        if not partners:
            unpaired += colwise
            continue
        prepare = _prepare_point(scope, colwise, modules, raw, cross=not direct)
        pair = Pair(scope, prepare, tuple(colwise), tuple(partners))
        _check_siblings(pair, modules, raw)
        _check_fused(pair, modules)
        pairs.append(pair)
    order = list(modules).index
    return tuple(sorted(pairs, key=lambda p: order(p.scope))), tuple(sorted(unpaired, key=order))


def _parent(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def _pair_scope(
    fqn: str, rowwise_parents: set[str], modules: dict[str, nn.Module], raw: dict[str, ModuleStyle]
) -> str:
    """The parent a column-wise module pairs under: its own parent, or the first ancestor above
    a chain of projection groups (modules whose parameters are all column-wise)."""
    scope = _parent(fqn)
    while scope and scope not in rowwise_parents and is_projection_group(scope, modules, raw):
        scope = _parent(scope)
    return scope


def is_projection_group(
    fqn: str, modules: dict[str, nn.Module], raw: dict[str, ModuleStyle]
) -> bool:
    """Every module under ``fqn`` that holds parameters is column-wise (and there is one)."""
    holders = [
        name
        for name, module in modules[fqn].named_modules(prefix=fqn)
        if any(True for _ in module.parameters(recurse=False))
    ]
    return bool(holders) and all(
        name in raw and raw[name].style == TPStyle.COLWISE for name in holders
    )


def untouched_consumers(
    parent: str, modules: dict[str, nn.Module], raw: dict[str, ModuleStyle]
) -> list[str]:
    """Parameters of ``parent`` (its own, or of direct children other than projection groups)
    without a tensor-parallel style: they would receive the parent's input as a DTensor if the
    parent marked it."""
    module = modules[parent]
    found = [
        f"{parent}.{name}" if parent else name for name, _ in module.named_parameters(recurse=False)
    ]
    for name, child in module.named_children():
        fqn = f"{parent}.{name}" if parent else name
        if (
            fqn not in raw
            and any(True for _ in child.parameters())
            and not is_projection_group(fqn, modules, raw)
        ):
            found.append(fqn)
    return found


def _prepare_point(
    scope: str,
    colwise: list[str],
    modules: dict[str, nn.Module],
    raw: dict[str, ModuleStyle],
    *,
    cross: bool,
) -> str | None:
    """Where the pair's shared input is marked: the scope when nothing else there reads it,
    else the one projection group under the scope that holds every column-wise module (None
    when there is none: each column-wise module marks its own input)."""
    others = [
        f
        for f in untouched_consumers(scope, modules, raw)
        if not _narrow(modules.get(f), colwise, modules)
    ]
    if not cross and not others:
        return scope
    children = {_child_of(scope, fqn) for fqn in colwise}
    if len(children) == 1:
        child = children.pop()
        if child not in colwise and is_projection_group(child, modules, raw):
            return child
    return None


def _narrow(module: nn.Module | None, colwise: list[str], modules: dict[str, nn.Module]) -> bool:
    """A module whose parameters are all narrower than the pair's input (Qwen3's per-head
    ``q_norm``, a per-head scale): it cannot take the scope's input, only what the column-wise
    Linears make of it (per-head features; the abstract run checks that it never reads the
    marked input, and finds its partial gradient)."""
    if module is None:
        return False
    widths = {w[0] for f in colwise if (w := linear_widths(modules[f])) is not None}
    sizes = [p.shape[-1] for p in module.parameters()]
    return bool(widths) and bool(sizes) and all(n != 1 and n not in widths for n in sizes)


def _child_of(scope: str, fqn: str) -> str:
    """The child of ``scope`` that ``fqn`` lies in (``fqn`` itself when a direct child)."""
    head = (fqn[len(scope) + 1 :] if scope else fqn).split(".")[0]
    return f"{scope}.{head}" if scope else head


def _check_siblings(pair: Pair, modules: dict[str, nn.Module], raw: dict[str, ModuleStyle]) -> None:
    """Every Linear beside a pair's column-wise modules is column-wise too."""
    for fqn in pair.colwise:
        parent = _parent(fqn)
        for name, child in modules[parent].named_children():
            sibling = f"{parent}.{name}" if parent else name
            if sibling in raw or not is_linear_like(child) or sibling in pair.rowwise:
                continue
            raise PlanError(
                f"'{fqn}' is column-wise and '{pair.rowwise[0]}' row-wise (a tensor-parallel pair "
                f"under '{pair.scope}'), but '{sibling}' beside '{fqn}' is replicated: ranks would "
                f"hold a shard of {fqn.rpartition('.')[2]}'s heads or features and all of "
                f"{name}'s, and the attention or product between them would be wrong. Shard "
                f"'{sibling}.weight' column-wise too, or replicate the pair.",
                fqn=f"{sibling}.weight",
            )


def _check_fused(pair: Pair, modules: dict[str, nn.Module]) -> None:
    """A column-wise output wider than its row-wise partner's input: a fused projection, or a
    row-wise Linear that does not consume it."""
    inner = min(w[0] for r in pair.rowwise if (w := linear_widths(modules[r])) is not None)
    for fqn in pair.colwise:
        widths = linear_widths(modules[fqn])
        if widths is None or widths[1] <= inner:
            continue
        raise PlanError(
            f"'{fqn}' ({type(modules[fqn]).__name__}) outputs {widths[1]} features but its "
            f"row-wise tensor-parallel partner '{pair.rowwise[0]}' takes {inner} "
            f"({widths[1] / inner:g} ×): either '{fqn}' packs several projections into one "
            "output (q, k and v; gate and up) — sharded column-wise, each rank would hold a slice "
            "across them instead of whole heads of each — or the row-wise Linear does not consume "
            f"its output. Replicate '{fqn}' (P()) or build the model with separate projections; "
            "shard row-wise only the Linear that consumes the column-wise outputs.",
            fqn=f"{fqn}.weight",
        )
