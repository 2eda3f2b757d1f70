"""The `pacerl` command. Each subcommand parses its own arguments and calls into the library."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from pacerl.agents.evaluation.config import EvalConfig
from pacerl.config_keys import check_keys
from pacerl.lab.calibrate_cli import add_calibrate_parser
from pacerl.lab.simulate_cli import add_simulate_parser
from pacerl.sandbox import BACKENDS, Limits, Sandbox, SandboxUsageError
from pacerl.sandbox.http_guard import add_guard_flags, guard_from_flags
from pacerl.sandbox.limits import RequestMaxima
from pacerl.serve_openai import add_serve_openai_parser
from pacerl.settings import read_settings

_RETRIEVER_FLAGS = {
    "max_queries": ("--max-queries", "queries in one request", 4096),
    "max_query_chars": ("--max-query-chars", "characters in one query", 512),
    "max_topk": ("--max-topk", "largest topk a request may ask for", 100),
    "max_hits": ("--max-hits", "queries x topk in one request", 16_384),
    "search_workers": ("--search-workers", "searches running at once, one thread each", 2),
    "max_waiting": ("--max-waiting-searches", "requests waiting for a search thread; more get HTTP 503", 64),
}
"""RetrieverLimits field -> (flag, help, its default as shown in --help; a test checks they agree)."""


def _add_limit_flags(parser: argparse.ArgumentParser, per_request_maximum: bool = False) -> None:
    defaults = Limits()
    suffix = " a request gets when it asks for none (default: %(default)s)" if per_request_maximum else ""
    parser.add_argument(
        "--timeout", type=float, default=defaults.timeout_s, help="wall-clock seconds" + suffix
    )
    parser.add_argument(
        "--memory-mb", type=int, default=defaults.memory_mb, help="address-space MiB" + suffix
    )
    parser.add_argument("--max-processes", type=int, default=defaults.max_processes)
    parser.add_argument("--output-cap", type=int, default=defaults.output_cap_bytes, help="bytes kept")
    if per_request_maximum:
        maxima = RequestMaxima()
        cap = "; more is capped, and the answer says so (default: %(default)s)"
        parser.add_argument(
            "--max-timeout", type=float, default=maxima.timeout_s, help="most run_timeout honoured" + cap
        )
        parser.add_argument(
            "--max-memory-mb", type=int, default=maxima.memory_mb, help="most memory_limit_MB honoured" + cap
        )


def _limits(args: argparse.Namespace) -> Limits:
    return Limits(
        timeout_s=args.timeout,
        memory_mb=args.memory_mb,
        max_processes=args.max_processes,
        output_cap_bytes=args.output_cap,
    )


def _backend_options(pairs: Sequence[str]) -> dict[str, object]:
    """`--option key=value` pairs; values parsed as JSON when they parse, else kept as strings."""
    options: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--option wants key=value, got {pair!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def cmd_sandbox_run(args: argparse.Namespace) -> int:
    """`pacerl sandbox run FILE|-`: run one program, print the ExecResult as one JSON object."""
    source = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
    stdin = Path(args.stdin).read_bytes() if args.stdin else None
    with Sandbox(args.backend, limits=_limits(args), **_backend_options(args.option)) as sandbox:
        result = sandbox.run(source, language=args.language, stdin=stdin)
    print(json.dumps(result.to_json()))
    return 0 if result.ok else 1


def cmd_serve_sandbox(args: argparse.Namespace) -> int:
    """`pacerl serve sandbox`: a SandboxFusion-compatible /run_code server."""
    from pacerl.sandbox.server import GUARD, serve

    serve(
        backend=args.backend,
        host=args.host,
        port=args.port,
        max_concurrency=args.max_concurrency,
        limits=_limits(args),
        options=_backend_options(args.option),
        max_queue=args.max_queue,
        guard=guard_from_flags(args, GUARD),
        maxima=RequestMaxima(timeout_s=args.max_timeout, memory_mb=args.max_memory_mb),
    )
    return 0


def cmd_serve_retriever(args: argparse.Namespace) -> int:
    """`pacerl serve retriever`: a Search-R1-compatible /retrieve server (BM25 over a JSONL corpus)."""
    from pacerl.envs.retriever import RetrieverLimits, serve

    given = {field: getattr(args, field) for field in _RETRIEVER_FLAGS if getattr(args, field) is not None}
    limits = RetrieverLimits(**given)
    serve(
        corpus=args.corpus,
        host=args.host,
        port=args.port,
        default_topk=args.topk,
        limits=limits,
        guard=guard_from_flags(args, limits.guard()),
    )
    return 0


def cmd_serve_sglang(args: argparse.Namespace) -> int:
    """`pacerl serve sglang`: replace this process with an SGLang server launched with pacerl's flags."""
    from pacerl.agents.engine.sglang import launch_command

    argv = launch_command(
        args.model, args.port, args.python, args.extra,
        moe=args.moe, host=args.host, weight_version=args.weight_version,
    )  # fmt: skip
    executable = shutil.which(args.python)
    if executable is None:
        raise ValueError(f"--python {args.python!r} is not an executable (the environment with sglang)")
    print(f"pacerl: exec {shlex.join(argv)}", file=sys.stderr, flush=True)
    os.execv(executable, argv)


def cmd_demo(args: argparse.Namespace) -> int:
    """`pacerl demo`: the main job on the embedded defaults."""
    from pacerl.demo import run_demo

    return run_demo(backend=args.backend)


_PRINT_CONFIG_HELP = (
    "print the resolved config as JSON (what the run saves as config.json, the model's defaults filled "
    "in) and exit without loading the model or running anything"
)


def _check_keys(config_path: str | None, overrides: Sequence[str]) -> None:
    """Refuse a misspelt key of the config file or the overrides before the library loads (seconds of
    torch and transformers); everything else is checked when the config is built."""
    data = read_settings(Path(config_path)) if config_path is not None else {}
    check_keys(data, overrides)


def cmd_train(args: argparse.Namespace) -> int:
    """`pacerl train [--config FILE] [key=value ...] [--resume RUN_DIR] [--print-config]`."""
    if args.resume is None:
        _check_keys(args.config, args.overrides)
    from pacerl.train import main_train

    return main_train(args.config, args.overrides, args.resume, print_config=args.print_config)


def cmd_sft(args: argparse.Namespace) -> int:
    """`pacerl sft --out DIR [--config FILE] [key=value ...]`."""
    _check_keys(args.config, args.overrides)
    from pacerl.train import main_sft

    return main_sft(args.config, args.overrides, args.out)


_ROUTER_STD = 0.02
"""pacerl.agents.upcycle.DEFAULT_ROUTER_STD as --help shows it, without importing torch for every command (a
test checks they agree)."""


def cmd_upcycle(args: argparse.Namespace) -> int:
    """`pacerl upcycle --model DIR_OR_GGUF --experts E --top-k K --out DIR`: a Mixtral-layout MoE whose
    experts are copies of the dense model's MLPs (agents.upcycle), saved with the model's tokenizer."""
    from pacerl.agents.models import load_model, parameter_count, save_model
    from pacerl.agents.upcycle import DEFAULT_ROUTER_STD, upcycle_to_mixtral

    std = DEFAULT_ROUTER_STD if args.router_std is None else args.router_std
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} exists and is not an empty directory")
    dense, tokenizer = load_model(args.model, dtype="auto")  # keep the checkpoint's dtype
    moe = upcycle_to_mixtral(dense, args.experts, args.top_k, router_init_std=std, seed=args.seed)
    save_model(moe, tokenizer, out)
    before, after = parameter_count(dense) / 1e6, parameter_count(moe) / 1e6
    print(
        f"pacerl: upcycled {args.model} ({before:.1f}M parameters) to {args.experts} experts, "
        f"top-{args.top_k} ({after:.1f}M parameters, {moe.dtype}): {out}"
    )
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """`pacerl eval [--config FILE] [key=value ...] [--model DIR] [--env ID] [--n K] ...`."""
    _check_keys(args.config, args.overrides)
    from pacerl.evaluate import main_eval

    return main_eval(
        args.model,
        args.env,
        args.n,
        args.tasks,
        args.out,
        temperature=args.temperature,
        max_tasks=args.max_tasks,
        retriever_url=args.retriever_url,
        seed=args.seed,
        episodes=args.episodes,
        config_path=args.config,
        overrides=args.overrides,
        suite=args.suite,
        suite_dir=args.suite_dir,
        print_config=args.print_config,
    )


def add_eval_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add the `eval` subcommand (handler `cmd_eval`) to `pacerl`'s subparsers; returns its parser."""
    from pacerl.envs import ENV_IDS

    defaults = EvalConfig()
    parser = commands.add_parser(
        "eval",
        help="evaluate a model on an env's tasks: avg@K, pass@k, tool use, failures",
        description="The same config as `pacerl train` (--config FILE and key=value overrides: model, "
        "env, evaluation.settings, engine_backend, openai); the flags below are shorthands for its keys.",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. "
                        "evaluation.settings.max_new_tokens=512 env.system_prompt=null")  # fmt: skip
    parser.add_argument("--config", metavar="FILE", help="a run config (TOML or JSON), as pacerl train's")
    parser.add_argument("--model", metavar="DIR", help="a model directory (model.path)")
    parser.add_argument(
        "--env",
        metavar="ID",
        help=f"a registered env id ({', '.join(ENV_IDS)}), module:Name-v0 for an env your module "
        "registers, or skyrl-gym/NAME for a skyrl-gym env (env.id)",
    )
    parser.add_argument(
        "--n", type=int, metavar="K", help=f"episodes sampled per task (default {defaults.samples})"
    )
    parser.add_argument(
        "--tasks",
        metavar="FILE",
        help="a .jsonl/.parquet task file or shipped set (default: the env's *-val; evaluation.tasks)",
    )
    parser.add_argument("--out", metavar="FILE", help="write the report as JSON here (default: print only)")
    parser.add_argument(
        "--temperature", type=float, metavar="T", help="sampling temperature; 0 is greedy, with --n 1"
    )
    parser.add_argument("--max-tasks", type=int, metavar="M", help="evaluate only the first M tasks")
    parser.add_argument(
        "--retriever-url",
        metavar="URL",
        help="the search tool's retriever (default: the env starts its own; Search-v0 serves BM25 over "
        "the shipped corpus in process)",
    )
    parser.add_argument("--seed", type=int, help=f"seed of the samplers (default {defaults.seed})")
    parser.add_argument(
        "--episodes", metavar="FILE", help="write every episode's transcript here (JSONL: segments as text)"
    )
    parser.add_argument(
        "--suite",
        metavar="NAME",
        help="evaluate a benchmark suite (math, aime, search-r1, nq-hotpotqa, bfcl, bfcl-multi-turn), one "
        "benchmark (aime24, math500, gsm8k, nq, multi_turn_base, ...) or a family with arguments "
        "(reasoning-gym:basic_arithmetic,leg_counting): avg@k, pass@k and maj@k per benchmark and their "
        "average",
    )
    parser.add_argument(
        "--suite-dir",
        metavar="DIR",
        help="read the benchmarks from <DIR>/<name>.parquet (default: $PACERL_BENCHMARK_DIR, else the hub)",
    )
    parser.add_argument("--print-config", action="store_true", help=_PRINT_CONFIG_HELP)
    parser.set_defaults(handler=cmd_eval)
    return parser


def add_plot_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `pacerl plot RUN_DIR` to the CLI's subcommands."""
    parser = commands.add_parser("plot", help="redraw a run's PNG plots into RUN_DIR/plots/")
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="a run directory (holds metrics.jsonl)")
    parser.set_defaults(handler=cmd_plot)


def cmd_plot(args: argparse.Namespace) -> int:
    """`pacerl plot RUN_DIR`: print each written path."""
    from pacerl.plots import plot_run

    for path in plot_run(args.run_dir):
        print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pacerl", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="run the main job on the embedded defaults")
    demo.add_argument("--backend", default="local", choices=sorted(BACKENDS))
    demo.set_defaults(handler=cmd_demo)

    train = commands.add_parser("train", help="train with async RL (no arguments: the embedded defaults)")
    train.add_argument("--config", help="a TOML or JSON run config (default: the built-in one)")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its latest checkpoint")
    train.add_argument("overrides", nargs="*", help="key=value settings, e.g. loop.steps=50 learner.lr=3e-5")
    train.add_argument("--print-config", action="store_true", help=_PRINT_CONFIG_HELP)
    train.set_defaults(handler=cmd_train)

    sft = commands.add_parser("sft", help="warm-start a model on generated tool-use demonstrations")
    sft.add_argument("--out", required=True, help="directory for the warm-started model")
    sft.add_argument("--config", help="a run config (its model, env and sft sections are used)")
    sft.add_argument(
        "overrides", nargs="*", help="key=value settings, e.g. sft.steps=100 env.id=pacerl/Math-v0"
    )
    sft.set_defaults(handler=cmd_sft)

    upcycle = commands.add_parser(
        "upcycle",
        help="turn a dense Llama-family model into a Mixtral MoE that starts as it (sparse upcycling)",
    )
    upcycle.add_argument(
        "--model", required=True, help="a checkpoint directory, a .gguf file or a shipped name"
    )
    upcycle.add_argument(
        "--experts", type=int, required=True, help="experts per layer, each a copy of the MLP"
    )
    upcycle.add_argument("--top-k", type=int, required=True, help="experts each token is routed to")
    upcycle.add_argument("--out", required=True, help="directory for the MoE checkpoint (new or empty)")
    upcycle.add_argument("--seed", type=int, default=0, help="seed of the routers (default: %(default)s)")
    upcycle.add_argument(
        "--router-std",
        type=float,
        default=None,
        help=f"standard deviation of the routers' initial weights (default: {_ROUTER_STD})",
    )
    upcycle.set_defaults(handler=cmd_upcycle)

    add_eval_parser(commands)
    add_plot_parser(commands)
    add_simulate_parser(commands)
    add_calibrate_parser(commands)

    sandbox = commands.add_parser("sandbox", help="run code in a sandbox").add_subparsers(
        dest="sandbox_command", required=True
    )
    run = sandbox.add_parser("run", help="run FILE (or - for stdin) and print the result as JSON")
    run.add_argument("file", help="program file, or - to read it from stdin")
    run.add_argument("--backend", default="local", choices=sorted(BACKENDS))
    run.add_argument("--language", default="python")
    run.add_argument("--stdin", help="file whose bytes become the program's stdin")
    run.add_argument("--option", action="append", default=[], help="backend option key=value")
    _add_limit_flags(run)
    run.set_defaults(handler=cmd_sandbox_run)

    serve = commands.add_parser("serve", help="run a server").add_subparsers(
        dest="serve_command", required=True
    )
    serve_sandbox = serve.add_parser("sandbox", help="SandboxFusion-compatible /run_code server")
    serve_sandbox.add_argument("--backend", default="local", choices=["local", "docker"])
    serve_sandbox.add_argument("--host", default="127.0.0.1")
    serve_sandbox.add_argument("--port", type=int, default=8080)
    serve_sandbox.add_argument("--max-concurrency", type=int, default=8, help="runs at once; more wait")
    serve_sandbox.add_argument(
        "--max-queue", type=int, default=None, help="requests allowed to wait; beyond it HTTP 503 at once"
    )
    serve_sandbox.add_argument("--option", action="append", default=[], help="backend option key=value")
    _add_limit_flags(serve_sandbox, per_request_maximum=True)
    add_guard_flags(serve_sandbox, ("98 MiB, every input at its cap", "128 MiB"))
    serve_sandbox.set_defaults(handler=cmd_serve_sandbox)

    serve_retriever = serve.add_parser("retriever", help="Search-R1-compatible /retrieve server (BM25)")
    serve_retriever.add_argument(
        "--corpus", required=True, help='JSONL corpus, one {"id", "contents"} document per line'
    )
    serve_retriever.add_argument("--host", default="127.0.0.1")
    serve_retriever.add_argument("--port", type=int, default=8000)
    serve_retriever.add_argument(
        "--topk", type=int, default=3, help="documents per query when a request says none"
    )
    work = serve_retriever.add_argument_group("per-request caps (HTTP 422 past them) and search threads")
    for field, (flag, text, default) in _RETRIEVER_FLAGS.items():
        work.add_argument(
            flag, dest=field, type=int, default=None, metavar="N", help=f"{text} (default: {default})"
        )
    add_guard_flags(serve_retriever, ("from the query caps", "4 bodies at the cap"))
    serve_retriever.set_defaults(handler=cmd_serve_retriever)

    serve_sglang = serve.add_parser(
        "sglang",
        help="exec an SGLang server with the flags pacerl needs; arguments after -- go to it unchanged",
    )
    serve_sglang.add_argument("--model", required=True, help="model path (or hub name) for --model-path")
    serve_sglang.add_argument("--host", default="127.0.0.1")
    serve_sglang.add_argument("--port", type=int, default=30000)
    serve_sglang.add_argument(
        "--python", default=sys.executable, help="the Python of the environment where sglang is installed"
    )
    serve_sglang.add_argument(
        "--moe",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="return routed experts (R3); --no-moe for a dense model",
    )
    serve_sglang.add_argument(
        "--weight-version", type=int, default=0, help="the version of the weights it starts with"
    )
    serve_sglang.add_argument("extra", nargs="*", help="after --: more sglang.launch_server arguments")
    serve_sglang.set_defaults(handler=cmd_serve_sglang)
    add_serve_openai_parser(serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pacerl` console script."""
    args = build_parser().parse_args(argv)
    try:
        handler: Callable[[argparse.Namespace], int] = args.handler
        code = handler(args)
    except (SandboxUsageError, ValueError, OSError, RuntimeError) as error:
        print(f"pacerl: error: {error}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
