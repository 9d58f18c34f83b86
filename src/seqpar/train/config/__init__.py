"""The run's configuration (YAML -> pydantic), validated before any process group exists.

    schema.py   TrainConfig and its sections: fields, defaults, the rules knowable from the YAML alone
    load.py     load_config (a YAML file) / config_from_dict, dotted overrides, paths relative to the file
    checks.py   validate_for_launch (world size, head counts, max_length), resolve_sp_degrees, the global batch
                (rows_per_step, resolve_grad_accum), epochs -> steps; size: dynamic's degrees (dynamic_degrees,
                rows_sp_size)
"""

from .checks import (
    dynamic_degrees,
    resolve_grad_accum,
    resolve_sp_degrees,
    rows_per_step,
    rows_sp_size,
    steps_for_epochs,
    validate_for_launch,
    with_total_steps,
)
from .load import config_from_dict, load_config, set_dotted
from .schema import (
    CheckpointSpec,
    DatasetSpec,
    DPOSpec,
    ExportSpec,
    FinetuningSpec,
    FSDPSpec,
    GRPOSpec,
    MemorySpec,
    ModelSpec,
    OptimizerSpec,
    ScheduleSpec,
    SequenceParallelSpec,
    TrainConfig,
)

__all__ = ["TrainConfig", "ModelSpec", "DatasetSpec", "SequenceParallelSpec", "DPOSpec", "GRPOSpec", "FinetuningSpec",
           "OptimizerSpec", "ScheduleSpec", "CheckpointSpec", "ExportSpec", "MemorySpec", "FSDPSpec", "load_config",
           "config_from_dict", "set_dotted", "validate_for_launch", "resolve_sp_degrees", "steps_for_epochs",
           "with_total_steps", "rows_per_step", "resolve_grad_accum", "dynamic_degrees", "rows_sp_size"]
