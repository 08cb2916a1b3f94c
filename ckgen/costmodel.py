"""TEMPORARY: the config cost model moved to the package ckgen/model/. This module re-exports what
other modules still import from here; it goes when they import ckgen.model."""
from .model import *  # noqa: F401,F403
from .model import __all__  # noqa: F401
from .model.candidates import _walk_configs  # noqa: F401
from .model.features import _main_launch, _phi_matrix, _regs  # noqa: F401
from .model.fit import _prepare, _usable_records  # noqa: F401
from .model.lattice import _CLASS_STATE, _LATTICES, _class_filter, _lattice  # noqa: F401
from .model.parsed import _PackedTables, _packed_table, _parsed_get, _unpacked_table  # noqa: F401
from .model.policy import _ENTRY_CONFIGS, _PARSED, _REPLACED, _split_validity  # noqa: F401
from .model.store import _loaded, _warned  # noqa: F401
