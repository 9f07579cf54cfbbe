# CPU arrays: Enzyme forward-over-reverse of the sum over instances.

"""
    SumOverInstances(f, args, xdims, argdims)

`X -> sum over instances I of f(x_I, args_I...)`: the function whose gradient is every
instance's own gradient and whose Hessian is block-diagonal (instances are independent).
"""
struct SumOverInstances{F,A,D,E}
    f::F
    args::A
    xdims::D
    argdims::E
end

function (s::SumOverInstances)(X::AbstractArray)
    total = zero(eltype(X))
    for I in CartesianIndices(Base.tail(size(X)))
        x = instance_view(X, I, s.xdims)
        a = map((arg, d) -> instance_view(arg, I, d), s.args, s.argdims)
        total += oftype(total, s.f(x, a...))
    end
    return total
end

"""
    tangents(x, v)

Enzyme's annotation of `x` with the tangents `v` (a tuple): `Duplicated` for one tangent,
`BatchDuplicated` for more. Enzyme's own sugar (`gradient(Forward, ...; chunk = Val(1))`)
also uses `Duplicated` rather than a width-1 batch.
"""
tangents(x, v::NTuple{1}) = Duplicated(x, v[1])
tangents(x, v::Tuple) = BatchDuplicated(x, v)

"""
    grad_and_hvp!(G, HV, f, X, V, args, xdims, argdims)

Write every instance's gradient into `G` and its Hessian times `V[j]` into `HV[j]` for the
`K = length(V)` tangents, in one forward-over-reverse pass (`X`, `G` and every `V[j]`, `HV[j]`
share one layout `(n, batch...)`). `K` is a compile-time batch width: keep it small (pyhvp
sends at most 8 at a time).
"""
function grad_and_hvp!(
    G::Array{T,N},
    HV::NTuple{K,Array{T,N}},
    f,
    X::Array{T,N},
    V::NTuple{K,Array{T,N}},
    args::Tuple,
    xdims::Val,
    argdims::Tuple,
) where {T,N,K}
    total = SumOverInstances(f, args, xdims, argdims)
    # Enzyme's hvp_and_gradient!, with K tangents: forward mode through a reverse gradient.
    # `gradient!` starts with `make_zero!(G)`, whose forward derivative zeroes every `HV[j]`
    # too, so the outputs may come in uninitialized (Enzyme's `hvp!` docs pass `undef` arrays).
    autodiff(Forward, gradient!, Const(Reverse), tangents(G, HV), Const(total), tangents(X, V))
    return nothing
end
