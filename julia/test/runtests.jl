# Tests on Julia arrays against the closed form of the seed-000 function
# f(x, mu) = exp(-|x - mu|^2): gradient -2 d f, Hessian f (4 d d' - 2 I) with d = x - mu.
# Run with `julia --project=julia -e 'import Pkg; Pkg.test()'`; CuArray cases run where CUDA works.
using Test: @test, @test_throws, @testset
using PyHVP: grad_and_hvp!, instance_grad_and_hvp
using ForwardDiff: derivative
import CUDA

gaussian(x, mu) = exp(-sum(abs2, x .- mu))

# The same function through a derivative the user takes with ForwardDiff itself: d/dt of
# t^2/2 * gaussian at t = 1. Its `Dual{Tag}` meets our duals in `*`, so ForwardDiff asks the
# tags' precedence (without PyHVP's `≺` methods: `DualMismatchError`).
nested_gaussian(x, mu) = derivative(t -> t^2 / 2 * gaussian(x, mu), one(eltype(mu)))

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

"""One instance (`n` variables, `k` tangents): `instance_grad_and_hvp` of `f` (the
Gaussian, or `nested_gaussian`) and the Gaussian's closed form."""
function one_instance(T, k, n, f)
    scale = T(2 * sqrt(n))  # |x - mu|^2 of order 1 whatever n; T keeps the element type
    x, mu = Tuple(randn(T, n) ./ scale), randn(T, n) ./ scale
    v = ntuple(_ -> Tuple(randn(T, n)), k)
    g, hv = instance_grad_and_hvp(z -> f(collect(z), mu), x, v)
    column(t) = Float64.(reshape(collect(t), n, 1))
    G, HV = closed_form(column(x), map(column, v), column(mu))
    return (collect(g), map(collect, hv)), (vec(G), map(vec, HV))
end

event_length(::Val{D}) where {D} = prod(D)

"""The seed-000 batch through `grad_and_hvp!` on one device, and the closed form."""
function seed000_batch(to_device, T, k, dims, f = gaussian)
    # Julia order: x (d, n_a, n_b, n_g), mu (d, 1, 1, n_g); a scalar event (`Val(())`, d = 1)
    # gives each instance a number instead of a vector; `Val((32,))` gives 32 variables.
    d = event_length(dims)
    scale = T(2 * sqrt(d))
    X = randn(T, d, 4, 2, 5) ./ scale
    Mu = randn(T, d, 1, 1, 5) ./ scale
    V = ntuple(_ -> randn(T, size(X)), k)
    G, HV = to_device(zero(X)), map(v -> to_device(zero(v)), V)
    args = (to_device(Mu),)
    grad_and_hvp!(G, HV, f, to_device(X), map(to_device, V), args, dims, (dims,))
    expected = closed_form(Float64.(X), map(v -> Float64.(v), V), Float64.(Mu))
    return (Array(G), map(Array, HV)), expected
end

"""A user function that reads past its 3 variables, on CUDA: the kernel's bounds error."""
function out_of_bounds_on_cuda()
    X, Mu = CUDA.CuArray(randn(Float32, 3, 4)), CUDA.CuArray(randn(Float32, 3, 1))
    V = (CUDA.CuArray(randn(Float32, 3, 4)),)
    reads_x4(x, mu) = x[4] * sum(mu)
    grad_and_hvp!(similar(X), map(similar, V), reads_x4, X, V, (Mu,), Val((3,)), (Val((3,)),))
    return nothing
end

# 32 variables: from 32 elements on, Base's `map` over a tuple goes through `Vector{Any}`
# (`Any32`), which device code cannot compile; `instance_grad_and_hvp` builds every tuple
# with `ntuple` (its CUDA run is the `grad_and_hvp!` testset below with `Val((32,))`).
@testset "instance_grad_and_hvp (one GPU thread's work) on the CPU, $T, k=$k, n=$n, $f" for T in FLOATS,
    k in (1, 3),
    n in (3, 32),
    f in (gaussian, nested_gaussian)

    (g, hv), (G, HV) = one_instance(T, k, n, f)
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
    dims in (Val((3,)), Val(()), Val((32,)))

    (G, HV), (G_ref, HV_ref) = seed000_batch(to_device, T, k, dims)
    @test isapprox(G, G_ref; rtol = tolerance(T), atol = tolerance(T))
    @test all(isapprox.(HV, HV_ref; rtol = tolerance(T), atol = tolerance(T)))
end

if CUDA.functional()
    # The tags' precedence matters on the dual path only (CUDA); the CPU path is Enzyme's.
    @testset "a user function nesting ForwardDiff.derivative, on cuda, $T" for T in FLOATS
        (G, HV), (G_ref, HV_ref) = seed000_batch(CUDA.CuArray, T, 3, Val((3,)), nested_gaussian)
        @test isapprox(G, G_ref; rtol = tolerance(T), atol = tolerance(T))
        @test all(isapprox.(HV, HV_ref; rtol = tolerance(T), atol = tolerance(T)))
    end

    # CUDA.jl's `signal_exception` (src/device/runtime.jl:189-206) sets a flag and exits the
    # kernel; `synchronize()` finds the flag and throws `KernelException`. The context stays
    # usable: the next call on it still gives the right answer.
    @testset "a bounds error in the user function on cuda, then a call" begin
        @test_throws CUDA.KernelException out_of_bounds_on_cuda()
        (G, HV), (G_ref, HV_ref) = seed000_batch(CUDA.CuArray, Float32, 1, Val((3,)))
        @test isapprox(G, G_ref; rtol = 1e-4, atol = 1e-4)
        @test all(isapprox.(HV, HV_ref; rtol = 1e-4, atol = 1e-4))
    end
end
