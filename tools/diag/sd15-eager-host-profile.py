#!/usr/bin/env python3
"""Where the host time of a converted SD1.5 UNet training step goes, in eager mode: the nn model
and the converted one timed in interleaved rounds (host-inclusive ms per step, as bench/models.py
times them), then cProfile of converted steps (the functions with the most own time, and
ckgen's share), and `ct.fallbacks()` (calls that went to PyTorch). GPU only; needs diffusers.

    python3 tools/diag/sd15-eager-host-profile.py [--batch 4] [--steps 5] [--out DIR]
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import io
import os
import pstats
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()

    import torch

    import ckgen.torch as ct
    from models import Row, build, interleaved_host_ms, make_step  # bench/models.py

    dev = torch.device("cuda")
    row = Row("sd15-unet", (args.batch, 4, 64, 64), "nhwc", "train", True)
    nn_model, _ = build(row, torch.bfloat16, dev)
    ck_model = copy.deepcopy(nn_model)
    report = ct.convert(ck_model)
    x = torch.randn(row.shape, device=dev, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    steps = {"eager": make_step(nn_model, nn_model, x, "train"), "ck_eager": make_step(ck_model, ck_model, x, "train")}
    for s in steps.values():
        for _ in range(3):
            s()
    ms = interleaved_host_ms(steps, dev, args.rounds, args.steps, gpu=True)
    lines = [f"SD1.5 UNet {row.shape} bf16 channels-last train, {torch.cuda.get_device_name()}",
             f"convert: {report.summary() if hasattr(report, 'summary') else str(report).splitlines()[0]}"]
    for c, (host, gpu, gn, pool) in ms.items():
        lines.append(f"{c:9s} host {host:8.2f} ms  gpu {gpu:8.2f} ms  gn {gn:.0%}")
    lines.append(f"ck_eager / eager host: {ms['eager'][0] / ms['ck_eager'][0]:.3f}x faster, "
                 f"gpu {ms['eager'][1] / ms['ck_eager'][1]:.3f}x")
    lines.append(f"fallbacks: {ct.fallbacks()}")
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        steps["ck_eager"]()
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf).sort_stats("tottime")
    st.print_stats(30)
    buf2 = io.StringIO()
    pstats.Stats(prof, stream=buf2).sort_stats("cumulative").print_stats("ckgen", 30)
    text = "\n".join(lines) + "\n\n" + buf.getvalue() + "\n" + buf2.getvalue()
    print("\n".join(lines))
    Path(args.out, "sd15-eager-host-profile.txt").write_text(text)
    Path(args.out, "sd15-convert-report.txt").write_text(str(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
