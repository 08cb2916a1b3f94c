"""An instance: one op's config rendered for one target. Shared by tuner, dispatcher, library."""
from __future__ import annotations

from .codegen import KernelSource, render
from .ops.spec import OpSpec, Problem
from .types import Config, Target


class InvalidConfig(ValueError):
    """A config that cannot run a problem; the message is the validator's reason."""


def render_instance(op: OpSpec, problem: Problem, config: Config, target: Target, *,
                    check: bool = True) -> KernelSource:
    """The instance's source. `check=False` skips `validate`: only for offline studies of what
    the validator should admit (a config it rejects for its registers still renders)."""
    if check:
        ok = op.validate(problem, config, target)
        if not ok:
            raise InvalidConfig(f"{op.name} {config.key()}: {ok.reason}")
    return render(op.template, op.instance_name(problem, config), op.render_context(problem, config, target),
                  op.template_dir)
