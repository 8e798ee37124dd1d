"""Packed documents and sliding windows under context parallelism: the spec every method takes, the mask of
a block of positions, the work each rank does, and the ``--docs`` flag of the studies.

    distlab run --nproc 4 -m distlab.cp.ring --seq 8192 --docs lognormal:mean=1024,seed=0 --window 512 --check

``cu_seqlens`` holds global document boundaries ``[0, l1, l1+l2, ..., T]`` of a packed batch (the same on
every rank; zero-length documents are allowed and hold no token). Token i sees key j iff both lie in one
document, ``j <= i`` when causal, and ``i - j <= window`` when a window is given (causal only). Every CP
method turns that into per-block ``distlab.kernels.masks.KeyMask`` intervals over global positions, so the
same rule holds whatever layout put the tokens where.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import torch

from distlab import comm
from distlab.kernels.masks import KeyMask, check_cu_seqlens, check_window, document_mask
from distlab.lru import kept


@dataclasses.dataclass(frozen=True)
class Documents:
    """The mask of a packed sequence of ``total`` tokens (validated: see ``from_args``)."""

    total: int
    cu_seqlens: torch.Tensor | None = None   # int64 on CPU
    causal: bool = False
    window: int | None = None

    @classmethod
    def from_args(cls, total: int, cu_seqlens=None, causal=False, window=None) -> "Documents":
        cu = check_cu_seqlens(cu_seqlens, total) if cu_seqlens is not None else None
        return cls(total, cu, bool(causal), check_window(window, causal))

    @property
    def masked(self) -> bool:
        """Anything beyond plain causal / full attention over one sequence."""
        return self.cu_seqlens is not None or self.window is not None

    def mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor, device=None) -> KeyMask:
        m = document_mask(q_pos, k_pos, self.cu_seqlens, self.causal, self.window, self.total)
        return m.to(device) if device is not None else m

    def work(self, q_pos: torch.Tensor, k_pos: torch.Tensor | None = None) -> int:
        """Visible (query, key) pairs of queries ``q_pos`` against keys ``k_pos`` (default: every key)."""
        k_pos = torch.arange(self.total) if k_pos is None else k_pos
        return self.mask(q_pos, k_pos).visible_pairs()

    def lengths(self) -> list[int]:
        cu = self.cu_seqlens if self.cu_seqlens is not None else torch.tensor([0, self.total])
        return (cu[1:] - cu[:-1]).tolist()


LAYOUTS = ("contiguous", "zigzag", "balanced")

PLAN_CACHE_SIZE = 32
_PLANS: collections.OrderedDict = collections.OrderedDict()


def cached_plan(what: str, docs: Documents, *key, build):
    """``build()``, once per method ``what``, pack and ``key`` (world, rank, layout, device, ...): the masks and
    block lists a CP method derives from a pack cost milliseconds of host time (64k tokens, W=8: ~12 ms for
    a ring rank's blocks), and every layer of a model, every step on the same pack, asks again. The last
    ``PLAN_CACHE_SIZE`` plans are kept; a kept mask keeps its kernels' tile tables (``KeyMask.memo``) too."""
    cu = None if docs.cu_seqlens is None else tuple(docs.cu_seqlens.tolist())
    k = (what, docs.total, docs.causal, docs.window, cu, *key)
    return kept(_PLANS, k, build, PLAN_CACHE_SIZE)


def check_call_everywhere(what: str, group, q, k, v, causal=False, layout="contiguous", cu_seqlens=None,
                          window=None) -> None:
    """The first thing a CP method does: raise the same ValueError on every rank of ``group`` unless every
    rank was given q, k, v of one shape and dtype, and the same causal flag, layout, window and
    ``cu_seqlens`` (``comm.check_same_on_every_rank``: one small all-gather the first time these inputs are
    seen, none after). Everything a method checks afterwards is then the same question on every rank, so
    its ValueError is raised everywhere or nowhere, before any exchange."""
    try:
        cu = torch.as_tensor(cu_seqlens).reshape(-1).to(torch.int64) if cu_seqlens is not None else torch.tensor([-1])
        weights = torch.arange(1, cu.numel() + 1, dtype=torch.int64)
        digest = (int((cu * weights).sum()) % (2**61 - 1), cu.numel())
    except (TypeError, ValueError, RuntimeError):
        digest = (-2, -2)
    win = -1 if window is None else (int(window) if isinstance(window, int) else -2)
    extra = (int(bool(causal)), LAYOUTS.index(layout) if layout in LAYOUTS else -1, win, *digest)

    def describe(values):
        c, lay, w, dig, n = values[-5:]
        return (f"q, k, v {comm.describe_signature(values[:-5])}; causal={bool(c)}, "
                f"layout={LAYOUTS[lay] if lay >= 0 else '?'}, window={None if w == -1 else w}, "
                f"cu_seqlens {'none' if n == 1 and dig == (2**61 - 2) else f'of {n} entries, digest {dig}'}")

    comm.check_same_on_every_rank(what, comm.tensor_signature(q, k, v) + extra, group, describe)


# ----------------------------------------------------------------------------------------------- --docs

def parse_docs(spec: str | None, total: int) -> torch.Tensor | None:
    """``--docs``: document lengths ``3000,1200,800`` (repeated until they fill ``total``, the last one cut),
    or a distribution ``lognormal:mean=2048[,sigma=1.0][,seed=0]`` drawn until ``total`` is filled, or
    ``uniform:min=64,max=4096[,seed=0]``. Returns cu_seqlens (int64), or None for no documents."""
    if spec is None:
        return None
    if ":" in spec:
        kind, _, params = spec.partition(":")
        try:
            kw = {k.strip(): float(v) for k, v in (p.split("=") for p in params.split(",") if p)}
        except ValueError:
            raise ValueError(f"--docs {spec!r}: parameters are name=value, e.g. lognormal:mean=2048,seed=0") from None
        gen = torch.Generator().manual_seed(int(kw.pop("seed", 0)))
        if kind == "lognormal":
            mean, sigma = kw.pop("mean", 2048.0), kw.pop("sigma", 1.0)
            if mean < 1 or sigma <= 0:
                raise ValueError(f"--docs {spec!r}: lognormal needs mean >= 1 and sigma > 0")
            mu = math.log(mean) - sigma ** 2 / 2

            def draw():
                return math.exp(mu + sigma * float(torch.randn((), generator=gen)))
        elif kind == "uniform":
            lo, hi = kw.pop("min", 1.0), kw.pop("max", 4096.0)
            if not 1 <= lo <= hi:
                raise ValueError(f"--docs {spec!r}: uniform needs 1 <= min <= max")

            def draw():
                return lo + (hi - lo) * float(torch.rand((), generator=gen))
        else:
            raise ValueError(f"--docs {spec!r}: unknown distribution {kind!r} (lognormal, uniform, or a list)")
        if kw:
            raise ValueError(f"--docs {spec!r}: unknown parameter(s) {', '.join(kw)}")
        lengths, filled = [], 0
        while filled < total:
            n = max(1, round(draw()))
            lengths.append(min(n, total - filled))
            filled += lengths[-1]
    else:
        try:
            pattern = [int(x) for x in spec.split(",")]
        except ValueError:
            raise ValueError(f"--docs {spec!r}: give lengths (3000,1200,800) or a distribution "
                             "(lognormal:mean=2048,seed=0)") from None
        if not pattern or any(n < 1 for n in pattern):
            raise ValueError(f"--docs {spec!r}: document lengths must be >= 1")
        lengths, filled, i = [], 0, 0
        while filled < total:
            lengths.append(min(pattern[i % len(pattern)], total - filled))
            filled += lengths[-1]
            i += 1
    return torch.tensor([0] + lengths).cumsum(0)


def describe(docs: Documents) -> str:
    lengths = docs.lengths()
    parts = []
    if docs.cu_seqlens is not None:
        parts.append(f"{len(lengths)} documents (lengths {min(lengths)}..{max(lengths)}, mean "
                     f"{sum(lengths) / len(lengths):.0f})")
    if docs.window is not None:
        parts.append(f"window {docs.window}")
    return ", ".join(parts) or "one sequence"
