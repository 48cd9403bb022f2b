"""`atari/NAME`: envpool's Atari games (NAME an envpool task id, e.g. Pong-v5) as a gymnax Environment.

envpool steps its games in C++ threads and cannot be traced or vmapped, so the env's `reset` and
`step` are `jax.pure_callback`s (vmap_method="broadcast_all"): however many vmaps wrap them (a run's
envs, its seeds, its sweep points), one call receives every env's action at once and steps envpool
once. Each env's gymnax state names the pool that holds it (a random id, so pools of another
process, and evaluation's pools, never pass for a run's training pool), its slot there, its `tick`
(the steps and resets that slot has made; distinct at every call, so XLA can neither merge two calls
nor reuse one) and its envpool seed.

Seeds: `reset(key)` draws each env's envpool seed from that env's own key, and envpool seeds every
env of a pool by its own seed (`env_seed`), so an env's episodes depend on its key and actions only:
the same key twice gives the same episodes, and a run's seed alone gives the episodes it gets in a
batch of seeds or sweep points. Pools: one reset call makes one pool for all the envs it is given.
Where a step is handed envs of several pools (the harness initialises runs one after another on CPU:
one pool per run), of an unknown pool (a run resumed in a new process: pools cannot be saved) or of
a pool of another size, it moves them all into one new pool: an env that has shown only its first
observation (tick 0) is rebuilt from its seed and goes on seamlessly; any other env starts a new game,
and that step reports a truncation (reward 0, its final observation the new game's first). An env
whose state its pool has moved past (a step XLA computed and then discarded, e.g. the batched
while_loop of evaluation stepping runs that have finished) or that shares its slot with another (PBT
copying a member's envs) is given a new game the same way. A pool not stepped since the last two
pools were made is closed.

Auto-reset as gymnax's: envpool resets a finished env when it is next given an action, returning
reward 0 and the next episode's first frame. The same callback hides that step: it sends the
finished envs one more action at once, so `step` returns the next episode's first observation with
the finished step's reward and flags, the true last observation in `info["final_observation"]`.
That auto-reset is envpool's own: after a lost life (episodic life) the game goes on, after a game
over or the time limit a new game begins. An explicit envpool reset always begins a new game.

Preprocessing (CleanRL's and purejaxql's envpool configs): 84x84 grey frames, 4 frames skipped
(max-pooled over the last two), 4 stacked, up to 30 no-ops and FIRE at a new game, no sticky
actions, the minimal action set, 27,000 steps (108,000 frames) a game. Episodic life: a lost life
is a termination for learning, an episode of the metrics and of greedy evaluation. Rewards are
clipped to their sign; the game's own score is in `info["raw_reward"]` (and a game's end in
`info["game_over"]`) for a file that wants to report it. Observations are uint8 [84, 84, 4].
"""

import secrets
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct  # this module is imported by suites.register only, after XLA's flags are set
from gymnax.environments import environment, spaces

from .protocol import UsageError

# envpool's Atari options as CleanRL's ppo_atari_envpool.py and purejaxql's pqn_atari.yaml use them,
# written out so that envpool's defaults changing changes nothing here.
OPTIONS = dict(
    episodic_life=True,  # a lost life ends a learning episode (the game goes on)
    reward_clip=True,  # rewards -1, 0 or 1
    img_height=84,
    img_width=84,
    gray_scale=True,
    stack_num=4,
    frame_skip=4,
    noop_max=30,
    use_fire_reset=True,
    repeat_action_probability=0.0,
    full_action_space=False,
    max_episode_steps=27_000,  # agent steps: 108,000 frames
)
FRAMES = (4, 84, 84)  # envpool's observation: channels first
SEEDS = 2**31 - 1  # envpool seeds are C ints


def atari_env(env_name: str, name: str, **options):
    """`atari/NAME`'s gymnax Environment; `options` override OPTIONS (tests: a short time limit)."""
    try:
        import envpool
        from envpool.registration import registry
    except Exception as error:  # e.g. envpool without its ROMs (envpool-assets)
        raise UsageError(f"--env-name {env_name}: envpool cannot be imported ({error})") from None
    games = sorted(task for task, (module, *_) in registry.specs.items() if module == "envpool.atari")
    if name not in games:
        raise UsageError(f"--env-name {env_name}: envpool has no Atari game {name!r}; it has {', '.join(games)}")
    options = {**OPTIONS, **options}
    spec = envpool.make_spec(name, **options)
    return AtariEnv(name, Pools(name, options), spec.action_space.n, options["max_episode_steps"])


@struct.dataclass
class AtariState:
    pool: jax.Array  # int32: the pool that holds this env
    slot: jax.Array  # int32: its env id in that pool
    tick: jax.Array  # int32: the steps and resets of that slot; 0: only its first observation yet
    seed: jax.Array  # int32: its envpool seed


FRAMES_SHAPE = jax.ShapeDtypeStruct(FRAMES, jnp.uint8)
INT, FLOAT, BOOL = (jax.ShapeDtypeStruct((), dtype) for dtype in (jnp.int32, jnp.float32, jnp.bool_))


def channels_last(obs: jax.Array) -> jax.Array:  # envpool's [C, H, W] as the files' convolutions read: [H, W, C]
    return jnp.transpose(obs, (1, 2, 0))


class AtariEnv(environment.Environment):
    """The gymnax Environment whose reset and step are `pools`' callbacks (module docstring)."""

    def __init__(self, name: str, pools: "Pools", num_actions: int, max_steps: int):
        self._name, self.pools, self._num_actions, self.max_steps = name, pools, num_actions, max_steps

    @property
    def default_params(self):
        return environment.EnvParams(max_steps_in_episode=self.max_steps)

    def reset_env(self, key, params):
        # This env's envpool seed, from its own key (module docstring). Two resets with the same seeds,
        # if XLA merged them, would share a pool: the next step finds more envs than it holds and
        # rebuilds them from these seeds, unchanged (tick 0).
        seed = jax.random.randint(key, (), 0, SEEDS, jnp.int32)
        shapes = (FRAMES_SHAPE, INT, INT, INT)
        obs, pool, slot, tick = jax.pure_callback(self.pools.reset, shapes, seed, vmap_method="broadcast_all")
        return channels_last(obs), AtariState(pool, slot, tick, seed)

    def step(self, key, state, action, params=None):
        """gymnax's step with its auto-reset, all in one callback; `key` is unused (envpool has its own).
        A pure callback may be merged with an identical call, dropped when its outputs are unused, or
        run again; none of it can feed the learner a wrong transition here. Every call's inputs differ
        (each env's tick moves on at every call), so no two calls merge; a dropped call leaves the
        pool and the states as they were; a call run again, or one whose outputs are discarded,
        leaves envs whose tick the pool has moved past, and those start a new game as a truncation."""
        outputs = (FRAMES_SHAPE, FRAMES_SHAPE, FLOAT, BOOL, BOOL, FLOAT, BOOL, INT, INT, INT, INT)
        where = (state.pool, state.slot, state.tick, state.seed)
        action = jnp.asarray(action, jnp.int32)
        out = jax.pure_callback(self.pools.step, outputs, *where, action, vmap_method="broadcast_all")
        obs, final, reward, terminated, truncated, raw_reward, game_over, *where = out
        info = dict(final_observation=channels_last(final), terminated=terminated, truncated=truncated)
        info.update(raw_reward=raw_reward, game_over=game_over)
        return channels_last(obs), AtariState(*where), reward, terminated, truncated, info

    @property
    def name(self) -> str:
        return self._name

    @property
    def num_actions(self) -> int:
        return self._num_actions

    def action_space(self, params=None):
        return spaces.Discrete(self._num_actions)

    def observation_space(self, params=None):
        return spaces.Box(0, 255, (84, 84, 4), jnp.uint8)


class Pool:
    """One envpool pool of len(seeds) envs, reset, and each env's tick (module docstring)."""

    def __init__(self, task: str, options: dict, seeds: np.ndarray, made: int):
        import envpool

        seed = [int(s) for s in seeds]  # a list: envpool seeds env i by seed[i] (its env_seed)
        self.env = envpool.make(task, env_type="gymnasium", num_envs=len(seed), seed=seed, **options)
        self.first = self.env.reset()[0]  # [envs, *FRAMES] in env id order
        self.ticks = np.zeros(len(seed), np.int64)
        self.size, self.used = len(seed), made  # used: the count of pools made when it was last used

    def close(self) -> None:
        self.env.close()


class Outcome:
    """What one step callback returns per env, filled in by env id (flat: one row per env)."""

    def __init__(self, n: int):
        self.obs, self.final = np.zeros((n, *FRAMES), np.uint8), np.zeros((n, *FRAMES), np.uint8)
        self.reward, self.raw_reward = np.zeros(n, np.float32), np.zeros(n, np.float32)
        self.terminated, self.truncated, self.game_over = (np.zeros(n, bool) for _ in range(3))


class Pools:
    """The envpool pools of one `atari/NAME` env in this process, and the host side of its callbacks."""

    def __init__(self, task: str, options: dict):
        self.task, self.options = task, options
        self.pools: dict[int, Pool] = {}
        self.made = 0  # pools made so far
        self.lock = threading.Lock()  # XLA may run callbacks on several threads

    def make(self, seeds: np.ndarray) -> tuple[int, Pool]:
        """A new pool for these seeds under a new id; closes those not used since the last two were made."""
        self.made += 1
        for old in [i for i, pool in self.pools.items() if pool.used < self.made - 1]:
            self.pools.pop(old).close()
        pool_id = 0
        while pool_id == 0 or pool_id in self.pools:  # random: an id saved by another process is unknown here
            pool_id = secrets.randbelow(SEEDS) + 1
        self.pools[pool_id] = Pool(self.task, self.options, seeds, self.made)
        return pool_id, self.pools[pool_id]

    def reset(self, seed: np.ndarray):
        """Callback: one new pool for every env of the batch (seeds [*batch]) -> obs, pool, slot, tick."""
        batch = np.shape(seed)
        with self.lock:
            pool_id, pool = self.make(np.asarray(seed).reshape(-1))
        slots = np.arange(pool.size, dtype=np.int32).reshape(batch)
        obs = pool.first.reshape(*batch, *FRAMES)
        return obs, np.full(batch, pool_id, np.int32), slots, np.zeros(batch, np.int32)

    def step(self, pool_id, slot, tick, seed, action):
        """Callback: every env's step ([*batch] each) -> obs, final obs, reward, terminated, truncated,
        raw reward, game over, and the env's next pool, slot, tick and seed."""
        batch = np.shape(action)
        pool_id, slot, tick, seed, action = (np.asarray(x).reshape(-1) for x in (pool_id, slot, tick, seed, action))
        with self.lock:
            pool_id, pool, slot, valid, seed = self.place(pool_id, slot, tick, seed)
            out = advance(pool, slot, valid, action)
            pool.ticks[slot] += 1  # every env was stepped or reset: its tick moves on
            pool.used, tick = self.made, pool.ticks[slot].astype(np.int32)
        shaped = lambda x: np.reshape(x, (*batch, *np.shape(x)[1:]))  # noqa: E731
        where = (np.full(len(slot), pool_id, np.int32), slot.astype(np.int32), tick, seed.astype(np.int32))
        fields = (out.obs, out.final, out.reward, out.terminated, out.truncated, out.raw_reward, out.game_over)
        return tuple(map(shaped, (*fields, *where)))

    def place(self, pool_id, slot, tick, seed):
        """The pool stepping these envs (flat), their slots there, which of them go on (the others
        start a new game) and their seeds: their own pool if it holds exactly them, else a new one."""
        pool = self.pools.get(int(pool_id[0]))
        if pool is None or (pool_id != pool_id[0]).any() or pool.size != len(slot):
            return self.rebuild(pool_id, tick, seed)
        slot, own = own_slots(slot, pool.size)
        return int(pool_id[0]), pool, slot, own & (tick == pool.ticks[slot]), seed

    def rebuild(self, pool_id, tick, seed):
        """All these envs in one new pool: those at tick 0 from their seeds (their first observation
        again), the others from seeds drawn from seed and tick (they start a new game)."""
        fresh = tick == 0
        seed = np.where(fresh, seed, (seed.astype(np.int64) * 1_000_003 + tick) % SEEDS)
        ids, counts = np.unique(pool_id, return_counts=True)
        for old, count in zip(ids.tolist(), counts.tolist(), strict=True):
            if old in self.pools and self.pools[old].size == count:  # all its envs move: it is done
                self.pools.pop(old).close()
        new_id, pool = self.make(seed)
        return new_id, pool, np.arange(len(seed)), fresh, seed


def own_slots(slot: np.ndarray, size: int):
    """(slots, own): each slot's first claimant keeps it; the others (PBT's copies, or slots out of
    range) get the slots no one claims, one each (as many as there are envs), and are not own."""
    own = np.zeros(len(slot), bool)
    own[np.unique(slot, return_index=True)[1]] = True
    own &= (slot >= 0) & (slot < size)
    slot = slot.copy()
    slot[~own] = np.setdiff1d(np.arange(size), slot[own])
    return slot, own


def advance(pool: Pool, slot: np.ndarray, valid: np.ndarray, action: np.ndarray) -> Outcome:
    """One step of the envs in `slot` (flat): the valid ones take their action and, where that ends
    an episode, envpool's auto-reset at once; the others start a new game (a truncation)."""
    out, row = Outcome(len(slot)), np.empty(pool.size, np.int64)
    row[slot] = np.arange(len(slot))  # env id -> its row in the batch
    if valid.any():
        pool.env.send(action[valid], slot[valid])
        obs, reward, terminated, truncated, info = pool.env.recv()
        at = row[info["env_id"]]
        out.obs[at], out.reward[at], out.raw_reward[at] = obs, reward, info["reward"]
        out.terminated[at], out.truncated[at], out.game_over[at] = terminated, truncated, info["terminated"] != 0
    out.final[:] = out.obs
    done = slot[out.terminated | out.truncated]
    if len(done):  # envpool resets a finished env when next given an action (ignored); episodic life goes on
        pool.env.send(np.zeros(len(done), np.int32), done)
        obs, *_, info = pool.env.recv()
        out.obs[row[info["env_id"]]] = obs
    if not valid.all():  # an explicit reset: a new game
        obs, info = pool.env.reset(slot[~valid])
        at = row[info["env_id"]]
        out.obs[at], out.final[at], out.truncated[at] = obs, obs, True
    return out
