"""Mutated and random TOML never crashes the simulator's readers: cost models, model and
cluster descriptions either load or fail with one of our errors, never another exception
and never a hang (each read is bounded by the file's size)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipedsl.errors import PipedslError
from pipedsl.library import load
from pipedsl.simulator.costs import CostModel
from pipedsl.simulator.hardware import load_cluster, load_model

SEED = 20261201
MUTANTS = 300  # per reader

COSTS = """\
forward = [1.0, 1.5]
backward = 2.0
input_grad = 1.0
weight_grad = 1.0
latency = 20e-6
bandwidth = 25e9
activation_bytes = 16000000
gradient_bytes = [8e6]
residual_bytes = 1024
weight_residual_bytes = 0
overlap_sends = true
per_device = false
"""
_VALUES = ["0", "-1", "1e308", "-1e308", "nan", "inf", "-inf", "1e-320", "99999999999999999999", "0.5",
           "true", '"x"', "[]", "[1, 2, 3]", "[[1]]", "{}", "1979-05-27", "'\\xff'", '"\\u00e9"']  # fmt: skip
_BYTES = [b"\xff", b"\xfe\xff", b"\x00", b"\xc3", b"\xe2\x82", b"[", b"]", b"=", b"\n", b'"', b"#", b"."]
_SCHEDULE = load("1f1b", pp=2, microbatches=4)


def _mutate(text: bytes, rng: random.Random) -> bytes:
    lines = text.split(b"\n")
    choice = rng.randrange(6)
    i = rng.randrange(len(lines))
    if choice == 0:  # a value replaced by one of the awkward ones
        key, sep, _ = lines[i].partition(b"=")
        if sep:
            lines[i] = key + b"= " + rng.choice(_VALUES).encode()
    elif choice == 1:
        del lines[i]
    elif choice == 2:
        lines.insert(i, lines[i])
    elif choice == 3:  # bytes inserted, often not UTF-8
        at = rng.randrange(len(lines[i]) + 1)
        lines[i] = lines[i][:at] + rng.choice(_BYTES) + lines[i][at:]
    elif choice == 4:
        at = rng.randrange(len(lines[i]) + 1)
        lines[i] = lines[i][:at] + lines[i][at + rng.randint(1, 4) :]
    else:
        lines[i] = rng.choice([b"[model]", b"[cluster]", b"[costs]", b"key = 1", b"name = 7", b"[[model]]"])
    return b"\n".join(lines)


def _read_costs(path: Path) -> Any:
    costs = CostModel.from_toml(path)
    return costs.resolve(_SCHEDULE)


def _expect_ours(read: Callable[[Path], Any], path: Path) -> str:
    try:
        read(path)
    except PipedslError as err:
        assert str(err)
        return "refused"
    except Exception as err:  # noqa: BLE001 - the point: name any foreign exception
        pytest.fail(f"{type(err).__name__}: {err}\n--- file ---\n{path.read_bytes()!r}")
    return "read"


def _preset(name: str) -> bytes:
    return (Path(__file__).parents[2] / "simulator" / "presets" / f"{name}.toml").read_bytes()


@pytest.mark.parametrize(
    ("label", "original", "read"),
    [
        ("costs", COSTS.encode(), _read_costs),
        ("model", _preset("llama-8b"), load_model),
        ("cluster", _preset("h100-80gb"), load_cluster),
    ],
)
def test_mutated_files_load_or_fail_with_our_error(
    tmp_path: Path, label: str, original: bytes, read: Callable[[Path], Any]
) -> None:
    rng = random.Random(f"{SEED}-{label}")
    path = tmp_path / f"{label}.toml"
    outcomes: dict[str, int] = {}
    for _ in range(MUTANTS):
        text = original
        for _ in range(rng.randint(1, 3)):
            text = _mutate(text, rng)
        path.write_bytes(text)
        outcome = _expect_ours(read, path)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    # Some mutants still load: the mutations are small enough to probe the checks.
    assert outcomes.get("refused", 0) > 0 and outcomes.get("read", 0) > 0, outcomes


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=400))
def test_any_bytes_load_or_fail_with_our_error(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "any.toml"
    path.write_bytes(data)
    for read in (_read_costs, load_model, load_cluster):
        _expect_ours(read, path)
