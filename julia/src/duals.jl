# One instance's gradient and Hessian-vector products by nested ForwardDiff duals: what each
# GPU thread computes. Plain Julia on tuples, so the Julia tests run it on the CPU as well.
#
# The tags are our own singletons and the seeding and extraction are written out (as
# WaterLily.jl does for its GPU kernels) rather than going through `ForwardDiff.gradient`:
# ForwardDiff's extraction compares `Tag` precedence through `tagcount`, a `@generated`
# counter whose order GPU codegen can invert (WaterLily.jl PR #284). Here no operation ever
# mixes the two tags -- every tangent dual sits inside a gradient dual -- so no precedence is
# ever asked for.

"""Tag of the outer duals: their `K` partials carry the tangents `v[1], ..., v[K]`."""
struct TangentTag end

"""Tag of the inner duals: their `N` partials carry the gradient directions `e_1, ..., e_N`."""
struct GradientTag end

"""
    instance_grad_and_hvp(h, x, v) -> (g, hv)

Gradient `g` of the scalar function `h` at `x` (an `N`-tuple) and its Hessian times each of
the `K` tangents `v[j]` (`N`-tuples; `hv[j]` is `H v[j]`), from one evaluation of `h` on
nested duals: `x[i]` is seeded with the tangents (outer duals) and with `e_i` (inner duals),
so the inner partials of `h(x)` are `g` and their outer partials are `H v[j]` -- forward over
forward, `(N + 1)(K + 1)` numbers per operation. An `h` that ignores its argument gives zeros.
"""
function instance_grad_and_hvp(h, x::NTuple{N,T}, v::NTuple{K,NTuple{N,T}}) where {N,K,T}
    seeded = ntuple(Val(N)) do i
        xi = Dual{TangentTag}(x[i], ntuple(j -> v[j][i], Val(K)))
        Dual{GradientTag}(xi, ntuple(l -> l == i ? one(xi) : zero(xi), Val(N)))
    end
    y = h(seeded)
    dy = ntuple(i -> gradient_partial(y, i), Val(N))
    return map(value, dy), ntuple(j -> map(d -> partials(d, j), dy), Val(K))
end

gradient_partial(y::Dual{GradientTag}, i) = partials(y, i)
gradient_partial(y::Real, _) = zero(y)
