"""Auto-wrap: which submodules become units. Shared by both backends and by `plan` (one copy of the logic)."""
from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from shardtune.errors import UserError


def resolve_unit_classes(model: nn.Module, wrap: str | Sequence[str] | int) -> tuple[type[nn.Module], ...]:
    """'auto' -> the decoder-block classes HF names in `_no_split_modules`; a list -> those class names.

    An int (minimum unit size in params) returns () and is handled by `find_units`.
    """
    if isinstance(wrap, int) and not isinstance(wrap, bool):
        return ()
    if wrap == "auto":
        names = _no_split_modules(model)
        if not names:
            raise UserError("engine.wrap: auto found no _no_split_modules on this model: "
                            "name the block class, e.g. engine.wrap=[LlamaDecoderLayer]")
    else:
        names = list(wrap)
    by_name = {type(m).__name__: type(m) for m in model.modules()}
    missing = [n for n in names if n not in by_name]
    found = tuple(by_name[n] for n in names if n in by_name)
    if wrap != "auto" and missing:
        raise UserError(f"engine.wrap: class(es) {missing} not in the model: choose from "
                        f"{sorted({n for n in by_name if n.endswith(('Layer', 'Block'))}) or sorted(by_name)[:10]}")
    if not found:
        raise UserError(f"engine.wrap: none of {names} occurs in the model: name the block class explicitly")
    return found


def _no_split_modules(model: nn.Module) -> list[str]:
    for m in model.modules():  # peft wraps the HF model; the first module that declares it wins
        names = getattr(m, "_no_split_modules", None)
        if names:
            return list(names)
    return []


def find_units(model: nn.Module, unit_classes: tuple[type[nn.Module], ...],
               min_unit_params: int | None = None) -> list[nn.Module]:
    """Units in forward order (module registration order), not nested; the root unit is not included.

    With `unit_classes`, every instance is a unit. Otherwise every maximal child subtree whose parameter count
    reaches `min_unit_params` is one (a greedy policy like FSDP's size_based_auto_wrap_policy).
    """
    if unit_classes:
        units: list[nn.Module] = []
        _collect(model, unit_classes, units, is_root=True)
        return units
    assert min_unit_params is not None and min_unit_params > 0
    units = []
    _collect_by_size(model, min_unit_params, units)
    return [u for u in units if u is not model]


def _collect(module: nn.Module, classes: tuple[type[nn.Module], ...], out: list[nn.Module], is_root: bool) -> None:
    if not is_root and isinstance(module, classes):
        out.append(module)
        return  # no nested units inside a unit
    for child in module.children():
        _collect(child, classes, out, is_root=False)


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _collect_by_size(module: nn.Module, min_params: int, out: list[nn.Module]) -> None:
    for child in module.children():
        n = _numel(child)
        if n == 0:
            continue
        big_children = [c for c in child.children() if _numel(c) >= min_params]
        if n >= min_params and not big_children:
            out.append(child)
        else:
            _collect_by_size(child, min_params, out)
