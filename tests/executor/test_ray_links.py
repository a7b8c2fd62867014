"""The Ray backend's transfer links (:mod:`pipedsl.executor.ray_links`), without Ray.

Two transfer servers in this process stand for two actors: values move between meshes of
different forced CPU devices exactly as they move between actors' processes.
"""

from __future__ import annotations

import datetime
import itertools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import transfer
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pipedsl.executor.errors import ExecutionError, PeerFailed
from pipedsl.executor.ray_links import Links, channel_of, layout_of, structs, transfer_id
from pipedsl.executor.ray_transport import Mailbox, RayTransport
from pipedsl.program import Buffer, BufferKind


@pytest.fixture(scope="module")
def links() -> tuple[Links, Links]:
    a, b = Links("127.0.0.1"), Links("127.0.0.1")
    for end in (a, b):
        end.meet((a.address, b.address))
    return a, b


def _meshes() -> tuple[Mesh, Mesh]:
    devices = jax.devices()
    return Mesh(np.array(devices[:2]), ("data",)), Mesh(np.array(devices[2:4]), ("data",))


def test_a_value_moves_to_the_other_mesh_with_its_specs(links: tuple[Links, Links]) -> None:
    sender, receiver = links
    here, there = _meshes()
    split = jax.device_put(jnp.arange(12.0).reshape(6, 2), NamedSharding(here, PartitionSpec("data")))
    whole = jax.device_put(jnp.array([1.0, 2.0, 3.0]), NamedSharding(here, PartitionSpec()))
    layout = layout_of((split, whole))
    assert layout == (((6, 2), "float32", PartitionSpec("data")), ((3,), "float32", PartitionSpec()))
    sender.server.await_pull(7, [split, whole])
    got = receiver.connection(0).pull(7, list(structs(layout, there)))
    for moved, original in zip(got, (split, whole), strict=True):
        np.testing.assert_array_equal(np.asarray(moved), np.asarray(original))
        assert moved.sharding.device_set == set(there.devices.flat)
        assert moved.sharding.spec == original.sharding.spec


def test_an_error_offered_in_place_of_a_value_reaches_its_puller(links: tuple[Links, Links]) -> None:
    # What a failing device offers for the values it will never send.
    sender, receiver = links
    here, there = _meshes()
    layout = (((4,), "float32", PartitionSpec()),)
    sender.server.await_pull(8, [transfer.make_error_array(s, "device 0 failed") for s in structs(layout, here)])
    got = receiver.connection(0).pull(8, list(structs(layout, there)))
    with pytest.raises(Exception, match="device 0 failed"):
        jax.block_until_ready(got)


def test_only_arrays_with_named_shardings_have_a_layout() -> None:
    here, _ = _meshes()
    placed = jax.device_put(jnp.ones(2), NamedSharding(here, PartitionSpec()))
    assert layout_of((placed,)) is not None
    assert layout_of((np.ones(2),)) is None
    assert layout_of((placed, 1.0)) is None
    assert layout_of(()) is None
    assert layout_of([placed]) is None


def test_channels_cover_activations_and_input_gradients_only() -> None:
    act = Buffer(BufferKind.ACTIVATION, 3, 5)
    assert channel_of(1, 2, 0, 1, act) == channel_of(1, 2, 0, 1, Buffer(BufferKind.ACTIVATION, 3, 9))
    assert channel_of(1, 2, 0, 1, act) != channel_of(1, 2, 0, 1, Buffer(BufferKind.GRADIENT, 3, 5))
    assert channel_of(1, 2, 0, 1, Buffer(BufferKind.RESIDUAL, 3, 5)) is None
    assert channel_of(1, 2, 0, 1, ("grad", 3, 0)) is None
    # Beyond what a transfer id holds: sent as actor calls.
    assert channel_of(1, 2, 0, 256, act) is None
    assert channel_of(1, 2, 0, 1, Buffer(BufferKind.ACTIVATION, 1024, 0)) is None
    assert channel_of(1, 2, 0, 1, Buffer(BufferKind.ACTIVATION, 0, 1 << 16)) is None


def test_transfer_ids_differ_for_every_step_receiver_and_buffer() -> None:
    kinds = (BufferKind.ACTIVATION, BufferKind.GRADIENT)
    grid = itertools.product((0, 1, 2**27 - 1), (0, 1, 255), kinds, (0, 1, 1023), (0, 1, 65535))
    ids = [transfer_id(step, dst, Buffer(kind, stage, m)) for step, dst, kind, stage, m in grid]
    assert len(set(ids)) == len(ids)
    assert all(0 <= i < 2**63 for i in ids)


def test_equal_placements_have_equal_layouts() -> None:
    # A value may come with another spec that places it the same (axes of size 1).
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(2, 1), ("data", "tensor"))
    x = jnp.ones((4, 2))

    def layout(*spec: object) -> object:
        return layout_of((jax.device_put(x, NamedSharding(mesh, PartitionSpec(*spec))),))

    assert layout("data") == layout("data", "tensor") == layout(("data", "tensor")) == layout("data", None)
    assert layout(None, "tensor") == layout()
    assert layout("data") != layout()


# -- a receive by transfer whose value never comes --------------------------------------

_PULLED = (((4,), "float32", PartitionSpec()),)  # the layout of the value pulled below


def _receiver(links: tuple[Links, Links], key: Buffer, *, step: int, timeout: float) -> tuple[RayTransport, Mailbox]:
    """Device 1's end of a step in which ``key`` comes from device 0 by transfer."""
    _, receiver = links
    _, there = _meshes()
    channel = channel_of(0, 0, 0, 1, key)
    assert channel is not None
    receiver.learned[channel] = (step - 1, structs(_PULLED, there))
    mailbox = Mailbox(receiver.learned)
    mailbox.begin(step)
    transport = RayTransport(
        1,
        step,
        mailbox,
        (),
        receiver,
        mesh=there,
        pipeline=(0, 0),
        planned=(),
        expected=((key, 0),),
        recording=False,
        timeout=timeout,
    )
    return transport, mailbox


def _offer_error(links: tuple[Links, Links], key: Buffer, *, step: int) -> None:
    """What device 0's abort offers in place of ``key``: the pull device 1 left pending
    completes (a pull cannot be cancelled; one pending when the process ends aborts it)."""
    sender, _ = links
    here, _ = _meshes()
    wanted = structs(_PULLED, here)
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=60)
    sender.server.await_pull(transfer_id(step, 1, key), [transfer.make_error_array(s, "step over") for s in wanted], timeout=deadline)


def test_a_pull_never_offered_ends_at_the_receive_timeout(links: tuple[Links, Links]) -> None:
    key = Buffer(BufferKind.ACTIVATION, 0, 0)
    transport, _ = _receiver(links, key, step=101, timeout=0.5)
    start = time.monotonic()
    try:
        with pytest.raises(ExecutionError, match="device 1 waited 0.5 s for .* from device 0, which never sent it"):
            transport.recv(key, 0, timeout=0.5)
        assert 0.5 <= time.monotonic() - start < 5
    finally:
        _offer_error(links, key, step=101)


def test_a_failure_elsewhere_ends_a_pull_at_once(links: tuple[Links, Links]) -> None:
    # A pull cannot be cancelled: the receive stops waiting when the step fails.
    key = Buffer(BufferKind.GRADIENT, 1, 2)
    transport, mailbox = _receiver(links, key, step=102, timeout=60)
    threading.Timer(0.2, mailbox.fail, (102, "device 0 failed")).start()
    start = time.monotonic()
    try:
        with pytest.raises(PeerFailed, match="device 1 stopped waiting for .* from device 0: device 0 failed"):
            transport.recv(key, 0, timeout=60)
        assert time.monotonic() - start < 5
    finally:
        _offer_error(links, key, step=102)


def test_a_first_value_that_arrives_before_its_step_begins_is_taken_from_the_mailbox(
    links: tuple[Links, Links],
) -> None:
    # The sender began step 5 first: the channel's first value, which carries its layout,
    # is in this device's mailbox before this device's step 5 begins. The channel is known
    # then, yet this step's first value did not come by transfer.
    _, receiver = links
    _, there = _meshes()
    key = Buffer(BufferKind.ACTIVATION, 0, 0)
    channel = channel_of(7, 0, 0, 1, key)
    value = (jax.device_put(jnp.arange(4.0), NamedSharding(there, PartitionSpec())),)
    layout = layout_of(value)
    assert channel is not None and layout is not None
    mailbox = Mailbox(receiver.learned)
    mailbox.put(5, 0, key, value, learn=(channel, structs(layout, there)))
    transport = RayTransport(
        1, 5, mailbox, (), receiver, mesh=there, pipeline=(7, 0), planned=(), expected=((key, 0),), recording=False, timeout=2
    )
    mailbox.begin(5)
    got = transport.recv(key, 0, timeout=2)
    np.testing.assert_array_equal(np.asarray(got[0]), np.arange(4.0))
