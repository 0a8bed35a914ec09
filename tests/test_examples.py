"""Smoke tests of the examples: a few CPU steps with tiny settings, in-process (the `--mesh`
runs: in a subprocess that sees 4 CPU devices).

Each run trains a tokenizer on ~0.3 MB of the standard library (cached for the module), a
one-block model and a 512-token vocabulary for a handful of steps.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

for _name in ("flax", "optax", "tokenizers", "tqdm", "matplotlib"):
    pytest.importorskip(_name)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jax_fusedloss  # noqa: E402
from examples import _common, _data, _mesh, distill, rl, train_lm  # noqa: E402

TINY = ["--vocab", "512", "--text-mb", "0.3", "--seq-len", "64", "--batch", "8",
        "--d-model", "64", "--layers", "1", "--heads", "2", "--lr", "1e-2", "--no-progress"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One tokenizer cache for every test of the module."""
    return tmp_path_factory.mktemp("tokenizer_cache")


def _tiny(out, cache_dir, *extra: str) -> list[str]:
    return TINY + ["--out", str(out), "--cache-dir", str(cache_dir), *extra]


def _optax_masked_mean(logits: jax.Array, labels: jax.Array) -> jax.Array:
    mask = labels != _data.IGNORE_INDEX
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(mask, labels, 0))
    return jnp.sum(jnp.where(mask, per_token, 0.0)) / jnp.sum(mask)


def test_pack_pads_document_tails_with_ignored_labels():
    x, y = _data.pack([[1, 2, 3, 4, 5], [6, 7]], seq_len=4, eos_id=0, pad_id=9)
    # [1 2 3 4 5 eos] -> (1 2 3 4 | 2 3 4 5), (5 pad pad pad | eos -100 -100 -100); [6 7 eos] -> ...
    np.testing.assert_array_equal(x, [[1, 2, 3, 4], [5, 9, 9, 9], [6, 7, 9, 9]])
    np.testing.assert_array_equal(y, [[2, 3, 4, 5], [0, -100, -100, -100], [7, 0, -100, -100]])


def test_first_step_loss_matches_optax(tmp_path, cache_dir):
    args = train_lm.parse_args(_tiny(tmp_path, cache_dir))
    data = train_lm.load_data(args)
    model = _common.TransformerLM(train_lm.model_config(args, data.vocab_size),
                                  rngs=nnx.Rngs(args.seed))
    x, y = next(_data.batches(data.train_inputs, data.train_labels, args.batch, args.seed))
    padded = np.flatnonzero((data.train_labels == _data.IGNORE_INDEX).any(axis=1))
    x, y = np.concatenate([x, data.train_inputs[padded[:2]]]), np.concatenate(
        [y, data.train_labels[padded[:2]]])
    assert (y == _data.IGNORE_INDEX).any(), "the batch must contain padding"
    logits = model(x)
    fused = jax_fusedloss.cross_entropy(logits, y, ignore_index=-100, z_loss=0.0)
    np.testing.assert_allclose(fused, _optax_masked_mean(logits, y), rtol=1e-5)
    for z_loss in (0.0, 1e-4):  # the examples' A/B pair, with and without the z-loss
        np.testing.assert_allclose(
            _common.lm_loss(logits, y, impl="fused", z_loss=z_loss),
            _common.lm_loss(logits, y, impl="optax", z_loss=z_loss), rtol=1e-5)


def test_train_lm_loss_falls_and_writes_outputs(tmp_path, cache_dir):
    metrics = train_lm.main(_tiny(tmp_path, cache_dir, "--steps", "10"))
    assert metrics["loss_impl"] == "fused"
    assert metrics["final_loss"] < metrics["first_loss"] - 0.3
    assert metrics["final_val_loss"] < metrics["first_val_loss"] - 0.3
    assert metrics["data"]["padding_fraction"] > 0
    check = metrics["first_step_check"]
    np.testing.assert_allclose(check["fused"], check["optax"], rtol=1e-5)
    np.testing.assert_allclose(metrics["first_loss"], check["fused"], rtol=1e-5)
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert {"first_loss", "final_loss", "final_val_loss", "loss_impl"} <= saved.keys()
    assert (tmp_path / "loss_curves.png").stat().st_size > 0


def test_train_lm_ab_flag_same_first_loss(tmp_path, cache_dir):
    fused = train_lm.main(_tiny(tmp_path / "fused", cache_dir, "--steps", "3"))
    optax_run = train_lm.main(_tiny(tmp_path / "optax", cache_dir, "--steps", "3",
                                    "--loss", "optax"))
    assert optax_run["loss_impl"] == "optax"
    np.testing.assert_allclose(optax_run["first_loss"], fused["first_loss"], rtol=1e-5)
    np.testing.assert_allclose(optax_run["train_losses"], fused["train_losses"], rtol=1e-3)


def test_train_lm_fused_linear_same_objective(tmp_path, cache_dir):
    """--loss fused-linear (LM head + loss in linear_cross_entropy) starts from the same loss
    as the logits losses and reports its memory (the compiled loss + gradient's temporaries;
    the device peak is n/a on the CPU)."""
    metrics = train_lm.main(_tiny(tmp_path, cache_dir, "--steps", "3", "--loss", "fused-linear"))
    check = metrics["first_step_check"]
    assert set(check) == {"fused", "optax", "fused-linear"}
    np.testing.assert_allclose(check["fused-linear"], check["fused"], rtol=1e-5)
    np.testing.assert_allclose(metrics["first_loss"], check["fused-linear"], rtol=1e-5)
    assert metrics["loss_impl"] == "fused-linear" and metrics["tokens_per_s"] > 0
    assert metrics["loss_grad_temp_bytes"] > 0
    assert metrics["peak_memory_bytes"] is None or metrics["peak_memory_bytes"] > 0
    assert metrics["train_losses"][-1] < metrics["train_losses"][0]


@pytest.mark.skipif(not hasattr(jax_fusedloss, "distill_loss"),
                    reason="jax_fusedloss.distill_loss is not available")
def test_progress_bar_counts_the_step_its_numbers_are_from(tmp_path, cache_dir, capsys):
    argv = [a for a in _tiny(tmp_path, cache_dir, "--steps", "4") if a != "--no-progress"]
    train_lm.main(argv)
    bar = capsys.readouterr().err.replace("\r", "\n").splitlines()
    last = [line for line in bar if "4/4" in line][-1]
    assert "val=" in last and "@4" in last and "loss=" in last, bar
    for line in bar:  # a validation loss is shown with the step count it was measured at
        if "@" in line and "/4" in line:
            done = line.split("/4")[0].split()[-1]
            assert line.split("@")[1].startswith(("0", done)), line


def test_distill_smoke(tmp_path, cache_dir, monkeypatch):
    labels = []
    train = _common.train

    def spy(*args, **kwargs):
        labels.append((kwargs.get("desc"), kwargs.get("loss_label", "loss")))
        return train(*args, **kwargs)

    monkeypatch.setattr(_common, "train", spy)
    metrics = distill.main(_tiny(tmp_path, cache_dir, "--teacher-steps", "10", "--steps", "6",
                                 "--teacher-d-model", "64", "--d-model", "32", "--k", "8",
                                 "--tail", "--divergence", "jsd"))
    for name in ("distilled", "distilled-logits", "baseline"):
        student = metrics["students"][name]
        assert student["final_loss"] < student["first_loss"]
        assert student["final_val_loss"] < student["first_val_loss"]
    assert np.isfinite([metrics["val_loss_distilled"], metrics["val_loss_baseline"]]).all()
    first = {name: s["first_val_loss"] for name, s in metrics["students"].items()}
    assert first["distilled"] == first["baseline"], "students must start from one init"
    assert (tmp_path / "metrics.json").exists() and (tmp_path / "loss_curves.png").exists()
    assert labels == [("teacher", "loss"), ("student (distilled)", "0.5*ce+0.5*jsd+tail"),
                      ("student (distilled-logits)", "0.5*ce+0.5*jsd+tail (logits)"),
                      ("student (baseline)", "ce")], labels
    fused, logits = (metrics["students"][n] for n in ("distilled", "distilled-logits"))
    assert abs(fused["first_val_loss"] - logits["first_val_loss"]) < 1e-3
    assert fused["loss_grad_temp_bytes"] > 0 and logits["loss_grad_temp_bytes"] > 0


def test_mesh_flag_is_validated(tmp_path, cache_dir, capsys):
    n = jax.device_count()
    args = train_lm.parse_args(_tiny(tmp_path, cache_dir, "--mesh", f"data={n}"))
    assert dict(args.mesh.shape) == {"data": n, "model": 1}
    for mesh, message in ((f"data={n + 1}", f"must multiply to {n}"),
                          ("tensor=1", "axis 'tensor' is unknown"),
                          ("data2", "must be NAME=SIZE"),
                          ("data=1,data=1", "given twice"),
                          ("model=0", "at least 1")):
        with pytest.raises(SystemExit):
            train_lm.parse_args(_tiny(tmp_path, cache_dir, "--mesh", mesh))
        assert message in capsys.readouterr().err, mesh
    sizes = types.SimpleNamespace(shape={"data": 2, "model": 2})
    with pytest.raises(ValueError, match="--batch 9 is not a multiple of the mesh's data=2"):
        _mesh.check_sizes(sizes, batch=9, vocab=512)
    with pytest.raises(ValueError, match="vocabulary of 511 tokens is not a multiple"):
        _mesh.check_sizes(sizes, batch=8, vocab=511)


def _run_on_4_cpus(out, cache_dir, *flags: str) -> tuple[dict, str]:
    """Runs train_lm.py in a fresh process that sees 4 CPU devices; returns its metrics and
    stdout. (The device count is fixed when jax starts, hence the subprocess.)"""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "examples.train_lm",
                           *_tiny(out, cache_dir, "--steps", "4", *flags)],
                          cwd=Path(__file__).resolve().parents[1], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "metrics.json").read_text()), proc.stdout


# No "--loss optax" run: every run here already evaluates optax's loss on its mesh (the
# first-step check below), and training through optax's loss runs none of the library.
@pytest.mark.parametrize("mesh, loss, logits_spec", [
    ("data=2,model=2", "fused", "P('data', None, 'model')"),
    ("data=4", "fused", "P('data',)"),  # the size-1 "model" axis drops out of the spec
    ("data=2,model=2", "fused-linear", None),  # no logits: hidden over data, table over model
])
def test_train_lm_on_a_mesh_of_4_cpu_devices(tmp_path, cache_dir, mesh, loss, logits_spec):
    metrics, stdout = _run_on_4_cpus(tmp_path, cache_dir, "--mesh", mesh, "--loss", loss)
    sizes = {"data": 1, "model": 1} | {k: int(v) for k, v in
                                       (item.split("=") for item in mesh.split(","))}
    assert metrics["mesh"] == sizes and metrics["runtime"]["device_count"] == 4
    assert f"mesh: data={sizes['data']} x model={sizes['model']} (4 cpu devices)" in stdout
    # The loss sees the logits split as intended, and nothing in the compiled loss + gradient
    # gathers them (no collective as large as one device's share of the logits).
    assert metrics["logits_spec"] == logits_spec
    assert metrics["logits_collectives"] == [], metrics["logits_collectives"]
    assert metrics["hlo_collectives"] > 0, "the HLO scan found no collective at all"
    losses = metrics["train_losses"]
    assert np.isfinite(losses).all() and np.isfinite(metrics["final_val_loss"]), losses
    assert abs(losses[0] - np.log(metrics["data"]["vocab_size"])) < 0.5, losses[0]
    assert losses[-1] < losses[0] and metrics["final_val_loss"] < metrics["first_val_loss"]
    assert metrics["loss_impl"] == loss and metrics["tokens_per_s"] > 0
    check = metrics["first_step_check"]  # fused and optax on the same mesh, batch and init
    np.testing.assert_allclose(check["fused"], check["optax"], rtol=1e-5)
    np.testing.assert_allclose(metrics["first_loss"], check[loss], rtol=1e-5)


def test_rl_smoke(tmp_path, cache_dir):
    """A few supervised and GRPO steps: finite numbers, every curve written, and the fused
    log-probs equal log_softmax of the materialised logits."""
    metrics = rl.main(_tiny(tmp_path, cache_dir, "--sft-steps", "4", "--steps", "3",
                            "--prompts", "2", "--group", "2", "--gen-len", "4"))
    hist = metrics["history"]
    assert all(len(v) == 3 and np.isfinite(v).all() for v in hist.values()), hist
    assert metrics["logprob_check_max_abs"] < 1e-4
    assert all(0.0 <= r <= 1.0 for r in hist["reward"])
    assert all(e > 0 for e in hist["entropy"]) and all(lp < 0 for lp in hist["logprob"])
    assert (tmp_path / "metrics.json").exists() and (tmp_path / "rl_curves.png").exists()
