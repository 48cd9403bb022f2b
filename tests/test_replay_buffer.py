"""dqn.py's replay buffer against plain Python/NumPy references: wrap-around, uniform sampling of
filled slots only, independence across vmapped seeds."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_algorithm

OBS_DIM = 3


@pytest.fixture(scope="module")
def dqn():
    return load_algorithm("dqn")


def transitions(first: int, n: int, dqn):
    """n transitions numbered first, first+1, ...: every field encodes the number."""
    ids = np.arange(first, first + n)
    return dqn.Transition(
        obs=jnp.asarray(np.repeat(ids[:, None], OBS_DIM, 1), jnp.float32),
        action=jnp.asarray(ids % 5, jnp.int32),
        reward=jnp.asarray(ids * 0.5, jnp.float32),
        terminated=jnp.asarray(ids % 3 == 0),
        final_obs=jnp.asarray(np.repeat(ids[:, None] + 1000, OBS_DIM, 1), jnp.float32),
    )


def fill(dqn, capacity, batches, n):
    """`batches` adds of n numbered transitions each, through a jitted buffer_add."""
    add = jax.jit(dqn.buffer_add)
    buffer = dqn.buffer_init(capacity, (OBS_DIM,), jnp.float32)
    for b in range(batches):
        buffer = add(buffer, transitions(b * n, n, dqn))
    return jax.device_get(buffer)


@pytest.fixture(scope="module")
def sample_many(dqn):
    """buffer_sample with many independent keys."""

    def sample(buffer, batch, draws, seed=0):
        keys = jax.random.split(jax.random.PRNGKey(seed), draws)
        draw = functools.partial(dqn.buffer_sample, batch_size=batch)
        return jax.device_get(jax.jit(jax.vmap(draw, (None, 0)))(buffer, keys))

    return sample


@pytest.mark.parametrize("capacity, n, batches", [(7, 3, 5), (12, 4, 3), (10, 10, 3), (5, 1, 13), (100, 3, 4)])
def test_add_wraps_around(dqn, capacity, n, batches):
    buffer = fill(dqn, capacity, batches, n)
    # Reference: a Python list of slots written one transition after the other.
    slots, position = [None] * capacity, 0
    for i in range(batches * n):
        slots[position] = i
        position = (position + 1) % capacity
    filled = [s for s in slots if s is not None]
    assert int(buffer.position) == position
    assert int(buffer.size) == len(filled) == min(batches * n, capacity)
    ids = np.array([-1 if s is None else s for s in slots])
    data = buffer.data
    assert data.obs.shape == data.final_obs.shape == (capacity, OBS_DIM)
    assert data.action.shape == data.reward.shape == data.terminated.shape == (capacity,)
    assert data.action.dtype == np.int32 and data.terminated.dtype == bool and data.obs.dtype == np.float32
    f = ids >= 0
    np.testing.assert_array_equal(data.obs[f, 0], ids[f])
    np.testing.assert_array_equal(data.final_obs[f, 0], ids[f] + 1000)
    np.testing.assert_array_equal(data.action[f], ids[f] % 5)
    np.testing.assert_array_equal(data.reward[f], ids[f] * 0.5)
    np.testing.assert_array_equal(data.terminated[f], ids[f] % 3 == 0)
    np.testing.assert_array_equal(data.obs[~f], 0)  # never written


def test_sample_shapes_and_consistent_rows(dqn, sample_many):
    buffer = fill(dqn, 50, 4, 6)
    batch = sample_many(buffer, 16, 3)
    assert batch.obs.shape == batch.final_obs.shape == (3, 16, OBS_DIM)
    assert batch.action.shape == batch.reward.shape == batch.terminated.shape == (3, 16)
    ids = batch.obs[..., 0]
    # Every field of a sampled row comes from the same transition.
    np.testing.assert_array_equal(batch.final_obs[..., 0], ids + 1000)
    np.testing.assert_array_equal(batch.action, ids % 5)
    np.testing.assert_array_equal(batch.reward, ids * 0.5)
    np.testing.assert_array_equal(batch.terminated, ids % 3 == 0)


@pytest.mark.parametrize(
    "capacity, n, batches, batch",
    [
        (100, 10, 3, 8),  # partly filled: 30 of 100 slots, 8 does not divide 30
        (64, 5, 7, 16),  # partly filled: 35 of 64
        (30, 4, 11, 8),  # wrapped around: full, the newest data overwrote the oldest
    ],
)
def test_sampling_is_uniform_over_filled_slots_only(dqn, sample_many, capacity, n, batches, batch):
    buffer = fill(dqn, capacity, batches, n)
    size = int(buffer.size)
    stored = set(buffer.data.obs[:size, 0].astype(int).tolist())
    draws = 20_000
    ids = sample_many(buffer, batch, draws).obs[..., 0].astype(int)
    assert set(np.unique(ids).tolist()) == stored, "must draw every filled slot and nothing else"
    # No transition twice in one batch (the buffer holds more than a batch).
    assert all(len(set(row)) == batch for row in ids[:2000].tolist())
    # Every stored transition equally likely: counts within 5 standard deviations of draws * batch / size.
    counts = np.array([np.sum(ids == i) for i in sorted(stored)])
    p = batch / size
    expected, sd = draws * p, np.sqrt(draws * p * (1 - p))
    assert np.abs(counts - expected).max() < 5 * sd, (counts.min(), counts.max(), expected)


def test_sampling_before_a_batch_is_stored(dqn, sample_many):
    """Fewer stored transitions than a batch: repeats are unavoidable, but only filled slots."""
    buffer = fill(dqn, 100, 1, 5)
    ids = sample_many(buffer, 16, 500).obs[..., 0]
    assert set(np.unique(ids).astype(int).tolist()) == set(range(5))


def test_seeds_have_independent_buffers_under_vmap(dqn):
    """Two runs' buffers, vmapped: each is written and sampled as if it were alone."""
    capacity, n, batch = 20, 3, 6
    add = jax.jit(jax.vmap(dqn.buffer_add))
    sample = jax.jit(jax.vmap(functools.partial(dqn.buffer_sample, batch_size=batch)))
    buffers = jax.vmap(lambda _: dqn.buffer_init(capacity, (OBS_DIM,), jnp.float32))(jnp.arange(2))
    for b in range(9):  # wraps around
        data = [transitions(b * n, n, dqn), transitions(5000 + b * n, n, dqn)]
        buffers = add(buffers, jax.tree.map(lambda *x: jnp.stack(x), *data))
    keys = jax.random.split(jax.random.PRNGKey(3), 2)
    batches = jax.device_get(sample(buffers, keys))
    assert (batches.obs[0] < 5000).all() and (batches.obs[1] >= 5000).all()

    alone = fill(dqn, capacity, 9, n)  # seed 0's data, on its own
    want = jax.device_get(jax.jit(dqn.buffer_sample, static_argnums=2)(alone, keys[0], batch))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(lambda x: x[0], batches), want)
    # Seed 1 given seed 0's key draws the same slots, from its own data.
    other = jax.device_get(sample(buffers, keys[::-1]))
    np.testing.assert_array_equal(other.obs[1, :, 0] - 5000, want.obs[:, 0])
    # Changing seed 1's data leaves seed 0's samples alone.
    changed = buffers._replace(data=buffers.data._replace(obs=buffers.data.obs.at[1].set(-1.0)))
    again = jax.device_get(sample(changed, keys))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(lambda x: x[0], again), want)
    assert (again.obs[1] == -1).all()
