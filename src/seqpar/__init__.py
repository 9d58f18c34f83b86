"""seqpar: exact sequence parallelism (Ulysses, Ring, USP) for long-context post-training.

Layers, lowest first (each imports only its own layer or lower; the README's "Where things live" map):
comm -> mesh -> layout -> attention -> data / loss / dynamic -> memory -> steps / rl -> hf -> train / trl ->
planner -> bench -> cli. `import seqpar` loads up to the shared training step (seqpar.steps), never a
trainer.
"""

from . import attention  # the package, callable as the function (attention/__init__.py)
from .errors import SeqParError
from .layout import local_positions, padded_length, required_multiple, shard, unshard
from .mesh import SequenceParallelMesh, auto_degrees, init_mesh
from .rl import TokenLogps, gather_tokens, token_logps

__version__ = "0.1.0"

__all__ = [
    "SeqParError",
    "SequenceParallelMesh",
    "TokenLogps",
    "attention",
    "auto_degrees",
    "gather_tokens",
    "init_mesh",
    "local_positions",
    "padded_length",
    "required_multiple",
    "shard",
    "token_logps",
    "unshard",
]
