# CuArrays: one thread per instance, each differentiating its own small function in registers.
# (Enzyme over whole-array CuArray broadcasts is known to abort; code inside a kernel is the
# supported path.)

"""Gradient of `f(x, args...)` with respect to the register value `x`: reverse mode."""
@inline function instance_gradient(x, f, args::Tuple)
    return autodiff_deferred(Reverse, Const(f), Active, Active(x), map(Const, args)...)[1][1]
end

# ForwardWithPrimal returns (derivative, primal); with one tangent (`Duplicated`) the
# derivative is the tangent itself, with K (`BatchDuplicated`) an indexable K-tuple.
@inline tangent_batch(dg, ::Val{1}) = (dg,)
@inline tangent_batch(dg, ::Val) = dg

function grad_and_hvp_kernel!(G, HV::NTuple{K}, f, X, V::NTuple{K}, args, xdims, argdims) where {K}
    b = (blockIdx().x - 1) * blockDim().x + threadIdx().x
    instances = CartesianIndices(Base.tail(size(X)))
    b > length(instances) && return nothing
    I = instances[b]
    x = instance_load(X, I, xdims)
    v = map(t -> instance_load(t, I, xdims), V)
    a = map((arg, d) -> instance_load(arg, I, d), args, argdims)
    dg, g = autodiff_deferred(
        ForwardWithPrimal,
        Const(instance_gradient),
        Duplicated,
        tangents(x, v),
        Const(f),
        Const(a),
    )
    instance_store!(G, I, g)
    hv = tangent_batch(dg, Val(K))
    for j in 1:K
        instance_store!(HV[j], I, hv[j])
    end
    return nothing
end

function grad_and_hvp!(
    G::CuArray{T,N},
    HV::NTuple{K,CuArray{T,N}},
    f,
    X::CuArray{T,N},
    V::NTuple{K,CuArray{T,N}},
    args::Tuple,
    xdims::Val,
    argdims::Tuple,
) where {T,N,K}
    n = n_instances(X)
    n == 0 && return nothing
    kernel = @cuda launch = false grad_and_hvp_kernel!(G, HV, f, X, V, args, xdims, argdims)
    config = launch_configuration(kernel.fun)
    threads = min(n, config.threads)
    blocks = cld(n, threads)
    kernel(G, HV, f, X, V, args, xdims, argdims; threads, blocks)
    synchronize()
    return nothing
end
