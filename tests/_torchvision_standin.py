"""import_timm(): timm for the CPU tests of ckgen.torch's timm adapters, where torchvision is
missing or unusable.

timm imports torchvision at import time (FrozenBatchNorm2d, transforms, datasets), but the
modules the adapters handle (timm.layers GroupNorm, GroupNorm1, GroupNormAct, the ResNets built
from them) use none of it. PyPI's torchvision wheels for Linux are CUDA builds that do not load
next to torch's CPU wheel, which the CPU tier installs (pyproject's test extra), and the CPU
torchvision build is not on PyPI. So, only when `import timm` fails on torchvision, the tests
put a stand-in package under that name in sys.modules (every attribute is an empty class),
import timm, and take the stand-in out again; timm keeps its references, the rest of the
session sees no torchvision. Where a real torchvision loads (the GPU machine), it is used.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class _Placeholder(type):
    """A class whose attributes are more such classes: enough for module-level code such as
    `InterpolationMode.NEAREST: 'nearest'` in a dict, or subclassing `transforms.Transform`."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {})

    def __call__(cls, *args, **kwargs):
        return object.__new__(cls)


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Module(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def _forget(prefix: str) -> None:
    for name in [n for n in sys.modules if n == prefix or n.startswith(prefix + ".")]:
        del sys.modules[name]


#: How to add timm to a test environment: without its dependencies, which are torch (installed),
#: torchvision (standed in here) and packages the test extra's diffusers already brings. The
#: `models` extra, or a plain `pip install timm`, would install a CUDA torch over the CPU one.
TIMM_INSTALL = "pip install --no-deps timm"
SKIP_NO_TIMM = f"timm is not installed ({TIMM_INSTALL} adds it and keeps the installed torch)"


def import_timm():
    """timm, with the stand-in if the real torchvision cannot be imported; None if timm is not
    installed or does not import even so."""
    try:
        import timm

        return timm
    except ModuleNotFoundError as e:
        if e.name is None or not e.name.startswith("torchvision"):
            return None  # timm itself (or another dependency) is missing
    except Exception:  # noqa: BLE001 - a torchvision that does not load (CUDA build on CPU torch)
        pass
    _forget("timm")
    _forget("torchvision")
    finder = _Finder()
    sys.meta_path.insert(0, finder)
    try:
        import timm

        return timm
    except Exception:  # noqa: BLE001
        return None
    finally:
        sys.meta_path.remove(finder)
        _forget("torchvision")
