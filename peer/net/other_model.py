"""What to tell someone whose swarm serves another model: which one, and what to pass.

Peers and requesters chain only on the same model id (a hash of every file of the model,
its chat template included, tagged with how a span is quantized: stages/kernels/quant.py
`model_tag`). Records of another model are kept out of a view (`ViewKeeper.foreign_models`
remembers who advertised which); when they are all a joiner hears of, every command says so
in the same words: a joining peer (peer/node/peer_node.py), a requester and a gateway
(peer/request/client.py `Swarm.connect`), `swarm status` (peer/cli/status.py).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Iterable, Mapping

from tessera.stages.weights import registry
from tessera.stages.kernels.quant import base_model_id


def registered_models() -> dict[str, str]:
    """Model id -> registered name, of the models on this machine (`tessera model list`), read from
    their manifests as they are (no file is hashed or rewritten)."""
    root = registry.models_root()
    found: dict[str, str] = {}
    if not root.is_dir():
        return found
    for folder in sorted(root.iterdir()):
        try:
            found.setdefault(str(json.loads((folder / registry.MANIFEST).read_text())["model_id"]), folder.name)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a registered model (a staging folder, a broken manifest): nothing to name
    return found


def other_model_reason(foreign: Iterable[str], own_id: str, own_model: str,
                       known: Mapping[str, str] | None = None, *, requester: bool = True) -> str:
    """What to tell someone whose swarm serves another model: which (its id, and its name if
    it is registered here), and what to pass. `foreign`: the model ids the peers advertised;
    `requester`: said to a requester, which may also chain any quantization (--accept-mixed)."""
    counts = Counter(foreign)
    theirs, n = counts.most_common(1)[0]
    peers = f"{n} peer{'s' if n != 1 else ''}"
    if base_model_id(theirs) == base_model_id(own_id):  # the same model, another quantization
        tag = theirs.split("+", 1)[1] if "+" in theirs else ""
        kind, _, group = tag.partition("g")  # "int4g32" -> int4, group 32 (stages/kernels/quant.py model_tag)
        flags = f"--quant {kind}" + (f" --quant-group {group}" if group else "") if tag else "--quant none"
        what = f"quantized as {tag}" if tag else "unquantized"
        mixed = " (or --accept-mixed)" if requester else ""
        return f"the peers there serve {own_model} {what} ({peers}), not as asked: pass {flags}{mixed}"
    known = registered_models() if known is None else known
    name = known.get(base_model_id(theirs))
    hint = (f"pass --model {name}" if name else
            "it is not registered here (`tessera model list`): get its files, then pass --model with their name")
    return (f"the peers there serve another model: model id {theirs[:16]}… ({peers}); {hint}. This one is "
            f"--model {own_model} (model id {own_id[:16]}…). A model id covers every file of the model, its "
            "chat template included: peers and requesters chain only on identical files")


__all__ = ["registered_models", "other_model_reason"]
