"""PPO (clipped surrogate, GAE, Gaussian policy) for continuous-action gymnax environments, in one file:
`python ppo_continuous.py --env-name MountainCarContinuous-v0 --num-seeds 16` (--help lists every option). The
whole run is one jitted function; seeds, and sweep points of the float hyperparameters in HParams, are vmapped
into one program:

    train = make_train(Config(env_name="Pendulum-v1"))
    runner, metrics = jax.jit(jax.vmap(train))(jax.random.split(jax.random.PRNGKey(0), 8))

The policy is a diagonal Gaussian (an MLP gives the mean, a learned state-independent vector the log std); its
samples are clipped to the action bounds (or squashed into them with tanh, --squash). Observations are normalised
by running per-feature statistics and rewards scaled by a running std of the discounted return (both on by
default); params.msgpack saves those statistics with the networks.

Needs jax, flax, optax, chex, distrax, gymnax and numpy only; importing it defines things and does nothing else.
"""

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
import distrax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization

HARNESS_PROTOCOL = 4  # the run harness's interface this file follows (algorithms/onefile_harness/protocol.py)
ACTIONS = "continuous"  # the action spaces this algorithm takes


# Defaults for Pendulum-v1: each rollout is one whole 200-step episode per env (docs/defaults.md).
@dataclasses.dataclass(frozen=True)
class Config:
    """Each field is a flag (`lr` is --lr), annotated with its help, then the rules its value satisfies."""

    env_name: Annotated[str, "a gymnax environment with continuous actions (gymnax.registered_envs)"] = "Pendulum-v1"
    total_timesteps: Annotated[int, "env steps per run (all envs together)", "total_timesteps < 2**31"] = 160_000
    num_envs: Annotated[int, "parallel environments per run", "0 < num_envs < 2**31"] = 8
    num_steps: Annotated[int, "steps per environment in each rollout", "0 < num_steps < 2**31"] = 200
    update_epochs: Annotated[int, "passes over each rollout batch", "0 < update_epochs < 2**31"] = 4
    num_minibatches: Annotated[int, "minibatches per epoch; divides num_envs * num_steps", "num_minibatches > 0"] = 8
    lr: Annotated[float, "Adam learning rate (start value when annealed)", "0 < lr < inf"] = 2.5e-3
    anneal_lr: Annotated[bool, "decay the learning rate linearly to 0 over all gradient steps"] = True
    gamma: Annotated[float, "discount factor", "0 <= gamma <= 1"] = 0.97
    gae_lambda: Annotated[float, "GAE lambda (bias/variance trade-off of advantages)", "0 <= gae_lambda <= 1"] = 0.95
    clip_eps: Annotated[float, "PPO ratio clip range; also clips the value update", "0 < clip_eps < inf"] = 0.2
    objective: Annotated[str, "ppo, or dpo (Discovered Policy Optimisation)", "objective in ('ppo', 'dpo')"] = "ppo"
    dpo_alpha: Annotated[float, "DPO's drift threshold where the advantage is >= 0", "0 < dpo_alpha < inf"] = 2.0
    dpo_beta: Annotated[float, "DPO's drift threshold where the advantage is < 0", "0 < dpo_beta < inf"] = 0.6
    ent_coef: Annotated[float, "entropy bonus coefficient", "0 <= ent_coef < inf"] = 0.01
    vf_coef: Annotated[float, "value loss coefficient", "0 <= vf_coef < inf"] = 0.5
    max_grad_norm: Annotated[float, "global gradient-norm clip", "0 < max_grad_norm < inf"] = 0.5
    activation: Annotated[str, "hidden activation", "activation in ('tanh', 'relu')"] = "tanh"
    hidden_size: Annotated[int, "units per hidden layer (actor and critic alike)", "0 < hidden_size < 2**31"] = 64
    num_layers: Annotated[int, "hidden layers in actor and critic", "0 < num_layers < 2**31"] = 2
    log_std_init: Annotated[float, "initial log std of the Gaussian (learned)", "-inf < log_std_init < inf"] = 0.0
    squash: Annotated[bool, "squash actions into the bounds with tanh (else clip them to the bounds)"] = False
    normalize_obs: Annotated[bool, "normalise observations by a running per-feature mean and variance"] = True
    normalize_reward: Annotated[bool, "divide rewards by a running std of the discounted return"] = True
    eval_episodes: Annotated[int, "greedy evaluation episodes per run after training", "eval_episodes > 0"] = 16
    seed: Annotated[int, "base seed; run i uses jax.random.split(PRNGKey(seed), num_seeds)[i]"] = 0
    num_seeds: Annotated[int, "independent runs trained side by side (vmapped)", "0 < num_seeds < 2**31"] = 8

    @property
    def steps_per_update(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def num_updates(self) -> int:
        return self.total_timesteps // self.steps_per_update


class HParams(NamedTuple):  # the float hyperparameters in which runs of one compiled program may differ (--sweep)
    lr: jax.Array
    gamma: jax.Array
    gae_lambda: jax.Array
    clip_eps: jax.Array
    ent_coef: jax.Array
    vf_coef: jax.Array
    max_grad_norm: jax.Array


hparams_from = lambda config: HParams(**{f: jnp.float32(getattr(config, f)) for f in HParams._fields})  # noqa: E731


def validate(config: Config) -> None:
    """Refuses a config that cannot run, naming the option and what is allowed (each field's rules, then these)."""
    validate_hparams(dataclasses.asdict(config))
    batch, minibatches = config.steps_per_update, config.num_minibatches
    require(batch % minibatches == 0, f"--num-minibatches {minibatches} must divide num_envs * num_steps = {batch}")
    require(batch <= config.total_timesteps, f"--total-timesteps must be at least num_envs * num_steps = {batch}")


# ---- Networks and the Gaussian policy ----
class Torso(nn.Module):  # what a network reads first: replace it to read observations another way
    obs_shape: tuple  # one observation's shape, as the env gives it

    @nn.compact
    def __call__(self, obs: jax.Array) -> jax.Array:
        """Observations [..., *obs_shape] as float32 vectors [..., features]."""
        return obs.reshape(*obs.shape[: obs.ndim - len(self.obs_shape)], -1).astype(jnp.float32)


class MLP(nn.Module):  # the actor's and the critic's towers: the same shape, different output scales
    out_dim: int
    out_scale: float
    obs_shape: tuple
    hidden_size: int
    num_layers: int
    activation: str

    @nn.compact
    def __call__(self, obs: jax.Array) -> jax.Array:
        act, x = getattr(nn, self.activation), Torso(self.obs_shape)(obs)  # nn.tanh or nn.relu
        for _ in range(self.num_layers):
            x = act(nn.Dense(self.hidden_size, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(x))
        return nn.Dense(self.out_dim, kernel_init=nn.initializers.orthogonal(self.out_scale))(x)


class GaussianActor(MLP):
    """The MLP gives the mean (out_scale 0.01: the first policy is centred on 0); the log std is one
    learned vector, the same for every state."""

    log_std_init: float = 0.0

    @nn.compact
    def __call__(self, obs: jax.Array) -> tuple[jax.Array, jax.Array]:
        log_std = self.param("log_std", nn.initializers.constant(self.log_std_init), (self.out_dim,))
        return super().__call__(obs), log_std


class Networks(NamedTuple):
    actor: nn.Module  # obs -> (mean, log std) of a Gaussian; its parameters are params["actor"]
    critic: nn.Module  # obs -> [1] value; params["critic"]


def make_networks(config: Config, action_dim: int, obs_shape: tuple) -> Networks:
    shape = dict(hidden_size=config.hidden_size, num_layers=config.num_layers, activation=config.activation)
    shape |= dict(obs_shape=obs_shape)
    actor = GaussianActor(action_dim, 0.01, **shape, log_std_init=config.log_std_init)
    return Networks(actor=actor, critic=MLP(1, 1.0, **shape))


def policy(mean: jax.Array, log_std: jax.Array) -> distrax.Distribution:
    """The diagonal Gaussian of the sample u; its event is the last (action) axis (mean and
    log_std broadcast against each other, as in jnp)."""
    return distrax.Independent(distrax.Normal(mean, jnp.exp(log_std)), reinterpreted_batch_ndims=1)


class ActionMap(NamedTuple):
    """From the Gaussian's sample u (what the rollout stores) to the action the env executes. Clip
    (default): a = clip(u, low, high), log-probabilities those of the unclipped u, as in CleanRL,
    Stable-Baselines3 and PureJAXRL: the clip is part of the environment, so the ratio of two Gaussians
    at the same u stays exact (the clipped action's point masses at the bounds have no density ratio).
    Squash: a = centre + half_range * tanh(u), log p(a) = log N(u) - log|det da/du|; that term cancels
    in the ratio but makes the stored log-probability the executed action's true density. It is taken
    at the stored u (forward_log_det_jacobian), never by distrax.Transformed.log_prob(a), whose
    atanh(a) is inf once tanh(u) rounds to 1 (|u| > ~9 in float32) and inaccurate well before."""

    low: jax.Array
    high: jax.Array
    squash: bool

    def bijector(self) -> distrax.Bijector:
        rescale = distrax.ScalarAffine(shift=(self.high + self.low) / 2, scale=(self.high - self.low) / 2)
        return distrax.Block(distrax.Chain([rescale, distrax.Tanh()]), ndims=1)

    def __call__(self, u: jax.Array) -> jax.Array:
        if self.squash:
            return self.bijector().forward(u)
        return jnp.clip(u, self.low, self.high)

    def log_prob(self, u: jax.Array, mean: jax.Array, log_std: jax.Array) -> jax.Array:
        log_prob = policy(mean, log_std).log_prob(u)
        if self.squash:
            log_prob = log_prob - self.bijector().forward_log_det_jacobian(u)
        return log_prob


def action_map(config: Config, env: "VecEnv") -> ActionMap:
    """The env's bounds; --squash needs them finite."""
    low, high = env.action_low, env.action_high
    bounded = np.isfinite(low).all() and np.isfinite(high).all()
    require(bounded or not config.squash, f"--squash needs bounded actions; {config.env_name}'s are {low} to {high}")
    return ActionMap(jnp.asarray(low), jnp.asarray(high), config.squash)


# ---- Running statistics (the same in ppo_continuous.py, ppo_rnd.py: tests/test_files.py) ----
class RunningStats(NamedTuple):  # mean and (population) variance of every sample seen so far, per feature
    mean: jax.Array
    var: jax.Array
    count: jax.Array  # samples seen (float32: exact up to 2**24, a negligible drift beyond)

    @classmethod
    def empty(cls, shape: tuple = ()) -> "RunningStats":
        return cls(mean=jnp.zeros(shape), var=jnp.ones(shape), count=jnp.zeros(()))


def update_stats(stats: RunningStats, batch: jax.Array) -> RunningStats:
    """Merges a batch [..., *feature shape] of n_b samples, mean m_b, variance v_b, into the n_a seen so far (mean
    m_a, variance v_a): the parallel form of Welford's update (Chan et al.), n = n_a + n_b, d = m_b - m_a, mean =
    m_a + d n_b / n, var = (v_a n_a + v_b n_b + d^2 n_a n_b / n) / n, the whole stream's (not a moving average).
    The count starts at 0, so the first batch sets the statistics to its own (no division by 0: n_b > 0)."""
    axes = tuple(range(batch.ndim - stats.mean.ndim))
    n_b = float(np.prod([batch.shape[a] for a in axes]))
    n, delta = stats.count + n_b, batch.mean(axes) - stats.mean
    m2 = stats.var * stats.count + batch.var(axes) * n_b + jnp.square(delta) * (stats.count * n_b / n)
    return RunningStats(stats.mean + delta * (n_b / n), m2 / n, n)


# ---- Normalisers: observations, and the discounted return that scales rewards ----
def normalize(stats: RunningStats, x: jax.Array) -> jax.Array:
    # The clip (+-10, as Stable-Baselines3's VecNormalize; ppo_rnd.py's +-5 is RND's) bounds a near-constant feature.
    return jnp.clip((x - stats.mean) / jnp.sqrt(stats.var + 1e-8), -10.0, 10.0)


def discounted_returns(reward, done, gamma, initial):
    """gym's NormalizeReward return per env, G_t = gamma * G_{t-1} + r_t, restarting from 0 after
    every episode end, for a [T, N] rollout; `initial` [N] carries it across rollouts.
    Returns (G [T, N], the carry for the next rollout)."""

    def step(carry, x):
        reward_t, done_t = x
        g = gamma * carry + reward_t
        return jnp.where(done_t, 0.0, g), g

    last, returns = jax.lax.scan(step, initial, (reward, done))
    return returns, last


# ---- The algorithm: GAE, the PPO loss, and the training loop ----
class Transition(NamedTuple):
    obs: jax.Array  # [T, N, *obs_shape] as the env gave it (not normalised)
    action: jax.Array  # [T, N, action_dim] the Gaussian sample, before clipping or tanh
    log_prob: jax.Array  # [T, N] under the policy that acted
    reward: jax.Array  # [T, N] as the env gave it (not scaled)
    terminated: jax.Array  # [T, N]
    done: jax.Array  # [T, N] terminated or truncated: the next obs starts a new episode
    final_obs: jax.Array  # [T, N, *obs_shape] true next observation (for bootstrapping)


class Batch(NamedTuple):
    obs: jax.Array  # normalised as when acting
    action: jax.Array
    log_prob: jax.Array
    value: jax.Array
    advantage: jax.Array
    target: jax.Array


class Runner(NamedTuple):  # everything one run carries from update to update
    params: Any  # {"actor": ..., "critic": ...}
    opt_state: Any
    episodes: "Episodes"
    obs_norm: RunningStats  # [*obs_shape] statistics of every observation acted on, all envs together
    return_norm: RunningStats  # [] statistics of discounted_return, whose std scales the rewards
    discounted_return: jax.Array  # [num_envs] discounted return so far of each env's current episode
    rng: jax.Array
    hparams: HParams


def compute_gae(reward, value, next_value, terminated, done, gamma, gae_lambda):
    """Advantages and value targets of a [T, N] rollout. `next_value` is V of the true next observation, so a
    truncation bootstraps from the state it cut off; `terminated` zeroes it; `done` (either) stops the recursion."""
    chex.assert_equal_shape([reward, value, next_value, terminated, done])
    delta = reward + gamma * next_value * (1.0 - terminated) - value  # terminated: bool or 0/1

    def backward(next_advantage, step):
        delta_t, done_t = step
        advantage = delta_t + gamma * gae_lambda * (1.0 - done_t) * next_advantage
        return advantage, advantage

    _, advantage = jax.lax.scan(backward, jnp.zeros_like(delta[0]), (delta, done.astype(delta.dtype)), reverse=True)
    return advantage, advantage + value


def policy_objective(config: Config, ratio, log_ratio, advantage, clip_eps):
    """Per sample, from the ratio r of the new policy to the acting one and the advantage A. ppo: -min(r A,
    clip(r, 1 - clip_eps, 1 + clip_eps) A). dpo (Lu et al. 2022): -(r A - drift), the drift ReLU((r - 1) A -
    alpha tanh((r - 1) A / alpha)) for A >= 0, ReLU(log(r) A - beta tanh(log(r) A / beta)) for A < 0."""
    if config.objective == "dpo":
        alpha, beta = config.dpo_alpha, config.dpo_beta
        drift_positive = nn.relu((ratio - 1) * advantage - alpha * jnp.tanh((ratio - 1) * advantage / alpha))
        drift_negative = nn.relu(log_ratio * advantage - beta * jnp.tanh(log_ratio * advantage / beta))
        return -(ratio * advantage - jnp.where(advantage >= 0, drift_positive, drift_negative))
    return -jnp.minimum(ratio * advantage, jnp.clip(ratio, 1 - clip_eps, 1 + clip_eps) * advantage)


def ppo_loss(config: Config, networks: Networks, params, minibatch: Batch, to_env: ActionMap, hp: HParams, key):
    """The policy objective (clipped surrogate or DPO), the clipped value loss and the entropy bonus
    of one minibatch. `key` is unused by PPO itself: it is there for a loss that samples (noise, dropout)."""
    mean, log_std = networks.actor.apply(params["actor"], minibatch.obs)
    log_ratio = to_env.log_prob(minibatch.action, mean, log_std) - minibatch.log_prob
    ratio = jnp.exp(log_ratio)
    advantage = minibatch.advantage
    advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-8)
    policy_loss = policy_objective(config, ratio, log_ratio, advantage, hp.clip_eps).mean()
    value = networks.critic.apply(params["critic"], minibatch.obs)[:, 0]
    value_clipped = minibatch.value + jnp.clip(value - minibatch.value, -hp.clip_eps, hp.clip_eps)
    value_loss = 0.5 * jnp.maximum(jnp.square(value - minibatch.target), jnp.square(value_clipped - minibatch.target))
    value_loss = value_loss.mean()
    # With --squash this is the entropy before tanh: the squashed one has no closed form.
    entropy = policy(mean, log_std).entropy().mean()
    loss = policy_loss + hp.vf_coef * value_loss - hp.ent_coef * entropy
    stats = dict(loss=loss, policy_loss=policy_loss, value_loss=value_loss, entropy=entropy)
    stats.update(approx_kl=((ratio - 1) - log_ratio).mean(), clip_fraction=(jnp.abs(ratio - 1) > hp.clip_eps).mean())
    return loss, stats


def make_optimizer(config: Config, hparams: HParams):
    num_grad_steps = config.num_updates * config.update_epochs * config.num_minibatches
    lr = (lambda count: hparams.lr * (1.0 - count / num_grad_steps)) if config.anneal_lr else hparams.lr
    return optax.chain(optax.clip_by_global_norm(hparams.max_grad_norm), optax.adam(learning_rate=lr, eps=1e-5))


def scale_rewards(config: Config, runner: Runner, transitions: Transition, hp: HParams):
    """(rewards for the update, return statistics, discounted returns carried on). As gym's
    NormalizeReward: r / std(discounted return), the std over every step and env so far (this
    rollout included), so that returns, and the critic's targets, have a scale of about 1
    whatever the env's reward scale is."""
    if not config.normalize_reward:
        return transitions.reward, runner.return_norm, runner.discounted_return
    returns, discounted_return = discounted_returns(
        transitions.reward, transitions.done, hp.gamma, runner.discounted_return
    )
    return_norm = update_stats(runner.return_norm, returns)
    return transitions.reward / jnp.sqrt(return_norm.var + 1e-8), return_norm, discounted_return


def make_train(config: Config, env: "VecEnv | None" = None) -> Callable:
    """`train(rng, hparams=None) -> (runner, metrics of shape [num_updates])`: `train.init(rng, hparams)`, then
    `train.update(runner, update_index)` in a `lax.scan`, in `env` (default: VecEnv(env_name, num_envs))."""
    validate(config)
    env = VecEnv(config.env_name, config.num_envs) if env is None else env
    networks, to_env = make_networks(config, env.action_dim, env.obs_shape), action_map(config, env)
    T, N, M = config.num_steps, config.num_envs, config.num_minibatches

    @jax.custom_batching.sequential_vmap  # seeds in turn: vmapped, orthogonal init's QRs can deadlock XLA's CPU pool
    def init(rng: jax.Array, hparams: HParams | None = None) -> Runner:
        hparams = hparams_from(config) if hparams is None else hparams
        rng, actor_key, critic_key, env_key = jax.random.split(rng, 4)
        obs = jnp.zeros((1, *env.obs_shape), env.obs_dtype)
        params = {"actor": networks.actor.init(actor_key, obs), "critic": networks.critic.init(critic_key, obs)}
        return Runner(
            params=params, opt_state=make_optimizer(config, hparams).init(params),
            episodes=Episodes.start(*env.reset(env_key)), obs_norm=RunningStats.empty(env.obs_shape),
            return_norm=RunningStats.empty(), discounted_return=jnp.zeros(N), rng=rng, hparams=hparams,
        )  # fmt: skip

    def rollout(params, episodes: "Episodes", key: jax.Array, norm: Callable):
        """T steps of every env under the current policy: (the episodes after them, [T, N] transitions)."""

        def env_step(episodes: Episodes, key: jax.Array):
            action_key, env_key = jax.random.split(key)
            mean, log_std = networks.actor.apply(params["actor"], norm(episodes.obs))
            action, log_prob = sample_action(mean, log_std, to_env, action_key)
            step = env.step(env_key, episodes.env_state, to_env(action))
            done = step.terminated | step.truncated
            transition = Transition(episodes.obs, action, log_prob, step.reward, step.terminated, done, step.final_obs)
            return episodes.after(step), transition

        return jax.lax.scan(env_step, episodes.counting(), jax.random.split(key, T))

    def make_batch(params, tr: Transition, reward: jax.Array, norm: Callable, hp: HParams) -> Batch:
        """The rollout (observations normalised) with its values, GAE advantages and value targets for the
        (scaled) `reward`, flattened to [T * N]."""
        obs, final_obs = norm(tr.obs), norm(tr.final_obs)
        # V(final_obs) gives every step's bootstrap value, the last step's included.
        value, next_value = networks.critic.apply(params["critic"], jnp.stack([obs, final_obs]))[..., 0]
        gae = compute_gae(reward, value, next_value, tr.terminated, tr.done, hp.gamma, hp.gae_lambda)
        batch = Batch(obs, tr.action, tr.log_prob, value, *gae)
        return jax.tree.map(lambda x: x.reshape(T * N, *x.shape[2:]), batch)

    def learn(params, opt_state, batch: Batch, key: jax.Array, hp: HParams):
        """`update_epochs` passes of shuffled minibatch steps over the batch."""
        optimizer = make_optimizer(config, hp)

        def minibatch_step(train, inputs):
            (params, opt_state), (minibatch, key) = train, inputs
            grad = jax.grad(ppo_loss, argnums=2, has_aux=True)
            grads, stats = grad(config, networks, params, minibatch, to_env, hp, key)
            updates, opt_state = optimizer.update(grads, opt_state)
            return (optax.apply_updates(params, updates), opt_state), {**stats, "grad_norm": optax.tree.norm(grads)}

        def epoch(train, key):
            order_key, loss_key = jax.random.split(key)
            order = jax.random.permutation(order_key, T * N)
            minibatches = jax.tree.map(lambda x: x[order].reshape(M, T * N // M, *x.shape[1:]), batch)
            return jax.lax.scan(minibatch_step, train, (minibatches, jax.random.split(loss_key, M)))

        return jax.lax.scan(epoch, (params, opt_state), jax.random.split(key, config.update_epochs))

    def update(runner: Runner, update_index: jax.Array):
        hp = runner.hparams
        rng, rollout_key, learn_key = jax.random.split(runner.rng, 3)
        # The statistics stay fixed for the rollout and its update: the update then sees exactly
        # the inputs the policy acted on (its first ratios are 1); this rollout's observations
        # join the statistics for the next one.
        acting_stats = runner.obs_norm
        norm = (lambda x: normalize(acting_stats, x)) if config.normalize_obs else (lambda x: x)
        episodes, transitions = rollout(runner.params, runner.episodes, rollout_key, norm)
        reward, return_norm, discounted_return = scale_rewards(config, runner, transitions, hp)
        obs_norm = update_stats(runner.obs_norm, transitions.obs) if config.normalize_obs else runner.obs_norm
        batch = make_batch(runner.params, transitions, reward, norm, hp)
        (params, opt_state), stats = learn(runner.params, runner.opt_state, batch, learn_key, hp)
        finite = jnp.isfinite(stats["loss"]).all() & jnp.isfinite(optax.tree.norm(params))
        metrics = {**episodes.metrics(), **{name: value.mean() for name, value in stats.items()}, "finite": finite}
        metrics["env_steps"] = (update_index + 1) * T * N
        metrics["action_std"] = jnp.exp(params["actor"]["params"]["log_std"]).mean()
        metrics["return_std"] = jnp.sqrt(return_norm.var)
        runner = Runner(
            params=params, opt_state=opt_state, episodes=episodes, obs_norm=obs_norm, return_norm=return_norm,
            discounted_return=discounted_return, rng=rng, hparams=hp,
        )  # fmt: skip
        return runner, metrics

    def train(rng: jax.Array, hparams: HParams | None = None):
        return jax.lax.scan(update, init(rng, hparams), jnp.arange(config.num_updates, dtype=jnp.int32))

    train.init, train.update = init, update
    return train


# ---- The policy's action ----
def sample_action(mean: jax.Array, log_std: jax.Array, to_env: ActionMap, key: jax.Array):
    """A Gaussian sample u, drawn from `key`, and its log-probability, for each row of (mean, log_std)."""
    action = policy(mean, log_std).sample(seed=key)
    return action, to_env.log_prob(action, mean, log_std)


def make_act(config: Config, greedy: bool = True, env: "VecEnv | None" = None) -> Callable:
    """`act(params, obs, key) -> action` for one observation in the env's own shape (vmap it for a batch): the
    Gaussian's mean, or (greedy=False) a sample of it as in training, clipped or squashed into the bounds;
    observations normalised by the saved statistics (frozen) with normalize_obs."""
    env = env or VecEnv(config.env_name, 1)
    networks, to_env = make_networks(config, env.action_dim, env.obs_shape), action_map(config, env)

    def act(params, obs: jax.Array, key: jax.Array) -> jax.Array:
        if config.normalize_obs:
            obs = normalize(RunningStats(**params["obs_norm"]), obs)
        mean, log_std = networks.actor.apply(params["actor"], obs)
        return to_env(mean if greedy else policy(mean, log_std).sample(seed=key))

    return act


def saved_params(runner: Runner) -> dict:
    """What params.msgpack holds and `make_evaluate` takes: the networks and the normalisation
    statistics (as dicts, so that flax.serialization.msgpack_restore gives back the same tree)."""
    return {**runner.params, "obs_norm": runner.obs_norm._asdict(), "return_norm": runner.return_norm._asdict()}


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
