"""Every ``DISTLAB_*`` environment variable, declared once: its default and what it does.

    python -m distlab.knobs                                     # the table, with what is set now
    DISTLAB_TRITON_ATTN_PDL=1 python -m distlab.cp.emulate --seq 8192

Two kinds. *Launch knobs* choose among equivalent implementations of a kernel (tiles, TMA, programmatic
dependent launch, ...) for tuning sweeps; the code reads them here with ``get(name)`` (name without the
``DISTLAB_`` prefix), never from ``os.environ``. *Launcher variables* carry state from a launcher to its
ranks (``distlab run``, ``launch/*.sh``). The environment is read once, at the first ``get``; a
``DISTLAB_*`` variable that is set but not declared here is an error then (a misspelt knob would otherwise
be ignored in silence). ``override(NAME=value, ...)`` puts values in force for a block (sweeps), ``set`` /
``unset`` until further notice (a check script's sweep).
Library functions such as ``ring_attention`` take their choices as arguments; only studies and the
kernels' launch configuration consult knobs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class Knob:
    default: str | None
    doc: str
    launcher: bool = False   # set by a launcher for its ranks, not by hand


_TILES = "BLOCK_M,BLOCK_N,warps,stages of the Triton attention {} kernel (default: per device, see triton_attention)"
KNOBS = {
    # attention kernels (distlab.kernels.triton_attention, triton_attention_backward)
    "TRITON_ATTN_FWD": Knob(None, _TILES.format("forward")),
    "TRITON_ATTN_DKV": Knob(None, _TILES.format("dK/dV")),
    "TRITON_ATTN_DKV_RING": Knob(None, _TILES.format("ring-step dK/dV")),
    "TRITON_ATTN_DQ": Knob(None, _TILES.format("dQ")),
    "TRITON_ATTN_DQ_RING": Knob(None, _TILES.format("ring-step dQ")),
    "TRITON_ATTN_TMA": Knob("auto", "kernels whose tiles move by TMA: auto (fwd, launches of enough work), 0, 1 "
                                    "(all) or a comma list of fwd, dq, dkv"),
    "TRITON_ATTN_PDL": Knob("0", "1: accumulating forwards launched as programmatic dependents (sm90+)"),
    "FUSED_CE_TRITON": Knob("auto", "fused linear CE's chunk step in Triton (distlab.kernels.triton_ce): auto "
                                    "(CUDA, bf16/fp16, grads_in_input_dtype), 1 always, 0 never"),
    "TRITON_MASKED_ORDER": Knob("auto", "the masked kernels' tiles: lpt (longest key / query range first, every "
                                        "head's), rows (row order, head by head), auto (lpt for an accumulated "
                                        "ring block, rows for a whole call)"),
    "PACKED_FWD_STREAMS": Knob("1", "CUDA streams of a packed Triton ring's forward: 1, or 2 (the later steps' "
                                    "blocks beside my own step's, merged at the end; H100: no faster)"),
    "RING_DQ_FINAL": Knob("1", "1: a Triton ring's backward (dense or packed) writes each row's final dQ in q's "
                               "dtype from its last block's dQ kernel; 0: a float32 dQ converted after the ring "
                               "(the path before 2026-12-05, for an A/B)"),
    "PACKED_BWD_STREAMS": Knob("4", "CUDA streams of a packed Triton ring's backward: 1 (one), 2 (dQ kernels on "
                                    "their own), 4 (also each step's dK/dV kernels on one of two in turn, and the "
                                    "travelling dK/dV accumulators on a fourth; the fastest on the H100)"),
    "TRITON_MASKED_GAPS": Knob("1", "0: the masked attention kernel's forward and dQ loop over every key tile of a "
                                    "query tile's range (1: they skip the whole tiles no row of the tile sees; the "
                                    "same results bit for bit)"),
    "TRITON_MASKED_FULL_TILES": Knob("1", "0: the masked attention kernel masks every key tile (no unmasked "
                                          "fast path for tiles every row sees whole)"),
    "TRITON_ATTN_FMA": Knob("1", "1: the forward's rescale fused into one multiply-add"),
    "TRITON_ATTN_DQ_MODE": Knob("kernel", "how a ring step's dQ reaches the float32 accumulator: kernel, atomic, tma-reduce"),
    "TRITON_ATTN_SPLIT_GROUPS": Knob("auto", "GQA dK/dV split over q-head groups: auto, 0 or 1"),
    "TRITON_ATTN_SPLIT_SUM": Knob("dq", "where split dK/dV partials are summed, and a later ring step's dK/dV "
                                        "added to the received accumulator: dq (in the dQ kernel) or kernel"),
    "RING_STEPS_PER_LAUNCH": Knob(None, "the ring studies' steps per launch (1..4, or group sizes such as 1,1,2,4); "
                                        "with documents, the forward's launch groups"),
    # memory-bound kernels (distlab.kernels.launch)
    "KERNEL_WARPS": Knob(None, "warps per program of every memory-bound kernel (default: each kernel's own)"),
    "KERNEL_RMSNORM_ROWS": Knob(None, "rows per program of the fused RMSNorm (a power of two; default 1)"),
    "KERNEL_RMSNORM_BWD_ROWS": Knob(None, "rows per program of the RMSNorm backward (default: by width)"),
    "KERNEL_ROPE_TOKENS": Knob(None, "tokens per program of the RoPE kernel (default 1)"),
    "KERNEL_SWIGLU_EVICT": Knob(None, "1: SwiGLU loads marked evict-first (default: the kernel's own)"),
    "KERNEL_SWIGLU_BLOCK": Knob(None, "columns per program of the SwiGLU kernel (default 2048)"),
    "KERNEL_MERGE_BLOCK": Knob(None, "rows per program of the LSE merge (default 32)"),
    "KERNEL_DQ_ROWS": Knob(None, "rows per program of the FA4 ring's one-kernel dQ finish (a power of two; default "
                                 "triton_dq_finish.ROWS)"),
    "RING_DKV_SIDE_STREAM": Knob("1", "0: a fused ring backward's dK/dV adds and sends stay on the compute stream "
                                      "(1: on a side stream, beside the next launch group's kernels)"),
    "RING_DKV_ROUTE": Knob("ring", "the ring studies' and the emulator's dK/dV route: ring (a float32 accumulator one "
                                   "hop a step) or direct (each share sent to its owner, summed there once: "
                                   "distlab.cp.ring_dkv_direct; fused backward only)"),
    "RING_DKV_ADDS": Knob("1", "0: a timing probe of the emulator only (distlab.cp.emulate --variant): a fused ring "
                               "backward skips its dK/dV adds (dK/dV wrong; refused on a real ring)"),
    "RING_FUSE_MAX_KEYS": Knob("0", "keys at most in one fused ring block of FA4/cuDNN/torch (a launch group's "
                                       "blocks over one row range joined, distlab.cp.ring.fuse_plan); 0: no cap"),
    "RING_DKV_ADD_ROWS": Knob("0", "1: a fused FA4 ring block's dK/dV share (strided) added row by row in one "
                                   "multi-tensor launch (0: one strided add; H100 GPU clock: 1 loses at S8192, ties at S32768)"),
    "RING_ZERO_AHEAD": Knob("0", "1: a fused FA4 ring backward zeroes the later blocks' dK/dV scratch at its start, on "
                                 "the side stream (0: each on the compute stream right before its block; 1 passed the GPU "
                                 "test; its graph capture fixed since, not yet timed)"),
    "RING_KV_LANDING": Knob("1", "0: a fused ring block's K/V concatenated from the steps' (1: received straight into "
                                 "its buffer, distlab.cp.ring_landing)"),
    "RING_KEEP_OUTPUTS": Knob("1", "0: a ring forward of FA4 blocks allocates each block's out/LSE and builds each "
                                   "merge's key every pass (1: kept and bound per ring shape, distlab.cp.ring_kept)"),
    "RING_MERGE_EARLY": Knob("auto", "auto: a ring forward of FA4/cuDNN blocks whose last block covers the shard's second "
                                  "half merges the earlier blocks beside it on the side stream (the first half's rows "
                                  "final, the second half's into a float32 running result), then the last block alone "
                                  "(distlab.cp.ring_merge_early), at shards of 4096 rows or more; 1: at any shard; 0: "
                                  "every block merged after the last"),
    "RING_MERGE_BLOCKS": Knob("4", "block results a ring forward of cuDNN/FA4 blocks merges per Triton launch (1-4; "
                                   "0: one lse_merge_ per block, the float32 result converted after)"),
    # grouped GEMM (distlab.kernels.grouped_gemm)
    "GROUPED_GEMM_CONFIG": Knob(None, "BM,BN,BK,warps,stages of the grouped GEMM (default: by shape)"),
    "GROUPED_GEMM_TMA": Knob("1", "1: TMA descriptors for the grouped GEMM's operands (sm90+)"),
    "GROUPED_GEMM_PERSISTENT": Knob("1", "1: one persistent program per SM walks the tiles"),
    "GROUPED_GEMM_SPLIT_EPILOGUE": Knob("0", "1: the output tile stored in two halves"),
    "GROUPED_GEMM_GROUP_M": Knob(None, "m-tiles per band in the tile order (default 16 persistent, 8 else)"),
    "GROUPED_GEMM_WS": Knob("0", "1: warp specialisation in the persistent kernel"),
    "GROUPED_GEMM_WGRAD_TMA": Knob("0", "1: TMA loads in the weight-gradient kernel"),
    # collectives and runtime
    "TRITON_LAUNCH": Knob("cached", "Triton launches: cached (bound once per key, distlab.kernels.launch."
                                    "CachedLaunch), plain (Triton's own launch every call), check (both; raises if "
                                    "they differ), skip (no launch: the host work around it, host_cost --skip-launches)"),
    "FA4_RING_ACCUM": Knob("1", "0: a ring backward on fa4 blocks calls FA4's whole backward per block (1: its kernels "
                                "one by one, dQ's and dK/dV's float32 accumulators kept across the steps: "
                                "distlab.kernels.fa4_ring_backward)"),
    "FA4_RING_FOLD": Knob("auto", "0: a fa4 ring backward runs its unmasked blocks as GQA (dK/dV summed over a kv "
                                  "head's q heads by atomics into float32 scratch); 1: with each kv head's q heads "
                                  "folded into rows, as MHA (G times the rows a CTA loops over, dK/dV written in q's "
                                  "dtype, the travelling dK/dV a float32 bshd tensor); auto: half for shards of 2048 "
                                  "rows, every unmasked set for shards of 4096 (where each was measured to pay; "
                                  "distlab.kernels.fa4_ring_backward: FOLD_MIN_SHARD, FOLD_MAX_ROWS, "
                                  "FOLD_WHOLE_SHARD); half: a causal zigzag ring's half-shard row sets, "
                                  "at any shard length"),
    "FA4_REPLAY": Knob("1", "0: every fa4 forward through FlashAttention-4's Python interface (default: a shape's "
                            "compiled kernel called directly after its first call, distlab.kernels.fa4)"),
    "FA4_MASKED_CONTIGUOUS": Knob("0", "1: a fa4 masked backward hands FA4 contiguous copies of q, out and dO (0: "
                                       "as they come, all-gather's kv-head groups' strided views, which FA4 takes; "
                                       "H100, 64k: 55.6 -> 61.1% f+b, docs/PERF.md)"),
    "FA4_COPIES_KERNEL": Knob("1", "1: a fa4 masked backward on CUDA sums the dK/dV of keys read as copies in one "
                                   "Triton pass (distlab.kernels.triton_copies_sum; H100, all-gather at 64k: 60.3 -> "
                                   "74.5% f+b, docs/PERF.md, against the torch path's five passes then); 0: torch's index_add_ "
                                   "in float32, for an A/B"),
    "FA4_RING_SHARE_PRE": Knob("1", "1: a fa4 ring backward runs FA4's preprocess once, for the whole shard's rows, "
                                    "every unfolded row set reading its rows' delta and LSE from it "
                                    "(distlab.kernels.fa4_ring_backward.FA4RingBackward.share_preprocess); 0: one "
                                    "preprocess a row set, for an A/B"),
    "FA4_RING_ZERO_BESIDE": Knob("once", "1: a fused fa4 ring backward zeroes its later row sets' dQ accumulators on "
                                         "the side stream, beside step 0's kernels (H100 S8192: GPU clock +0.6, wall "
                                         "-0.3 to -4 points, docs/PERF.md), and with FA4_RING_PRE_ONCE the folded "
                                         "sets' (the pass leaves them); once: only the latter (H100 S32768, with "
                                         "FA4_RING_DQ_EARLY and RING_MERGE_EARLY: wall a tie, GPU clock +1.5%); 0: on "
                                         "the compute stream"),
    "FA4_RING_KEEP_SCRATCH": Knob("1", "1: a fused fa4 ring backward keeps its later unfolded blocks' dK/dV scratch per "
                                       "ring shape, zeroed with the later row sets' dQ accumulators by one fill "
                                       "(distlab.kernels.fa4_ring_backward.FA4RingBackward.prepare); 0: torch.zeros "
                                       "a block, for an A/B"),
    "FA4_RING_DQ_FUSED": Knob("1", "1: a fa4 ring backward's dQ finished in one Triton kernel over every row set's "
                                   "accumulator in FA4's tile order (distlab.kernels.triton_dq_finish; H100 S8192, "
                                   "slowest rank: GPU clock 75.2 -> 76.8%, wall 74.7 -> 76.2%, docs/PERF.md); 0: "
                                   "FA4's postprocess a set, the parts added, for an A/B"),
    "FA4_RING_GLUE": Knob("1", "a folding fa4 ring backward's glue passes in Triton (distlab.kernels.triton_ring_glue): "
                               "1 both, fold (Q, out and dO folded in one launch), add (the float32 dK/dV += a "
                               "block's bf16 share, vectorized); 0: torch's copies and adds (H100 S32768, with "
                               "FA4_RING_DKV_FINISH=1, slowest rank f+b wall 84.5 -> 85.8%, docs/PERF.md)"),
    "FA4_RING_FOLD_PRE": Knob("1", "1: a folding fa4 ring backward folds each folded row set's Q and dO and runs FA4's "
                                   "preprocess for it in one Triton pass (distlab.kernels.triton_fold_preprocess: out "
                                   "read once, not folded; H100 S16384 slowest rank f+b wall 77.2 -> 78.8%, "
                                   "docs/PERF.md); 0: the fold (FA4_RING_GLUE), then FA4's preprocess, for an A/B"),
    "FA4_RING_PRE_ONCE": Knob("1", "1: a folding fa4 ring backward with FA4_RING_FOLD_PRE=1 runs every row set's "
                                   "preprocess (the folded sets' folds, the whole shard's unfolded set) in one Triton "
                                   "pass before step 0, q, out and dO read once (FA4RingBackward._preprocess_once; "
                                   "H100 S32768 rank 4: 129 µs against 170 for three passes, docs/PERF.md); 0: each "
                                   "set's own pass when its first block runs, for an A/B"),
    "FA4_RING_DQ_EARLY": Knob("auto", "auto: a fa4 ring backward whose last kernels are all one later row set's (zigzag's "
                                   "second half) finishes dQ of the other sets beside them on the side stream: the rows "
                                   "only they hold in q's dtype, the others' float32 sum for the last set's rows, so "
                                   "the finish after the last kernel reads two accumulators, not three "
                                   "(FA4RingBackward._dq_early), at shards of DQ_EARLY_MIN_SHARD rows or more; 1: at "
                                   "any shard; 0: the whole finish after the last kernel"),
    "FA4_RING_DKV_FINISH": Knob("1", "1: a folding fa4 ring backward's unfolded blocks (causal, and row sets too long to "
                                     "fold) hand their float32 dK/dV scratch to one Triton pass that scales it and "
                                     "adds it into the travelling accumulator (triton_ring_glue.dkv_finish_); 0: "
                                     "converted to q's dtype by FA4's postprocesses, then added"),
    "FA4_KEEP_KEY_COPIES": Knob("1", "1: a fa4 masked forward keeps its sequences' copies of shared keys for the "
                                     "backward when its caller asks (attention_forward(keep=), all-gather CP); 0: "
                                     "the backward gathers them again, for an A/B"),
    "TIMEOUT_S": Knob("300", "seconds a collective waits for the other ranks before failing the job"),
    # launcher variables
    "ERROR_DIR": Knob(None, "where ranks file their errors for distlab run's summary", launcher=True),
    "LAUNCHER_PID": Knob(None, "distlab run's pid: its ranks die with it", launcher=True),
    "MODULE": Knob(None, "the study module of launch/run.sh (sbatch)", launcher=True),
    "NPROC_PER_NODE": Knob(None, "processes per node of launch/run.sh", launcher=True),
    "PYTHON": Knob(None, "the python of launch/run.sh", launcher=True),
    "PORT": Knob(None, "the rendezvous port of launch/run.sh", launcher=True),
    "RDZV_TIMEOUT": Knob(None, "the rendezvous timeout of launch/run.sh", launcher=True),
    "LOG_DIR": Knob(None, "the log folder of the launch scripts", launcher=True),
}

_ENV: dict[str, str] | None = None     # what the environment held at the first read (never parallel state)
_GENERATION = [0]                      # bumped whenever the knobs in force may change (plans cache on it)
_OVERRIDES: list[dict[str, str]] = []
_SET: dict[str, str] = {}                # knobs.set(): until knobs.unset()


def _environment() -> dict[str, str]:
    global _ENV
    if _ENV is None:
        found = {k[len("DISTLAB_"):]: v for k, v in os.environ.items() if k.startswith("DISTLAB_")}
        unknown = sorted(k for k in found if k not in KNOBS)
        if unknown:
            raise ValueError(f"unknown environment variable(s) {', '.join('DISTLAB_' + k for k in unknown)}: "
                             "python -m distlab.knobs lists the known ones")
        _ENV = found
    return _ENV


def get(name: str) -> str | None:
    """The value in force of knob ``name`` (without ``DISTLAB_``): an override, else the environment as it
    was at the first read, else the declared default."""
    if name not in KNOBS:
        raise KeyError(f"no knob DISTLAB_{name} is declared in distlab.knobs")
    for layer in reversed(_OVERRIDES):
        if name in layer:
            return layer[name]
    if name in _SET:
        return _SET[name]
    return _environment().get(name, KNOBS[name].default)


@contextlib.contextmanager
def override(**values):
    """``with override(TRITON_ATTN_PDL="1"): ...``: the given knobs (None: the default) for the block."""
    unknown = sorted(k for k in values if k not in KNOBS)
    if unknown:
        raise ValueError(f"unknown knob(s) {', '.join(unknown)}: python -m distlab.knobs lists them")
    _OVERRIDES.append({k: (KNOBS[k].default if v is None else str(v)) for k, v in values.items()})
    _GENERATION[0] += 1
    try:
        yield
    finally:
        _OVERRIDES.pop()
        _GENERATION[0] += 1


def set(**values) -> None:   # noqa: A001 (the knobs' own verb)
    """Put knob values in force until ``unset`` (a script's sweep; blocks use ``override``)."""
    unknown = sorted(k for k in values if k not in KNOBS)
    if unknown:
        raise ValueError(f"unknown knob(s) {', '.join(unknown)}: python -m distlab.knobs lists them")
    _SET.update({k: str(v) for k, v in values.items()})
    _GENERATION[0] += 1


def unset(*names) -> None:
    for name in names:
        _SET.pop(name, None)
    _GENERATION[0] += 1


def generation() -> int:
    """A number that changes whenever ``override``, ``set`` or ``unset`` may have changed a knob in force: a
    launch plan computed from knobs (``distlab.kernels.triton_attention``) stays valid while it is the same."""
    return _GENERATION[0]


def parse_settings(text: str, prefix: str = "") -> dict[str, str]:
    """``'PDL=1;FWD=64,64,4,3'`` (a study's ``--variant``) -> knob values, each name ``prefix`` + NAME unless
    it is a full knob name already."""
    out = {}
    for item in filter(None, text.split(";")):
        name, sep, value = item.partition("=")
        name = name.strip().upper().removeprefix("DISTLAB_")
        if not sep or not name:
            raise ValueError(f"{text!r}: each setting is NAME=VALUE")
        out[name if name in KNOBS else prefix + name] = value.strip()
    return out


def in_force() -> dict[str, str]:
    """Every knob whose value differs from its default (for a benchmark's JSON)."""
    return {f"DISTLAB_{k}": v for k in KNOBS if not KNOBS[k].launcher and (v := get(k)) != KNOBS[k].default}


def main() -> None:
    width = max(map(len, KNOBS)) + 8
    for name, knob in KNOBS.items():
        now = _environment().get(name)
        shown = f"= {now}" if now is not None else f"[{knob.default if knob.default is not None else 'unset'}]"
        print(f"DISTLAB_{name:<{width - 8}} {shown:<14} {'(launcher) ' if knob.launcher else ''}{knob.doc}")


if __name__ == "__main__":
    from distlab.bench import run_study

    run_study(main)
