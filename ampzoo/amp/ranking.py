"""The ranking behind `python -m amp.search`: which compute units to keep in fp32 first, the keep-list that names
exactly a set of units, and the bisection over how many to keep. No training here: amp/search/command.py runs the
candidates and judges them."""
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from ampzoo.amp.names import portable, resolve, split_keep
from ampzoo.amp.policy import check_paths
from ampzoo.amp.precision import units as unit_cells
from ampzoo.errors import ConfigError

# Cells that only select or move values, exact in any dtype (by the class a keep-list names: CpuMaxPool2x2 is MaxPool2d)
EXACT = ("ReLU", "ReLU6", "MaxPool1d", "MaxPool2d", "MaxPool3d", "Flatten", "Dropout", "Identity")
TIERS = ("overflow", "constant", "error", "underflow")  # the audit's flags, most serious first


@dataclass
class Unit:
    path: str
    cls: str
    params: int
    flops: int
    flags: List[str]
    local_rel_err: float


@dataclass
class Candidate:
    k: int                      # the first k ranked units in fp32 (and search.pin_fp32)
    kept: List[str]             # unit paths in fp32
    keep_fp32: List[str]        # the same as a keep-list: class names where a whole class is kept, else paths
    low_params: float           # share of parameters in low precision
    low_flops: float            # share of FLOPs in low precision
    runs: Dict[str, dict] = field(default_factory=dict)  # seed -> run record
    verdict: str = ""           # "within", "outside", "diverged"
    delta: Optional[float] = None
    reason: str = ""            # why a diverged candidate diverged (train.py's error line)


def rank(units: List[Unit]) -> List[Unit]:
    def key(u: Unit):
        tier = next((i for i, t in enumerate(TIERS) if t in u.flags), len(TIERS))
        return tier, -u.local_rel_err
    return sorted((u for u in units if portable(u.cls) not in EXACT), key=key)


def matching(names: List[str], units: List[Unit], net, key: str) -> List[str]:
    """Unit paths a keep-list names (Cell classes: every instance; paths: that sub-module and below)."""
    classes, paths = split_keep(list(names))
    cells = dict(unit_cells(net))
    check_paths(net, paths, key)
    resolved = resolve(classes, key)
    for cls in resolved:
        if not any(isinstance(cells[u.path], cls) for u in units):
            raise ConfigError(f"{key}: {cls.__name__} matches no compute unit of {type(net).__name__}; its classes: "
                              f"{', '.join(sorted({u.cls for u in units}))}")
    return [u.path for u in units
            if isinstance(cells[u.path], resolved) or any(u.path == p or u.path.startswith(p + ".") for p in paths)]


def keep_list(kept: List[str], units: List[Unit], net) -> List[str]:
    """The shortest keep-list for exactly these units: a class name where every unit of that class is kept,
    a sub-module path where every unit below it is, the unit's own path otherwise. A class a network builds on
    some devices only (CpuConv2d) goes by the class that matches it on every device (Conv2d)."""
    cells, left, out = dict(unit_cells(net)), [u.path for u in units if u.path in kept], []
    for cls in dict.fromkeys(portable(type(cells[p])) for p in left):
        try:
            resolved = resolve([cls], "keep")
        except ConfigError:
            continue  # not a nameable class (a model's private Cell): named by path below
        members = [u.path for u in units if isinstance(cells[u.path], resolved)]
        if all(m in kept for m in members):
            out.append(cls)
            left = [p for p in left if p not in members]
    for path in sorted({".".join(p.split(".")[:i]) for p in left for i in range(1, p.count(".") + 1)},
                       key=lambda a: a.count(".")):
        below = [u.path for u in units if u.path.startswith(path + ".")]
        if below and all(b in kept for b in below) and all(b in left for b in below):
            out.append(path)
            left = [p for p in left if p not in below]
    return out + left


def candidate(k: int, ranked: List[Unit], pinned: List[str], units: List[Unit], net) -> Candidate:
    kept = sorted(set(pinned) | {u.path for u in ranked[:k]}, key=[u.path for u in units].index)
    low = [u for u in units if u.path not in kept]
    def share(attr: str) -> float:  # the part of the network's `attr` (params, flops) the low-precision units hold
        return sum(getattr(u, attr) for u in low) / max(sum(getattr(u, attr) for u in units), 1)
    return Candidate(k, kept, keep_list(kept, units, net), share("params"), share("flops"))


def bisect(n: int, passes: Callable[[int], bool]) -> Optional[int]:
    """The smallest k in 0..n with passes(k), assuming passes is monotone; None if not even n passes."""
    if passes(0):
        return 0
    if n == 0 or not passes(n):
        return None
    lo, hi = 0, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if passes(mid) else (mid, hi)
    return hi
