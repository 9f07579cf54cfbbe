"""
    PyHVP

The Julia side of pyhvp's `backend="julia"`: per-instance gradients and Hessian-vector products
of a batch of independent instances, written in place into arrays that torch allocated.

Layout (torch's row-major dims reversed, in Julia's column-major order): `X` is
`(n, batch...)` -- column `X[:, I]` is instance `I`; every tangent and output has `X`'s shape;
an argument `A` is `(n_a, abatch...)` where each `abatch` dim is 1 (shared by all instances
along that dim) or equals the batch dim. `xdims`/`argdims` are `Val`s of the event shapes
(already reversed) that the user function sees: `()` for a scalar, `(n,)` for a vector.

- `Array`s: Enzyme forward-over-reverse of the sum over instances (the Hessian of the sum is
  block-diagonal, so this is every instance's own HVP), `BatchDuplicated` for the k tangents.
- `CuArray`s: one GPU thread per instance evaluates its function once on nested ForwardDiff
  duals held in registers (forward over forward); no Enzyme in device code.

pyhvp loads this file with `include` (julia/README.md says why); `Pkg.test()` uses it as the
package of `julia/Project.toml`.
"""
module PyHVP

import DLPack
using CUDA:
    CUDA,
    @cuda,
    CuArray,
    blockDim,
    blockIdx,
    device!,
    launch_configuration,
    synchronize,
    threadIdx
using Enzyme: Enzyme, BatchDuplicated, Const, Duplicated, Forward, Reverse, autodiff, gradient!
using ForwardDiff: ForwardDiff, Dual, Tag, partials, value
using StaticArrays: SArray

export grad_and_hvp!, grad_and_hvp_dlpack!, instance_grad_and_hvp, versions

include("instances.jl")
include("cpu.jl")
include("duals.jl")
include("gpu.jl")
include("dlpack.jl")
include("versions.jl")

end # module PyHVP
