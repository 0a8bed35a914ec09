"""The tests' oracles: naive formulas in plain JAX (`jax_ref`) and plain PyTorch
(`torch_oracle`), apart from the frontends they check. Each materialises the full softmax at the
dtype it is given (float64 in the tests); reference gradients come only from autodiff of these
formulas (`jax.vjp`, `torch.autograd`)."""
