# Picking one instance's values out of the batched layout (see the module docstring).

"""
    shared_index(A, I)

The batch index in `A` of instance `I` (a `CartesianIndex` over `X`'s batch dims): dims of
size 1 in `A` are shared by every instance, so they are indexed at 1.
"""
function shared_index(A::AbstractArray, I::CartesianIndex)
    return CartesianIndex(map((i, s) -> s == 1 ? 1 : i, Tuple(I), Base.tail(size(A))))
end

"""
    instance_view(A, I, Val(dims))

Instance `I` of `A` as a view with the event shape `dims` (`()` gives the scalar); numbers are
shared by all instances. Used on the CPU, where Enzyme differentiates the view in place.
"""
instance_view(A::AbstractArray, I::CartesianIndex, d::Val) =
    event_shape(view(A, :, shared_index(A, I)), d)
instance_view(a::Number, ::CartesianIndex, ::Val) = a

event_shape(column::AbstractVector, ::Val{()}) = column[1]
event_shape(column::AbstractVector, ::Val{D}) where {D} = reshape(column, D)

"""
    instance_values(A, I, Val(dims))

The `prod(dims)` values of instance `I` of `A` as a tuple (registers, in a GPU kernel).
"""
function instance_values(A::AbstractArray, I::CartesianIndex, ::Val{D}) where {D}
    J = shared_index(A, I)
    return ntuple(i -> A[i, J], Val(prod(D)))
end

"""
    instance_load(A, I, Val(dims))

Instance `I` of `A` as the value the user function sees in a GPU kernel: an `SArray` of the
event shape `dims`, or the number itself for `dims == ()`; numbers are shared by all instances.
"""
instance_load(A::AbstractArray, I::CartesianIndex, d::Val) =
    static_shape(instance_values(A, I, d), d)
instance_load(a::Number, ::CartesianIndex, ::Val) = a

# `NTuple{1}` (not `Tuple`) so that this method is more specific than the next one in both
# arguments; with `::Tuple` a scalar event (`Val(())`) was an ambiguous call.
static_shape(values::NTuple{1}, ::Val{()}) = values[1]
static_shape(values::NTuple{L,T}, ::Val{D}) where {L,T,D} =
    SArray{Tuple{D...},T,length(D),L}(values)

"""
    instance_store!(A, I, values)

Write one instance's values (a tuple, in `A`'s first-dim order) into column `I` of `A`.
"""
function instance_store!(A::AbstractArray, I::CartesianIndex, values::Tuple)
    for i in eachindex(values)
        A[i, I] = values[i]
    end
    return nothing
end
