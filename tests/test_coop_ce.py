"""The co-operative cross-entropy prototype (benchmarks/coop_ce.py, issue 11 item 1).

On the CPU the interpreter runs programs one after another, so only P=1 can complete a row
normally; P=2 and P=3 exercise the watchdog and, through the member that arrives last, the
exchange and merge of partials. Both variants: slices in registers and REREAD (slices walked
twice in tiles). The sm_90 compile checks what the synchronisation compiles to and the
REREAD variant's registers and cache hints. The GPU checks are
`python -m benchmarks.coop_ce --check`.
"""
import json
import subprocess
import sys

import pytest
import torch

from benchmarks import coop_ce, coop_ce_measure
from tests.helpers import compiler_env


def _check_p1(x, y, got, info, **opts):
    assert info["timeouts"] == 0, info
    errors = coop_ce.compare(got, coop_ce.references(x, y, **opts), y, x.shape[1])
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("n, vocab, dtype, smoothing, z_loss, groups", [
    (7, 97, torch.float32, 0.0, 0.0, 2),  # several rows per group: the prefetch path
    (1, 300, torch.bfloat16, 0.0, 0.0, None),
    (6, 300, torch.bfloat16, 0.1, 1e-3, 3),
    (5, 40, torch.float32, 0.0, 0.0, 5),  # one row per group
])
def test_p1_matches_references(interpreter, n, vocab, dtype, smoothing, z_loss, groups):
    x, y = coop_ce.make_inputs(n, vocab, dtype, "cpu", seed=n + vocab)
    info = {}
    got = coop_ce.coop_ce_fwd_grad(x, y, 1, groups=groups, smoothing=smoothing, z_loss=z_loss,
                                   info=info)
    _check_p1(x, y, got, info, smoothing=smoothing, z_loss=z_loss)


@pytest.mark.parametrize("n, vocab, dtype, smoothing, z_loss, groups, block, evict, prefetch", [
    (7, 97, torch.float32, 0.0, 0.0, 2, 32, True, True),  # 4 tiles, the last 1 column wide
    (6, 300, torch.bfloat16, 0.1, 1e-3, 3, 64, True, False),  # 5 tiles, smoothing, z-loss
    (1, 300, torch.bfloat16, 0.0, 0.0, None, 512, False, True),  # one tile wider than V
    (5, 40, torch.float32, 0.0, 0.0, 5, 16, False, False),  # 3 tiles, one row per group
    (3, 129, torch.float32, 0.05, 0.0, 1, 16, True, True),  # 9 tiles, 3 rows in one group
])
def test_reread_p1_matches_references(interpreter, n, vocab, dtype, smoothing, z_loss, groups,
                                      block, evict, prefetch):
    x, y = coop_ce.make_inputs(n, vocab, dtype, "cpu", seed=n + vocab + block)
    cfg = coop_ce.Reread(1 << 16, block, 4, evict=evict, prefetch=prefetch)
    assert cfg.p(vocab) == 1
    info = {}
    got = coop_ce.coop_reread_fwd_grad(x, y, cfg, groups=groups, smoothing=smoothing,
                                       z_loss=z_loss, info=info)
    _check_p1(x, y, got, info, smoothing=smoothing, z_loss=z_loss)


@pytest.mark.parametrize("p, block, prefetch", [
    (2, None, True),  # slices in registers
    (2, 16, False),  # REREAD: member 0 two full tiles; member 1 one ragged, one empty
    (3, 8, True),  # REREAD: three partials merged (BLOCK_P = 4: one padding lane)
])
def test_watchdog_and_merge(interpreter, p, block, prefetch):
    """2 groups, 4 rows: the members of a group run one after another; all but the last wait
    max_spin polls and give up (NaN loss and lse, NaN on their columns, P - 1 timeouts per
    row); the last arrives to find every partial published and writes its columns of the
    correct gradient."""
    n, vocab = 4, 40  # rows 1 ignored, 3 labelled out of range (make_inputs)
    x, y = coop_ce.make_inputs(n, vocab, torch.float32, "cpu", seed=3)
    info = {}
    loss, lse, grad = coop_ce.coop_ce_fwd_grad(x, y, p, 4, block=block, prefetch=prefetch,
                                               groups=2, max_spin=2, info=info)
    assert info["timeouts"] == n * (p - 1), info
    assert lse.isnan().all() and loss[[0, 2, 3]].isnan().all() and loss[1] == 0, (loss, lse)
    last = (p - 1) * coop_ce.slice_cols(vocab, p)
    assert grad[:, :last].isnan().all()
    _, _, ref = coop_ce.references(x, y)["fp32"]
    good = [0, 1, 2]
    torch.testing.assert_close(grad[good, last:], ref[good, last:], atol=1e-6, rtol=1e-4)
    assert grad[3].isnan().all()


def test_parse_ncu_csv():
    """Metrics per kernel from `ncu --csv` (values with thousands separators, launches of the
    same kernel summed, percentages kept, the application's own output skipped)."""
    text = "\n".join([
        "==PROF== Connected to process 1", "app output",
        '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
        '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
        '"Metric Value"',
        '"0","1","python","h","ce_fwd_kernel","1","7","(128, 1, 1)","(8192, 1, 1)","0","9.0",'
        '"Command line profiler metrics","dram__bytes_read.sum","byte","2,101,346,304"',
        '"0","1","python","h","ce_fwd_kernel","1","7","(128, 1, 1)","(8192, 1, 1)","0","9.0",'
        '"Command line profiler metrics","lts__t_sector_hit_rate.pct","%","41.5"',
        '"1","1","python","h","coop_ce_kernel","1","7","(128, 1, 1)","(528, 1, 1)","0","9.0",'
        '"Command line profiler metrics","dram__bytes_read.sum","byte","1,000"',
        '"2","1","python","h","coop_ce_kernel","1","7","(128, 1, 1)","(528, 1, 1)","0","9.0",'
        '"Command line profiler metrics","dram__bytes_read.sum","byte","24"'])
    got = coop_ce_measure.parse_ncu_csv(text)
    assert got == {"ce_fwd_kernel": {"dram__bytes_read.sum": 2101346304.0,
                                     "lts__t_sector_hit_rate.pct": 41.5},
                   "coop_ce_kernel": {"dram__bytes_read.sum": 1024.0}}, got
    assert coop_ce_measure.parse_ncu_csv("==ERROR== ERR_NVGPUCTRPERM") == {}


def test_sm90_synchronisation_compiles_as_intended(tmp_path):
    """Both variants, bf16 and fp32: the arrival is one acq_rel atomic add at gpu scope, the
    spin loop is short and polls with an acquire load at gpu scope, partials are read from L2
    (.cg), logits move in 16-byte vectors and nothing spills. Register variant: the next
    row's slice is loaded between arrival and spin. REREAD: loads between arrival and spin
    only with prefetch; with eviction hints the statistics pass loads evict_last and the
    gradient pass loads and stores evict_first; at least 2 CTAs fit on an SM, 5 at up to 8
    values per thread (the point: the register variant fits 1)."""
    env = compiler_env(TRITON_CACHE_DIR=str(tmp_path / "triton-cache"))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.coop_ce", "--ptx"], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = json.loads(proc.stdout)
    assert len(reports) == len(coop_ce_measure.PTX_CONFIGS) + len(
        coop_ce_measure.PTX_REREAD_CONFIGS)
    for r in reports:
        what = {k: r.get(k) for k in ("dtype", "p", "num_warps", "vocab", "block", "evict",
                                      "prefetch", "registers", "occupancy")}
        assert "atom.global.gpu.acq_rel.add.u32" in r["sync_ops"], (what, r["sync_ops"])
        assert len(r["spin_loops"]) == 1, (what, r["spin_loops"])
        spin = r["spin_loops"][0]
        assert spin["sync"] in (["ld.global.gpu.acquire.b32"],
                                ["atom.global.gpu.acquire.add.u32"]), (what, spin)
        assert spin["global_loads"] in ([], spin["sync"]), (what, spin)  # nothing else polled
        assert "ld.global.cg.b32" in r["global_loads"], (what, r["global_loads"])
        assert r["registers"] is not None, (what, r["ptxas"])
        prefetch = r["loads_between_arrival_and_spin"]
        vector = {o for o in r["global_loads"] if ".v4." in o}
        if r.get("block") is None:
            assert prefetch and set(prefetch) == {"ld.global.v4.b32"}, (what, prefetch)
            if r["dtype"] == "bf16":
                assert r["spill_bytes"] == 0, (what, r["ptxas"])
            continue
        assert r["spill_bytes"] == 0, (what, r["ptxas"])
        hints = ({"ld.global.L1::evict_last.L2::cache_hint.v4.b32",
                  "ld.global.L1::evict_first.L2::cache_hint.v4.b32"} if r["evict"] else
                 {"ld.global.v4.b32"})
        assert vector == hints, (what, r["global_loads"])
        stores = {o for o in r["global_stores"] if ".v4." in o}
        assert stores == {"st.global.L1::evict_first.L2::cache_hint.v4.b32" if r["evict"]
                          else "st.global.v4.b32"}, (what, r["global_stores"])
        first = "ld.global.L1::evict_last.L2::cache_hint.v4.b32" if r["evict"] else \
            "ld.global.v4.b32"
        assert (set(prefetch) == {first}) if r["prefetch"] else not prefetch, (what, prefetch)
        assert r["occupancy"] >= (5 if r["block"] // (32 * r["num_warps"]) <= 8 else 2), what
