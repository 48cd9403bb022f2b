"""IQN (implicit quantile networks, Dabney et al. 2018) for discrete-action gymnax environments, in one file:
`python iqn.py --env-name Acrobot-v1 --num-seeds 16` (--help lists every option). The Q-network maps an observation
and quantile levels tau ~ U(0, 1) to each action's tau-quantiles of its return (a cosine embedding of tau multiplies
the observation's features); it learns them by quantile Huber regression of N sampled levels towards the target
network's N' sampled quantiles after the next action, and acts on the mean of K sampled quantiles (replay buffer,
target network, optional double DQN as in dqn.py). Every loss and every action draws its levels from the key it is
given. The whole run is one jitted function; seeds, and sweep points of the float hyperparameters in HParams, are
vmapped into one program, each with its own buffer:

    train = make_train(Config(env_name="CartPole-v1"))
    runner, metrics = jax.jit(jax.vmap(train))(jax.random.split(jax.random.PRNGKey(0), 8))

Needs jax, flax, optax, chex, gymnax and numpy only; importing it defines things and does nothing else."""

import argparse
import ast
import dataclasses
import difflib
import inspect
import json
import os
import pathlib
import pkgutil
import sys
import tempfile
import time
import typing
from collections.abc import Callable
from typing import Annotated, Any, NamedTuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization

HARNESS_PROTOCOL = 4  # the run harness's interface this file follows (algorithms/onefile_harness/protocol.py)
ACTIONS = "discrete"  # the action spaces this algorithm takes


@dataclasses.dataclass(frozen=True)
class Config:
    """Each field is a flag (`lr` is --lr), annotated with its help, then the rules its value satisfies."""

    env_name: Annotated[str, "a gymnax environment with discrete actions (gymnax.registered_envs)"] = "CartPole-v1"
    total_timesteps: Annotated[int, "env steps per run (all envs together)", "total_timesteps < 2**31"] = 300_000
    num_envs: Annotated[int, "parallel environments per run", "0 < num_envs < 2**31"] = 10
    num_steps: Annotated[int, "steps per environment in each update (one metrics row)", "0 < num_steps < 2**31"] = 100
    buffer_size: Annotated[int, "replay buffer capacity per run (>= num_envs)", "0 < buffer_size < 2**31"] = 10_000
    batch_size: Annotated[int, "transitions per gradient step (the paper's 32)", "batch_size > 0"] = 32
    learning_starts: Annotated[int, "env steps before gradient steps begin", "0 <= learning_starts < 2**31"] = 10_000
    train_frequency: Annotated[int, "env steps (all envs) per gradient step", "0 < train_frequency < 2**31"] = 10
    target_update_frequency: Annotated[int, "env steps per target update", "0 < target_update_frequency < 2**31"] = 250
    tau: Annotated[float, "target <- tau * online + (1 - tau) * target (1 copies)", "0 < tau <= 1"] = 1.0
    double_dqn: Annotated[bool, "double DQN: the online network picks the next action, the target rates it"] = True
    num_taus: Annotated[int, "N: levels regressed (the paper's 64)", "0 < num_taus < 2**31"] = 8
    num_target_taus: Annotated[int, "N': levels of the targets (the paper's 64)", "0 < num_target_taus < 2**31"] = 8
    num_action_taus: Annotated[int, "K: levels whose mean acts (the paper's 32)", "0 < num_action_taus < 2**31"] = 8
    embedding_dim: Annotated[int, "cosines in the embedding of tau (the paper's 64)", "0 < embedding_dim < 2**31"] = 32
    kappa: Annotated[float, "quantile Huber threshold (the paper's is 1)", "0 < kappa < inf"] = 100.0
    lr: Annotated[float, "Adam learning rate (start value when annealed; the paper's 5e-5)", "0 < lr < inf"] = 1e-3
    anneal_lr: Annotated[bool, "decay the learning rate linearly to 0 over all gradient steps"] = True
    gamma: Annotated[float, "discount factor", "0 <= gamma <= 1"] = 0.99
    max_grad_norm: Annotated[float, "global gradient-norm clip", "0 < max_grad_norm < inf"] = 1000.0
    eps_start: Annotated[float, "epsilon-greedy exploration rate at the first step", "0 <= eps_start <= 1"] = 1.0
    eps_end: Annotated[float, "exploration rate once the linear decay is over", "0 <= eps_end <= 1"] = 0.01
    eps_fraction: Annotated[float, "share of total_timesteps epsilon takes to decay", "0 <= eps_fraction <= 1"] = 0.3
    activation: Annotated[str, "hidden activation", "activation in ('relu', 'tanh')"] = "relu"
    hidden_size: Annotated[int, "units per hidden layer of the Q-network", "0 < hidden_size < 2**31"] = 64
    num_layers: Annotated[int, "hidden layers of the Q-network", "0 < num_layers < 2**31"] = 2
    network: Annotated[str, "torso: its convolutions (CONVOLUTIONS)", "network in ('mlp', 'cnn', 'nature_cnn')"] = "mlp"
    eval_episodes: Annotated[int, "greedy evaluation episodes per run after training", "eval_episodes > 0"] = 16
    seed: Annotated[int, "base seed; run i uses jax.random.split(PRNGKey(seed), num_seeds)[i]"] = 0
    num_seeds: Annotated[int, "independent runs trained side by side (vmapped)", "0 < num_seeds < 2**31"] = 8

    @property
    def steps_per_update(self) -> int:  # one update's env steps, all envs together (one metrics row)
        return self.num_envs * self.num_steps

    @property
    def num_updates(self) -> int:
        return self.total_timesteps // self.steps_per_update


class HParams(NamedTuple):  # the float hyperparameters in which runs of one compiled program may differ (--sweep)
    lr: jax.Array
    gamma: jax.Array
    tau: jax.Array
    max_grad_norm: jax.Array
    eps_start: jax.Array
    eps_end: jax.Array
    eps_fraction: jax.Array
    kappa: jax.Array


hparams_from = lambda config: HParams(**{f: jnp.float32(getattr(config, f)) for f in HParams._fields})  # noqa: E731


def validate(config: Config) -> None:
    """Refuses a config that cannot run, naming the option and what is allowed (each field's rules, then these)."""
    validate_hparams(dataclasses.asdict(config))
    size, envs, steps = config.buffer_size, config.num_envs, config.steps_per_update
    require(size >= envs, f"--buffer-size {size} must be at least num_envs = {envs} (each env step writes num_envs)")
    require(steps <= config.total_timesteps, f"--total-timesteps must be at least num_envs * num_steps = {steps}")


# ---- Networks ----
CONVOLUTIONS = {  # --network: the torso's convolutions, each (features, kernel size, stride), unpadded, ReLU after
    "mlp": (),  # none: the observation flattened
    "cnn": ((16, 3, 1),),  # MinAtar's (Young & Tian 2019), for small images
    "nature_cnn": ((32, 8, 4), (64, 4, 2), (64, 3, 1)),  # Atari's (Mnih et al. 2015), for 84x84 frames
}


class Conv(nn.Module):  # nn.Conv(features, (size, size), stride, padding="VALID"): its parameters and outputs
    features: int
    size: int
    stride: int
    patches: bool | None = None  # one matmul of the image's patches (None: on CPU, docs/speed-tricks.md)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [B, H, W, C] -> [B, H', W', features]
        k, s = self.size, self.stride
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (k, k, x.shape[-1], self.features))
        bias = self.param("bias", nn.initializers.zeros, (self.features,))
        if not (jax.default_backend() == "cpu" if self.patches is None else self.patches):
            dims = ("NHWC", "HWIO", "NHWC")
            return jax.lax.conv_general_dilated(x, kernel, (s, s), "VALID", dimension_numbers=dims) + bias
        # XLA's CPU convolution is slow inside a lax.scan (jax-ml/jax#12868): each output pixel's patch, its k * k
        # offsets sliced and joined (row, column, channel: the kernel's own order), times the kernel as a matrix.
        h, w = (x.shape[1] - k) // s + 1, (x.shape[2] - k) // s + 1
        offsets = [x[:, i : i + s * (h - 1) + 1 : s, j : j + s * (w - 1) + 1 : s] for i in range(k) for j in range(k)]
        return jnp.concatenate(offsets, -1) @ kernel.reshape(-1, self.features) + bias


class Torso(nn.Module):  # what a network reads first: replace it to read observations another way
    network: str  # a key of CONVOLUTIONS
    obs_shape: tuple  # one observation's shape, as the env gives it ([height, width, channels] for an image)

    @nn.compact
    def __call__(self, obs: jax.Array) -> jax.Array:
        """Observations [..., *obs_shape] as float32 features [..., F]: convolved, then flattened."""
        lead, x = obs.shape[: obs.ndim - len(self.obs_shape)], obs.reshape(-1, *self.obs_shape).astype(jnp.float32)
        x = x / 255.0 if CONVOLUTIONS[self.network] and obs.dtype == jnp.uint8 else x  # bytes (Atari's) as [0, 1]
        for features, size, stride in CONVOLUTIONS[self.network]:
            x = nn.relu(Conv(features, size, stride)(x))
        return x.reshape(*lead, -1)


def check_network(network: str, obs_shape: tuple) -> None:
    """Convolutions read images [height, width, channels] no smaller than their kernels."""
    size = min(obs_shape[:2]) if len(obs_shape) == 3 else 0
    for _, kernel, stride in CONVOLUTIONS[network]:
        size = (size - kernel) // stride + 1 if size >= kernel else 0
    why = f"reads images [height, width, channels] larger than its kernels; this env's are {tuple(obs_shape)}"
    require(network == "mlp" or size > 0, f"--network {network} {why}")


class QNetwork(nn.Module):
    """(obs [..., *obs_shape], taus [..., M]) -> [..., M, num_actions]: each action's return quantile at each level.
    The observation's features psi(x) (Torso, then hidden layers) are multiplied elementwise by the levels' embedding
    phi(tau) = relu(Dense(cos(pi * i * tau), i = 0 .. embedding_dim - 1)), then one more hidden layer and the output."""

    num_actions: int
    network: str
    obs_shape: tuple
    hidden_size: int
    num_layers: int
    embedding_dim: int
    activation: str

    @nn.compact
    def __call__(self, obs: jax.Array, taus: jax.Array) -> jax.Array:
        act, x = getattr(nn, self.activation), Torso(self.network, self.obs_shape)(obs)  # nn.relu or nn.tanh
        for _ in range(self.num_layers):
            x = act(nn.Dense(self.hidden_size)(x))
        cosines = jnp.cos(jnp.pi * jnp.arange(self.embedding_dim, dtype=jnp.float32) * taus[..., None])
        phi = nn.relu(nn.Dense(self.hidden_size)(cosines))  # [..., M, hidden]
        h = act(nn.Dense(self.hidden_size)(x[..., None, :] * phi))
        return nn.Dense(self.num_actions)(h)


class Networks(NamedTuple):
    q: nn.Module  # (obs, taus) -> [..., taus, num_actions] quantiles; its parameters are params["q"] (and the target's)


def make_networks(config: Config, num_actions: int, obs_shape: tuple) -> Networks:
    check_network(config.network, obs_shape)
    shape = dict(hidden_size=config.hidden_size, num_layers=config.num_layers, embedding_dim=config.embedding_dim)
    return Networks(q=QNetwork(num_actions, config.network, obs_shape, activation=config.activation, **shape))


def q_values(config: Config, network: nn.Module, params, obs: jax.Array, key: jax.Array) -> jax.Array:
    """[..., num_actions] Q-values: the mean of the quantiles at num_action_taus levels drawn from `key`."""
    taus = jax.random.uniform(key, (*obs.shape[: obs.ndim - len(network.obs_shape)], config.num_action_taus))
    return network.apply(params, obs, taus).mean(-2)


# ---- The replay buffer (the same in dqn.py, c51.py, qr_dqn.py, iqn.py: tests/test_files.py) ----
class Transition(NamedTuple):
    obs: jax.Array  # [..., *obs_shape] in the env's dtype
    action: jax.Array  # [...] int32
    reward: jax.Array  # [...] float32
    terminated: jax.Array  # [...] bool: a terminal state; a time-limit truncation is not one
    final_obs: jax.Array  # [..., *obs_shape] the true next observation (before auto-reset)


class ReplayBuffer(NamedTuple):  # a circular store of one run's transitions (one per seed): slots [0, size) filled
    data: Transition  # every field [capacity, ...]
    position: jax.Array  # int32: where the next transition goes
    size: jax.Array  # int32, at most capacity


def buffer_init(capacity: int, obs_shape: tuple, obs_dtype) -> ReplayBuffer:  # observations kept as the env gives them
    zeros = lambda *shape, dtype=jnp.float32: jnp.zeros((capacity, *shape), dtype)  # noqa: E731
    obs = zeros(*obs_shape, dtype=obs_dtype)
    data = Transition(obs, zeros(dtype=jnp.int32), zeros(), zeros(dtype=bool), final_obs=obs)
    return ReplayBuffer(data=data, position=jnp.int32(0), size=jnp.int32(0))


def buffer_add(buffer: ReplayBuffer, batch: Transition) -> ReplayBuffer:
    """Writes a batch of n <= capacity transitions at `position`, wrapping around the end."""
    capacity, n = buffer.data.action.shape[0], batch.action.shape[0]
    slots = (buffer.position + jnp.arange(n, dtype=jnp.int32)) % capacity
    data = jax.tree.map(lambda store, x: store.at[slots].set(x.astype(store.dtype)), buffer.data, batch)
    size = jnp.minimum(buffer.size + n, capacity)
    return ReplayBuffer(data=data, position=(buffer.position + n) % capacity, size=size)


def buffer_sample(buffer: ReplayBuffer, key: jax.Array, batch_size: int) -> Transition:
    """`batch_size` transitions from the filled slots, each as likely as any other (batch / size) and, once the buffer
    holds a batch, none twice: one from each of `batch_size` nearly equal strata of the filled range, rotated by a
    uniform offset. Each batch spans the buffer evenly, less noisy than draws with replacement."""
    slot_key, shift_key = jax.random.split(key)
    n, j = buffer.size, jnp.arange(batch_size + 1, dtype=jnp.int32)
    bounds = j * (n // batch_size) + j * (n % batch_size) // batch_size  # floor(j * n / batch) without int32 overflow
    slots = jax.random.randint(slot_key, (batch_size,), bounds[:-1], jnp.maximum(bounds[1:], bounds[:-1] + 1))
    shift = jax.random.randint(shift_key, (), 0, n)
    slots = jnp.where(slots >= n - shift, slots - (n - shift), slots + shift)  # (slots + shift) % n, no overflow
    return jax.tree.map(lambda store: store[slots], buffer.data)


# ---- The training loop's parts (the same in dqn.py, c51.py, qr_dqn.py, iqn.py, rainbow.py: tests/test_files.py) ----
class Runner(NamedTuple):  # everything one run carries from update to update
    params: Any  # {"q": online Q-network parameters}
    target_params: Any  # {"q": target network parameters}
    opt_state: Any
    buffer: ReplayBuffer
    episodes: "Episodes"
    rng: jax.Array
    hparams: HParams


def interval_crossings(before, steps: int, interval: int, learning_starts: int):
    """How many multiples of `interval` lie in (max(before, learning_starts), before + steps]: the gradient
    steps (or target updates) that a vectorized step from `before` to `before + steps` env steps owes. Summed
    over a run, that is exactly max(0, total // interval - learning_starts // interval), whatever num_envs is."""
    return jnp.maximum(0, (before + steps) // interval - jnp.maximum(before, learning_starts) // interval)


def total_gradient_steps(config: Config) -> int:
    trained = config.num_updates * config.steps_per_update
    return max(0, trained // config.train_frequency - config.learning_starts // config.train_frequency)


def polyak_update(online, target, tau: jax.Array, count: jax.Array):
    """`count` Polyak updates target <- tau * online + (1 - tau) * target with the same online parameters, in
    one at rate 1 - (1 - tau)^count. tau = 1 copies."""
    return optax.incremental_update(online, target, 1.0 - (1.0 - tau) ** jnp.asarray(count, jnp.float32))


def epsilon(config: Config, hparams: HParams, env_steps: jax.Array) -> jax.Array:
    """Linear decay from eps_start to eps_end over eps_fraction of total_timesteps, then flat."""
    decay_steps = jnp.maximum(hparams.eps_fraction * config.total_timesteps, 1.0)
    progress = jnp.minimum(env_steps / decay_steps, 1.0)
    return hparams.eps_start + (hparams.eps_end - hparams.eps_start) * progress


def epsilon_greedy(q: jax.Array, epsilon: jax.Array, key: jax.Array) -> jax.Array:
    """Epsilon-greedy on [..., num_actions] Q-values: a uniformly random action with probability epsilon."""
    explore_key, action_key = jax.random.split(key)
    explore = jax.random.uniform(explore_key, q.shape[:-1]) < epsilon
    return jnp.where(explore, jax.random.randint(action_key, q.shape[:-1], 0, q.shape[-1]), jnp.argmax(q, -1))


def make_optimizer(config: Config, hparams: HParams):
    num_grad_steps = max(1, total_gradient_steps(config))
    anneal = lambda count: hparams.lr * jnp.maximum(1.0 - count / num_grad_steps, 0.0)  # noqa: E731
    lr = anneal if config.anneal_lr else hparams.lr
    return optax.chain(optax.clip_by_global_norm(hparams.max_grad_norm), optax.adam(learning_rate=lr))


# ---- The algorithm: the TD loss ----
def quantile_huber_loss(quantiles: jax.Array, taus: jax.Array, targets: jax.Array, kappa: jax.Array) -> jax.Array:
    """Quantile Huber loss of estimates `quantiles` [B, N] at their levels `taus` [B, N] against sampled `targets`
    [B, N']: with u = targets[b, j] - quantiles[b, i],

        loss = mean_b sum_i mean_j |taus[b, i] - 1{u < 0}| * huber_kappa(u) / kappa,

    huber_kappa(u) = u^2 / 2 for |u| <= kappa, else kappa * (|u| - kappa / 2)."""
    u = targets[:, None, :] - quantiles[:, :, None]  # [B, i, j]
    tau = taus[:, :, None]
    weighted = jnp.where(u < 0, 1.0 - tau, tau) * optax.huber_loss(u, delta=kappa) / kappa  # |tau - 1{u < 0}|
    return weighted.mean(-1).sum(-1).mean()


def td_loss(config: Config, networks: Networks, params, target_params, batch: Transition, hp: HParams, key: jax.Array):
    """(loss, aux) of the online Q-network's `params` against the target's `target_params` ({"q": ...} each).

    From `key`: N levels tau [B, N] for the taken action's quantiles, N' levels tau' [B, N'] for the targets
    reward + gamma * (1 - terminated) * Z_tau'(final_obs, a'), and K levels for a', the action of the highest mean
    quantile by the target network, or by the online one (double DQN). `final_obs` is the true next observation, so
    a time-limit truncation bootstraps from the state it cut off; only `terminated` zeroes the bootstrap. The loss is
    `quantile_huber_loss`; aux holds the taken actions' Q-values (mean quantiles), the target quantiles, both sets of
    levels and the Q-values that chose a'."""
    network, params, target_params = networks.q, params["q"], target_params["q"]
    taus_key, target_taus_key, action_taus_key = jax.random.split(key, 3)
    B = batch.action.shape[0]
    chooser = jax.lax.stop_gradient(params) if config.double_dqn else target_params
    next_q = q_values(config, network, chooser, batch.final_obs, action_taus_key)
    next_action = jnp.argmax(next_q, -1)
    target_taus = jax.random.uniform(target_taus_key, (B, config.num_target_taus))
    next_quantiles = network.apply(target_params, batch.final_obs, target_taus)  # [B, N', actions]
    next_quantiles = jnp.take_along_axis(next_quantiles, next_action[:, None, None], -1)[..., 0]
    chex.assert_equal_shape([batch.reward, batch.terminated, batch.action, next_action])
    target = batch.reward[:, None] + hp.gamma * (1.0 - batch.terminated[:, None]) * next_quantiles
    target = jax.lax.stop_gradient(target)
    taus = jax.random.uniform(taus_key, (B, config.num_taus))
    quantiles = jnp.take_along_axis(network.apply(params, batch.obs, taus), batch.action[:, None, None], -1)[..., 0]
    chex.assert_shape([target, quantiles], [(B, config.num_target_taus), (B, config.num_taus)])
    loss = quantile_huber_loss(quantiles, taus, target, hp.kappa)
    return loss, {
        "q": quantiles.mean(-1),
        "target": target,
        "taus": taus,
        "target_taus": target_taus,
        "next_q": next_q,
    }


# ---- The training loop: dqn.py's, with a key for the levels tau that each env step acts on ----
def make_train(config: Config, env: "VecEnv | None" = None) -> Callable:
    """`train(rng, hparams=None) -> (runner, metrics of shape [num_updates])`: `train.init(rng, hparams)`, then
    `train.update(runner, update_index)` in a `lax.scan`, in `env` (default: VecEnv(env_name, num_envs))."""
    validate(config)
    env = VecEnv(config.env_name, config.num_envs) if env is None else env
    networks = make_networks(config, env.num_actions, env.obs_shape)
    network = networks.q
    T, N = config.num_steps, config.num_envs
    max_grad_steps = -(-N // config.train_frequency)  # the most one vectorized step can owe (usually 0 or 1 are due)

    @jax.custom_batching.sequential_vmap  # seeds in turn: vmapped, orthogonal init's QRs can deadlock XLA's CPU pool
    def init(rng: jax.Array, hparams: HParams | None = None) -> Runner:
        hparams = hparams_from(config) if hparams is None else hparams
        rng, params_key, env_key = jax.random.split(rng, 3)
        obs, taus = jnp.zeros((1, *env.obs_shape), env.obs_dtype), jnp.zeros((1, config.num_taus))
        params = {"q": network.init(params_key, obs, taus)}
        return Runner(
            params=params,
            target_params=params,
            opt_state=make_optimizer(config, hparams).init(params),
            buffer=buffer_init(config.buffer_size, env.obs_shape, env.obs_dtype),
            episodes=Episodes.start(*env.reset(env_key)),
            rng=rng,
            hparams=hparams,
        )

    def gradient_step(runner: Runner, key: jax.Array):
        """One Adam step on a batch drawn from the buffer: (runner, its loss, mean Q and gradient norm)."""
        sample_key, loss_key = jax.random.split(key)
        batch = buffer_sample(runner.buffer, sample_key, config.batch_size)
        hp, loss_and_grad = runner.hparams, jax.value_and_grad(td_loss, argnums=2, has_aux=True)
        (loss, aux), grads = loss_and_grad(config, networks, runner.params, runner.target_params, batch, hp, loss_key)
        updates, opt_state = make_optimizer(config, hp).update(grads, runner.opt_state)
        stats = dict(loss=loss, q_mean=aux["q"].mean(), grad_norm=optax.tree.norm(grads))
        return runner._replace(params=optax.apply_updates(runner.params, updates), opt_state=opt_state), stats

    def learn(runner: Runner, before: jax.Array, key: jax.Array):
        """The gradient steps and target updates due in a vectorized step from `before` env steps: one per multiple
        of its interval that the env-step count crossed, so any num_envs keeps the schedule. Returns (runner, (the
        [max_grad_steps] steps' stats, which were taken, target updates))."""
        num_grad = interval_crossings(before, N, config.train_frequency, config.learning_starts)
        untaken = dict.fromkeys(("loss", "q_mean", "grad_norm"), jnp.float32(0))
        skip = lambda runner, key: (runner, untaken)  # noqa: E731

        def maybe_step(runner: Runner, inputs):
            i, key = inputs
            return jax.lax.cond(i < num_grad, gradient_step, skip, runner, key)

        steps = jnp.arange(max_grad_steps)
        runner, stats = jax.lax.scan(maybe_step, runner, (steps, jax.random.split(key, max_grad_steps)))
        num_target = interval_crossings(before, N, config.target_update_frequency, config.learning_starts)
        polyak = lambda target: polyak_update(runner.params, target, runner.hparams.tau, num_target)  # noqa: E731
        target = jax.lax.cond(num_target > 0, polyak, lambda target: target, runner.target_params)
        return runner._replace(target_params=target), (stats, steps < num_grad, num_target)

    def update(runner: Runner, update_index: jax.Array):
        hp = runner.hparams
        rng, steps_key = jax.random.split(runner.rng)

        def env_step(runner: Runner, inputs):
            """One vectorized epsilon-greedy env step into the buffer, then the gradient steps and target updates."""
            t, key = inputs
            action_key, action_taus_key, env_key, learn_key = jax.random.split(key, 4)
            before = (update_index * T + t) * N  # env steps of this run before this vectorized step
            # Same for every seed and sweep point (not batched under vmap): the conds in learn stay conds.
            eps = epsilon(config, hp, before)
            obs = runner.episodes.obs
            q = q_values(config, network, runner.params["q"], obs, action_taus_key)
            action = epsilon_greedy(q, eps, action_key)
            step = env.step(env_key, runner.episodes.env_state, action)
            buffer = buffer_add(runner.buffer, Transition(obs, action, step.reward, step.terminated, step.final_obs))
            runner = runner._replace(buffer=buffer, episodes=runner.episodes.after(step))
            runner, (stats, taken, num_target) = learn(runner, before, learn_key)
            return runner, (stats, taken, num_target, eps)

        steps = (jnp.arange(T, dtype=jnp.int32), jax.random.split(steps_key, T))
        start = runner._replace(episodes=runner.episodes.counting())
        runner, (stats, taken, num_target, eps) = jax.lax.scan(env_step, start, steps)
        # The gradient steps' means (0 / 0, NaN, in an update without any: never a stale or zero-filled value).
        means = {name: jnp.where(taken, value, 0.0).sum() / taken.sum() for name, value in stats.items()}
        metrics = {
            "env_steps": (update_index + 1) * T * N,
            **runner.episodes.metrics(),
            **means,
            "epsilon": eps[-1],  # that of the update's last env step
            "gradient_steps": taken.sum(),
            "target_updates": num_target.sum(),
            "finite": jnp.isfinite(stats["loss"]).all() & jnp.isfinite(optax.tree.norm(runner.params)),
        }
        return runner._replace(rng=rng), metrics

    def train(rng: jax.Array, hparams: HParams | None = None):
        return jax.lax.scan(update, init(rng, hparams), jnp.arange(config.num_updates, dtype=jnp.int32))

    train.init, train.update = init, update
    return train


# ---- The policy's action ----
def make_act(config: Config, greedy: bool = True, env: "VecEnv | None" = None) -> Callable:
    """`act(params, obs, key) -> action` for one observation in the env's own shape (vmap it for a batch): the
    action of the highest Q-value (the mean of K quantiles at levels drawn from `key`) of the online network, or
    (greedy=False) epsilon-greedy at eps_end."""
    env = env or VecEnv(config.env_name, 1)
    network = make_networks(config, env.num_actions, env.obs_shape).q

    def act(params, obs: jax.Array, key: jax.Array) -> jax.Array:
        action_taus_key, action_key = jax.random.split(key)
        q = q_values(config, network, params["q"], obs, action_taus_key)
        return jnp.argmax(q) if greedy else epsilon_greedy(q, config.eps_end, action_key)

    return act


def saved_params(runner: Runner) -> dict:
    return runner.params  # what params.msgpack holds and `make_evaluate` takes: the online Q-network's parameters


# --------------------------------------------------------------------------------------
# Running this file (the same in every single-agent file: tests/test_files.py): checks, env loop, eval, command line
# --------------------------------------------------------------------------------------
class ConfigError(ValueError):
    """A config value that cannot work, naming the option and what is allowed; raised before anything compiles."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate_hparams(values: dict) -> None:
    """Each value satisfies its Config field's rules (Python expressions; NaN fails them), as must each sweep point;
    and Config names no field twice (the second line would silently replace the first)."""
    try:  # without source (a class typed into a notebook cell) there is nothing to compare
        names = [n.target.id for n in ast.parse(inspect.getsource(Config)).body[0].body if hasattr(n, "target")]
    except (OSError, TypeError):
        names = []
    require(len(set(names)) == len(names), f"Config names {max(names or [''], key=names.count)} twice: rename one")
    rules = {field.name: typing.get_args(field.type)[2:] for field in dataclasses.fields(Config)}
    for name, value in values.items():
        for rule in rules[name]:
            ok = eval(rule, {name: value, "inf": np.inf})
            require(ok, f"--{name.replace('_', '-')} must satisfy {rule}, got {value!r}")


class EnvStep(NamedTuple):
    obs: jax.Array  # [num_envs, *obs_shape] after auto-reset, in the env's own shape and dtype
    state: Any
    reward: jax.Array  # [num_envs] float32
    terminated: jax.Array  # [num_envs] bool: the episode reached a terminal state
    truncated: jax.Array  # [num_envs] bool: the episode hit its time limit
    final_obs: jax.Array  # [num_envs, *obs_shape] the true next observation, before auto-reset


class VecEnv:
    """`num_envs` copies of a gymnax env under `jax.vmap` of its own `step` (auto-reset, final observation)."""

    def __init__(self, env_name: str, num_envs: int):
        import gymnax  # here: importing it computes with JAX, which must wait for configure_xla's flags

        require(env_name in gymnax.registered_envs, f"--env-name {env_name!r} is not in gymnax.registered_envs")
        try:  # a download without a network, a missing package, a factory that raises: refused in one line
            self.env, self.params = gymnax.make(env_name)
        except Exception as error:
            reason = f"{type(error).__name__}: {' '.join(str(error).split())}"
            raise ConfigError(f"--env-name {env_name} cannot be built: {reason}") from None
        self.num_envs, self.max_episode_steps = num_envs, self.params.max_steps_in_episode
        obs = jax.eval_shape(self.env.reset, jax.random.PRNGKey(0), self.params)[0]  # one observation, unbatched
        self.obs_shape, self.obs_dtype = obs.shape, obs.dtype  # as the env gives it: networks flatten what they read
        space = self.env.action_space(self.params)
        kind = "discrete" if hasattr(space, "n") else "continuous"
        require(kind == ACTIONS, f"--env-name {env_name} has {kind} actions; this file takes {ACTIONS} actions")
        self.num_actions, self.action_shape = getattr(space, "n", 0), space.shape
        bounds = (np.float32(np.broadcast_to(getattr(space, end, 0), space.shape)).flatten() for end in ("low", "high"))
        self.action_dim, (self.action_low, self.action_high) = int(np.prod(space.shape)), bounds  # continuous actions

    def reset(self, key: jax.Array):
        return jax.vmap(self.env.reset, in_axes=(0, None))(jax.random.split(key, self.num_envs), self.params)

    def step(self, key: jax.Array, state: Any, action: jax.Array) -> EnvStep:
        keys, action = jax.random.split(key, self.num_envs), action.reshape(self.num_envs, *self.action_shape)
        step = jax.vmap(self.env.step, in_axes=(0, 0, 0, None))(keys, state, action, self.params)
        obs, state, reward, terminated, truncated, info = step
        return EnvStep(obs, state, reward.astype(jnp.float32), terminated, truncated, info["final_observation"])


class Episodes(NamedTuple):  # every env's current episode, and those ended since `counting()` (an update's start)
    env_state: Any
    obs: jax.Array  # [num_envs, *obs_shape]
    episode_return: jax.Array  # [num_envs] return so far
    episode_length: jax.Array  # [num_envs] int32 steps so far
    ended: jax.Array = None  # [3] since counting began: episodes ended, their returns summed, their lengths summed

    @classmethod
    def start(cls, obs: jax.Array, env_state: Any) -> "Episodes":
        return cls(env_state, obs, jnp.zeros(obs.shape[0]), jnp.zeros(obs.shape[0], jnp.int32)).counting()

    def counting(self) -> "Episodes":
        return self._replace(ended=jnp.zeros(3))

    def after(self, step: EnvStep) -> "Episodes":  # those that ended in `step` are counted and begin anew
        done, ret, length = step.terminated | step.truncated, self.episode_return + step.reward, self.episode_length + 1
        ended = self.ended + jnp.where(done, jnp.stack([jnp.ones_like(ret), ret, length]), 0).sum(-1)
        return Episodes(step.state, step.obs, jnp.where(done, 0.0, ret), jnp.where(done, 0, length), ended)

    def metrics(self) -> dict:  # the mean return and length of the episodes counted: NaN when none ended
        count, ret, length = self.ended  # 0 / 0 is NaN
        return dict(episode_return=ret / count, episode_length=length / count, episodes_finished=jnp.int32(count))


def make_evaluate(config: Config, env: VecEnv | None = None) -> Callable:
    """`evaluate(params, rng) -> mean return` of greedy episodes, one per env of `env` (default: eval_episodes)."""
    validate(config)
    env = VecEnv(config.env_name, config.eval_episodes) if env is None else env
    act = make_act(config, env=env)
    start = getattr(act, "memory", None)  # a recurrent policy's memory at an episode's start (None: it has none)
    batched = jax.vmap(act if start is not None else lambda p, o, k, m: (act(p, o, k), m), (None, 0, 0, 0))

    class Evaluating(NamedTuple):  # what evaluation carries from step to step
        env_state: Any
        obs: jax.Array
        memory: Any  # a recurrent policy's memory, per env
        total: jax.Array  # [episodes] return so far: each env's first episode is scored, and only it
        alive: jax.Array  # [episodes] bool: that episode has not ended yet
        rng: jax.Array
        t: jax.Array  # env steps taken

    def evaluate(params, rng: jax.Array) -> jax.Array:
        def env_step(carry: Evaluating) -> Evaluating:
            rng, act_key, env_key = jax.random.split(carry.rng, 3)
            seen = (carry.obs, carry.env_state) if getattr(act, "reads_state", False) else carry.obs  # a planner's
            action, memory = batched(params, seen, jax.random.split(act_key, env.num_envs), carry.memory)
            step = env.step(env_key, carry.env_state, action)
            total = carry.total + jnp.where(carry.alive, step.reward, 0.0)
            alive = carry.alive & ~(step.terminated | step.truncated)
            return Evaluating(step.state, step.obs, memory, total=total, alive=alive, rng=rng, t=carry.t + 1)

        reset_key, rng = jax.random.split(rng)
        obs, env_state = env.reset(reset_key)
        memory = jax.tree.map(lambda m: jnp.broadcast_to(m, (env.num_envs, *jnp.shape(m))), start)
        first = Evaluating(env_state, obs, memory, jnp.zeros(env.num_envs), jnp.ones(env.num_envs, bool), rng, t=0)
        return jax.lax.while_loop(lambda c: c.alive.any() & (c.t < env.max_episode_steps), env_step, first).total.mean()

    return evaluate


def load_run(run_dir: str, seed: int = 0, point: int = 0):
    """(config, params) of one run in a run directory of this file (alone or the harness's): the Config with its sweep
    point's values (--pbt: the member's last) and its part of params.msgpack, whose arrays are [points, seeds, ...]."""
    with np.load(pathlib.Path(run_dir, "metrics.npz")) as metrics:
        values = {name[6:]: metrics[name][point] for name in metrics.files if name.startswith("sweep_")}
        values |= {name[4:]: metrics[name][point, seed, -1] for name in metrics.files if name.startswith("pbt_")}
    saved = json.loads(pathlib.Path(run_dir, "config.json").read_text()) | {k: v.item() for k, v in values.items()}
    params = serialization.msgpack_restore(pathlib.Path(run_dir, "params.msgpack").read_bytes())
    config = Config(**{f.name: saved.get(f.name, f.default) for f in dataclasses.fields(Config)})  # new fields: default
    return config, jax.tree.map(lambda x: x[point, seed], params)


def configure_xla() -> None:
    """Unless XLA_FLAGS has them: the concurrent CPU scheduler off (it deadlocked vmapped training), faster compiles."""
    cpu = not any(module.name.startswith(("jax_cuda", "jax_rocm", "libtpu")) for module in pkgutil.iter_modules())
    flags, given = ["xla_cpu_enable_concurrency_optimized_scheduler=false"], os.environ.get("XLA_FLAGS", "")
    flags += ["xla_backend_optimization_level=1"] * cpu
    os.environ["XLA_FLAGS"] = " ".join([given] + [f"--{f}" for f in flags if f.split("=")[0] not in given]).strip()


def train_with_progress(config: Config, train: Callable):
    """Every seed's run in one program, compiled, then trained with a report every tenth of it: (runner, metrics
    [seeds, updates], {"compile": seconds, "train": seconds})."""
    total, every, clock = config.num_updates, -(-config.num_updates // 10), [time.perf_counter()]

    def report(index, mean_return):  # this update's mean return over seeds, env steps/s since training began
        speed = (index + 1) * config.steps_per_update * config.num_seeds / (time.perf_counter() - clock[-1])
        shown = f"{mean_return:.1f}" if np.isfinite(mean_return) else "- (no episode ended in this update)"
        print(f"update {index + 1}/{total}: return {shown}, {speed:,.0f} env steps/s", flush=True)

    def update(runners, index: jax.Array):  # every seed's update, and a report every tenth of the run
        runners, metrics = jax.vmap(train.update, in_axes=(0, None))(runners, index)
        mean_return, tenth = jnp.nanmean(metrics["episode_return"]), ((index + 1) % every == 0) | (index + 1 == total)
        jax.lax.cond(tenth, lambda: jax.debug.callback(report, index, mean_return, ordered=True), lambda: None)
        return runners, metrics

    keys = jax.random.split(jax.random.PRNGKey(config.seed), config.num_seeds)
    run = lambda keys: jax.lax.scan(update, jax.lax.map(train.init, keys), jnp.arange(total))  # noqa: E731
    compiled = jax.jit(run).lower(keys).compile()  # init by lax.map (not vmap), as the harness does on CPU
    clock.append(time.perf_counter())
    print(f"compiled in {clock[1] - clock[0]:.1f} s", flush=True)
    runner, metrics = jax.device_get(compiled(keys))
    seconds = {"compile": clock[1] - clock[0], "train": time.perf_counter() - clock[1]}
    return runner, {name: np.swapaxes(value, 0, 1) for name, value in metrics.items()}, seconds


def summarise_run(config: Config, metrics: dict, greedy: np.ndarray, seconds: dict) -> dict:
    """summary.json in the harness's names. A seed's final return: the mean return of its episodes that ended in the
    last 5% of updates (None where none did)."""
    last = -int(np.ceil(config.num_updates * 0.05))
    returns, counts = metrics["episode_return"][:, last:], metrics["episodes_finished"][:, last:]
    with np.errstate(invalid="ignore", divide="ignore"):
        final = np.where(counts > 0, returns * counts, 0.0).sum(-1) / counts.sum(-1)
    finite, number = final[np.isfinite(final)], lambda x: float(x) if np.isfinite(x) else None  # noqa: E731
    summary = dict(algorithm=os.path.basename(__file__)[:-3], env_name=config.env_name, num_seeds=config.num_seeds)
    summary |= dict(
        total_timesteps=config.total_timesteps, trained_timesteps=config.num_updates * config.steps_per_update
    )
    summary |= {f"final_return_{f.__name__}": number(f(finite)) if finite.size else None for f in (np.mean, np.std)}
    summary |= dict(final_return_per_seed=[number(x) for x in final], eval_return_mean=number(greedy.mean()))
    summary |= {f"{name}_seconds": value for name, value in seconds.items()} | dict(backend=jax.default_backend())
    return summary | dict(steps_per_second=summary["trained_timesteps"] * config.num_seeds / seconds["train"])


def report_lines(summary: dict) -> str:
    """The harness's closing lines, of what a file alone computes."""
    show = {
        k: "n/a" if v is None else f"{v:.1f}" for k, v in summary.items() if k.endswith(("_mean", "_std", "_seconds"))
    }
    return (
        f"final: return {show['final_return_mean']} ± {show['final_return_std']} over {summary['num_seeds']} seeds "
        f"(episodes ending in the last 5% of training), greedy eval {show['eval_return_mean']}\ncompile "
        f"{show['compile_seconds']} s, train {show['train_seconds']} s ({summary['steps_per_second']:,.0f} env "
        f"steps/s), eval {show['eval_seconds']} s"
    )


HARNESS_OPTIONS = "sweep compile-cache checkpoint checkpoint-every checkpoint-buffer resume eval-only render track "
HARNESS_OPTIONS += "wandb-project quiet pbt pbt-interval pbt-fraction pbt-fields pbt-bounds pbt-perturb pbt-fitness"


def unknown_option(name: str, given: list, options: list) -> str:
    """What to say of an option this file alone lacks: that it is the run harness's, or the closest of its own."""
    option = next((word.split("=")[0] for word in given if word.startswith("-")), given[0])
    if option.lstrip("-").removeprefix("no-") in HARNESS_OPTIONS.split():
        return f"{option}: an option of the run harness (algorithms/onefile_harness/), not of {name} alone"
    squash = lambda text: text.lstrip("-").replace("-", "").replace("_", "").lower()  # noqa: E731  (--mtau: --m-tau)
    close = difflib.get_close_matches(squash(option), (ours := {squash(o): o for o in options}), n=1)
    return f"{option}: not an option of {name}" + (f"; did you mean {ours[close[0]]}?" if close else " (see --help)")


def main(argv: list[str] | None = None) -> int:
    """This file alone, writing a run directory as the harness does; exit 2: bad input (nothing written), 3: NaN."""
    configure_xla()  # before JAX's first computation
    name, fields = os.path.basename(__file__), dataclasses.fields(Config)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False, exit_on_error=False)
    try:
        for field in fields:
            kind, *text = typing.get_args(field.type) or (field.type, "")  # its help and rules; a plain `x: float` too
            require(kind in (bool, int, float, str), f"Config.{field.name}: a flag takes bool, int, float or str")
            parse = {"action": argparse.BooleanOptionalAction} if kind is bool else {"type": kind}
            parse |= dict(default=field.default, help="; ".join(text))
            parser.add_argument("--" + field.name.replace("_", "-"), **parse)
        parser.add_argument("--runs-dir", default="runs", help="results go to a new directory under this one")
        args, unknown = parser.parse_known_args(argv)
        require(not unknown, unknown and unknown_option(name, unknown, list(parser._option_string_actions)))
        config = Config(**{field.name: getattr(args, field.name) for field in fields})
        train, evaluate = make_train(config), make_evaluate(config)
        os.makedirs(args.runs_dir, exist_ok=True)
        prefix = f"{name[:-3]}-{config.env_name.replace('/', '-')}-{time.strftime('%Y%m%d-%H%M%S')}-"
        run_dir = pathlib.Path(tempfile.mkdtemp(prefix=prefix, dir=args.runs_dir))
    except (argparse.ArgumentError, ConfigError, OSError) as error:
        print(f"{name}: error: {error}", file=sys.stderr)
        return 2
    print(f"{name} alone (no run harness beside it): {config.num_seeds} seeds on {config.env_name}", flush=True)
    (run_dir / "config.json").write_text(json.dumps({**dataclasses.asdict(config), "sweep": {}}, indent=2))
    runner, metrics, seconds = train_with_progress(config, train)
    params, keys = saved_params(runner), jax.random.split(jax.random.PRNGKey(config.seed + 1), config.num_seeds)
    start, greedy = time.perf_counter(), np.asarray(jax.jit(jax.vmap(evaluate))(params, keys))
    summary = summarise_run(config, metrics, greedy, {**seconds, "eval": time.perf_counter() - start})
    point = lambda tree: jax.tree.map(lambda x: np.asarray(x)[None], tree)  # noqa: E731  (one sweep point)
    wall = seconds["train"] * np.arange(1, config.num_updates + 1) / config.num_updates  # spread evenly over updates
    np.savez_compressed(run_dir / "metrics.npz", **point(metrics), eval_return=point(greedy), wall_seconds=wall)
    (run_dir / "params.msgpack").write_bytes(serialization.to_bytes(point(params)))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    for update, seed in np.argwhere(~metrics["finite"].T)[:1]:  # [update, seed] where NaN or inf first appeared
        print(f"error: NaN or inf first appeared at update {update + 1}, seed index {seed}", file=sys.stderr)
    print(report_lines(summary) + f"\nresults: {run_dir}", flush=True)
    return 0 if metrics["finite"].all() else 3


if __name__ == "__main__":  # in the repository, the run harness beside this file takes over
    harness = os.path.isdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), "onefile_harness"))
    sys.exit(__import__("onefile_harness").command_line(sys.modules[__name__]) if harness else main())
