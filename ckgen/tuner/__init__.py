"""The tuning layer: one pipeline (`tune`: a `TuneRequest` run by a `Tuner`, the evaluator its one
seam) used by `ckgen tune` and `retune`, online tuning (`online`) and the workers (`workers`),
with the samplers (`sampler`), replayed sweeps as an evaluator (`replay`) and study storage URLs
(`storage_url`). It builds on the runtime (docs/architecture.md, "Layers")."""
