"""tests/test_tune_replay.py's fixture, one process per sweep: which sweeps set the floors."""
import json, sys, os, time
from multiprocessing import Pool
from pathlib import Path
sys.path.insert(0, os.getcwd())
from ckgen.replay import load_sweep, replay, sweep_paths

def one(path):
    t = time.time()
    sw = load_sweep(path)
    if not sw.complete:
        return None
    out = {str(tr): [replay(sw, tr, s)[0] for s in range(20)] for tr in (20, 40)}
    return sw.name, out, time.time() - t

if __name__ == "__main__":
    paths = sweep_paths("bench/results/sweeps")
    res = {}
    with Pool(min(16, len(paths))) as p:
        for r in p.imap_unordered(one, paths):
            if r:
                res[r[0]] = r[1]
                print(f"{r[0]:30s} {r[2]:.0f}s  20: worst {max(r[1]['20']):.4f} in3% {sum(x<=1.03 for x in r[1]['20'])}/20"
                      f"   40: worst {max(r[1]['40']):.4f} in3% {sum(x<=1.03 for x in r[1]['40'])}/20", flush=True)
                Path(sys.argv[1]).write_text(json.dumps(res, indent=1))
