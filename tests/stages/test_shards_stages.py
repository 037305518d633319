"""Tensor shards in process: exactness against the unsharded stage, and the audit of every step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tessera.peer.plan.audit import REQUESTER, check
from tessera.stages.shards.sharded import ShardError, ShardedStage
from tessera.stages.families.catalog import spec_from_file
from tessera.stages.assembly.stage import load_stage

from ..shard_helpers import DECODE_STEPS, LOGITS_TOLERANCE, InProcessGroup, greedy_run

PROMPT = [1, 504, 3458, 282, 4649, 30, 216, 10, 45, 99, 7, 1000]


@pytest.fixture(scope="module")
def synth_models(tmp_path_factory):
    """Shapes a group of 2 and of 4 can split: 8 heads / 4 KV heads, hidden 128, MLP 256."""
    from tessera.peer.cli.model_files import synthesise

    base = tmp_path_factory.mktemp("shard-synth")
    shape = dict(hidden=128, layers=4, heads=8, kv_heads=4, intermediate=256, vocab=320)
    return {
        "llama": synthesise(base / "llama", seed=11, **shape),
        "qwen2": synthesise(base / "qwen2", seed=12, architecture="qwen2", **shape),  # q/k/v biases
    }


def compare(reference: tuple[list[int], list[torch.Tensor]], sharded: tuple[list[int], list[torch.Tensor]]) -> float:
    ref_tokens, ref_logits = reference
    tokens, logits = sharded
    assert tokens == ref_tokens
    worst = max(float((a - b).abs().max()) for a, b in zip(ref_logits, logits))
    assert worst <= LOGITS_TOLERANCE, worst
    return worst


def test_smollm2_group_of_three_matches_the_unsharded_stage(smol_dir, smol_stage):
    group = InProcessGroup(smol_dir, start=0, end=30, count=3, group="smol")
    reference = greedy_run(smol_stage, [smol_stage], PROMPT, session="ref")
    worst = compare(reference, greedy_run(smol_stage, [group], PROMPT))
    print(f"SmolLM2, a group of 3 over all 30 layers: max |logits - unsharded| = {worst:.2e}")
    report = check(group.logs)
    assert report.ok, report.summary()
    assert report.closure == f"{DECODE_STEPS + 1}/{DECODE_STEPS + 1}"
    assert report.collectives == (DECODE_STEPS + 1) * 3 * 30 * 6  # 4 rounds, two of them fused


@pytest.mark.parametrize("arch, count", [("qwen2", 2), ("llama", 4), ("llama", 2)])
def test_synthetic_groups_match_between_unsharded_spans(synth_models, arch, count):
    """[0, 1) unsharded, [1, 3) a group, [3, 4) unsharded: slices in, slices out."""
    folder = synth_models[arch]
    head = load_stage(folder, start=0, end=0, embed=True, head=True)
    whole = load_stage(folder)
    before, after = load_stage(folder, start=0, end=1), load_stage(folder, start=3, end=4)
    group = InProcessGroup(folder, start=1, end=3, count=count)
    prompt = [5, 17, 260, 42, 99, 3]
    compare(greedy_run(head, [whole], prompt), greedy_run(head, [before, group, after], prompt))
    report = check(group.logs)
    assert report.ok, report.summary()
    assert report.audited == DECODE_STEPS + 1


def test_each_rank_holds_one_nth_of_the_weights(smol_dir):
    spec = spec_from_file(smol_dir / "config.json")
    rank = ShardedStage.load(smol_dir, start=4, end=6, index=1, count=3)
    assert rank.weight_bytes * 3 == 2 * spec.layer_bytes(4)
    assert rank.cols == (192, 384)
    rank.open("s", capacity=10)
    full = load_stage(smol_dir, start=4, end=6)
    assert rank.session_bytes(10) * 3 == full.session_bytes(10)  # its KV heads only


def test_a_group_size_that_does_not_divide_the_kv_heads_is_refused(smol_dir):
    with pytest.raises(ShardError, match="key/value heads \\(3\\) is not divisible by 2"):
        ShardedStage.load(smol_dir, start=0, end=1, index=0, count=2)
    with pytest.raises(ShardError, match="need 0 <= index < count"):
        ShardedStage.load(smol_dir, start=0, end=1, index=3, count=3)


def test_sub_span_sessions_and_rollback(synth_models):
    """A session over part of the group's span, and a rewrite after a rollback, stay exact."""
    folder = synth_models["llama"]
    head = load_stage(folder, start=0, end=0, embed=True, head=True)
    first = load_stage(folder, start=0, end=2)
    group = InProcessGroup(folder, start=1, end=4, count=2)
    reference = load_stage(folder)
    for rank in group.ranks:
        rank.open("s", capacity=16, start=2, end=4)
    group._steps["s"] = 0
    first.open("s", capacity=16)
    reference.open("s", capacity=16)
    x = head.embed([3, 4, 5, 6])
    got = group.forward("s", first.forward("s", x, 0), 0)
    torch.testing.assert_close(head.logits(got), head.logits(reference.forward("s", x, 0)), atol=LOGITS_TOLERANCE, rtol=0)
    for rank in group.ranks:
        rank.rollback("s", 2)
    reference.rollback("s", 2)
    first.rollback("s", 2)
    y = head.embed([9, 10])
    got = group.forward("s", first.forward("s", y, 2), 2)
    torch.testing.assert_close(head.logits(got), head.logits(reference.forward("s", y, 2)), atol=LOGITS_TOLERANCE, rtol=0)
    assert check(group.logs).ok


# -- the audit catches what it must ------------------------------------------------------


def test_the_broken_variant_that_gathers_the_full_state_fails_the_audit(synth_models):
    """Its output is still right — only the audit can tell — and the audit does."""
    folder = synth_models["llama"]
    head = load_stage(folder, start=0, end=0, embed=True, head=True)
    whole = load_stage(folder)
    broken = InProcessGroup(folder, start=0, end=4, count=2, gather_full=True)
    prompt = [5, 17, 260, 42]
    compare(greedy_run(head, [whole], prompt, steps=4), greedy_run(head, [broken], prompt, steps=4))
    report = check(broken.logs)
    assert not report.ok
    assert report.audited == 0 and report.steps == 5
    assert "FAIL" in report.summary() and "closure 0/5" in report.summary()
    text = "\n".join(report.problems)
    assert "held the FULL hidden state at layer 0 (residual_mid)" in text
    assert "all_gather of residual_mid at layer 0, inside the declared interval [0, 4)" in text


@pytest.fixture(scope="module")
def clean_logs(synth_models):
    folder = synth_models["llama"]
    head = load_stage(folder, start=0, end=0, embed=True, head=True)
    group = InProcessGroup(folder, start=0, end=4, count=4)
    greedy_run(head, [group], [5, 6, 7], steps=3)
    assert check(group.logs).ok
    return group.logs


def _edit(logs, index, **changes):
    out = list(logs)
    out[index] = dataclasses.replace(out[index], **changes)
    return out


def test_the_audit_counts_a_step_a_rank_did_not_log(clean_logs):
    report = check(clean_logs[1:])
    assert report.closure == "3/4"
    assert any("no log from rank 0" in p for p in report.problems)


def test_the_audit_catches_one_node_holding_two_slices(clean_logs):
    report = check(_edit(clean_logs, 1, node=clean_logs[0].node))
    assert not report.ok and any("held slices [0, 1]" in p for p in report.problems)


def test_the_audit_catches_a_receive_nobody_sent(clean_logs):
    log = clean_logs[2]
    records = list(log.records)
    k = next(i for i, r in enumerate(records) if r["event"] == "reduce_scatter" and r["op"] == "down")
    records[k] = {**records[k], "received": records[k]["received"][1:]}  # one incoming partial unlogged
    report = check(_edit(clean_logs, 2, records=tuple(records)))
    assert not report.ok and any("did not log receiving them" in p for p in report.problems)


def test_the_audit_catches_a_rank_that_knows_every_partial(clean_logs):
    """Receiving every rank's partial of all columns is as good as the full state."""
    log = clean_logs[0]
    records = list(log.records)
    k = next(i for i, r in enumerate(records) if r["event"] == "reduce_scatter" and r["op"] == "o_proj")
    records[k] = {**records[k], "received": [[src, 0, log.hidden] for src, _, _ in records[k]["received"]]}
    report = check(_edit(clean_logs, 0, records=tuple(records)))
    assert any("held the FULL hidden state at layer 0 (o_proj)" in p for p in report.problems)


def test_the_audit_allows_a_compatibility_gather_only_at_the_end(clean_logs):
    k = next(i for i, log in enumerate(clean_logs) if log.role == REQUESTER)
    log = clean_logs[k]
    inside = tuple({**r, "layer": 2} if r["event"] == "compat_gather" else r for r in log.records)
    report = check(_edit(clean_logs, k, records=inside))
    assert not report.ok and any("compatibility gather at layer 2" in p for p in report.problems)
    member = _edit(clean_logs, k, node=clean_logs[0].node)  # a rank gathering its own group's output
    assert any("is a rank of the group" in p for p in check(member).problems)


def test_the_audit_catches_a_skipped_operator(clean_logs):
    log = clean_logs[3]
    records = tuple(r for r in log.records if not (r["layer"] == 1 and r["op"] == "mlp_norm"))
    report = check(_edit(clean_logs, 3, records=records))
    assert any("operators differ" in p and "mlp_norm" in p for p in report.problems)


def test_a_step_the_requester_never_got_is_aborted_but_still_checked(clean_logs):
    """A rank died mid-step (a failover): the step is not counted, yet a full state in it still fails."""
    requester_steps = [i for i, log in enumerate(clean_logs) if log.role == REQUESTER]
    last = requester_steps[-1]
    without = clean_logs[:last] + clean_logs[last + 1:]
    report = check(without)
    assert report.ok and report.closure == "3/3" and report.aborted == 1
    log = without[-2]  # a rank's log of the aborted step
    records = list(log.records)
    k = next(i for i, r in enumerate(records) if r["event"] == "held" and r["op"] == "residual_mid")
    records[k] = {**records[k], "cols": [0, log.hidden]}
    report = check([*without[:-2], dataclasses.replace(log, records=tuple(records)), without[-1]])
    assert not report.ok and report.aborted_violations == 1
