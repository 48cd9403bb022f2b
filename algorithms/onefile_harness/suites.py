"""Environment suites beyond gymnax, registered with gymnax as SUITE/NAME when a run asks for one
(Atari, through envpool's threads rather than XLA, is atari.py's).

Each suite's raw environment (none of its own episode or auto-reset wrappers) becomes a gymnax
`Environment`: `step_env` reports only the suite's natural termination, the episode's time limit
is gymnax's `is_truncated` against `max_steps_in_episode` (never together with a termination), and
gymnax's auto-reset keeps the true final observation. An algorithm file takes it through
`gymnax.make` like any gymnax env, so its rollouts, targets and evaluation are unchanged.

A suite's reset (a Brax pipeline's first state, a Craftax world) can cost far more than a step, so
each env declares `envs_per_reset`, and a run's vectorised env (`vec_env`) pools resets: every env
holds a fresh episode in reserve and starts it when its episode ends, and each step redraws one
reserve per `envs_per_reset` envs (at least one), in turn. The algorithm files take it through
make_train's and make_evaluate's `env` argument; a gymnax env runs the file's own VecEnv.
"""

import contextlib
import importlib.util
import io
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .protocol import UsageError


class Suite(NamedTuple):
    module: str
    install: str  # the pip line of the version tested here
    actions: str  # "discrete" or "continuous"
    names: str  # where its environment names are listed


SUITES = {
    "brax": Suite("brax", "pip install brax==0.14.2", "continuous", "ant, halfcheetah, hopper, ... in brax.envs"),
    "craftax": Suite("craftax", "pip install craftax==1.6.1", "discrete", "Craftax-Classic-Symbolic-v1, ..."),
    "xminigrid": Suite("xminigrid", "pip install xminigrid==0.9.3", "discrete", "MiniGrid-DoorKey-5x5, ..."),
    "atari": Suite(
        "envpool", "pip install envpool==1.2.5", "discrete", "Pong-v5, Breakout-v5, ... (envpool's Atari task ids)"
    ),
    "pgx": Suite("pgx", "pip install pgx==2.6.0", "discrete", "connect_four, tic_tac_toe, othello, ... (pgx's ids)"),
}


def suite_help() -> str:
    return "; ".join(f"{prefix}/NAME ({suite.actions}: {suite.names})" for prefix, suite in SUITES.items())


def register(env_name: str) -> None:
    """Registers `SUITE/NAME` with gymnax (once), or raises a UsageError saying what is wrong: an
    unknown suite or name, or the pip line when the suite is not installed. Other names are left
    to gymnax."""
    import gymnax

    prefix, slash, name = env_name.partition("/")
    if not slash or env_name in gymnax.registered_envs:
        return
    if prefix not in SUITES:
        raise UsageError(f"--env-name {env_name}: unknown suite {prefix!r}; the suites are {suite_help()}")
    suite = SUITES[prefix]
    if importlib.util.find_spec(suite.module) is None:
        raise UsageError(f"--env-name {env_name} needs the {suite.module} package: {suite.install}")
    env = {"brax": brax_env, "craftax": craftax_env, "xminigrid": xminigrid_env, "atari": atari_env, "pgx": pgx_env}[
        prefix
    ]
    env = env(env_name, name)
    gymnax.register(env_name, lambda **kwargs: env)


def suite_env(
    name: str, start: Callable, transition: Callable, spaces: tuple, max_steps: int, envs_per_reset: int, legal=None
):
    """A gymnax Environment around a suite's raw env, given as `start(key) -> (obs, inner)` and
    `transition(key, inner, action) -> (obs, inner, reward, natural termination)`; `spaces` are the
    (action, observation) gymnax spaces and `max_steps` the time limit. A run's env redraws one
    fresh episode per `envs_per_reset` envs and step (1: gymnax's own auto-reset, one per env).
    `legal(inner)`, where given, is the legal actions' mask: the env's `legal_action_mask(state)`."""
    from flax import struct
    from gymnax.environments import environment

    @struct.dataclass
    class SuiteState:
        inner: Any  # the suite's own state
        time: jax.Array  # steps taken in this episode
        terminated: jax.Array  # the step that led here ended the episode naturally

    class SuiteEnv(environment.Environment):
        @property
        def default_params(self):
            return environment.EnvParams(max_steps_in_episode=max_steps)

        def step_env(self, key, state, action, params):
            obs, inner, reward, terminated = transition(key, state.inner, action)
            terminated = jnp.asarray(terminated, bool)
            state = SuiteState(inner=inner, time=state.time + 1, terminated=terminated)
            return obs, state, jnp.asarray(reward, jnp.float32), terminated, {}

        def reset_env(self, key, params):
            obs, inner = start(key)
            return obs, SuiteState(inner=inner, time=jnp.int32(0), terminated=jnp.bool_(False))

        def is_truncated(self, state, params):  # the time limit, never on a natural termination
            return (state.time >= params.max_steps_in_episode) & ~state.terminated

        @property
        def name(self) -> str:
            return name

        def action_space(self, params=None):
            return spaces[0]

        def observation_space(self, params=None):
            return spaces[1]

    if legal is not None:
        SuiteEnv.legal_action_mask = lambda self, state: legal(state.inner)
    env = SuiteEnv()
    env.envs_per_reset = envs_per_reset
    return env


def brax_env(env_name: str, name: str):
    """`brax/NAME` or `brax/NAME:BACKEND` (generalized, positional, spring or mjx; brax's default
    otherwise): actions in [-1, 1], episodes truncated at 1000 steps as in Brax's training."""
    from gymnax.environments import spaces

    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():  # MJX's and Brax's notices
        warnings.simplefilter("ignore")
        from brax import envs

        base, _, backend = name.partition(":")
        if base not in envs._envs:  # brax lists its envs in no public name
            raise UsageError(f"--env-name {env_name}: brax has no {base!r}; it has {', '.join(sorted(envs._envs))}")
        try:
            env = envs.get_environment(base, **({"backend": backend} if backend else {}))
        except Exception as error:
            raise UsageError(f"--env-name {env_name}: brax could not create it ({error})") from None

    def start(key):
        state = env.reset(key)
        return state.obs, state

    def transition(key, state, action):
        state = env.step(state, action)
        return state.obs, state, state.reward, state.done > 0.5

    action_space = spaces.Box(-1.0, 1.0, (env.action_size,), jnp.float32)
    observation_space = spaces.Box(-jnp.inf, jnp.inf, (env.observation_size,), jnp.float32)
    # A reset (the pipeline's initial state) costs a few steps: one fresh episode per 32 env steps.
    return suite_env(env_name, start, transition, (action_space, observation_space), 1000, envs_per_reset=32)


def craftax_env(env_name: str, name: str):
    """`craftax/NAME`: Craftax's env without auto-reset. Its own time limit is part of its game-over
    test (a termination, discount 0); here it is gymnax's truncation instead."""
    from craftax.craftax_env import make_craftax_env_from_name
    from gymnax.environments import spaces as gymnax_spaces

    try:
        env = make_craftax_env_from_name(name, auto_reset=False)
    except ValueError:
        raise UsageError(
            f"--env-name {env_name}: craftax has no {name!r}; it has Craftax-Symbolic-v1, Craftax-Pixels-v1, "
            "Craftax-Classic-Symbolic-v1 and Craftax-Classic-Pixels-v1"
        ) from None
    params = env.default_params
    unlimited = params.replace(max_timesteps=2**30)  # the limit is gymnax's truncation, not a game over

    def start(key):
        return env.reset_env(key, params)

    def transition(key, state, action):
        obs, state, reward, game_over, _ = env.step_env(key, state, action, unlimited)
        return obs, state, reward, game_over

    observation = env.observation_space(params)  # Craftax's own space classes: the same as gymnax spaces
    spaces = (
        gymnax_spaces.Discrete(env.num_actions),
        gymnax_spaces.Box(observation.low, observation.high, observation.shape, observation.dtype),
    )
    # Generating a world costs about a fifth of stepping 256 envs: one fresh world per 256 env steps
    # (Craftax's own optimistic reset idea).
    return suite_env(env_name, start, transition, spaces, int(params.max_timesteps), envs_per_reset=256)


def xminigrid_env(env_name: str, name: str):
    """`xminigrid/MiniGrid-*`: XLand-MiniGrid's env without auto-reset. Its last step has discount 0
    when the goal is reached (a termination) and 1 at its step limit (a truncation, here gymnax's)."""
    import xminigrid
    from gymnax.environments import spaces

    if name not in xminigrid.registered_environments() or name.startswith("XLand-"):
        minigrid = [n for n in xminigrid.registered_environments() if n.startswith("MiniGrid-")]
        raise UsageError(
            f"--env-name {env_name}: choose one of {', '.join(minigrid)} (XLand-* tasks need a ruleset from "
            "a downloaded benchmark, which this adapter does not load)"
        )
    env, params = xminigrid.make(name)

    def start(key):
        timestep = env.reset(params, key)
        return timestep.observation, timestep

    def transition(key, timestep, action):
        timestep = env.step(params, timestep, action)
        return timestep.observation, timestep, timestep.reward, timestep.discount == 0

    action_space = spaces.Discrete(env.num_actions(params))
    observation_space = spaces.Box(0, 255, env.observation_shape(params), jnp.uint8)
    # A reset (a new random layout) costs about two steps: one fresh episode per 32 env steps.
    return suite_env(
        env_name, start, transition, (action_space, observation_space), params.max_steps, envs_per_reset=32
    )


def pgx_env(env_name: str, name: str):
    """`pgx/NAME`: a pgx game. Its observation is the player to move's and the reward the mover's; in a two-player
    game (connect_four, othello, ...) the env's `two_player` is True: a planner's values are the player to move's,
    and each ply flips their sign (alphazero.py's self-play). `legal_action_mask(state)`: the legal moves."""
    import pgx
    from gymnax.environments import spaces

    if name not in pgx.available_envs():
        raise UsageError(f"--env-name {env_name}: pgx has no {name!r}; it has {', '.join(pgx.available_envs())}")
    game = pgx.make(name)

    def start(key):
        state = game.init(key)
        return state.observation, state

    def transition(key, state, action):
        mover = state.current_player
        state = game.step(state, action, key)
        return state.observation, state, state.rewards[mover], state.terminated

    obs = jax.eval_shape(game.init, jax.random.PRNGKey(0)).observation
    space = (spaces.Discrete(game.num_actions), spaces.Box(0, 1, obs.shape, obs.dtype))
    # pgx's own limits (go's, ...) are terminations with its rewards; this one only bounds an evaluation's loop.
    env = suite_env(env_name, start, transition, space, 10_000, envs_per_reset=1, legal=lambda s: s.legal_action_mask)
    env.two_player = game.num_players == 2
    return env


def atari_env(env_name: str, name: str):
    """envpool's games, stepped outside XLA: their own module (atari.py), imported only when asked for."""
    from .atari import atari_env

    return atari_env(env_name, name)


class Reserved(NamedTuple):
    """A pooled env's state: the envs' own states, and each env's fresh episode in reserve."""

    env: Any  # [num_envs] the envs' states
    obs: jax.Array  # [num_envs, *obs_shape] each env's reserve: the first observation it starts next
    state: Any  # [num_envs] and its env state
    redrawn: jax.Array  # reserves redrawn so far; the next redraw replaces reserve redrawn % num_envs


class PooledStep(NamedTuple):  # the fields of the algorithm files' EnvStep
    obs: jax.Array
    state: Any
    reward: jax.Array
    terminated: jax.Array
    truncated: jax.Array
    final_obs: jax.Array


class PooledResets:
    """An algorithm file's VecEnv whose envs start fresh episodes from reserves (module docstring):
    the same interface (reset, step, and the VecEnv's attributes), for envs whose reset is costly."""

    def __init__(self, vec, envs_per_reset: int):
        self.vec, self.num_resets = vec, min(vec.num_envs, -(-vec.num_envs // envs_per_reset))

    def __getattr__(self, name: str):
        return getattr(self.vec, name)

    def _fresh(self, key: jax.Array, count: int):
        reset = jax.vmap(self.vec.env.reset_env, in_axes=(0, None))
        return reset(jax.random.split(key, count), self.vec.params)

    def reset(self, key: jax.Array):
        now_key, ahead_key = jax.random.split(key)
        obs, state = self._fresh(now_key, self.vec.num_envs)
        ahead_obs, ahead_state = self._fresh(ahead_key, self.vec.num_envs)
        return obs, Reserved(env=state, obs=ahead_obs, state=ahead_state, redrawn=jnp.int32(0))

    def step(self, key: jax.Array, state: Reserved, action: jax.Array):
        env, vec = self.vec.env, self.vec
        step_key, reset_key = jax.random.split(key)
        action = action.reshape(vec.num_envs, *vec.action_shape)
        obs, stepped, reward, terminated, _ = jax.vmap(env.step_env, in_axes=(0, 0, 0, None))(
            jax.random.split(step_key, vec.num_envs), state.env, action, vec.params
        )
        truncated = jax.vmap(env.is_truncated, in_axes=(0, None))(stepped, vec.params)
        done, final_obs = terminated | truncated, obs
        select = jax.vmap(lambda d, new, old: jax.tree.map(lambda n, o: jax.lax.select(d, n, o), new, old))
        # Envs that ended start their reserves; this step's fresh episodes replace the next reserves in turn.
        slots = (state.redrawn + jnp.arange(self.num_resets)) % vec.num_envs
        fresh = self._fresh(reset_key, self.num_resets)
        reserve = jax.tree.map(lambda old, new: old.at[slots].set(new), (state.obs, state.state), fresh)
        next_state = Reserved(select(done, state.state, stepped), *reserve, redrawn=state.redrawn + self.num_resets)
        return PooledStep(
            obs=select(done, state.obs, final_obs),
            state=next_state,
            reward=reward.astype(jnp.float32),
            terminated=terminated,
            truncated=truncated,
            final_obs=final_obs,
        )


def vec_env(algo, env_name: str, num_envs: int):
    """The vectorised env a run trains or evaluates in: the file's own VecEnv, with pooled resets
    for a suite's env that declares `envs_per_reset` above 1."""
    vec = algo.VecEnv(env_name, num_envs)
    envs_per_reset = getattr(vec.env, "envs_per_reset", 1)
    return vec if envs_per_reset <= 1 else PooledResets(vec, envs_per_reset)


def make_evaluate(algo, config):
    """The file's greedy evaluation, in the env `vec_env` gives for `eval_episodes` envs."""
    return algo.make_evaluate(config, vec_env(algo, config.env_name, config.eval_episodes))
