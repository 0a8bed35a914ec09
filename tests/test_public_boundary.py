"""The public boundary of every op (`_common.public`): boolean options are checked (a string or
a traced value is a TypeError naming the option), array-likes such as Flax `nnx.Param` are
accepted wherever an array is, and linear_cross_entropy's empty hidden dimension is named."""
from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fusedloss as jfl
from tests.helpers import assert_close
from tests.reference import jax_ref

N, V, D, K = 3, 11, 4, 2


def _inputs():
    keys = jax.random.split(jax.random.key(5), 5)
    x = jax.random.normal(keys[0], (N, V)) * 2
    y = jax.random.randint(keys[1], (N,), 0, V)
    lp, ids = jax.lax.top_k(jax.nn.log_softmax(jax.random.normal(keys[2], (N, V))), K)
    h = jax.random.normal(keys[3], (N, D))
    w = jax.random.normal(keys[4], (D, V))
    return x, y, ids, lp, h, w


# name -> (function, positional array arguments, required keyword options)
def _calls():
    x, y, ids, lp, h, w = _inputs()
    return {
        "cross_entropy": (jfl.cross_entropy, (x, y), {}),
        "kd_loss": (jfl.kd_loss, (x, ids, lp), {}),
        "distill_loss": (jfl.distill_loss, (x, y, ids, lp), {"alpha": 0.5}),
        "logsumexp": (jfl.logsumexp, (x,), {}),
        "entropy": (jfl.entropy, (x,), {}),
        "token_logprobs": (jfl.token_logprobs, (x, y), {}),
        "merge_partials": (jfl.merge_partials, (x, jnp.ones_like(x)), {}),
        "linear_cross_entropy": (jfl.linear_cross_entropy, (h, w, y), {}),
        "linear_token_logprobs": (jfl.linear_token_logprobs, (h, w, y), {}),
        "linear_kd_loss": (jfl.linear_kd_loss, (h, w, ids, lp), {}),
        "linear_distill_loss": (jfl.linear_distill_loss, (h, w, y, ids, lp), {"alpha": 0.5}),
    }


def _bool_options():
    for name, (fn, _, _) in _calls().items():
        for param in inspect.signature(fn).parameters.values():
            if param.annotation in ("bool", bool):
                yield name, param.name


BOOL_OPTIONS = list(_bool_options())


def test_every_public_function_is_covered():
    assert sorted(_calls()) == sorted(jfl.__all__), "a public function is missing from _calls"
    assert {o for _, o in BOOL_OPTIONS} >= {"return_lse", "return_entropy",
                                            "temperature_squared"}, BOOL_OPTIONS


@pytest.mark.parametrize("fn_name,option", BOOL_OPTIONS)
def test_bool_option_rejects_a_non_bool(fn_name, option):
    fn, arrays, kwargs = _calls()[fn_name]
    for bad in ("no", 1, None):
        with pytest.raises(TypeError, match=rf"{option}={bad!r} must be a bool"):
            fn(*arrays, **kwargs, **{option: bad}, implementation="xla")


@pytest.mark.parametrize("fn_name,option", BOOL_OPTIONS)
def test_bool_option_rejects_a_traced_value(fn_name, option):
    fn, arrays, kwargs = _calls()[fn_name]
    with pytest.raises(TypeError, match=rf"{option} must be a static Python bool, got a traced"):
        jax.jit(lambda flag: fn(*arrays, **kwargs, **{option: flag}, implementation="xla"))(True)


def test_linear_cross_entropy_empty_hidden_dimension_is_named():
    with pytest.raises(ValueError, match=r"hidden.shape=\(3, 0\): its last axis \(the hidden "
                                         r"dimension D\) must not be empty"):
        jfl.linear_cross_entropy(jnp.zeros((3, 0)), jnp.zeros((0, V)), jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match=r"logits.shape=\(3, 0\): its last axis \(the "
                                         r"vocabulary axis V\) must not be empty"):
        jfl.cross_entropy(jnp.zeros((3, 0)), jnp.zeros(3, jnp.int32))


@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_flax_nnx_linear_parameters_as_weight_and_bias(impl, interpreter):
    nnx = pytest.importorskip("flax.nnx")
    _, y, _, _, h, _ = _inputs()
    lin = nnx.Linear(D, V, rngs=nnx.Rngs(0))
    lin.bias[...] = jax.random.normal(jax.random.key(9), (V,))

    def loss(model):
        return jfl.linear_cross_entropy(h, model.kernel, y, bias=model.bias, implementation=impl)

    value, grads = nnx.value_and_grad(loss)(lin)
    w, b = np.asarray(lin.kernel[...], np.float64), np.asarray(lin.bias[...], np.float64)
    with jax_ref.x64():
        ref = jax.value_and_grad(lambda w, b: jax_ref.linear_cross_entropy(
            jnp.asarray(np.asarray(h), jnp.float64), w, y, b), (0, 1))
        want, (dw, db) = ref(jnp.asarray(w), jnp.asarray(b))
    assert_close(value, want, rtol=2e-5, what="loss with nnx.Param weight and bias")
    assert_close(grads.kernel[...], dw, rtol=2e-5, atol=2e-6, what="d loss / d kernel")
    assert_close(grads.bias[...], db, rtol=2e-5, atol=2e-6, what="d loss / d bias")


@pytest.mark.parametrize("fn_name", sorted(_calls()))
def test_nnx_variables_as_every_array_argument(fn_name):
    nnx = pytest.importorskip("flax.nnx")
    fn, arrays, kwargs = _calls()[fn_name]
    want = fn(*arrays, **kwargs, **({} if fn_name == "merge_partials"
                                     else {"implementation": "xla"}))
    wrapped = [nnx.Variable(a) for a in arrays]
    got = fn(*wrapped, **kwargs, **({} if fn_name == "merge_partials"
                                    else {"implementation": "xla"}))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(g, w, rtol=0.0, what=f"{fn_name} of nnx.Variable inputs vs arrays")


# ----------------------------------------------------------------------------- check_labels
def _label_ops(labels):
    """name -> loss of (logits [2, 3, V] or hidden [2, 3, D]) with `labels` [2, 3] and
    check_labels=True, and the ignore_index it takes (None: every label must be in range)."""
    teacher = jax.random.normal(jax.random.key(3), (2, 3, V), jnp.float32)
    lp, ids = jax.lax.top_k(jax.nn.log_softmax(teacher), K)
    w = jax.random.normal(jax.random.key(4), (D, V), jnp.float32)
    return {
        "cross_entropy": (lambda x: jfl.cross_entropy(
            x, labels, check_labels=True, implementation="xla"), -100),
        "token_logprobs": (lambda x: jfl.token_logprobs(
            x, labels, check_labels=True, implementation="xla").sum(), None),
        "distill_loss": (lambda x: jfl.distill_loss(
            x, labels, ids, lp, alpha=0.5, check_labels=True, implementation="xla"), -100),
        "linear_cross_entropy": (lambda h: jfl.linear_cross_entropy(
            h[..., :D], w, labels, check_labels=True, implementation="xla"), -100),
    }


LABEL_OPS = ["cross_entropy", "token_logprobs", "distill_loss", "linear_cross_entropy"]


@pytest.mark.parametrize("op", LABEL_OPS)
@pytest.mark.parametrize("bad", [-1, V, 2**40])
def test_check_labels_names_the_first_out_of_range_label(op, bad):
    x = jax.random.normal(jax.random.key(0), (2, 3, V))
    dtype = jnp.int64 if bad > 2**31 else jnp.int32
    with jax.enable_x64(dtype == jnp.int64):
        labels = jnp.array([[1, 2, 3], [4, 5, 6]], dtype).at[1, 1].set(bad).at[1, 2].set(bad)
        fn, ignore = _label_ops(labels)[op]
        ignored = "" if ignore is None else f" and is not ignore_index={ignore}"
        message = (rf"labels\[1, 1\]={bad} lies outside \[0, {V}\){ignored}: 2 such label\(s\) "
                   rf"\(found by check_labels=True\)")
        with pytest.raises(ValueError, match=message):
            jax.block_until_ready(fn(x))
        with pytest.raises(Exception, match=message):  # jit: JAX's runtime error carries it
            jax.block_until_ready(jax.jit(jax.value_and_grad(fn))(x))


@pytest.mark.parametrize("op", LABEL_OPS)
def test_check_labels_passes_valid_and_ignored_labels(op):
    x = jax.random.normal(jax.random.key(0), (2, 3, V))
    labels = jnp.array([[0, V - 1, 3], [4, 5, 6]])
    fn, ignore = _label_ops(labels)[op]
    if ignore is not None:
        labels = labels.at[0, 2].set(ignore)
        fn, _ = _label_ops(labels)[op]
    value, grad = jax.jit(jax.value_and_grad(fn))(x)
    assert np.isfinite(float(value)) and bool(jnp.isfinite(grad).all()), (
        f"{op}: valid labels {labels.tolist()} gave loss {value}")


def test_vocab_axis_outside_shard_map_is_an_error():
    x, y, ids, lp, h, w = _inputs()
    for call in (lambda: jfl.cross_entropy(x, y, vocab_axis="model"),
                 lambda: jfl.kd_loss(x, ids, lp, vocab_axis="model"),
                 lambda: jfl.logsumexp(x, vocab_axis=("data", "model")),
                 lambda: jfl.linear_cross_entropy(h, w, y, vocab_axis="model")):
        with pytest.raises(ValueError, match=r"vocab_axis=.*names no mesh axis bound here: "
                                             r"vocab_axis is for use inside jax.shard_map"):
            call()
