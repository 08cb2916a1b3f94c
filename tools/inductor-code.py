"""Print the Triton code torch.compile generates for the pooling suite's PyTorch baselines (to see
what ckgen must beat). Needs a GPU and torch.

    python tools/inductor-code.py [--out DIR]"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    x = torch.randn(64, 64, 112, 112, device="cuda", dtype=torch.bfloat16)
    cases = {
        "maxpool_fwd_nchw": (lambda t: F.max_pool2d(t, 3, 2, 1), x),
        "maxpool_fwd_nhwc": (lambda t: F.max_pool2d(t, 3, 2, 1), x.to(memory_format=torch.channels_last)),
        "avgpool_fwd_nchw": (lambda t: F.avg_pool2d(t, 3, 2, 1), x),
    }
    y = F.avg_pool2d(x, 3, 2, 1)
    dy = torch.randn_like(y)
    cases["avgpool_bwd_nchw"] = (lambda g: torch.ops.aten.avg_pool2d_backward(g, x, [3, 3], [2, 2], [1, 1], False, True, None), dy)
    for name, (fn, inp) in cases.items():
        try:
            _, code = run_and_get_code(torch.compile(fn), inp)
            text = "\n\n".join(code)
        except Exception as e:  # noqa: BLE001
            text = f"failed: {e!r}"
        Path(a.out, f"inductor-{name}.py").write_text(text)
        print(name, len(text))


if __name__ == "__main__":
    main()
