"""shard_map edge cases on 4 CPU devices, each in a subprocess (the device count is fixed when
jax starts, and a deadlocked collective would hang the test process):

- the interpreted kernels inside shard_map over tokens, followed by a psum, with per-device
  inputs of 128 KiB: this deadlocked while the interpreter's host callback was a
  pure_callback (its arguments are first put on CPU device 0, whose thread waited at the psum);
- `vocab_axis` naming a mesh axis the vocabulary is not split over: a clear ValueError
  instead of a loss larger by log(axis size) and a broken gradient.
"""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU4 = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}

PRELUDE = """
import os
os.environ["TRITON_INTERPRET"] = "1"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import jax_fusedloss as jfl
"""

TOKENS_PSUM = PRELUDE + """
n, v = 32, 4000
mesh = Mesh(jax.devices(), ("d",))
x = jax.random.normal(jax.random.key(0), (n, v))
y = jax.random.randint(jax.random.key(1), (n,), 0, v)

def f(x, y):
    def local(x, y):
        loss = jfl.cross_entropy(x, y, reduction="sum", implementation="triton")
        return jax.lax.psum(loss, "d")
    return jax.shard_map(local, mesh=mesh, in_specs=(P("d", None), P("d")), out_specs=P())(x, y)

loss, grad = jax.jit(jax.value_and_grad(f))(x, y)
x64 = np.asarray(x, np.float64)
lse = np.log(np.exp(x64 - x64.max(1, keepdims=True)).sum(1)) + x64.max(1)
want = float(np.sum(lse - x64[np.arange(n), np.asarray(y)]))
p = np.exp(x64 - lse[:, None])
p[np.arange(n), np.asarray(y)] -= 1
print("LOSS", float(loss), want)
print("GRADERR", float(np.abs(np.asarray(grad, np.float64) - p).max()))
"""


def _run(script: str, *args: str, timeout: int = 120) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **CPU4)
    try:
        proc = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"no result within {timeout} s (deadlock?): "
                             f"{(e.stdout or b'')[-2000:]!r}") from e
    out = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0, out
    return proc.stdout


def test_interpreted_kernels_in_shard_map_with_psum_finish(interpreter):
    out = _run(TOKENS_PSUM)
    got, want = (float(t) for t in out.split("LOSS")[1].split()[:2])
    assert abs(got - want) <= 1e-4 * abs(want), f"loss {got} != float64 reference {want}"
    err = float(out.split("GRADERR")[1].split()[0])
    assert err < 1e-5, f"gradient max abs error {err} against the float64 reference"


WRONG_AXIS = PRELUDE + """
import sys
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
n, v, d = 8, 12, 3
x = jax.random.normal(jax.random.key(0), (n, v))
y = jax.random.randint(jax.random.key(1), (n,), 0, v)
lp, ids = jax.lax.top_k(jax.nn.log_softmax(x), 2)
h = jax.random.normal(jax.random.key(2), (n, d))
w = jax.random.normal(jax.random.key(3), (d, v))
ops = lambda impl: {
    "cross_entropy": lambda x, y, ids, lp: jfl.cross_entropy(
        x, y, reduction="sum", implementation=impl, vocab_axis="model"),
    "token_logprobs": lambda x, y, ids, lp: jfl.token_logprobs(
        x, y, implementation=impl, vocab_axis="model").sum(),
    "logsumexp": lambda x, y, ids, lp: jfl.logsumexp(
        x, implementation=impl, vocab_axis="model").sum(),
    "entropy": lambda x, y, ids, lp: jfl.entropy(
        x, implementation=impl, vocab_axis="model").sum(),
    "kd_loss": lambda x, y, ids, lp: jfl.kd_loss(
        x, ids, lp, reduction="sum", implementation=impl, vocab_axis="model"),
    "distill_loss": lambda x, y, ids, lp: jfl.distill_loss(
        x, y, ids, lp, alpha=0.5, reduction="sum", implementation=impl, vocab_axis="model"),
}

def case(name, impl):
    if name == "linear_cross_entropy":
        args, specs = (h, w, y), (P("data", None), P(None, None), P("data"))
        op = lambda h, w, y: jfl.linear_cross_entropy(h, w, y, reduction="sum",
                                                      implementation=impl, vocab_axis="model")
    else:
        args = (x, y, ids, lp)
        specs = (P("data", None), P("data"), P("data", None), P("data", None))
        op = ops(impl)[name]

    def f(*a):
        return jax.shard_map(lambda *a: jax.lax.psum(op(*a), "data"), mesh=mesh,
                             in_specs=specs, out_specs=P(), check_vma=True)(*a)

    try:
        jax.jit(jax.value_and_grad(f))(*args)
        return "NO ERROR"
    except ValueError as e:
        return "VALUEERROR " + " ".join(str(e).split())
    except Exception as e:  # the case fails, the others still run
        return f"{type(e).__name__} " + " ".join(str(e).split())[:2000]

for name_impl in sys.argv[1:]:  # each case a fresh jit; a trace-time error leaves no state
    name, impl = name_impl.split(":")
    print("CASE", name, impl, case(name, impl), flush=True)
"""

OPS = ["cross_entropy", "token_logprobs", "logsumexp", "entropy", "kd_loss", "distill_loss",
       "linear_cross_entropy"]


IMPLS = ["xla", "triton"]


@pytest.fixture(scope="module")
def wrong_axis_results():
    """{(op, impl): the WRONG_AXIS line} for every case, from one child process (one jax
    start, not one a case)."""
    out = _run(WRONG_AXIS, *(f"{op}:{impl}" for op in OPS for impl in IMPLS), timeout=300)
    lines = [ln.split(" ", 3) for ln in out.splitlines() if ln.startswith("CASE ")]
    return {(op, impl): rest for _, op, impl, rest in lines}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", OPS)
def test_vocab_axis_the_logits_are_not_split_over_is_an_error(op, impl, interpreter,
                                                              wrong_axis_results):
    out = wrong_axis_results.get((op, impl), "no result")
    assert "VALUEERROR" in out and "vocab_axis=" in out and "'model'" in out, (
        f"{op} ({impl}) with logits not split over vocab_axis='model' should raise a ValueError "
        f"naming vocab_axis, got:\n{out}")


VOCAB_SPLIT = PRELUDE + """
import sys
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
n, v = 8, 12
x = jax.random.normal(jax.random.key(0), (n, v)) * 2
lp, ids = jax.lax.top_k(jax.nn.log_softmax(jax.random.normal(jax.random.key(1), (n, v))), 3)
t, check_vma = float(sys.argv[1]), sys.argv[2] == "1"

def local(x, ids, lp):
    loss = jfl.kd_loss(x, ids, lp, temperature=t, reduction="sum", implementation="xla",
                       vocab_axis="model")
    return loss[None]  # no psum: its transpose differs under check_vma=False

def f(x):
    return jax.shard_map(local, mesh=mesh, in_specs=(P("data", "model"), P("data", None),
                                                     P("data", None)),
                         out_specs=P("data"), check_vma=check_vma)(x, ids, lp).sum()

try:
    loss, grad = jax.jit(jax.value_and_grad(f))(x)
except ValueError as e:
    print("VALUEERROR", e)
    sys.exit(0)
want, want_grad = jax.value_and_grad(lambda x: jfl.kd_loss(
    x, ids, lp, temperature=t, reduction="sum", implementation="xla"))(x)
print("LOSS", float(loss), float(want))
print("GRADERR", float(jnp.abs(grad - want_grad).max()))
"""


@pytest.mark.parametrize("temperature", [2.0, 1e300])
def test_vocab_split_kd_matches_one_device(temperature, interpreter):
    """A correct vocab_axis passes the check; the vocabulary-parallel merge takes a temperature
    whose float32 reciprocal underflows (it divided by T: -inf / inf = NaN)."""
    out = _run(VOCAB_SPLIT, str(temperature), "1")
    got, want = (float(t) for t in out.split("LOSS")[1].split()[:2])
    assert abs(got - want) <= 1e-5 * abs(want) + 1e-6, (
        f"T={temperature}: vocabulary-split loss {got} != one-device loss {want}")
    err = float(out.split("GRADERR")[1].split()[0])
    assert err < 1e-6, f"T={temperature}: gradient max abs difference {err} from one device"


def test_vocab_axis_under_check_vma_false_is_an_error(interpreter):
    """check_vma=False: no varying axes to check, and the gradient came out divided by the
    vocabulary axis size (kd_loss, cross_entropy)."""
    out = _run(VOCAB_SPLIT, "2.0", "0")
    assert "VALUEERROR vocab_axis='model' needs jax.shard_map's check_vma=True" in out, out
