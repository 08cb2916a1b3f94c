"""Does the Timer's L2 flush hold against torch.compile's kernels? For held-out cases, time
ckgen, eager and torch.compile after a plain fill of 2x L2 (the old flush) and after
`Timer.flush`, before and after torch.compile has run on the same input. Triton loads inputs
with an evict_last hint; a plain fill does not evict such lines, so after compile ran, the
input partly stays in L2 and everything reading it looks faster. Needs a GPU and torch.

    python tools/l2-flush-check.py 24,33,25   # indices into bench/heldout.yaml"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def main() -> None:
    import torch

    import heldout as H
    from ckgen.runtime.bench import Timer
    from ckgen.runtime.target import device_info

    timer = Timer(device_info(None).l2_bytes, warmup=3, runs=20)

    def timed(fn, flush) -> float:
        return timer.time(fn, flush=flush).median_us

    plain = timer.fill

    cases = H.load_cases()
    for i in (int(v) for v in sys.argv[1].split(",")):
        op, p = H.problem_of(cases[i])
        ours, eager, explain, graph = H.calls(cases[i])
        explain()
        out = [f"before compile: plain ours={timed(ours, plain):.1f} flush ours={timed(ours, timer.flush):.1f}"]
        comp = torch.compile(graph or eager, dynamic=False)
        comp()
        for tag, fl in (("plain", plain), ("flush", timer.flush)):
            out.append(f"| after, {tag}: ours={timed(ours, fl):.1f} eager={timed(eager, fl):.1f} "
                       f"compile={timed(comp, fl):.1f}")
        print(i, op.name, p.key(), " ".join(out), flush=True)
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
