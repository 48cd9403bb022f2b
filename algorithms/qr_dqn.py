"""QR-DQN (quantile regression DQN, Dabney et al. 2018) for discrete-action gymnax environments, in one
file: `python qr_dqn.py --env-name Acrobot-v1 --num-seeds 16 --lr 1e-3` (--help lists every option).
The Q-network gives each action `num_quantiles` quantiles of its return distribution, at the midpoints
tau_i = (2i + 1) / (2N); it learns them by quantile Huber regression towards the target network's
quantiles after the next action, and acts on their mean (replay buffer, target network, optional
double DQN as in dqn.py).
The whole run (epsilon-greedy acting, replay-buffer writes, gradient steps and target updates at their
env-step intervals) is one jitted function, and seeds (and sweep points: the float hyperparameters in
HParams) are vmapped into one program, each run with its own replay buffer:

    train = make_train(Config(env_name="CartPole-v1"))
    runner, metrics = jax.jit(jax.vmap(train))(jax.random.split(jax.random.PRNGKey(0), 8))

Depends only on jax, flax, optax, chex, gymnax and numpy: copy it anywhere and it runs. Importing
it defines things and does nothing else. The algorithm comes first; the blocks that let the file
run alone (environment loop, evaluation, command line) are last, the same in every file.
"""

import argparse
import dataclasses
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

# gymnax is imported where an environment is made, not here: it computes with JAX when
# imported, which would start JAX's backend before the command line sets XLA's flags.

HARNESS_PROTOCOL = 2  # the run harness's interface this file follows (algorithms/onefile_harness/protocol.py)
ACTIONS = "discrete"  # the action spaces this algorithm takes


@dataclasses.dataclass(frozen=True)
class Config:
    """Every field is a command-line flag (`lr` is --lr); its annotation's text is the flag's help."""

    env_name: Annotated[str, "a gymnax environment with discrete actions (gymnax.registered_envs)"] = "CartPole-v1"
    total_timesteps: Annotated[int, "environment steps per run (all envs together)"] = 300_000
    num_envs: Annotated[int, "parallel environments per run"] = 10
    num_steps: Annotated[int, "steps per environment in each update (one progress/metrics row)"] = 100
    buffer_size: Annotated[int, "replay buffer capacity in transitions per run (>= num_envs)"] = 10_000
    batch_size: Annotated[int, "transitions per gradient step, sampled uniformly from the buffer"] = 128
    learning_starts: Annotated[int, "env steps before the first gradient step"] = 10_000
    train_frequency: Annotated[int, "env steps (all envs together) per gradient step"] = 10
    target_update_frequency: Annotated[int, "env steps (all envs together) per target-network update"] = 250
    tau: Annotated[float, "target update rate: target <- tau * online + (1 - tau) * target (1 = copy)"] = 1.0
    double_dqn: Annotated[bool, "double DQN: the online network picks the next action, the target rates it"] = True
    num_quantiles: Annotated[int, "quantiles per action (the loss weighs N^2 pairs; SB3's 50 learned later)"] = 25
    kappa: Annotated[float, "Huber threshold of the quantile loss (1, the paper's, diverged on CartPole)"] = 100.0
    lr: Annotated[float, "Adam learning rate (start value when annealed)"] = 2.5e-4
    anneal_lr: Annotated[bool, "decay the learning rate linearly to 0 over all gradient steps"] = False
    gamma: Annotated[float, "discount factor"] = 0.99
    max_grad_norm: Annotated[float, "global gradient-norm clip"] = 1000.0
    eps_start: Annotated[float, "epsilon-greedy exploration rate at the first step"] = 1.0
    eps_end: Annotated[float, "exploration rate once the linear decay is over"] = 0.01
    eps_fraction: Annotated[float, "fraction of training (total_timesteps) over which epsilon decays linearly"] = 0.3
    activation: Annotated[str, "hidden activation: relu or tanh"] = "relu"
    hidden_size: Annotated[int, "units per hidden layer of the Q-network"] = 128
    num_layers: Annotated[int, "hidden layers of the Q-network"] = 2
    eval_episodes: Annotated[int, "greedy evaluation episodes per run after training"] = 16
    seed: Annotated[int, "base seed; run i uses jax.random.split(PRNGKey(seed), num_seeds)[i]"] = 0
    num_seeds: Annotated[int, "independent runs trained side by side (vmapped)"] = 8

    @property
    def steps_per_update(self) -> int:
        """Env steps of one update, all envs together (one progress and metrics row)."""
        return self.num_envs * self.num_steps

    @property
    def num_updates(self) -> int:
        return self.total_timesteps // self.steps_per_update


class HParams(NamedTuple):
    """Float hyperparameters that may differ between the runs of one compiled program (--sweep)."""

    lr: jax.Array
    gamma: jax.Array
    tau: jax.Array
    max_grad_norm: jax.Array
    eps_start: jax.Array
    eps_end: jax.Array
    eps_fraction: jax.Array
    kappa: jax.Array


ACTIVATIONS = {"relu": nn.relu, "tanh": nn.tanh}


def validate(config: Config) -> None:
    """Refuses a config that cannot run, naming the option and what is allowed."""
    sizes = ("total_timesteps", "num_envs", "num_steps", "buffer_size", "batch_size")
    intervals = ("train_frequency", "target_update_frequency")
    require_positive(config, (*sizes, *intervals, "hidden_size", "num_layers", "eval_episodes", "num_seeds"))
    require(config.learning_starts >= 0, f"--learning-starts must be >= 0, got {config.learning_starts}")
    validate_hparams({name: getattr(config, name) for name in HParams._fields})
    activation = config.activation
    require(activation in ACTIVATIONS, f"--activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    require(config.num_quantiles >= 1, f"--num-quantiles must be at least 1, got {config.num_quantiles}")
    size, envs = config.buffer_size, config.num_envs
    require(size >= envs, f"--buffer-size {size} must be at least num_envs = {envs} (each env step writes num_envs)")
    per_update = config.steps_per_update
    require(
        per_update <= config.total_timesteps < 2**31,
        f"--total-timesteps must be in [{per_update}, 2**31) (one update of num_envs * num_steps, and int32 step "
        f"counts), got {config.total_timesteps}",
    )
    for name in ("buffer_size", "learning_starts", *intervals):  # int32 inside the compiled program too
        require(getattr(config, name) < 2**31, f"{flag(name)} must be below 2**31, got {getattr(config, name)}")


def validate_hparams(values: dict) -> None:
    """The checks of the sweepable fields, for the Config and for every sweep point."""
    for name, value in values.items():
        require(np.isfinite(value), f"{flag(name)} must be finite, got {value}")
    for name in ("lr", "max_grad_norm"):
        require(values[name] > 0, f"{flag(name)} must be positive, got {values[name]}")
    require(0 < values["tau"] <= 1, f"--tau must be in (0, 1], got {values['tau']}")
    require(values["kappa"] > 0, f"--kappa must be positive, got {values['kappa']}")
    for name in ("gamma", "eps_start", "eps_end", "eps_fraction"):
        require(0 <= values[name] <= 1, f"{flag(name)} must be in [0, 1], got {values[name]}")


# --------------------------------------------------------------------------------------
# Networks
# --------------------------------------------------------------------------------------
class QNetwork(nn.Module):
    """MLP from a flat observation to each action's return quantiles, [num_actions, num_quantiles]."""

    num_actions: int
    num_quantiles: int
    hidden_size: int
    num_layers: int
    activation: str

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        act = ACTIVATIONS[self.activation]
        for _ in range(self.num_layers):
            x = act(nn.Dense(self.hidden_size)(x))
        quantiles = nn.Dense(self.num_actions * self.num_quantiles)(x)
        return quantiles.reshape(*x.shape[:-1], self.num_actions, self.num_quantiles)


class Networks(NamedTuple):
    q: nn.Module  # obs -> [num_actions, num_quantiles] quantiles; its parameters are params["q"] (and the target's)


def make_networks(config: Config, num_actions: int) -> Networks:
    shape = dict(hidden_size=config.hidden_size, num_layers=config.num_layers, activation=config.activation)
    return Networks(q=QNetwork(num_actions, config.num_quantiles, **shape))


def q_values(config: Config, network: nn.Module, params, obs: jax.Array) -> jax.Array:
    """[..., num_actions] Q-values (its quantiles' means) of the network with parameters `params`."""
    return network.apply(params, obs).mean(-1)


# --------------------------------------------------------------------------------------
# The algorithm: the replay buffer, the TD loss, and the training loop
# --------------------------------------------------------------------------------------
class Transition(NamedTuple):
    obs: jax.Array  # [..., obs_dim]
    action: jax.Array  # [...] int32
    reward: jax.Array  # [...] float32
    terminated: jax.Array  # [...] bool: a terminal state; a time-limit truncation is not one
    final_obs: jax.Array  # [..., obs_dim] the true next observation (before auto-reset)


class ReplayBuffer(NamedTuple):
    """A circular store of one run's transitions (under vmap, one per seed): slots [0, size) are filled."""

    data: Transition  # every field [capacity, ...]
    position: jax.Array  # int32: where the next transition goes
    size: jax.Array  # int32, at most capacity


def buffer_init(capacity: int, obs_dim: int) -> ReplayBuffer:
    zeros = lambda *shape, dtype=jnp.float32: jnp.zeros((capacity, *shape), dtype)  # noqa: E731
    data = Transition(zeros(obs_dim), zeros(dtype=jnp.int32), zeros(), zeros(dtype=bool), final_obs=zeros(obs_dim))
    return ReplayBuffer(data=data, position=jnp.int32(0), size=jnp.int32(0))


def buffer_add(buffer: ReplayBuffer, batch: Transition) -> ReplayBuffer:
    """Writes a batch of n <= capacity transitions at `position`, wrapping around the end."""
    capacity, n = buffer.data.action.shape[0], batch.action.shape[0]
    slots = (buffer.position + jnp.arange(n, dtype=jnp.int32)) % capacity
    data = jax.tree.map(lambda store, x: store.at[slots].set(x.astype(store.dtype)), buffer.data, batch)
    size = jnp.minimum(buffer.size + n, capacity)
    return ReplayBuffer(data=data, position=(buffer.position + n) % capacity, size=size)


def buffer_sample(buffer: ReplayBuffer, key: jax.Array, batch_size: int) -> Transition:
    """`batch_size` transitions from the filled slots, each as likely as any other (batch / size) and, once
    the buffer holds a batch, none twice: one from each of `batch_size` nearly equal strata of the filled
    range, the pattern rotated by a uniform offset. Each batch spans the buffer evenly: draws with
    replacement, noisier, left more of c51.py's CartPole seeds below a return of 475."""
    slot_key, shift_key = jax.random.split(key)
    n, j = buffer.size, jnp.arange(batch_size + 1, dtype=jnp.int32)
    bounds = j * (n // batch_size) + j * (n % batch_size) // batch_size  # floor(j * n / batch) without int32 overflow
    slots = jax.random.randint(slot_key, (batch_size,), bounds[:-1], jnp.maximum(bounds[1:], bounds[:-1] + 1))
    shift = jax.random.randint(shift_key, (), 0, n)
    slots = jnp.where(slots >= n - shift, slots - (n - shift), slots + shift)  # (slots + shift) % n, no overflow
    return jax.tree.map(lambda store: store[slots], buffer.data)


class Runner(NamedTuple):
    """Everything one run carries from update to update."""

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


def quantile_midpoints(num_quantiles: int) -> jax.Array:
    """tau_i = (2i + 1) / (2N), i = 0 .. N-1: the quantile levels the network's outputs estimate."""
    return (2 * jnp.arange(num_quantiles, dtype=jnp.float32) + 1) / (2 * num_quantiles)


def quantile_huber_loss(quantiles: jax.Array, targets: jax.Array, kappa: jax.Array) -> jax.Array:
    """Quantile Huber loss of estimates `quantiles` [B, N] at the midpoints tau_i against sampled
    `targets` [B, N']: with u = targets[b, j] - quantiles[b, i],

        loss = mean_b sum_i mean_j |tau_i - 1{u < 0}| * huber_kappa(u) / kappa,

    huber_kappa(u) = u^2 / 2 for |u| <= kappa, else kappa * (|u| - kappa / 2)."""
    tau = quantile_midpoints(quantiles.shape[-1])[:, None]
    u = targets[:, None, :] - quantiles[:, :, None]  # [B, i, j]
    weighted = jnp.where(u < 0, 1.0 - tau, tau) * optax.huber_loss(u, delta=kappa) / kappa  # |tau - 1{u < 0}|
    return weighted.mean(-1).sum(-1).mean()


def make_td_loss(config: Config, network: nn.Module) -> Callable:
    """Returns `td_loss(params, target_params, batch, hp, key) -> (loss, aux)` for Q-network params.

    target quantiles = reward + gamma * (1 - terminated) * theta_target(final_obs, a'), where a'
    has the highest mean quantile by the target network, or by the online one (double DQN).
    `final_obs` is the true next observation, so a time-limit truncation bootstraps from the
    state it cut off; only `terminated` zeroes the bootstrap. The loss is `quantile_huber_loss`
    of the taken action's quantiles. aux holds the taken actions' Q-values (mean quantiles) and
    the target quantiles. `key` is unused by QR-DQN itself: it is there for a loss that samples.
    """

    def td_loss(params, target_params, batch: Transition, hp: HParams, key: jax.Array):
        next_quantiles_target = network.apply(target_params, batch.final_obs)
        chooser = jax.lax.stop_gradient(params) if config.double_dqn else target_params
        next_action = jnp.argmax(q_values(config, network, chooser, batch.final_obs), -1)
        next_quantiles = jnp.take_along_axis(next_quantiles_target, next_action[:, None, None], -2)[:, 0]
        chex.assert_equal_shape([batch.reward, batch.terminated, batch.action, next_action])
        target = batch.reward[:, None] + hp.gamma * (1.0 - batch.terminated[:, None]) * next_quantiles
        target = jax.lax.stop_gradient(target)
        quantiles = jnp.take_along_axis(network.apply(params, batch.obs), batch.action[:, None, None], -2)[:, 0]
        chex.assert_shape([target, quantiles], (batch.action.shape[0], config.num_quantiles))
        loss = quantile_huber_loss(quantiles, target, hp.kappa)
        return loss, {"q": quantiles.mean(-1), "target": target}

    return td_loss


def make_optimizer(config: Config, hparams: HParams):
    num_grad_steps = max(1, total_gradient_steps(config))
    anneal = lambda count: hparams.lr * jnp.maximum(1.0 - count / num_grad_steps, 0.0)  # noqa: E731
    lr = anneal if config.anneal_lr else hparams.lr
    return optax.chain(optax.clip_by_global_norm(hparams.max_grad_norm), optax.adam(learning_rate=lr))


def make_train(config: Config, env: "VecEnv | None" = None) -> Callable:
    """Returns `train(rng, hparams=None) -> (runner, metrics)` running the whole config, where
    `metrics` maps names to arrays of shape [num_updates]: `train.init(rng, hparams)`, then
    `train.update(runner, update_index)` num_updates times in a `lax.scan`. `env` is the vectorised
    environment to train in (default: `VecEnv(config.env_name, config.num_envs)`)."""
    validate(config)
    env = VecEnv(config.env_name, config.num_envs) if env is None else env
    network = make_networks(config, env.num_actions).q
    td_loss = make_td_loss(config, network)
    T, N = config.num_steps, config.num_envs
    max_grad_steps = -(-N // config.train_frequency)  # the most one vectorized step can owe (usually 0 or 1 are due)

    def init(rng: jax.Array, hparams: HParams | None = None) -> Runner:
        hparams = hparams_from(config) if hparams is None else hparams
        rng, params_key, env_key = jax.random.split(rng, 3)
        params = {"q": network.init(params_key, jnp.zeros((1, env.obs_dim)))}
        return Runner(
            params=params,
            target_params=params,
            opt_state=make_optimizer(config, hparams).init(params),
            buffer=buffer_init(config.buffer_size, env.obs_dim),
            episodes=Episodes.start(*env.reset(env_key)),
            rng=rng,
            hparams=hparams,
        )

    def gradient_step(runner: Runner, key: jax.Array):
        """One Adam step on a batch drawn from the buffer: (runner, its loss, mean Q and gradient norm)."""
        sample_key, loss_key = jax.random.split(key)
        batch = buffer_sample(runner.buffer, sample_key, config.batch_size)
        hp, target_params = runner.hparams, runner.target_params["q"]
        loss_fn = lambda params: td_loss(params["q"], target_params, batch, hp, loss_key)  # noqa: E731
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(runner.params)
        updates, opt_state = make_optimizer(config, hp).update(grads, runner.opt_state)
        stats = dict(loss=loss, q_mean=aux["q"].mean(), grad_norm=optax.tree.norm(grads))
        return runner._replace(params=optax.apply_updates(runner.params, updates), opt_state=opt_state), stats

    def learn(runner: Runner, before: jax.Array, key: jax.Array):
        """The gradient steps and target updates due in a vectorized step from `before` env steps:
        one per multiple of its interval that the env-step count crossed, so any num_envs keeps
        the schedule. Returns (runner, (the [max_grad_steps] steps' stats, which were taken, target updates))."""
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
            act_key, env_key, learn_key = jax.random.split(key, 3)
            before = (update_index * T + t) * N  # env steps of this run before this vectorized step
            # Same for every seed and sweep point (not batched under vmap): the conds in learn stay conds.
            eps = epsilon(config, hp, before)
            obs = runner.episodes.obs
            action = sample_action(act_key, q_values(config, network, runner.params["q"], obs), eps)
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


# --------------------------------------------------------------------------------------
# The policy's action
# --------------------------------------------------------------------------------------
def sample_action(key: jax.Array, q: jax.Array, epsilon: jax.Array) -> jax.Array:
    """Epsilon-greedy on [..., num_actions] Q-values: a uniformly random action with probability epsilon."""
    explore_key, action_key = jax.random.split(key)
    explore = jax.random.uniform(explore_key, q.shape[:-1]) < epsilon
    return jnp.where(explore, jax.random.randint(action_key, q.shape[:-1], 0, q.shape[-1]), jnp.argmax(q, -1))


def make_greedy_policy(config: Config, env: "VecEnv") -> "Policy":
    """The action of the highest Q-value (mean quantile) of the online network (no carry: not recurrent)."""
    network = make_networks(config, env.num_actions).q

    def act(params, carry, obs: jax.Array, start: jax.Array, key: jax.Array):
        return carry, jnp.argmax(q_values(config, network, params["q"], obs), -1)

    return Policy(init=lambda num_envs: (), act=act)


def saved_params(runner: Runner) -> dict:
    """What params.msgpack holds and `make_evaluate` takes: the online Q-network's parameters."""
    return runner.params


# --------------------------------------------------------------------------------------
# Running this file (the same in every algorithm file: tests/test_files.py): config helpers, the
# environment loop, greedy evaluation and the command line. In the repository, `python
# algorithms/<name>.py` hands over to the run harness beside it (algorithms/onefile_harness); a copy
# of this file alone runs `main`.
# --------------------------------------------------------------------------------------
class ConfigError(ValueError):
    """A config value that cannot work, naming the option and what is allowed; raised before anything compiles."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def require_positive(config, names: tuple) -> None:
    for name in names:
        require(getattr(config, name) > 0, f"{flag(name)} must be a positive integer, got {getattr(config, name)}")


def hparams_from(config) -> HParams:  # the Config's own values of the sweepable fields
    return HParams(**{name: jnp.float32(getattr(config, name)) for name in HParams._fields})


def make_env(env_name: str):
    """gymnax.make, with errors a user can act on; only the ACTIONS this file's algorithm takes."""
    import gymnax

    names = gymnax.registered_envs
    require(env_name in names, f"--env-name {env_name!r} is not a gymnax environment; choose one of {', '.join(names)}")
    env, env_params = gymnax.make(env_name)
    kind = "discrete" if isinstance(env.action_space(env_params), gymnax.environments.spaces.Discrete) else "continuous"
    require(kind == ACTIONS, f"--env-name {env_name} has {kind} actions; {os.path.basename(__file__)} takes {ACTIONS}")
    return env, env_params


class EnvStep(NamedTuple):
    obs: jax.Array  # [num_envs, obs_dim] after auto-reset
    state: Any
    reward: jax.Array  # [num_envs] float32
    terminated: jax.Array  # [num_envs] bool: the episode reached a terminal state
    truncated: jax.Array  # [num_envs] bool: the episode hit its time limit
    final_obs: jax.Array  # [num_envs, obs_dim] the true next observation, before auto-reset


class VecEnv:
    """`num_envs` copies of a gymnax env stepped by gymnax's own `step` (auto-reset, the true final
    observation) under `jax.vmap`; observations flat float32, actions in the env's shape."""

    def __init__(self, env_name: str, num_envs: int):
        self.env, self.params = make_env(env_name)
        self.num_envs, self.max_episode_steps = num_envs, int(self.params.max_steps_in_episode)
        self.obs_shape = tuple(self.env.observation_space(self.params).shape)
        self.obs_dim = int(np.prod(self.obs_shape))
        space = self.env.action_space(self.params)
        self.num_actions = int(getattr(space, "n", 0))  # discrete actions: how many
        self.action_shape, self.action_dim = tuple(space.shape), int(np.prod(space.shape))  # continuous actions
        bounds = [np.broadcast_to(np.float32(getattr(space, end, 0)), space.shape) for end in ("low", "high")]
        self.action_low, self.action_high = (bound.reshape(-1) for bound in bounds)  # flat [action_dim]

    def flat(self, obs: jax.Array) -> jax.Array:
        return obs.reshape(*obs.shape[: obs.ndim - len(self.obs_shape)], self.obs_dim).astype(jnp.float32)

    def reset(self, key: jax.Array):
        obs, state = jax.vmap(self.env.reset, in_axes=(0, None))(jax.random.split(key, self.num_envs), self.params)
        return self.flat(obs), state

    def step(self, key: jax.Array, state: Any, action: jax.Array) -> EnvStep:
        step = jax.vmap(self.env.step, in_axes=(0, 0, 0, None))
        keys, action = jax.random.split(key, self.num_envs), action.reshape(self.num_envs, *self.action_shape)
        obs, state, reward, terminated, truncated, info = step(keys, state, action, self.params)
        final_obs = self.flat(info["final_observation"])
        return EnvStep(self.flat(obs), state, reward.astype(jnp.float32), terminated, truncated, final_obs)


class Episodes(NamedTuple):
    """Every env's current episode, and sums over the episodes that ended since `counting()` (an
    update's start): their means are the logged metrics."""

    env_state: Any
    obs: jax.Array  # [num_envs, obs_dim]
    episode_return: jax.Array  # [num_envs] return so far
    episode_length: jax.Array  # [num_envs] steps so far
    finished: jax.Array = None  # int32: episodes that ended since counting began
    return_sum: jax.Array = None  # float32: their returns, summed
    length_sum: jax.Array = None  # int32: their lengths, summed

    @classmethod
    def start(cls, obs: jax.Array, env_state: Any) -> "Episodes":
        return cls(env_state, obs, jnp.zeros(obs.shape[0]), jnp.zeros(obs.shape[0], jnp.int32)).counting()

    def counting(self) -> "Episodes":
        return self._replace(finished=jnp.int32(0), return_sum=jnp.float32(0), length_sum=jnp.int32(0))

    def after(self, step: EnvStep) -> "Episodes":
        """The episodes after `step`: those that ended are counted and begin anew."""
        done, ret, length = step.terminated | step.truncated, self.episode_return + step.reward, self.episode_length + 1
        ended = lambda x: jnp.where(done, x, 0).sum()  # noqa: E731
        sums = (self.finished + done.sum(), self.return_sum + ended(ret), self.length_sum + ended(length))
        return Episodes(step.state, step.obs, jnp.where(done, 0.0, ret), jnp.where(done, 0, length), *sums)

    def metrics(self) -> dict:
        """Mean return and length of the episodes counted: NaN when none ended."""
        mean = lambda total: jnp.where(self.finished > 0, total / jnp.maximum(self.finished, 1), jnp.nan)  # noqa: E731
        return dict(episode_return=mean(self.return_sum), episode_length=mean(self.length_sum), **{
            "episodes_finished": self.finished})  # fmt: skip


class Policy(NamedTuple):
    init: Callable  # init(num_envs) -> the policy's own carry (e.g. a recurrent state)
    act: Callable  # act(params, carry, obs, start, key) -> (carry, action); start: obs begins an episode


class Evaluating(NamedTuple):  # what evaluation carries from step to step
    env_state: Any
    obs: jax.Array
    policy: Any  # the policy's own carry
    total: jax.Array  # [episodes] return so far: each env's first episode is scored, and only it
    alive: jax.Array  # [episodes] bool: that episode has not ended yet
    rng: jax.Array
    t: jax.Array  # env steps taken


def make_evaluate(config: Config, env: VecEnv | None = None) -> Callable:
    """Returns `evaluate(params, rng) -> mean return` of `eval_episodes` greedy episodes, one per env
    of `env` (default: VecEnv(config.env_name, config.eval_episodes)), each scored until it ends."""
    validate(config)
    env = VecEnv(config.env_name, config.eval_episodes) if env is None else env
    policy = make_greedy_policy(config, env)

    def env_step(params, carry: Evaluating) -> Evaluating:
        rng, act_key, env_key = jax.random.split(carry.rng, 3)
        policy_carry, action = policy.act(
            params, carry.policy, carry.obs, jnp.full(env.num_envs, carry.t == 0), act_key
        )
        step, total = env.step(env_key, carry.env_state, action), carry.total
        total, alive = (
            total + jnp.where(carry.alive, step.reward, 0.0),
            carry.alive & ~(step.terminated | step.truncated),
        )
        return Evaluating(step.state, step.obs, policy_carry, total=total, alive=alive, rng=rng, t=carry.t + 1)

    def evaluate(params, rng: jax.Array) -> jax.Array:
        reset_key, rng = jax.random.split(rng)
        obs, env_state = env.reset(reset_key)
        alive, total = jnp.ones(env.num_envs, bool), jnp.zeros(env.num_envs)
        first = Evaluating(env_state, obs, policy.init(env.num_envs), total=total, alive=alive, rng=rng, t=0)
        running = lambda carry: carry.alive.any() & (carry.t < env.max_episode_steps)  # noqa: E731
        return jax.lax.while_loop(running, lambda carry: env_step(params, carry), first).total.mean()

    return evaluate


def configure_xla() -> None:
    """XLA's flags for this file alone, set before JAX's first computation unless XLA_FLAGS has them:
    the concurrency-optimised CPU scheduler off (it has deadlocked vmapped training, jaxlib 0.10), and
    on a CPU-only install backend optimisation level 1 (compiles faster, trains as fast)."""
    flags = {"xla_cpu_enable_concurrency_optimized_scheduler": "false"}
    accelerator = any(module.name.startswith(("jax_cuda", "jax_rocm", "libtpu")) for module in pkgutil.iter_modules())
    if os.environ.get("JAX_PLATFORMS", "").lower() == "cpu" or not accelerator:
        flags["xla_backend_optimization_level"] = "1"
    for name, value in flags.items():
        if name not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{name}={value}".strip()


def train_in_chunks(config: Config, train, keys: jax.Array):
    """All seeds in one vmapped program, called for a tenth of the updates at a time with progress
    printed between calls; the updates past the run's end (in the last chunk) change nothing."""
    num_updates, chunk = config.num_updates, -(-config.num_updates // 10)
    runner = jax.jit(lambda keys: jax.lax.map(train.init, keys))(keys)  # as the harness does on CPU
    shapes = jax.eval_shape(train.update, jax.eval_shape(train.init, keys[0]), 0)[1]
    skip = lambda runner, index: (runner, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))  # noqa: E731
    update = lambda runner, index: jax.lax.cond(index < num_updates, train.update, skip, runner, index)  # noqa: E731
    scan = lambda runner, first: jax.lax.scan(update, runner, first + jnp.arange(chunk))  # noqa: E731
    run, chunks, start = jax.jit(jax.vmap(scan, in_axes=(0, None)), donate_argnums=0), [], time.perf_counter()
    for first in range(0, num_updates, chunk):
        runner, metrics = run(runner, first)
        chunks.append(jax.device_get(metrics))
        done, returns = min(first + chunk, num_updates), chunks[-1]["episode_return"]
        speed = done * config.steps_per_update * len(keys) / (time.perf_counter() - start)
        mean = returns[np.isfinite(returns)].mean() if np.isfinite(returns).any() else np.nan
        print(
            f"update {done}/{num_updates}: return {mean:.1f}, {speed:,.0f} env steps/s (compile included)", flush=True
        )
    return runner, jax.tree.map(lambda *parts: np.concatenate(parts, axis=1)[:, :num_updates], *chunks)


def main(argv: list[str] | None = None) -> int:
    """This file alone: every Config field a flag, all seeds trained in one vmapped program, the greedy
    policies evaluated, and config.json, metrics.npz, params.msgpack and summary.json written as the
    run harness writes them. Exits 2 on bad input (nothing written), 3 when NaN or inf appeared."""
    name, fields = os.path.basename(__file__), dataclasses.fields(Config)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False, exit_on_error=False)
    for field in fields:
        kind, doc = typing.get_args(field.type)
        parse = {"action": argparse.BooleanOptionalAction} if kind is bool else {"type": kind}
        parser.add_argument(flag(field.name), default=field.default, help=doc, **parse)
    parser.add_argument("--runs-dir", default="runs", help="results go to a new directory under this one")
    try:
        args, unknown = parser.parse_known_args(argv)
        harness = "(the others, such as --sweep, --resume and --track, need the run harness beside it)"
        require(
            not unknown, f"{' '.join(unknown)}: not an option of {name} alone, whose options --help lists {harness}"
        )
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
    start, keys = time.perf_counter(), jax.random.split(jax.random.PRNGKey(config.seed), config.num_seeds)
    runner, metrics = train_in_chunks(config, train, keys)
    seconds = time.perf_counter() - start  # compilation included
    eval_keys = jax.random.split(jax.random.PRNGKey(config.seed + 1), config.num_seeds)
    return write_results(
        run_dir, config, runner, metrics, jax.jit(jax.vmap(evaluate))(saved_params(runner), eval_keys), seconds
    )


def write_results(run_dir: pathlib.Path, config: Config, runner, metrics: dict, eval_return, seconds: float) -> int:
    """metrics.npz, params.msgpack and summary.json as the run harness writes them (one sweep point),
    and the results on stdout; returns the exit status: 3 when NaN or inf appeared."""
    point = lambda tree: jax.tree.map(lambda x: np.asarray(x)[None], tree)  # noqa: E731
    wall = seconds * np.arange(1, config.num_updates + 1) / config.num_updates
    np.savez_compressed(run_dir / "metrics.npz", **point(metrics), eval_return=point(eval_return), wall_seconds=wall)
    (run_dir / "params.msgpack").write_bytes(serialization.to_bytes(point(saved_params(runner))))
    last = -(-config.num_updates // 20)  # a run's final return: its episodes ending in the last 5% of updates
    returns, counts = metrics["episode_return"][:, -last:], metrics["episodes_finished"][:, -last:]
    with np.errstate(invalid="ignore", divide="ignore"):  # NaN: no episode ended in that window
        final = np.where(counts > 0, returns * counts, 0.0).sum(-1) / counts.sum(-1)
    summary = dict(algorithm=os.path.basename(__file__)[:-3], env_name=config.env_name, num_seeds=config.num_seeds)
    summary.update(trained_timesteps=config.num_updates * config.steps_per_update, train_seconds=seconds)
    summary.update(final_return_per_seed=[float(x) if np.isfinite(x) else None for x in final])
    summary.update(eval_return_mean=float(np.mean(eval_return)))
    bad = np.argwhere(~metrics["finite"].T)  # [update, seed] where NaN or inf appeared, earliest first
    if len(bad):
        summary["nonfinite"] = {"first_update": int(bad[0, 0]) + 1, "seed_index": int(bad[0, 1])}
        print(f"error: NaN or inf first appeared at update {bad[0, 0] + 1}, seed index {bad[0, 1]}", file=sys.stderr)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"final return per seed {np.round(final, 1).tolist()}, greedy eval {summary['eval_return_mean']:.1f}")
    print(f"results: {run_dir}", flush=True)
    return 3 if len(bad) else 0


if __name__ == "__main__":
    if os.path.isdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), "onefile_harness")):
        from onefile_harness import command_line  # the repository's run harness, beside this file

        sys.exit(command_line(sys.modules[__name__]))
    configure_xla()
    sys.exit(main())
