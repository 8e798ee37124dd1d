"""Where ``lse_merge_blocks_`` departs from ``merge_into`` on a GPU: every block count, with and without a
running result and a separate final buffer, bf16 and float32, cached and plain launches; per case the
largest error, where it sits and which rows exceed 5% (2026-12-05, H200: every running result written to a
separate final failed, 0.4 rel, until a barrier went before the kernels' LSE store; see docs/PERF.md).

    python3 launch/merge_diag.py            # GPU (or the CPU with TRITON_INTERPRET=1 and a short sequence: 64)
"""
import sys

import torch

from distlab import knobs
from distlab.kernels.lse_merge import lse_merge_blocks_, merge_blocks_reference


DEV = "cuda" if torch.cuda.is_available() else "cpu"   # cpu: TRITON_INTERPRET=1


def rand(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(DEV, dtype)


def run(b, s, h, d, dtype, n, has_acc, to_final, spans, poison):
    blks = []
    for i, (lo, hi) in enumerate(spans[:n]):
        blks.append((rand(b, hi - lo, h, d, dtype=dtype, seed=40 + 2 * i),
                     rand(b, h, hi - lo, dtype=torch.float32, seed=41 + 2 * i) + 2.0 * i, lo, hi))
    got_o, got_l = rand(b, s, h, d, dtype=torch.float32, seed=11), rand(b, h, s, dtype=torch.float32, seed=12)
    want_o, want_l = merge_blocks_reference(got_o if has_acc else None, got_l, blks, (b, s, h, d))
    final = torch.full((b, s, h, d), poison, dtype=dtype, device=DEV) if to_final else None
    res_o, res_l = lse_merge_blocks_(got_o, got_l, blks, has_acc=has_acc, final=final)
    torch.cuda.synchronize() if DEV == "cuda" else None
    err = (res_o.double() - want_o.double()).abs()
    i = int(err.flatten().argmax())
    where = torch.unravel_index(torch.tensor(i), err.shape)
    bad_rows = (err.amax(dim=(0, 2, 3)) > 0.05 * want_o.abs().max()).nonzero().flatten()
    lerr = (res_l - want_l).abs().max().item()
    return (err.max() / want_o.abs().max()).item(), tuple(int(x) for x in where), res_o[where].item(), \
        want_o[where].item(), bad_rows[:8].tolist(), len(bad_rows), lerr


def main():
    b, s, h, d = 1, int(sys.argv[1]) if len(sys.argv) > 1 else 4096, 32, 128
    spans = [(0, s), (s // 3, s), (0, s - 5), (s - s // 2, s)]
    for mode in ("cached", "plain"):
        with knobs.override(TRITON_LAUNCH=mode):
            for dtype in (torch.bfloat16, torch.float32):
                for n in (1, 2, 3, 4):
                    for has_acc in (True, False):
                        for to_final in (False, True):
                            for poison in ((0.0, float("nan")) if to_final else (0.0,)):
                                r = run(b, s, h, d, dtype, n, has_acc, to_final, spans, poison)
                                flag = "BAD" if r[0] > 1e-2 or r[-1] > 1e-4 else "ok "
                                print(flag, mode, str(dtype)[6:], f"n={n} acc={has_acc:d} final={to_final:d} "
                                      f"poison={poison}", "rel %.3g at %s got %.4g want %.4g rows %s (%d) lse %.2g"
                                      % r, flush=True)


if __name__ == "__main__":
    main()
