"""The win rate of a multi-agent file's SMAX runs: each seed's policy plays `--episodes` greedy episodes against
the heuristic enemy; a battle is won when an episode's last reward holds SMAX's won-battle bonus (1 per agent).

    python benchmarks/smax_wins.py runs/ippo-SMAX-3m-... [--episodes 64]
"""

import argparse
import importlib.util
import json
import pathlib
import sys


def load_file(run_dir: pathlib.Path):
    name = json.loads((run_dir / "summary.json").read_text())["algorithm"]
    path = pathlib.Path(__file__).resolve().parents[1] / "algorithms" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def win_rate(module, config, params, env, key) -> float:
    """The share of `env.num_envs` greedy episodes (each env's first) whose last reward holds the won-battle bonus."""
    import jax
    import jax.numpy as jnp

    act, episodes = module.make_act(config, greedy=True, env=env), env.num_envs
    memory = getattr(act, "memory", None)  # a recurrent policy's (ippo_rnn.py's), carried as make_evaluate does
    batched = jax.vmap(act if memory is not None else lambda p, o, k, m: (act(p, o, k), m), (None, 0, 0, 0))

    def play(key):
        def step(carry, key):
            obs, state, memory, won, over = carry
            action, memory = batched(params, obs, jax.random.split(key, episodes), memory)
            got = env.step(jax.random.fold_in(key, 1), state, action)
            ended = (got.terminated | got.truncated) & ~over
            return (got.obs, got.state, memory, won | (ended & (got.reward >= 1.0)), over | ended), None

        obs, state = env.reset(key)
        first = jax.tree.map(lambda m: jnp.broadcast_to(m, (episodes, *jnp.shape(m))), memory)
        start = (obs, state, first, jnp.zeros(episodes, bool), jnp.zeros(episodes, bool))
        (*_, won, over), _ = jax.lax.scan(step, start, jax.random.split(key, env.max_episode_steps))
        return won.mean(), over.all()

    rate, finished = jax.jit(play)(key)
    assert bool(finished), "an episode outlasted the time limit"
    return float(rate)


def win_rates(run_dir: pathlib.Path, episodes: int) -> list[float]:
    module = load_file(run_dir)
    module.configure_xla()
    import jax

    summary, rates, env = json.loads((run_dir / "summary.json").read_text()), [], None
    for seed in range(summary["num_seeds"]):
        config, params = module.load_run(str(run_dir), seed)
        env = env or module.VecEnv(config.env_name, episodes)
        rates.append(win_rate(module, config, params, env, jax.random.PRNGKey(seed)))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=pathlib.Path)
    parser.add_argument("--episodes", type=int, default=64)
    args = parser.parse_args()
    rates = win_rates(args.run_dir, args.episodes)
    mean = sum(rates) / len(rates)
    print(
        json.dumps(
            {
                "run_dir": str(args.run_dir),
                "episodes_per_seed": args.episodes,
                "win_rate_per_seed": rates,
                "win_rate_mean": mean,
            }
        )
    )


if __name__ == "__main__":
    main()
