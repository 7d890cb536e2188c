"""The ``posttrain serve`` command: its arguments, and loading the model to serve as ``posttrain eval`` does
(a model directory, hub id or alias, a checkpoint, a run directory's latest checkpoint, a LoRA run's adapter
merged into its base, a ``ref_logit_mix`` run's mixture), then serving until interrupted.
"""

from __future__ import annotations

import argparse
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

if TYPE_CHECKING:
    from posttrain.serve.server import ServeApp

# torch, transformers and the server load with the command, not with `posttrain --help`

API_KEY_ENV = "POSTTRAIN_SERVE_API_KEY"


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    """``posttrain serve MODEL [--host H] [--port P] ...``."""
    s = sub.add_parser("serve", help="serve a model, checkpoint or run's policy as an OpenAI-compatible HTTP API "
                       "(/v1/chat/completions, /v1/completions, /v1/models)")
    s.add_argument("model", help="model directory, hub id or alias, checkpoint, run directory (its latest "
                   "checkpoint) or a LoRA run's checkpoint")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: a free one)")
    s.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}, else none)")
    s.add_argument("--served-model-name", help="the model's name in the API (default: MODEL as given)")
    s.add_argument("--max-tokens", type=int, default=1024, help="the most tokens one completion may ask for")
    s.add_argument("--max-n", type=int, default=16, help="the most completions one request may ask for")
    s.add_argument("--max-body-mb", type=float, default=4.0, help="the largest request body read, in MiB")
    s.add_argument("--batch-wait-ms", type=float, default=20.0, help="how long a batch waits for company (default "
                   "20; bench/serve.py measures what it buys)")
    s.add_argument("--max-batch-rows", type=int, default=64, help="the most sequences one engine call samples")
    s.add_argument("--tool-parser", help="tool-call parser (hermes, llama3_json, mistral, compact, any; default: "
                   "the chat template's)")
    s.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    s.add_argument("--dtype", default="float32", help="the weights' dtype (model.dtype; default float32)")
    s.add_argument("--seed", type=int, default=0, help="seed of the draws of requests that give none")


def build_app(args: argparse.Namespace, console: Console) -> ServeApp:
    """Load ``args.model`` (as ``posttrain eval --model`` does) on the ``hf`` engine and wrap it in a ServeApp."""
    from posttrain.config import load_config
    from posttrain.evaluation.run import _as_trained
    from posttrain.models.load import load_model, load_tokenizer, resolve_device
    from posttrain.rollout import make_engine
    from posttrain.run.setup import run_dir_model
    from posttrain.serve.protocol import Limits
    from posttrain.serve.server import ServeApp, ServeSettings

    given = str(args.model)
    path = run_dir_model(given)
    run = Path(given)
    if not (run / "config.toml").exists() and Path(path).parent.name == "checkpoints":
        run = Path(path).parent.parent  # a checkpoint: its run's config says how it was trained
    overrides = [f'model.device="{args.device}"', f'model.dtype="{args.dtype}"']
    cfg = load_config(run / "config.toml" if (run / "config.toml").exists() else None, overrides)
    device = resolve_device(cfg.model)
    tokenizer = load_tokenizer(path)
    policy = load_model(path, cfg.model.dtype, device).eval()
    policy, _ = _as_trained(cfg, policy, given, path, device, console)
    engine = make_engine("hf", policy, tokenizer)
    limits = Limits(max_tokens=args.max_tokens, max_n=args.max_n)
    settings = ServeSettings(
        model_name=args.served_model_name or given, api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        limits=limits, max_body=int(args.max_body_mb * (1 << 20)), batch_wait_s=args.batch_wait_ms / 1000,
        max_batch_rows=args.max_batch_rows, tool_parser=args.tool_parser, seed=args.seed)
    return ServeApp(engine, tokenizer, settings, context=int(policy.config.max_position_embeddings))


def cli_serve(args: argparse.Namespace, console: Console) -> int:
    """``posttrain serve``: load, bind, serve until Ctrl-C."""
    from posttrain.serve.server import start

    app = build_app(args, console)
    server, thread = start(app, args.host, args.port)
    host, port = server.server_address[:2]
    key = " (API key required)" if app.settings.api_key else ""
    console.print(f"posttrain serve: {app.settings.model_name!r} at http://{host}:{port}/v1{key}", highlight=False,
                  soft_wrap=True)
    if not app.settings.api_key and args.host not in ("127.0.0.1", "localhost", "::1"):
        console.print(f"[yellow]warning:[/] listening on {args.host} without an API key: anyone who can reach this "
                      f"port can sample the model (--api-key or ${API_KEY_ENV})", soft_wrap=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        app.close()
    return 0
