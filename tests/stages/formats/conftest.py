"""The checkpoints every test here reads, written once per session (checkpoints.py says how)."""

from __future__ import annotations

import pytest

from ..families.conformance import SHAPE, build
from . import checkpoints as ck

WIDE = {**SHAPE, "hidden_size": 256, "head_dim": 64}  # k-quant blocks are 256 inputs
LLAMA = dict(intermediate_size=512)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256, intermediate_size=512, norm_topk_prob=True)
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K", "Q8_0")
EVERY_BLOCK_TYPE = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1")
LOW_BIT_ORDER = ck.LOW_BIT + EVERY_BLOCK_TYPE  # the every-type file's types, in turn
SPLIT_GGUF, SPLIT_TENSORS = "gguf-llama-every-type", 12  # its 30 tensors in shards of 12, 12 and 6


def cycling(kinds: tuple[str, ...]):
    """A GGUF type per matrix, every kind used (by the matrix's name, so stable across runs)."""
    return lambda name: kinds[sum(name.encode()) % len(kinds)]


def in_turn(kinds: tuple[str, ...]):
    """A GGUF type per matrix, the kinds in turn as the writer asks (in a fixed order): every kind
    is used once there are as many matrices."""
    given: dict[str, str] = {}
    return lambda name: given.setdefault(name, kinds[len(given) % len(kinds)])


@pytest.fixture(scope="session")
def sources(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("float")
    from ..families.rows import ROWS

    return {"llama": build(root, "llama", transformers.LlamaConfig(**WIDE, **LLAMA), seed=41),
            "moe": build(root, "moe", transformers.Qwen3MoeConfig(**WIDE, **MOE), seed=42),
            # the MLA families' first configurations (low-rank q, dense first layer, groups, a shared expert; qk norm)
            "deepseek_v3": build(root, "deepseek_v3", ROWS["deepseek_v3/lora-groups-shared-yarn"].config(), seed=43),
            "glm4_moe": build(root, "glm4_moe", ROWS["glm4_moe/qknorm-bias-groups-shared"].config(), seed=44),
            # DSA with an indexer in every layer (its matrices ship fp8 too, and are held dense)
            "glm_moe_dsa": build(root, "glm_moe_dsa", ROWS["glm_moe_dsa/full-raw-bias-fused"].config(), seed=45)}


@pytest.fixture(scope="session")
def shipped(sources, tmp_path_factory):
    """name -> (shipped folder, its reference float folder)."""
    root = tmp_path_factory.mktemp("shipped")
    out = {}
    for name, write in {
        "fp8-llama": lambda o: ck.fp8_folder(sources["llama"], o),
        "fp8-moe": lambda o: ck.fp8_folder(sources["moe"], o),
        "fp8-llama-ragged-blocks": lambda o: ck.fp8_folder(sources["llama"], o, block=(96, 160)),
        # MLA's kv_b_proj (a parameter the engine holds dense: dequantized at load) and its other
        # projections, shared experts, routers with a correction bias; blocks of 16 for their small shapes
        "fp8-deepseek_v3": lambda o: ck.fp8_folder(sources["deepseek_v3"], o, block=(16, 16)),
        "fp8-glm4_moe": lambda o: ck.fp8_folder(sources["glm4_moe"], o, block=(16, 16)),
        "fp8-glm_moe_dsa": lambda o: ck.fp8_folder(sources["glm_moe_dsa"], o, block=(16, 16)),
        "mxfp4-moe": lambda o: ck.mxfp4_folder(sources["moe"], o),
        "mxfp4-moe-fused": lambda o: ck.mxfp4_folder(sources["moe"], o, fused=True),
        "mxfp4-llama-every-matrix": lambda o: ck.mxfp4_folder(sources["llama"], o, not_converted=["lm_head"]),
    }.items():
        folder = write(root / name)
        out[name] = (folder, ck.reference_folder(folder, root / f"{name}-reference"))
    # compressed-tensors' NVFP4 and INT4 (symmetric; with zero points), ModelOpt's NVFP4, each against the
    # library's own decompression; DeepSeek-V4's ue8m0 fp8 and FP4 experts against transformers' dequantizer
    for name, write, reference in (
        ("nvfp4-llama", lambda o: ck.ct_folder(sources["llama"], o, "nvfp4"), ck.ct_reference_folder),
        ("nvfp4-moe-modelopt", lambda o: ck.ct_folder(sources["moe"], o, "nvfp4", modelopt=True), ck.ct_reference_folder),
        ("int4-llama", lambda o: ck.ct_folder(sources["llama"], o, "int4"), ck.ct_reference_folder),
        ("int4-moe-asym", lambda o: ck.ct_folder(sources["moe"], o, "int4-asym"), ck.ct_reference_folder),
        ("fp8-deepseek_v3-fp4-experts", lambda o: ck.dsv4_folder(sources["deepseek_v3"], o), ck.dsv4_reference_folder),
    ):
        folder = write(root / name)
        out[name] = (folder, reference(folder, root / f"{name}-reference"))
    from tessera.stages.weights.convert import convert_gguf

    gguf = {f"gguf-llama-{kind}": ("llama", (kind,), "Q8_0") for kind in K_QUANTS}
    gguf["gguf-llama-every-k-quant"] = ("llama", K_QUANTS, "Q6_K")
    gguf["gguf-llama-q4"] = ("llama", ("Q4_0", "Q4_1"), "Q8_0")  # the older 4-bit types, each with a fused form
    gguf["gguf-moe-every-type"] = ("moe", EVERY_BLOCK_TYPE, "Q6_K")
    # the low-bit files' types (21 Llama matrices: each of the 19 block types at least once), the edges IQ4_XS
    gguf["gguf-llama-every-type"] = ("llama", in_turn(LOW_BIT_ORDER), "IQ4_XS")
    gguf["gguf-moe-low-bit"] = ("moe", in_turn(ck.LOW_BIT), "Q2_K")
    for name, (source, kinds, edge) in gguf.items():
        types = kinds if callable(kinds) else cycling(kinds)
        split = SPLIT_TENSORS if name == SPLIT_GGUF else 0  # one file split as large models ship: 3 shards
        path = ck.gguf_file(sources[source], root / f"{name}.gguf", types, edge_type=edge, split_max_tensors=split)
        convert_gguf(path, root / name, keep_blocks=True)
        out[name] = (root / name, ck.gguf_reference_folder(path, root / f"{name}-reference"))
    return out


NAMES = ["fp8-llama", "fp8-moe", "fp8-llama-ragged-blocks", "fp8-deepseek_v3", "fp8-glm4_moe", "fp8-glm_moe_dsa",
         "mxfp4-moe", "mxfp4-moe-fused", "mxfp4-llama-every-matrix",
         *(f"gguf-llama-{kind}" for kind in K_QUANTS), "gguf-llama-every-k-quant", "gguf-llama-q4", "gguf-moe-every-type",
         "gguf-llama-every-type", "gguf-moe-low-bit",
         "nvfp4-llama", "nvfp4-moe-modelopt", "int4-llama", "int4-moe-asym", "fp8-deepseek_v3-fp4-experts"]


