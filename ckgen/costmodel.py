"""TEMPORARY: the config cost model is the package ckgen/model/. This module re-exports what other
modules still import from here; it goes when they import ckgen.model."""
from . import model
from .model import *  # noqa: F403
from .model.candidates import _walk_configs
from .model.features import _main_launch, _phi_matrix, _regs
from .model.fit import _prepare, _usable_records
from .model.lattice import _CLASS_STATE, _LATTICES, _class_filter, _lattice
from .model.parsed import _PackedTables, _packed_table, _parsed_get, _unpacked_table
from .model.policy import _ENTRY_CONFIGS, _PARSED, _REPLACED, _split_validity
from .model.store import _loaded, _warned

__all__ = model.__all__ + [
    "_CLASS_STATE", "_ENTRY_CONFIGS", "_LATTICES", "_PARSED", "_PackedTables", "_REPLACED", "_class_filter", "_lattice",
    "_loaded", "_main_launch", "_packed_table", "_parsed_get", "_phi_matrix", "_prepare", "_regs", "_split_validity",
    "_unpacked_table", "_usable_records", "_walk_configs", "_warned"]
