# Picking one instance's values out of the batched layout (see the module docstring).

"""
    shared_index(A, I)

The batch index in `A` of instance `I` (a `CartesianIndex` over `X`'s batch dims): dims of
size 1 in `A` are shared by every instance, so they are indexed at 1.
"""
@inline function shared_index(A::AbstractArray, I::CartesianIndex)
    return CartesianIndex(map((i, s) -> s == 1 ? 1 : i, Tuple(I), Base.tail(size(A))))
end

"""
    instance_view(A, I, Val(dims))

Instance `I` of `A` as a view with the event shape `dims` (`()` gives the scalar); numbers are
shared by all instances. Used on the CPU, where the view is differentiated in place.
"""
@inline instance_view(A::AbstractArray, I::CartesianIndex, d::Val) =
    event_shape(view(A, :, shared_index(A, I)), d)
@inline instance_view(a::Number, ::CartesianIndex, ::Val) = a

@inline event_shape(column::AbstractVector, ::Val{()}) = column[1]
@inline event_shape(column::AbstractVector, ::Val{D}) where {D} = reshape(column, D)

"""
    instance_load(A, I, Val(dims))

Instance `I` of `A` copied into registers: an `SArray` of the event shape `dims` (`()` gives
the scalar). Used inside GPU kernels, where nothing may be heap-allocated.
"""
@inline function instance_load(A::AbstractArray{T}, I::CartesianIndex, ::Val{D}) where {T,D}
    J = shared_index(A, I)
    values = ntuple(i -> A[i, J], Val(prod(D)))
    return static_shape(values, Val(D))
end
@inline instance_load(a::Number, ::CartesianIndex, ::Val) = a

# `NTuple{1}` (not `Tuple`) so that this method is more specific than the next one in both
# arguments; with `::Tuple` a scalar event (`Val(())`) was an ambiguous call.
@inline static_shape(values::NTuple{1}, ::Val{()}) = values[1]
@inline static_shape(values::NTuple{L,T}, ::Val{D}) where {L,T,D} =
    SArray{Tuple{D...},T,length(D),L}(values)

"""
    instance_store!(A, I, value)

Write one instance's result (an `SArray` or, for a scalar event, a number) into column `I`.
"""
@inline function instance_store!(A::AbstractArray, I::CartesianIndex, value::SArray)
    for i in eachindex(value)
        A[i, I] = value[i]
    end
    return nothing
end
@inline function instance_store!(A::AbstractArray, I::CartesianIndex, value::Number)
    A[1, I] = value
    return nothing
end

"""Number of instances of the batched layout `X` (`(n, batch...)`)."""
n_instances(X::AbstractArray) = prod(Base.tail(size(X)))

"""
    tangents(x, v)

Enzyme's annotation of `x` with the tangents `v` (a tuple): `Duplicated` for one tangent,
`BatchDuplicated` for more. Enzyme's own sugar (`gradient(Forward, ...; chunk = Val(1))`)
also uses `Duplicated` rather than a width-1 batch.
"""
@inline tangents(x, v::NTuple{1}) = Duplicated(x, v[1])
@inline tangents(x, v::Tuple) = BatchDuplicated(x, v)
