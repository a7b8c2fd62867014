"""Collectives on a TPU torus: rings per axis over ICI, and DCN between slices.

A TPU slice is a torus of chips (``Cluster.torus`` bounds its axes: v5e 16 x 16, v5p up to
16 x 16 x 24), each chip linked to its two neighbours along every axis by ICI links of
``intra_node_bandwidth`` bytes per second per direction. An axis has wraparound links (the
last chip linked to the first) only where its length is a multiple of ``torus_wrap``: a whole
v5e pod axis of 16, or whole 4 x 4 x 4 cubes of v5p. Several slices (``Cluster.slices``) are
joined by the data-center network (DCN), each host's chips sharing its adapters
(``Cluster.network_share``).

Layout, as ``jax.experimental.mesh_utils.create_device_mesh`` lays a mesh out: a slice holds
``plan.gpus / slices`` chips in the most even shape the torus allows (:func:`slice_shape`);
the plan's mesh axes, ordered by increasing traffic (pipeline, data, context, tensor), take
physical axes from the busiest down, each the subset of whole axes with the most axes whose
lengths multiply to its size; where none does, axes are split by the same preferences as
``create_device_mesh(..., allow_split_physical_axes=True)`` (:func:`mesh_layout`). Between
slices, ranks are numbered pipeline-outermost: the pipeline crosses the slices where its
degree allows, then the data-parallel replicas (``Plan.fsdp``: FSDP inside each slice, data
parallelism across them), then the shard groups (:func:`dcn_split`).

Pricing, for ``S`` bytes (the whole, unsharded size) over a group, as XLA runs it: one ring
phase per physical axis the group spans (a reduce-scatter along x, then along y on the
x-shard, ...), each of ``z`` chips costing ``(z - 1)·α`` and ``(z - 1)/z · S_i / B`` of its
axis's links with ``S_i`` what is left after the earlier phases, ``α`` one hop
(``intra_node_latency``); the bytes split into one part per axis, each part starting on
another axis, so that every axis's links work at once and the busiest axis sets the time
(:func:`_ici_seconds`); ``B``:

- a ring over a whole axis with wraparound: both directions of each link, ``2·b``
  (``b`` = link bandwidth × ``intra_node_efficiency``);
- a partial axis, or one without wraparound: a line, on which a bidirectional ring runs at
  ``b``;
- a group whose chips on an axis lie ``stride`` apart (a higher-traffic mesh axis split
  the same physical axis): ``stride`` such rings share each link, ``B / stride``.

Across ``m`` slices the group's ``k`` chips of each slice each move their ``S/k`` shard over
DCN: ``(m - 1)·α_dcn + (m - 1)/m · (S/k) / B_dcn``. An all-reduce is a reduce-scatter then an
all-gather: twice the gather. A pipeline send crosses one ICI link (``α + S/b``) inside a
slice, DCN between slices.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

from pipedsl.simulator.hardware import Cluster
from pipedsl.simulator.plan import Plan, PlanError

__all__ = [
    "MESH_AXES",
    "mesh_sizes",
    "Ring",
    "TorusGroup",
    "slice_shape",
    "mesh_layout",
    "dcn_split",
    "torus_group",
    "torus_gather_seconds",
    "torus_all_reduce_seconds",
    "crosses_slices",
]

MESH_AXES = ("pipeline", "data", "fsdp", "context", "tensor")
"""The plan's mesh axes in order of increasing traffic, as ``create_device_mesh`` wants them:
the data-parallel ranks are ``data`` (replicas, ``Plan.replicas``) by ``fsdp`` (the ZeRO
shard group, ``Plan.shard_group``; all of them without ``Plan.fsdp``), as MaxText names them."""


def mesh_sizes(plan: Plan) -> dict[str, int]:
    """The size of each of :data:`MESH_AXES` for ``plan``."""
    return dict(zip(MESH_AXES, (plan.pp, plan.replicas, plan.shard_group, plan.cp, plan.tp), strict=True))


@dataclass(frozen=True, slots=True)
class Ring:
    """One phase of a collective: a ring over ``chips`` chips along one physical axis,
    ``stride`` chips apart, using the axis's wraparound link or not (a line)."""

    chips: int
    wraps: bool
    stride: int = 1

    def bandwidth(self, cluster: Cluster) -> float:
        """Achieved bytes per second of the ring: both directions of each link with
        wraparound, one without, shared by the ``stride`` rings interleaved on the axis."""
        link = cluster.intra_node_bandwidth * cluster.intra_node_efficiency
        return link * (2 if self.wraps else 1) / self.stride

    def describe(self) -> str:
        kind = "ring with wraparound" if self.wraps else "line"
        apart = f", {self.stride} apart" if self.stride > 1 else ""
        return f"{self.chips}-chip {kind}{apart}"


@dataclass(frozen=True, slots=True)
class TorusGroup:
    """A communication group on a torus cluster: its ICI ``rings`` (one per physical axis
    it spans, in axis order) inside each of the ``slices`` slices it spans."""

    rings: tuple[Ring, ...]
    slices: int = 1

    @property
    def per_slice(self) -> int:
        return math.prod(r.chips for r in self.rings)

    @property
    def ranks(self) -> int:
        return self.per_slice * self.slices

    def describe(self) -> str:
        inside = " then ".join(r.describe() for r in self.rings) or "one chip"
        across = f", across {self.slices} slices over DCN" if self.slices > 1 else ""
        return f"{self.ranks} chips: {inside} per slice{across}"


def slice_shape(chips: int, cluster: Cluster) -> tuple[int, ...]:
    """The torus shape of a slice of ``chips`` chips: among the shapes within
    ``cluster.torus`` whose axes are powers of two or multiples of ``torus_wrap`` (Google's
    slice shapes: 8 x 16, 8 x 8 x 16, 16 x 16 x 24), the most even one (smallest longest
    axis, then largest shortest), axes in increasing order."""
    return _slice_shape(chips, tuple(sorted(cluster.torus)), cluster.torus_wrap)


@functools.lru_cache(maxsize=256)
def _slice_shape(chips: int, bounds: tuple[int, ...], wrap: int) -> tuple[int, ...]:
    def allowed(n: int) -> bool:
        return n & (n - 1) == 0 or n % wrap == 0

    shapes = [
        shape
        for shape in itertools.product(*(range(1, b + 1) for b in bounds))
        if math.prod(shape) == chips and list(shape) == sorted(shape) and all(allowed(n) for n in shape)
    ]
    if not shapes:
        largest = "x".join(map(str, bounds))
        most = math.prod(bounds)
        if chips > most and chips % most == 0:
            hint = (
                f"a slice holds at most {most} chips: ask for {chips // most} slices of {most} joined by the"
                f" data-center network (--slices {chips // most})"
            )
        elif chips > most:
            hint = f"a slice holds at most {most} chips: give a multiple of a slice's chips and --slices"
        else:
            hint = "give a chip count it can shape"
        raise PlanError(f"no slice of the {largest} torus holds {chips} chips; {hint}")
    return min(shapes, key=lambda s: (max(s), -min(s)))


def mesh_layout(physical: tuple[int, ...], logical: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """How ``create_device_mesh`` lays the ``logical`` mesh (axes by increasing traffic)
    onto the ``physical`` torus: the size of each logical axis on each physical axis,
    ``[physical][logical]``, the physical axes' sizes multiplying to their lengths."""
    return _mesh_layout(physical, logical)


@functools.lru_cache(maxsize=1024)
def _mesh_layout(physical: tuple[int, ...], logical: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    free = list(physical)
    whole: list[tuple[int, ...]] = [() for _ in logical]
    for index in reversed(range(len(logical))):
        size = logical[index]
        # More physical axes first, for the bandwidth of their links.
        for count in range(len(physical), 0, -1):
            found = next(
                (c for c in itertools.combinations(range(len(free)), count) if math.prod(free[i] for i in c) == size),
                None,
            )
            if found is not None:
                whole[index] = found
                free = [0 if i in found else n for i, n in enumerate(free)]
                break
        else:
            if size > 1:
                return _split_layout(physical, logical)
    return tuple(
        tuple(physical[p] if p in whole[index] else 1 for index in range(len(logical))) for p in range(len(physical))
    )


def _split_layout(physical: tuple[int, ...], logical: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """``create_device_mesh``'s layout that splits physical axes: each logical axis, busiest
    first, takes the feasible factors preferring the most chips on whole axes, then the most
    whole axes, then the most on axes already taken, then the largest in reverse lexical order."""
    taken = [[1] * len(logical) for _ in physical]
    for index in reversed(range(len(logical))):
        used = [math.prod(row) for row in taken]
        options = _factor_options(tuple(n // u for n, u in zip(physical, used, strict=True)), logical[index])
        if not options:
            raise PlanError(f"a mesh of {logical} does not lay out on a torus of {physical}")

        def preference(x: tuple[int, ...], used: list[int] = used) -> tuple[int, int, int, tuple[int, ...]]:
            whole = [s for i, s in enumerate(x) if s == physical[i]]
            shared = math.prod(s for i, s in enumerate(x) if used[i] > 1)
            return math.prod(whole), sum(1 for s in whole if s > 1), shared, x

        best = max(options, key=preference)
        for p, size in enumerate(best):
            taken[p][index] = size
    return tuple(tuple(row) for row in taken)


def _factor_options(available: tuple[int, ...], size: int) -> set[tuple[int, ...]]:
    """Every way of taking ``size`` chips as prime factors of the ``available`` axis lengths."""
    primes = _prime_factors(size)
    holders = {p: [a for a, n in enumerate(available) for q in _prime_factors(n) if q == p] for p in set(primes)}
    per_prime = [set(itertools.combinations(holders[p], primes.count(p))) for p in sorted(set(primes))]
    options = set()
    for choice in itertools.product(*per_prime):
        result = [1] * len(available)
        for p, axes in zip(sorted(set(primes)), choice, strict=True):
            for a in axes:
                result[a] *= p
        if all(n % r == 0 for n, r in zip(available, result, strict=True)):
            options.add(tuple(result))
    return options


def _prime_factors(n: int) -> list[int]:
    factors, p = [], 2
    while n > 1 and p * p <= n:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors + ([n] if n > 1 else [])


def dcn_split(plan: Plan, cluster: Cluster) -> tuple[int, int, int]:
    """(pipeline, data, fsdp) degrees across the slices: the pipeline takes as many as its
    degree divides, the data-parallel replicas as many of the rest as theirs divides, the
    shard groups the others; a :class:`PlanError` where they cannot."""
    slices = cluster.slices
    across_pipeline = math.gcd(_pipeline_chips(plan), slices)
    rest = slices // across_pipeline
    across_data = math.gcd(plan.replicas, rest)
    across_fsdp = rest // across_data
    if plan.shard_group % across_fsdp:
        raise PlanError(
            f"pp = {plan.pp} and dp = {plan.dp} cannot span {slices} slices: the pipeline spans {across_pipeline} of "
            f"them and dp must be a multiple of the other {rest}; tensor and context parallelism stay "
            "inside a slice"
        )
    return across_pipeline, across_data, across_fsdp


def _pipeline_chips(plan: Plan) -> int:
    """The chips the pipeline axis spans: pp, or one where the pipeline devices share them."""
    return 1 if plan.shared_devices else plan.pp


def _slice_mesh(plan: Plan, cluster: Cluster) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, int, int]]:
    """(slice shape, the plan's mesh inside one slice, (pipeline, data, fsdp) across slices)."""
    across = dcn_split(plan, cluster)
    inside = (
        _pipeline_chips(plan) // across[0],
        plan.replicas // across[1],
        plan.shard_group // across[2],
        plan.cp,
        plan.tp,
    )
    return slice_shape(plan.gpus // cluster.slices, cluster), inside, across


def torus_group(plan: Plan, axes: tuple[str, ...], cluster: Cluster) -> TorusGroup:
    """The group of one chip's peers along the mesh ``axes`` (names from :data:`MESH_AXES`)."""
    shape, inside, across = _slice_mesh(plan, cluster)
    layout = mesh_layout(shape, inside)
    members = [MESH_AXES.index(a) for a in axes]
    rings = []
    for p, sizes in enumerate(layout):
        chips = math.prod(sizes[m] for m in members)
        if chips == 1:
            continue
        # Inside a physical axis the busier mesh axes run innermost (create_device_mesh's reshape).
        innermost = max(m for m in members if sizes[m] > 1)
        stride = math.prod(s for m, s in enumerate(sizes) if m > innermost)
        whole = chips * stride == shape[p]
        rings.append(Ring(chips, whole and shape[p] % cluster.torus_wrap == 0, stride))
    slices = math.prod(n for axis, n in zip(MESH_AXES, across, strict=False) if axis in axes)
    return TorusGroup(tuple(rings), slices)


def torus_gather_seconds(num_bytes: float, group: TorusGroup, cluster: Cluster) -> float:
    """Seconds of an all-gather or reduce-scatter of ``num_bytes`` (the unsharded size) over
    ``group`` (see the module docstring), with the cluster's fixed cost of a collective."""
    if group.ranks <= 1 or num_bytes <= 0:
        return 0.0
    rings = group.rings
    seconds = cluster.collective_latency_s + sum((r.chips - 1) * cluster.intra_node_latency for r in rings)
    seconds += _ici_seconds(num_bytes, rings, cluster)
    if group.slices > 1:
        m, left = group.slices, num_bytes / group.per_slice
        seconds += (m - 1) * cluster.inter_node_latency + (m - 1) / m * left / cluster.network_share
    return seconds


def _ici_seconds(num_bytes: float, rings: tuple[Ring, ...], cluster: Cluster) -> float:
    """Seconds the ICI links take to move a gather of ``num_bytes`` over ``rings``, every
    axis's links busy at once: the bytes split into one part per axis, each part's phases
    starting on a different axis and going round the others in turn (so each axis carries a
    first phase's full share of one part and later phases' smaller shares of the others);
    the slowest axis sets the time. On n equal axes that is the one-axis time over n, as
    "How to Scale Your Model" (jax-ml/scaling-book, "Sharded Matrices": an AllGather over
    several axes has their bandwidth times the number of axes) prices it."""
    n = len(rings)
    if n == 0:
        return 0.0
    busy = [0.0] * n
    for first in range(n):
        left = num_bytes / n
        for step in range(n):
            axis = (first + step) % n
            ring = rings[axis]
            busy[axis] += (ring.chips - 1) / ring.chips * left / ring.bandwidth(cluster)
            left /= ring.chips
    return max(busy)


def torus_all_reduce_seconds(num_bytes: float, group: TorusGroup, cluster: Cluster) -> float:
    """Seconds of an all-reduce of ``num_bytes`` over ``group``: a reduce-scatter, then an
    all-gather (one fixed cost of a collective)."""
    if group.ranks <= 1 or num_bytes <= 0:
        return 0.0
    return 2 * torus_gather_seconds(num_bytes, group, cluster) - cluster.collective_latency_s


def crosses_slices(a: int, b: int, plan: Plan, cluster: Cluster) -> bool:
    """Whether pipeline devices ``a`` and ``b`` sit in different slices (the pipeline is
    numbered outermost, so each slice holds ``pp / across`` consecutive pipeline devices)."""
    across = dcn_split(plan, cluster)[0]
    per_slice = plan.pp // across
    return a // per_slice != b // per_slice
