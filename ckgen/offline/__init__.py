"""The offline layer: the instance library of `ckgen generate` (`library`), the build of the
records the package ships (`shipped`) and `ckgen bench` (`opbench`) (docs/architecture.md,
"Layers")."""
