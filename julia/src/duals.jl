# One instance's gradient and Hessian-vector products by nested ForwardDiff duals: what each
# GPU thread computes. Plain Julia on tuples, so the Julia tests run it on the CPU as well.
#
# The tags are our own singletons and the seeding and extraction are written out (as
# WaterLily.jl does for its GPU kernels) rather than going through `ForwardDiff.gradient`:
# ForwardDiff's extraction compares `Tag` precedence through `tagcount`, a `@generated`
# counter whose order GPU codegen can invert (WaterLily.jl PR #284). Our tags' precedence is
# defined below by methods on types instead, so it is settled at compile time.
#
# Device code: every tuple here has a length that is a type parameter (`N` variables, `K`
# tangents), so it is built and read with `ntuple(i -> ..., Val(N))`, never `map` or a splat:
# Base's `map` over 32 or more elements (`Any32`) collects into a `Vector{Any}` and splats it,
# a heap allocation and a dynamic call that device code cannot compile.
# `tests/test_julia_static.py` enforces this.

"""Tag of the outer duals: their `K` partials carry the tangents `v[1], ..., v[K]`."""
struct TangentTag end

"""Tag of the inner duals: their `N` partials carry the gradient directions `e_1, ..., e_N`."""
struct GradientTag end

# Precedence (`ForwardDiff.:≺(a, b)`: true when `Dual{b}` sits outside `Dual{a}`), asked when
# an operation mixes two tags. Tangent duals sit inside gradient duals; a derivative that the
# user's function takes itself (`ForwardDiff.derivative` inside `f`) is taken inside ours, so
# its duals go outside both: TangentTag ≺ GradientTag ≺ every `ForwardDiff.Tag`. WaterLily.jl
# v1.8.0 `src/core.jl:253-255` defines its `_InnerTag` the same way; its tag is the inner call
# there and ranks after every `Tag`, ours are the outer calls and rank before.
ForwardDiff.:≺(::Type{TangentTag}, ::Type{GradientTag}) = true
ForwardDiff.:≺(::Type{GradientTag}, ::Type{TangentTag}) = false
ForwardDiff.:≺(::Type{TangentTag}, ::Type{TangentTag}) = false
ForwardDiff.:≺(::Type{GradientTag}, ::Type{GradientTag}) = false
ForwardDiff.:≺(::Type{<:Union{TangentTag,GradientTag}}, ::Type{<:Tag}) = true
ForwardDiff.:≺(::Type{<:Tag}, ::Type{<:Union{TangentTag,GradientTag}}) = false

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
    g = ntuple(i -> value(dy[i]), Val(N))
    hv = ntuple(j -> ntuple(i -> partials(dy[i], j), Val(N)), Val(K))
    return g, hv
end

gradient_partial(y::Dual{GradientTag}, i) = partials(y, i)
gradient_partial(y::Real, _) = zero(y)
