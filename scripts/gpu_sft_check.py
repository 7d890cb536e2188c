"""Diagnostic: the demo's SFT warm-up on the CPU and on CUDA from the same start, step for step.

On an H200 (torch 2.11, transformers 5.17) ``posttrain demo --quick`` reached 2 % held-out pass@1
after 400 SFT steps where the CPU reaches its 40 % target by step 310. This prints the SFT loss and
the validation accuracy of both devices side by side, so that the first step where they part shows.

    python scripts/gpu_sft_check.py [STEPS]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from rich.console import Console

from posttrain.config import config_from_dict
from posttrain.demos.arithmetic import demo_config
from posttrain.trainers.sft import sft


def main() -> None:
    """Run ``STEPS`` SFT steps on each device and print both loss curves."""
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        devices = os.environ.get("DEVICES", "cpu,cuda").split(",")  # DEVICES=cpu,cpu: a dry run
        for i, device in enumerate(devices):
            d = demo_config(f"{tmp}/{i}", 0, True)
            d["model"]["device"] = device
            d["sft"].update(steps=steps, eval_every=20, target_accuracy=1.0)
            sft(config_from_dict(d), console=Console(quiet=True))
            curves[i] = [json.loads(x) for x in Path(f"{tmp}/{i}/metrics.jsonl").read_text().splitlines()]
    print(f"{devices[0]} vs {devices[1]}")
    for a, b in zip(curves[0], curves[1], strict=False):
        keys = [k for k in ("sft/loss", "optim/grad_norm", "sft/val_accuracy") if k in a]
        print(a["step"], "  ".join(f"{k} {a[k]:.5f} {b.get(k, float('nan')):.5f}" for k in keys))


if __name__ == "__main__":
    main()
