"""The local backend's transport between pipeline devices of this process."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pipedsl.executor.local.exchange import Handoff, LocalExchange, resharder
from pipedsl.executor.runtime.scheduler import NOTHING, Receive
from pipedsl.program import Buffer, BufferKind

ACT = Buffer(BufferKind.ACTIVATION, 0, 0)


def _meshes(shape: tuple[int, int] = (1, 1)) -> list[Mesh]:
    size = shape[0] * shape[1]
    devices = jax.devices()
    return [Mesh(np.array(devices[d * size : (d + 1) * size]).reshape(shape), ("data", "tensor")) for d in range(2)]


def _exchange(meshes: list[Mesh], *, copy: bool = False, by_host: bool = True) -> LocalExchange:
    return LocalExchange([resharder(m, copy=copy, by_host=by_host) for m in meshes])


def _received(exchange: LocalExchange, key: object, timeout: float = 30.0) -> object:
    """What device 1 receives as ``key`` from device 0, taking a hand-over still being
    computed as the scheduler does once nothing else can go on."""
    got = exchange.take(Receive(key, 0), 1)
    return got.take(timeout) if isinstance(got, Handoff) else got


def _on(x: jax.Array, mesh: Mesh, spec: PartitionSpec = PartitionSpec()) -> jax.Array:
    return jax.block_until_ready(jax.device_put(x, NamedSharding(mesh, spec)))


def test_a_computed_buffer_between_cpu_devices_comes_through_host_memory() -> None:
    meshes = _meshes()
    exchange = _exchange(meshes)
    x = _on(jnp.arange(6.0).reshape(2, 3), meshes[0])
    exchange.endpoint(0).send(ACT, (x,), 1, stage=0)
    (got,) = _received(exchange, ACT)
    # A host array (a view of the sender's buffer), which the receiver's stage program
    # copies in as it is dispatched.
    assert isinstance(got, np.ndarray)
    np.testing.assert_array_equal(got, np.arange(6.0).reshape(2, 3))
    consume = jax.jit(lambda v: v * 2.0, in_shardings=NamedSharding(meshes[1], PartitionSpec()))
    out = consume(got)
    assert out.devices() == set(meshes[1].devices.flat)
    np.testing.assert_array_equal(out, 2.0 * np.arange(6.0).reshape(2, 3))


def _still_computing(mesh: Mesh) -> jax.Array:
    a = _on(jnp.eye(1024) * 0.5, mesh)
    # Several large products: the dispatch returns long before the result is computed.
    y = jax.jit(lambda m: m @ m @ m @ m @ m)(a)
    assert not y.is_ready()
    return y


def test_a_buffer_still_being_computed_is_waited_for_and_comes_through_host_memory() -> None:
    # Host arrays either way: a stage program compiles once for host arguments and once
    # more for device arrays.
    meshes = _meshes()
    exchange = _exchange(meshes)
    exchange.endpoint(0).send(ACT, (_still_computing(meshes[0]),), 1, stage=0)
    (got,) = _received(exchange, ACT)
    assert isinstance(got, np.ndarray)
    np.testing.assert_allclose(got[:2, :2], np.eye(2) / 32)


def test_taking_a_buffer_still_being_computed_leaves_the_wait_to_the_caller() -> None:
    meshes = _meshes()
    exchange = _exchange(meshes)
    exchange.endpoint(0).send(ACT, (_still_computing(meshes[0]),), 1, stage=0)
    pending = exchange.take(Receive(ACT, 0), 1)
    assert isinstance(pending, Handoff)
    (got,) = pending.take(30.0)
    assert isinstance(got, np.ndarray)
    np.testing.assert_allclose(got[:2, :2], np.eye(2) / 32)


def test_values_that_are_not_program_buffers_stay_on_devices() -> None:
    # Parameters handed out after an update are kept resident: never host arrays.
    meshes = _meshes()
    exchange = _exchange(meshes)
    leaf = _on(jnp.ones(3), meshes[0])
    exchange.endpoint(0).send(("param", 1, 0), leaf, 1, stage=0)
    got = _received(exchange, ("param", 1, 0))
    assert isinstance(got, jax.Array) and got.devices() == set(meshes[1].devices.flat)


def test_a_sharded_buffer_keeps_its_sharding_on_the_receivers_mesh() -> None:
    meshes = _meshes((2, 1))
    exchange = _exchange(meshes)
    x = _on(jnp.arange(8.0).reshape(4, 2), meshes[0], PartitionSpec("data"))
    exchange.endpoint(0).send(ACT, (x,), 1, stage=0)
    (got,) = _received(exchange, ACT)
    assert got.sharding == NamedSharding(meshes[1], PartitionSpec("data"))
    np.testing.assert_array_equal(got, np.arange(8.0).reshape(4, 2))


def test_a_value_not_sent_yet_is_nothing_and_arrivals_say_what_came() -> None:
    exchange = _exchange(_meshes())
    assert exchange.take(Receive(("grad", 0, 3), 0), 1) is NOTHING
    exchange.endpoint(0).send(("grad", 0, 3), jnp.ones(2), 1, stage=0)
    assert exchange.arrivals() == [(("grad", 0, 3), 1)] and exchange.arrivals() == []


def test_without_host_transfers_a_buffer_still_being_computed_is_copied_and_not_waited_for() -> None:
    # The accelerators' path: the copy is queued behind the computation, nothing waits.
    meshes = _meshes()
    exchange = _exchange(meshes, by_host=False)
    exchange.endpoint(0).send(ACT, (_still_computing(meshes[0]),), 1, stage=0)
    (got,) = exchange.take(Receive(ACT, 0), 1)
    assert isinstance(got, jax.Array) and got.devices() == set(meshes[1].devices.flat)
    np.testing.assert_allclose(np.asarray(got)[:2, :2], np.eye(2) / 32)


def test_pipeline_devices_on_the_same_devices_copy_what_they_send_when_asked_to() -> None:
    # A step dispatched apart on shared devices copies as devices of their own would.
    devices = jax.devices()[:1]
    meshes = [Mesh(np.array(devices).reshape(1, 1), ("data", "tensor")) for _ in range(2)]
    x = _on(jnp.arange(4.0), meshes[0])
    for copy, same in ((False, True), (True, False)):
        exchange = _exchange(meshes, copy=copy, by_host=False)
        exchange.endpoint(0).send(ACT, (x,), 1, stage=0)
        (got,) = exchange.take(Receive(ACT, 0), 1)
        assert (got is x) == same
        np.testing.assert_array_equal(got, np.arange(4.0))
