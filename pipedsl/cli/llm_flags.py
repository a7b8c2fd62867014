"""The options ``estimate`` and ``search`` take for today's LLM plans, and how they are read:
context parallelism, the sharding mode, the framework profile, uneven stages and the
convention MFU is counted by (see docs/plans.md)."""

from __future__ import annotations

import argparse
from typing import Any

from pipedsl.cli.common import positive_int
from pipedsl.simulator.flops import DEFAULT_FLOP_COUNT, FlopCount, flops_per_token
from pipedsl.simulator.frameworks import DEFAULT_FRAMEWORK, FRAMEWORKS
from pipedsl.simulator.hardware import Model
from pipedsl.simulator.plan import ContextExchange, PlanError, Recompute
from pipedsl.simulator.stages import ends_split

__all__ = [
    "add_common_options",
    "add_estimate_options",
    "add_search_options",
    "stage_layers",
    "flops_words",
    "search_mfu",
]


def add_common_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--framework``, ``--mfu-flops`` and ``--no-update-barrier``, which both commands take."""
    parser.add_argument(
        "--framework",
        choices=tuple(FRAMEWORKS),
        help=f"the framework that runs the plan, whose fixed costs are priced (default {DEFAULT_FRAMEWORK} on GPUs,"
        " maxtext on TPU chips)",
    )
    parser.add_argument(
        "--mfu-flops",
        choices=[c.value for c in FlopCount],
        default=DEFAULT_FLOP_COUNT.value,
        help="how MFU counts model FLOPs: 6n (6N per token, the default), palm (6N + 12·L·h·s), "
        "megatron (Narayanan et al.'s eq. 3)",
    )
    parser.add_argument(
        "--no-update-barrier",
        action="store_true",
        help="the optimizer step reads only each device's own gradients (no global-norm clip, no finiteness "
        "check over the model): price a step in a long run, each device's drain overlapping the next warm-up",
    )


def add_estimate_options(plan: argparse._ArgumentGroup) -> None:
    """``estimate``'s: the context-parallel degree and exchange, the sharding choices, the layers per stage."""
    plan.add_argument("--cp", type=positive_int, default=1, metavar="N", help="context-parallel degree (default 1)")
    plan.add_argument(
        "--cp-exchange",
        choices=[c.value for c in ContextExchange],
        default=ContextExchange.RING.value,
        help="how context-parallel ranks exchange keys and values (default ring)",
    )
    plan.add_argument(
        "--reduce-once",
        action="store_true",
        help="ZeRO 2/3: accumulate gradients whole and reduce-scatter them once per step (FSDP without "
        "per-microbatch sync, Megatron's distributed optimizer), not every microbatch",
    )
    plan.add_argument(
        "--keep-weights",
        action="store_true",
        help="ZeRO 3: keep the forward's gathered weights for the backward (FSDP reshard_after_forward=False)",
    )
    plan.add_argument(
        "--stage-layers",
        metavar="L",
        help="layers of each of the pp x vpp stages, comma-separated (e.g. 0,9,9,...,0), or 'ends': the "
        "first and last stage hold only the embedding and the head, the rest an equal share",
    )


def add_search_options(parser: argparse.ArgumentParser) -> None:
    """``search``'s: the context-parallel degrees to try, and how pipeline plans split the layers."""
    parser.add_argument(
        "--cp",
        type=_cp_list,
        metavar="A,B",
        help="context-parallel degrees to try (default: powers of two leaving each rank at least 4,096 tokens)",
    )
    parser.add_argument(
        "--stage-layers",
        choices=("even", "ends"),
        default="ends",
        help="how pipeline plans split the layers where pp x vpp does not divide them: ends (default), first "
        "and last stage hold only the embedding and the head (as Llama 3 405B's 126 layers ran); even leaves "
        "such plans out",
    )


def _cp_list(text: str) -> tuple[int, ...]:
    return tuple(positive_int(part.strip()) for part in text.split(","))


def stage_layers(text: str | None, model: Model, stages: int) -> tuple[int, ...] | None:
    """``--stage-layers``: ``ends`` (first and last stage hold only the embedding and the
    head), or each stage's layers separated by commas or spaces; None when not given."""
    if text is None:
        return None
    if text.strip() == "ends":
        layers = ends_split(model.layers, stages)
        if layers is None:
            raise PlanError(
                f"--stage-layers ends: {model.name}'s {model.layers} layers do not split evenly over the "
                f"{stages - 2} stages between the first and the last (pp × vpp = {stages})"
            )
        return layers
    try:
        return tuple(int(x) for x in text.replace(",", " ").split())
    except ValueError:
        raise PlanError(f"--stage-layers: expected 'ends' or whole numbers separated by commas, got {text!r}") from None


def flops_words(count: FlopCount) -> str:
    """How the MFU's FLOPs were counted, for the output."""
    default = ", the default" if count is DEFAULT_FLOP_COUNT else ""
    words = {FlopCount.SIX_N: "6N", FlopCount.PALM: "PaLM's 6N + 12·L·h·s", FlopCount.MEGATRON: "Megatron's eq. 3"}
    return f"{words[count]} FLOPs{default}"


def search_mfu(rows: list[dict[str, Any]], model: Model, count: FlopCount) -> list[dict[str, Any]]:
    """A search's rows with their ``mfu`` (6N) turned into ``count``'s."""
    if count is DEFAULT_FLOP_COUNT:
        return rows
    six = flops_per_token(model, DEFAULT_FLOP_COUNT)
    return [
        {**row, "mfu": row["mfu"] * (flops_per_token(model, count, recompute=Recompute(row["recompute"])) / six)}
        for row in rows
    ]
