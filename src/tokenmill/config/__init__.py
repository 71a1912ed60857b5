"""Typed run configuration.

A run is fully described by one :class:`Config`: a dataclass per section, a docstring (``doc``
metadata) on every field. Resolution order, later wins::

    defaults < preset (TOML shipped in tokenmill/presets) < --config FILE.toml < --section.field VALUE

Unknown keys and bad values raise :class:`ConfigError` naming the key and the closest valid one.
The resolved config is written as ``config.toml`` into the run directory and can be fed back
with ``--config`` to reproduce the run.
"""

from tokenmill.config.lora import LORA_ROLES, LoraConfig, check_nf4_shards, lora_roles
from tokenmill.config.resolve import (
    _closest,
    apply_overrides,
    check_lora_targets,
    flatten,
    from_dict,
    load_preset,
    load_toml,
    preset_names,
    reference_markdown,
    resolve,
    save,
    to_toml,
    tomllib,
    validate,
)
from tokenmill.config.schema import (
    CheckpointConfig,
    CompileConfig,
    Config,
    DataConfig,
    F,
    LogConfig,
    MemoryConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    concrete,
    describe_range,
    field_ranges,
    field_specs,
    sections,
    shape_fields,
)
from tokenmill.config.suggest import ALIASES, closest_key, suggest
from tokenmill.errors import ConfigError

__all__ = [
    "F", "CheckpointConfig", "CompileConfig", "Config", "ConfigError", "DataConfig", "LogConfig", "LORA_ROLES",
    "LoraConfig", "MemoryConfig", "check_nf4_shards", "lora_roles",
    "ModelConfig", "OptimConfig", "ParallelConfig", "TrainConfig", "_closest", "apply_overrides", "check_lora_targets", "concrete", "describe_range",
    "field_ranges", "field_specs", "flatten", "from_dict", "load_preset", "load_toml", "preset_names",
    "reference_markdown", "resolve", "save", "sections", "shape_fields", "suggest", "closest_key", "ALIASES", "to_toml", "tomllib", "validate",
]
