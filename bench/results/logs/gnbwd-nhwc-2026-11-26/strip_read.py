"""Read bandwidth of NHWC access patterns: a block reads a strip of `w` bytes of each pixel row
(row = C*2 bytes) over many pixels, vs whole rows. Sum into a dummy output so loads aren't elided."""
import cupy as cp, sys
src = r'''
extern "C" __global__ void strip(const uint4* __restrict__ x, float* out, long long npix, int row_v, int w_v, int pix_per_block) {
  // grid: (strips, pixel chunks); block: w_v columns x R rows
  int strip = blockIdx.x, chunk = blockIdx.y;
  int col = threadIdx.x % w_v, r = threadIdx.x / w_v, R = blockDim.x / w_v;
  long long p0 = (long long)chunk * pix_per_block;
  float acc = 0.f;
  for (int p = r; p < pix_per_block; p += R) {
    long long pix = p0 + p; if (pix >= npix) break;
    uint4 v = x[pix * row_v + (long long)strip * w_v + col];
    acc += __int_as_float(v.x) + __int_as_float(v.y) + __int_as_float(v.z) + __int_as_float(v.w);
  }
  if (acc == 1.2345f) out[0] = acc;
}'''
k = cp.RawKernel(src, "strip")
N, C, HW = 16, 512, 4096
row_v = C * 2 // 16
x = cp.random.random(N * HW * C // 2, dtype=cp.float32).view(cp.uint32).reshape(-1)
out = cp.zeros(1, cp.float32)
nbytes = x.nbytes
def t(fn, reps=20):
    fn(); cp.cuda.Device().synchronize()
    s, e = cp.cuda.Event(), cp.cuda.Event()
    ts = []
    for _ in range(reps):
        s.record(); fn(); e.record(); e.synchronize(); ts.append(cp.cuda.get_elapsed_time(s, e) * 1000)
    ts.sort(); return ts[len(ts)//2]
y = cp.empty_like(x)
tc = t(lambda: cp.copyto(y, x))
print(f"copy {nbytes/1e6:.0f} MB: {tc:.1f} us ({2*nbytes/tc/1e3:.0f} GB/s r+w); read-only equiv {nbytes/(tc/2)/1e3:.0f}")
for w_bytes in (32, 64, 128, 256, 512, 1024):
    w_v = w_bytes // 16
    for threads in (128, 256, 512):
        for ppb in (256, 512, 2048):
            strips = row_v // w_v
            chunks = (N * HW + ppb - 1) // ppb
            f = lambda: k((strips, chunks), (threads,), (x, out, cp.int64(N * HW), cp.int32(row_v), cp.int32(w_v), cp.int32(ppb)))
            us = t(f)
            print(f"strip {w_bytes:5d} B  t{threads:4d} pix/block {ppb:5d}: {us:7.1f} us  {nbytes/us/1e3:6.0f} GB/s read")
