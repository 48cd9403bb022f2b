"""--eval-only and --render: a finished run's saved parameters evaluated again, and one greedy
episode per run drawn as an animated GIF."""

import contextlib
import importlib.util
import io
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import suites
from .plan import RunPlan
from .protocol import UsageError
from .rundir import write_json
from .stats import point_label


def evaluate_saved(job, plan: RunPlan, say) -> int:
    """--eval-only: the saved parameters of every run, evaluated with the keys training's own
    evaluation used (so the same --eval-episodes give the same returns); --render draws them."""
    params = jax.tree.map(lambda x: np.reshape(x, (plan.num_runs, *np.shape(x)[2:])), job.params)
    evaluate = jax.jit(jax.vmap(suites.make_evaluate(job.algo, job.config)), out_shardings=plan.sharding)
    returns = plan.to_host(evaluate(plan.to_devices(params), jax.device_put(plan.eval_keys, plan.sharding)))
    if job.run_dir is None:
        return 0
    points = [
        {
            "sweep_point": point,
            "eval_return_mean": float(np.mean(returns[index])),
            "eval_return_per_seed": [float(x) for x in returns[index]],
        }
        for index, point in enumerate(plan.points)
    ]
    write_json(
        os.path.join(job.run_dir, "evaluation.json"), {"eval_episodes": job.config.eval_episodes, "points": points}
    )
    for point in points:
        say(
            f"{point_label(point['sweep_point']) or 'eval'}: greedy return {point['eval_return_mean']:.1f} over "
            f"{plan.num_seeds} seeds x {job.config.eval_episodes} episodes"
        )
    if job.args.render:
        render_episodes(job, plan, job.params, say)
    print(f"results: {job.run_dir}", flush=True)
    return 0


class Replaying(NamedTuple):
    """What the recorded episode carries from one env step to the next."""

    env_state: Any
    obs: jax.Array
    memory: Any  # a recurrent policy's memory ([1, ...]; None for the others)
    alive: jax.Array  # [1] bool: the episode has not ended yet
    rng: jax.Array


def make_episode_recorder(algo, config):
    """Returns `record(params, rng) -> (env states, rewards, alive)`, each [max_episode_steps]:
    one greedy episode (the first of the file's evaluation with the same key), the state each step
    starts from, its reward, and whether the episode was still running."""
    env = suites.vec_env(algo, config.env_name, 1)
    act = algo.make_act(config, env=env)
    start = getattr(act, "memory", None)  # as the file's make_evaluate: None for a policy without memory
    batched = jax.vmap(act if start is not None else lambda p, o, k, m: (act(p, o, k), m), (None, 0, 0, 0))
    seen = (lambda c: (c.obs, c.env_state)) if getattr(act, "reads_state", False) else (lambda c: c.obs)  # a planner's

    def env_step(params, carry: Replaying, _):
        rng, act_key, env_key = jax.random.split(carry.rng, 3)
        action, memory = batched(params, seen(carry), jax.random.split(act_key, 1), carry.memory)
        step = env.step(env_key, carry.env_state, action)
        alive = carry.alive & ~(step.terminated | step.truncated)
        return Replaying(step.state, step.obs, memory, alive, rng), (carry.env_state, step.reward, carry.alive)

    def record(params, rng: jax.Array):
        reset_key, rng = jax.random.split(rng)
        obs, env_state = env.reset(reset_key)
        memory = jax.tree.map(lambda m: jnp.asarray(m)[None], start)
        step = lambda carry, x: env_step(params, carry, x)  # noqa: E731
        first = Replaying(env_state, obs, memory, jnp.ones(1, bool), rng)
        _, (states, rewards, alive) = jax.lax.scan(step, first, None, env.max_episode_steps)
        return jax.tree.map(lambda x: x[:, 0], (states, rewards, alive))

    return record


# What gymnax's Visualizer can draw (classic control through gymnasium's pygame renderer).
DRAWABLE = {
    "MinAtar": ("Asterix-MinAtar", "Breakout-MinAtar", "Freeway-MinAtar", "Seaquest-MinAtar", "SpaceInvaders-MinAtar"),
    "pygame": ("Acrobot-v1", "CartPole-v1", "Pendulum-v1", "MountainCar-v0", "MountainCarContinuous-v0"),
    "other": ("Catch-bsuite", "Pong-misc", "PointRobot-misc", "MetaMaze-misc", "FourRooms-misc"),
}


def drawable_env(algo, env_name: str):
    """(env, params) that gymnax can draw for `env_name` (a wrapper's inner env if need be), or a
    UsageError saying why not; for a multi-agent file, (env, None) of a JaxMARL env its own
    MPEVisualizer draws (MPE's)."""
    vec_env = algo.VecEnv(env_name, 1)
    env, env_params = vec_env.env, vec_env.params
    if hasattr(vec_env, "num_agents"):  # JaxMARL's, imported by the file's VecEnv
        from jaxmarl.environments.mpe.simple import SimpleMPE

        if not isinstance(env, SimpleMPE):
            raise UsageError(f"--render: JaxMARL's visualiser is used for its MPE envs (MPE_...), not {env_name}")
        return env, None
    drawable = sum(DRAWABLE.values(), ())
    while env.name not in drawable and hasattr(env, "env"):
        env = env.env  # e.g. an observation wrapper: the states are its inner env's
    if env.name not in drawable:
        raise UsageError(f"--render: gymnax cannot draw {env_name}; it draws {', '.join(drawable)}")
    if env.name in DRAWABLE["pygame"] and importlib.util.find_spec("pygame") is None:
        raise UsageError(f"--render: gymnax draws {env.name} with pygame: pip install pygame")
    return env, env_params


def render_episodes(job, plan: RunPlan, params, say) -> None:
    """One greedy episode per run as an animated GIF, one frame per step, in RUN_DIR/episodes."""
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # pygame draws off screen
    os.environ.setdefault("SDL_AUDIODRIVER", "dummy")
    import matplotlib

    matplotlib.use("Agg")
    from gymnax.visualize import Visualizer

    env, env_params = drawable_env(job.algo, job.config.env_name)
    draw = lambda frames, rewards, path: Visualizer(env, env_params, frames, rewards).animate(path)  # noqa: E731
    if env_params is None:  # a JaxMARL MPE env
        draw = lambda frames, rewards, path: draw_mpe(env, frames, path)  # noqa: E731
    record = jax.jit(make_episode_recorder(job.algo, job.config))
    folder = os.path.join(job.run_dir, "episodes")
    os.makedirs(folder, exist_ok=True)
    for point_index, point in enumerate(plan.points):
        for seed in range(plan.num_seeds):
            run = point_index * plan.num_seeds + seed
            states, rewards, alive = jax.device_get(
                record(jax.tree.map(lambda x: x[point_index, seed], params), plan.eval_keys[run])
            )
            length = int(alive.sum())
            frames = [jax.tree.map(lambda x: x[t], states) for t in range(length)]
            name = "-".join(filter(None, [point_label(point).replace(", ", "-"), f"seed{seed}"])) + ".gif"
            draw(frames, np.cumsum(rewards[:length]), os.path.join(folder, name))
            say(f"{name}: {length} steps, return {float(rewards[:length].sum()):.1f}")


def draw_mpe(env, frames: list, path: str) -> None:
    """One MPE episode's states as an animated GIF, by JaxMARL's MPEVisualizer (which prints; quietened)."""
    import matplotlib
    import matplotlib.pyplot as plt
    from jaxmarl.environments.mpe import MPEVisualizer

    with contextlib.redirect_stdout(io.StringIO()), matplotlib.rc_context({"animation.writer": "pillow"}):
        MPEVisualizer(env, frames).animate(path, view=False)
    plt.close("all")
