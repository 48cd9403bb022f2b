"""PPO with random network distillation (RND, Burda et al. 2018) for discrete-action gymnax environments, in one
file: `python ppo_rnd.py --env-name MountainCar-v0 --num-seeds 16` (--help lists every option). The exploration
bonus, a trained predictor's error at matching a fixed random network on the next observation, is learned by a
second value head as a non-episodic return beside the episodic extrinsic one. The whole run is one jitted
function; seeds, and sweep points of the float hyperparameters in HParams, are vmapped into one program:

    train = make_train(Config(env_name="DeepSea-bsuite"))
    runner, metrics = jax.jit(jax.vmap(train))(jax.random.split(jax.random.PRNGKey(0), 8))

Needs jax, flax, optax, chex, gymnax and numpy only; importing it defines things and does nothing else.
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

    env_name: Annotated[str, "a gymnax environment with discrete actions (gymnax.registered_envs)"] = "DeepSea-bsuite"
    total_timesteps: Annotated[int, "env steps per run (all envs together)", "total_timesteps < 2**31"] = 102_400
    num_envs: Annotated[int, "parallel environments per run", "0 < num_envs < 2**31"] = 16
    num_steps: Annotated[int, "steps per environment in each rollout", "0 < num_steps < 2**31"] = 32
    update_epochs: Annotated[int, "passes over each rollout batch", "0 < update_epochs < 2**31"] = 4
    num_minibatches: Annotated[int, "minibatches per epoch; divides num_envs * num_steps", "num_minibatches > 0"] = 4
    lr: Annotated[float, "Adam learning rate (start value when annealed)", "0 < lr < inf"] = 2.5e-3
    anneal_lr: Annotated[bool, "decay the learning rate linearly to 0 over all gradient steps"] = True
    gamma: Annotated[float, "discount factor of the extrinsic (episodic) return", "0 <= gamma <= 1"] = 0.99
    # The intrinsic return never restarts: gamma_int = 1 would let it (and its running std) grow without bound.
    gamma_int: Annotated[float, "discount factor of the intrinsic (non-episodic) return", "0 <= gamma_int < 1"] = 0.99
    ext_coef: Annotated[float, "weight of the extrinsic advantage in the sum", "0 <= ext_coef < inf"] = 2.0
    int_coef: Annotated[float, "weight of the intrinsic advantage in the sum", "0 <= int_coef < inf"] = 1.0
    rnd_lr: Annotated[float, "Adam learning rate of the RND predictor (constant)", "0 < rnd_lr < inf"] = 1e-3
    update_proportion: Annotated[float, "fraction of a minibatch RND trains on", "0 < update_proportion <= 1"] = 0.25
    rnd_size: Annotated[int, "hidden and embedding size of RND's target and predictor", "0 < rnd_size < 2**31"] = 64
    gae_lambda: Annotated[float, "GAE lambda (bias/variance trade-off of advantages)", "0 <= gae_lambda <= 1"] = 0.95
    clip_eps: Annotated[float, "PPO ratio clip range; also clips both value updates", "0 < clip_eps < inf"] = 0.2
    objective: Annotated[str, "ppo, or dpo (Discovered Policy Optimisation)", "objective in ('ppo', 'dpo')"] = "ppo"
    dpo_alpha: Annotated[float, "DPO's drift threshold where the advantage is >= 0", "0 < dpo_alpha < inf"] = 2.0
    dpo_beta: Annotated[float, "DPO's drift threshold where the advantage is < 0", "0 < dpo_beta < inf"] = 0.6
    ent_coef: Annotated[float, "entropy bonus coefficient", "0 <= ent_coef < inf"] = 0.01
    vf_coef: Annotated[float, "value loss coefficient", "0 <= vf_coef < inf"] = 0.5
    max_grad_norm: Annotated[float, "global gradient-norm clip", "0 < max_grad_norm < inf"] = 0.5
    activation: Annotated[str, "hidden activation", "activation in ('tanh', 'relu')"] = "tanh"
    hidden_size: Annotated[int, "units per hidden layer (actor and critic alike)", "0 < hidden_size < 2**31"] = 64
    normalize_obs: Annotated[bool, "feed actor and critic observations normalised as RND's (not raw)"] = False
    num_layers: Annotated[int, "hidden layers in actor and critic", "0 < num_layers < 2**31"] = 2
    network: Annotated[str, "torso: its convolutions (CONVOLUTIONS)", "network in ('mlp', 'cnn', 'nature_cnn')"] = "mlp"
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
    gamma_int: jax.Array
    ext_coef: jax.Array
    int_coef: jax.Array
    rnd_lr: jax.Array
    update_proportion: jax.Array
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


class MLP(nn.Module):  # the actor's, the critic's and RND's towers: the same shape, different output scales
    out_dim: int
    out_scale: float
    network: str
    obs_shape: tuple
    hidden_size: int
    num_layers: int
    activation: str

    @nn.compact
    def __call__(self, obs: jax.Array) -> jax.Array:
        act, x = getattr(nn, self.activation), Torso(self.network, self.obs_shape)(obs)  # nn.tanh or nn.relu
        for _ in range(self.num_layers):
            x = act(nn.Dense(self.hidden_size, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(x))
        return nn.Dense(self.out_dim, kernel_init=nn.initializers.orthogonal(self.out_scale))(x)


class Networks(NamedTuple):
    actor: nn.Module  # obs -> logits; its parameters are params["actor"]
    critic: nn.Module  # obs -> [2] values: extrinsic, intrinsic; params["critic"]
    target: nn.Module  # normalised next obs -> [rnd_size] embedding, fixed at its random init; rnd_params["target"]
    predictor: nn.Module  # the same shape, trained to match the target; rnd_params["predictor"]


def make_networks(config: Config, num_actions: int, obs_shape: tuple) -> Networks:
    """Actor (small initial output: a near-uniform first policy), critic with two value heads, and RND's target
    and predictor: relu MLPs of two hidden layers, rnd_size wide, to an rnd_size embedding; all of observations of
    `obs_shape`."""
    check_network(config.network, obs_shape)
    shape = dict(hidden_size=config.hidden_size, num_layers=config.num_layers, activation=config.activation)
    shape |= dict(network=config.network, obs_shape=obs_shape)
    rnd = dict(
        network=config.network, obs_shape=obs_shape, hidden_size=config.rnd_size, num_layers=2, activation="relu"
    )
    return Networks(actor=MLP(num_actions, 0.01, **shape), critic=MLP(2, 1.0, **shape), **{
        name: MLP(config.rnd_size, np.sqrt(2), **rnd) for name in ("target", "predictor")})  # fmt: skip


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


# ---- The algorithm: intrinsic rewards, two-stream GAE, the PPO and RND losses, and the training loop ----
class Transition(NamedTuple):
    obs: jax.Array  # [T, N, *obs_shape]
    action: jax.Array  # [T, N]
    log_prob: jax.Array  # [T, N] under the policy that acted
    reward: jax.Array  # [T, N]
    terminated: jax.Array  # [T, N]
    done: jax.Array  # [T, N] terminated or truncated: the next obs starts a new episode
    final_obs: jax.Array  # [T, N, *obs_shape] true next observation (for bootstrapping)


class Batch(NamedTuple):
    obs: jax.Array
    action: jax.Array
    log_prob: jax.Array
    value: jax.Array  # [..., 2] extrinsic, intrinsic
    advantage: jax.Array  # ext_coef * A_ext + int_coef * A_int
    target: jax.Array  # [..., 2] extrinsic, intrinsic
    next_obs: jax.Array  # the true next observation, normalised as RND sees it
    next_embedding: jax.Array  # the fixed target's embedding of it: what the predictor learns


class Runner(NamedTuple):  # everything one run carries from update to update
    params: Any  # {"actor": ..., "critic": ...}
    opt_state: Any
    rnd_params: Any  # {"target": fixed, "predictor": trained}
    rnd_opt_state: Any  # the predictor's own Adam state
    episodes: "Episodes"
    obs_norm: RunningStats  # [*obs_shape] statistics of every next observation seen, all envs together
    int_return_norm: RunningStats  # [] statistics of every value of int_return, whose std scales intrinsic rewards
    int_return: jax.Array  # [num_envs] the forward filter's discounted intrinsic return of each env
    rng: jax.Array
    hparams: HParams


def normalize(stats: RunningStats, obs: jax.Array) -> jax.Array:
    """RND's input (and with normalize_obs the actor's and critic's): the observation standardised by the running
    statistics (as float32), clipped to [-5, 5] as in the paper."""
    return jnp.clip((obs.astype(jnp.float32) - stats.mean) / jnp.sqrt(stats.var + 1e-8), -5.0, 5.0)


def policy_obs(config: Config, obs_norm: RunningStats, obs: jax.Array) -> jax.Array:
    """What the actor and critic see: the observation, or with normalize_obs RND's normalised one."""
    return normalize(obs_norm, obs) if config.normalize_obs else obs


def intrinsic_reward(networks: Networks, rnd_params, obs_norm: RunningStats, next_obs: jax.Array):
    """The predictor's squared error (mean over the embedding) at matching the fixed target on the normalised
    next observation: (the raw intrinsic reward [...], the normalised observation, the target's embedding of it)."""
    x = normalize(obs_norm, next_obs)
    embedding = networks.target.apply(rnd_params["target"], x)
    return jnp.square(networks.predictor.apply(rnd_params["predictor"], x) - embedding).mean(-1), x, embedding


def forward_filter(int_reward, initial, gamma_int):
    """The paper's reward forward filter: per env, R_t = gamma_int * R_{t-1} + r_t over a [T, N] rollout, never
    reset at episode ends; `initial` [N] carries it across rollouts. Returns (R [T, N], the carry)."""
    carry, returns = jax.lax.scan(lambda R, r: (gamma_int * R + r,) * 2, initial, int_reward)
    return returns, carry


def scale_intrinsic_reward(raw_int_reward, int_return, int_return_norm: RunningStats, gamma_int):
    """Divides a rollout's [T, N] raw intrinsic rewards by the running std of the intrinsic return: the forward
    filter runs on from `int_return` [N], and all T * N of its values join the statistics first. Returns (scaled
    rewards, the filter's carry, the statistics)."""
    int_returns, int_return = forward_filter(raw_int_reward, int_return, gamma_int)
    int_return_norm = update_stats(int_return_norm, int_returns)
    return raw_int_reward / jnp.sqrt(int_return_norm.var + 1e-8), int_return, int_return_norm


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


def compute_two_stream_gae(
    reward, int_reward, value, next_value, last_value_int, terminated, done, gamma, gamma_int, gae_lambda
):
    """RND's two advantage streams of a [T, N] rollout, from `value` [T, N, 2] (both heads on the observations acted
    on): the extrinsic one episodic, as compute_gae with `next_value` [T, N] V_ext of the true next observation;
    the intrinsic one as if the run were one episode: step t bootstraps from V_int of obs[t + 1] (`last_value_int`
    [N] after the last step), at an episode end the next episode's first, since the stream of experience (and of
    novelty) goes on from there. Returns ((A_ext, target_ext), (A_int, target_int))."""
    chex.assert_equal_shape([reward, int_reward, next_value, terminated, done, value[..., 0]])
    chex.assert_shape(last_value_int, value.shape[1:2])
    extrinsic = compute_gae(reward, value[..., 0], next_value, terminated, done, gamma, gae_lambda)
    stream_next_value = jnp.concatenate([value[1:, :, 1], last_value_int[None]])
    never = jnp.zeros_like(int_reward)
    intrinsic = compute_gae(int_reward, value[..., 1], stream_next_value, never, never, gamma_int, gae_lambda)
    return extrinsic, intrinsic


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


def ppo_loss(config: Config, networks: Networks, params, minibatch: Batch, hp: HParams, key: jax.Array):
    """The policy objective (clipped surrogate or DPO), the clipped value losses of both heads (summed) and the
    entropy bonus of one minibatch. `key` is unused by PPO itself: it is there for a loss that samples (noise,
    dropout)."""
    logits = networks.actor.apply(params["actor"], minibatch.obs)
    log_probs = jax.nn.log_softmax(logits)
    log_prob = jnp.take_along_axis(log_probs, minibatch.action[:, None], -1)[:, 0]
    log_ratio = log_prob - minibatch.log_prob
    ratio = jnp.exp(log_ratio)
    advantage = minibatch.advantage
    advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-8)
    policy_loss = policy_objective(config, ratio, log_ratio, advantage, hp.clip_eps).mean()
    value = networks.critic.apply(params["critic"], minibatch.obs)
    chex.assert_equal_shape([value, minibatch.value, minibatch.target])
    value_clipped = minibatch.value + jnp.clip(value - minibatch.value, -hp.clip_eps, hp.clip_eps)
    value_losses = jnp.maximum(jnp.square(value - minibatch.target), jnp.square(value_clipped - minibatch.target))
    value_loss, value_loss_int = 0.5 * value_losses.mean(0)  # the extrinsic head's, the intrinsic head's
    entropy = -(jnp.exp(log_probs) * log_probs).sum(-1).mean()
    loss = policy_loss + hp.vf_coef * (value_loss + value_loss_int) - hp.ent_coef * entropy
    stats = dict(loss=loss, policy_loss=policy_loss, value_loss=value_loss, value_loss_int=value_loss_int)
    stats["entropy"] = entropy
    stats.update(approx_kl=((ratio - 1) - log_ratio).mean(), clip_fraction=(jnp.abs(ratio - 1) > hp.clip_eps).mean())
    return loss, stats


def rnd_loss(config: Config, networks: Networks, predictor_params, minibatch: Batch, hp: HParams, key: jax.Array):
    """The predictor's mean squared error at matching the target's embeddings (computed once per rollout: the target
    is fixed) over a random update_proportion of the minibatch, a mask drawn with `key` (as the paper: with many
    envs the predictor would otherwise learn too fast); 0 if the mask is empty."""
    error = jnp.square(networks.predictor.apply(predictor_params, minibatch.next_obs) - minibatch.next_embedding)
    mask = jax.random.bernoulli(key, hp.update_proportion, error.shape[:1])
    return jnp.where(mask, error.mean(-1), 0.0).sum() / jnp.maximum(mask.sum(), 1)


def make_optimizer(config: Config, hparams: HParams):
    num_grad_steps = config.num_updates * config.update_epochs * config.num_minibatches
    lr = (lambda count: hparams.lr * (1.0 - count / num_grad_steps)) if config.anneal_lr else hparams.lr
    return optax.chain(optax.clip_by_global_norm(hparams.max_grad_norm), optax.adam(learning_rate=lr, eps=1e-5))


def make_rnd_optimizer(hparams: HParams):
    """The predictor's own Adam, at a constant rnd_lr: novelty must keep being learned away to the end."""
    return optax.adam(learning_rate=hparams.rnd_lr, eps=1e-5)


def make_train(config: Config, env: "VecEnv | None" = None) -> Callable:
    """`train(rng, hparams=None) -> (runner, metrics of shape [num_updates])`: `train.init(rng, hparams)`, then
    `train.update(runner, update_index)` in a `lax.scan`, in `env` (default: VecEnv(env_name, num_envs))."""
    validate(config)
    env = VecEnv(config.env_name, config.num_envs) if env is None else env
    networks = make_networks(config, env.num_actions, env.obs_shape)
    T, N, M = config.num_steps, config.num_envs, config.num_minibatches

    @jax.custom_batching.sequential_vmap  # seeds in turn: vmapped, orthogonal init's QRs can deadlock XLA's CPU pool
    def init(rng: jax.Array, hparams: HParams | None = None) -> Runner:
        hparams = hparams_from(config) if hparams is None else hparams
        rng, actor_key, critic_key, target_key, predictor_key, env_key = jax.random.split(rng, 6)
        obs = jnp.zeros((1, *env.obs_shape), env.obs_dtype)
        params = {"actor": networks.actor.init(actor_key, obs), "critic": networks.critic.init(critic_key, obs)}
        predictor = networks.predictor.init(predictor_key, obs)
        return Runner(
            params=params, opt_state=make_optimizer(config, hparams).init(params),
            rnd_params={"target": networks.target.init(target_key, obs), "predictor": predictor},
            rnd_opt_state=make_rnd_optimizer(hparams).init(predictor), episodes=Episodes.start(*env.reset(env_key)),
            obs_norm=RunningStats.empty(env.obs_shape), int_return_norm=RunningStats.empty(),
            int_return=jnp.zeros(N), rng=rng, hparams=hparams,
        )  # fmt: skip

    def rollout(params, obs_norm: RunningStats, episodes: "Episodes", key: jax.Array):
        """T steps of every env under the current policy: (the episodes after them, [T, N] transitions)."""

        def env_step(episodes: Episodes, key: jax.Array):
            action_key, env_key = jax.random.split(key)
            obs = policy_obs(config, obs_norm, episodes.obs)
            action, log_prob = sample_action(networks.actor.apply(params["actor"], obs), action_key)
            step = env.step(env_key, episodes.env_state, action)
            done = step.terminated | step.truncated
            transition = Transition(episodes.obs, action, log_prob, step.reward, step.terminated, done, step.final_obs)
            return episodes.after(step), transition

        return jax.lax.scan(env_step, episodes.counting(), jax.random.split(key, T))

    def make_batch(params, obs_norm, transitions: Transition, last_obs, int_reward, rnd_input, hp: HParams) -> Batch:
        """The rollout with its values, two-stream GAE advantages and value targets, flattened to [T * N]. `last_obs`
        [N]: what every env continues from after the rollout; `rnd_input`: the normalised next observations and
        their target embeddings."""
        # V(final_obs) gives every step's extrinsic bootstrap value, the last step's included.
        observations = jnp.concatenate([transitions.obs, transitions.final_obs, last_obs[None]])
        observations = policy_obs(config, obs_norm, observations)
        values = networks.critic.apply(params["critic"], observations)
        value, next_value, last_value = values[:T], values[T : 2 * T, :, 0], values[2 * T]
        tr = transitions
        (advantage, target), (advantage_int, target_int) = compute_two_stream_gae(
            tr.reward, int_reward, value, next_value, last_value[:, 1], tr.terminated, tr.done, hp.gamma, hp.gamma_int,
            hp.gae_lambda,
        )  # fmt: skip
        advantage, target = hp.ext_coef * advantage + hp.int_coef * advantage_int, jnp.stack([target, target_int], -1)
        batch = Batch(observations[:T], tr.action, tr.log_prob, value, advantage, target, *rnd_input)
        return jax.tree.map(lambda x: x.reshape(T * N, *x.shape[2:]), batch)

    def learn(params, opt_state, predictor, rnd_opt_state, batch: Batch, key: jax.Array, hp: HParams):
        """`update_epochs` passes of shuffled minibatch steps over the batch, each a step of the actor and critic
        and one of RND's predictor (on its own Adam)."""
        optimizer, rnd_optimizer = make_optimizer(config, hp), make_rnd_optimizer(hp)

        def minibatch_step(train, inputs):
            (params, opt_state, predictor, rnd_opt_state), (minibatch, key) = train, inputs
            key, rnd_key = jax.random.split(key)
            grads, stats = jax.grad(ppo_loss, argnums=2, has_aux=True)(config, networks, params, minibatch, hp, key)
            updates, opt_state = optimizer.update(grads, opt_state)
            stats["rnd_loss"], rnd_grads = jax.value_and_grad(rnd_loss, argnums=2)(
                config, networks, predictor, minibatch, hp, rnd_key
            )
            rnd_updates, rnd_opt_state = rnd_optimizer.update(rnd_grads, rnd_opt_state)
            params, predictor = optax.apply_updates(params, updates), optax.apply_updates(predictor, rnd_updates)
            return (params, opt_state, predictor, rnd_opt_state), {**stats, "grad_norm": optax.tree.norm(grads)}

        def epoch(train, key):
            order_key, loss_key = jax.random.split(key)
            order = jax.random.permutation(order_key, T * N)
            minibatches = jax.tree.map(lambda x: x[order].reshape(M, T * N // M, *x.shape[1:]), batch)
            return jax.lax.scan(minibatch_step, train, (minibatches, jax.random.split(loss_key, M)))

        train = (params, opt_state, predictor, rnd_opt_state)
        return jax.lax.scan(epoch, train, jax.random.split(key, config.update_epochs))

    def update(runner: Runner, update_index: jax.Array):
        hp = runner.hparams
        rng, rollout_key, learn_key = jax.random.split(runner.rng, 3)
        # With normalize_obs, actor and critic see observations normalised by the statistics before this rollout.
        episodes, transitions = rollout(runner.params, runner.obs_norm, runner.episodes, rollout_key)
        # Intrinsic rewards, once per rollout: the observation statistics take in this rollout's next
        # observations first (so the first rollout's set them), then the rewards are scaled by the running
        # std of the forward filter's intrinsic return, which takes in all T * N of its values.
        obs_norm = update_stats(runner.obs_norm, transitions.final_obs.astype(jnp.float32))
        raw_int_reward, *rnd_input = intrinsic_reward(networks, runner.rnd_params, obs_norm, transitions.final_obs)
        int_reward, int_return, int_return_norm = scale_intrinsic_reward(
            raw_int_reward, runner.int_return, runner.int_return_norm, hp.gamma_int
        )
        batch = make_batch(runner.params, runner.obs_norm, transitions, episodes.obs, int_reward, rnd_input, hp)
        target, predictor = runner.rnd_params["target"], runner.rnd_params["predictor"]
        (params, opt_state, predictor, rnd_opt_state), stats = learn(
            runner.params, runner.opt_state, predictor, runner.rnd_opt_state, batch, learn_key, hp
        )
        finite = jnp.isfinite(stats["loss"]).all() & jnp.isfinite(stats["rnd_loss"]).all()
        finite &= jnp.isfinite(int_reward).all() & jnp.isfinite(optax.tree.norm((params, predictor)))
        metrics = {**episodes.metrics(), **{name: value.mean() for name, value in stats.items()}, "finite": finite}
        metrics.update(intrinsic_reward=int_reward.mean(), env_steps=(update_index + 1) * T * N)
        return Runner(
            params=params, opt_state=opt_state, rnd_params={"target": target, "predictor": predictor},
            rnd_opt_state=rnd_opt_state, episodes=episodes, obs_norm=obs_norm, int_return_norm=int_return_norm,
            int_return=int_return, rng=rng, hparams=hp,
        ), metrics  # fmt: skip

    def train(rng: jax.Array, hparams: HParams | None = None):
        return jax.lax.scan(update, init(rng, hparams), jnp.arange(config.num_updates, dtype=jnp.int32))

    train.init, train.update = init, update
    return train


# ---- The policy's action ----
def sample_action(logits: jax.Array, key: jax.Array):
    """An action drawn from softmax(logits), and its log-probability, for each row of logits."""
    action = jax.random.categorical(key, logits)
    return action, jnp.take_along_axis(jax.nn.log_softmax(logits), action[..., None], -1)[..., 0]


def make_act(config: Config, greedy: bool = True, env: "VecEnv | None" = None) -> Callable:
    """`act(params, obs, key) -> action` for one observation in the env's own shape (vmap it for a batch): the
    actor's most probable action, or (greedy=False) one drawn from its softmax as in training; observations
    normalised by the saved statistics (frozen) with normalize_obs."""
    env = env or VecEnv(config.env_name, 1)
    networks = make_networks(config, env.num_actions, env.obs_shape)

    def act(params, obs: jax.Array, key: jax.Array) -> jax.Array:
        obs = policy_obs(config, RunningStats(**params["obs_norm"]), obs)
        logits = networks.actor.apply(params["actor"], obs)
        return jnp.argmax(logits) if greedy else jax.random.categorical(key, logits)

    return act


def saved_params(runner: Runner) -> dict:
    """What params.msgpack holds and `make_evaluate` takes: the actor's and critic's parameters and the observation
    statistics (a dict, so that flax.serialization.msgpack_restore gives back the same tree)."""
    return {**runner.params, "obs_norm": runner.obs_norm._asdict()}


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
