# Tests on Julia arrays against the closed form of the seed-000 function
# f(x, mu) = exp(-|x - mu|^2): gradient -2 d f, Hessian f (4 d d' - 2 I) with d = x - mu.
# Run with `julia --project=julia -e 'import Pkg; Pkg.test()'`; CuArray cases run where CUDA works.
using Test: @test, @testset
using PyHVP: grad_and_hvp!, instance_grad_and_hvp
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

FLOATS = (Float32, Float64)
tolerance(T) = T == Float32 ? 1e-4 : 1e-10

# Test bodies live in functions: fatou does not look inside the `@testset` macro calls.

"""One instance (3 variables, `k` tangents): `instance_grad_and_hvp` and the closed form."""
function one_instance(T, k)
    x, mu = Tuple(randn(T, 3) ./ 2), randn(T, 3) ./ 2
    v = ntuple(_ -> Tuple(randn(T, 3)), k)
    g, hv = instance_grad_and_hvp(z -> gaussian(collect(z), mu), x, v)
    column(t) = Float64.(reshape(collect(t), 3, 1))
    G, HV = closed_form(column(x), map(column, v), column(mu))
    return (collect(g), map(collect, hv)), (vec(G), map(vec, HV))
end

"""The seed-000 batch through `grad_and_hvp!` on one device, and the closed form."""
function seed000_batch(to_device, T, k, dims)
    # Julia order: x (d, n_a, n_b, n_g), mu (d, 1, 1, n_g); a scalar event (`Val(())`, d = 1)
    # gives each instance a number instead of a vector.
    d = dims === Val(()) ? 1 : 3
    X = randn(T, d, 4, 2, 5) ./ 2
    Mu = randn(T, d, 1, 1, 5) ./ 2
    V = ntuple(_ -> randn(T, size(X)), k)
    G, HV = to_device(zero(X)), map(v -> to_device(zero(v)), V)
    args = (to_device(Mu),)
    grad_and_hvp!(G, HV, gaussian, to_device(X), map(to_device, V), args, dims, (dims,))
    expected = closed_form(Float64.(X), map(v -> Float64.(v), V), Float64.(Mu))
    return (Array(G), map(Array, HV)), expected
end

@testset "instance_grad_and_hvp (one GPU thread's work) on the CPU, $T, k=$k" for T in FLOATS,
    k in (1, 3)

    (g, hv), (G, HV) = one_instance(T, k)
    @test isapprox(g, G; rtol = tolerance(T), atol = tolerance(T))
    @test all(isapprox.(hv, HV; rtol = tolerance(T), atol = tolerance(T)))
end

@testset "instance_grad_and_hvp of a function that ignores its argument is zero" begin
    g, hv = instance_grad_and_hvp(_ -> 1.0, (0.5, 2.0), ((1.0, 0.0),))
    @test g == (0.0, 0.0) && hv == ((0.0, 0.0),)
end

devices = [("cpu", identity)]
CUDA.functional() && push!(devices, ("cuda", CUDA.CuArray))

@testset "grad_and_hvp! on $name, $T, k=$k, $dims" for (name, to_device) in devices,
    T in FLOATS,
    k in (1, 3),
    dims in (Val((3,)), Val(()))

    (G, HV), (G_ref, HV_ref) = seed000_batch(to_device, T, k, dims)
    @test isapprox(G, G_ref; rtol = tolerance(T), atol = tolerance(T))
    @test all(isapprox.(HV, HV_ref; rtol = tolerance(T), atol = tolerance(T)))
end
