# The entry point pyhvp calls through juliacall: torch tensors lent through DLPack capsules,
# results written in place, every borrowed tensor handed back before the call returns.

"""
    borrow!(loans, (capsule, shape))

The torch tensor behind `capsule` (made by `tensor.__dlpack__()` in Python) as a Julia array
of `shape` over the same memory; what must be handed back is pushed to `loans`.

The shape comes from Python, never from DLPack.jl's guess: DLPack.jl reverses the dims only
when the strides do not read as column-major, and torch 2.4-2.8 export every size-1 dim with
stride 1, so a C-contiguous `(1, 3)` reads as column-major and comes back unreversed. A
C-contiguous tensor and the column-major array of the reversed shape have the same linear
order, so `reshape` is right whichever way DLPack.jl guessed; it copies nothing, and an
`Array` stays an `Array`, a `CuArray` a `CuArray`.
"""
function borrow!(loans::Vector{Any}, lent::Tuple)
    capsule, shape = lent
    manager = DLPack.DLManagedTensor(capsule)
    push!(loans, manager)
    wrapper = DLPack.unsafe_wrap(manager, capsule)
    push!(loans, wrapper)
    return reshape(wrapper, Tuple(shape))
end

"""
    release!(loans)

Hand every borrowed tensor back to torch now rather than whenever Julia's GC next runs (it is
driven by Julia's own allocations, which are tiny here): `finalize` runs DLPack.jl's
finalizers at once, the wrapper's (it leaves `DLPack.WRAPS_POOL`) and the manager's (it calls
torch's deleter, which drops the tensor reference the capsule held).
"""
release!(loans::Vector{Any}) = foreach(finalize, loans)

from_python(a::Real, ::Type{T}, ::Vector{Any}) where {T} = convert(T, a)
from_python(lent::Tuple, ::Type, loans::Vector{Any}) = borrow!(loans, lent)

"""Run `body` with CUDA device `index` current (torch's `cuda:index`); `nothing` for the CPU."""
on_device(body, ::Nothing) = body()
on_device(body, index::Integer) = device!(body, index)

"""
    grad_and_hvp_dlpack!(g, hvs, f, x, vs, args, xdims, argdims, device)

`grad_and_hvp!` on torch tensors. `g`, `x` and the tuples `hvs`, `vs` hold `(capsule, shape)`
pairs of C-contiguous tensors of torch shape `(batch..., n)`, whose Julia shape is
`(n, batch...)`; `args` hold such pairs or Python numbers (converted to `x`'s element type);
`xdims`, `argdims` are the reversed event shapes; `device` is the CUDA device index of the
tensors, or `nothing` on the CPU.
"""
function grad_and_hvp_dlpack!(g, hvs, f, x, vs, args, xdims, argdims, device)
    loans = Any[]
    try
        on_device(device) do
            X = borrow!(loans, x)
            grad_and_hvp!(
                borrow!(loans, g),
                map(t -> borrow!(loans, t), Tuple(hvs)),
                f,
                X,
                map(t -> borrow!(loans, t), Tuple(vs)),
                map(a -> from_python(a, eltype(X), loans), Tuple(args)),
                Val(Tuple(xdims)),
                map(d -> Val(Tuple(d)), Tuple(argdims)),
            )
        end
    finally
        release!(loans)
    end
    return nothing
end
