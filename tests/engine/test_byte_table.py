"""One byte table written by hand: the engine's ledger against docs/design.md §2's formula, no shared code.

Preset lbp with P=2, G=4, O=8 (R=1, S unset) on W=8 ranks placed as 2 nodes x 2
packages x 2 GCDs; the tiny GPT of megatron_lbp.testing.tiny_gpt in fp32
(4-byte weights and gradients); k=2 micro-batches per step. Every number
below is worked out from the model's shapes and the formula, nothing is
imported from the planner (megatron_lbp.core.costs / layout) or the engine.

Parameters (hidden h=64, 4 heads, vocabulary 128, tied output layer, LayerNorms with bias):
  embedding unit    128*64                                                   =  8192
  one layer unit    2 LayerNorms 2*(64+64)                                   =   256
                    linear_qkv 192*64 + 192                                  = 12480
                    linear_proj 64*64 + 64                                   =  4160
                    linear_fc1 256*64 + 256                                  = 16640
                    linear_fc2 64*256 + 64                                   = 16448
                                                                               -----
                                                                               49984
  final LayerNorm   64 + 64                                                  =   128
  total             8192 + 2*49984 + 128                                     = 108288
Padding (docs/design.md §2: every level divides a bucket, alignment 128): each unit is
one bucket padded to a multiple of O*128 = 1024 elements:
  8192 -> 8192 (8*1024), 49984 -> 50176 (49*1024), 128 -> 1024
  N = 8192 + 2*50176 + 1024 = 109568 elements

Bytes each rank sends per optimizer step (docs/design.md §2, w = g = 4 bytes, S unset):
  package  forward_gather   k*w*N*(P-1)/P  = 2*4*109568*1/2           = 438272
           backward_gather  the same (S unset: bf16/fp32 primary regather) = 438272
  node     grad_reduce      k*g*N*(G-1)/G  = 2*4*109568*3/4           = 657408
           step_gather      w*(N/P)*(G/P-1)/(G/P) = 4*54784*1/2       = 109568
                            (1/G -> 1/P: ranks {0,2} are two packages of one node)
  network  step_reduce      g*(N/G)*(O/G-1)/(O/G) = 4*27392*1/2       =  54784
           step_gather      w*(N/G)*(O/G-1)/(O/G) = 4*27392*1/2       =  54784
Totals per link class: package 876544, node 766976, network 109568.

The optimizer step overlaps the next forward (issue 13 item 4): the 1/G -> 1/P node
all-gathers of a step's updated weights are issued under the next step's forward,
but the ledger charges them to the step that wrote the weights. So every step's
report, the first included, is the table above.

The same model under preset zeropp (ZeRO++: P = G = O = 8, a secondary copy per node of
S = 4 in the weights' dtype, qwZ, two-hop int4 qgZ; X = G/S = 2 nodes), by the same
formula with q(n) = n + 4*ceil(n/256) (int8 + a fp32 scale per 256) and
q4(n) = n/2 + 4*ceil(n/256) (int4, two codes a byte):
  network  forward_gather   first micro-batch from the primary slices, int8:
                            7 * (q(1024) + 2*q(6272) + q(128))
                            = 7 * (1040 + 2*6372 + 132)               =  97412
  node     forward_gather   second micro-batch from the secondary copy (built by the
                            first), int8: 3 * (q(2048) + 2*q(12544) + q(256))
                            = 3 * (2080 + 2*12740 + 260)              =  83460
           backward_gather  k * the same                              = 166920
           grad_reduce      k * (S-1)*X * (q4(1024) + 2*q4(6272) + q4(128))
                            = 2 * 6 * (528 + 2*3236 + 68)             =  84816
  network  grad_reduce      k * (X-1) * 7068                          =  14136
Totals per link class: package 0, node 335196, network 111548 (nothing in the step:
the optimizer slice is the gradient shard is the primary slice).

A test of the test charges one bucket's gather to nobody (the final LayerNorm's
1024-element bucket in the node step_gather, 4*512*1/2 = 1024 bytes) and expects
the comparison to name that phase and link.
"""
from megatron_lbp.testing.multirank import rank_location_env, run_on_ranks
from megatron_lbp.testing.tiny_gpt import TinyGPTSpec, TrainSpec, train_hier

LBP = ["--hier-preset", "lbp", "--hier-param-group-size", "2", "--hier-grad-group-size", "4",
       "--hier-optim-group-size", "8"]
TRAIN = TrainSpec(steps=2, micro_batches=2, bucket_size=20000)

BY_HAND = {
    "forward_gather":  {"package": 438272, "node": 0, "network": 0},
    "backward_gather": {"package": 438272, "node": 0, "network": 0},
    "grad_reduce":     {"package": 0, "node": 657408, "network": 0},
    "step_reduce":     {"package": 0, "node": 0, "network": 54784},
    "step_gather":     {"package": 0, "node": 109568, "network": 54784},
}
TOTALS_BY_HAND = {"package": 876544, "node": 766976, "network": 109568}
ZEROPP = ["--hier-preset", "zeropp"]
ZEROPP_BY_HAND = {
    "forward_gather":  {"package": 0, "node": 83460, "network": 97412},
    "backward_gather": {"package": 0, "node": 166920, "network": 0},
    "grad_reduce":     {"package": 0, "node": 84816, "network": 14136},
    "step_reduce":     {"package": 0, "node": 0, "network": 0},
    "step_gather":     {"package": 0, "node": 0, "network": 0},
}
ZEROPP_TOTALS_BY_HAND = {"package": 0, "node": 335196, "network": 111548}
UNITS_BY_HAND = [8192, 49984, 49984, 128]


def ledger_of_two_steps(fault=None, argv=LBP):
    """Both steps' ledgers (and the unit sizes) of the run (lbp unless ``argv``) on this rank."""
    if fault == "one_bucket_uncharged":
        _uncharge_last_bucket_of_step_gather()
    res = train_hier(TinyGPTSpec(), TRAIN, argv)
    return {"units": res.extra["bucket_numels"],
            "steps": [{"by_phase": r["traffic_by_phase"], "by_class": r["traffic_bytes"]}
                      for r in res.step_reports]}


def _uncharge_last_bucket_of_step_gather():
    """Test-only fault: the node all-gather of the last bucket after the step is not counted."""
    from megatron_lbp.engine.comm import Collectives

    original = Collectives.all_gather

    def all_gather(self, out, inp, family, phase, async_op=False, unit=None, **how):
        if phase == "step_gather" and family == "grad_to_param" and unit == 3:
            record = self.ledger.record
            self.ledger.record = lambda *a, **k: None
            try:
                return original(self, out, inp, family, phase, async_op=async_op, unit=unit,
                                **how)
            finally:
                self.ledger.record = record
        return original(self, out, inp, family, phase, async_op=async_op, unit=unit, **how)

    Collectives.all_gather = all_gather


def table_differences(ranks, by_hand=BY_HAND, totals_by_hand=TOTALS_BY_HAND):
    """Lines naming each (rank, step, phase, link) whose ledger entry is not the hand-written one."""
    lines = []
    for r, got in enumerate(ranks):
        if got["units"] != UNITS_BY_HAND:
            lines.append(f"rank {r}: units of {got['units']} elements, by hand {UNITS_BY_HAND}")
        if len(got["steps"]) != TRAIN.steps:
            lines.append(f"rank {r}: {len(got['steps'])} step reports, {TRAIN.steps} steps run")
        for s, step in enumerate(got["steps"]):
            for phase, links in by_hand.items():
                for link, want in links.items():
                    have = step["by_phase"][phase][link]
                    if have != want:
                        lines.append(f"rank {r} step {s}: {phase} over {link}: ledger {have} "
                                     f"bytes, by hand {want}")
            if step["by_class"] != totals_by_hand:
                lines.append(f"rank {r} step {s}: per link class {step['by_class']}, "
                             f"by hand {totals_by_hand}")
    return lines


def test_lbp_ledger_equals_the_hand_written_table():
    ranks = run_on_ranks(ledger_of_two_steps, 8, rank_env=rank_location_env(4))
    problems = table_differences(ranks)
    assert not problems, "\n".join(problems)


def test_zeropp_ledger_equals_the_hand_written_table():
    ranks = run_on_ranks(ledger_of_two_steps, 8, None, ZEROPP, rank_env=rank_location_env(4),
                         timeout=600)   # the int4 and int8 codecs in torch on a shared CPU
    problems = table_differences(ranks, ZEROPP_BY_HAND, ZEROPP_TOTALS_BY_HAND)
    assert not problems, "\n".join(problems)


def test_a_bucket_left_off_the_ledger_fails_the_table():
    """Test of the test: one uncharged 1024-element bucket is named, phase and link."""
    ranks = run_on_ranks(ledger_of_two_steps, 8, "one_bucket_uncharged",
                         rank_env=rank_location_env(4))
    problems = table_differences(ranks)
    assert any("step_gather over node: ledger 108544 bytes, by hand 109568" in p
               for p in problems), problems
    assert all("over node" in p or "per link class" in p for p in problems), problems
