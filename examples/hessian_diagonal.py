"""
Hessian diagonals, exact and estimated
======================================

Seed 001: the diagonal of the input Hessian of a vector-valued function, batched.

The seed tried ``jvp(jacrev(f), (x,), (ones,))``: that is ``H_k @ ones`` -- each output's Hessian
times a vector of ones, i.e. the row sums of H_k -- not its diagonal (no single vector v gives
``diag(H) = H v``). pyhvp pushes one basis direction e_i per pass through every instance at once
(forward-over-forward), N passes in all, never building the [B, M, N, N] Hessian.

For a scalar function with many variables, the estimators need fewer Hessian-vector products
than N: the last part draws the error of Hutchinson's and Diag++'s estimates against the number
of samples, and checks that Hutchinson's error falls as samples grow and that Diag++ is exact
once samples >= 3 N.
Run: ``python examples/hessian_diagonal.py``.
"""

import matplotlib.pyplot as plt
import torch
from torch.func import hessian, jacrev, jvp, vmap

import pyhvp

# --- the seed's code ------------------------------------------------------------------------

torch.manual_seed(0)
x_single = torch.tensor([1.0, 2.0, 3.0], requires_grad=False)
x_batch = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], requires_grad=False)
layer = torch.nn.Linear(3, 5).requires_grad_(False)


def hvp_vecfwd(f, x, v):
    """The seed's attempt: the Jacobian's directional derivative along v = H_k v for every k."""
    return jvp(jacrev(f), (x,), (v,))[1]


def f_batch_scalar(x):
    return torch.sum(x * x, dim=-1)


def f_single_vector(x):
    return torch.sigmoid(layer(x))


def f_batch_vector(x):
    return torch.sigmoid(layer(x))


# --- the seed's attempt, pyhvp, and the dense check side by side ----------------------------


def compare(title, wrong, ours, dense):
    """Print, per row, the seed's N numbers | pyhvp's N numbers | the dense N numbers."""
    print(f"\n{title}\n  columns: seed's jvp(jacrev) with ones (H @ 1) | pyhvp | dense diagonal")
    torch.set_printoptions(precision=3, linewidth=120)
    print(torch.cat([wrong, ours, dense], dim=-1))
    torch.set_printoptions(profile="default")
    torch.testing.assert_close(ours, dense)
    print(f"  pyhvp == dense: True;  seed's attempt == dense: {torch.allclose(wrong, dense)}")


compare(
    "Batched scalar f: [B, N] -> [B], diag H = [B, N] (H = 2 I is diagonal: H @ 1 happens to fit)",
    vmap(lambda x: jvp(torch.func.grad(f_batch_scalar), (x,), (torch.ones_like(x),))[1])(x_batch),
    pyhvp.hessian_diagonal(f_batch_scalar, x_batch),
    vmap(hessian(f_batch_scalar))(x_batch).diagonal(dim1=-2, dim2=-1),
)
compare(
    "Unbatched vector f: [N] -> [M], diag H = [M, N]",
    hvp_vecfwd(f_single_vector, x_single, torch.ones_like(x_single)),
    pyhvp.hessian_diagonal(f_single_vector, x_single),
    hessian(f_single_vector)(x_single).diagonal(dim1=-2, dim2=-1),
)
compare(
    "Batched vector f: [B, N] -> [B, M], diag H = [B, M, N]",
    vmap(hvp_vecfwd, in_dims=(None, 0, 0))(f_batch_vector, x_batch, torch.ones_like(x_batch)),
    pyhvp.hessian_diagonal(f_batch_vector, x_batch),
    vmap(hessian(f_batch_vector))(x_batch).diagonal(dim1=-2, dim2=-1),
)


# --- estimators: error against samples --------------------------------------------------------
# A scalar tanh network of N = 16 variables, 256 instances. Error: the root mean square of the
# estimate's error relative to that of the exact diagonal, over all instances and variables.

n_vars, width = 16, 32
w1, w2 = torch.randn(width, n_vars) / n_vars**0.5, torch.randn(width) / width**0.5


def f_scalar(x):
    return torch.tanh(x @ w1.T) @ w2


x_many = torch.randn(256, n_vars)
exact = pyhvp.hessian_diagonal(f_scalar, x_many)
torch.testing.assert_close(exact, vmap(hessian(f_scalar))(x_many).diagonal(dim1=-2, dim2=-1))
sample_counts = [3, 6, 12, 24, 48, 96, 192]
errors = {}
for method in ("hutchinson", "diag++"):
    errors[method] = []
    for samples in sample_counts:
        estimate = pyhvp.hessian_diagonal(
            f_scalar, x_many, method=method, samples=samples,
            generator=torch.Generator().manual_seed(samples),
        )  # fmt: skip
        error = ((estimate - exact).pow(2).mean() / exact.pow(2).mean()).sqrt().item()
        errors[method].append(error)
print("\nsamples    " + " ".join(f"{s:>8d}" for s in sample_counts))
for method, row in errors.items():
    print(f"{method:10} " + " ".join(f"{e:8.2e}" for e in row))

_, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
for method, row in errors.items():
    ax.loglog(sample_counts, [max(e, 1e-8) for e in row], "o-", label=method)
ax.loglog(sample_counts, [errors["hutchinson"][0] * (3 / s) ** 0.5 for s in sample_counts], "k:",
          label="1 / sqrt(samples)")  # fmt: skip
ax.axvline(3 * n_vars, color="grey", lw=0.8)
ax.set(xlabel="samples (Hessian-vector products per instance)",
       ylabel="relative RMS error of the diagonal",
       title=f"Estimated Hessian diagonals, N = {n_vars} variables")  # fmt: skip
ax.legend()
plt.show()

hutchinson = errors["hutchinson"]
if not hutchinson[-1] < hutchinson[0] / 3:
    raise SystemExit(f"Hutchinson's error did not fall with samples: {hutchinson}")
if not max(errors["diag++"][sample_counts.index(3 * n_vars) :]) < 1e-4:
    raise SystemExit(f"Diag++ is not exact at samples >= 3 N: {errors['diag++']}")
