"""The ``posttrain`` command line: ``demo | sft | rft | train | dpo | rm | plan | eval | astar-values | compare |
report | rank-prompts | algorithms | export | serve``.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from posttrain.compare.args import add_compare_parser
from posttrain.errors import ConfigError, RankError

if TYPE_CHECKING:
    from posttrain.config import Config
    from posttrain.run.checkpoint import Resume

# Everything heavier (torch, transformers, the registries) is imported by the command that needs it, so
# that `posttrain --help` and a bad command line answer at once.


def _input_errors() -> tuple[type[Exception], ...]:
    """The errors that mean bad input (a message and exit status 2, no traceback), imported when one is raised."""
    from posttrain.algorithms.registry import UnknownNameError
    from posttrain.data.readers import DataError
    from posttrain.models.load import ModelLoadError
    from posttrain.reporting.report import RunDirError
    from posttrain.run.checkpoint import CheckpointError

    return ConfigError, ModelLoadError, CheckpointError, UnknownNameError, RunDirError, DataError, RankError


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="run directory (default: the recipe's `out`)")
    p.add_argument("--max-steps", type=int, help="number of training steps")
    p.add_argument("--seed", type=int, help="random seed")
    p.add_argument(
        "--resume", action="store_true",
        help="continue the run in --out from its newest checkpoint that verifies against its manifest",
    )
    p.add_argument(
        "--resume-from", type=_step, metavar="STEP",
        help="continue the run in --out from the checkpoint of this step (it must verify; implies --resume)",
    )


def _recipe_cmd(sub: argparse._SubParsersAction, name: str, help_: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_)
    p.add_argument("recipe", nargs="?", help="TOML recipe (default: built-in defaults)")
    p.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. algorithm.loss=cispo rollout.group_size=16"
    )
    _common(p)
    return p


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(prog="posttrain", description="RL post-training of language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser(
        "demo", help="tiny model + SFT + GRPO on a built-in task, with an equal-time SFT control"
    )
    d.add_argument("--quick", action="store_true", help="a smaller, faster version (used by the tests)")
    d.add_argument(
        "--real",
        action="store_true",
        help="GRPO on SmolLM2-135M-Instruct (pip install 'posttrain[real]'): baseline and final held-out pass@1",
    )
    d.add_argument(
        "--agent",
        action="store_true",
        help="a multi-turn game (guess_number): SFT on noisy expert transcripts, then GRPO vs trloo vs gigpo",
    )
    d.add_argument(
        "--reward",
        choices=["task", "math"],
        default="task",
        help="RL reward: the task's verifier (default), or boxed answers checked by math-verify",
    )
    _common(d)
    _recipe_cmd(sub, "train", "RL training from a recipe")
    _recipe_cmd(sub, "sft", "supervised fine-tuning on a task's demonstrations")
    _recipe_cmd(sub, "rft", "rejection-sampling fine-tuning / expert iteration (ReST-EM, RAFT, STaR)")
    _recipe_cmd(sub, "dpo", "preference optimization (DPO family) on task-built or file pairs")
    _recipe_cmd(sub, "rm", "reward-model training (Bradley-Terry, optional ODIN debiasing) on task-built or file pairs")
    plan = _recipe_cmd(sub, "plan", "the memory an RL run of a recipe needs on its device (from the model's config)")
    plan.add_argument("--json", action="store_true", help="print the parts and total_gib as one JSON object")
    e = sub.add_parser("eval", help="pass@k, maj@k and calibration of a model on a task's held-out prompts")
    e.add_argument("recipe", nargs="?", help="TOML recipe naming the task (default: built-in defaults)")
    e.add_argument("overrides", nargs="*", help="dotted overrides, e.g. eval.n=16 'eval.k=[1,4,16]'")
    e.add_argument("--model", help="model directory, checkpoint, run directory or hub id (default: model.path)")
    e.add_argument("--json", help="where to write the results (default: <out>/eval.json)")
    e.add_argument("--out", help="output directory (default: the recipe's `out`)")
    e.add_argument("--seed", type=int, help="random seed (which prompts, which samples)")
    v = sub.add_parser(
        "astar-values",
        help="A*-PO's offline stage: sample M reference responses per training prompt, write rewards and V* "
        "(for algorithm.reference_values)",
    )
    v.add_argument("recipe", nargs="?", help="TOML recipe (e.g. recipes/a_star_po.toml)")
    v.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algorithm.advantage_params.samples=4")
    v.add_argument("--out", dest="file", help="the JSONL to write (default: algorithm.reference_values, else "
                   "<recipe>.values.jsonl next to the recipe)")
    v.add_argument("--limit", type=_positive, help="only the first N training prompts the run meets")
    v.add_argument("--seed", type=int, help="random seed (the run's: which prompts, which samples)")
    add_compare_parser(sub)
    r = sub.add_parser("report", help="one self-contained HTML page of one or more run directories")
    r.add_argument("runs", nargs="+", help="run directories (several are overlaid)")
    r.add_argument("--html", default="report.html", help="the file to write (default: report.html)")
    r.add_argument("--title", help="page title")
    k = sub.add_parser(
        "rank-prompts",
        help="rank a run's training prompts by the variance of their pass rate (1-shot RLVR's selection)",
    )
    k.add_argument("run", help="a run directory (its prompt_stats.jsonl) or a prompt_stats.jsonl file")
    k.add_argument("--top", type=int, default=None, help="keep the first N (default: all)")
    k.add_argument("--min-appearances", type=int, default=2, help="steps a prompt must appear in (default 2)")
    k.add_argument("--out", help="JSONL to write, one ranked prompt per line (for task.dataset.train_prompts)")
    rp = sub.add_parser("replay", help="re-run one step's prepare and update from its checkpoint and recorded batch "
                        "(log.record_batches); prints the step's metrics as one JSON line")
    rp.add_argument("run", help="a run directory trained with log.record_batches = true")
    rp.add_argument("--step", type=int, required=True, help="the step to replay (as metrics.jsonl counts, from 1)")
    rp.add_argument("--rows", help="batch rows for the per-token table, e.g. 0,3")
    rp.add_argument("--tokens", action="store_true", help="print per-token advantage, ratio, clip, loss, entropy")
    a = sub.add_parser("algorithms", help="list registry entries, or print one entry's documentation")
    a.add_argument("name", nargs="?", help="an entry name (e.g. grpo, ppo_clip)")
    a.add_argument("--plugin", action="append", default=[], metavar="FILE_OR_MODULE",
                   help="also import this plugin (a .py file or a module; repeatable) and list its entries")
    a.add_argument("--recipe", help="also import the plugins this recipe names")
    from posttrain.run.export import add_export_parser  # light: torch and gguf load with the command
    from posttrain.serve.command import add_serve_parser  # light: the model and the server load with the command

    add_export_parser(sub)
    add_serve_parser(sub)
    return parser


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _step(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be a step >= 0, got {n}")
    return n


def _resume(args: argparse.Namespace) -> Resume:
    """What the trainers take as ``resume``: ``True``/``False``, or ``ResumeFrom(step)`` for ``--resume-from``."""
    if getattr(args, "resume_from", None) is None:
        return bool(getattr(args, "resume", False))
    from posttrain.run.checkpoint import ResumeFrom

    return ResumeFrom(args.resume_from)


def _recipe(args: argparse.Namespace) -> str | None:
    """The recipe argument, unless it is really the first override (``train a.b=1``)."""
    recipe = args.recipe
    return None if recipe and "=" in recipe and not recipe.endswith(".toml") else recipe


def _recipe_to_load(args: argparse.Namespace) -> str | None:
    """The recipe a command loads: its argument, or with ``--resume`` and no recipe the run's saved config."""
    recipe = _recipe(args)
    if _resume(args) and recipe is None and getattr(args, "out", None):
        from pathlib import Path

        saved = Path(args.out) / "config.toml"
        if saved.exists():
            recipe = str(saved)
    return recipe


def _import_recipe_plugins(args: argparse.Namespace) -> None:
    """Import the plugins the command's recipe names before the command imports its trainer and the config
    (seconds): a broken plugin is reported at once. ``load_config`` imports them anyway (a no-op by then).
    """
    if args.command not in ("train", "sft", "rft", "dpo", "rm", "eval", "plan", "astar-values"):
        return
    recipe = _recipe_to_load(args)
    if recipe is not None:
        from posttrain.plugins import import_plugins, recipe_plugins

        import_plugins(recipe_plugins(recipe))


def _load(args: argparse.Namespace, steps_key: str) -> Config:
    from posttrain.config import load_config

    overrides = list(args.overrides)
    recipe = _recipe_to_load(args)
    if args.recipe and _recipe(args) is None:
        overrides.insert(0, args.recipe)
    if getattr(args, "out", None):
        overrides.append(f'out="{args.out}"')
    if args.seed is not None:
        overrides.append(f"seed={args.seed}")
    if getattr(args, "max_steps", None) is not None:
        overrides.append(f"{steps_key}={args.max_steps}")
    return load_config(recipe, overrides)


def _demo(args: argparse.Namespace, parser: argparse.ArgumentParser, console: Console) -> None:
    """``posttrain demo``: the tiny model's, ``--real`` (SmolLM2-135M-Instruct) or ``--agent`` (multi-turn)."""
    if args.real and args.agent:
        parser.error("demo: --real and --agent are separate demos; pick one")
    if args.agent:
        from posttrain.demos.agent import run_agent_demo

        out = args.out or ("runs/demo-agent-quick" if args.quick else "runs/demo-agent")
        run_agent_demo(out=out, seed=args.seed or 0, quick=args.quick, max_steps=args.max_steps, console=console)
    elif args.real:
        from posttrain.demos.real import run_real_demo

        out = args.out or ("runs/demo-real-quick" if args.quick else "runs/demo-real")
        run_real_demo(out=out, seed=args.seed or 0, quick=args.quick, max_steps=args.max_steps, console=console)
    else:
        from posttrain.demos.arithmetic import run_demo

        out = args.out or ("runs/demo-quick" if args.quick else "runs/demo")
        run_demo(
            out=out,
            seed=args.seed or 0,
            quick=args.quick,
            max_steps=args.max_steps,
            console=console,
            reward=args.reward,
        )


def _algorithms(args: argparse.Namespace, console: Console) -> None:
    """``posttrain algorithms``: every registry's entries (or one entry's docstring), with those of the plugins
    that ``--plugin`` and ``--recipe`` name, marked as theirs.
    """
    from pathlib import Path

    from posttrain.docgen.catalog import print_algorithms
    from posttrain.plugins import import_plugins, recipe_plugins

    if args.recipe and not Path(args.recipe).is_file():
        raise ConfigError(f"recipe {args.recipe!r} does not exist")
    import_plugins([*(recipe_plugins(args.recipe) if args.recipe else []), *args.plugin])
    print_algorithms(console, args.name)


def _replay(args: argparse.Namespace, console: Console) -> int:
    """``posttrain replay`` (its body: ``trainers/replay.py``)."""
    from posttrain.trainers.replay import cli_replay

    return cli_replay(args, console)


def _module_command(args: argparse.Namespace, console: Console) -> int:
    """A command whose body lives in its own module: ``export`` (``run/export.py``), ``serve``
    (``serve/command.py``).
    """
    if args.command == "serve":
        from posttrain.serve.command import cli_serve

        return cli_serve(args, console)
    from posttrain.run.export import cli_export

    return cli_export(args, console)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``posttrain`` console script."""
    parser = build_parser()
    # overrides may follow options (`train r.toml --out x a.b=1`): collect the leftovers
    args, extra = parser.parse_known_args(argv)
    takes_overrides = ("train", "sft", "rft", "dpo", "rm", "eval", "compare", "plan", "astar-values")
    if extra and (args.command not in takes_overrides or any(e.startswith("-") for e in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    console = Console()
    try:
        _import_recipe_plugins(args)
        if args.command == "demo":
            _demo(args, parser, console)
        elif args.command == "train":
            from posttrain.train.rl import train

            train(_load(args, "train.steps"), resume=_resume(args), console=console)
        elif args.command == "sft":
            from posttrain.trainers.sft import sft

            sft(_load(args, "sft.steps"), resume=_resume(args), console=console)
        elif args.command == "rft":
            from posttrain.trainers.rft import rft

            rft(_load(args, "rft.rounds"), resume=_resume(args), console=console)
        elif args.command == "dpo":
            from posttrain.trainers.dpo import dpo_train

            dpo_train(_load(args, "dpo.steps"), resume=_resume(args), console=console)
        elif args.command == "rm":
            from posttrain.trainers.rm import rm_train

            rm_train(_load(args, "rm.steps"), resume=_resume(args), console=console)
        elif args.command == "plan":
            from posttrain.planning.plan import run_plan

            run_plan(_load(args, "train.steps"), console, as_json=args.json)
        elif args.command == "eval":
            from posttrain.evaluation.run import run_eval

            run_eval(_load(args, "train.steps"), model=args.model, out=args.json, console=console)
        elif args.command == "astar-values":
            from posttrain.trainers.astar_values import run_astar_values

            run_astar_values(_load(args, "train.steps"), out=args.file, limit=args.limit, recipe=_recipe(args),
                             console=console)
        elif args.command == "compare":
            from posttrain.compare.run import cli_compare

            return cli_compare(args, console)
        elif args.command == "report":
            from pathlib import Path

            from posttrain.reporting.report import write_report

            path = write_report([Path(p) for p in args.runs], Path(args.html), title=args.title)
            console.print(f"wrote {path}")
        elif args.command == "rank-prompts":
            from posttrain.train.prompt_stats import cli_rank_prompts

            return cli_rank_prompts(args, console)
        elif args.command == "algorithms":
            _algorithms(args, console)
        elif args.command == "replay":
            return _replay(args, console)
        elif args.command in ("export", "serve"):
            return _module_command(args, console)
    except Exception as e:
        if not isinstance(e, ConfigError) and not isinstance(e, _input_errors()):  # (those import seconds' worth)
            raise
        console.print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True, highlight=False)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
