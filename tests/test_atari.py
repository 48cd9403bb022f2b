"""Atari through envpool (--env-name atari/NAME, onefile_harness/atari.py): the env's reset and step
under nested vmap (seeds x envs) are one envpool pool stepped once per call; each step equals
envpool's own with its auto-reset step taken out (the next episode's first frame in the same step,
the true last one as the final observation); an env's episodes depend on its own key only; envs of
several pools, of an unknown pool (a resumed run), copied (PBT) or stepped from a state the pool has
moved past are handled; ppo.py and dqn.py train on it from the command line.

Tests that need envpool are skipped without it (requirements-envs.txt); the refusal of a missing
envpool, which fakes its absence, runs everywhere.
"""

import importlib.util
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT, load_algorithm, run_main
from onefile_harness import suites

needs_envpool = pytest.mark.skipif(
    importlib.util.find_spec("envpool") is None, reason="envpool is not installed (requirements-envs.txt)"
)
SEEDS, ENVS = 2, 3  # the nested vmap: seeds x envs


def atari_env(game="Pong-v5", **options):
    from onefile_harness import atari

    return atari.atari_env(f"atari/{game}", game, **options)


def rollout(env, keys, actions):
    """Reset with `keys` ([seeds, 2]) under vmap(vmap(reset)) over ENVS envs each, then step the
    `actions` ([steps, seeds, envs]) under nested vmap: (first obs, first state, steps, last state)."""
    params = env.default_params
    step = jax.vmap(jax.vmap(env.step, (None, 0, 0, None)), (None, 0, 0, None))

    def run(keys, actions):
        split = jax.vmap(lambda key: jax.random.split(key, actions.shape[-1]))(keys)
        obs, state = jax.vmap(jax.vmap(env.reset, (0, None)), (0, None))(split, params)

        def one(state, action):
            obs, state, reward, terminated, truncated, info = step(jax.random.PRNGKey(0), state, action, params)
            return state, (obs, info["final_observation"], reward, terminated, truncated, state)

        last, steps = jax.lax.scan(one, state, actions)
        return obs, state, steps, last

    return jax.device_get(jax.jit(run)(keys, actions))


def cycling_actions(steps, seeds, envs, num_actions):
    t, s, e = np.meshgrid(np.arange(steps), np.arange(seeds), np.arange(envs), indexing="ij")
    return jnp.asarray((t + 2 * s + e) % num_actions, jnp.int32)


@pytest.fixture(scope="module")
def pong():
    return atari_env()


@pytest.fixture(scope="module")
def batch_run(pong):
    """[2 seeds, 3 envs] of Pong for 12 steps from keys 0 and 1."""
    keys = jax.random.split(jax.random.PRNGKey(0), SEEDS)
    return keys, rollout(pong, keys, cycling_actions(12, SEEDS, ENVS, 6))


@needs_envpool
def test_nested_vmap_steps_one_pool(pong, batch_run):
    _, (obs, first, steps, last) = batch_run
    next_obs, final, reward, terminated, truncated, states = steps
    assert obs.shape == (SEEDS, ENVS, 84, 84, 4) and obs.dtype == np.uint8
    assert next_obs.shape == final.shape == (12, SEEDS, ENVS, 84, 84, 4) and next_obs.dtype == np.uint8
    assert reward.dtype == np.float32 and terminated.dtype == truncated.dtype == np.bool_
    assert (obs[..., 0] == obs[..., 3]).all()  # a first frame: the stack holds it four times
    assert len(np.unique(last.pool)) == 1 and last.pool.flat[0] in pong.pools.pools  # one pool for all
    assert sorted(last.slot.flat) == list(range(SEEDS * ENVS))
    np.testing.assert_array_equal(last.tick, 12)  # each env stepped once per step
    assert len({first.seed[s, e] for s in range(SEEDS) for e in range(ENVS)}) == SEEDS * ENVS


def reference(game, options, seed, actions):
    """envpool's own pool of one env seeded `seed`, driven by `actions` with its auto-reset step made
    by hand after every episode end: per step (last obs, reward, terminated, truncated, next obs)."""
    import envpool

    from onefile_harness import atari

    pool = envpool.make(game, env_type="gymnasium", num_envs=1, seed=[int(seed)], **{**atari.OPTIONS, **options})
    first, steps = pool.reset()[0][0], []
    for action in actions:
        obs, reward, terminated, truncated, _ = pool.step(np.array([action], np.int32))
        after = pool.step(np.array([0], np.int32))[0] if terminated[0] or truncated[0] else obs
        steps.append((obs[0], reward[0], terminated[0], truncated[0], after[0]))
    return first, steps


@needs_envpool
def test_an_episode_end_starts_the_next_in_the_same_step():
    """Breakout firing: a lost life at step 24 ends an episode (the game goes on), the time limit at
    step 30 another (a new game); each step is envpool's with its auto-reset step taken out."""
    options = dict(max_episode_steps=30)
    env = atari_env("Breakout-v5", **options)
    actions = jnp.ones((40, 1, 1), jnp.int32)  # FIRE
    obs, first, steps, _ = rollout(env, jax.random.PRNGKey(3)[None], actions)
    next_obs, final, reward, terminated, truncated = (x[:, 0, 0] for x in steps[:5])
    own_first, own = reference("Breakout-v5", options, first.seed[0, 0], np.ones(40, int))
    channels_last = lambda frames: np.transpose(frames, (1, 2, 0))  # noqa: E731
    np.testing.assert_array_equal(obs[0, 0], channels_last(own_first))
    for t, (last, own_reward, own_terminated, own_truncated, after) in enumerate(own):
        np.testing.assert_array_equal(final[t], channels_last(last), err_msg=f"final obs, step {t + 1}")
        np.testing.assert_array_equal(next_obs[t], channels_last(after), err_msg=f"obs, step {t + 1}")
        assert (reward[t], terminated[t], truncated[t]) == (own_reward, own_terminated, own_truncated), t + 1
    assert terminated.nonzero()[0].tolist() == [23] and truncated.nonzero()[0].tolist() == [29]
    for t in (23, 29):
        assert not np.array_equal(next_obs[t], final[t])
    assert (next_obs[29][..., 0] == next_obs[29][..., 3]).all()  # a new game's first frame
    assert not (next_obs[23][..., 0] == next_obs[23][..., 3]).all()  # the same game goes on


@needs_envpool
def test_an_env_depends_on_its_own_key_only(pong, batch_run):
    """The same keys twice give the same episodes; a seed alone gives those it gets in the batch."""
    keys, (obs, _, steps, _) = batch_run
    again = rollout(pong, keys, cycling_actions(12, SEEDS, ENVS, 6))
    np.testing.assert_array_equal(again[0], obs)
    np.testing.assert_array_equal(again[2][0], steps[0])
    alone = rollout(pong, keys[1:], cycling_actions(12, SEEDS, ENVS, 6)[:, 1:])
    np.testing.assert_array_equal(alone[0][0], obs[1])
    np.testing.assert_array_equal(alone[2][0][:, 0], steps[0][:, 1])
    np.testing.assert_array_equal(alone[2][1][:, 0], steps[1][:, 1])


def step_from(env, state, action):
    """One step of every env in `state` ([seeds, envs]), jitted."""
    step = jax.vmap(jax.vmap(env.step, (None, 0, 0, None)), (None, 0, 0, None))
    run = jax.jit(lambda state, action: step(jax.random.PRNGKey(0), state, action, env.default_params))
    obs, state, reward, terminated, truncated, info = jax.device_get(run(state, action))
    return obs, state, reward, truncated, info["final_observation"]


@needs_envpool
def test_envs_of_several_pools_go_on_in_one(pong, batch_run):
    """Each seed reset on its own (as the harness initialises runs on CPU) and then stepped together:
    one pool, and the episodes of the batch's single reset."""
    keys, (_, _, steps, _) = batch_run
    states = [rollout(pong, keys[s : s + 1], jnp.zeros((0, 1, ENVS), jnp.int32))[1] for s in range(SEEDS)]
    state = jax.tree.map(lambda *x: np.concatenate(x), *states)
    assert len(np.unique(state.pool)) == SEEDS
    obs, state, _, truncated, _ = step_from(pong, state, cycling_actions(1, SEEDS, ENVS, 6)[0])
    np.testing.assert_array_equal(obs, steps[0][0])
    assert not truncated.any() and len(np.unique(state.pool)) == 1


@needs_envpool
def test_lost_envs_start_a_new_game_as_a_truncation(pong, batch_run):
    """An unknown pool (a resumed run), an env copied onto another (PBT) and a state the pool has moved
    past: those envs start a new game, reported as a truncation with reward 0; the others go on."""
    _, (_, _, steps, last) = batch_run
    action = jnp.zeros((SEEDS, ENVS), jnp.int32)
    unknown = last.replace(pool=np.full_like(last.pool, 7))
    obs, state, reward, truncated, final = step_from(pong, unknown, action)
    assert truncated.all() and (reward == 0).all() and (obs[..., 0] == obs[..., 3]).all()
    np.testing.assert_array_equal(final, obs)
    assert len(np.unique(state.pool)) == 1 and state.pool.flat[0] in pong.pools.pools
    _, state, _, truncated, _ = step_from(pong, state, action)
    assert not truncated.any()  # then they go on

    copied = jax.tree.map(lambda x: np.stack([x[0], x[0]]), state)  # seed 1 holds seed 0's envs
    obs, moved, _, truncated, _ = step_from(pong, copied, action)
    assert not truncated[0].any() and truncated[1].all()
    assert sorted(moved.slot.flat) == list(range(SEEDS * ENVS))
    stale = step_from(pong, copied, action)  # a step from a state the pool has moved past
    assert stale[3].all()


@needs_envpool
@pytest.mark.slow  # about 15 s each (a pool per run, the Nature CNN on CPU): CI runs them, the fast loop does not
@pytest.mark.parametrize(
    ("name", "flags"),
    [
        ("dqn", ("--buffer-size", "256", "--learning-starts", "64", "--batch-size", "32", "--train-frequency", "16")),
        ("ppo", ("--update-epochs", "1")),
    ],
)
def test_the_command_line_trains_on_atari(name, flags, tmp_path):
    """`python algorithms/NAME.py --env-name atari/Breakout-v5 --network nature_cnn`, two seeds, a tiny
    budget. Breakout rather than Pong: an untrained agent loses its first life, which ends an episode
    (episodic life), within ~25 steps, so the greedy evaluation takes seconds (a game of Pong: ~900 steps)."""
    command = [sys.executable, str(ROOT / "algorithms" / f"{name}.py"), "--env-name", "atari/Breakout-v5"]
    command += ["--network", "nature_cnn", "--num-seeds", "2", "--num-envs", "4", "--num-steps", "16"]
    command += ["--total-timesteps", "128", *flags, "--eval-episodes", "2", "--runs-dir", str(tmp_path)]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (run_dir,) = tmp_path.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["env_name"] == "atari/Breakout-v5" and summary["num_seeds"] == 2
    assert np.isfinite(summary["eval_return_mean"]) and summary["eval_return_mean"] >= 0


@needs_envpool
def test_an_unknown_game_exits_2(capsys, tmp_path):
    argv = ["--env-name", "atari/NotAGame-v5", "--runs-dir", tmp_path]
    code, out, err = run_main(load_algorithm("ppo"), argv, capsys)
    assert code == 2 and out == "" and err.count("\n") == 1 and not list(tmp_path.iterdir())
    assert "envpool has no Atari game 'NotAGame-v5'; it has Adventure-v5, " in err and "Pong-v5" in err


def test_a_missing_envpool_exits_2_with_the_pip_line(monkeypatch, capsys, tmp_path):
    import gymnax

    find_spec = suites.importlib.util.find_spec
    monkeypatch.setattr(
        suites.importlib.util, "find_spec", lambda name, *a: None if name == "envpool" else find_spec(name, *a)
    )
    # As in a process where no atari/ env was registered yet (another test of this worker may have registered one).
    monkeypatch.setattr(gymnax, "registered_envs", [n for n in gymnax.registered_envs if not n.startswith("atari/")])
    small = ["--total-timesteps", "256", "--num-envs", "2", "--num-steps", "32", "--num-seeds", "1"]  # if not refused
    argv = ["--env-name", "atari/Pong-v5", *small, "--runs-dir", tmp_path]
    code, out, err = run_main(load_algorithm("ppo"), argv, capsys)
    assert code == 2 and out == "" and not list(tmp_path.iterdir())
    assert err.strip().endswith("needs the envpool package: pip install envpool==1.2.5") and err.count("\n") == 1
