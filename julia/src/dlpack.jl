# The entry point pyhvp calls through juliacall: torch tensors in, results written in place.

from_python(a::Real, ::Type{T}) where {T} = convert(T, a)
from_python(a, ::Type) = DLPack.from_dlpack(a)

"""
    grad_and_hvp_dlpack!(g, hvs, f, x, vs, args, xdims, argdims)

`grad_and_hvp!` on torch tensors: `g`, `x` and the tuples `hvs`, `vs` are C-contiguous torch
tensors of one shape `(batch..., n)`, wrapped without copies by `DLPack.from_dlpack` (their
dims come out reversed: `(n, batch...)`); `args` are tensors `(abatch..., n_a)` or Python
numbers (converted to `x`'s element type); `xdims`, `argdims` are the reversed event shapes.
"""
function grad_and_hvp_dlpack!(g, hvs, f, x, vs, args, xdims, argdims)
    X = DLPack.from_dlpack(x)
    # Nothing to write; and DLPack.jl leaves an empty tensor's dims unreversed.
    isempty(X) && return nothing
    T = eltype(X)
    grad_and_hvp!(
        DLPack.from_dlpack(g),
        map(DLPack.from_dlpack, Tuple(hvs)),
        f,
        X,
        map(DLPack.from_dlpack, Tuple(vs)),
        map(a -> from_python(a, T), Tuple(args)),
        Val(Tuple(xdims)),
        map(d -> Val(Tuple(d)), Tuple(argdims)),
    )
    return nothing
end
