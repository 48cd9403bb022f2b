"""ppo_trxl.py: the attention mask against a NumPy reference, no memory crossing an episode start (in the
replayed window, in acting), the rollout and the greedy policy against a plain loop that steps one env at a time
with a memory it resets itself, the update replaying exactly what acted (ratio 1 on every sample), the positional
encodings and the longer MemoryChains.

The checks every algorithm shares (vmap, determinism, sweeps, chunking, the command line) live in
tests/test_train.py and tests/test_cli.py; memory against no memory on CartPole without velocities is
tests/test_learning.py's check for this file. Each compiled program here is built once per module.
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TERMINATED, TRUNCATED, load_algorithm, short_episodes


@pytest.fixture(scope="module")
def trxl():
    module = load_algorithm("ppo_trxl")
    module.validate(module.Config())  # registers MEMORY_ENVS with gymnax, as make_train does first
    return module


def small_config(trxl, **changes):
    """Two gated, normalised layers of width 8, two heads, a memory of 3 steps: shorter than the hand-made windows."""
    defaults = dict(embed_size=8, num_heads=2, num_layers=2, memory_len=3, gating=True, layer_norm=True)
    return trxl.Config(**{**defaults, **changes})


@pytest.fixture(scope="module")
def short(trxl):
    """3 updates of 8 envs x 20 steps, one epoch of one minibatch each, time limit conftest.SHORT_LIMIT."""
    config = small_config(
        trxl, num_envs=8, num_steps=20, total_timesteps=8 * 20 * 3, num_minibatches=1, update_epochs=1, num_seeds=1
    )
    return config, trxl.make_train(config, short_episodes(trxl, config.num_envs))


def init_params(trxl, config, key=0, obs_dim=2):
    """Parameters with every weight drawn at random (the zero-initialised relative bias and the small actor
    output too), so that each position and each gate matters."""
    network = trxl.make_networks(config, 2, (obs_dim,)).actor_critic
    first = (trxl.initial_memory(config, 1), jnp.zeros((1, 1, obs_dim)), jnp.ones((1, 1), bool))
    params = network.init(jax.random.PRNGKey(key), *first)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(key + 100), len(leaves))
    leaves = [0.5 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves, strict=True)]
    return network, jax.tree.unflatten(tree, leaves)


def hand_made_window(config, seed=0, obs_dim=2):
    """conftest's [T=6, N=5] boundary patterns as episode starts (the obs after a done begins a new episode; envs 1
    and 3 also begin one at t=0), random observations, and a random memory before the window whose steps are valid
    in patterns of their own (env 4's none)."""
    done = TERMINATED | TRUNCATED
    start = np.concatenate([np.array([[False, True, False, True, False]]), done[:-1]]).astype(bool)
    rng = np.random.default_rng(seed)
    obs = rng.normal(size=(*start.shape, obs_dim)).astype(np.float32)
    N, M = start.shape[1], config.memory_len
    cache = rng.normal(size=(N, config.num_layers, M, config.embed_size)).astype(np.float32)
    valid = np.array([[1, 1, 1], [0, 1, 1], [0, 0, 1], [1, 1, 1], [0, 0, 0]], bool)[:, -M:]
    memory = (cache, valid, rng.integers(0, 9, size=N).astype(np.int32))
    return memory, obs, start


# --------------------------------------------------------------------------------------
# The mask, positions and no memory across an episode start
# --------------------------------------------------------------------------------------
def numpy_mask(valid, start):
    """Which keys (the memory's M steps, then the window's T) window step i attends to, step by step: a memory
    step if it is valid and no episode began in steps 0..i, within M steps back; a window step j <= i if no episode
    began in steps j+1..i, within M steps back."""
    N, M = valid.shape
    T = start.shape[0]
    mask = np.zeros((N, T, M + T), bool)
    for n in range(N):
        for i in range(T):
            for key in range(M + T):
                j = key - M  # the key's step, counted from the window's first (the memory's are negative)
                if not 0 <= i - j <= M:
                    continue
                if j < 0:
                    mask[n, i, key] = valid[n, key] and not start[: i + 1, n].any()
                else:
                    mask[n, i, key] = not start[j + 1 : i + 1, n].any()
    return mask


@pytest.mark.parametrize("memory_len", [1, 3, 8])
def test_attention_mask_matches_numpy(trxl, memory_len):
    """Starts mid-window, at the first step and not at all, memories valid in part; M shorter and longer than T."""
    config = small_config(trxl, memory_len=memory_len)
    _, _, start = hand_made_window(config)
    valid = np.random.default_rng(memory_len).random((start.shape[1], memory_len)) < 0.7
    valid[:, -1] = True  # a memory is valid from some step on: once invalid, older steps are too
    valid = np.flip(np.cumprod(np.flip(valid, -1), -1), -1).astype(bool)
    got = np.asarray(trxl.attention_mask(jnp.asarray(valid), jnp.asarray(start)))
    want = numpy_mask(valid, start)
    np.testing.assert_array_equal(got, want)
    assert want[:, np.arange(start.shape[0]), np.arange(start.shape[0]) + memory_len].all()  # itself, always
    assert (want[..., :memory_len].any() or memory_len == 1) and not want.all()


def test_positions_and_sinusoids_match_numpy(trxl):
    config = small_config(trxl)
    (_, _, step), _, start = hand_made_window(config)
    got = np.asarray(trxl.episode_steps(jnp.asarray(step), jnp.asarray(start)))
    want = np.zeros(start.shape, int)
    for n in range(start.shape[1]):
        position = step[n]
        for t in range(start.shape[0]):
            position = 0 if start[t, n] else position
            want[t, n], position = position, position + 1
    np.testing.assert_array_equal(got, want)
    position = np.arange(50)
    angle = position[:, None] / 10_000 ** (np.arange(0, 6, 2) / 6)
    np.testing.assert_allclose(
        trxl.sinusoids(jnp.asarray(position), 6), np.concatenate([np.sin(angle), np.cos(angle)], -1), atol=1e-5
    )


@pytest.mark.parametrize("positional_encoding", ["relative", "absolute", "none"])
@pytest.mark.parametrize(("gating", "layer_norm"), [(False, False), (True, True)])
def test_no_memory_crosses_an_episode_start(trxl, positional_encoding, gating, layer_norm):
    """Everything before each env's last episode start (the memory, earlier observations) changed at random: every
    output from that start on stays the same, and outputs before it move."""
    config = small_config(trxl, positional_encoding=positional_encoding, gating=gating, layer_norm=layer_norm)
    network, params = init_params(trxl, config, key=1)
    (cache, valid, step), obs, start = hand_made_window(config)
    T, N = start.shape
    last_start = np.array([max([t for t in range(T) if start[t, n]], default=-1) for n in range(N)])
    after = np.arange(T)[:, None] >= last_start[None]  # [T, N]: in the last episode (all of env 4's window)
    assert (last_start > 0).sum() >= 2

    def outputs(cache, obs):
        memory = trxl.Memory(jnp.asarray(cache), jnp.asarray(valid), jnp.asarray(step))
        return [np.asarray(x) for x in jax.jit(network.apply)(params, memory, jnp.asarray(obs), jnp.asarray(start))]

    rng = np.random.default_rng(5)
    changed_obs = np.where(after[..., None], obs, rng.normal(size=obs.shape).astype(np.float32))
    started = last_start >= 0  # env 4 began no episode in the window: its memory is all it has (none valid)
    changed_cache = np.where(started[:, None, None, None], rng.normal(size=cache.shape).astype(np.float32), cache)
    for got, want in zip(outputs(changed_cache, changed_obs), outputs(cache, obs), strict=True):
        np.testing.assert_array_equal(got[after], want[after])
        assert (np.abs(got[~after] - want[~after]) > 0).any()


def numpy_layer(p, x, memory, mask, gating, layer_norm):
    """Layer in float64 NumPy: layer norm, attention of the window's steps over the memory and the window with the
    relative bias of each key's distance back (query step minus key step), masked; the gated or plain residual; the
    MLP on normalised inputs, gated or added."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    sigmoid = lambda a: 1 / (1 + np.exp(-a))  # noqa: E731

    def norm(y, q):
        if not layer_norm:
            return y
        return (y - y.mean(-1, keepdims=True)) / np.sqrt(y.var(-1, keepdims=True) + 1e-6) * q["scale"] + q["bias"]

    def gate(q, x, y):
        D = x.shape[-1]
        wy, ux = y @ q["Dense_0"]["kernel"], x @ q["Dense_1"]["kernel"]
        r, z = sigmoid(wy[..., :D] + ux[..., :D]), sigmoid(wy[..., D : 2 * D] + ux[..., D:] - q["bias"])
        return (1 - z) * x + z * np.tanh(wy[..., 2 * D :] + (r * x) @ q["Dense_2"]["kernel"])

    M, T = memory.shape[1], x.shape[1]
    keys = norm(np.concatenate([memory, x], 1), p.get("LayerNorm_0"))
    project = lambda y, q: np.einsum("nsd,dhk->nshk", y, q["kernel"]) + q["bias"]  # noqa: E731
    q, k, v = project(keys[:, M:], p["query"]), project(keys, p["key"]), project(keys, p["value"])
    logits = np.einsum("nqhk,nshk->nhqs", q, k) / np.sqrt(q.shape[-1])
    for i in range(T):
        for j in range(M + T):
            logits[:, :, i, j] += p["relative_bias"][:, min(max(M + i - j, 0), M)] if "relative_bias" in p else 0
    logits = np.where(mask[:, None], logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out = np.einsum("nhqs,nshk,hkd->nqd", weights, v, p["out"]["kernel"]) + p["out"]["bias"]
    relu = lambda a: np.maximum(a, 0)  # noqa: E731
    x = gate(p["Gate_0"], x, relu(out)) if gating else x + out
    hidden = relu(norm(x, p.get("LayerNorm_1")) @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"])  # flax names the
    mlp = hidden @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"]  # outer Dense first: it is built first
    return gate(p["Gate_1"], x, relu(mlp)) if gating else x + mlp


@pytest.mark.parametrize("positional_encoding", ["relative", "none"])
@pytest.mark.parametrize(("gating", "layer_norm"), [(False, False), (True, True), (True, False), (False, True)])
def test_layer_matches_numpy(trxl, positional_encoding, gating, layer_norm):
    """One layer over the hand-made window (starts mid-window, memories valid in part), every weight random."""
    config = small_config(trxl)
    (cache, valid, _), _, start = hand_made_window(config)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(start.shape[1], start.shape[0], config.embed_size)).astype(np.float32)
    mask = trxl.attention_mask(jnp.asarray(valid), jnp.asarray(start))
    layer = trxl.Layer(config.num_heads, positional_encoding, gating, layer_norm)
    params = layer.init(jax.random.PRNGKey(0), x, cache[:, 0], mask)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    params = jax.tree.unflatten(tree, [0.5 * jax.random.normal(k, a.shape) for k, a in zip(keys, leaves, strict=True)])
    got = jax.jit(layer.apply)(params, x, cache[:, 0], mask)
    want = numpy_layer(params["params"], x, cache[:, 0], np.asarray(mask), gating, layer_norm)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


# --------------------------------------------------------------------------------------
# Acting, the rollout and the update
# --------------------------------------------------------------------------------------
def python_loop(trxl, config, network, params, memory, obs, start, final_obs=None):
    """The network stepped one env at a time and one step at a time, as make_act does: the memory replaced by a
    fresh one where an episode starts. (logits, values, V(final_obs) attending over the step itself too)."""
    T, N = start.shape
    step = jax.jit(network.apply)
    out = {k: np.zeros((T, N, *shape)) for k, shape in (("logits", (2,)), ("value", ()), ("next_value", ()))}
    for n in range(N):
        mine = jax.tree.map(lambda x: jnp.asarray(x)[n : n + 1], memory)
        for t in range(T):
            mine = trxl.initial_memory(config, 1) if start[t, n] else mine
            inputs, logits, value = step(params, mine, jnp.asarray(obs[t, n])[None, None], jnp.zeros((1, 1), bool))
            out["logits"][t, n], out["value"][t, n] = logits[0, 0], value[0, 0]
            mine = trxl.remember(mine, inputs[0], jnp.zeros(1, bool))
            if final_obs is not None:
                next_value = step(params, mine, jnp.asarray(final_obs[t, n])[None, None], jnp.zeros((1, 1), bool))[2]
                out["next_value"][t, n] = next_value[0, 0]
    return out


def test_replay_equals_stepping_one_env_at_a_time(trxl):
    """The window replayed at once (masks, shifted distances) gives each step's logits and value that one env
    stepped alone gets, with a memory it resets itself at each start."""
    config = small_config(trxl)
    network, params = init_params(trxl, config, key=2)
    memory, obs, start = hand_made_window(config)
    _, logits, value = jax.jit(network.apply)(params, trxl.Memory(*map(jnp.asarray, memory)), obs, start)
    want = python_loop(trxl, config, network, params, trxl.Memory(*memory), obs, start)
    np.testing.assert_allclose(logits, want["logits"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(value, want["value"], rtol=1e-5, atol=1e-5)


def test_act_carries_the_memory_it_is_given(trxl):
    """make_act: act.memory holds nothing valid; act, vmapped over envs and fed act.memory where an episode starts,
    gives the most probable action of the replayed window."""
    config = small_config(trxl)
    network, params = init_params(trxl, config, key=4)
    memory, obs, start = hand_made_window(config)
    act = trxl.make_act(config, env=types.SimpleNamespace(num_actions=2, obs_shape=obs.shape[2:]))  # the window's
    assert not np.asarray(act.memory.valid).any() and int(act.memory.step) == 0
    _, logits, _ = jax.jit(network.apply)(params, trxl.Memory(*map(jnp.asarray, memory)), obs, start)
    batched, carried = jax.jit(jax.vmap(act, in_axes=(None, 0, 0, 0))), trxl.Memory(*memory)
    fresh = jax.tree.map(lambda x: np.broadcast_to(x, (start.shape[1], *np.shape(x))), act.memory)
    for t, key in enumerate(jax.random.split(jax.random.PRNGKey(0), len(start))):
        carried = jax.tree.map(lambda f, m: np.where(start[t].reshape(-1, *[1] * (m.ndim - 1)), f, m), fresh, carried)
        action, carried = batched(params, obs[t], jax.random.split(key, start.shape[1]), carried)
        np.testing.assert_array_equal(action, np.asarray(logits[t]).argmax(-1))


def test_rollout_matches_a_python_loop(trxl, short):
    """Two rollouts in a row with terminations and truncations: every step's log-prob, value and bootstrap value
    V(final_obs) equal a plain loop that resets the memory itself at each start and bootstraps attending over the
    step itself; and the update's replay from the memory the rollout began with gives back every log-prob and value
    that acted (ratio 1 on every sample)."""
    config, train = short
    network = trxl.make_networks(config, 2, (2,)).actor_critic
    rollout = jax.jit(train.rollout)
    runner = jax.jit(train.init)(jax.random.PRNGKey(0))
    saw = {"terminated": 0, "truncated": 0}
    for key in jax.random.split(jax.random.PRNGKey(1), 2):
        memory = jax.device_get(runner.memory)
        episodes, new_memory, tr = jax.device_get(rollout(runner.params, runner.episodes, runner.memory, key))
        np.testing.assert_array_equal(tr.start[1:], tr.done[:-1])  # done at t: step t+1 starts an episode

        want = python_loop(trxl, config, network, runner.params, memory, tr.obs, tr.start, tr.final_obs)
        log_prob = np.take_along_axis(jax.nn.log_softmax(want["logits"]), tr.action[..., None], -1)[..., 0]
        np.testing.assert_allclose(tr.log_prob, log_prob, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(tr.value, want["value"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(tr.next_value, want["next_value"], rtol=1e-5, atol=1e-5)
        going_on = ~tr.done[:-1]  # V(final_obs) is the next step's value where no episode ended
        np.testing.assert_allclose(tr.next_value[:-1][going_on], tr.value[1:][going_on], rtol=1e-5, atol=1e-5)

        _, logits, value = jax.jit(network.apply)(runner.params, runner.memory, tr.obs, tr.start)
        replayed = np.take_along_axis(jax.nn.log_softmax(logits), tr.action[..., None], -1)[..., 0]
        np.testing.assert_allclose(np.exp(replayed - tr.log_prob), 1.0, rtol=1e-5)  # ratio 1, every sample
        np.testing.assert_allclose(value, tr.value, rtol=1e-5, atol=1e-5)

        saw["terminated"] += int(tr.terminated.sum())
        saw["truncated"] += int((tr.done & ~tr.terminated).sum())
        runner = runner._replace(episodes=episodes, memory=new_memory)
    assert saw["terminated"] > 0 and saw["truncated"] > 0, saw


def test_first_gradient_step_sees_ratio_one(short):
    """One epoch of one minibatch per update: the only gradient step replays the policy that acted, through the
    update's own env shuffle, so the ratio is 1 (KL 0, nothing clipped) on every update."""
    config, train = short
    _, metrics = jax.device_get(jax.jit(train)(jax.random.PRNGKey(1)))
    assert metrics["finite"].all() and (metrics["episodes_finished"] > 0).all()
    np.testing.assert_allclose(metrics["approx_kl"], 0.0, atol=1e-7)
    np.testing.assert_array_equal(metrics["clip_fraction"], 0.0)
    assert (metrics["grad_norm"] > 0).all()


# --------------------------------------------------------------------------------------
# Environments
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("length", [30, 60, 100])
def test_longer_memory_chains(trxl, length):
    """MemoryChain-bsuite-n: the context shows only at the start, the one reward (+1 for the context's action,
    -1 for the other) comes at the last of n + 1 steps."""
    env = trxl.VecEnv(f"MemoryChain-bsuite-{length}", 4)
    assert env.params.memory_length == length and env.num_actions == 2

    def episode(key, action):
        obs, state = env.reset(key)
        seen, rewards = [obs], []
        for _ in range(length + 1):
            step = env.step(key, state, jnp.full(4, action))
            seen.append(step.obs), rewards.append(step.reward)
            state = step.state
        return np.array(seen), np.array(rewards), step

    obs, rewards, last = episode(jax.random.PRNGKey(0), 1)
    assert np.asarray(last.terminated).all() and not np.abs(rewards[:-1]).any()
    context = obs[0, :, 2]  # +1 or -1: the bit to remember
    assert (obs[2:-1, :, 2] == 0).all()  # gone after the first steps
    np.testing.assert_array_equal(rewards[-1], np.where(context > 0, 1.0, -1.0))
