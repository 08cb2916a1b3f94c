"""The runtime layer: what a call of a public op needs. The device (`target`), tensor adapters
(`tensors`), NVRTC and the kernel cache (`compile`), the spill check of untuned picks (`spill`),
the instance DB (`db`), selection and launch plans (`dispatch`), the public ops and `explain`
(`api`), the correctness gate (`verify`) and timing (`bench`). It builds on the core and the cost
model (`ckgen.model`) and never imports tuning: online tuning registers a hook with the
dispatcher (docs/architecture.md, "Layers")."""
