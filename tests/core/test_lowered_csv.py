"""PyTorch's runtime (lowered) CSV: the computations with SEND_F, RECV_F, SEND_B and RECV_B,
named as PyTorch's ``_add_send_recv`` names them (a send by the sending stage, a receive
by the receiving one)."""

from __future__ import annotations

import re

import pytest

from pipedsl.cli import main
from pipedsl.errors import ConversionError
from pipedsl.interop import export, to_csv, to_lowered_csv
from pipedsl.library import load

_COMM = re.compile(r"^(\d+)(SEND|RECV)_([FB])(\d+)$")


def test_1f1b_on_two_devices() -> None:
    assert to_lowered_csv(load("1f1b", pp=2, microbatches=2)) == (
        "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\n1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1B1,1SEND_B1\n"
    )


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("1f1b", {"pp": 4, "microbatches": 8}),
        ("zbv", {"pp": 2, "microbatches": 4}),
        ("interleaved_1f1b", {"pp": 2, "microbatches": 4}),
    ],
)
def test_every_send_has_its_receive_and_computes_keep_their_order(name: str, params: dict[str, int]) -> None:
    schedule = load(name, **params)
    rows = [row.split(",") if row else [] for row in to_lowered_csv(schedule).splitlines()]
    compute_rows = [row.split(",") if row else [] for row in to_csv(schedule).splitlines()]
    sends, recvs = set(), set()
    for device, row in enumerate(rows):
        assert [c for c in row if not _COMM.match(c)] == compute_rows[device]
        for cell in row:
            match = _COMM.match(cell)
            if match is None:
                continue
            stage, what, direction, microbatch = int(match[1]), match[2], match[3], int(match[4])
            owner = stage
            if what == "SEND":
                # The value leaves the sender's stage towards the next (F) or previous (B) one.
                receiver = stage + 1 if direction == "F" else stage - 1
                sends.add((direction, receiver, microbatch))
            else:
                recvs.add((direction, stage, microbatch))
            assert schedule.placement[owner] == device
    assert sends == recvs and sends
    for direction, receiver, _ in sends:
        sender = receiver - 1 if direction == "F" else receiver + 1
        assert schedule.placement[sender] != schedule.placement[receiver]  # no send within a device


def test_only_csv_has_a_lowered_form(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConversionError, match="only csv has a lowered form"):
        export(load("1f1b"), "json", lowered=True)
    assert main(["convert", "1f1b", "-p", "pp=2", "-p", "microbatches=2", "--to", "csv", "--lowered"]) == 0
    assert capsys.readouterr().out.startswith("0F0,0SEND_F0,")
