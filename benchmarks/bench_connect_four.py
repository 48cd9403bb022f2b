"""alphazero.py's self-play on pgx's connect_four, against two opponents: a uniformly random legal player, and a plain
MCTS with the same number of simulations (mctx's muzero_policy with uniform priors, each new leaf valued by one random
game played out from it, no noise, its most visited move). Games as the first and as the second player are counted
apart; the trained policy acts as make_act's greedy act does (a search with the trained networks).

    python benchmarks/bench_connect_four.py                      # trains FLAGS' run (2 seeds), then plays each seed
    python benchmarks/bench_connect_four.py --run-dir runs/alphazero-pgx-connect_four-<time>   # plays a trained run

Writes connect_four_<backend>.jsonl (appended) and .md (the newest measurement) into benchmarks/results.
"""

import argparse
import json
import os
import tempfile
import time

import numpy as np

from common import ROOT, describe, load_algorithm, machine, run_cli, suites, write_markdown, xla

ENV = "pgx/connect_four"
# The run measured: self-play at gamma 1 with Monte-Carlo value targets (lambda 1), 64 games at a time, the board
# through --network cnn.
FLAGS = ["--env-name", ENV, "--gamma", "1", "--gae-lambda", "1", "--num-envs", "64", "--network", "cnn", "--lr", "1e-3"]
FLAGS += ["--total-timesteps", "1572864"]


def random_player(jax, state, key):
    """A uniformly random legal move of each game's pgx state."""
    return jax.random.categorical(key, jax.numpy.where(state.legal_action_mask, 0.0, -jax.numpy.inf))


def make_mcts_player(jax, game, num_simulations: int):
    """Plain MCTS over pgx's own step: uniform priors over legal moves, a random play-out's result as each new leaf's
    value (for the player to move there), the sign flipped at each ply; it plays its most visited move."""
    import mctx

    jnp = jax.numpy

    def playout(state, key):  # one game's result for the player to move in `state`, played out at random
        player = state.current_player

        def move(carry):
            state, key = carry
            key, move_key, step_key = jax.random.split(key, 3)
            return game.step(state, random_player(jax, state, move_key), step_key), key

        end, _ = jax.lax.while_loop(lambda carry: ~carry[0].terminated, move, (state, key))
        return end.rewards[player]

    def evaluate(state, key):
        priors = jnp.where(state.legal_action_mask, 0.0, -1e9)
        return priors, jax.vmap(playout)(state, jax.random.split(key, priors.shape[0]))

    def model(_, key, action, state):
        mover = state.current_player
        step_key, value_key = jax.random.split(key)
        state = jax.vmap(game.step)(state, action, jax.random.split(step_key, action.shape[0]))
        reward = jnp.take_along_axis(state.rewards, mover[:, None], 1)[:, 0]
        priors, value = evaluate(state, value_key)
        discount = jnp.where(state.terminated, 0.0, -1.0)
        return mctx.RecurrentFnOutput(reward=reward, discount=discount, prior_logits=priors, value=value), state

    def player(state, key):
        root_key, search_key = jax.random.split(key)
        priors, value = evaluate(state, root_key)
        root = mctx.RootFnOutput(prior_logits=priors, value=value, embedding=state)
        out = mctx.muzero_policy(
            None, search_key, root, model, num_simulations, invalid_actions=~state.legal_action_mask,
            dirichlet_fraction=0.0, temperature=0.0,
        )  # fmt: skip
        return jnp.argmax(out.action_weights, -1)

    return player


def play(jax, env, agent, opponent, key, games: int) -> np.ndarray:
    """`games` games of the suite env (pgx's state inside), the agent first in the first half and second in the
    other: the agent's result in each (+1 won, 0 drawn, -1 lost)."""
    jnp = jax.numpy
    reset_key, key = jax.random.split(key)
    obs, state = jax.vmap(env.reset_env, (0, None))(jax.random.split(reset_key, games), env.default_params)
    first = state.inner.current_player
    seat = jnp.where(jnp.arange(games) < games // 2, first, 1 - first)

    @jax.jit
    def ply(obs, state, result, key):
        agent_key, opponent_key, step_key = jax.random.split(key, 3)
        mine = agent(obs, state, agent_key)
        theirs = opponent(state.inner, opponent_key)
        action = jnp.where(state.inner.current_player == seat, mine, theirs)
        step = jax.vmap(env.step_env, (0, 0, 0, None))
        obs, after, _, terminated, _ = step(jax.random.split(step_key, games), state, action, env.default_params)
        ended = terminated & ~state.inner.terminated
        result = jnp.where(ended, jnp.take_along_axis(after.inner.rewards, seat[:, None], 1)[:, 0], result)
        return obs, after, result

    result = jnp.zeros(games)
    while not bool(state.inner.terminated.all()):
        key, ply_key = jax.random.split(key)
        obs, state, result = ply(obs, state, result, ply_key)
    return np.asarray(result)


def score(result: np.ndarray) -> dict:
    half = len(result) // 2
    rate = lambda r: dict(won=float((r > 0).mean()), drawn=float((r == 0).mean()), lost=float((r < 0).mean()))  # noqa: E731
    return dict(first=rate(result[:half]), second=rate(result[half:]), all=rate(result))


def measure(run_dir: str, games: int, num_simulations: int | None) -> list:
    import jax
    import pgx

    az = load_algorithm("alphazero")
    suites.register(ENV)
    vec = az.VecEnv(ENV, 1)
    env, game = vec.env, pgx.make("connect_four")
    with np.load(os.path.join(run_dir, "metrics.npz")) as metrics:
        seeds = metrics["episode_return"].shape[1]
    rows = []
    for seed in range(seeds):
        config, params = az.load_run(run_dir, seed=seed)
        sims = num_simulations or config.num_simulations
        act = jax.vmap(az.make_act(config, env=vec, num_simulations=sims), (None, 0, 0))
        agent = lambda obs, state, key: act(params, (obs, state), jax.random.split(key, games))  # noqa: E731
        row = dict(seed=seed, num_simulations=sims, games=games)
        opponents = {"random": lambda state, key: random_player(jax, state, key)}
        opponents["mcts"] = make_mcts_player(jax, game, sims)
        for name, opponent in opponents.items():
            start = time.perf_counter()
            row[name] = score(play(jax, env, agent, opponent, jax.random.PRNGKey(1000 + seed), games))
            row[name]["seconds"] = time.perf_counter() - start
            print(f"seed {seed} against {name}: {row[name]}", flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", help="a trained run of alphazero.py on pgx/connect_four (default: train one)")
    parser.add_argument("--games", type=int, default=256, help="games per opponent and seed (half as first player)")
    parser.add_argument("--num-simulations", type=int, help="simulations per move, each side (default: the run's)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = parser.parse_args()
    xla.configure()
    trained = None
    if args.run_dir is None:
        runs = tempfile.mkdtemp(prefix="connect_four-")
        trained = run_cli("alphazero", [*FLAGS, "--num-seeds", "2"], runs, os.path.join(runs, "cache"), timeout=3600)
        args.run_dir = trained["run_dir"]
    rows = measure(args.run_dir, args.games, args.num_simulations)
    import jax

    record = dict(machine=machine(), run_dir=args.run_dir, flags=FLAGS if trained else None, rows=rows)
    if trained:
        record["train_seconds"] = trained["summary"]["train_seconds"]
        record["compile_seconds"] = trained["summary"]["compile_seconds"]
    backend = jax.default_backend()
    with open(os.path.join(args.out, f"connect_four_{backend}.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
    lines = ["# alphazero.py on pgx's connect_four", "", describe(record["machine"]) + ".", ""]
    if trained:
        lines += [
            f"Trained: `python algorithms/alphazero.py {' '.join(FLAGS)} --num-seeds 2` (compile "
            f"{record['compile_seconds']:.0f} s, train {record['train_seconds']:.0f} s).",
            "",
        ]
    lines += [
        "| seed | simulations | opponent | won as first | won as second | drawn | lost | games |",
        "|---" * 8 + "|",
    ]
    for row in rows:
        for name in ("random", "mcts"):
            r = row[name]
            lines.append(
                f"| {row['seed']} | {row['num_simulations']} | {name} | {r['first']['won']:.1%} | "
                f"{r['second']['won']:.1%} | {r['all']['drawn']:.1%} | {r['all']['lost']:.1%} | {row['games']} |"
            )
    write_markdown(os.path.join(args.out, f"connect_four_{backend}.md"), lines)


if __name__ == "__main__":
    main()
