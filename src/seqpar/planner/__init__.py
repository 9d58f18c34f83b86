"""`seqpar plan`: which ulysses x ring x dp and memory features fit a model on a cluster, and how fast.

model.py (architecture facts from an HF config), memory.py (saved-tensor memory model), time.py (FLOPs
and communication), search.py (candidates, ranking, YAML), gpus.py (presets), measure.py / validate.py
(MemTracker calibration), cli.py (the command).
"""

from .gpus import GPU_PRESETS, Cluster, make_cluster
from .memory import Features, Layout, Workload, estimate_memory
from .model import ModelFacts, bundled_models, load_model_facts
from .search import Candidate, Request, plan
from .time import estimate_time

__all__ = ["GPU_PRESETS", "Cluster", "make_cluster", "Features", "Layout", "Workload", "estimate_memory",
           "ModelFacts", "bundled_models", "load_model_facts", "Candidate", "Request", "plan", "estimate_time"]
