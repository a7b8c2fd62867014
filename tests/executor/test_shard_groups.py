"""Shard groups (``RunOptions.fsdp``): the dp devices of a pipeline device form dp / fsdp
groups that each shard the ZeRO state (mesh axis ``"data"``), replicas of one another
(``"replica"``) whose gradient shards are all-reduced across them: FSDP inside a TPU slice or
a GPU node and data parallelism across them (MaxText's ``ici_fsdp`` x ``dcn_data``, PyTorch's
HSDP), as the planner prices ``Plan.fsdp``."""

from __future__ import annotations

import re

import jax
import pytest

from helpers import HYBRID_ADAM, assert_relative_close, assert_trees_close, hybrid, hybrid_problem, hybrid_schedule
from pipedsl.cli import main
from pipedsl.run_options import RunOptions, RunOptionsError

COLLECTIVE = re.compile(r"\b(all-reduce|reduce-scatter|all-gather)(-start)?\(")


@pytest.mark.parametrize(("pp", "zero", "reduce_once"), [(1, 3, False), (2, 2, True)])
def test_shard_groups_match_value_and_grad_and_one_group(pp: int, zero: int, reduce_once: bool) -> None:
    schedule = hybrid_schedule("1f1b" if pp > 1 else "gpipe", pp, 1)
    dp = 4
    _, params, batch, ref_loss, ref_grads = hybrid_problem("explicit", schedule.num_stages, dp)
    grouped = hybrid("explicit", schedule, dp=dp, fsdp=dp // 2, tp=1, zero=zero, reduce_once=reduce_once)
    result = grouped.step(params, batch)
    assert abs(float(result.loss) - float(ref_loss)) < 1e-5 * abs(float(ref_loss))
    assert_relative_close(result.grads, ref_grads)
    # One Adam step updates the parameters as ZeRO over all of dp does.
    flat = hybrid("explicit", schedule, dp=dp, tp=1, zero=zero, reduce_once=reduce_once)
    p_grouped, _, _ = grouped.train_step(params, None, batch, optimizer=HYBRID_ADAM)
    p_flat, _, _ = flat.train_step(params, None, batch, optimizer=HYBRID_ADAM)
    assert_trees_close(grouped.gather(p_grouped), flat.gather(p_flat), atol=1e-6)
    # The optimizer state is sharded over "data" (the group) and whole over "replica".
    big = max(jax.tree_util.tree_leaves(grouped.backend.workers[0].states[0]), key=lambda leaf: leaf.size)
    assert "data" in str(big.sharding.spec) and "replica" not in str(big.sharding.spec)
    assert big.sharding.mesh.shape == {"replica": 2, "data": dp // 2, "context": 1, "tensor": 1}


def test_a_shard_groups_reduction_crosses_the_replicas() -> None:
    schedule = hybrid_schedule("gpipe", 1, 1)
    _, params, batch, _, _ = hybrid_problem("explicit", 1, 4)
    (grouped,) = hybrid("explicit", schedule, dp=4, fsdp=2, tp=1, zero=2, reduce_once=True).compile(params, batch)
    (flat,) = hybrid("explicit", schedule, dp=4, tp=1, zero=2, reduce_once=True).compile(params, batch)
    # Reduced once per step: a reduce-scatter inside the group, then an all-reduce of the shards
    # across the replicas; over one group of all four, the reduce-scatter alone.
    found = [m.group(1) for m in COLLECTIVE.finditer(grouped.compiled_hlo()["reduce"])]
    assert found == ["reduce-scatter", "all-reduce"]
    assert [m.group(1) for m in COLLECTIVE.finditer(flat.compiled_hlo()["reduce"])] == ["reduce-scatter"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"dp": 4, "fsdp": 3, "zero": 3}, "fsdp must be a whole number dividing dp=4"),
        ({"dp": 4, "fsdp": 2, "zero": 0}, "zero=0 shards nothing"),
        ({"dp": 4, "fsdp": True, "zero": 3}, "fsdp must be a whole number"),
    ],
)
def test_shard_groups_are_checked(options: dict[str, int], message: str) -> None:
    with pytest.raises(RunOptionsError, match=message):
        RunOptions(**options)
    assert RunOptions(dp=4, fsdp=4, zero=3).fsdp is None  # one group of all dp: no groups
    assert RunOptions(dp=4, fsdp=2, zero=3).replicas == 2


def _losses(capsys: pytest.CaptureFixture[str], *flags: str) -> list[float]:
    args = ["run", "1f1b", "-p", "pp=1", "-p", "microbatches=2", "--model", "transformer", "--width", "16"]
    assert main([*args, "--steps", "3", "--microbatch-size", "2", "--dp", "4", "--zero", "3", *flags]) == 0
    out = capsys.readouterr().out
    return [float(line.split()[1]) for line in out.splitlines() if line.strip().startswith(("1 ", "2 ", "3 "))]


def test_pipedsl_run_trains_shard_groups_as_one_group(capsys: pytest.CaptureFixture[str]) -> None:
    grouped = _losses(capsys, "--fsdp", "2")
    flat = _losses(capsys)
    assert len(grouped) == 3 and grouped[2] < grouped[0]
    assert grouped == pytest.approx(flat, rel=1e-5)
