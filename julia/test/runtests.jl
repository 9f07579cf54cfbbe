# Tests of the kernels on Julia arrays against the closed form of the seed-000 function
# f(x, mu) = exp(-|x - mu|^2): gradient -2 d f, Hessian f (4 d d' - 2 I) with d = x - mu.
# Run with `julia --project=julia -e 'import Pkg; Pkg.test()'`; CuArray cases run where CUDA works.
using Test: @test, @testset
using PyHVP: grad_and_hvp!
import CUDA

gaussian(x, mu) = exp(-sum(abs2, x .- mu))

function closed_form(X, V, Mu)
    G, HV = similar(X), map(similar, V)
    for I in CartesianIndices(Base.tail(size(X)))
        J = CartesianIndex(map((i, s) -> s == 1 ? 1 : i, Tuple(I), Base.tail(size(Mu))))
        d = X[:, I] .- Mu[:, J]
        f = exp(-sum(abs2, d))
        G[:, I] .= -2 .* d .* f
        for (hv, v) in zip(HV, V)
            hv[:, I] .= f .* (4 .* d .* sum(d .* v[:, I]) .- 2 .* v[:, I])
        end
    end
    return G, HV
end

function run_kernel(to_device, X, V, Mu, dims)
    G, HV = to_device(zero(X)), map(v -> to_device(zero(v)), V)
    args = (to_device(Mu),)
    grad_and_hvp!(G, HV, gaussian, to_device(X), map(to_device, V), args, dims, (dims,))
    return Array(G), map(Array, HV)
end

devices = [("cpu", identity)]
CUDA.functional() && push!(devices, ("cuda", CUDA.CuArray))

@testset "grad_and_hvp! on $name, $T, k=$k, $dims" for (name, to_device) in devices,
    T in (Float32, Float64),
    k in (1, 3),
    dims in (Val((3,)), Val(()))

    # seed-000 layout in Julia order: x (d, n_a, n_b, n_g), mu (d, 1, 1, n_g); a scalar
    # event (`Val(())`, d = 1) gives each instance a number instead of a vector.
    d = dims === Val(()) ? 1 : 3
    X = randn(T, d, 4, 2, 5) ./ 2
    Mu = randn(T, d, 1, 1, 5) ./ 2
    V = ntuple(_ -> randn(T, size(X)), k)
    G, HV = run_kernel(to_device, X, V, Mu, dims)
    G_ref, HV_ref = closed_form(Float64.(X), map(v -> Float64.(v), V), Float64.(Mu))
    tol = T == Float32 ? 1e-4 : 1e-10
    @test isapprox(G, G_ref; rtol = tol, atol = tol)
    @test all(isapprox.(HV, HV_ref; rtol = tol, atol = tol))
end
