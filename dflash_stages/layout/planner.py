"""Which multi-GPU layout to train with: predicted tokens/s of each, from one-GPU rates.

A pure function of a few measured (or given) numbers — no torch, so it is cheap to import and
to test. ``dflash-pipe plan`` (``dflash_stages/layout/cli.py``) measures the numbers and prints this.

Inputs: ``rt`` = target forward tokens/s on one GPU, ``rd`` = drafter tokens/s on one GPU (row
tokens / step time), ``mt`` / ``md`` = their peak GiB. Layouts on G GPUs of one host:

- **pairs**: G // 2 data-parallel pairs, a target GPU streaming features to a drafter GPU:
  ``(G // 2) * min(rt, rd)``; mt on each target GPU, md on each drafter GPU.
- **fan-in N→M**: N target GPUs stream rows into M drafter GPUs (N + M = G, N >= M, N % M == 0):
  ``min(N * rt, M * rd)``; every valid split is computed, the fastest is "the" fan-in.
- **colocated**: every GPU runs a target copy and a drafter replica back to back:
  ``overlap * G / (1/rt + 1/rd)``; mt + md on every GPU. ``overlap`` = 1 is back to back
  (conservative: the two overlap on one GPU; docs/benchmarks.md has the measurements).
- **one GPU alone**: colocated with G = 1, for reference.

Drafter replicas all-reduce their gradients once per step; its time is left out of every layout,
its memory is not: with several replicas each drafter GPU also holds the float32 copy of all
gradients that the trainer all-reduces (``allreduce_gib``). Feature rows (T x k x H elements)
cross a link in pairs and fan-in: hidden behind the stages as long as each drafter GPU's link is
busy less than all of the time, i.e. a row's copy takes less than the time between two rows
reaching that GPU (for pairs: less than the slower stage's time per row). When it is not, the
layout is link-bound and its rate is capped by the link. Rows queued in the stream link between
extract and train (``queued_rows``) sit on the GPU that produced them and are added to its
memory; in fan-in as many again wait on the drafter GPU, in the receiving rank's queue.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

GIB = 2**30
DEFAULT_LINK_GBPS = 100.0
"""GB/s (1e9 bytes/s) of the GPU-to-GPU link per GPU: NVLink class, well under NVLink's nominal
bandwidth per direction, to leave room for what a peer copy really gets."""


@dataclass(frozen=True)
class PlanInputs:
    target_tok_s: float
    """rt: target forward tokens/s on one GPU."""
    drafter_tok_s: float
    """rd: drafter tokens/s on one GPU (row tokens / optimizer-step time)."""
    target_gib: float | None = None
    """mt: peak GiB of the target forward (None = unknown)."""
    drafter_gib: float | None = None
    """md: peak GiB of the drafter step (None = unknown)."""
    gpu_gib: float | None = None
    """Memory of one GPU; None = do not check."""
    overlap: float = 1.0
    """Colocated speed-up over back to back (1.0 = none, conservative)."""
    row_tokens: int | None = None
    """T: tokens per packed row (for the feature transfer)."""
    row_bytes: int | None = None
    """Bytes of one row's features (T x k x H x element size)."""
    link_gbps: float = DEFAULT_LINK_GBPS
    queued_rows: int = 0
    """Feature rows a stream link may hold on the extract GPU (the engine's queue bound)."""
    allreduce_gib: float | None = None
    """GiB the gradient all-reduce adds to each drafter GPU when there are several replicas (a
    float32 copy of every gradient: 4 bytes x drafter parameters); None = unknown, not added."""

    def __post_init__(self) -> None:
        if not (self.target_tok_s > 0 and self.drafter_tok_s > 0):
            raise ValueError("target and drafter tokens/s must be > 0")
        if self.overlap <= 0:
            raise ValueError("overlap must be > 0")
        if self.link_gbps <= 0:
            raise ValueError("link GB/s must be > 0")
        for name in ("target_gib", "drafter_gib", "gpu_gib", "allreduce_gib"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0")

    @property
    def transfer_s(self) -> float | None:
        """Seconds to copy one row's features over the link."""
        return None if self.row_bytes is None else self.row_bytes / (self.link_gbps * 1e9)

    def replicas_gib(self, replicas: int) -> float:
        """What data parallelism adds to each drafter GPU: the all-reduce's copy, if several."""
        return (self.allreduce_gib or 0.0) if replicas > 1 else 0.0

    @property
    def queue_gib(self) -> float:
        """GiB of queued feature rows on an extract GPU (0 when the row size is unknown)."""
        return self.queued_rows * self.row_bytes / GIB if self.row_bytes else 0.0


@dataclass(frozen=True)
class Layout:
    """One layout's predicted result."""

    name: str
    """``pairs``, ``fan-in 3→1``, ``colocated``, ``one GPU alone``."""
    kind: str
    """``pairs`` | ``fan_in`` | ``colocated`` | ``single``."""
    gpus: int
    """GPUs the layout uses (pairs on an odd G leave one idle)."""
    target_gpus: int
    drafter_gpus: int
    tokens_per_s: float
    bound: str
    """What limits it: ``target``, ``drafter``, ``balanced``, ``link`` or ``back to back``."""
    memory: tuple[tuple[str, float | None], ...]
    """(role, GiB on each GPU of that role): ``(("target", mt), ("drafter", md))`` or
    ``(("target + drafter", mt + md),)``; None = unknown."""
    fits: bool | None
    """Every GPU within ``gpu_gib``; None when either is unknown."""
    transfer_ms: float | None = None
    """One row's feature copy; None for colocated (nothing crosses) or an unknown row size."""
    link_busy: float | None = None
    """Fraction of time each drafter GPU's link is copying rows at the stages' rate; > 1 means
    the copy is not hidden and the layout is link-bound."""
    how: str = ""

    @property
    def gib_per_gpu(self) -> float | None:
        """The most any one GPU of the layout holds."""
        values = [gib for _, gib in self.memory]
        return None if any(v is None for v in values) else max(values)  # type: ignore[type-var]

    @property
    def transfer_hidden(self) -> bool | None:
        return None if self.link_busy is None else self.link_busy <= 1.0


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    gpus: int
    single: Layout
    colocated: Layout
    pairs: Layout | None
    """None when G < 2."""
    fan_in: Layout | None
    """The fastest valid split; None when G < 2."""
    fan_in_splits: tuple[Layout, ...] = ()
    """Every valid split, fastest first (``fan_in`` is the first)."""
    fan_in_excluded: tuple[tuple[int, int], ...] = ()
    """(N, M) with N + M = G and N >= M that are invalid because N % M != 0."""
    recommended: Layout | None = None
    """The fastest of pairs / fan-in / colocated that fits (unknown memory counts as fitting);
    None when none fits."""
    notes: tuple[str, ...] = field(default_factory=tuple)

    def candidates(self) -> list[Layout]:
        """pairs, the best fan-in and colocated (those that exist for this G)."""
        return [x for x in (self.pairs, self.fan_in, self.colocated) if x is not None]


def fan_in_splits(gpus: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(valid, excluded) (N targets, M drafters) with N + M = gpus and N >= M >= 1; valid when N
    is a multiple of M (each drafter takes rows from the same number of targets)."""
    valid, excluded = [], []
    for m in range(1, gpus // 2 + 1):
        n = gpus - m
        (valid if n % m == 0 else excluded).append((n, m))
    return valid, excluded


def _fits(memory: tuple[tuple[str, float | None], ...], gpu_gib: float | None) -> bool | None:
    values = [gib for _, gib in memory]
    if gpu_gib is None or any(v is None for v in values):
        return None
    return max(values) <= gpu_gib  # type: ignore[type-var]


def _add(a: float | None, b: float) -> float | None:
    return None if a is None else a + b


def streamed(inp: PlanInputs, name: str, kind: str, n: int, m: int, how: str,
             received_queue: bool = False) -> Layout:
    """n target GPUs streaming into m drafter GPUs, each group working in parallel:
    min(n * rt, m * rd), capped by the drafter GPUs' links when the copy is not hidden.
    ``received_queue``: rows also queue on the drafter GPU (another rank receives them)."""
    t_side, d_side = n * inp.target_tok_s, m * inp.drafter_tok_s
    rate = min(t_side, d_side)
    bound = "balanced" if t_side == d_side else "target" if t_side < d_side else "drafter"
    transfer_ms = link_busy = None
    ts = inp.transfer_s
    if ts is not None and inp.row_tokens:
        rows_per_s_per_drafter = rate / (m * inp.row_tokens)
        link_busy = ts * rows_per_s_per_drafter
        transfer_ms = ts * 1e3
        if link_busy > 1.0:  # the link cannot keep up: rows reach each drafter GPU at 1/ts
            rate, bound = m * inp.row_tokens / ts, "link"
    drafter = _add(inp.drafter_gib, inp.replicas_gib(m) + (inp.queue_gib if received_queue else 0.0))
    memory = (("target", _add(inp.target_gib, inp.queue_gib)), ("drafter", drafter))
    return Layout(name=name, kind=kind, gpus=n + m, target_gpus=n, drafter_gpus=m, tokens_per_s=rate,
                  bound=bound, memory=memory, fits=_fits(memory, inp.gpu_gib), transfer_ms=transfer_ms,
                  link_busy=link_busy, how=how)


def colocated(inp: PlanInputs, gpus: int, name: str = "colocated", kind: str = "colocated") -> Layout:
    """Target forward and drafter step back to back on each GPU (times ``overlap``)."""
    rate = inp.overlap * gpus / (1.0 / inp.target_tok_s + 1.0 / inp.drafter_tok_s)
    both = None if inp.target_gib is None or inp.drafter_gib is None else (
        inp.target_gib + inp.drafter_gib + inp.queue_gib + inp.replicas_gib(gpus))
    memory = (("target + drafter", both),)
    if kind == "single":
        how = "dflash-pipe run, extract and train on the same device"
    else:
        how = f"torchrun --nproc_per_node {gpus}; extract and train both on cuda:{{local_rank}}"
    return Layout(name=name, kind=kind, gpus=gpus, target_gpus=gpus, drafter_gpus=gpus, tokens_per_s=rate,
                  bound="back to back", memory=memory, fits=_fits(memory, inp.gpu_gib), how=how)


def pairs(inp: PlanInputs, gpus: int) -> Layout | None:
    p = gpus // 2
    if p < 1:
        return None
    how = (f"torchrun --nproc_per_node {p}; extract on cuda:{{local_rank}}, train on cuda:{{local_rank+{p}}}"
           + ("; one GPU idle" if gpus % 2 else ""))
    return streamed(inp, "pairs", "pairs", p, p, how)


def _ranks(first: int, count: int) -> str:
    """Ranks ``first .. first + count - 1`` as the pipeline file writes them: ``[3]`` or ``"0-2"``."""
    return f"[{first}]" if count == 1 else f'"{first}-{first + count - 1}"'


def fan_in(inp: PlanInputs, n: int, m: int) -> Layout:
    """Ranks 0..n-1 run pack and extract, ranks n..n+m-1 train and checkpoint (``ranks:`` in the
    pipeline file, as ``pipelines/layouts_cpu/fan_in.yaml``)."""
    if n < m or m < 1 or n % m:
        raise ValueError(f"fan-in {n}→{m} is not valid: needs N >= M >= 1 and N a multiple of M")
    how = (f"torchrun --nproc_per_node {n + m}; pack and extract with ranks: {_ranks(0, n)}, train and "
           f"checkpoint with ranks: {_ranks(n, m)}; every device cuda:{{local_rank}}")
    return streamed(inp, f"fan-in {n}→{m}", "fan_in", n, m, how, received_queue=True)


def _pick(layouts: list[Layout]) -> Layout | None:
    """Fastest that fits (unknown fit counts as fitting); ties: less memory, then list order."""
    ok = [(i, x) for i, x in enumerate(layouts) if x.fits is not False]
    if not ok:
        return None
    return min(ok, key=lambda ix: (-ix[1].tokens_per_s,
                                   ix[1].gib_per_gpu if ix[1].gib_per_gpu is not None else 0.0, ix[0]))[1]


def plan(inp: PlanInputs, gpus: int) -> Plan:
    """Every layout on ``gpus`` GPUs, and the recommendation."""
    if gpus < 1:
        raise ValueError("gpus must be >= 1")
    single = colocated(inp, 1, name="one GPU alone", kind="single")
    col = colocated(inp, gpus)
    valid, excluded = fan_in_splits(gpus)
    splits = [fan_in(inp, n, m) for n, m in valid]
    splits.sort(key=lambda x: -x.tokens_per_s)  # stable: among equals the larger N comes first
    result = Plan(inputs=inp, gpus=gpus, single=single, colocated=col, pairs=pairs(inp, gpus),
                  fan_in=splits[0] if splits else None, fan_in_splits=tuple(splits),
                  fan_in_excluded=tuple(excluded))
    candidates = result.candidates()
    best = _pick(candidates)
    allreduce = ("its float32 gradient copy is in the memory" if inp.allreduce_gib is not None
                 else "its float32 gradient copy (4 bytes per drafter parameter) is not in the memory either")
    notes = ["drafter replicas all-reduce gradients once per step: its time is not counted (colocated pays it "
             f"on every GPU's busy path, fan-in N→1 not at all; docs/multi_gpu.md); {allreduce}",
             f"colocated = back to back × {inp.overlap:g}: on one H200 the pipeline ran 1.08× (8B dims) and "
             "1.23× (32B dims) back to back (docs/benchmarks.md); --overlap F credits that"]
    if any(x.link_busy is not None and x.link_busy > 1 for x in candidates):
        notes.append("a feature copy takes longer than the time between rows: those layouts are link-bound")
    return replace(result, recommended=best, notes=tuple(notes))
