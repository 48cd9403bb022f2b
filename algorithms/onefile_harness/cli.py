"""The command line: every Config field of the algorithm file as a flag, and the harness's options."""

import argparse
import dataclasses
import difflib
import typing
from collections.abc import Sequence

from .protocol import Algorithm, UsageError, flag
from .suites import suite_help


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        if message.startswith("unrecognized arguments: "):
            message = unrecognized(message.split(": ", 1)[1].split(), list(self._option_string_actions))
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def unrecognized(given: list, options: list) -> str:
    """An unknown option, and the closest one there is (--mtau: --m-tau), however its dashes fall."""
    option = next((word.split("=")[0] for word in given if word.startswith("-")), given[0])
    squash = lambda text: text.lstrip("-").replace("-", "").replace("_", "").lower()  # noqa: E731
    ours = {squash(name): name for name in options}
    close = difflib.get_close_matches(squash(option), ours, n=1)
    return f"{option}: no such option" + (f"; did you mean {ours[close[0]]}?" if close else "")


def integer(text: str) -> int:
    """An int flag that also takes 3e5 or 1_000_000."""
    value = float(text)
    if not value.is_integer():
        raise ValueError(text)
    return int(value)


integer.__name__ = "int"  # argparse names the type in its error message


BOOLEAN = argparse.BooleanOptionalAction
# The run harness's own options: (section of --help, flag, default, argparse settings with the help).
OPTIONS = (
    (
        "runs",
        "--sweep",
        [],
        dict(
            action="append",
            metavar="FIELD=V1,V2,...",
            help="train every value in one compiled program (repeat for a grid); FIELD is one of SWEEPABLE",
        ),
    ),
    ("runs", "--runs-dir", "runs", dict(help="results go to a new directory under this one")),
    (
        "runs",
        "--compile-cache",
        True,
        dict(
            action=BOOLEAN,
            help="JAX persistent compilation cache (JAX_COMPILATION_CACHE_DIR, else ~/.cache/jax_rl_compile)",
        ),
    ),
    (
        "checkpoints and resume",
        "--checkpoint",
        True,
        dict(
            action=BOOLEAN,
            help="write the whole training state into RUN_DIR/checkpoint.msgpack when training ends (and on Ctrl-C)",
        ),
    ),
    (
        "checkpoints and resume",
        "--checkpoint-every",
        0,
        dict(
            type=integer,
            metavar="CHUNKS",
            help="also write it every CHUNKS chunks of ~10%% of training, or of --pbt-interval (0: only at the end)",
        ),
    ),
    (
        "checkpoints and resume",
        "--checkpoint-buffer",
        True,
        dict(
            action=BOOLEAN,
            help="keep the replay buffer (if any) in checkpoints; a run resumed without one restarts it empty",
        ),
    ),
    (
        "checkpoints and resume",
        "--resume",
        None,
        dict(
            metavar="RUN_DIR", help="continue the run in RUN_DIR from its checkpoint; only --total-timesteps may change"
        ),
    ),
    (
        "evaluation",
        "--eval-only",
        None,
        dict(
            metavar="RUN_DIR",
            help="evaluate the parameters RUN_DIR saved (--eval-episodes may change); write RUN_DIR/evaluation.json",
        ),
    ),
    (
        "evaluation",
        "--render",
        False,
        dict(
            action="store_true", help="with --eval-only: also draw one greedy episode per run, RUN_DIR/episodes/*.gif"
        ),
    ),
    (
        "output",
        "--track",
        None,
        dict(
            choices=("tensorboard", "wandb"),
            help="stream every update's metrics of every run to TensorBoard (RUN_DIR/tensorboard) or to Weights & "
            "Biases (WANDB_MODE=offline works without a network)",
        ),
    ),
    ("output", "--wandb-project", None, dict(help="the W&B project of --track wandb (default: the algorithm's name)")),
    ("output", "--quiet", False, dict(action="store_true", help="print only the results directory")),
    (
        "population-based training (docs/pbt.md)",
        "--pbt",
        False,
        dict(
            action="store_true",
            help="the runs (seeds x sweep points) are one population: every --pbt-interval updates the weakest copy "
            "the fittest, in the compiled program, and perturb their hyperparameters",
        ),
    ),
    (
        "population-based training (docs/pbt.md)",
        "--pbt-interval",
        0,
        dict(type=integer, metavar="UPDATES", help="updates between exploit/explore steps (0: a twentieth of the run)"),
    ),
    (
        "population-based training (docs/pbt.md)",
        "--pbt-fraction",
        0.25,
        dict(type=float, help="the weakest share of members that copy one of the same share of the fittest"),
    ),
    (
        "population-based training (docs/pbt.md)",
        "--pbt-fields",
        None,
        dict(metavar="FIELD,...", help="the HParams fields explore changes, of SWEEPABLE (default: learning rates)"),
    ),
    (
        "population-based training (docs/pbt.md)",
        "--pbt-bounds",
        [],
        dict(
            action="append",
            metavar="FIELD=LOW,HIGH",
            help="the range a perturbed field stays in (default for a learning rate: a tenth of its lowest start "
            "value to ten times its highest; other fields need one with multiply)",
        ),
    ),
    (
        "population-based training (docs/pbt.md)",
        "--pbt-perturb",
        "multiply",
        dict(
            choices=("multiply", "resample"),
            help="explore: multiply by 0.8 or 1.2, or draw one of the field's start values (its --sweep values)",
        ),
    ),
    (
        "population-based training (docs/pbt.md)",
        "--pbt-fitness",
        "return",
        dict(
            choices=("return", "greedy"),
            help="return: the mean return of the episodes a member finished in the interval; greedy: a greedy "
            "evaluation of --eval-episodes episodes",
        ),
    ),
)


def build_parser(algo: Algorithm, doc: str, defaults: bool = True) -> Parser:
    """Every Config field as a flag, and the harness's own options; with `defaults=False`, the
    options not given on the command line are left out (to tell which were given)."""
    default = (lambda value: value) if defaults else (lambda value: argparse.SUPPRESS)
    parser = Parser(
        prog=f"{algo.name}.py",
        description=doc.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=f"--env-name takes any id in gymnax.registered_envs, or {suite_help()}; a suite is installed by its "
        "pip line (all of them: pip install -r requirements-envs.txt).",
        allow_abbrev=False,
    )
    for field in dataclasses.fields(algo.Config):
        field_type, doc, *rules = typing.get_args(field.type) or (field.type, "")  # Annotated[type, doc, rule, ...]
        if field_type not in (bool, int, float, str):
            raise UsageError(f"Config.{field.name}: a flag takes bool, int, float or str, not {field_type}")
        if field_type is bool:
            kind = dict(action=BOOLEAN)
        else:
            kind = dict(type=integer if field_type is int else field_type, metavar=field_type.__name__.upper())
        kind["help"] = "; ".join([doc, *rules])
        parser.add_argument("--" + flag(field.name), default=default(field.default), **kind)
    groups = {}
    for section, name, value, settings in OPTIONS:
        group = groups.setdefault(section, parser.add_argument_group(section))
        settings = {**settings, "help": settings["help"].replace("SWEEPABLE", ", ".join(map(flag, algo.sweepable)))}
        group.add_argument(name, default=default(value), **settings)
    return parser


def parse_args(algo: Algorithm, doc: str, argv: Sequence[str] | None):
    """(Config, the harness's options, the names of the options given)."""
    args = build_parser(algo, doc).parse_args(argv)
    given = set(vars(build_parser(algo, doc, defaults=False).parse_args(argv)))
    config = algo.Config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(algo.Config)})
    return config, args, given
