"""The co-operative cross-entropy prototype (benchmarks/coop_ce.py, issue 11 item 1).

On the CPU the interpreter runs programs one after another, so only P=1 can complete a row
normally; P=2 exercises the watchdog and, through the member that arrives last, the exchange
and merge of partials. The sm_90 compile checks what the synchronisation compiles to. The GPU
checks are `python -m benchmarks.coop_ce --check`.
"""
import json
import subprocess
import sys

import pytest
import torch

from benchmarks import coop_ce
from tests.helpers import compiler_env


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
    assert info["timeouts"] == 0, info
    refs = coop_ce.references(x, y, smoothing=smoothing, z_loss=z_loss)
    errors = coop_ce.compare(got, refs, y, vocab)
    assert not errors, "\n".join(errors)


def test_watchdog_and_merge_with_two_members(interpreter):
    """P=2, 2 groups, 4 rows: member 0 of a group runs first, waits max_spin polls, gives up
    (NaN loss and lse, NaN on its columns, one timeout per row); member 1 arrives second, finds
    both partials published and writes its columns of the correct gradient."""
    n, vocab = 4, 40  # rows 1 ignored, 3 labelled out of range (make_inputs)
    x, y = coop_ce.make_inputs(n, vocab, torch.float32, "cpu", seed=3)
    info = {}
    loss, lse, grad = coop_ce.coop_ce_fwd_grad(x, y, 2, groups=2, max_spin=2, info=info)
    assert info["timeouts"] == n, info
    assert lse.isnan().all() and loss[[0, 2, 3]].isnan().all() and loss[1] == 0, (loss, lse)
    split = coop_ce.slice_cols(vocab, 2)
    assert grad[:, :split].isnan().all()
    _, _, ref = coop_ce.references(x, y)["fp32"]
    good = [0, 1, 2]
    torch.testing.assert_close(grad[good, split:], ref[good, split:], atol=1e-6, rtol=1e-4)
    assert grad[3].isnan().all()


def test_sm90_synchronisation_compiles_as_intended(tmp_path):
    """For every P that fits at 32 warps, bf16 and fp32: the arrival is one acq_rel atomic
    add at gpu scope, the spin loop is short and polls with an acquire load at gpu scope, the
    next row's slice is loaded (16-byte vector loads) between arrival and spin, partials are
    read from L2 (.cg), and bf16 slices stay in registers (no spills)."""
    env = compiler_env(TRITON_CACHE_DIR=str(tmp_path / "triton-cache"))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.coop_ce", "--ptx"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = json.loads(proc.stdout)
    assert len(reports) == len(coop_ce.PTX_CONFIGS)
    for r in reports:
        what = f"{r['dtype']} P={r['p']} warps={r['num_warps']} V={r['vocab']}"
        assert "atom.global.gpu.acq_rel.add.u32" in r["sync_ops"], (what, r["sync_ops"])
        assert len(r["spin_loops"]) == 1, (what, r["spin_loops"])
        spin = r["spin_loops"][0]
        assert spin["sync"] in (["ld.global.gpu.acquire.b32"],
                                ["atom.global.gpu.acquire.add.u32"]), (what, spin)
        assert spin["global_loads"] in ([], spin["sync"]), (what, spin)  # nothing else polled
        prefetch = r["loads_between_arrival_and_spin"]
        assert prefetch and set(prefetch) == {"ld.global.v4.b32"}, (what, prefetch)
        assert "ld.global.cg.b32" in r["global_loads"], (what, r["global_loads"])
        assert r["registers"] is not None, (what, r["ptxas"])
        if r["dtype"] == "bf16":
            assert r["spill_bytes"] == 0, (what, r["ptxas"])
