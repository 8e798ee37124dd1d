"""Start-up: process group from torchrun / SLURM / a single process, device, seeds, and Layout.

    distlab run --nproc 4 -m distlab.cp.ring --seq 8192     # torchrun environment
    srun python -m distlab.cp.ring --seq 8192               # SLURM environment (one task per GPU)
    python -m distlab.cp.ring --seq 8192                    # a single process: world size 1

``init_runtime()`` reads the launcher's environment, picks the device (``cuda:LOCAL_RANK`` when CUDA is
present, else CPU) and the backend (nccl for CUDA, gloo for CPU), and starts the default process group
with a timeout (``DISTLAB_TIMEOUT_S``, default 300 s; every mesh group gets it too), so a rank that dies
or freezes makes the others fail instead of hang. Under a launcher, a rank also dies with the process
that started it (``PR_SET_PDEATHSIG``): killing ``distlab run`` with SIGKILL leaves no orphaned workers.
It returns a ``Runtime``; there is no global state beyond torch.distributed's own default group.

``Layout`` validates parallel degrees against the world size before any communication and builds
one named ``DeviceMesh``.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import random
import subprocess
import sys

import numpy as np
import torch
import torch.distributed as dist

from distlab import knobs
from distlab.ports import free_port

GPU_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclasses.dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    launcher: str  # "torchrun", "slurm" or "single"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _slurm_head_node() -> str:
    nodes = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST") or "127.0.0.1"
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return nodes.split(",")[0].split("[")[0]


def launch_env() -> tuple[str, int, int, int]:
    """(launcher, rank, world_size, local_rank) from torchrun's or SLURM's variables, else a single process.

    Under SLURM without torchrun, MASTER_ADDR defaults to the job's first node and MASTER_PORT to a port
    derived from the job id, both exported so every task agrees.
    """
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return "torchrun", int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        env.setdefault("MASTER_ADDR", _slurm_head_node())
        env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
        return "slurm", int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0))
    return "single", 0, 1, 0


def pick_device(local_rank: int, device: str | None = None) -> torch.device:
    if device is not None:
        from distlab.bench import resolve_device

        dev = resolve_device(device)   # refuses a CUDA device on a machine without one, with the fix
        return torch.device("cuda", local_rank % torch.cuda.device_count()) if dev == torch.device("cuda") else dev
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def collective_timeout_s() -> float:
    """Seconds a collective may wait for the other ranks: the knob ``DISTLAB_TIMEOUT_S`` (default 300). The
    first knob a rank reads: an unknown ``DISTLAB_*`` variable fails here, before any collective."""
    value = knobs.get("TIMEOUT_S")
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"DISTLAB_TIMEOUT_S={value!r}: give a positive number of seconds")
    return seconds


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (the launcher's agent) dies, and exit now if it
    already has. No-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    launcher = knobs.get("LAUNCHER_PID")   # set by distlab run, our parent
    parent = int(launcher) if launcher and launcher.isdigit() else os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:   # the parent died before the request took effect (while we imported torch)
        os._exit(1)


def init_runtime(device: str | None = None, backend: str | None = None, timeout_s: float | None = None,
                 seed: int | None = 0) -> Runtime:
    """Initialise torch.distributed (if not already) from the environment; return the Runtime.

    A single process without launcher variables gets a process group of size 1 on a free local port, so
    the same code paths run everywhere. ``timeout_s`` bounds every collective of the default group
    (default ``collective_timeout_s()``).
    """
    for key, value in GPU_SAFE_ENV.items():
        os.environ.setdefault(key, value)
    default_timeout = collective_timeout_s()   # also checks the DISTLAB_* knobs, on every rank, first
    timeout_s = timeout_s if timeout_s is not None else default_timeout
    launcher, rank, world, local_rank = launch_env()
    if launcher != "single":
        die_with_parent()
    dev = pick_device(local_rank, device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    if backend == "nccl" and dev.type != "cuda":
        raise ValueError("backend 'nccl' needs CUDA devices; use gloo on CPU")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"unknown backend {backend!r}; use nccl (CUDA) or gloo (CPU)")
    if not dist.is_initialized():
        kwargs = {"timeout": datetime.timedelta(seconds=timeout_s)}
        if dev.type == "cuda":
            kwargs["device_id"] = dev  # binds NCCL to this GPU (no guessing from the rank)
        if launcher == "single":
            kwargs.update(init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        else:
            kwargs.update(rank=rank, world_size=world)
        dist.init_process_group(backend, **kwargs)
    if seed is not None:
        seed_everything(seed)
    return Runtime(dist.get_rank(), dist.get_world_size(), local_rank, dev, backend, launcher)


def shutdown() -> None:
    from distlab import comm

    comm.forget_agreed()
    if dist.is_initialized():
        dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    """Same seed for python, numpy and torch (CPU and CUDA), so every rank draws the same full tensors."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclasses.dataclass
class Layout:
    """How one job is sharded: ``dp`` × context parallelism (``ulysses`` × ``ring`` = ``cp``) × ``tp``, with
    ``sp`` (sequence parallelism inside TP) and ``cp_layout`` (how the CP axes cut the sequence: zigzag,
    contiguous or balanced, ``distlab.cp.layout``). The product of the degrees must equal the world size.

    Give ``cp`` alone for pure ring, or the two axes (``cp`` then follows). ``validate()`` raises a ValueError
    naming the bad degree (call it on every rank before any collective). ``build_mesh()`` returns one
    ``DeviceMesh`` with axes ``dp_replicate``, ``dp_shard``, ``ring``, ``ulysses``, ``tp`` (outer to inner: tp,
    then ulysses neighbours are adjacent ranks, which on a node share the fastest links) and the flattened
    axes ``dp`` = dp_replicate × dp_shard, ``cp`` = ring × ulysses, ``shard`` = dp_shard × cp (what ZeRO shards
    over), ``dp_cp`` (the ranks holding the same dense weights) and ``dp_cp_tp`` (every rank: MoE experts
    spread over it under TP). ``dp_shard`` / ``dp_replicate`` / ``zero``: sharded data parallelism
    (``distlab.zero``); without them dp is all replicate. ``for_model`` gives data parallelism what the model axes leave;
    ``add_layout_args`` / ``from_args`` are the flags train and infer share.
    """

    world_size: int
    dp: int = 1
    cp: int | None = None
    tp: int = 1
    ulysses: int | None = None
    ring: int | None = None
    sp: bool = False
    cp_layout: str = "zigzag"
    dp_shard: int | None = None
    dp_replicate: int | None = None
    zero: int | None = None
    cp_method: str = "ring"

    AXES = ("dp", "ring", "ulysses", "tp")
    MESH_AXES = ("dp_replicate", "dp_shard", "ring", "ulysses", "tp")

    def __post_init__(self):
        for name in ("cp", "ulysses", "ring"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"parallel degree {name}={value!r} must be a positive integer")
        if self.ulysses is None and self.ring is None:
            self.cp = 1 if self.cp is None else self.cp
            self.ulysses, self.ring = 1, self.cp
        elif self.cp is None:
            self.ulysses, self.ring = self.ulysses or 1, self.ring or 1
            self.cp = self.ulysses * self.ring
        else:
            if self.ulysses is None or self.ring is None:
                given = self.ulysses or self.ring
                if self.cp % given:
                    raise ValueError(f"cp={self.cp} is not divisible by the given CP axis degree {given}")
                self.ulysses, self.ring = (given, self.cp // given) if self.ulysses else (self.cp // given, given)
            if self.ulysses * self.ring != self.cp:
                raise ValueError(f"ulysses={self.ulysses} x ring={self.ring} = {self.ulysses * self.ring}, "
                                 f"but cp={self.cp}")
        self._split_data_parallel()
        self.validate()

    def _split_data_parallel(self) -> None:
        """``dp`` = ``dp_replicate`` x ``dp_shard`` (HSDP). Sharded data parallelism (ZeRO, ``distlab.zero``) is on
        when either is given; it shards over dp_shard x cp (the CP ranks hold the same weights, as in
        torchtitan), and ``zero`` (1, 2 or 3, default 3) says what it shards."""
        for name in ("dp_shard", "dp_replicate"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"--{name.replace('_', '-')} {value!r} must be a positive integer")
        if self.dp_shard is None and self.dp_replicate is None:
            if self.zero is not None:
                raise ValueError(f"--zero {self.zero} shards the data-parallel ranks: give --dp-shard N too")
            return
        given = self.dp_shard if self.dp_replicate is None else self.dp_replicate
        if self.dp_shard is not None and self.dp_replicate is not None:
            if self.dp_shard * self.dp_replicate != self.dp:
                raise ValueError(f"--dp-replicate {self.dp_replicate} x --dp-shard {self.dp_shard} = "
                                 f"{self.dp_replicate * self.dp_shard}, but the other degrees leave {self.dp} "
                                 "data-parallel ranks")
        elif self.dp % given:
            which = "--dp-shard" if self.dp_replicate is None else "--dp-replicate"
            raise ValueError(f"{which} {given} does not divide the {self.dp} data-parallel ranks the other degrees "
                             f"leave (world {self.world_size} / tp {self.tp} / cp {self.cp})")
        elif self.dp_replicate is None:
            self.dp_replicate = self.dp // self.dp_shard
        else:
            self.dp_shard = self.dp // self.dp_replicate
        self.zero = 3 if self.zero is None else self.zero
        if self.zero not in (1, 2, 3):
            raise ValueError(f"--zero {self.zero!r}: 1 (optimizer state), 2 (+ gradients) or 3 (+ parameters)")

    @property
    def sharded(self) -> bool:
        """Sharded data parallelism (ZeRO) over ``shard_degree`` = dp_shard x cp ranks."""
        return self.dp_shard is not None

    @property
    def shard_degree(self) -> int:
        return (self.dp_shard or 1) * self.cp if self.sharded else 1

    @classmethod
    def for_model(cls, world_size: int, tp=1, ring=1, ulysses=1, sp=False, cp_layout="zigzag", batch=None,
                  dp_shard=None, dp_replicate=None, zero=None, cp_method="ring") -> "Layout":
        """Data parallelism takes what ``tp`` × ``ring`` × ``ulysses`` leave of the world; ValueError (on every
        rank, before any collective) when the degrees or the global ``batch`` do not divide."""
        model_parallel = tp * ring * ulysses
        if world_size % model_parallel:
            raise ValueError(f"tp {tp} x ring {ring} x ulysses {ulysses} does not divide the world size {world_size}")
        layout = cls(world_size, dp=world_size // model_parallel, tp=tp, ring=ring, ulysses=ulysses, sp=bool(sp),
                     cp_layout=cp_layout, dp_shard=dp_shard, dp_replicate=dp_replicate, zero=zero, cp_method=cp_method)
        if batch is not None and batch % layout.dp:
            raise ValueError(f"batch {batch} is not divisible by the {layout.dp} data-parallel ranks")
        return layout

    @classmethod
    def from_args(cls, args, world_size: int, preset: dict | None = None, batch=None) -> "Layout":
        """The layout of ``add_layout_args``' flags; a flag left out takes the preset's value (a config's
        "layout" section), else the default."""
        preset = {"tp": 1, "sp": False, "ring": 1, "ulysses": 1, "cp_layout": "zigzag", "dp_shard": None,
                  "dp_replicate": None, "zero": None, "cp_method": "ring", **(preset or {})}
        values = {k: getattr(args, k, None) if getattr(args, k, None) is not None else v for k, v in preset.items()}
        return cls.for_model(world_size, batch=batch, **values)

    @property
    def seq_len_divisor(self) -> int:
        """What the global sequence length must be a multiple of: every CP rank holds whole chunks of the
        layout (two per rank for zigzag), and under SP each piece splits again over tp."""
        from distlab.cp.layout import chunks_per_rank

        chunks = chunks_per_rank(self.cp_layout) if self.ring > 1 else 1
        return self.ring * chunks * self.ulysses * (self.tp if self.sp else 1)

    def describe(self) -> str:
        dp = (f"dp {self.dp} (replicate {self.dp_replicate} x shard {self.dp_shard}, ZeRO-{self.zero} over "
              f"{self.shard_degree})" if self.sharded else f"dp {self.dp}")
        method = ", all-gather KV" if self.cp_method == "allgather" and self.cp > 1 else ""
        return (f"{dp} x tp {self.tp}{' (SP)' if self.sp else ''} x ring {self.ring} x ulysses "
                f"{self.ulysses}{f' ({self.cp_layout}{method})' if self.cp > 1 else ''}")

    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.AXES}

    def validate(self) -> None:
        from distlab.cp.layout import check_layout

        check_layout(self.cp_layout)
        if self.cp_method not in ("ring", "allgather"):
            raise ValueError(f"--cp-method {self.cp_method!r}: ring (ring, Ulysses or USP as the degrees say) or "
                             "allgather (Llama 3's all-gather KV over the ring axis)")
        if self.cp_method == "allgather" and self.ulysses > 1:
            raise ValueError(f"--cp-method allgather gathers K/V over the whole CP axis: give --ring {self.cp} "
                             f"--ulysses 1, not ulysses {self.ulysses}")
        for name, degree in self.degrees().items():
            if not isinstance(degree, int) or degree < 1:
                raise ValueError(f"parallel degree {name}={degree!r} must be a positive integer")
        product = int(np.prod(list(self.degrees().values())))
        if product != self.world_size:
            shown = " x ".join(f"{k}={v}" for k, v in self.degrees().items())
            raise ValueError(f"parallel degrees {shown} multiply to {product}, but the world size is "
                             f"{self.world_size}")

    MESH_GROUPS = MESH_AXES + ("dp", "cp", "dp_cp", "dp_cp_tp", "shard")

    def mesh_degrees(self) -> dict[str, int]:
        """The mesh's five axes: dp splits into dp_replicate (outer) x dp_shard."""
        replicate = self.dp_replicate if self.sharded else self.dp
        return {"dp_replicate": replicate, "dp_shard": self.dp_shard or 1, "ring": self.ring,
                "ulysses": self.ulysses, "tp": self.tp}

    def build_mesh(self, device_type: str, timeout_s: float | None = None):
        """The named mesh. Every group in it gets ``timeout_s`` (default ``collective_timeout_s()``, as the
        default group): DeviceMesh's subgroups would otherwise take gloo's 30-minute default, so a frozen rank
        hung training that long."""
        timeout_s = timeout_s if timeout_s is not None else collective_timeout_s()
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, tuple(self.mesh_degrees().values()), mesh_dim_names=self.MESH_AXES)
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        mesh["ring", "ulysses"]._flatten("cp")
        mesh["dp_shard", "ring", "ulysses"]._flatten("shard")   # ZeRO shards over these (same weights, same tp)
        mesh["dp_replicate", "dp_shard", "ring", "ulysses"]._flatten("dp_cp")   # ranks that hold the same weights outside TP/EP
        mesh["dp_replicate", "dp_shard", "ring", "ulysses", "tp"]._flatten("dp_cp_tp")   # all ranks: EP under TP
        from torch.distributed.distributed_c10d import _set_pg_timeout   # no public setter exists

        for name in self.MESH_GROUPS:
            _set_pg_timeout(datetime.timedelta(seconds=timeout_s), mesh.get_group(name))
        return mesh


def add_layout_args(parser, sp: bool = True, data_parallel: bool = False) -> None:
    """The layout flags of train and infer (left out: the config's "layout" section, else 1 / zigzag);
    ``data_parallel``: also the sharded data-parallel flags (training)."""
    from distlab.bench import positive_int

    parser.add_argument("--tp", type=positive_int, default=None, help="tensor-parallel degree")
    if sp:
        parser.add_argument("--sp", action="store_true", default=None, help="sequence parallelism inside TP")
    parser.add_argument("--ring", type=positive_int, default=None, help="context parallelism: ring degree")
    parser.add_argument("--ulysses", type=positive_int, default=None, help="context parallelism: Ulysses degree")
    parser.add_argument("--layout", "--cp-layout", dest="cp_layout", choices=("zigzag", "contiguous", "balanced"),
                        default=None, help="sequence layout of the CP axes, as in the CP studies")
    parser.add_argument("--cp-method", choices=("ring", "allgather"), default=None,
                        help="ring (default: ring / Ulysses / USP by the degrees) or allgather (Llama 3's all-gather "
                        "KV over --ring ranks)")
    if data_parallel:
        parser.add_argument("--dp-shard", type=positive_int, default=None, help="shard weights, gradients and AdamW "
                            "state over this many data-parallel ranks (x the CP ranks): ZeRO, distlab.zero")
        parser.add_argument("--dp-replicate", type=positive_int, default=None, help="HSDP: replicas of the sharded "
                            "group (default: what --dp-shard leaves of dp)")
        parser.add_argument("--zero", type=int, choices=(1, 2, 3), default=None, help="what is sharded: 1 optimizer "
                            "state, 2 + gradients, 3 + parameters (default 3 with --dp-shard)")
