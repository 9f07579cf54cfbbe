# CuArrays: one GPU thread per instance, each differentiating its own small function in
# registers with nested ForwardDiff duals (`instance_grad_and_hvp`). Device code holds no
# Enzyme call: Enzyme's nested deferred AD cannot compile inside a kernel (GPUCompiler.jl#629,
# Enzyme.jl#2189). Every construct used here is listed in julia/README.md with the upstream
# GPU test that runs it.

function grad_and_hvp_kernel!(
    G,
    HV::NTuple{K},
    f,
    X,
    V::NTuple{K},
    args,
    instances,
    xdims,
    argdims,
) where {K}
    b = (blockIdx().x - 1) * blockDim().x + threadIdx().x
    b > length(instances) && return nothing
    I = instances[b]
    a = map((arg, d) -> instance_load(arg, I, d), args, argdims)
    g, hv = instance_grad_and_hvp(
        z -> f(static_shape(z, xdims), a...),
        instance_values(X, I, xdims),
        ntuple(j -> instance_values(V[j], I, xdims), Val(K)),
    )
    instance_store!(G, I, g)
    for j in 1:K
        instance_store!(HV[j], I, hv[j])
    end
    return nothing
end

"""
    grad_and_hvp!(G, HV, f, X, V, args, xdims, argdims)

The `CuArray` method: one thread per instance (see `grad_and_hvp!` on `Array`s for the
arguments), launched with the occupancy API's block size; returns after the kernel finished.
"""
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
    # Built on the host and indexed by the thread, as CUDA.jl's own mapreduce kernels do.
    instances = CartesianIndices(Base.tail(size(X)))
    isempty(instances) && return nothing
    kernel = @cuda launch = false grad_and_hvp_kernel!(
        G, HV, f, X, V, args, instances, xdims, argdims
    )
    config = launch_configuration(kernel.fun)
    threads = min(length(instances), config.threads)
    blocks = cld(length(instances), threads)
    kernel(G, HV, f, X, V, args, instances, xdims, argdims; threads, blocks)
    synchronize()
    return nothing
end
