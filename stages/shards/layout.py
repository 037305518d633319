"""The shape of a tensor-sharded layer, as plain data: what the ranks exchange and log per layer.

Torch-free on purpose: the planner (`peer/plan/groups.py`, `peer/plan/audit.py`) prices
and audits sharded spans from these facts without loading the engine.
"""

from __future__ import annotations

# Coordinate spaces a record can refer to. Only "hidden" (the residual stream and
# everything of its width) is constrained: no rank may know all of it at once.
HIDDEN = "hidden"

# What one rank reports per layer, in order: (event, op). `peer/plan/audit.py` checks
# every rank's log against it, so a skipped or extra operator is caught.
LAYER_AUDIT_OPS: tuple[tuple[str, str], ...] = (
    ("held", "residual_in"),
    ("held", "attn_norm"),
    ("held", "qkv"), ("all_reduce_scalar", "attn_norm"), ("reduce_scatter", "qkv"), ("held", "qkv"),
    ("held", "attn"),
    ("held", "o_proj"), ("reduce_scatter", "o_proj"), ("held", "o_proj"),
    ("held", "residual_mid"),
    ("held", "mlp_norm"),
    ("held", "gate_up"), ("all_reduce_scalar", "mlp_norm"), ("reduce_scatter", "gate_up"), ("held", "gate_up"),
    ("held", "swiglu"),
    ("held", "down"), ("reduce_scatter", "down"), ("held", "down"),
    ("held", "residual_out"),
)
# Rounds of all-to-all exchange per layer: the norms' all-reduces ride with the next reduce-scatter.
ROUNDS_PER_LAYER = 4
